"""New policy weights into the rollout engines after every update.

Today: policy rank 0's full state_dict -> Ray's object store (as numpy arrays) -> every engine, in place.
"""
from __future__ import annotations

import time

import torch

# dtypes numpy has no type for travel as the same-width integers, viewed back on arrival
_NO_NUMPY = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def to_wire(sd: dict) -> dict:
    """A state_dict for Ray's object store, as numpy arrays: `ray.put` copies each once into shared memory and
    `ray.get` maps it without a copy. Torch tensors would be pickled and copied at both ends: the stage's weight
    sync at a 57M-parameter fp32 policy took 1.22 s per step as tensors, 0.10 s as arrays
    (benchmarks/ppo_step.py --size 57m, benchmarks/RESULTS.md)."""
    out = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        out[k] = (v.view(_NO_NUMPY[v.dtype]).numpy(), v.dtype) if v.dtype in _NO_NUMPY else v.numpy()
    return out


def from_wire(sd: dict) -> dict:
    """`to_wire`'s arrays as tensors sharing their (read-only, object-store) memory, for a `load_state_dict` or
    weight loader that copies them into the model; tensors pass through (an in-process state_dict)."""
    import warnings

    import numpy as np

    out = {}
    with warnings.catch_warnings():  # read-only views: the loaders copy from them, never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for k, v in sd.items():
            if isinstance(v, tuple):
                out[k] = torch.from_numpy(v[0]).view(v[1])
            else:
                out[k] = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    return out


def received_weights(refs: list) -> dict:
    """The state_dict a rollout engine loads: from Ray's object store (refs = [ObjectRef]) or given in process."""
    import ray

    return from_wire(refs[0] if isinstance(refs[0], dict) else ray.get(refs[0]))


def connect(roles, cfg) -> "ObjectStoreSync":
    """The weight path of one run between roles.policy and roles.rollouts (created once, after the actors)."""
    return ObjectStoreSync(roles)


class ObjectStoreSync:
    """Policy rank 0's full state_dict -> Ray's object store -> every rollout engine, in place."""
    method = "object_store"

    def __init__(self, roles):
        self.roles = roles

    def sync(self) -> float:
        """Seconds."""
        return sync_weights(self.roles)


def sync_weights(roles) -> float:
    """Policy rank 0's full state_dict -> Ray's object store -> every rollout engine, in place. Seconds."""
    import ray

    t0 = time.perf_counter()
    refs = [r for part in ray.get([a.publish_weights.remote() for a in roles.policy]) for r in part]
    ray.get([e.load_weights.remote(refs) for e in roles.rollouts])
    return time.perf_counter() - t0


def publish(learner) -> list:
    """The full state_dict in Ray's object store, as numpy arrays (`to_wire`: one copy, into shared memory;
    every rank gathers, rank 0 publishes). Returns [ref] (wrapped, so the caller receives the reference,
    not the arrays)."""
    import ray

    with learner._gathered():
        return [ray.put(to_wire(learner.engine.module.state_dict()))] if learner.rank == 0 else []
