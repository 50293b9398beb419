"""GPU layer (a) figures for the ppo roles, in-process (no Ray, no vLLM), on random models of real shapes built on
the machine (nothing is downloaded; weights are random, so only speed and memory mean anything):

  logprob_peak_memory  Qwen2-1.5B shape, 8 x 1024 tokens, no grad: rlhf_core.rl.logprobs.token_logprobs (LM head in
                       chunks) beside the plain path (model logits -> fp32 log_softmax -> gather): the CUDA
                       allocator's peak above the weights and ids, seconds (each path after one warm-up call),
                       and how far the two paths disagree.
  grpo_step            Qwen2-0.5B shape in bf16: HFRollout.generate -> a synthetic token-level reward ->
                       group_norm advantages -> Learner.train (DeepSpeed, 1-rank group, ZeRO-2) ->
                       HFRollout.load_weights (the learner's full CPU state_dict, as the object store delivers
                       it); median seconds of each part over the timed steps. One optimizer step per rollout and
                       no KL term, so, as the stage does then, the learner takes the old log-probs from its own
                       first forward; the separate Learner.forward pass the stage runs otherwise (several updates
                       per rollout, or a KL term) is timed apart, `old_logp_forward_s`, and left out of `step_s`.
  hf_rollout           the rollout part: generated tokens/s, and the allocator's peak while generating above
                       what was held before (HF generate keeps every step's fp32 logits for output_logits:
                       P*n x new tokens x V x 4 bytes, `kept_fp32_logits_gb`).
  learner_mfu          6 * parameters * trained tokens (prompt + response, every row) / train seconds / peak
                       FLOP/s, peak = 989e12 (H100 SXM, bf16 dense; --peak-flops to change it). CPU: no figure.

All roles share one process and one GPU here, so a role's peak memory includes the others' weights. The
reward is the share of even token ids in a response: it only gives the advantages a spread.

    python3 benchmarks/gpu/gpu_roles.py --device cuda                    (on the lent GPU: bash benchmarks/gpu/gpu_smoke.sh)
    .venv/bin/python benchmarks/gpu/gpu_roles.py --device cpu --small    (CPU smoke run, tiny shapes, fp32)

One JSON line per measurement on stdout; with OUT set, also $OUT/gpu_roles.json (a list, rewritten after each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core from this checkout (not installed there)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

QWEN2_0_5B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
QWEN2_1_5B = dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936)
SMALL = dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=512)  # vocab >= the tokenizer's 400
H100_BF16_DENSE = 989e12

emit = emitter("gpu_roles.json")  # benchmarks/gpu/records.py


def qwen2(shape: dict, tok=None):
    from transformers import Qwen2Config

    ids = {} if tok is None else dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id)
    return Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=True,
                       **ids)


def random_model(cfg, dev, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


class Clock:
    """Wall seconds, the GPU's queued work included."""

    def __init__(self, cuda: bool):
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


# ---------------------------------------------------------------------------------------------- memory
def logprob_memory(shape: dict, B: int, L: int, dev: str, dtype, clock: Clock) -> None:
    import torch

    from rlhf_core.rl import logprobs

    cuda = dev == "cuda"
    model = random_model(qwen2(shape), dev, dtype)
    V = shape["vocab"]
    ids = torch.randint(0, V, (B, L), device=dev)
    attn = torch.ones_like(ids)

    def plain():  # what a trainer without chunking does: (B, L, V) logits, fp32 log_softmax over all of them
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    results = {}
    for path, fn in (("chunked", lambda: logprobs.token_logprobs(model, ids, attn)[0]), ("plain", plain)):
        with torch.no_grad():  # warm-up: the first call pays kernel loading and cuBLAS set-up (issue 36: the 3.8x
            fn()               # chunked / plain figure of 2026-11-26 timed the chunked path first and cold)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t0 = clock()
        with torch.no_grad():
            results[path] = fn().float().cpu()
        seconds = clock() - t0
        extra = (torch.cuda.max_memory_allocated() - base) / 1e9 if cuda else None
        emit({"what": "logprob_peak_memory", "path": path, "shape": shape, "batch": B, "seq_len": L,
              "dtype": str(dtype).removeprefix("torch."), "peak_above_weights_gb": extra,
              "one_fp32_logits_gb": B * (L - 1) * V * 4 / 1e9, "seconds": round(seconds, 3),
              **({"max_abs_diff_vs_chunked": float((results["plain"] - results["chunked"]).abs().max())}
                 if path == "plain" else {})})
    del model
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- GRPO step
def learner_hp(bf16: bool, zero_stage: int, samples: int, micro: int, new_tokens: int) -> dict:
    """The Learner's settings through the driver's learner_settings (the stage's defaults, one optimizer step
    over all samples of a rollout)."""
    from rlhf_core.ppo import loop

    cfg = dict(seed=42, bf16=bf16, gradient_checkpointing=False, actor_learning_rate=1e-6, critic_learning_rate=9e-6,
               adam_betas=(0.9, 0.95), l2=0.0, lr_warmup_ratio=0.0, min_lr_ratio=0.1, train_batch_size=samples,
               micro_train_batch_size=micro, micro_rollout_batch_size=micro, max_norm=1.0, zero_stage=zero_stage,
               max_epochs=1, generate_max_len=new_tokens, dual_clip=None, use_kl_loss=False, kl_estimator="k1",
               entropy_loss_coef=0.0, value_clip=0.5, reward_max_len=1024, enable_vllm_is_correction=False,
               vllm_is_truncated_threshold=(0.5, 5.0), use_icepop=False, temperature=1.0, eps_clip=0.2,
               eps_clip_low_high=None, loss_agg=None, advantage_estimator="group_norm", deepspeed_enable_sleep=False,
               ref_num_nodes=1, ref_num_gpus_per_node=1, ref_reward_offload=False, packing_samples=False,
               use_dynamic_batch=False, train_max_tokens_per_gpu=16192, rollout_max_tokens_per_gpu=None,
               adam_offload=False, value_head_prefix="score", pretrain_data=None, ptx_coef=0.05, weight_sync_bucket_mb=256,
               kl_loss_agg="token", loss_agg_empty_rows="drop",  # issue 37: OpenRLHF's KL-loss token mean
               attn_implementation="sdpa", shared_prompt=False,  # one row per sample (written before shared prompts)
               lr_scheduler="cosine_with_min_lr", tokenizer_chat_template=None, overlap_comm=False,
               deepcompile=False)
    return loop.learner_settings(SimpleNamespace(**cfg))


def grpo(args, shape: dict, dev: str, dtype, clock: Clock, work: Path) -> None:
    import torch

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.rl import rl_math
    from rlhf_core.runtime.jobs import free_port
    from rlhf_core.ppo.batches import collate
    from rlhf_core.ppo.engines import HFRollout
    from rlhf_core.ppo.roles import Learner

    cuda, bf16 = dev == "cuda", dtype == torch.bfloat16
    tok = tiny.build_tokenizer(work / "tokenizer", demo_task.corpus(0))
    model_dir = work / "policy"
    t0 = clock()
    model = random_model(qwen2(shape, tok), dev, dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    params = sum(p.numel() for p in model.parameters())  # the tied embedding / LM head matrix counted once
    del model
    build_s = clock() - t0

    P, n = args.prompts, args.n
    samples = P * n
    t0 = clock()
    eng = HFRollout(str(model_dir), bf16=bf16)
    learner = Learner("policy", 0, 1)
    learner.setup(str(model_dir), learner_hp(bf16, args.zero_stage, samples, args.micro, args.new_tokens), "127.0.0.1",
                  free_port(), total_steps=args.steps + 1)
    setup_s = clock() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (args.prompt_len,), generator=g).tolist() for _ in range(P)]

    steps = []
    for step in range(args.steps + 1):  # step 0 warms up (kernels, allocator, DeepSpeed buffers)
        rec = {}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() if cuda else 0
        t_step = t0 = clock()
        outs = eng.generate(prompts, n, args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=step)
        rec["rollout_s"] = clock() - t0
        rec["rollout_extra_gb"] = (torch.cuda.max_memory_allocated() - start) / 1e9 if cuda else None
        resp = [o["ids"] for per in outs for o in per]
        rec["generated_tokens"] = sum(len(r) for r in resp)
        batch = collate([p for p in prompts for _ in range(n)], resp, eng.pad_id,
                        logprobs=[o["logprobs"] for per in outs for o in per])
        scores = torch.tensor([sum(t % 2 == 0 for t in r) / len(r) for r in resp])  # (B,) grouped by prompt
        adv, ret = rl_math.advantages_and_returns("group_norm", scores, batch["mask"], n,
                                                  torch.zeros_like(batch["mask"]), 0.0)
        t0 = clock()
        old = learner.forward(batch)  # timed only: see old_logp_forward_s in the module docstring
        rec["forward_s"] = clock() - t0
        rec["rollout_logprob_gap"] = float(((batch["rollout_logp"] - old).abs() * batch["mask"]).sum()
                                           / batch["mask"].sum())
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = clock()
        # one optimizer step per rollout, no KL term: no old_logp, the learner takes its own first forward's
        # (detached) as the stage does then (rlhf_core.ppo.loop.train)
        out = learner.train({**batch, "adv": adv, "returns": ret}, kl_loss_coef=0.0)
        rec["train_s"] = clock() - t0
        rec["train_peak_gb"] = out["policy_peak_mem_gb"] * 2 ** 30 / 1e9 if cuda else None
        rec["trained_tokens"] = int(batch["attn"].sum())
        t0 = clock()
        eng.load_weights([learner._full_state_dict()])  # what Learner.publish_weights puts in the object store
        rec["sync_s"] = clock() - t0
        rec["step_s"] = clock() - t_step - rec["forward_s"]
        if step:
            steps.append(rec)

    def med(key: str):
        vals = [s[key] for s in steps if s[key] is not None]
        return statistics.median(vals) if vals else None

    common = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "prompts": P, "n": n,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "timed_steps": len(steps)}
    emit({"what": "grpo_step", **common, "zero_stage": args.zero_stage, "micro_batch": args.micro,
          "build_and_save_s": round(build_s, 2), "setup_s": round(setup_s, 2),
          **{f"{k}_median": round(med(k), 4) for k in ("step_s", "rollout_s", "train_s", "sync_s")},
          "old_logp_forward_s_median": round(med("forward_s"), 4),
          "rollout_logprob_gap_median": med("rollout_logprob_gap")})
    emit({"what": "hf_rollout", **common, "generated_tokens": med("generated_tokens"),
          "tokens_per_s": round(med("generated_tokens") / med("rollout_s"), 1),
          "peak_above_start_gb": med("rollout_extra_gb"),
          "kept_fp32_logits_gb": samples * args.new_tokens * shape["vocab"] * 4 / 1e9})
    flops = 6 * params * med("trained_tokens") / med("train_s")
    emit({"what": "learner_mfu", **common, "params": params, "trained_tokens_per_step": med("trained_tokens"),
          "train_s_median": round(med("train_s"), 4), "model_tflops_per_s": round(flops / 1e12, 3),
          "peak_flops": args.peak_flops if cuda else None, "mfu": round(flops / args.peak_flops, 4) if cuda else None,
          "train_peak_gb": med("train_peak_gb")})  # absolute: the rollout engine's weights are in it too


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes and batches (a CPU smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed GRPO steps after one warm-up (3; small: 2)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout (16; small: 4)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (8; small: 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (64; small: 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens per sample (128; small: 8)")
    ap.add_argument("--micro", type=int, default=None, help="learner micro-batch, rows (16; small: 8)")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 2, 3])
    ap.add_argument("--mem-batch", type=int, default=None, help="log-prob memory rows (8; small: 2)")
    ap.add_argument("--mem-len", type=int, default=None, help="log-prob memory tokens per row (1024; small: 64)")
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE, help="the GPU's peak FLOP/s for MFU")
    args = ap.parse_args()
    defaults = dict(steps=(2, 3), prompts=(4, 16), n=(4, 8), prompt_len=(8, 64), new_tokens=(8, 128), micro=(8, 16),
                    mem_batch=(2, 8), mem_len=(64, 1024))
    for k, (small, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, small if args.small else full)

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every role picks its device with torch.cuda.is_available()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu --small)")
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 on CPUs without AMX is ~6x slower (ENV-NOTES)
    clock = Clock(cuda)
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    emit({"what": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "transformers": transformers.__version__, "deepspeed": ds_version, "dtype": str(dtype).removeprefix("torch."),
          "small": args.small})
    logprob_memory(SMALL if args.small else QWEN2_1_5B, args.mem_batch, args.mem_len, args.device, dtype, clock)
    with tempfile.TemporaryDirectory(prefix="gpu-roles-") as work:
        grpo(args, SMALL if args.small else QWEN2_0_5B, args.device, dtype, clock, Path(work))


if __name__ == "__main__":
    main()
