"""The reward interface's types, shared by every source: the spec naming one source, the rewards it returns, the
error it raises, and the checks and aggregation every source's rewards go through (rewards.py dispatches;
reward_model.py is the reward-model source)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class RewardError(RuntimeError):
    """A reward source failed or returned unusable rewards; the message names the source and rows."""


@dataclass(frozen=True)
class RewardSpec:
    model: str | None = None
    func_path: str | None = None
    remote_url: str | None = None
    value_head_prefix: str = "value_head"
    prm_aggregate: str = "min"  # a process reward model's reduction of its step rewards: min | last | mean
    prm_tokens: tuple[str, ...] | None = None  # a plain causal LM as a PRM: (placeholder, positive, negative, ...)
    prm_step_separator: str | None = None  # a PRM scoring unmarked responses: where one step ends (mark_steps)
    normalize: bool = True  # apply the mean/std stored in the reward model's config, when present
    max_len: int = 1024  # tokens of prompt + response (+ EOS); longer texts are cut as train_rm cuts them
    append_eos: bool = True
    batch_size: int = 64
    dtype: str = "auto"
    timeout_s: float = 30.0
    retries: int = 3
    storage_options: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        given = [k for k in ("model", "func_path", "remote_url") if getattr(self, k)]
        if len(given) != 1:
            raise RewardError(f"give exactly one reward source (model, func_path or remote_url); got {given or 'none'}")
        return given[0]


@dataclass
class Rewards:
    rewards: list[float]
    scores: list[float] | None = None
    extra_logs: dict = field(default_factory=dict)
    step_rewards: list[list[float]] | None = None  # a process reward model's per-step rewards


def combine_rewards(each: list[list[float]], agg: str = "sum") -> list[float]:
    """The rewards of several reward models # (n_models, B) -> (B,): sum, as OpenRLHF's reward_fn
    (openrlhf/cli/train_ppo_ray.py v0.6-v0.7: `torch.stack(rewards).sum(dim=0)`), or mean."""
    total = [sum(col) for col in zip(*each)]
    return total if agg == "sum" else [t / len(each) for t in total]


def check_finite(rewards: list[float], what: str = "rewards") -> None:
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise RewardError(f"{what}: {len(bad)} non-finite reward(s) (NaN/inf) at rows {bad[:20]}"
                          + (" ..." if len(bad) > 20 else "") + f": {[rewards[i] for i in bad[:5]]}")
