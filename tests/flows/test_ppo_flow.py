"""The `ppo` flow: configs/demo_ppo.yaml through `rlhf-flows run ppo` (from the shared demo run's SFT policy and
reward model, which demo_ppo.yaml's sft/train_rm settings equal), SIGKILLed mid-iteration 2 once its ppo
stage has a store checkpoint; the rerun reuses every committed stage, resumes the ppo stage from its
checkpoint, and the held-out gold reward rises every iteration. Bad flow settings are refused before work."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from flows import common, ppo as ppo_flow
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.train import checkpoints
from stages.common import ConfigError, load_config
from tests.flows.flowkit import kill_marked, manifests
from tests.flows.test_resume import _kill_when, _start

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo_ppo.yaml"


@pytest.mark.slow
def test_ppo_demo_learns_every_iteration_and_resumes_after_sigkill(demo_run, tmp_path):
    raw = yaml.safe_load(CONFIG.read_text())
    params = {**raw, "demo": False, "root": str(tmp_path / "runs"), "run_name": "ppo", "iterations": 2,
              "pretrain_uri": demo_run.sft, "reward_uri": demo_run.reward, "prompt_data": f"{demo_run.inputs}/prompts.jsonl",
              "eval_prompt_data": f"{demo_run.inputs}/eval_prompts.jsonl", "gold_reward_file": demo_task.__file__,
              "sft": {}, "train_rm": {}}
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(yaml.safe_dump(params))
    run = tmp_path / "runs" / "ppo"

    # 1. killed in iteration 2's ppo stage, after its first store checkpoint
    marker = uuid.uuid4().hex
    proc = _start(cfg, tmp_path, marker, flow="ppo", step_sleep=1.0)  # slow steps so the kill lands mid-stage
    stage = run / "iter-2" / "ppo"
    _kill_when(proc, lambda: any((stage / "checkpoints").glob(f"*/{checkpoints.MARKER}"))
               and not (stage / store.MANIFEST).exists(), marker, "iteration 2's ppo checkpoint")
    first = manifests(str(run))
    assert {"prompts", "eval_prompts", "iter-0/eval", "iter-1/ppo", "iter-1/eval"} <= set(first)
    assert "iter-2/ppo" not in first  # a killed stage is never committed

    # 2. rerun to the end: nothing committed is redone, the ppo stage continues from its checkpoint
    marker = uuid.uuid4().hex
    proc = _start(cfg, tmp_path, marker, flow="ppo")
    assert proc.wait(timeout=900) == 0, (tmp_path / f"run-{marker[-4:]}.log").read_text()[-3000:]
    kill_marked(marker)
    second = manifests(str(run))
    for k, m in first.items():
        assert (second[k].fingerprint, second[k].created_at) == (m.fingerprint, m.created_at), k
    trained = second["iter-2/ppo"].metrics
    assert trained["resumed_from_step"] == 4 and trained["steps_done"] == trained["planned_steps"] == 8
    assert {i["name"]: i["uri"] for i in second["iter-2/ppo"].inputs}["policy"].rstrip("/").endswith("iter-1/ppo")
    report = json.loads((run / "report.json").read_text())
    gold = [r["gold_reward"] for r in report["iterations"]]
    print("ppo flow held-out gold per iteration", gold)
    assert report["stop_reason"] == "completed all iterations" and len(gold) == 3
    assert gold[1] > gold[0] + 0.05 and gold[2] > gold[1] + 0.05  # rises every iteration
    assert all(r["ppo_steps"] == 8 for r in report["iterations"][1:])
    steps = report["steps"]  # every training step of every iteration, plotted in reward.png's third panel
    assert [s["step"] for s in steps] == list(range(1, 17)) and [s["iteration"] for s in steps] == [1] * 8 + [2] * 8
    assert all(isinstance(s["reward"], float) and isinstance(s["kl"], float) for s in steps)
    assert (run / "reward.png").exists() and not (run / "_LOCK.json").exists()


@pytest.mark.parametrize("over, message", [
    ({"ppo": {"policy_uri": "x"}}, "ppo.policy_uri is set by the flow"),
    ({"ppo": {"advantage_estimator": "group_norm", "n_samples_per_prompt": 1}}, "n_samples_per_prompt >= 2"),
    ({"ppo": {"actor_learning_rat": 1e-3}}, "ppo.actor_learning_rat: unknown field"),
])
def test_bad_ppo_settings_are_refused_by_name_before_work(over, message):
    with pytest.raises(ConfigError, match=message):  # typed sections refuse some when read, the stage check the rest
        p = load_config(ppo_flow.Params, CONFIG, over)
        common.validate(p, "ppo", ppo_flow.checks(p))
