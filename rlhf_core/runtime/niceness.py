"""Ray workers at the priority of the process that runs the stage, not Ray's niceness 15.

Ray starts every worker process at niceness 15 (its `worker_niceness` system config, `RAY_worker_niceness`: the
core worker calls nice() on its main thread at start; the driver stays where it is). On a node where anything else
runs, the roles and engines a stage starts then get a core only when no process at a lower niceness wants it: the
ppo stage beside one busy loop took 4-5x longer per step than with the workers at 0 (ENV-NOTES), while a peer that
trains in one process (TRL) runs at its launcher's niceness. So every Ray actor a stage starts runs at the niceness
of the stage's process:

- a local Ray the stage starts itself (`rollout.generation._ray_up`): `worker_niceness` in its system config, so
  every worker, the tasks and actors that others start inside it included (vLLM's TP workers), stays at the
  raylet's niceness, which it inherits from the stage's process;
- each actor on any cluster, one joined by address included (`at_launcher_priority`, `actor_env`): the variable
  `RAY_worker_niceness=0` in its runtime_env (Ray reads its config from RAY_* variables in the worker too, so the
  worker does not lower its own priority; tasks and actors it starts inherit the variable) and, first thing in its
  constructor, every thread of its process set to the target niceness (a node's raylet may run at another niceness
  than the stage). Raising a niceness is always allowed; lowering it needs CAP_SYS_NICE or an RLIMIT_NICE, and when
  the OS refuses, one warning in the actor's log (which Ray forwards to the driver) says at what niceness it runs,
  why, and what to change.

The same processes' OpenMP threads wait at a barrier briefly before they sleep (`omp_env`: GOMP_SPINCOUNT=1000 unless
the user set it or OMP_WAIT_POLICY), so a thread that lost its core to another process is not kept from it by its
siblings' spinning (measured below SPIN).

Setting, read in the stage's process (a Ray Job's driver, the value its submitter resolved: `job_env`):

    RLHF_FLOWS_RAY_NICENESS=driver   (default) the niceness of the stage's process
    RLHF_FLOWS_RAY_NICENESS=ray      Ray's own behaviour (RAY_worker_niceness, else 15); nothing here changes it
    RLHF_FLOWS_RAY_NICENESS=N        this niceness (-20..19); below the stage's own needs the privileges above
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("rlhf_flows")

ENV = "RLHF_FLOWS_RAY_NICENESS"


def own() -> int:
    """This thread's niceness."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def target() -> int | None:
    """The niceness the stage's Ray workers run at, None for Ray's own behaviour; a value that is none of driver, ray
    or an integer in -20..19 fails naming the variable."""
    raw = os.environ.get(ENV, "").strip().lower() or "driver"
    if raw == "ray":
        return None
    if raw == "driver":
        return own()
    try:
        n = int(raw)
    except ValueError:
        n = None
    if n is None or not -20 <= n <= 19:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected driver (the stage's own niceness, the default), ray "
                         f"(Ray's worker niceness, 15 unless RAY_worker_niceness says otherwise) or an integer in -20..19")
    return n


def system_config() -> dict:
    """`_system_config` entries for a local Ray this process starts: its workers at the target niceness (nice() only
    adds to the raylet's, which is ours); nothing for Ray's own behaviour."""
    t = target()
    return {} if t is None else {"worker_niceness": max(0, t - own())}


def actor_env() -> dict[str, str]:
    """runtime_env env_vars for a Ray actor the stage starts (empty for Ray's own behaviour): the worker keeps its
    raylet's niceness, and the actor's constructor (at_launcher_priority) reads the target from it."""
    t = target()
    return {} if t is None else {"RAY_worker_niceness": "0", ENV: str(t)}


# On a busy node an OpenMP parallel region runs at the pace of its slowest thread, and GNU OpenMP's threads that reach a
# barrier first spin (GOMP_SPINCOUNT, 300,000 by default) before they sleep: their spinning takes the core that the
# thread they wait for needs. benchmarks/parts/omp_spin.py on 2 cores beside one busy loop (2026-11-29): two threads of
# 96x768 @ 768x2048 fp32 matmuls 16.2 s by default, 10.9 s with GOMP_SPINCOUNT=1000, 9.6 s on one thread; quiet, 6.3
# and 5.0 s. OMP_WAIT_POLICY=PASSIVE (no spin at all) 11.1 s busy, 5.3 s quiet. (benchmarks/RESULTS.md)
SPIN = {"GOMP_SPINCOUNT": "1000"}


def omp_env() -> dict[str, str]:
    """Environment for the processes a stage starts that compute (Ray actors, training jobs): OpenMP threads that spin
    briefly at a barrier (SPIN), unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY (theirs is kept). Read by
    OpenMP when the process starts, so it goes in the process's environment, not in a running one."""
    return {} if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys() else dict(SPIN)


def job_env() -> dict[str, str]:
    """For a Ray Job's runtime_env env_vars: the submitter's resolved setting, and Ray's job supervisor (whose child
    the job's driver is) at its raylet's niceness; without them the driver runs at Ray's 15 and "driver" read there
    would mean 15."""
    t = target()
    return {ENV: "ray"} if t is None else {"RAY_worker_niceness": "0", ENV: str(t)}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]  # Linux: a niceness per thread
    except OSError:
        return [0]  # elsewhere setpriority(PRIO_PROCESS, 0) sets the whole process


def adopt(who: str = "this process") -> int | None:
    """Set every thread of this process to the niceness in its environment (ENV as actor_env wrote it; nothing when
    it is absent or "ray"); returns this thread's niceness after. When the OS refuses to lower it, one warning says
    so, and the process keeps running where it is."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "ray", "driver"):  # "driver" would be this worker's own: nothing to change
        return None
    want, was, refused = int(raw), own(), None
    for tid in _threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != want:
                os.setpriority(os.PRIO_PROCESS, tid, want)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as e:
            refused = e
    now = own()
    if refused is not None:
        log.warning("%s (pid %d): the OS refused to lower its niceness from %d to %d, the stage's (%s: %s); it runs at "
                    "%d, so any process at a lower niceness on its node takes the CPU first. Start the node's Ray with "
                    "RAY_worker_niceness=0 in the environment of `ray start`, run Ray as a user allowed to lower a "
                    "niceness (CAP_SYS_NICE, or RLIMIT_NICE), or set %s=ray to keep Ray's niceness without this "
                    "warning", who, os.getpid(), was, want, ENV, refused, now, ENV)
    return now


def at_launcher_priority(cls: type) -> type:
    """`cls` for ray.remote whose constructor first runs `adopt` (same name, so Ray's process titles and logs still
    say the role's class)."""

    def __init__(self, *args, **kwargs):
        adopt(cls.__name__)
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
