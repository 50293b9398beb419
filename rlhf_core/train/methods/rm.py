"""Reward model: Bradley-Terry pairwise loss (losses.pairwise_rm_loss, sigmoid or log-exp, optional margin)
on a scalar head read at each sequence's last token; chosen and rejected in one forward. After training the
reward mean and std over the training set go into config.json for the score stage to normalise."""
from __future__ import annotations

import math

import torch

from rlhf_core.rl import logprobs, losses
from rlhf_core.train import attention
from rlhf_core.train.entry import batch_of

MODEL = "reward_model"
FINAL_PASS = True  # reward mean / std of the trained model over the training set (saved_config): one more forward


def rewards(engine, spec: dict, seqs: list[list[int]], starts: list[int], pad_id: int):
    """Scalar rewards # (n,) of k chosen then k rejected sequences (score head on each sample's last token;
    a pair's prompt forwarded once, entry.batch_of) and the forward's batches.Tokens."""
    b = batch_of(spec, seqs, starts, pad_id, pairs=True)
    dev = engine.device
    model = getattr(engine, "module", engine)
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(core, core.base_model_prefix)  # the mask as every method builds it (eager needs an additive one)
    kw, last = attention.model_inputs(body, b, dev), b.last.to(dev)
    # through the top module (the engine's): ZeRO-3 prefetches (logprobs.through_top)
    r = logprobs.through_top(model, lambda: core.score(body(**kw, use_cache=False).last_hidden_state[last[:, 0], last[:, 1]]))
    return r.squeeze(-1).float(), b.tokens()


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    k = len(recs)
    r, tokens = rewards(engine, spec, [x["chosen_ids"] for x in recs] + [x["rejected_ids"] for x in recs],
                        [x["chosen_start"] for x in recs] + [x["rejected_start"] for x in recs], pad_id)
    margin = torch.tensor([x["margin"] for x in recs], device=r.device) if spec["use_margin"] else None
    o = losses.pairwise_rm_loss(r[:k], r[k:], margin, spec["loss"])
    c, j = o.metrics["chosen_reward"], o.metrics["rejected_reward"]
    return o.losses.mean(), {"loss": o.losses.detach(), **o.metrics, "reward_sq": c * c + j * j}, tokens


def summarize(totals: dict[str, float], n: int) -> dict:
    out = {f"final_{k}": v / n for k, v in totals.items() if k != "reward_sq"}
    mean = (totals["chosen_reward"] + totals["rejected_reward"]) / (2 * n)
    out["reward_mean"], out["reward_std"] = mean, math.sqrt(max(totals["reward_sq"] / (2 * n) - mean ** 2, 1e-12))
    return out


def saved_config(final: dict, spec: dict) -> dict:
    return {"reward_mean": final["reward_mean"], "reward_std": final["reward_std"]}
