"""Learning-rate schedules: the four of transformers' get_scheduler that OpenRLHF's --lr_scheduler is passed
to, as the factor of the peak learning rate that optimizer step s (0-based) runs at. Formulas from
transformers.optimization (the *_lr_lambda functions); warm-up steps as OpenRLHF counts them."""
from __future__ import annotations

import math


def warmup_steps(lr_warmup_ratio: float, total: int) -> int:
    """OpenRLHF's num_warmup_steps = ceil(steps x lr_warmup_ratio)."""
    return math.ceil(lr_warmup_ratio * total)


def lr_factor(name: str, s: int, warm: int, total: int, min_lr_ratio: float) -> float:
    """learning_rate x this = the lr of step s. Warm-up rises linearly from 0 (transformers: step 0 runs at
    lr 0); then constant, linear to 0 at `total`, or half a cosine from 1 to min_lr_ratio
    (cosine_with_min_lr, num_cycles 0.5). e.g. linear, warm 2, total 6: 0, 0.5, 1, 0.75, 0.5, 0.25."""
    if name == "constant":
        return 1.0
    if s < warm:
        return s / max(1, warm)
    if name == "constant_with_warmup":
        return 1.0
    progress = (s - warm) / max(1, total - warm)
    if name == "linear":
        return max(0.0, 1.0 - progress)
    if name == "cosine_with_min_lr":
        return max(0.0, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler {name!r}: constant, constant_with_warmup, cosine_with_min_lr or linear")
