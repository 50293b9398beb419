"""Ray workers at the niceness of the process that starts the stage (rlhf_core.runtime.niceness), not Ray's 15.

Every niceness is read inside the actor, thread by thread (/proc/self/task: Linux keeps one per thread, and Ray's
nice() at a worker's start touches only its main thread), relative to this test process's own niceness `N0`
(0 when pytest runs plainly). A Ray whose workers run at Ray's default shows the main thread at N0 + 15 (capped at
19), so each assertion below fails without the change. The cluster "joined by address" is a real Ray started by a
child process at N0 + 5 (its raylet, and so every worker before our setting, at N0 + 5).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_core.runtime import niceness

N0 = os.getpriority(os.PRIO_PROCESS, 0)
RAY_DEFAULT = 15


def cap(n: int) -> int:
    return max(-20, min(19, n))


def can_lower() -> bool:
    """Whether this host lets a process lower its niceness (root / CAP_SYS_NICE / RLIMIT_NICE), tried for real."""
    probe = "import os; n = os.getpriority(os.PRIO_PROCESS, 0); os.setpriority(os.PRIO_PROCESS, 0, n + 1); " \
            "os.setpriority(os.PRIO_PROCESS, 0, n)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------- the setting
def test_the_setting_resolves_to_a_niceness_or_rays_own(monkeypatch):
    """driver (and unset) -> this process's niceness; ray -> None (Ray's own); an integer -> itself; anything else a
    ValueError naming the variable. What a local Ray and each actor are given follows: worker_niceness = target - N0
    (nice() adds to the raylet's, which is ours), the actor's env keeps the raylet's niceness and carries the target."""
    monkeypatch.delenv(niceness.ENV, raising=False)
    assert niceness.target() == N0
    assert niceness.system_config() == {"worker_niceness": 0}
    assert niceness.actor_env() == {"RAY_worker_niceness": "0", niceness.ENV: str(N0)}
    assert niceness.job_env() == {"RAY_worker_niceness": "0", niceness.ENV: str(N0)}
    monkeypatch.setenv(niceness.ENV, "ray")
    assert niceness.target() is None
    assert niceness.system_config() == {} and niceness.actor_env() == {}
    assert niceness.job_env() == {niceness.ENV: "ray"}
    monkeypatch.setenv(niceness.ENV, str(N0 + 4))
    assert niceness.target() == N0 + 4
    assert niceness.system_config() == {"worker_niceness": 4}
    monkeypatch.setenv(niceness.ENV, "-20")
    assert niceness.target() == -20 and niceness.system_config() == {"worker_niceness": 0}  # nice() cannot lower
    for bad in ("20", "high", "1.5"):
        monkeypatch.setenv(niceness.ENV, bad)
        with pytest.raises(ValueError, match=rf"^{niceness.ENV}='{bad}': expected driver"):
            niceness.target()


def run_child(code: str, env: dict, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, text=True,
                          capture_output=True, preexec_fn=preexec, timeout=120)


THREADS = """
    import os, threading, time
    from rlhf_core.runtime import niceness

    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread that exists before adopt
    print(niceness.adopt("Probe"), sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")))
"""


def test_adopt_moves_every_thread_of_the_process():
    """A process with two threads at N0 adopts N0 + 3 (raising is always allowed): both threads at N0 + 3 (setting
    only the calling thread would leave the other at N0: Linux keeps a niceness per thread)."""
    res = run_child(THREADS, {niceness.ENV: str(N0 + 3)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(N0 + 3), f"[{N0 + 3},", f"{N0 + 3}]"]
    assert "refused" not in res.stderr


def test_adopt_says_when_the_os_refuses_and_runs_on():
    """A process at niceness 15 with no right to lower it (an unprivileged user: root drops to nobody first) asked
    for N0 < 15: it stays at 15, and one warning names the process, both nicenesses, the OS's error and the fixes."""
    assert N0 < 15, "run this test from a process below niceness 15"
    unprivileged_at_15 = """
        import os
        from rlhf_core.runtime import niceness  # imported while the interpreter's files are still readable
        os.setpriority(os.PRIO_PROCESS, 0, 15)
        if os.geteuid() == 0:  # root may lower a niceness: become nobody
            os.setgid(65534)
            os.setuid(65534)
    """
    res = run_child(textwrap.dedent(unprivileged_at_15) + textwrap.dedent(THREADS), {niceness.ENV: str(N0)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["15", "[15,", "15]"]
    assert f"Probe (pid " in res.stderr
    assert f"the OS refused to lower its niceness from 15 to {N0}, the stage's ({niceness.ENV}: [Errno " in res.stderr
    assert "it runs at 15" in res.stderr and "RAY_worker_niceness=0" in res.stderr
    assert f"{niceness.ENV}=ray" in res.stderr


def test_ray_niceness_leaves_the_process_alone():
    """Ray's own behaviour (ray) and a worker that carries no setting: adopt changes nothing."""
    for env in ({niceness.ENV: "ray"}, {niceness.ENV: ""}):
        res = run_child(THREADS, env, preexec=lambda: os.setpriority(os.PRIO_PROCESS, 0, N0 + 2))
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["None", f"[{N0 + 2},", f"{N0 + 2}]"]


# ---------------------------------------------------------------------------------------------- real Ray
class Probe:
    """An engine for run_engines: each item answers with the nicenesses of its actor's threads (nice), or with the
    OpenMP spin its process started with (spin)."""

    def nice(self, items: list) -> list:
        return [sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})
                for _ in items]

    def spin(self, items: list) -> list:
        return [os.environ.get("GOMP_SPINCOUNT") for _ in items]

    def workers(self, items: list) -> list:
        """The workers of this Ray node (the raylet's children: other tests' Rays may run beside it) by process title
        (ray::IDLE: started and waiting for work)."""
        titles = []
        for d in Path("/proc").iterdir():
            try:
                if not d.name.isdigit() or int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1]) != os.getppid():
                    continue
                cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode()
            except (OSError, ValueError, IndexError):
                continue
            if cmd.startswith("ray::") and not cmd.endswith("Agent"):  # not Ray's dashboard / runtime_env agents
                titles.append(cmd.split()[0])
        return [sorted(titles) for _ in items]


def threads_nice(actor) -> list[int]:
    import ray

    return ray.get(actor.__ray_call__.remote(
        lambda _self: sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})))


@pytest.mark.slow
def test_engines_on_a_local_ray_run_at_the_drivers_niceness(monkeypatch):
    """run_engines starting its own Ray (_ray_up): both engines' every thread at N0; with the setting at ray, their
    main threads at Ray's N0 + 15."""
    from rlhf_core.rollout import generation

    import ray

    assert not ray.is_initialized()
    monkeypatch.delenv(niceness.ENV, raising=False)
    assert generation.run_engines(Probe, (), "nice", [0, 1], {}, num_engines=2) == [[N0], [N0]]
    monkeypatch.setenv(niceness.ENV, "ray")
    got = generation.run_engines(Probe, (), "nice", [0, 1], {}, num_engines=2)
    assert [max(g) for g in got] == [cap(N0 + RAY_DEFAULT)] * 2
    # the engines' OpenMP threads spin briefly at a barrier (niceness.omp_env), whatever the niceness setting
    assert generation.run_engines(Probe, (), "spin", [0], {}, num_engines=1) == ["1000"]
    # no worker prestarted beside the engine: Ray's would have no runtime_env, never an engine's (_ray_up)
    assert generation.run_engines(Probe, (), "workers", [0], {}, num_engines=1) == [["ray::Probe.workers"]]


def test_processes_that_compute_spin_briefly_at_an_openmp_barrier_unless_the_user_said(monkeypatch):
    """omp_env: GOMP_SPINCOUNT=1000 for the actors and training jobs a stage starts (a thread that lost its core to
    another process is not kept from it by its siblings' spinning); a GOMP_SPINCOUNT or OMP_WAIT_POLICY the user set
    is kept, in a training job's environment too."""
    from rlhf_core.runtime import jobs

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert niceness.omp_env() == {"GOMP_SPINCOUNT": "1000"} and jobs.job_env(1)["GOMP_SPINCOUNT"] == "1000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "50000")
    assert niceness.omp_env() == {} and jobs.job_env(1)["GOMP_SPINCOUNT"] == "50000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert niceness.omp_env() == {} and "GOMP_SPINCOUNT" not in jobs.job_env(1)


@pytest.fixture(scope="module")
def cluster_at_5():
    """A Ray started by a child process at niceness N0 + 5, its GCS address; stopped by that child (its pid)."""
    hold = textwrap.dedent("""
        import os, sys, ray
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024 ** 2)
        print(ctx.address_info["gcs_address"], flush=True)
        sys.stdin.read()
        ray.shutdown()
    """)
    p = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, N0 + 5))
    try:
        address = p.stdout.readline().strip()
        assert address, "the child's Ray did not start"
        yield address
    finally:
        p.stdin.close()
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.mark.slow
def test_engines_on_a_cluster_joined_by_address(cluster_at_5, monkeypatch):
    """A cluster whose raylet runs at N0 + 5: the engines at N0 when the OS lets a process lower its niceness (else
    at N0 + 5, the raylet's, with the warning of test_adopt_says_when_the_os_refuses_and_runs_on); with the setting at
    ray, their main threads at N0 + 5 + 15, capped at 19."""
    from rlhf_core.rollout import generation

    monkeypatch.delenv(niceness.ENV, raising=False)
    want = N0 if can_lower() else N0 + 5
    got = generation.run_engines(Probe, (), "nice", [0, 1], {}, num_engines=2, ray_address=cluster_at_5)
    assert got == [[want], [want]]
    monkeypatch.setenv(niceness.ENV, "ray")
    got = generation.run_engines(Probe, (), "nice", [0, 1], {}, num_engines=2, ray_address=cluster_at_5)
    assert [max(g) for g in got] == [cap(N0 + 5 + RAY_DEFAULT)] * 2


@pytest.mark.slow
def test_ppo_roles_on_a_cluster_joined_by_address(cluster_at_5, tiny, monkeypatch):
    """The ppo stage's roles (placement.Roles: the policy learner and an hf rollout engine) on the N0 + 5 cluster:
    every thread of each at N0 (or the raylet's N0 + 5 where the OS refuses); with the setting at ray, their main
    threads at N0 + 20 capped at 19."""
    import ray

    from rlhf_core.ppo import loop
    from rlhf_core.ppo.placement import Roles
    from stages import ppo

    cfg = ppo.Config(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", rollout_batch_size=2,
                     n_samples_per_prompt=2, advantage_estimator="group_norm", train_batch_size=4,
                     micro_train_batch_size=2, init_kl_coef=0.0, vllm_num_engines=1, rollout_backend="hf",
                     ray_address=cluster_at_5)
    want = N0 if can_lower() else N0 + 5
    for setting, check in ((None, lambda got: got == [want]), ("ray", lambda got: max(got) == cap(N0 + 5 + RAY_DEFAULT))):
        if setting:
            monkeypatch.setenv(niceness.ENV, setting)
        else:
            monkeypatch.delenv(niceness.ENV, raising=False)
        ray.init(address=cluster_at_5)
        try:
            roles = Roles(cfg, str(tiny.policy_dir), None, None, None, 4, loop.learner_settings(cfg), 256)
            got = {roles.name(a): threads_nice(a) for a in roles.all}
            assert set(got) == {"policy0", "rollout0"}
            roles.close()
            assert all(check(g) for g in got.values()), (setting, got)
        finally:
            ray.shutdown()
