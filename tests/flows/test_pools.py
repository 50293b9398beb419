"""Stages on their own work pools, in one flow (flows/pools.py), against the session's real `prefect server`: two
process pools with one worker each run an iterative-DPO iteration's generate / score and reference / dpo as child
flow runs of the loop's run; the training worker killed (its process group, -9) mid-dpo fails the stage naming
pool and worker, and once it is restarted a rerun resumes without running a committed stage again. A pool the
server does not have is refused by name before any stage runs."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.runtime import faults
from rlhf_core.train import checkpoints
from stages.common import ConfigError
from tests.flows.flowkit import alive_marked, demo_params, kill_marked, manifests

pytestmark = pytest.mark.slow
AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def _run(prefect_server, cfg: Path, log: Path, marker: str) -> subprocess.Popen:
    """`rlhf-flows run iterative-dpo --config cfg` against the server, in its own session (the test may kill it)."""
    env = {**prefect_server.env, **{k: os.environ[k] for k in AWS if k in os.environ}, "RLHF_TEST_MARKER": marker}
    return subprocess.Popen([str(Path(sys.executable).parent / "rlhf-flows"), "run", "iterative-dpo", "--config", str(cfg)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _saved_checkpoint(uri: str) -> bool:
    """A checkpoint under `uri` whose marker is written (a folder alone may be a save the kill interrupts: the
    rerun then rightly starts from step 0, which the clean-clone run under load once hit)."""
    fs, path = store.filesystem(uri)
    fs.invalidate_cache()
    return bool(fs.glob(f"{path}/*/{checkpoints.MARKER}"))


def _children(api: str, run_name: str) -> dict[str, list[dict]]:
    """The `rlhf-stage` flow runs of run `run_name` (tag run:NAME) by name, oldest first."""
    runs = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [f"run:{run_name}"]}},
                                                        "sort": "EXPECTED_START_TIME_ASC"}).json()
    out: dict[str, list[dict]] = {}
    for fr in runs:
        out.setdefault(fr["name"], []).append(fr)
    return out


def _parent_of(api: str, child: dict) -> str:
    """The flow run a child flow run belongs to (through run_deployment's task run in the parent)."""
    return httpx.get(f"{api}/task_runs/{child['parent_task_run_id']}").json()["flow_run_id"]


def test_stages_on_two_pools_then_a_dead_training_worker_and_a_resume(demo_run, prefect_server, s3_root, tmp_path):
    tag = uuid.uuid4().hex[:6]
    gen_pool, train_pool, run_name = f"gen-{tag}", f"train-{tag}", f"pools-{tag}"
    gen_worker, train_worker = f"w-gen-{tag}", f"w-train-{tag}"
    markers = {w: uuid.uuid4().hex for w in ("gen", "train", "flow")}
    aws = {k: os.environ[k] for k in AWS if k in os.environ}
    params = demo_params(demo=False, root=s3_root, run_name=run_name, iterations=1, pretrain_uri=demo_run.sft,
                         reward_uri=demo_run.reward, prompt_data=f"{demo_run.inputs}/prompts.jsonl",
                         eval_prompt_data=f"{demo_run.inputs}/eval_prompts.jsonl", gold_reward_file=demo_task.__file__,
                         sft={}, train_rm={}, lock_lease_s=15,
                         generate={"num_engines": 0, "best_of_n": 2, "rollout_batch_size": 16, "max_new_tokens": 12},
                         eval={"samples_per_prompt": 2, "max_new_tokens": 12}, reference={"max_len": 48},
                         dpo={"max_len": 48, "micro_train_batch_size": 8, "train_batch_size": 8, "save_steps": 1},
                         pools={"generate": gen_pool, "score": gen_pool, "reference": train_pool, "dpo": train_pool})
    cfg = tmp_path / "pools.yaml"
    cfg.write_text(yaml.safe_dump(params))
    run, api = f"{s3_root}/{run_name}", prefect_server.api
    for pool in (gen_pool, train_pool):
        prefect_server.prefect("work-pool", "create", pool, "--type", "process")

    def start_worker(kind: str, pool: str, name: str, n: int) -> subprocess.Popen:
        # polling every 5 s (Prefect's default: 10 s) is about 2.5 s less hand-over per stage, on average; the first
        # training worker's jobs take slow steps (rlhf_core.runtime.faults): the kill lands mid-training
        slow = {faults.STEP_SLEEP: "2.0"} if (kind, n) == ("train", 1) else {}
        return prefect_server.worker(pool, name, tmp_path / f"worker-{kind}-{n}.log",
                                     extra_env={**aws, "RLHF_TEST_MARKER": markers[kind], "PREFECT_WORKER_QUERY_SECONDS": "5",
                                                **slow})

    workers = {"gen": start_worker("gen", gen_pool, gen_worker, 1), "train": start_worker("train", train_pool, train_worker, 1)}
    try:
        # 1. generate / score on the gen pool, reference / dpo on the train pool; the train worker is killed with its
        #    flow run's process once dpo has saved a checkpoint
        proc = _run(prefect_server, cfg, tmp_path / "run-1.log", markers["flow"])
        deadline = time.time() + 420
        while not (_saved_checkpoint(f"{run}/iter-1/dpo/checkpoints") and not store.committed_any(f"{run}/iter-1/dpo")):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "run-1.log").read_text()[-3000:]
            time.sleep(0.3)
        os.killpg(workers["train"].pid, signal.SIGKILL)
        workers["train"].wait()
        deadline = time.time() + 120
        while (left := alive_marked(markers["train"])) and time.time() < deadline:
            time.sleep(1)
        assert not left, "alive 120 s after the train worker's group was killed:\n" + "\n".join(left)
        assert proc.wait(timeout=300) != 0
        log1 = (tmp_path / "run-1.log").read_text()
        assert re.search(rf"iter-1/dpo: no heartbeat from flow run .* on pool '{train_pool}' \(worker {train_worker}\)", log1), log1[-3000:]
        first = manifests(run)
        assert {"iter-1/generate", "iter-1/score", "iter-1/pairs", "iter-1/reference"} <= set(first)
        assert "iter-1/dpo" not in first  # the killed stage committed nothing

        # 2. the worker restarted under its name, the rerun resumes: only dpo runs again, from its checkpoint
        workers["train"] = start_worker("train", train_pool, train_worker, 2)
        proc = _run(prefect_server, cfg, tmp_path / "run-2.log", markers["flow"])
        assert proc.wait(timeout=600) == 0, (tmp_path / "run-2.log").read_text()[-3000:]
        log2 = (tmp_path / "run-2.log").read_text()
        second = manifests(run)
        for k, m in first.items():
            assert (second[k].fingerprint, second[k].created_at) == (m.fingerprint, m.created_at), k
        dpo = second["iter-1/dpo"].metrics
        assert dpo["resumed_from_step"] >= 1 and dpo["steps_done"] == dpo["planned_steps"], dpo
        for label in ("iter-1/generate", "iter-1/score", "iter-1/reference"):
            assert f"{label}: committed at" in log2, label  # skipped, and said so
        handover = {m.group(1): float(m.group(3)) for m in re.finditer(
            r"(iter-1/\w+): on pool \S+ \(worker (\S+)\), hand-over ([\d.]+) s", log1 + log2)}
        assert set(handover) == {"iter-1/generate", "iter-1/score", "iter-1/reference", "iter-1/dpo"}, handover
        print("hand-over seconds (run_deployment call to stage start):", handover)
        for label, pool, worker in (("iter-1/generate", gen_pool, gen_worker), ("iter-1/dpo", train_pool, train_worker)):
            fs, path = store.filesystem(f"{run}/_pools/{label.replace('/', '-')}.json")
            rec = json.loads(fs.cat_file(path))  # the record a rerun skips by, with who ran it and the hand-over
            assert (rec["pool"], rec["worker"], rec["created_at"]) == (pool, worker, second[label].created_at), rec
            assert rec["handover_s"] > 0 and rec["stage_s"] > 0, rec

        # 3. from the API: which worker ran which child flow run, each a child of its loop's flow run
        children = _children(api, run_name)
        ran = {name: [(fr["labels"].get("prefect.worker.name"), fr["state_type"]) for fr in frs] for name, frs in children.items()}
        assert ran == {"iter-1/generate": [(gen_worker, "COMPLETED")], "iter-1/score": [(gen_worker, "COMPLETED")],
                       "iter-1/reference": [(train_worker, "COMPLETED")],
                       "iter-1/dpo": [(train_worker, "CRASHED"), (train_worker, "COMPLETED")]}, ran
        fs, path = store.filesystem(f"{run}/report.json")
        report_run = json.loads(fs.cat_file(path))["flow_run_id"]
        dead = children["iter-1/dpo"][0]["id"]  # its task runs, left Running by the kill, were set Crashed too
        left = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [dead]}}}).json()
        assert left and {t["state_type"] for t in left} <= {"CRASHED", "COMPLETED"}, [(t["name"], t["state_type"]) for t in left]
        parents = {name: [_parent_of(api, fr) for fr in frs] for name, frs in children.items()}
        first_parent = parents["iter-1/generate"][0]
        assert parents["iter-1/score"] == parents["iter-1/reference"] == [first_parent]
        assert parents["iter-1/dpo"] == [first_parent, report_run] and first_parent != report_run
        for fid in (first_parent, report_run):
            fr = httpx.get(f"{api}/flow_runs/{fid}").json()
            assert fr["name"] == run_name and fr["parameters"]["params"]["pools"]["dpo"] == train_pool
    finally:
        for w in workers.values():  # all at once: a worker under load can take long to shut down
            try:
                os.killpg(w.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 20
        for w in workers.values():
            try:
                w.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)
        for m in markers.values():
            kill_marked(m)


def test_a_pool_the_server_lacks_is_refused_by_name_before_any_stage(prefect_server, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.conftest import free_port
    from flows import pools

    with pytest.raises(ConfigError, match=r"pools: 'dpoo' is no stage of flow iterative-dpo \(its stages: .*\bdpo\b"):
        pools.check({"dpoo": "gpu-train"}, "iterative-dpo")
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        with pytest.raises(ConfigError, match=r"pools: no Prefect API server answers at http://127\.0\.0\.1:\d+/api"):
            pools.check({"dpo": "gpu-train"}, "iterative-dpo")
    # the loop from its CLI: refused before any stage (nothing under root)
    prefect_server.prefect("work-pool", "create", "refusal-pool", "--type", "process", check=False)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(demo_params(root=str(tmp_path / "runs"), run_name="bad", demo=True,
                                              pools={"generate": "refusal-pool", "dpo": "no-such-pool"})))
    out = subprocess.run([str(Path(sys.executable).parent / "rlhf-flows"), "run", "iterative-dpo", "--config", str(cfg)],
                         env=prefect_server.env, capture_output=True, text=True, timeout=300)
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "no work pool 'no-such-pool' (for dpo) on " in said, said[-3000:]
    assert re.search(r"its pools: .*\brefusal-pool\b", said), said[-3000:]
    assert not (tmp_path / "runs" / "bad").exists()


def test_cancelling_the_loop_cancels_its_stage_on_a_pool(prefect_server, tiny, s3_root, tmp_path):
    """`prefect flow-run cancel` of a loop started by `rlhf-flows run` (no worker acts on it) while its generate waits
    on a pool: the child flow run is cancelled, the loop ends Cancelled and says why."""
    tag = uuid.uuid4().hex[:6]
    pool, run_name, marker = f"idle-{tag}", f"cancel-{tag}", uuid.uuid4().hex
    prefect_server.prefect("work-pool", "create", pool, "--type", "process")  # no worker: the child stays Scheduled
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_task.prompts(32, 0)))
    cfg = tmp_path / "cancel.yaml"
    cfg.write_text(yaml.safe_dump(demo_params(demo=False, root=s3_root, run_name=run_name, iterations=1,
                                              pretrain_uri=tiny.policy_uri, reward_uri=tiny.reward_uri,
                                              prompt_data=str(prompts), sft={}, train_rm={},
                                              generate={"num_engines": 0, "rollout_batch_size": 16}, pools={"generate": pool})))
    proc = _run(prefect_server, cfg, tmp_path / "run.log", marker)
    try:
        deadline = time.time() + 300
        while not (kids := _children(prefect_server.api, run_name)):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        child = kids["iter-1/generate"][0]
        parent = _parent_of(prefect_server.api, child)
        prefect_server.prefect("flow-run", "cancel", parent)
        assert proc.wait(timeout=120) == 2
        said = (tmp_path / "run.log").read_text()
        assert f"iter-1/generate: the loop's flow run was cancelled; its flow run on pool '{pool}' is cancelled" in said
        state = lambda fid: httpx.get(f"{prefect_server.api}/flow_runs/{fid}").json()["state_type"]  # noqa: E731
        assert (state(child["id"]), state(parent)) == ("CANCELLED", "CANCELLED")
        assert not store.committed_any(f"{s3_root}/{run_name}/iter-1/generate")
    finally:
        proc.kill()
        kill_marked(marker)
