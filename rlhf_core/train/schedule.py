"""Learning-rate schedules: the five of transformers' get_scheduler that OpenRLHF's --lr_scheduler is passed to
(its DeepSpeed strategy gives min_lr_ratio to the two cosine-with-min-lr ones), as the factor of the peak learning
rate that optimizer step s (0-based) runs at. Formulas from transformers.optimization (the *_lr_lambda functions,
checked against get_scheduler by tests/stages/test_train_eval.py); warm-up steps as OpenRLHF counts them.

Step 0 of a warm-up: transformers' LambdaLR sets the lr of lambda(0) before the first optimizer step, and DeepSpeed
steps the schedule after each optimizer step, so under constant_with_warmup, linear and cosine_with_min_lr (OpenRLHF's
default) the first step runs at lr 0 whenever there is a warm-up: ceil(0.03 x 8) = 1 warm-up step makes 1 of an
8-step run's steps a no-op. cosine_warmup_with_min_lr (transformers PR #31870) warms up from 1/warm instead, its
first step at lr/warm, and ends its cosine at min_lr_ratio on the last step."""
from __future__ import annotations

import math

NAMES = ("cosine_with_min_lr", "cosine_warmup_with_min_lr", "constant", "constant_with_warmup", "linear")


def warmup_steps(lr_warmup_ratio: float, total: int) -> int:
    """OpenRLHF's num_warmup_steps = ceil(steps x lr_warmup_ratio)."""
    return math.ceil(lr_warmup_ratio * total)


def lr_factor(name: str, s: int, warm: int, total: int, min_lr_ratio: float) -> float:
    """learning_rate x this = the lr of step s. Warm-up rises linearly from 0 (step 0 at lr 0), or from 1/warm under
    cosine_warmup_with_min_lr; then constant, linear to 0 at `total`, or half a cosine from 1 to min_lr_ratio
    (num_cycles 0.5). e.g. linear, warm 2, total 6: 0, 0.5, 1, 0.75, 0.5, 0.25; cosine_warmup_with_min_lr,
    warm 1, total 3, min 0.1: 1, 0.55, 0.1."""
    if name == "constant":
        return 1.0
    if name == "cosine_warmup_with_min_lr":
        if s < warm:
            return (s + 1) / max(1, warm)
        progress = (s - warm + 1) / max(1, total - warm)  # reaches 1 on the last step
        return max(0.0, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    if s < warm:
        return s / max(1, warm)
    if name == "constant_with_warmup":
        return 1.0
    progress = (s - warm) / max(1, total - warm)
    if name == "linear":
        return max(0.0, 1.0 - progress)
    if name == "cosine_with_min_lr":
        return max(0.0, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler {name!r}: {', '.join(NAMES)}")
