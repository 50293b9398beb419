"""Which of a role's tensors hold device memory, read from the tensors themselves (the memory plan's holdings).

On a GPU a tensor's device says it. On a host without one, where the roles run on CPUs while a Ray cluster advertises
GPUs (the fake cluster of tests/rlhf_core/ppo/test_hybrid_moments.py), device and host are one memory: an offload
that moves nothing would look like one that works. There the roles run their offloads and reloads inside `moving`,
which gives the move the semantics it has between a GPU and its host: `t.to(...)` / `t.cpu()` across the boundary
return a new storage (a copy, as a CUDA copy is), and every storage an offload creates (the moved copies,
`empty_like` / `empty` buffers) is marked as host memory. Everything else counts as device memory. So a tensor an
offload reuses instead of creating (DeepSpeed's `*_offload_buffer` after a resume) still counts on the device, as it
would on the GPU.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_HOST: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()  # storages marked as host memory (no CUDA)


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` holds device memory: a CUDA (or other accelerator) tensor; on a host without CUDA, any CPU tensor
    whose storage no offload marked as host memory. `meta` tensors and empty storages hold nothing."""
    if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return False
    if torch.cuda.is_available():
        return t.device.type != "cpu"
    return t.untyped_storage() not in _HOST


def device_bytes(tensors) -> int:
    """Bytes of device memory `tensors` hold, each storage counted once (views and aliases share one)."""
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and on_device(t):
            s = t.untyped_storage()
            if id(s) not in seen:
                seen.add(id(s))
                total += s.nbytes()
    return total


_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.pin_memory}
_ALLOCS = {torch.empty_like, torch.empty, torch.zeros_like, torch.zeros}


class _Moving(TorchFunctionMode):
    def __init__(self, to_host: bool):
        super().__init__()
        self.to_host = to_host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not torch.is_tensor(out) or out.device.type != "cpu":
            return out
        if func in _MOVES and torch.is_tensor(args[0]) and args[0].device.type == "cpu":
            was_host = args[0].untyped_storage() in _HOST
            if was_host != self.to_host:  # across the boundary: a copy in the other memory
                out = out.clone() if out.untyped_storage() is args[0].untyped_storage() else out
                if self.to_host:
                    _HOST.add(out.untyped_storage())
        elif func in _ALLOCS and self.to_host:
            _HOST.add(out.untyped_storage())
        return out


@contextmanager
def moving(to_host: bool):
    """The body offloads (`to_host`) or reloads a role's states. On CUDA nothing changes; without CUDA the moves get
    a GPU's semantics (see the module docstring)."""
    if torch.cuda.is_available():
        yield
        return
    with torch.no_grad(), _Moving(to_host):
        yield
