"""The memory plan (rlhf_core.ppo.plan, `rlhf-flows plan`): its predictions beside the peaks a GPU measured
(benchmarks/gpu/measured_peaks.json, the lent H200's figures of 2026-11-26), the shipped 8B hybrid config against
80 GB GPUs in the phase order the roles now follow and in the order before issue 35, the phase states the driver
runs, the command line and the stage's refusal before Ray starts. Pure arithmetic on config.json files: no GPU."""
from __future__ import annotations

import json
import re
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


def holding(p: plan.Plan, moment: str, role: str) -> dict:
    return next(h.bytes for h in p.rows if h.moment == moment and h.role == role)


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


def hybrid_8b(**over) -> ppo.Config:
    """configs/reinforce_baseline_llama3_8b_hybrid.yaml's ppo stage (Llama-3-8B policy and reward model)."""
    from flows import ppo as flow
    from stages.common import load_config

    p = load_config(flow.Params, ROOT / "configs" / "reinforce_baseline_llama3_8b_hybrid.yaml")
    return ppo.Config.model_construct(**{**ppo.Config.model_construct().model_dump(), **p.ppo.model_dump(),
                                         "reward_model_uri": "rm", **over})


SHAPES_8B = {"policy": plan.shape(LLAMA3_8B), "reward": [plan.shape(LLAMA3_8B, "score")]}


def test_the_8b_hybrid_config_fits_80gb_at_every_moment_and_the_orders_before_did_not():
    """configs/reinforce_baseline_llama3_8b_hybrid.yaml (Llama-3-8B policy and reward model, 8 ranks ZeRO-3, 4 vLLM
    engines of TP 2 at 0.6, everything colocated, both sleeps, the reward model sharded over the 8 ranks as OpenRLHF's
    script shards it): every moment fits the 79.6 GB CUDA shows of an 80 GB H100; the peak is generate (vLLM's share,
    the reward and reference partitions, the sleeping learner's weights, contexts and NCCL). The sync's second wave
    holds the engine's weights only beside sleeping learners; entering train, the engines' release wave is the fuller.
    With the reward model on one rank (the config before issue 41) the run still fits now, while in the order before
    issues 35 and 41 (phase changes in one wave, the setup racing vLLM's profiling, a resume beside awake engines with
    DeepSpeed's offload buffers on the GPU) entering train from step 2 held the engines' awake share plus the learners'
    reload (the issue's 82.6 GB, with contexts and NCCL here) and the resume more: refused, naming the moment, the GPU
    and its holders."""
    now = plan.plan(hybrid_8b(), SHAPES_8B, 80)
    assert now.usable_gb == pytest.approx(79.6) and now.fits()
    moment, gpu, peak = now.peak()
    assert moment == "generate" and 57 * plan.GB < peak < 61 * plan.GB
    assert {now.total("generate", g) for g in range(8)} == {peak}  # a reward partition on every GPU
    sync = {h.role: h.bytes for h in now.holders("sync", 0, wave=1)}
    assert "kv_cache" not in sync["rollout0"] and sync["rollout0"]["weights"] > 0
    assert "optimizer" not in sync["policy0"] and sync["policy0"]["gather"] <= 2 * 128256 * 4096 * 2
    assert now.total("enter train", 0) == now.total("enter train", 0, 0) > now.total("enter train", 0, 1)
    asleep = {h.role: h.bytes for h in now.holders("train", 0)}["rollout0"]
    assert asleep == {"context": int((plan.CONTEXT_GB + plan.SLEEP_RESIDUE_GB) * plan.GB), "nccl": int(plan.NCCL_COMM_GB * plan.GB)}

    one_rm = hybrid_8b(reward_num_gpus_per_node=1)
    now, before = plan.plan(one_rm, SHAPES_8B, 80), plan.plan(one_rm, SHAPES_8B, 80, legacy=True)
    assert now.fits() and now.peak()[:2] == ("generate", 0)
    reloaded = {h.role: h.bytes for h in now.holders("enter train", 0, wave=1)}["policy0"]
    # one wave: what the engines' release wave holds, plus the learner's reload beside it
    assert before.total("enter train", 0) == now.total("enter train", 0, 0) + reloaded["optimizer"] + reloaded["grads"]
    assert 82 * plan.GB < before.total("enter train", 0) < 85 * plan.GB
    assert before.total("resume", 0) > 88 * plan.GB and now.total("resume", 0) < 40 * plan.GB
    assert before.peak()[:2] == ("resume", 0) and not before.fits()
    assert re.match(r"planned GPU memory peaks at 90.\d GB on GPU 0 at resume, over the 79.6 GB of 80 CUDA can "
                    r"use: rollout0 48.8 \(kv_cache 40.3, weights 7.5.*\), policy0 2\d.\d \(optimizer 1\d", before.over()), \
        before.over()
    assert plan.check(one_rm, SHAPES_8B, 80) is not None
    with pytest.raises(plan.PlanError, match="at generate, over the 47.6 GB of 48 CUDA"):  # vLLM's 0.6 of it + 22 GB
        plan.check(one_rm, SHAPES_8B, 48)


def test_the_pinned_host_memory_of_a_node_is_planned_and_checked_against_its_ram():
    """vLLM's sleep backs up every engine worker's weights in pinned host memory (8 workers x 16 GB / 2) and
    DeepSpeed's offload the learners' fp32 masters, Adam's moments and gradient partitions (8 ranks x (12 + 2) P / 8):
    22 P, 164.5 GB on the one node of the 8B hybrid run; a 128 GB node is refused naming it."""
    now = plan.plan(hybrid_8b(), SHAPES_8B, 80)
    P = SHAPES_8B["policy"].params
    assert list(now.host) == [0]
    assert sum(now.host[0].values()) == pytest.approx(8 * (P * 2 / 2) + 8 * (12 * P / 8 + P * 2 / 8), rel=1e-6)
    assert plan.plan(hybrid_8b(), SHAPES_8B, 80, node_gb=256).fits()
    small = plan.plan(hybrid_8b(), SHAPES_8B, 80, node_gb=128)
    assert not small.fits() and small.over().startswith("planned pinned host memory peaks at 164.5 GB on node 0, over "
                                                        "its 128 GB of RAM: policy")


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


HYBRID_8B = str(ROOT / "configs" / "reinforce_baseline_llama3_8b_hybrid.yaml")


def test_the_plan_command_prints_every_moment_and_exits_2_over_the_gpus_or_the_node(tmp_path, capsys):
    """`rlhf-flows plan` on the shipped flow config with the models' config.json in local folders: the table per
    moment, GPU and role, the pinned host memory per node, and the peak; exit 2 naming the moment, the GPU and the
    holders with 24 GB GPUs, naming the node with 128 GB nodes; the legacy order over 80 GB; a folder without
    config.json named."""
    from flows import cli

    for name, head in (("policy", "LlamaForCausalLM"), ("rm", "LlamaForSequenceClassification")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**LLAMA3_8B, "architectures": [head]}))
    args = ["plan", HYBRID_8B, f"pretrain_uri={tmp_path / 'policy'}", f"reward_uri={tmp_path / 'rm'}"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["moment", "gpus", "role", *plan.KINDS, "total"]
    assert {m for m in plan.MOMENTS if any(ln.startswith(m + "  ") for ln in lines)} == set(plan.MOMENTS)
    assert "pinned host memory: node 0: 164.5 GB (policy 104.7, rollout 59.8)" in out
    assert lines[-1] == "peak: 59.1 GB on GPU 0 at generate of 79.6 GB usable per GPU (80 GB sold): fits"
    assert cli.main([*args, "--gpu-memory-gb", "24"]) == 2
    err = capsys.readouterr().err
    assert "rlhf-flows: error: planned GPU memory peaks at" in err and "over the 23.6 GB of 24 CUDA can use" in err
    assert cli.main([*args, "--node-memory-gb", "128"]) == 2
    assert "pinned host memory peaks at 164.5 GB on node 0, over its 128 GB of RAM" in capsys.readouterr().err
    assert cli.main([*args, "ppo.reward_num_gpus_per_node=1", "--legacy-order"]) == 2
    assert "at resume, over the 79.6 GB" in capsys.readouterr().err
    assert cli.main(["plan", HYBRID_8B, f"pretrain_uri={tmp_path / 'nowhere'}", f"reward_uri={tmp_path / 'rm'}"]) == 2
    assert "nowhere/config.json cannot be read" in capsys.readouterr().err


def test_the_plan_reads_hub_ids_config_json_only_and_names_a_placeholder_key(hub_stub, tmp_path, monkeypatch, capsys):
    """Both shipped hybrid configs as they are, their models hub ids (a hub stand-in serving config.json and weights
    that must not be fetched): each plans every moment, only config.json downloaded, at the branch's commit. The
    shipped 8B config with the example store put back gets one line naming the key to override."""
    from flows import cli
    from tests.hubstub import use_hub

    qwen15 = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False,
                  architectures=["Qwen2ForCausalLM"])
    for repo, cfg in (("OpenRLHF/Llama-3-8b-sft-mixture", LLAMA3_8B), ("OpenRLHF/Llama-3-8b-rm-700k", LLAMA3_8B),
                      ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", qwen15)):
        hub_stub.add(repo, {"config.json": json.dumps(cfg), "model.safetensors": b"not to be fetched"})
    use_hub(hub_stub, monkeypatch, tmp_path / "hf")
    start = len(hub_stub.requests())
    assert cli.main(["plan", HYBRID_8B]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": fits")
    assert cli.main(["plan", str(ROOT / "configs" / "prorl_v2_math_hybrid.yaml")]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and out.splitlines()[-1].endswith(": fits")
    fetched = [r["path"] for r in hub_stub.requests()[start:] if "/resolve/" in r["path"]]
    assert fetched and all(p.endswith("/config.json") for p in fetched), fetched
    assert cli.main(["plan", HYBRID_8B, "pretrain_uri=s3://my-bucket/models/Llama-3-8b-sft-mixture"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pretrain_uri is s3://my-bucket/models/Llama-3-8b-sft-mixture, the " \
        "example's placeholder store: give the model's hub id or folder" in err


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
                     micro_train_batch_size=8, accelerator="gpu", ray_address="10.0.0.1:6379", gpu_memory_gb=1.0)
    with pytest.raises(plan.PlanError, match=r"planned GPU memory peaks at 1.2 GB on GPU 0 at train, over the 0.6 GB "
                                             r"of 1 CUDA can use: policy0 1.2 \(context 0.5, nccl 0.5, activations 0.2\)"):
        ppo.run(cfg)
    assert not ray.is_initialized() and not (tmp_path / "out").exists()
