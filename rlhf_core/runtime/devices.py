"""Where a role's tensors live: its device (the GPU Ray reserved for the actor, else the CPU), batches moved there
and results moved back, and its peak memory. Shared by the roles, the engines and the reward model."""
from __future__ import annotations

import torch


def device() -> torch.device:
    """The device a role's model lives on: the GPU Ray gave this actor (it sees only its own), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: dict, dev) -> dict:
    """Every tensor of `batch` on `dev` (batches arrive from Ray as CPU tensors)."""
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A result for the driver: detached, on the CPU. A `meta` tensor (the device tests run models on meta,
    which holds shapes but no values) comes back as zeros of its shape and dtype."""
    if x.device.type == "meta":
        return torch.zeros(x.shape, dtype=x.dtype)
    return x.detach().cpu()


def peak_memory_gb() -> float:
    """This process's peak memory: the GPU allocator's on CUDA, else the peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux
