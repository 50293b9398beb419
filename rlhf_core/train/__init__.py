"""Training jobs: the DeepSpeed entry point (entry), batches and data order (batches), checkpoints on the
store (checkpoints), and the parent side that launches a job and commits its model (launch)."""
from __future__ import annotations


def adamw(params, lr: float, betas, weight_decay: float):
    """torch AdamW, fused (one kernel over all tensors, on CPU and CUDA) when every parameter is a floating
    tensor the fused kernel takes: what transformers' Trainer (and so TRL) uses by default since torch 2.8
    ("adamw_torch_fused"). Numerically AdamW; ~4x less optimizer time than the per-tensor loop on a tiny
    model on CPU (benchmarks/RESULTS.md)."""
    import torch

    params = list(params)
    fused = all(p.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) and p.device.type in ("cpu", "cuda")
                for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused or None)


def deepspeed_options(hp: dict, config: dict) -> dict:
    """OpenRLHF's --overlap_comm and --deepcompile into a DeepSpeed config, as its get_train_ds_config writes them:
    overlap_comm sets zero_optimization's overlap_comm and contiguous_gradients (unset: DeepSpeed's default, on for
    ZeRO-3 only); deepcompile sets compile.deepcompile, and the caller compiles the engine (compile_engine).
    DeepSpeed 0.19.8 runs DeepCompile on CUDA only (deepspeed.compile.util.is_deepcompile_supported: torch >= 2.6
    on a cuda accelerator): the stages refuse it by name on a host without CUDA."""
    if hp.get("overlap_comm"):
        config["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True)
    if hp.get("deepcompile"):
        config["compile"] = {"deepcompile": True}
    return config


def compile_engine(engine, hp: dict):
    """deepcompile: engine.compile() after deepspeed.initialize, as OpenRLHF's strategy does."""
    if hp.get("deepcompile"):
        engine.compile()
    return engine


def no_lone_allreduce(engine):
    """A DeepSpeed engine without ZeRO on a single rank skips its gradient all-reduce: DeepSpeed otherwise
    flattens every gradient into one new buffer at each optimizer step to all-reduce it with itself: 0.67 s of a
    7.1 s profiled step for a 57M-parameter fp32 policy on 2 CPU cores (benchmarks/parts/learner_step.py --profile;
    benchmarks/RESULTS.md). With several ranks, or under ZeRO (whose optimizer partitions through that path),
    the engine is left as it is."""
    import torch.distributed as dist

    if engine.zero_optimization_stage() == 0 and (not dist.is_initialized() or dist.get_world_size() == 1):
        engine.enable_backward_allreduce = False
    return engine
