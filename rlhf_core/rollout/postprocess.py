"""OpenRLHF v0.9.5's post-processors (openrlhf/utils/processor.py) as pure functions over scored rows.

Rows are dicts with at least prompt, response, reward (and sample_index). Prompts keep the order of their
first row. Facts taken from OpenRLHF (its code is not copied):
  rs        rejection_sampling_processor: per prompt keep the highest-reward response (RAFT / Llama 2's
            rejection sampling, arXiv:2307.09288). Here also top_k > 1 responses per prompt.
  iter_dpo  iterative_dpo_processor: per prompt chosen = max reward, rejected = min reward (RLHFlow
            Online-RLHF). Unlike OpenRLHF, prompts whose max equals min (ties, including one sample) are
            dropped and counted: they give zero-gradient pairs.
  csft      conditional_sft_processor (arXiv:2308.12050): optional global normalisation
            (r - mean) / std with the unbiased std as torch.std computes it, then the template
            "{input} <rm_score>: {reward} " with the reward at 2 decimals. Here also `buckets`: the
            reward's rank bucket in the batch (0 = worst) as the condition.
  dynamic   PPO's dynamic filtering: keep a prompt's group only when its mean reward lies strictly inside
            (min_reward, max_reward) (OpenRLHF --dynamic_filtering_reward_range).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_CSFT_TEMPLATE = "{input} <rm_score>: {reward} "


class FilterError(ValueError):
    """Rows or settings a post-processor cannot use; the message says which."""


@dataclass
class FilterStats:
    rows_in: int = 0
    rows_out: int = 0
    prompts: int = 0
    dropped_ties: int = 0  # iter_dpo: prompts with >= 2 samples whose rewards are all equal
    dropped_single: int = 0  # iter_dpo: prompts with one sample
    dropped_range: int = 0  # rows removed by the reward-range filter
    dropped_empty: int = 0  # rows whose response is empty or blank
    extra: dict = field(default_factory=dict)


def group_by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    """prompt -> its rows, prompts in first-seen order, rows in input order."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["prompt"], []).append(r)
    return groups


def dynamic_filter(rows: list[dict], min_reward: float | None = None, max_reward: float | None = None) -> list[dict]:
    """Keep the rows of prompts whose mean reward m satisfies min_reward < m < max_reward (None = no bound).
    Example: rewards {a: [0, 1], b: [1, 1]}, range (0, 1): a has m = 0.5 -> kept; b has m = 1 -> dropped."""
    if min_reward is not None and max_reward is not None and min_reward >= max_reward:
        raise FilterError(f"reward range min {min_reward} must be < max {max_reward}")
    out = []
    for group in group_by_prompt(rows).values():
        m = sum(r["reward"] for r in group) / len(group)
        if (min_reward is None or m > min_reward) and (max_reward is None or m < max_reward):
            out.extend(group)
    return out


def drop_empty(rows: list[dict], stats: FilterStats | None = None) -> list[dict]:
    """Rows whose response has text. A policy may stop at once (EOS first); such a sample scores, but as a
    training target (an SFT output, a DPO chosen or rejected) it is refused downstream, so it is dropped
    here and counted. Example: responses ["good .", "", "  "] -> 1 row kept, 2 dropped."""
    out = [r for r in rows if r["response"].strip()]
    if stats is not None:
        stats.dropped_empty += len(rows) - len(out)
    return out


def finished(row: dict, prefix: str = "") -> dict:
    """{prefix + "finished": False} for a response cut at the length limit (training then appends no EOS to
    it), True for one that stopped; {} for rows that carry no finish_reason."""
    if "finish_reason" not in row:
        return {}
    return {f"{prefix}finished": row["finish_reason"] != "length"}


def best_of_n(rows: list[dict], top_k: int = 1) -> list[dict]:
    """SFT rows {input, output, reward}: the top_k highest-reward responses of each prompt, best first
    (equal rewards keep input order, as OpenRLHF keeps the first maximum)."""
    if top_k < 1:
        raise FilterError(f"top_k must be >= 1, got {top_k}")
    out = []
    for prompt, group in group_by_prompt(rows).items():
        best = sorted(group, key=lambda r: -r["reward"])[:top_k]  # stable sort: first max wins ties
        out += [{"input": prompt, "output": r["response"], "reward": float(r["reward"]), **finished(r)} for r in best]
    return out


def dpo_pairs(rows: list[dict], stats: FilterStats | None = None) -> list[dict]:
    """Pair rows {prompt, chosen, rejected, chosen_reward, rejected_reward, margin}: per prompt the first
    max-reward response against the first min-reward one; prompts with max == min are dropped (counted in
    `stats`). Example: rewards [0.2, 0.9, 0.2] -> chosen #1 (0.9), rejected #0 (0.2), margin 0.7."""
    stats = stats if stats is not None else FilterStats()
    out = []
    for prompt, group in group_by_prompt(rows).items():
        if len(group) < 2:
            stats.dropped_single += 1
            continue
        hi = max(group, key=lambda r: r["reward"])  # max/min return the first extreme: deterministic
        lo = min(group, key=lambda r: r["reward"])
        if hi["reward"] == lo["reward"]:
            stats.dropped_ties += 1
            continue
        out.append({"prompt": prompt, "chosen": hi["response"], "rejected": lo["response"],
                    "chosen_reward": float(hi["reward"]), "rejected_reward": float(lo["reward"]),
                    "margin": float(hi["reward"] - lo["reward"]),
                    **finished(hi, "chosen_"), **finished(lo, "rejected_")})
    return out


def normalize(rewards: list[float]) -> list[float]:
    """(r - mean) / std, std unbiased (n - 1), like OpenRLHF's reward_normalization.
    [1, 2, 3] -> mean 2, std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1]."""
    n = len(rewards)
    if n < 2:
        raise FilterError(f"reward normalisation needs >= 2 rows, got {n}")
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    if std == 0:
        raise FilterError("reward normalisation: all rewards are equal (std 0)")
    return [(r - mean) / std for r in rewards]


def reward_buckets(rewards: list[float], buckets: int) -> list[int]:
    """Each reward's bucket 0..buckets-1 by its rank in the batch (equal-count buckets; equal rewards share the
    bucket of their mean rank): the condition says "how good among what this policy produced", a single
    token the model can attend to, where a 2-decimal number is 4-5 digit tokens whose magnitude a tiny
    model barely reads. Example: [0.1, 0.9, 0.5, 0.5], 2 buckets -> ranks 0, 3, 1.5, 1.5 -> [0, 1, 0, 0]."""
    if buckets < 2:
        raise FilterError(f"reward buckets must be >= 2, got {buckets}")
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    rank = [0.0] * len(rewards)
    i = 0
    while i < len(order):  # ties: every member gets the mean of their ranks
        j = i
        while j + 1 < len(order) and rewards[order[j + 1]] == rewards[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            rank[k] = (i + j) / 2
        i = j + 1
    return [min(buckets - 1, int(r * buckets / len(rewards))) for r in rank]


def csft_condition(reward: float, buckets: int = 0, labels: list[str] | None = None) -> str:
    """The text of a condition: with buckets the bucket's label (labels[i], default the index i), else the
    reward at 2 decimals (OpenRLHF). Labels exist because a digit tag is the same token as any digit in the
    prompt (the demo's "#12 Review of ..."): measured on the demo, letters let the policy follow it twice as well."""
    if not buckets:
        return f"{reward:.2f}"
    return labels[int(reward)] if labels else str(int(reward))


def conditional_sft(rows: list[dict], normalize_rewards: bool = False, template: str = DEFAULT_CSFT_TEMPLATE,
                    buckets: int = 0, labels: list[str] | None = None) -> list[dict]:
    """SFT rows {input: template(prompt, condition), output: response, reward} for every row; the condition
    is the reward at 2 decimals (optionally normalised first), or with `buckets` its rank bucket (written as
    labels[bucket] when labels are given; the row's reward is the bucket index).
    Example: prompt "Q", reward 0.456 -> input "Q <rm_score>: 0.46 "."""
    if "{input}" not in template or "{reward}" not in template:
        raise FilterError(f"csft template {template!r} must contain {{input}} and {{reward}}")
    rewards = [float(r["reward"]) for r in rows]
    if labels is not None and len(labels) != buckets:
        raise FilterError(f"{len(labels)} bucket labels for {buckets} reward buckets: give one label per bucket")
    if buckets:
        rewards = [float(b) for b in reward_buckets(rewards, buckets)]
    elif normalize_rewards:
        rewards = normalize(rewards)
    # str.replace, not format(): prompts may contain braces
    return [{"input": template.replace("{reward}", csft_condition(rw, buckets, labels)).replace("{input}", r["prompt"]),
             "output": r["response"], "reward": rw, **finished(r)} for r, rw in zip(rows, rewards)]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
