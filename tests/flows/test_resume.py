"""Crash and resume: SIGKILL the flow process alone (not its group: what an OOM killer or a supervisor does)
during generation, then during DPO training; nothing it started (Ray, the training job, Prefect's API server)
outlives it by more than a bounded wait, each rerun resumes where the last stopped, and artifacts committed
before a kill are never redone (same fingerprint, same created_at). Then a run paused (SIGSTOP) past its lock's
lease while its training job runs: a second run takes over and finishes; the first, resumed, writes not a
single file more and stops naming the holder. The flow runs as `rlhf-flows run` in a subprocess with its own
Prefect home."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.runtime import faults
from tests.flows.flowkit import alive_marked, demo_params, kill_marked, manifests

pytestmark = pytest.mark.slow


def _env(tmp_path: Path, home: str, marker: str = "", step_sleep: float = 0.0) -> dict:
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / home), RLHF_TEST_MARKER=marker, **{faults.STEP_SLEEP: str(step_sleep)},
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300")
    env.pop("PREFECT_API_URL", None)  # the harness's API belongs to the test process: use an ephemeral one
    return env


def _start(cfg: Path, tmp_path: Path, marker: str, flow: str = "iterative-dpo", home: str = "prefect",
           step_sleep: float = 0.0) -> subprocess.Popen:
    """`rlhf-flows run FLOW --config cfg` in its own session; `step_sleep`: seconds each training step sleeps first
    (rlhf_core.runtime.faults), so that a kill lands mid-training."""
    env = _env(tmp_path, home, marker, step_sleep)
    exe = Path(sys.executable).parent / "rlhf-flows"
    return subprocess.Popen([str(exe), "run", flow, "--config", str(cfg)], env=env, start_new_session=True,
                            stdout=open(tmp_path / f"run-{marker[-4:]}.log", "w"), stderr=subprocess.STDOUT)


def _kill_when(proc: subprocess.Popen, ready, marker: str, what: str, timeout: float = 600) -> float:
    """SIGKILL the flow process once `ready()`; returns when it was killed."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"flow exited ({proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    killed_at = time.time()
    os.kill(proc.pid, signal.SIGKILL)  # the flow process alone
    proc.wait()
    deadline = time.time() + 120
    while (left := alive_marked(marker)) and time.time() < deadline:
        time.sleep(1)
    kill_marked(marker)  # after the assert's evidence is taken: never leave them to the next test
    assert not left, f"alive 120 s after the flow process was killed ({what}):\n" + "\n".join(left)
    return killed_at


def test_sigkill_during_generation_and_dpo_then_resume(demo_run, tmp_path):
    run = tmp_path / "runs" / "kill"
    params = demo_params(demo=False, root=str(tmp_path / "runs"), run_name="kill", iterations=1,
                         pretrain_uri=demo_run.sft, reward_uri=demo_run.reward,
                         prompt_data=f"{demo_run.inputs}/prompts.jsonl",
                         eval_prompt_data=f"{demo_run.inputs}/eval_prompts.jsonl", gold_reward_file=demo_task.__file__,
                         sft={}, train_rm={}, lock_lease_s=6,
                         dpo={"save_steps": 1})
    cfg = tmp_path / "kill.yaml"
    cfg.write_text(yaml.safe_dump(params))

    # 1. killed while generating: the generate prefix exists but holds no manifest
    began, marker = time.time(), uuid.uuid4().hex
    proc = _start(cfg, tmp_path, marker)
    gen = run / "iter-1" / "generate"
    _kill_when(proc, lambda: gen.is_dir() and not (gen / store.MANIFEST).exists(), marker, "generation")
    first = manifests(str(run))
    assert "prompts" in first and "iter-1/generate" not in first

    # 2. rerun, killed during DPO once a checkpoint is on the store
    marker = uuid.uuid4().hex
    proc = _start(cfg, tmp_path, marker, step_sleep=1.0)  # slow steps so the kill lands mid-training
    ckpt = run / "iter-1" / "dpo" / "checkpoints"
    killed_2 = _kill_when(proc, lambda: ckpt.is_dir() and any(ckpt.rglob("*")) and not (ckpt.parent / store.MANIFEST).exists(),
                          marker, "a DPO checkpoint")
    second = manifests(str(run))
    for k, m in first.items():
        assert (second[k].fingerprint, second[k].created_at) == (m.fingerprint, m.created_at), k
    assert {"iter-1/generate", "iter-1/score", "iter-1/pairs", "iter-1/reference"} <= set(second)
    assert "iter-1/dpo" not in second  # a killed training stage is never committed

    # 3. rerun, paused (the flow, its training job and its Prefect server: a frozen machine) once DPO has saved
    #    a newer checkpoint, and kept paused past its lock's lease
    marker_a = uuid.uuid4().hex
    first_ckpts = _checkpoints(ckpt)
    proc_a = _start(cfg, tmp_path, marker_a, step_sleep=1.0)  # still training when paused
    deadline = time.time() + 600
    while not (_checkpoints(ckpt) - first_ckpts):
        assert proc_a.poll() is None and time.time() < deadline, (tmp_path / f"run-{marker_a[-4:]}.log").read_text()[-3000:]
        time.sleep(0.2)
    paused = _signal_tree(proc_a.pid, signal.SIGSTOP)
    try:
        time.sleep(params["lock_lease_s"] + 1)
        # 4. a second run takes over the stale lock and runs to the end: DPO continues from a checkpoint; nothing
        #    before it is redone
        marker = uuid.uuid4().hex
        proc = _start(cfg, tmp_path, marker, home="prefect-b")
        assert proc.wait(timeout=900) == 0, (tmp_path / f"run-{marker[-4:]}.log").read_text()[-3000:]
        kill_marked(marker)
        log_b = (tmp_path / f"run-{marker[-4:]}.log").read_text()
        assert "took over the stale lock" in log_b
        assert "iter-1/generate: committed at" in log_b and "iter-1/reference: committed at" in log_b  # skipped, said
        third = manifests(str(run))
        for k, m in second.items():
            assert (third[k].fingerprint, third[k].created_at) == (m.fingerprint, m.created_at), k
        dpo = third["iter-1/dpo"].metrics
        assert dpo["resumed_from_step"] >= 1 and dpo["steps_done"] == dpo["planned_steps"]
        assert "iter-1/eval" in third and not (run / "_LOCK.json").exists()
        ended = time.time()
        before = _listing(run)
    finally:
        _signal_tree(proc_a.pid, signal.SIGCONT, paused)
    # the first run, resumed: its job and its flow find the lock gone before their next write and stop
    try:
        code = proc_a.wait(timeout=300)
    finally:
        kill_marked(marker_a)
    log_a = (tmp_path / f"run-{marker_a[-4:]}.log").read_text()
    assert code != 0 and "now held by nobody (deleted)" in log_a, log_a[-3000:]
    after = _listing(run)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}

    # report.json's wall_s is the run's time over its 4 attempts; a killed attempt counts until its lock's last
    # refresh (every lease/4 = 1.5 s): the 2nd held the run from before it committed generate until its kill
    import json

    report = json.loads((run / "report.json").read_text())
    attempts = list(report["attempts_wall_s"].values())
    assert len(attempts) == 4 and report["wall_s"] == pytest.approx(sum(attempts), abs=0.02), report["attempts_wall_s"]
    assert attempts[1] >= killed_2 - (run / "iter-1" / "generate" / store.MANIFEST).stat().st_mtime - 3, attempts
    assert sum(attempts) <= ended - began, (attempts, ended - began)

    # Prefect's record of attempts 1-3 (one Prefect home): the task runs a kill -9 left Running (generate of the
    # 1st, dpo of the 2nd) and those flow runs are Crashed, nothing is Running; the 3rd's run log says the
    # takeover and the iteration-0 line
    seen = json.loads(subprocess.run([sys.executable, "-c", _READ_PREFECT], capture_output=True, text=True, timeout=300, check=True,
                                     env=dict(_env(tmp_path, "prefect"), PYTHONPATH=str(Path(__file__).resolve().parents[2]))).stdout)
    assert not [t for t in seen["tasks"] if t[1] in ("RUNNING", "PENDING")] and not [f for f in seen["flows"] if f[1] == "RUNNING"], seen
    crashed = [t[0] for t in seen["tasks"] if t[1] == "CRASHED" and "its attempt died" in t[2]]
    assert "iter-1/generate" in crashed and "iter-1/dpo" in crashed, seen["tasks"]
    assert sum(f[1] == "CRASHED" for f in seen["flows"]) == 2, seen["flows"]
    assert any(m.startswith("took over the stale lock of run") for m in seen["logs"]), seen["logs"]
    assert any(m.startswith("iteration 0: gold ") for m in seen["logs"]), seen["logs"]


_READ_PREFECT = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as c:
    tasks = [(t.name, t.state.type.value, t.state.message or "") for t in c.read_task_runs()]
    flows = [(f.name, f.state.type.value) for f in c.read_flow_runs()]
    logs = [e.message for e in c.read_logs()]
print(json.dumps({"tasks": tasks, "flows": flows, "logs": logs}))
"""


def _checkpoints(ckpt: Path) -> set[str]:
    return {p.parent.name for p in ckpt.glob("*/_CHECKPOINT.json")} if ckpt.is_dir() else set()


def _signal_tree(pid: int, sig: int, pids: list[int] | None = None) -> list[int]:
    """Send `sig` to a process and every descendant (the training job runs in its own session)."""
    import psutil

    if pids is None:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return pids


def _listing(root: Path) -> dict[str, tuple]:
    """Every file under the run: (size, mtime_ns, sha256), the local store's stand-in for key and ETag."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}
