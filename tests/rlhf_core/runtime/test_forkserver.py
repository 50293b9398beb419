"""One-process jobs forked from the warm fork server (rlhf_core.runtime.forkserver) through jobs.run_job: the job
runs as `python -u -m` would run it (argv, cwd, its environment, output line by line, exit status, its own process
group), without importing what the server preloaded, the server reused for the same environment, and a job killed
or orphaned goes as a launched one does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlhf_core import store
from rlhf_core.runtime import forkserver, jobs

PROBE = '''
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "torch": "torch" in sys.modules,
                  "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "path0": sys.path[0]}))
what = sys.argv[1] if sys.argv[1:] else ""
if what == "exit3":
    raise SystemExit(3)
if what == "raise":
    raise ValueError("the probe broke")
if what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
print("to stderr", file=sys.stderr)
'''


def probe(tmp_path: Path) -> Path:
    (tmp_path / "fs_probe.py").write_text(PROBE)
    return tmp_path


def facts(lines: list[str]) -> dict:
    return json.loads(next(line for line in lines if line.startswith("{")))


def cmd(*args: str) -> list[str]:
    return [sys.executable, "-u", "-m", "fs_probe", *args]


def test_a_forked_job_runs_as_python_m_would_and_the_server_serves_the_next(tmp_path, monkeypatch):
    monkeypatch.delenv(forkserver.SWITCH, raising=False)
    cwd = str(probe(tmp_path))
    env = jobs.job_env(1, {"PROBE": "one"})
    assert forkserver.wanted(cmd(), env)  # no GPU on this host

    lines = jobs.run_job(cmd("a", "b c"), env=env, cwd=cwd)
    first = facts(lines)
    assert first["argv"] == ["a", "b c"] and first["cwd"] == cwd and first["path0"] == cwd and first["probe"] == "one"
    assert first["torch"], "the server preloads torch: the job does not import it again"
    assert first["pgid"] == first["pid"], "each job is its own process group (kill_group kills it)"
    assert first["ppid"] != os.getpid() and lines[-1] == "to stderr"  # stdout and stderr, in order

    # the same environment but for the variables read at run time only: the same server, a new process
    second = facts(jobs.run_job(cmd(), env={**env, "PYTEST_CURRENT_TEST": "another", store.FENCE_ENV: "{}",
                                            "RAY_AUTH_MODE": "disabled", "PYTHONBREAKPOINT": "x.y"}, cwd=cwd))
    assert second["ppid"] == first["ppid"] and second["pid"] != first["pid"]

    # exit statuses and a traceback, as a launched job's
    with pytest.raises(jobs.JobFailed, match="exit code 3"):
        jobs.run_job(cmd("exit3"), env=env, cwd=cwd)
    with pytest.raises(jobs.JobFailed, match="exit code 1") as failed:
        jobs.run_job(cmd("raise"), env=env, cwd=cwd)
    assert failed.value.tail[-1] == "ValueError: the probe broke"

    # killed by its process group, found in jobs.running() (how the tests that kill a job mid-run find it)
    def kill_when_sleeping():
        deadline = time.time() + 60
        while time.time() < deadline:
            for pid, c in jobs.running().items():
                if c[-1] == "sleep":
                    time.sleep(0.5)
                    os.killpg(pid, signal.SIGKILL)
                    return
            time.sleep(0.05)

    threading.Thread(target=kill_when_sleeping, daemon=True).start()
    with pytest.raises(jobs.JobFailed, match="killed by signal 9"):
        jobs.run_job(cmd("sleep"), env=env, cwd=cwd, on_line=lambda line: None)
    assert not jobs.running()

    # another environment (another OpenMP setting: read at import) gets a server of its own
    other = facts(jobs.run_job(cmd(), env={**env, "OMP_NUM_THREADS": "1", "PROBE": "two"}, cwd=cwd))
    assert other["probe"] == "two" and other["ppid"] not in (first["ppid"], os.getpid())
    assert not _alive(first["ppid"]), "the idle server of the first environment stopped"

    # switched off: launched as a new process (the guard execs it: its parent is this process)
    launched = facts(jobs.run_job(cmd(), env={**env, forkserver.SWITCH: "0"}, cwd=cwd))
    assert launched["ppid"] == os.getpid() and not launched["torch"]


def test_which_jobs_are_forked():
    env = {"PATH": os.environ.get("PATH", "")}
    assert forkserver.wanted([sys.executable, "-u", "-m", "rlhf_core.train.entry", "spec.json"], env)
    assert not forkserver.wanted([sys.executable, "-u", "-m", "rlhf_core.train.entry"], {**env, forkserver.SWITCH: "0"})
    assert not forkserver.wanted([sys.executable, "-c", "print(1)"], env)  # only `-u -m MODULE`
    assert not forkserver.wanted(["/other/python", "-u", "-m", "rlhf_core.train.entry", "s"], env)  # another interpreter
    ds = jobs.launcher_command("rlhf_core.train.entry", ["s"], "deepspeed", 2)
    assert not forkserver.wanted(ds, env)  # several ranks: DeepSpeed's launcher starts them


@pytest.mark.slow
def test_a_forked_job_and_its_server_go_when_the_process_that_ran_it_is_killed(tmp_path):
    """SIGKILL the caller (a flow process) mid-job: the server sees its socket close and goes, the job with it (as a
    launched job's guard ends it when its launcher dies)."""
    cwd = probe(tmp_path)
    caller = ("import sys\nfrom rlhf_core.runtime import jobs\n"
              f"jobs.run_job({cmd('sleep')!r}, env=jobs.job_env(1), cwd={str(cwd)!r}, on_line=lambda l: print(l, flush=True))\n")
    proc = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != forkserver.SWITCH})
    try:
        job = facts([proc.stdout.readline()])
        assert proc.stdout.readline().strip() == "sleeping"
        server = job["ppid"]
        assert server != proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert _gone_within(job["pid"], 30) and _gone_within(server, 30)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


CALLER = """
import json, os, signal, socket, sys, threading
from rlhf_core.runtime import forkserver
client = forkserver.Server.__new__(forkserver.Server)  # the caller's handle, on the socket it was given
client._ctrl, client._lock, client.jobs = socket.socket(fileno=int(sys.argv[1])), threading.Lock(), set()
env, cwd = {**os.environ, "PROBE": "in-process"}, sys.argv[2]
job = client.spawn("fs_probe", ["exit3"], env, cwd)
seen = {"exit3": job.stdout.readlines(), "exit3_rc": job.wait(30)}
sleeper = client.spawn("fs_probe", ["sleep"], env, cwd)
seen["sleep"] = [sleeper.stdout.readline(), sleeper.stdout.readline()]
seen["poll"] = sleeper.poll()
client._ctrl.close()  # the caller goes
seen["sleep_rc"], seen["sleep_pid"] = sleeper.wait(30), sleeper.pid
print(json.dumps(seen))
"""


def test_the_server_loop_forks_reports_and_ends_its_jobs_when_its_caller_closes(tmp_path, monkeypatch):
    """The server's loop (`serve`) run in this process for a caller process: a job's pid, output and exit status come
    back on the job's socket, poll() answers None while a job runs, and when the caller closes the control socket
    the loop SIGTERMs the job still running (which starts from a fresh interpreter's handlers, not this process's),
    returns, and leaves this process's signal handling as it found it."""
    cwd = str(probe(tmp_path))
    monkeypatch.setattr(forkserver, "PRELOAD", ("json", "no_such_module_here"))  # a missing preload is only reported
    mine, theirs = forkserver.socket.socketpair(forkserver.socket.AF_UNIX, forkserver.socket.SOCK_SEQPACKET)
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(mine.fileno()), cwd], pass_fds=[mine.fileno()],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mine.close()
    old_handler = signal.getsignal(signal.SIGCHLD)

    def exits_15(*_):  # a handler of this program's own (a pytest-xdist worker has one): not the jobs'
        raise SystemExit(15)

    previous = signal.signal(signal.SIGTERM, exits_15)
    try:
        forkserver.serve(theirs.detach())  # returns when the caller closes its end
        out, err = caller.communicate(timeout=60)
        assert signal.getsignal(signal.SIGTERM) is exits_15  # given back
    finally:
        signal.signal(signal.SIGTERM, previous)
        caller.kill()
    assert caller.returncode == 0, err[-3000:]
    seen = json.loads(out)
    first = facts(seen["exit3"])
    assert seen["exit3_rc"] == 3 and first["argv"] == ["exit3"] and first["probe"] == "in-process" and first["cwd"] == cwd
    assert first["ppid"] == os.getpid() and first["pgid"] == first["pid"]
    assert json.loads(seen["sleep"][0])["argv"] == ["sleep"] and seen["sleep"][1].strip() == "sleeping"
    assert seen["poll"] is None and seen["sleep_rc"] == -signal.SIGTERM
    assert os.waitpid(seen["sleep_pid"], 0)[1] == signal.SIGTERM  # ended by the loop's SIGTERM; this process reaps it
    assert signal.getsignal(signal.SIGCHLD) == old_handler and signal.set_wakeup_fd(-1) == -1


# ---------------------------------------------------------------------------------------------- Ray's workers
def launch(server_path: str, *args: str, **kw) -> subprocess.Popen:
    """`python -m rlhf_core.runtime.forkexec --server PATH ARGS`, as Ray starts a worker with its py_executable."""
    return subprocess.Popen([sys.executable, "-m", "rlhf_core.runtime.forkexec", "--server", server_path, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_the_launcher_runs_its_script_forked_or_on_its_own_and_mirrors_it(tmp_path, monkeypatch):
    """forkexec: with no server at the path the script runs as `python SCRIPT ARGS` in the launcher's own process;
    with a workers' server there it is forked from it, in the launcher's environment and cwd, writing to the
    launcher's stdout and stderr, and the launcher exits with its status, passes SIGTERM on, and when the launcher is
    SIGKILLed the worker goes too (its lifeline)."""
    script = str(probe(tmp_path) / "fs_probe.py")
    alone = launch(str(tmp_path / "none" / "s"), script, "a", "b", cwd=tmp_path)
    out, err = alone.communicate(timeout=60)
    assert alone.returncode == 0 and "to stderr" in err, err
    said = facts(out.splitlines())
    assert said["argv"] == ["a", "b"] and said["pid"] == alone.pid and not said["torch"]

    monkeypatch.setattr(forkserver, "WORKER_PRELOAD", ("json", "torch"))
    server = forkserver.Server({**os.environ, "OMP_NUM_THREADS": "2"}, listen=True)
    try:
        env = {**os.environ, "PROBE": "launcher's", "OMP_NUM_THREADS": "1"}
        p = launch(server.path, script, "exit3", cwd=tmp_path, env=env)
        out, err = p.communicate(timeout=120)
        said = facts(out.splitlines())
        assert p.returncode == 3 and said["argv"] == ["exit3"] and said["probe"] == "launcher's", err
        assert said["ppid"] == server.proc.pid and said["torch"] and said["cwd"] == str(tmp_path)
        assert said["path0"] == str(tmp_path)  # `python SCRIPT` puts the script's folder first

        p = launch(server.path, script, "sleep", cwd=tmp_path, env=env)
        worker = facts([p.stdout.readline()])["pid"]
        assert p.stdout.readline().strip() == "sleeping"
        p.terminate()
        assert p.wait(60) == -signal.SIGTERM  # the worker's end, passed on
        assert _gone_within(worker, 30)

        p = launch(server.path, script, "sleep", cwd=tmp_path, env=env)
        worker = facts([p.stdout.readline()])["pid"]
        p.kill()  # nothing to pass on: the worker's lifeline closes
        p.wait(30)
        assert _gone_within(worker, 30)
    finally:
        server.close()
    assert not Path(server.path).parent.exists()  # the socket's folder goes with the server
    monkeypatch.setenv(forkserver.SWITCH, "0")
    assert forkserver.worker_executable(dict(os.environ)) is None


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while _alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


class Where:
    """A Ray actor that says which process it runs in and what that process had imported before it."""

    def __init__(self):
        print("a forked worker writes to its launcher's log", flush=True)

    def facts(self) -> dict:
        import torch

        return {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "threads": torch.get_num_threads(),
                "mine": os.environ.get("FS_PROBE"), "preloaded": "rlhf_core.ppo.roles" in sys.modules}


def _launcher_of(argv: list[str]) -> int:
    """The forkexec process that started the worker whose argv is `argv` (Ray's startup token tells them apart)."""
    for d in Path("/proc").iterdir():
        try:
            line = (d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if d.name.isdigit() and b"rlhf_core.runtime.forkexec" in line and [a.decode() for a in line[-len(argv):]] == argv:
            return int(d.name)
    raise AssertionError(f"no launcher with {argv[-4:]}")


@pytest.mark.slow
@pytest.mark.own_ray
def test_a_local_rays_actors_are_forked_from_the_warm_server_and_go_with_their_launcher():
    """The Ray a stage starts (_ray_up) runs its actors in processes forked from the workers' server: the roles'
    modules already imported there, the actor's runtime_env in its environment, OpenMP at its OMP_NUM_THREADS, its
    output in Ray's worker log; its launcher (Ray's child) SIGKILLed, the actor dies; ray.kill ends the launcher."""
    import ray

    from rlhf_core.rollout import generation

    assert generation._ray_up(None)
    try:
        server = next(iter(forkserver._worker_servers.values()))
        where = ray.remote(Where).options(num_cpus=1, runtime_env={"env_vars": {"FS_PROBE": "mine", "OMP_NUM_THREADS": "1"}})
        first, second = where.remote(), where.remote()
        a, b = ray.get([first.facts.remote(), second.facts.remote()], timeout=300)
        assert a["ppid"] == b["ppid"] == server.proc.pid and a["pid"] != b["pid"]
        assert a["preloaded"] and a["mine"] == "mine" and a["threads"] == 1
        logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
        said = [f for f in logs.glob("worker-*.out") if "writes to its launcher's log" in f.read_text(errors="replace")]
        assert len(said) >= 2, sorted(p.name for p in logs.iterdir())

        os.kill(_launcher_of(a["argv"]), signal.SIGKILL)
        assert _gone_within(a["pid"], 30)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.facts.remote(), timeout=120)

        launcher = _launcher_of(b["argv"])
        ray.kill(second)
        assert _gone_within(b["pid"], 60) and _gone_within(launcher, 60)
    finally:
        ray.shutdown()
