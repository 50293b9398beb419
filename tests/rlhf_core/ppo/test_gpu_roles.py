"""The ppo roles on CUDA in bf16, in-process (no Ray, no vLLM): layer (a) of the GPU tests.

Layer (a) runs on a single lent GPU machine whose image has torch + CUDA, transformers, peft, pyarrow, fsspec
and pytest but no Ray, vLLM, Prefect, datasets or s3fs (DeepSpeed and its missing dependencies travel as
wheels): so nothing here imports `stages` or `flows`, and the learners' `hp` dict is made by
rlhf_core.ppo.loop.learner_settings from a plain namespace instead of the stage's pydantic Config. Each role
gets a CPU batch, as Ray delivers it, and must hand back CPU results from a model held on the GPU in bf16.
Layer (b), the whole ppo stage with Ray placement and vLLM's CUDA engine, is tests/test_gpu.py on a full GPU
image. Run this file on the lent machine with

    bash benchmarks/gpu/gpu_smoke.sh          (header: how to prepare the .whl folder it installs)

or, where DeepSpeed is installed: python -m pytest -n0 -m gpu tests/rlhf_core/ppo/test_gpu_roles.py -q.
Without CUDA every test here is skipped (tests/conftest.py).
"""
from __future__ import annotations

import gc
import math
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core.rl import logprobs, rl_math
from rlhf_core.ppo import batches, loop
from rlhf_core.ppo.engines import HFRollout
from rlhf_core.ppo.roles import Learner, Reference
from rlhf_core.rollout.rewards import RewardSpec
from rlhf_core.rollout.reward_model import RMEngine

pytestmark = pytest.mark.gpu
GPU = "cuda"  # the device type every role's model must sit on

# What the Learner reads: the ppo stage's defaults (stages/ppo.py Config) with a 4-sample batch of 2-sample
# micro-batches, as the CPU role tests' settings(), but bf16, ZeRO-2 and no lr warm-up.
STAGE = dict(seed=42, bf16=True, gradient_checkpointing=False, actor_learning_rate=1e-6, critic_learning_rate=9e-6,
             adam_betas=(0.9, 0.95), l2=0.0, lr_warmup_ratio=0.0, min_lr_ratio=0.1, train_batch_size=4,
             micro_train_batch_size=2, micro_rollout_batch_size=None, max_norm=1.0, zero_stage=2, max_epochs=1,
             generate_max_len=64, dual_clip=None, use_kl_loss=False, kl_estimator="k1", entropy_loss_coef=0.0,
             value_clip=0.5, reward_max_len=1024, enable_vllm_is_correction=False,
             vllm_is_truncated_threshold=(0.5, 5.0), use_icepop=False, temperature=1.0, eps_clip=0.2,
             eps_clip_low_high=None, loss_agg=None, advantage_estimator="group_norm", deepspeed_enable_sleep=False,
             ref_num_nodes=1, ref_num_gpus_per_node=1, ref_reward_offload=False, packing_samples=False,
             use_dynamic_batch=False, train_max_tokens_per_gpu=16192, rollout_max_tokens_per_gpu=None,
             adam_offload=False, value_head_prefix="score", pretrain_data=None, ptx_coef=0.05, weight_sync_bucket_mb=256,
             kl_loss_agg="token", loss_agg_empty_rows="drop",  # issue 37: OpenRLHF's KL-loss token mean
             attn_implementation="sdpa", shared_prompt=False,  # one row per sample (written before shared prompts)
             lr_scheduler="cosine_with_min_lr", tokenizer_chat_template=None, overlap_comm=False,
             deepcompile=False)


def hp(**over) -> dict:
    """The Learner's settings dict, through the same learner_settings the driver uses."""
    return loop.learner_settings(SimpleNamespace(**{**STAGE, **over}))


def experience(B: int = 4, P: int = 5, R: int = 6) -> dict:
    """A CPU batch as the driver sends it: B rows of a P-token prompt and an R-token response."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (P,), generator=g).tolist() for _ in range(B)]
    resp = [torch.randint(3, 300, (R - (i % 2),), generator=g).tolist() for i in range(B)]
    b = batches.collate(prompts, resp, pad_id=0, logprobs=[[-1.0] * len(r) for r in resp])
    T = b["mask"].shape
    b.update(old_logp=torch.full(T, -1.0), adv=torch.randn(T, generator=g), ref_logp=torch.full(T, -1.1),
             old_values=torch.zeros(T), returns=torch.ones(T))
    return b


def episodes_batch(prompt_ids: list[list[int]], outs: list[list[dict]], pad_id: int) -> dict:
    """A rollout engine's samples (n per prompt) as the driver collates them, rollout log-probs included."""
    eps = [(p, o) for p, per in zip(prompt_ids, outs) for o in per]
    return batches.collate([p for p, _ in eps], [o["ids"] for _, o in eps], pad_id,
                        logprobs=[o["logprobs"] for _, o in eps])


def assert_on_gpu_in_bf16(model: torch.nn.Module) -> None:
    """Every parameter (under ZeRO-3: this rank's partition, ds_tensor) is a bf16 tensor on the GPU."""
    params = list(model.named_parameters())
    assert params
    for name, p in params:
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p
        assert t.device.type == GPU and t.dtype == torch.bfloat16, f"{name}: {t.dtype} on {t.device}"


def assert_host_result(x: torch.Tensor, shape) -> None:
    assert x.device.type == "cpu" and x.dtype == torch.float32 and tuple(x.shape) == tuple(shape)
    assert torch.isfinite(x).all()


def masked_mean_abs(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x.abs() * mask).sum() / mask.sum().clamp(min=1))


@pytest.fixture
def learner_env():
    """Learner.setup sets the torch.distributed variables (restored afterwards) and makes a 1-rank nccl group
    (kept: DeepSpeed caches it, later learners in this process reuse it). A ZeRO-3 learner registers its
    DeepSpeed config with transformers (HfDeepSpeedConfig): it is unset afterwards, else every later
    from_pretrained in this process would build its model inside zero.Init."""
    saved = dict(os.environ)
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_learner(kind: str, model_dir, settings: dict, total_steps: int = 4) -> Learner:
    from rlhf_core.runtime.jobs import free_port

    learner = Learner(kind, 0, 1)
    learner.setup(str(model_dir), settings, "127.0.0.1", free_port(), total_steps=total_steps)
    return learner


# ---------------------------------------------------------------------------------------------- each role
@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_learner_trains_on_the_gpu_in_bf16_and_returns_cpu_results(tiny, learner_env, kind):
    learner = make_learner(kind, tiny.policy_dir if kind == "policy" else tiny.reward_dir, hp())
    assert_on_gpu_in_bf16(learner.module)
    batch = experience()
    assert_host_result(learner.forward(batch), batch["mask"].shape)  # old log-probs / values
    out = learner.train(batch, kl_loss_coef=0.0)
    assert out and all(isinstance(v, (int, float)) and math.isfinite(v) for v in out.values())  # padding counts are ints
    assert (out["policy_loss"] if kind == "policy" else out["critic_loss"]) != 0.0
    assert_on_gpu_in_bf16(learner.module)  # the step left the weights where they were


def test_reference_runs_on_the_gpu_in_bf16_and_returns_cpu_logprobs(tiny):
    ref = Reference(str(tiny.policy_dir), hp(temperature=0.7))
    assert_on_gpu_in_bf16(ref.model)
    batch = experience()
    lp = ref.forward(batch)
    assert_host_result(lp, batch["mask"].shape)
    assert (lp <= 0).all() and (lp[batch["mask"] > 0] < 0).all()


def test_hf_rollout_generates_on_the_gpu_in_bf16_and_takes_cpu_weights(tiny):
    eng = HFRollout(str(tiny.policy_dir), bf16=True)
    assert_on_gpu_in_bf16(eng.model)
    outs = eng.generate([[5, 6, 7], [8, 9]], n=3, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    assert [len(per) for per in outs] == [3, 3]
    for o in (o for per in outs for o in per):
        assert 0 < len(o["ids"]) == len(o["logprobs"]) <= 6 and all(isinstance(t, int) for t in o["ids"])
        assert all(math.isfinite(v) and v <= 0 for v in o["logprobs"]) and o["finish_reason"] in ("stop", "length")
    cpu_weights = {k: v.detach().cpu().float() for k, v in eng.model.state_dict().items()}  # as Ray hands them over
    assert eng.load_weights([cpu_weights]) == 1
    assert_on_gpu_in_bf16(eng.model)  # loaded into the GPU tensors, cast back to bf16


def test_reward_model_scores_on_the_gpu_in_bf16(tiny):
    rm = RMEngine(str(tiny.reward_dir), RewardSpec(model=str(tiny.reward_dir), dtype="bfloat16"))
    assert_on_gpu_in_bf16(rm.body)
    assert_on_gpu_in_bf16(rm.head)
    scores = rm.score([("Review of the movie:", "great fun ."), ("Review of the food:", "bad")], finished=[True, False])
    assert len(scores) == 2 and all(isinstance(s, float) and math.isfinite(s) for s in scores)


# ---------------------------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_step_on_the_gpu_changes_every_weight_matrix(tiny, learner_env, stage):
    """One optimizer step (train_batch_size 4 = 2 micro-batches of 2) at lr 1e-3: Adam's first step moves each
    element by about lr, well above bf16's spacing near the 0.02-sized initial weights (2^-13 = 1.2e-4), so
    every matrix changes in its bf16 copy too. (Norm weights sit at 1.0, where bf16's spacing is 2^-7: those
    may round back, so only matrices are checked.)"""
    learner = make_learner("policy", tiny.policy_dir, hp(zero_stage=stage, actor_learning_rate=1e-3))
    assert_on_gpu_in_bf16(learner.module)  # ZeRO-3: partitions, built inside zero.Init
    before = learner._full_state_dict()  # what publish_weights puts in Ray's object store (gathered under ZeRO-3)
    out = learner.train(experience(), kl_loss_coef=0.0)
    after = learner._full_state_dict()
    matrices = [k for k, v in before.items() if v.dim() == 2]
    assert matrices and [k for k in matrices if torch.equal(before[k], after[k])] == []
    assert after[matrices[0]].dtype == torch.bfloat16
    assert out["policy_peak_mem_gb"] > 0  # the CUDA allocator's peak


# ---------------------------------------------------------------------------------------------- log-probs
def test_rollout_and_trainer_logprobs_agree_in_bf16_at_temperature_0_6(tiny, learner_env):
    """The HF engine's sampled-token log-probs (KV-cached decoding, one token at a time) against the policy
    learner's (one forward over the whole sequence), both bf16 at T = 0.6: mean |difference| < 0.05 nats.
    fp32 agrees to 1e-3 (tests/rlhf_core/ppo/test_ppo_roles.py); bf16 keeps 8 significant bits, so each logit
    carries a relative rounding error of about 2^-8 from its last matmul alone, and the two paths round at
    different points in every layer. At a real model's logits of several units, divided by T = 0.6, that allows
    a few hundredths of a nat on a token; 0.05 on the mean leaves room for it (this tiny model's logits are about
    0.2 in size: in bf16 on the CPU its gap was 0.001). The bound must still tell the tempered policy from the
    untempered one: on this model they are 0.12 apart (fp32, measured on the CPU), and the learner's log-probs
    must be within the bound of an fp32 log_softmax(logits / T) and outside it from log_softmax(logits)."""
    from transformers import AutoModelForCausalLM

    T, bound = 0.6, 0.05
    eng = HFRollout(str(tiny.policy_dir), bf16=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    outs = eng.generate(prompts, n=4, max_new_tokens=16, temperature=T, top_p=1.0, top_k=0, seed=1)
    batch = episodes_batch(prompts, outs, eng.pad_id)
    mask = batch["mask"]
    learner = make_learner("policy", tiny.policy_dir, hp(temperature=T, train_batch_size=12, micro_train_batch_size=12))
    trainer = learner.forward(batch)
    assert masked_mean_abs(batch["rollout_logp"] - trainer, mask) < bound

    fp32 = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).to(GPU).eval()
    with torch.no_grad():
        logits = fp32(input_ids=batch["ids"].to(GPU), attention_mask=batch["attn"].to(GPU)).logits[:, :-1].float().cpu()
    targets = batch["ids"][:, 1:, None]
    tempered = torch.log_softmax(logits / T, -1).gather(-1, targets).squeeze(-1)
    untempered = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
    assert masked_mean_abs(trainer - tempered, mask) < bound < masked_mean_abs(trainer - untempered, mask)


def test_chunked_logprobs_peak_memory_at_the_qwen2_1p5b_shape():
    """rlhf_core.rl.logprobs.token_logprobs (no grad) on a random Qwen2-1.5B-shaped model in bf16, 8 x 1024 tokens:
    the peak the CUDA allocator reaches above the weights and ids stays below one fp32 (B, L - 1, V) tensor,
    8 * 1023 * 151936 * 4 bytes = 4.97e9 B (5.0 GB), which the plain logits + log_softmax path would hold (on
    top of the bf16 logits). By the arithmetic the chunked path's largest tensors are one chunk's logits,
    (1024, 151936) in bf16 and fp32 (0.3 + 0.6 GB), and logsumexp's fp32 temporary of the same size."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(GPU):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    B, L, V = 8, 1024, cfg.vocab_size
    ids = torch.randint(0, V, (B, L), device=GPU)
    attn = torch.ones_like(ids)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        lp, _ = logprobs.token_logprobs(model, ids, attn)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    one_fp32_logits = B * (L - 1) * V * 4
    print(f"chunked log-probs at the 1.5B shape: {extra / 1e9:.2f} GB above the weights "
          f"(bound {one_fp32_logits / 1e9:.2f} GB)")
    assert tuple(lp.shape) == (B, L - 1) and torch.isfinite(lp).all() and (lp <= 0).all()
    assert extra < one_fp32_logits
    del model, lp
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- GRPO
def test_grpo_steps_in_process_raise_the_demo_reward(tiny, learner_env):
    """The online-RL loop without Ray, all on the GPU in bf16: the HF engine samples 16 per prompt for 16
    prompts -> demo gold reward -> group_norm advantages -> old log-probs -> DeepSpeed update (2 optimizer steps
    of 128 samples) -> the learner's full state_dict into the engine, as sync_weights does. From the random
    tiny policy (a positive word is a rare sample there) at a high constant lr (2e-3), the mean reward of the
    last 3 of 15 steps beats the first 3 by more than 0.1. The same loop in bf16 on the CPU went from about 0.0
    to 0.55-0.69 (two seeds); with 8 x 8 samples and lr 1e-3 (fp32, CPU) it drifted by a few hundredths only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    prompt_ids = [tok(demo_task.INPUT_TEMPLATE.format(r["input"]), add_special_tokens=False).input_ids
                  for r in demo_task.prompts(16, 0)]
    n, steps, new_tokens = 16, 15, 8
    samples = len(prompt_ids) * n
    eng = HFRollout(str(tiny.policy_dir), bf16=True)
    learner = make_learner("policy", tiny.policy_dir,
                           hp(actor_learning_rate=2e-3, min_lr_ratio=1.0, train_batch_size=samples // 2,
                              micro_train_batch_size=samples // 2, micro_rollout_batch_size=samples,
                              generate_max_len=new_tokens), total_steps=2 * steps)
    rewards = []
    for step in range(steps):
        outs = eng.generate(prompt_ids, n, new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=step)
        batch = episodes_batch(prompt_ids, outs, eng.pad_id)
        scores = torch.tensor([demo_task.gold_reward(tok.decode(o["ids"], skip_special_tokens=True))
                               for per in outs for o in per])  # (B,) grouped by prompt
        adv, ret = rl_math.advantages_and_returns("group_norm", scores, batch["mask"], n,
                                                  torch.zeros_like(batch["mask"]), 0.0)
        old = learner.forward(batch)
        learner.train({**batch, "old_logp": old, "adv": adv, "returns": ret}, kl_loss_coef=0.0)
        eng.load_weights([learner._full_state_dict()])
        rewards.append(float(scores.mean()))
    print("grpo mean gold reward per step", [round(r, 3) for r in rewards])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


# ---------------------------------------------------------------------------------------------- hybrid engine, offload
@pytest.mark.parametrize("stage", [2, 3])
def test_learner_sleeps_and_wakes_around_a_step(tiny, learner_env, stage):
    """deepspeed_enable_sleep (Roles.phase, OpenRLHF's offload list): offload_states moves the optimizer states, fp32
    master weights and gradient buffers to the host (the CUDA allocator holds less, the holdings report no
    optimizer states) while the bf16 weights stay for the weight sync; reload_states brings them back, and the
    step after leaves the same weights as the same step without sleeping (bit for bit). ZeRO-3 trains with
    DeepSpeed's FusedAdam here (its offload_states moves only that optimizer's states)."""
    settings = hp(zero_stage=stage, actor_learning_rate=1e-3, deepspeed_enable_sleep=True)
    batch = experience()
    ref = make_learner("policy", tiny.policy_dir, settings)
    ref.train(batch, 0.0)
    learner = make_learner("policy", tiny.policy_dir, settings)
    learner.train(batch, 0.0)  # Adam's states exist from here on
    torch.cuda.synchronize()
    before, held = torch.cuda.memory_allocated(), learner.holdings()
    learner.sleep()
    asleep, held_asleep = torch.cuda.memory_allocated(), learner.holdings()
    learner.wake_up()
    assert asleep < before, (asleep, before)
    assert held["optimizer"] > 0 and held_asleep["optimizer"] == 0 and held_asleep["weights"] == held["weights"] > 0
    assert_on_gpu_in_bf16(learner.module)
    ref.train(batch, 0.0)
    learner.train(batch, 0.0)
    a, b = ref._full_state_dict(), learner._full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_adam_offload_keeps_the_optimizer_state_on_the_cpu(tiny, learner_env):
    """adam_offload: after a step, ZeRO-Offload's fp32 master partitions and Adam's moments are CPU tensors
    while the bf16 weights stay on the GPU."""
    learner = make_learner("policy", tiny.policy_dir, hp(zero_stage=2, adam_offload=True))
    learner.train(experience(), 0.0)
    opt = learner.engine.optimizer
    states = [t for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    assert opt.cpu_offload and states and all(t.device.type == "cpu" for t in states)
    assert all(p.device.type == "cpu" for p in opt.single_partition_of_fp32_groups)
    assert_on_gpu_in_bf16(learner.module)


def test_packing_on_the_gpu_matches_the_padded_forward(tiny, learner_env):
    """packing_samples on CUDA in bf16: the packed forward's log-probs equal the padded forward's within bf16's
    rounding (mean |difference| < 0.02 nats on the action tokens) with no padding forwarded."""
    batch = experience()
    plain = make_learner("policy", tiny.policy_dir, hp())
    packed = make_learner("policy", tiny.policy_dir, hp(packing_samples=True))
    a, b = plain.forward(batch), packed.forward(batch)
    assert masked_mean_abs(a - b, batch["mask"]) < 0.02
    assert packed.forwarded_tokens == int(batch["attn"].sum()) < plain.forwarded_tokens
