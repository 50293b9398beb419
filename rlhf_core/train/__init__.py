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
