"""Multi-node training without a shared disk, on one machine: two torchrun "nodes" (node_rank 0 started by
the sft stage, node_rank 1 by hand as an operator would on a second host), each with its own cache folder
(RLHF_FLOWS_CACHE) and nothing else in common but the S3 endpoint. Node 1 fetches the job spec, the data
and the model from the store; each rank uploads its own ZeRO shards. Both are SIGKILLed mid-run, and a
rerun on two fresh "nodes" (fresh caches) resumes from the store alone and finishes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.runtime import faults
from tests.conftest import free_port, upload_folder
from tests.flows.flowkit import kill_marked

pytestmark = pytest.mark.slow
ROOT = str(Path(__file__).resolve().parents[2])


def _wait(what, cond, procs, timeout=300.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (got := cond()):
            return got
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a node exited ({p.returncode}) while waiting for {what}:\n{p.stdout.read()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _exists(uri):
    fs, path = store.filesystem(uri)
    return fs.exists(path)


def _spec(uri):
    fs, path = store.filesystem(uri)
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def test_two_nodes_without_shared_disk_resume_from_the_store(tiny, s3_root, tmp_path):
    policy = upload_folder(tiny.policy_dir, f"{s3_root}/policy")  # a plain folder on S3: each node fetches it
    data = f"{s3_root}/sft.jsonl"
    fs, path = store.filesystem(data)
    fs.pipe_file(path, "".join(json.dumps(r) + "\n" for r in demo_task.sft_rows(64)).encode())
    out, port, marker = f"{s3_root}/sft", free_port(), f"RLHF_MULTINODE_TEST={uuid.uuid4().hex}"
    cfg = dict(policy_uri=policy, dataset_uri=data, output_uri=out, launcher="torchrun", num_gpus=1, num_nodes=2,
               master_addr="127.0.0.1", master_port=port, save_steps=2, train_batch_size=8,
               micro_train_batch_size=4, learning_rate=1e-3, max_len=48, zero_stage=2,
               input_template=demo_task.INPUT_TEMPLATE)
    spec_uri, marker_uri = f"{out}/_job/spec.json", f"{out}/checkpoints/step-2/_CHECKPOINT.json"

    def env(cache):
        return {**os.environ, "RLHF_FLOWS_CACHE": str(tmp_path / cache), "OMP_NUM_THREADS": "1",
                marker.split("=")[0]: marker.split("=")[1], "PYTHONPATH": ROOT,
                # run 1's steps slowed (runtime.faults): the kill lands after the step-2 checkpoint, mid-run
                faults.STEP_SLEEP: "1.0" if cache.endswith("-a") else ""}

    def node0(cache):
        code = f"from stages import sft; print(sft.run(sft.Config(**{cfg!r})).metrics)"
        return subprocess.Popen([sys.executable, "-c", code], env=env(cache), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def node1(cache):
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "1", "--nnodes", "2",
               "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "rlhf_core.train.entry", spec_uri]
        return subprocess.Popen(cmd, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    # run 1: both nodes up, killed after the step-2 checkpoint is committed
    a = node0("node0-a")
    _wait("the job spec", lambda: _spec(spec_uri), [a])
    b = node1("node1-a")
    try:
        _wait("the step-2 checkpoint", lambda: _exists(marker_uri), [a, b], timeout=600)
    finally:
        kill_marked(marker)
        for p in (a, b):
            p.wait(30)
    ckpt = json.loads(store.filesystem(marker_uri)[0].cat_file(store.filesystem(marker_uri)[1]))
    names = {f["path"] for f in ckpt["files"]}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names
    assert not store.committed_any(out)
    assert (tmp_path / "node1-a" / "models").is_dir()  # node 1 fetched the model into its own cache

    # run 2: two fresh nodes (new caches); everything comes from the store
    a = node0("node0-b")
    _wait("the resuming job spec", lambda: (_spec(spec_uri) or {}).get("resume"), [a])
    b = node1("node1-b")
    try:
        rc = a.wait(600)
        log = a.stdout.read()
        assert rc == 0, log[-3000:]
        assert b.wait(60) == 0
    finally:
        kill_marked(marker)
    m = store.read_manifest(out)
    assert m.metrics["resumed_from_step"] >= 2 and m.metrics["steps_done"] == m.metrics["planned_steps"] == 8
    assert (tmp_path / "node1-b" / "jobs").is_dir() and not _exists(f"{out}/_job")
