"""GPU figures for issues 35 and 41, in-process (no Ray, no vLLM), on random models of real shapes built there:

  ipc_leak        a 256 MB bucket handed out by CUDA IPC handle (torch.multiprocessing.reductions.reduce_tensor)
                  that no process ever opens, 8 times, as a policy rank without a colocated engine did before
                  issue 35: the CUDA memory still held after each torch.cuda.ipc_collect(), beside the same loop
                  making no handle (what weight_sync.send_ipc does now on such a rank).
  moments         one process holding the policy learner (DeepSpeed ZeRO-2, 1 rank, deepspeed_enable_sleep), the
                  reference and an hf rollout engine (vllm_enable_sleep: its weights to host memory), all on the one GPU
                  (colocate_all_models), driven through every moment of the memory plan (rlhf_core.ppo.plan.MOMENTS) in
                  the roles' order (placement.Roles: releases before acquires): the engine loads alone and sleeps,
                  the other roles load, two steps (enter generate, generate, enter train, train, sync; step 2 reloads
                  Adam's moments), a checkpoint saved asleep, then a resume (a fresh learner loads it beside the
                  sleeping engine, sleeps, the engine wakes for the weights). Per moment: the CUDA allocator's peak,
                  and beside it the plan's prediction for the same settings on this GPU (its fullest wave, without the
                  per-process contexts and NCCL buffers: one process here, no communicator), at the Qwen2-0.5B and
                  Qwen2-1.5B shapes; and the learner's holdings after the resume's sleep (the moments must be gone).

    python3 benchmarks/gpu/gpu_phases.py                    (on the lent GPU: bash benchmarks/gpu/gpu_phases.sh)
    .venv/bin/python benchmarks/gpu/gpu_phases.py --small   (CPU smoke run: tiny shape, no memory figures; the suite
                                                             runs it: tests/test_gpu_scripts.py)

One JSON line per measurement on stdout; with OUT set, also $OUT/gpu_phases.json (a list, rewritten after each).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

emit = emitter("gpu_phases.json")  # benchmarks/gpu/records.py
GB = 2 ** 30


def ipc_leak(mb: int = 256, rounds: int = 8) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    for make_handle in (True, False):
        torch.cuda.empty_cache()
        start, held = torch.cuda.memory_reserved(), []
        for _ in range(rounds):
            flat = torch.empty(mb * 2 ** 20, dtype=torch.uint8, device="cuda")
            if make_handle:
                handle = reduce_tensor(flat)  # nobody opens it
                del handle
            del flat
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            held.append(round((torch.cuda.memory_reserved() - start) / GB, 3))
        emit({"what": "ipc_leak", "handle_made": make_handle, "bucket_mb": mb, "reserved_after_each_gb": held})


def settings(small: bool) -> SimpleNamespace:
    """The stage settings of the measured run, what the plan and the Learner read (the stage's defaults, as
    gpu_roles.learner_hp has them: that machine has no Prefect / pydantic-settings stack to import the stage)."""
    base = dict(seed=42, gradient_checkpointing=False, actor_learning_rate=1e-6, critic_learning_rate=9e-6,
                adam_betas=(0.9, 0.95), l2=0.0, lr_warmup_ratio=0.0, min_lr_ratio=0.1, max_norm=1.0, max_epochs=1,
                dual_clip=None, use_kl_loss=False, kl_estimator="k1", entropy_loss_coef=0.0, value_clip=0.5,
                reward_max_len=1024, enable_vllm_is_correction=False, vllm_is_truncated_threshold=(0.5, 5.0),
                use_icepop=False, temperature=1.0, eps_clip=0.2, eps_clip_low_high=None, loss_agg=None,
                kl_loss_agg="token", loss_agg_empty_rows="drop", attn_implementation="sdpa", shared_prompt=False,
                lr_scheduler="cosine_with_min_lr", tokenizer_chat_template=None, overlap_comm=False, deepcompile=False,
                ref_num_nodes=1, ref_num_gpus_per_node=1, ref_reward_offload=False, packing_samples=False,
                use_dynamic_batch=False, train_max_tokens_per_gpu=16192, rollout_max_tokens_per_gpu=None,
                adam_offload=False, value_head_prefix="score", pretrain_data=None, ptx_coef=0.05,
                actor_num_nodes=1, actor_num_gpus_per_node=1, critic_num_nodes=1, critic_num_gpus_per_node=1,
                reward_num_nodes=1, reward_num_gpus_per_node=1, colocate_actor_ref=False, colocate_critic_reward=False,
                vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.95, weight_sync_backend="collective")
    return SimpleNamespace(**base, bf16=not small, zero_stage=2, advantage_estimator="group_norm",
                           n_samples_per_prompt=4 if small else 8, rollout_batch_size=4 if small else 16,
                           train_batch_size=16 if small else 128, micro_train_batch_size=8 if small else 16,
                           micro_rollout_batch_size=8 if small else 16, prompt_max_len=8 if small else 64,
                           generate_max_len=8 if small else 128, init_kl_coef=0.01, colocate_all_models=True,
                           vllm_num_engines=1, rollout_backend="hf", deepspeed_enable_sleep=True,
                           vllm_enable_sleep=True, weight_sync_bucket_mb=256)


def moments(shape_name: str, shape: dict, small: bool, work: Path) -> None:
    import torch

    from gpu_roles import qwen2, random_model
    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.ppo import batches, loop, node_store, plan, weight_sync
    from rlhf_core.ppo.engines import HFRollout
    from rlhf_core.ppo.roles import Learner, Reference
    from rlhf_core.rl import rl_math
    from rlhf_core.runtime.jobs import free_port

    cuda = torch.cuda.is_available() and not small
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = settings(small)
    hp = loop.learner_settings(cfg)
    tok = tiny.build_tokenizer(work / "tokenizer", demo_task.corpus(0))
    model_dir = work / shape_name
    model = random_model(qwen2(shape, tok), dev, dtype)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    mcfg = json.loads((model_dir / "config.json").read_text())
    del model
    if cuda:
        torch.cuda.empty_cache()
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB if cuda else 80.0
    planned = plan.plan(cfg, {"policy": plan.shape(mcfg)}, gpu_gb, reported=cuda)
    P, n = cfg.rollout_batch_size, cfg.n_samples_per_prompt
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (cfg.prompt_max_len,), generator=g).tolist() for _ in range(P)]

    def measure(moment: str, step: int, body):
        """Run `body` as the moment (the allocator's peak reset first) and emit its peak beside the plan's."""
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = body()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        holders = planned.holders(moment, 0)
        want = sum(v for h in holders for k, v in h.bytes.items() if k not in ("context", "nccl"))
        emit({"what": "moment", "shape": shape_name, "step": step, "moment": moment,
              "seconds": round(time.perf_counter() - t0, 3), "measured_peak_gb": round(peak / GB, 3) if peak else None,
              "planned_gb": round(want / GB, 3), "planned_over_measured": round(want / peak, 3) if peak else None,
              "planned_holders": {h.role: {k: round(v / GB, 3) for k, v in h.bytes.items() if k not in ("context", "nccl")}
                                  for h in holders if h.total}})
        return out

    def new_learner():
        learner = Learner("policy", 0, 1)
        learner.setup(str(model_dir), hp, "127.0.0.1", free_port(), total_steps=4)
        weight_sync.layout(learner, cfg.weight_sync_bucket_mb * 2 ** 20)
        return learner

    def sync(learner, eng):
        learner.sleep()  # releases first
        eng.wake_up(["weights"])
        named = dict(eng.model.named_parameters())
        with torch.no_grad():
            for i, params in weight_sync._walk(learner):  # one bucket at a time into the engine (in process)
                for (name, _, _), p in zip(learner._ws_layout[i], params):
                    named[name].copy_(p.data)

    eng = measure("setup: engines", 0, lambda: HFRollout(str(model_dir), bf16=cuda))
    eng.sleep()
    ref, learner = measure("setup", 0, lambda: (Reference(str(model_dir), hp), new_learner()))
    for step in range(2):
        if step == 0:
            measure("enter generate", step, lambda: (learner.sleep(), eng.wake_up()))
        else:
            eng.wake_up(["kv_cache"])
        outs = measure("generate", step, lambda: eng.generate(prompts, n, cfg.generate_max_len, temperature=1.0,
                                                              top_p=1.0, top_k=0, seed=step))
        resp = [o["ids"] for per in outs for o in per]
        batch = batches.collate([p for p in prompts for _ in range(n)], resp, eng.pad_id,
                                logprobs=[o["logprobs"] for per in outs for o in per])
        measure("enter train (step 1)" if step == 0 else "enter train", step, lambda: (eng.sleep(), learner.wake_up()))

        def train():
            ref_logp = ref.forward(batch)
            old = learner.forward(batch)
            scores = torch.tensor([sum(t % 2 == 0 for t in r) / max(1, len(r)) for r in resp])
            adv, ret = rl_math.advantages_and_returns("group_norm", scores, batch["mask"], n,
                                                      torch.zeros_like(batch["mask"]), 0.0)
            learner.train({**batch, "adv": adv, "returns": ret, "old_logp": old, "ref_logp": ref_logp}, 0.0)

        measure("train", step, train)
        measure("sync", step, lambda: sync(learner, eng))
    learner.engine.save_checkpoint(str(work / "ckpt"), tag="step-2", save_latest=False)  # asleep, as the stage saves
    emit({"what": "holdings", "shape": shape_name, "when": "after step 2", "learner": learner.holdings(),
          "engine": eng.holdings(), "reference": ref.holdings()})
    eng.sleep()
    del learner
    if cuda:
        torch.cuda.empty_cache()

    def resume():
        fresh = new_learner()
        fresh.engine.load_checkpoint(str(work / "ckpt"), tag="step-2")
        node_store.drop_offload_buffers(fresh.engine.optimizer)
        return fresh

    learner = measure("resume", 2, resume)
    measure("sync", 2, lambda: sync(learner, eng))
    emit({"what": "holdings", "shape": shape_name, "when": "resumed, asleep", "learner": learner.holdings(),
          "engine": eng.holdings(), "reference": ref.holdings()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run; no memory figures)")
    ap.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.small:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from gpu_roles import QWEN2_0_5B, QWEN2_1_5B, SMALL

    emit({"what": "env", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
          "torch": torch.__version__})
    if torch.cuda.is_available():
        ipc_leak()
    shapes = {"small": SMALL} if args.small else {"qwen2-0.5b": QWEN2_0_5B, "qwen2-1.5b": QWEN2_1_5B}
    for name in (["small"] if args.small else args.shapes.split(",")):
        with tempfile.TemporaryDirectory(prefix="gpu-phases-") as work:
            moments(name, shapes[name], args.small, Path(work))


if __name__ == "__main__":
    main()
