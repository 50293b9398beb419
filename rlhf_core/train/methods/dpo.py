"""DPO on one model: the reference log-probs are columns of the records (rlhf_core.train.reference, computed
once per dataset). Chosen and rejected go through one forward; losses.dpo_loss (sigmoid, ipo, cDPO; ipo on
per-token log-ratios with length_normalize) plus the chosen responses' NLL weighted by nll_loss_coef (RPO)."""
from __future__ import annotations

import torch

from rlhf_core.rl import losses
from rlhf_core.train.entry import forward

MODEL = "causal_lm"


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    k = len(recs)
    lp, n, tokens = forward(engine, spec, [r["chosen_ids"] for r in recs] + [r["rejected_ids"] for r in recs],
                            [r["chosen_start"] for r in recs] + [r["rejected_start"] for r in recs], pad_id, pairs=True)
    ref_c = torch.tensor([r["ref_chosen_logp"] for r in recs], device=lp.device)
    ref_r = torch.tensor([r["ref_rejected_logp"] for r in recs], device=lp.device)
    lengths = (n[:k], n[k:]) if spec.get("length_normalize") else None  # ipo per token (TRL's)
    o = losses.dpo_loss(lp[:k], lp[k:], ref_c, ref_r, spec["beta"], spec["loss_type"], spec["label_smoothing"], lengths)
    per = o.losses
    if spec["nll_loss_coef"] > 0:
        per = per + spec["nll_loss_coef"] * losses.nll_per_token(lp[:k], n[:k])
    return per.mean(), {"loss": per.detach(), **o.metrics}, tokens


def summarize(totals: dict[str, float], n: int) -> dict:
    return {f"final_{k}": v / n for k, v in totals.items()}
