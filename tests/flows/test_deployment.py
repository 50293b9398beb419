"""Deployments for real: `prefect server start` (the session's, tests/conftest.py), a process work pool and worker, `prefect deploy --all` from
deployments/prefect.yaml, and `prefect deployment run 'iterative-dpo/demo'` and `'ppo/demo'` to completion.
The server and worker listen on 127.0.0.1, die with this process, and are stopped by pid."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store
from tests.flows.flowkit import kill_marked

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_deploy_all_and_run_iterative_dpo_and_ppo_through_a_process_worker(demo_run, prefect_server, tmp_path):
    bindir, port, marker = prefect_server.bindir, prefect_server.port, uuid.uuid4().hex
    env = dict(prefect_server.env, RLHF_TEST_MARKER=marker)
    prefect = functools.partial(prefect_server.prefect, env=env)
    procs = []
    try:
        prefect("work-pool", "create", "rlhf-cpu", "--type", "process")  # the README's CPU path: one process pool
        out = prefect("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        for name in ("iterative-dpo/demo", "iterative-dpo/nightly", "raft/demo", "conditional-sft/demo",
                     "ppo/demo", "ppo/nightly", "iterative-dpo/on-new-data"):
            assert f"Deployment '{name}' successfully created" in out, name
        prefect("work-pool", "create", "rlhf-gpu-docker", "--type", "docker")  # the GPU image's file and pool
        assert "Deployment 'iterative-dpo/gpu' successfully created" in prefect("deploy", "--all", "--prefect-file",
                                                                                 "deployments/gpu.yaml")
        nightly = prefect("deployment", "inspect", "iterative-dpo/nightly")
        assert "0 3 * * *" in nightly and "'active': False" in nightly  # scheduled retraining, paused by default
        nightly = prefect("deployment", "inspect", "ppo/nightly")
        assert "30 3 * * *" in nightly and "'active': False" in nightly

        # The run form is typed per stage: the server holds each stage section's fields with defaults and
        # descriptions, refuses a typo or a wrong type in a section, and a key the flow wires in is not offered
        import httpx

        dep = httpx.get(f"http://127.0.0.1:{port}/api/deployments/name/iterative-dpo/demo").json()
        defs = dep["parameter_openapi_schema"]["definitions"]
        beta = defs["DpoSettings"]["properties"]["beta"]
        assert beta["default"] == 0.1 and beta["type"] == "number" and "beta" in beta["description"], beta
        assert defs["DpoSettings"]["additionalProperties"] is False
        assert "policy_uri" not in defs["DpoSettings"]["properties"] and "output_uri" not in defs["GenerateSettings"]["properties"]
        for bad, named in (({"dpo": {"betta": 0.1}}, "betta"), ({"dpo": {"learning_rate": "abc"}}, "abc")):
            out = subprocess.run([str(bindir / "prefect"), "--no-prompt", "deployment", "run", "iterative-dpo/demo",
                                  "--params", json.dumps({"params": bad})], env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=120)
            said = out.stdout + out.stderr
            assert out.returncode != 0 and named in said and "Created flow run" not in said, said[-2000:]
        procs.append(prefect_server.worker("rlhf-cpu", "cpu-worker", tmp_path / "worker.log", extra_env={"RLHF_TEST_MARKER": marker}))
        params = {"demo": False, "root": str(tmp_path / "runs"), "run_name": "deployed", "iterations": 1,
                  "pretrain_uri": demo_run.sft, "reward_uri": demo_run.reward, "sft": {}, "train_rm": {},
                  "prompt_data": f"{demo_run.inputs}/prompts.jsonl",
                  "eval_prompt_data": f"{demo_run.inputs}/eval_prompts.jsonl", "gold_reward_file": demo_task.__file__,
                  "generate": {"num_engines": 0, "best_of_n": 2, "rollout_batch_size": 16, "max_new_tokens": 12},
                  "eval": {"samples_per_prompt": 2, "max_new_tokens": 12},
                  "dpo": {"max_len": 48, "micro_train_batch_size": 8, "train_batch_size": 8}, "reference": {"max_len": 48}}
        out = prefect("deployment", "run", "iterative-dpo/demo", "--params", json.dumps({"params": params}),
                      "--watch", "--watch-timeout", "900", timeout=960)
        assert "Completed" in out, out[-2000:]
        report = json.loads((tmp_path / "runs" / "deployed" / "report.json").read_text())
        assert report["stop_reason"] == "completed all iterations" and len(report["iterations"]) == 2
        assert store.committed_any(str(tmp_path / "runs" / "deployed" / "iter-1" / "dpo"))
        # what the UI shows of that flow run, from the server's API: task runs named and tagged by iteration,
        # one card per kind (updated in place, not a version per publish), one summary line per iteration and
        # no launcher / row-count / empty lines at INFO in the run log
        api, run_id = f"http://127.0.0.1:{port}/api", report["flow_run_id"]
        of_run = {"flow_runs": {"id": {"any_": [run_id]}}}
        tasks = {t["name"]: t for t in httpx.post(f"{api}/task_runs/filter", json=of_run).json()}
        assert {"prompts", "iter-0/eval", "iter-1/generate", "iter-1/dpo", "iter-1/eval"} <= set(tasks), sorted(tasks)
        assert sorted(tasks["iter-1/dpo"]["tags"]) == ["iter:1", "run:deployed", "stage:dpo"]
        cards = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
        assert sorted(a["key"] for a in cards) == ["iterative-dpo-iterations", "iterative-dpo-plot", "iterative-dpo-progress",
                                                  "iterative-dpo-report"], [(a["key"], a["created"]) for a in cards]
        rows = next(a for a in cards if a["key"] == "iterative-dpo-iterations")["data"]
        assert [r["iteration"] for r in (json.loads(rows) if isinstance(rows, str) else rows)] == [0, 1]
        logs = [(e["level"], e["message"]) for e in httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {
            "any_": [run_id]}}, "limit": 200}).json()]
        said = [m for _, m in logs if m.startswith("iteration ")]
        assert len(said) == 2 and all(re.fullmatch(r"iteration \d: gold \S+, RM \S+, KL \S+, length \S+ tokens, \d+\.\d s", m)
                                      for m in said), said
        noise = [m for level, m in logs if level >= 20 and (not m.strip() or "[launch.py" in m or m.startswith("progress "))]
        assert not noise and any(m.startswith("step ") for _, m in logs), noise[:10]
        # online RL through the same worker: one small iteration of ppo/demo (its Ray job inside the flow run)
        ppo = {k: params[k] for k in ("demo", "root", "pretrain_uri", "reward_uri", "sft", "train_rm", "prompt_data",
                                      "eval_prompt_data", "gold_reward_file", "eval")}
        ppo.update(run_name="deployed-ppo", iterations=1,
                   ppo={"advantage_estimator": "group_norm", "n_samples_per_prompt": 2, "max_samples": 16,
                        "rollout_batch_size": 8, "train_batch_size": 16, "micro_train_batch_size": 8,
                        "generate_max_len": 8, "reward_max_len": 48, "actor_learning_rate": 5.0e-4})
        out = prefect("deployment", "run", "ppo/demo", "--params", json.dumps({"params": ppo}),
                      "--watch", "--watch-timeout", "900", timeout=960)
        assert "Completed" in out, out[-2000:]
        report = json.loads((tmp_path / "runs" / "deployed-ppo" / "report.json").read_text())
        assert report["stop_reason"] == "completed all iterations" and len(report["iterations"]) == 2
        assert store.read_manifest(str(tmp_path / "runs" / "deployed-ppo" / "iter-1" / "ppo")).metrics["steps_done"] == 2
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        kill_marked(marker)
