"""Supervised fine-tuning: token-level mean NLL of the response tokens (all tokens in pretrain_mode; the
stage sets `start`), OpenRLHF's GPTLMLoss. With gradient accumulation, each micro-batch's token mean (OpenRLHF;
the step's gradient is their mean), or with loss_token_mean=window one token mean over the step's window
(TRL): the job's loop puts the window's targets per micro-batch in the spec (entry.window_per_token)."""
from __future__ import annotations

from rlhf_core.rl import losses
from rlhf_core.train.entry import forward

MODEL = "causal_lm"


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    lp, n, tokens = forward(engine, spec, [r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    o = losses.sft_loss(lp, n, spec.get("window_per_token"))  # None: this micro-batch's token mean
    loss = o.losses.sum()
    return loss, {"loss": loss.detach().expand(len(recs)), **o.metrics}, tokens  # nll: each example's own mean NLL
