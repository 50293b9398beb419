"""Evaluation inside a ppo run (issue 45 item 1; OpenRLHF's --eval_dataset / --eval_steps / --ckpt.best_metric_key):
held-out prompts sampled through the rollout engines every eval_steps steps and after the last, OpenRLHF's pass@k
figures in the training log, the best policy kept under best/, a resumed run keeping its best so far; and a step you
can see (item 5): its FLOPs, tokens per second per device of the run, MFU, a sample of its rollouts per logged step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core import store
from rlhf_core.demo import demo_task
from rlhf_core.ppo import loop
from rlhf_core.ppo.rollout import eval_figures
from stages import ppo
from tests.conftest import reward_failing_after_a_checkpoint


def test_eval_figures_are_openrlhfs_pass_at_k_per_prompt_and_per_source():
    """3 prompts x 4 samples, rewards [1,0,0,0], [0,0,1,1], [0,0,0,0]: pass@4 = mean of the maxima (1 + 1 + 0) / 3;
    pass@1 = mean of the means (0.25 + 0.5 + 0) / 3 = 0.25; lengths 3,4,5,6 / 1,1,1,1 / 2,2,2,2: mean 30 / 12 = 2.5;
    one of 12 samples cut: 1/12. Prompts 0 and 2 from source a (pass@4 1/2, pass@1 0.125), prompt 1 from b."""
    got = eval_figures([1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0], 4, ["s3://x/a", "s3://x/b", "s3://x/a"],
                       [3, 4, 5, 6, 1, 1, 1, 1, 2, 2, 2, 2], [True] + [False] * 11)
    assert got == pytest.approx({"eval_pass4": 2 / 3, "eval_pass1": 0.25, "eval_response_length": 2.5,
                                 "eval_truncated_rate": 1 / 12, "eval_a_pass4": 0.5, "eval_a_pass1": 0.125,
                                 "eval_a_response_length": 3.25, "eval_a_truncated_rate": 0.125, "eval_b_pass4": 1.0,
                                 "eval_b_pass1": 0.5, "eval_b_response_length": 1.0, "eval_b_truncated_rate": 0.0})
    one = eval_figures([0.2, 0.6], 1, [None, None], [1, 1], [False, False])  # n 1: pass@1 is the mean reward
    assert one["eval_pass1"] == pytest.approx(0.4) and set(one) == {"eval_pass1", "eval_response_length",
                                                                    "eval_truncated_rate"}


def test_the_settings_go_together_and_a_best_metric_must_be_a_figure(tmp_path):
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", n_samples_per_prompt=2,
                advantage_estimator="group_norm")
    with pytest.raises(ValueError, match="eval_prompts_uri and eval_steps go together"):
        ppo.Config(**base, eval_prompts_uri="held-out.jsonl")
    with pytest.raises(ValueError, match="eval_prompts_uri and eval_steps go together"):
        ppo.Config(**base, eval_steps=2)
    with pytest.raises(ValueError, match="save_best_metric eval_pass4: the best policy is chosen among evaluations"):
        ppo.Config(**base, save_best_metric="eval_pass4")
    cfg = ppo.Config(**base, eval_prompts_uri="held-out.jsonl", eval_steps=1, save_best_metric="eval_pass9")
    with pytest.raises(ValueError, match="save_best_metric eval_pass9 is not a figure of the evaluation \\(it has "
                                         "eval_pass1, eval_pass4"):
        loop._keep_best(cfg, None, object(), None, {"eval_pass1": 0.5, "eval_pass4": 1.0}, 3)
    assert loop._keep_best(cfg.model_copy(update={"save_best_metric": "none"}), None, object(), None, {}, 3) is None


@pytest.mark.slow
def test_a_run_evaluates_on_schedule_keeps_its_best_and_a_resume_keeps_it_too(tiny, tmp_path):
    """4 steps (16 prompts, 4 per step), held-out prompts evaluated after every second step and the last; a first
    attempt fails in step 3, after its step-2 checkpoint; the rerun resumes: the training log has the evaluation at
    steps 2 and 4 (the first from the failed attempt, restored), the best of them is the manifest's, best/best.json's
    and its policy is under best/ in the artifact (the final policy when the best was the last). Every step logs its
    FLOPs (here 8 N per token: the rollout's forward, the policy's training forward and backward; the first training
    forward serves as the old log-probs; no reference, critic or reward model), tokens per second over the run's 2
    devices (policy and engine bundles) and MFU against peak_tflops_per_gpu; every logged step (2 and 4, log_steps 2)
    left 3 rollouts in rollouts/, the failed attempt's included."""
    prompts, held = tmp_path / "prompts.jsonl", tmp_path / "held-out.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(16, 0)))
    held.write_text("\n".join(json.dumps({**r, "source": "demo"}) for r in demo_task.prompts(3, 0, held_out=True)))
    out = tmp_path / "out"
    fail = reward_failing_after_a_checkpoint(tmp_path / "fail_in_step_3.py", out, tmp_path / "armed")
    cfg = ppo.Config(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(out),
                     reward_func_path=str(fail), input_template=demo_task.INPUT_TEMPLATE, generate_max_len=6,
                     advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                     micro_train_batch_size=8, lr_warmup_ratio=0.0, init_kl_coef=0.0, rollout_backend="hf",
                     eval_prompts_uri=str(held), eval_steps=2, eval_n_samples_per_prompt=3, eval_temperature=0.8,
                     eval_generate_max_len=4, save_steps=2, log_steps=2, rollout_samples_per_step=3,
                     peak_tflops_per_gpu=0.5)
    (tmp_path / "armed").write_text("")
    with pytest.raises(Exception, match="the node went away in step 3"):
        ppo.run(cfg)
    (tmp_path / "armed").unlink()
    m = ppo.run(cfg)
    assert m.metrics["resumed_from_step"] == 2 and m.metrics["steps_done"] == 4
    history = json.loads((out / "training_log.json").read_text())
    evaluated = {h["step"]: h for h in history if "eval_pass1" in h}
    assert sorted(evaluated) == [2, 4]
    for h in evaluated.values():
        assert set(h) >= {"eval_pass3", "eval_pass1", "eval_response_length", "eval_truncated_rate", "eval_s"}
        assert h["eval_pass1"] <= h["eval_pass3"] and 0 < h["eval_response_length"] <= 4  # a mean, a max
        assert "eval_demo_pass1" not in h  # one source: no per-source figures
    best_step = max(evaluated, key=lambda s: (evaluated[s]["eval_pass1"], -s))
    want = {"metric": "eval_pass1", "value": evaluated[best_step]["eval_pass1"], "step": best_step}
    assert m.metrics["best_eval"] == want and json.loads((out / "best" / "best.json").read_text()) == want
    assert m.metrics["eval_last"]["eval_pass1"] == evaluated[4]["eval_pass1"]
    listed = {f["path"] for f in m.files}
    assert {"best/best.json", "best/config.json"} <= listed and any(p.startswith("best/model") for p in listed)
    best, final = load_file(str(out / "best" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    same = all(torch.equal(best[k], final[k]) for k in final)
    assert same == (best_step == 4)
    store.read_manifest(str(out))  # the commit lists what the store holds (sizes checked)

    from transformers import AutoModelForCausalLM

    N = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir)).parameters())
    for h in history:
        tokens = h["step_tflops"] * 1e12 / (8 * N)  # forward 2N + train 6N per token of the batch
        assert h["old_logp_reused"] and 8 * 2 <= tokens <= 8 * 80 and tokens == pytest.approx(round(tokens))  # 8 rows
        work_s = h["step_s"] - h.get("eval_s", 0.0)
        assert h["devices"] == 2 and h["tokens_per_s_per_device"] == pytest.approx(tokens / work_s / 2)
        assert h["mfu"] == pytest.approx(h["step_tflops"] / work_s / (2 * 0.5))
    assert sorted(p for p in listed if p.startswith("rollouts/")) == ["rollouts/step-000002.parquet",
                                                                      "rollouts/step-000004.parquet"]
    import pyarrow.parquet as pq

    sample = pq.read_table(out / "rollouts" / "step-000004.parquet").to_pylist()
    assert len(sample) == 3 and [r["sample_index"] for r in sample] == [0, 1, 0]
    assert set(sample[0]) == {"step", "prompt_index", "sample_index", "prompt", "completion", "reward", "advantage",
                              "length", "stop_reason"}
    assert all(r["step"] == 4 and 1 <= r["length"] <= 6 and r["stop_reason"] in ("stop", "length") for r in sample)
    assert sample[0]["prompt"] == sample[1]["prompt"] and sample[0]["advantage"] == pytest.approx(-sample[1]["advantage"])
