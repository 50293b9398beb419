"""Launch a training job (the `deepspeed` launcher or torchrun) as a child process and watch it.

The child's output is streamed line by line into logging.getLogger("rlhf_flows") (which Prefect forwards
into the run log). The child runs in its own session, so on ANY exception in the parent (Prefect
cancellation, Ctrl-C, a crash) the whole process group - launcher and ranks - is killed. A non-zero exit
raises JobFailed carrying the child's last lines.

    1 process:     python -u -m rlhf_core.train.entry SPEC   (the entry sets the rank variables)
    G processes:   deepspeed --num_gpus G --master_port P --module rlhf_core.train.entry SPEC
    multi-node:    deepspeed --hostfile H --num_nodes N --num_gpus G ...   (same code path)
    every GPU:     deepspeed --master_port P --module ...   (num_gpus "all"; torchrun --nproc_per_node gpu)

A one-process job skips DeepSpeed's launcher: its runner and its `launch` module are two more Python
processes importing deepspeed before the rank starts, and the launcher polls the rank's exit once a
second; together 5.3 s of a 12.9 s tiny dpo stage (measured 2026-11-26, RESULTS "Fixed cost of a
training stage"). What they would do for one process, the entry does (RANK/LOCAL_RANK/WORLD_SIZE,
MASTER_ADDR/PORT; LOCAL_RANK 0 picks cuda:0).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("rlhf_flows")


class JobFailed(RuntimeError):
    """The training child exited non-zero; `tail` holds its last output lines."""

    def __init__(self, cmd: list[str], returncode: int, tail: list[str]):
        self.cmd, self.returncode, self.tail = cmd, returncode, tail
        how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
        super().__init__(f"training job failed ({how}): {' '.join(cmd[:6])} ...\n--- last lines ---\n"
                         + "\n".join(tail))


class JobStalled(RuntimeError):
    """The child printed nothing for `stall_timeout_s`: it was killed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_here() -> int:
    """GPUs this host shows (CUDA_VISIBLE_DEVICES respected, as deepspeed's runner and torchrun count them)."""
    import torch

    return torch.cuda.device_count()


def procs_per_node(num_gpus: int | str) -> int:
    """Processes a job starts on this node: `num_gpus`, or for "all" every GPU here (one on a host without GPUs)."""
    return num_gpus if num_gpus != "all" else max(1, gpus_here())


def hostfile_slots(hostfile: str) -> list[int | None]:
    """Each host's slots in a DeepSpeed hostfile ("host slots=N" lines; None: a host without slots=)."""
    out = []
    for line in Path(hostfile).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
            out.append(int(slots[0]) if slots else None)
    return out


def world_size(num_gpus: int | str, num_nodes: int = 1, hostfile: str | None = None) -> tuple[int, str]:
    """(ranks a job starts, how they were counted). num_gpus "all" (deepspeed without --num_gpus) is every GPU of
    each node: with a hostfile the slots of its first num_nodes hosts (deepspeed's runner reads them), else this
    host's GPUs on each node; a host without GPUs runs one process per node."""
    if num_gpus != "all":
        return num_gpus * num_nodes, "num_gpus x num_nodes"
    here = gpus_here()
    if not here:
        return num_nodes, f"num_gpus all: no GPU on this host, 1 process per node x {num_nodes} node(s)"
    slots = hostfile_slots(hostfile)[:num_nodes] if hostfile and Path(hostfile).is_file() else []
    if slots and None not in slots:
        return sum(slots), f"num_gpus all: the slots {slots} of {hostfile}"
    return here * num_nodes, f"num_gpus all: {here} GPU(s) on this host x {num_nodes} node(s)"


def launcher_command(module: str, args: list[str], launcher: str = "deepspeed", num_gpus: int | str = 1,
                     num_nodes: int = 1, hostfile: str | None = None, master_port: int | None = None,
                     master_addr: str | None = None, node_rank: int | str = 0) -> list[str]:
    """The command line running `python -m module args` under the chosen launcher (torchrun with several
    nodes: this is node `node_rank`, node 0 listens on master_addr:master_port). num_gpus "all": no --num_gpus
    (deepspeed starts a rank on every GPU of each node), torchrun's --nproc_per_node gpu; one process on a host
    without GPUs."""
    bindir = Path(sys.executable).parent
    if num_gpus == "all" and not gpus_here():
        num_gpus = 1
    port = str(master_port or free_port())
    if launcher == "deepspeed" and num_gpus == 1 and num_nodes == 1 and not hostfile and master_port is None:
        launcher = "python"  # one process: nothing for the launcher to do (module docstring)
    if launcher == "deepspeed":
        cmd = [str(bindir / "deepspeed"), *(["--num_gpus", str(num_gpus)] if num_gpus != "all" else []), "--master_port", port]
        if hostfile:
            cmd += ["--hostfile", hostfile, "--num_nodes", str(num_nodes)]
        return cmd + ["--module", module, *args]
    if launcher == "torchrun":
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", "gpu" if num_gpus == "all" else str(num_gpus), "--nnodes", str(num_nodes),
               "--master_port", port]
        if num_nodes > 1:
            cmd += ["--node_rank", str(node_rank), "--master_addr", master_addr or "127.0.0.1"]
        return cmd + ["-m", module, *args]
    if launcher == "python":  # one process, no launcher (debugging); the entry sets the rank variables
        return [sys.executable, "-u", "-m", module, *args]
    raise ValueError(f"unknown launcher {launcher!r} (deepspeed, torchrun or python)")


# torch.distributed's rendezvous variables: the launcher sets them for each rank it starts (the one-process entry, to
# rank 0 of 1 on a free port). A parent that is itself a rank, or ran torch.distributed in its own process (a notebook,
# a test), would hand its own to the job: a port its process group still listens on (EADDRINUSE), its rank and size.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def job_env(num_procs: int, extra: dict | None = None) -> dict:
    """Environment for the child: this process's without its rendezvous variables (RENDEZVOUS_ENV); one OpenMP thread
    per rank when ranks share the cores; OpenMP threads that spin briefly at a barrier (niceness.omp_env: full speed
    beside other processes on the node)."""
    from rlhf_core.runtime.niceness import omp_env

    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env.update(omp_env())
    if num_procs > 1 and "OMP_NUM_THREADS" not in (extra or {}):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_procs))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def run_job(cmd: list[str], env: dict | None = None, cwd: str | None = None, tail_lines: int = 40,
            on_line: Callable[[str], None] | None = None, stall_timeout_s: float | None = None,
            what: str = "training job") -> list[str]:
    """Run `cmd`, forward each output line to the log (and `on_line`), return the last lines on exit 0.
    Raises JobFailed on a non-zero exit, JobStalled (naming `what`) after `stall_timeout_s` without an
    output line; kills the child's process group on any exception here."""
    log.info("launching: %s", " ".join(cmd))
    proc = _start(cmd, env, cwd)
    _running[proc.pid] = cmd
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=stall_timeout_s)
            except queue.Empty:
                raise JobStalled(f"{what} made no progress (no output line) for {stall_timeout_s:g}s: killed "
                                 "(stall_timeout_s); last lines:\n" + "\n".join(tail)) from None
            if line is None:
                break
            line = line.rstrip("\n")
            tail.append(line)
            log.info("%s", line)
            if on_line:
                on_line(line)
        rc = proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        _running.pop(proc.pid, None)
    if rc != 0:
        raise JobFailed(cmd, rc, list(tail))
    return list(tail)


_running: dict[int, list[str]] = {}  # pid (its process group) -> command of each job run_job is watching


def running() -> dict[int, list[str]]:
    """The jobs this process is running now: {pid: command}; each pid is its job's process group (kill_group)."""
    return dict(_running)


def _start(cmd: list[str], env: dict | None, cwd: str | None):
    """The job's process: forked from the warm fork server where that is safe (rlhf_core.runtime.forkserver: a
    one-process job on a host without a GPU), else launched; either runs in its own session."""
    from rlhf_core.runtime import forkserver

    env = dict(os.environ) if env is None else env
    if forkserver.wanted(cmd, env):
        try:
            return forkserver.spawn(cmd, env, cwd)
        except OSError as e:
            log.warning("job fork server failed (%s): launching the job as a new process", e)
    return subprocess.Popen(dies_with_parent(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, env=env, cwd=cwd)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


# Run before the command, in the child's own process: SIGTERM when the process that started it dies
# (PR_SET_PDEATHSIG = 1, kept across the exec), and an exit if that process is already gone; then the command itself.
_GUARD = ("import ctypes, os, signal, sys\n"
          "try:\n    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
          "except (OSError, AttributeError):\n    pass\n"  # not Linux: no death signal
          "if os.getppid() != int(sys.argv[1]):\n    sys.exit('rlhf-flows: the process that started this one is gone')\n"
          "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dies_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when this process dies: a SIGKILLed flow process cannot run its
    except-branch, and the launcher lives in its own session; this stops it training on as an orphan (DeepSpeed's
    launcher passes SIGTERM on to its ranks). A small stdlib-only Python (-S, no site) sets the signal, then execs the
    command in the same process. Not a preexec_fn: Popen then has to fork() this whole process (a flow or a pytest
    worker of several GB) instead of vfork()ing, and a fork can fail with ENOMEM on a busy host (CI did, 2026-11-28:
    "OSError: [Errno 12] Cannot allocate memory" launching trainer jobs late in the suite); preexec_fn is also
    unsafe with threads running, which Prefect's and Ray's are."""
    return [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *cmd]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (launcher + ranks) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("job %s did not exit after SIGKILL", proc.pid)
    log.warning("killed job process group %s", proc.pid)
