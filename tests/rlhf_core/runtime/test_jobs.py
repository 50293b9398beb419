"""The launcher: output streamed to the log, JobFailed with the last lines, process group killed on error."""
import logging
import os
import sys
import time

import pytest

from rlhf_core.runtime import jobs


def test_command_shapes(tmp_path):
    ds = jobs.launcher_command("m.entry", ["spec.json"], "deepspeed", num_gpus=2, master_port=1234)
    assert ds[0].endswith("deepspeed") and ds[1:5] == ["--num_gpus", "2", "--master_port", "1234"]
    assert ds[-3:] == ["--module", "m.entry", "spec.json"]
    multi = jobs.launcher_command("m", [], "deepspeed", 8, 2, hostfile="/h", master_port=1)
    assert multi[5:9] == ["--hostfile", "/h", "--num_nodes", "2"]
    tr = jobs.launcher_command("m", ["a"], "torchrun", 2, master_port=5)
    assert tr[0].endswith("torchrun") and tr[-3:] == ["-m", "m", "a"] and "--nproc_per_node" in tr
    # one process on one node: the rank runs directly (no launcher processes), unless a port was pinned
    assert jobs.launcher_command("m.entry", ["spec.json"], "deepspeed") == [sys.executable, "-u", "-m", "m.entry", "spec.json"]
    assert jobs.launcher_command("m", [], "deepspeed", master_port=7)[0].endswith("deepspeed")
    with pytest.raises(ValueError, match="unknown launcher"):
        jobs.launcher_command("m", [], "mpirun")
    assert jobs.job_env(2)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


def test_streams_lines_and_fails_with_tail(caplog):
    code = "import sys\nfor i in range(100): print('line', i)\nprint('boom: bad thing', file=sys.stderr)\nsys.exit(3)"
    with caplog.at_level(logging.INFO, logger="rlhf_flows"):
        with pytest.raises(jobs.JobFailed, match="exit code 3") as e:
            jobs.run_job([sys.executable, "-c", code], tail_lines=5)
    assert e.value.returncode == 3
    assert e.value.tail[-1] == "boom: bad thing" and len(e.value.tail) == 5
    assert "boom: bad thing" in str(e.value)
    assert "line 0" in caplog.text  # every line reached the log
    assert jobs.run_job([sys.executable, "-c", "print('ok')"]) == ["ok"]


def test_exception_in_parent_kills_process_group(tmp_path):
    """The child starts a grandchild (like the launcher starts ranks); an exception while streaming kills both."""
    pidfile = tmp_path / "pids"
    code = (f"import os, subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}')\nprint('started', flush=True)\ntime.sleep(60)")

    def cancel(line):
        if line == "started":
            raise KeyboardInterrupt  # what a Prefect cancellation looks like inside the task

    with pytest.raises(KeyboardInterrupt):
        jobs.run_job([sys.executable, "-c", code], on_line=cancel)
    child, grandchild = map(int, pidfile.read_text().split())
    deadline = time.time() + 10
    while time.time() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(child) and not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its dead parent yet) counts as gone
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_silent_job_is_killed_and_named_after_the_stall_timeout(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\nprint('step 1/9', flush=True)\ntime.sleep(60)"
    t0 = time.time()
    with pytest.raises(jobs.JobStalled, match=r"sft training for s3://b/x made no progress \(no output line\) for 2s"
                                              r": killed \(stall_timeout_s\); last lines:\nstep 1/9"):
        jobs.run_job([sys.executable, "-c", code], stall_timeout_s=2, what="sft training for s3://b/x")
    assert time.time() - t0 < 50 and not _alive(int(pidfile.read_text()))


def test_a_job_started_by_a_rank_or_beside_a_process_group_rendezvous_on_its_own(tiny, tmp_path, monkeypatch):
    """A process that is itself a rank, or that ran torch.distributed in-process (a notebook, a test), has
    MASTER_PORT / RANK / WORLD_SIZE in its environment and may still listen on that port: a one-process trainer job it
    starts rendezvous on a port of its own as rank 0 of 1 (it inherited them before: as rank 0, EADDRINUSE; as
    rank 3 of 8, waiting for peers that never come until the stall timeout killed it)."""
    import socket

    import pyarrow  # noqa: F401  (the data below)

    from rlhf_core import store
    from rlhf_core.demo import demo_task
    from rlhf_core.inputs import data
    from stages import sft

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()  # what a live TCPStore of this process does on its MASTER_PORT
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        for k, v in (("RANK", "3"), ("LOCAL_RANK", "3"), ("WORLD_SIZE", "8")):
            monkeypatch.setenv(k, v)
        assert not set(jobs.RENDEZVOUS_ENV) & set(jobs.job_env(1))
        w = store.ArtifactWriter(str(tmp_path / "rows"), "data", {"n": 8})
        w.begin()
        w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(8, 0), "sft"))
        w.commit()
        m = sft.run(sft.Config(policy_uri=tiny.policy_uri, dataset_uri=str(tmp_path / "rows"), output_uri=str(tmp_path / "sft"),
                               input_template=demo_task.INPUT_TEMPLATE, max_epochs=1, train_batch_size=8,
                               micro_train_batch_size=8, max_len=32, stall_timeout_s=120))  # rank 3 of 8 waits for peers
        assert m.metrics["steps_done"] == 1
    finally:
        held.close()


def test_a_job_dies_with_the_process_that_launched_it_and_is_launched_without_a_fork(tmp_path):
    """dies_with_parent: the command runs in the launched process itself (the same pid, after the guard's exec) and
    gets SIGTERM when the process that launched it is SIGKILLed (nothing of the launcher's except-branch runs then);
    a guard whose launcher is already gone exits before running the command. run_job passes no preexec_fn, so Popen
    vforks instead of copying the launching process (a fork of a large pytest worker failed with ENOMEM in CI)."""
    import signal
    import subprocess

    pidfile, started = tmp_path / "child.pid", tmp_path / "child.started"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    launcher = ("import subprocess, sys, time\n"
                "from rlhf_core.runtime import jobs\n"
                f"p = subprocess.Popen(jobs.dies_with_parent([sys.executable, '-c', {child!r}]), start_new_session=True)\n"
                f"open({str(started)!r}, 'w').write(str(p.pid))\n"
                "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=os.getcwd())
    deadline = time.time() + 60
    while not (pidfile.exists() and pidfile.read_text() and started.exists()) and time.time() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert pid == int(started.read_text())  # the command is the launched process itself (exec'd by the guard)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the launched command outlived its SIGKILLed launcher")

    orphan = jobs.dies_with_parent([sys.executable, "-c", "print('ran')"])
    orphan[orphan.index(str(os.getpid()))] = "1"  # a guard told its launcher was pid 1: not its parent, so gone
    done = subprocess.run(orphan, capture_output=True, text=True)
    assert done.returncode == 1 and "ran" not in done.stdout and "the process that started this one is gone" in done.stderr

    calls = []
    real = subprocess.Popen

    class Spy(real):
        def __init__(self, *a, **kw):
            calls.append(kw)
            super().__init__(*a, **kw)

    subprocess.Popen = Spy
    try:
        assert jobs.run_job([sys.executable, "-c", "print('ok')"]) == ["ok"]
    finally:
        subprocess.Popen = real
    assert calls and all(kw.get("preexec_fn") is None for kw in calls)
