"""The memory plan (rlhf_core.ppo.plan, `rlhf-flows plan`): its predictions beside the peaks a GPU measured
(benchmarks/gpu/measured_peaks.json, the lent H200's figures of 2026-11-26), the shipped 8B hybrid config against
80 GB GPUs in the phase order the roles now follow and in the order before issue 35, the phase states the driver
runs, the command line and the stage's refusal before Ray starts. Pure arithmetic on config.json files: no GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.ppo import plan
from stages import ppo

ROOT = Path(__file__).resolve().parents[3]
MEASURED = json.loads((ROOT / "benchmarks" / "gpu" / "measured_peaks.json").read_text())
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"])


def config(**over) -> ppo.Config:
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", bf16=True, init_kl_coef=0.0,
                advantage_estimator="group_norm", n_samples_per_prompt=8, rollout_batch_size=16, train_batch_size=128)
    return ppo.Config.model_construct(**{**base, **over})


def holding(p: plan.Plan, phase: str, role: str) -> dict:
    return next(h.bytes for h in p.rows if h.phase == phase and h.role == role)


@pytest.mark.parametrize("peak", MEASURED["peaks"], ids=[p["id"] for p in MEASURED["peaks"]])
def test_the_plan_predicts_each_peak_the_gpu_measured_within_15_percent(peak):
    """Each figure recomputed from the plan of the run that measured it (bf16, its shape's config.json): the
    reference's experience forward above its weights (8 x 1024 tokens through the chunked LM head), the hf
    engine's rollout above what it held before (KV cache and per-step logits), and the learner's whole train
    peak (weights, ZeRO-2 optimizer and gradient buffers, one micro-batch's activations) plus the hf engine's
    weights, which shared its process."""
    shape = plan.shape(MEASURED["shapes"][peak["shape"]])
    if peak["id"] == "experience_forward":
        cfg = config(init_kl_coef=0.01, micro_rollout_batch_size=peak["rows"], prompt_max_len=peak["tokens_per_row"] - 1,
                     generate_max_len=1, micro_train_batch_size=peak["rows"])
        got = holding(plan.plan(cfg, {"policy": shape}, 141), "train", "reference")["activations"]
    elif peak["id"] == "hf_rollout":
        cfg = config(rollout_batch_size=peak["prompts"], n_samples_per_prompt=peak["n"], prompt_max_len=peak["prompt_len"],
                     generate_max_len=peak["new_tokens"])
        h = holding(plan.plan(cfg, {"policy": shape}, 141), "generate", "rollout0")
        got = h["kv_cache"] + h["activations"]
    else:
        cfg = config(zero_stage=peak["zero_stage"], micro_train_batch_size=peak["micro"], micro_rollout_batch_size=peak["micro"],
                     prompt_max_len=peak["prompt_len"], generate_max_len=peak["new_tokens"], gradient_checkpointing=False)
        p = plan.plan(cfg, {"policy": shape}, 141)
        learner = holding(p, "train", "policy0")
        got = sum(v for k, v in learner.items() if k != "context") + holding(p, "train", "rollout0")["weights"]
    measured = peak["gb"] * 1e9
    assert abs(got - measured) <= 0.15 * measured, (peak["id"], got / 1e9, peak["gb"])


def test_the_8b_hybrid_config_fits_80gb_and_the_order_before_issue_35_did_not():
    """configs/reinforce_baseline_llama3_8b_hybrid.yaml (Llama-3-8B policy and reward model, 8 ranks ZeRO-3, 4 vLLM
    engines of TP 2 at 0.6, everything colocated, both sleeps): its peak is the generate phase on GPU 0 (vLLM's
    share, the reward model, the sleeping learner's and the reference's partitions), under 80 GB. In the order
    before (learners awake with their optimizer states and vLLM fully awake for the sync, the object-store path
    gathering all 16 GB on every rank) the sync phase peaked at about 97 GB on GPU 0 (the issue counted ~98) and
    82 GB on the others: refused, naming the phase, the GPU and its holders."""
    from flows import ppo as flow
    from stages.common import load_config

    p = load_config(flow.Params, ROOT / "configs" / "reinforce_baseline_llama3_8b_hybrid.yaml")
    cfg = ppo.Config.model_construct(**{**ppo.Config.model_construct().model_dump(), **p.ppo.model_dump(),
                                        "reward_model_uri": "rm"})
    shapes = {"policy": plan.shape(LLAMA3_8B), "reward": [plan.shape(LLAMA3_8B, "score")]}
    now = plan.plan(cfg, shapes, 80)
    assert now.fits() and now.peak()[:2] == ("generate", 0) and 60 * plan.GB < now.peak()[2] < 80 * plan.GB
    engine = holding(now, "sync", "rollout0")
    assert engine["weights"] > 0 and "kv_cache" not in engine  # weights only for the sync
    assert "optimizer" not in holding(now, "sync", "policy0") and "optimizer" not in holding(now, "generate", "policy3")
    assert holding(now, "sync", "policy0")["gather"] <= 2 * 128256 * 4096 * 2  # a bucket: the embedding, gathered + flat
    before = plan.plan(cfg.model_copy(update={"weight_sync_backend": "object_store"}), shapes, 80, legacy=True)
    phase, gpu, peak = before.peak()
    assert (phase, gpu) == ("sync", 0) and 95 * plan.GB < peak < 99 * plan.GB and not before.fits()
    assert 81 * plan.GB < before.total("sync", 1) < 84 * plan.GB
    assert plan.check(cfg, shapes, 80) is not None
    with pytest.raises(plan.PlanError, match=r"peaks at 96.7 GB on GPU 0 in phase sync, over its 80 GB: rollout0 48.5 "
                                             r"\(kv_cache 40.5.*policy0 31.3 \(gather 15.0, optimizer 11.2"):
        raise plan.PlanError(before.over())


def test_the_phase_states_are_openrlhfs_order():
    """Learners asleep for generate and sync (optimizer states offloaded, bf16 weights kept to send), awake for
    train; engines asleep for train, weights only for sync, KV cache back for generate; the legacy order kept
    learners awake and woke engines fully for the sync. Without the flags every role stays awake."""
    both = config(deepspeed_enable_sleep=True, vllm_enable_sleep=True)
    assert [plan.role_states(both, p) for p in plan.PHASES] == [
        {"learner": "asleep", "engine": "awake"}, {"learner": "awake", "engine": "asleep"},
        {"learner": "asleep", "engine": "weights"}]
    assert plan.role_states(both, "sync", legacy=True) == {"learner": "awake", "engine": "awake"}
    assert {plan.role_states(config(), p)["engine"] for p in plan.PHASES} == {"awake"}
    assert plan.transitions("awake", "asleep") == [("sleep", None)]
    assert plan.transitions("asleep", "weights") == [("wake_up", ["weights"])]
    assert plan.transitions("weights", "awake") == [("wake_up", ["kv_cache"])]
    assert plan.transitions("asleep", "awake") == [("wake_up", None)] and plan.transitions("awake", "awake") == []


def test_shapes_count_parameters_as_the_models_do(tiny):
    """The parameter count from config.json equals the model's own, for the tiny Llama policy (LM head) and its
    reward model (score head) of the test zoo, and for a Qwen2 shape (q/k/v biases, tied embedding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    for folder, head, cls in ((tiny.policy_dir, "lm", AutoModelForCausalLM),
                              (tiny.reward_dir, "score", AutoModelForSequenceClassification)):
        cfg = json.loads((Path(folder) / "config.json").read_text())
        model = cls.from_pretrained(str(folder))
        assert plan.shape(cfg, head).params == sum(p.numel() for p in model.parameters())
    qwen = {**MEASURED["shapes"]["qwen2-0.5b"], "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**qwen))
    assert plan.shape(qwen).params == sum(p.numel() for p in model.parameters())
    with pytest.raises(plan.PlanError, match="no hidden_size"):
        plan.shape({"model_type": "bert"}, where="bert/config.json")


def test_the_plan_command_prints_the_table_and_exits_2_over_the_gpus(tmp_path, capsys):
    """`rlhf-flows plan` on the shipped flow config with the models' config.json in local folders: the table per
    phase, GPU and role, and the peak; with 40 GB GPUs exit 2 naming the phase, the GPU and the holders; the legacy
    order over 80 GB."""
    from flows import cli

    for name, head in (("policy", "LlamaForCausalLM"), ("rm", "LlamaForSequenceClassification")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**LLAMA3_8B, "architectures": [head]}))
    args = ["plan", str(ROOT / "configs" / "reinforce_baseline_llama3_8b_hybrid.yaml"),
            f"pretrain_uri={tmp_path / 'policy'}", f"reward_uri={tmp_path / 'rm'}"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["phase", "gpus", "role", *plan.KINDS, "total"]
    assert "generate  0 " in out and "sync      1-7" not in out and out.rstrip().endswith("of 80 GB per GPU: fits")
    assert cli.main([*args, "--gpu-memory-gb", "40"]) == 2
    err = capsys.readouterr().err
    assert "rlhf-flows: error: planned GPU memory peaks at" in err and "over its 40 GB" in err
    assert cli.main([*args, "--legacy-order"]) == 2 and "in phase sync, over its 80 GB" in capsys.readouterr().err
    assert cli.main(["plan", str(ROOT / "configs" / "reinforce_baseline_llama3_8b_hybrid.yaml"),
                     f"pretrain_uri={tmp_path / 'nowhere'}", f"reward_uri={tmp_path / 'rm'}"]) == 2
    assert "nowhere/config.json cannot be read" in capsys.readouterr().err


def test_the_stage_refuses_a_run_over_its_gpus_before_ray_starts(tiny, tmp_path):
    """A run planned for GPUs of a given size (a cluster's: accelerator gpu, ray_address; neither contacted) whose
    peak is over them fails in the stage's checks, naming the phase, the GPU and the holders, before Ray starts
    (no Ray here) and before anything is written under its output."""
    import ray

    from rlhf_core.demo import demo_task

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(16, 0)))
    cfg = ppo.Config(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(tmp_path / "out"),
                     reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE,
                     advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=8, train_batch_size=16,
                     micro_train_batch_size=8, accelerator="gpu", ray_address="10.0.0.1:6379", gpu_memory_gb=0.4)
    with pytest.raises(plan.PlanError, match=r"planned GPU memory peaks at 0.7 GB on GPU 0 in phase train, over its "
                                             r"0.4 GB: policy0 0.7 \(context 0.5, activations 0.2\)"):
        ppo.run(cfg)
    assert not ray.is_initialized() and not (tmp_path / "out").exists()
