"""KTO (Kahneman-Tversky Optimization, arXiv:2402.01306): unpaired desirable / undesirable completions.

Each record is one (prompt, completion, label) and one mismatched pair (the same prompt with another
record's completion) whose log-ratio estimates the reference point z0 ~ KL(pi || ref) (paper sec. 4.1; TRL
and OpenRLHF pair within a micro-batch, here a seeded derangement over the dataset, fixed before training so
that the reference log-probs of both are precomputed once by rlhf_core.train.reference, as for DPO).
A step forwards the mismatched pairs without gradient (z0 is detached), averages z0 over the ranks, then
forwards the examples and takes losses.kto_loss. The loss needs no pairs: paired preference data becomes
one desirable and one undesirable row per pair (data.pairs_to_kto).
"""
from __future__ import annotations

import random

import torch

from rlhf_core.rl import losses
from rlhf_core.inputs.data import DataError
from rlhf_core.train.batches import Encoder
from rlhf_core.train.entry import forward

MODEL = "causal_lm"


def tokenize(rows: list[dict], tok, max_len: int, overlong: str = "truncate", where: str = "kto data", seed: int = 0,
             model_dir=None) -> tuple[list[dict], int]:
    """`kto` rows (prompt, completion, label, finished?) -> {ids, start, kl_ids, kl_start, desirable}.
    The mismatched completion of row i is that of the row after i in a seeded permutation, preferring one
    written for another prompt."""
    if len(rows) < 2:
        raise DataError(f"{where}: KTO needs at least 2 rows (the KL estimate pairs a prompt with another row's completion)")
    enc = Encoder(tok, max_len, overlong, model_dir)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    after = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    out, cut = [], 0
    for i, r in enumerate(rows):
        if not isinstance(r.get("completion"), str) or not r["completion"].strip():
            raise DataError(f"{where} row {i}: key 'completion' is empty or missing")
        j = after[i]
        for _ in range(min(8, len(rows) - 1)):  # a completion of another prompt, when one is near
            if rows[j]["prompt"] != r["prompt"]:
                break
            j = after[j] if after[j] != i else j
        prompt = enc.prompt(r.get("prompt") or "")
        ids, start, c = enc(prompt, r["completion"], r.get("finished"), f"{where} row {i}")
        kl_ids, kl_start, _ = enc(prompt, rows[j]["completion"], rows[j].get("finished"), f"{where} row {j} (as row {i}'s KL pair)")
        cut += c
        out.append({"ids": ids, "start": start, "kl_ids": kl_ids, "kl_start": kl_start, "desirable": bool(r["label"])})
    return out, cut


def _mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    """(loss, per-example metrics, real tokens forwarded) of one micro-batch."""
    with torch.no_grad():  # z0 carries no gradient: this forward keeps no activations
        kl_lp, _, kl_tokens = forward(engine, spec, [r["kl_ids"] for r in recs], [r["kl_start"] for r in recs], pad_id)
    lp, _, tokens = forward(engine, spec, [r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    dev = lp.device
    ref = torch.tensor([r["ref_logp"] for r in recs], device=dev, dtype=lp.dtype)
    ref_kl = torch.tensor([r["ref_kl_logp"] for r in recs], device=dev, dtype=lp.dtype)
    kl = losses.kto_kl(kl_lp, ref_kl)
    if torch.is_grad_enabled():  # training: every rank runs the same micro-batches, so the mean is collective
        kl = _mean_over_ranks(kl)
    desirable = torch.tensor([r["desirable"] for r in recs], device=dev)
    o = losses.kto_loss(lp, ref, desirable, kl, spec["beta"], spec["desirable_loss_weight"], spec["undesirable_loss_weight"])
    return o.losses.mean(), {"loss": o.losses.detach(), **o.metrics}, tokens + kl_tokens


def summarize(totals: dict[str, float], n: int) -> dict:
    """Final metrics over the training set: class means of the implied reward and their gap."""
    n_d = totals["desirable"]
    out = {f"final_{k}": totals[k] / n for k in ("loss", "kl", "reward")}
    out["final_desirable_reward"] = totals["desirable_reward"] / max(n_d, 1)
    out["final_undesirable_reward"] = totals["undesirable_reward"] / max(n - n_d, 1)
    out["final_reward_gap"] = out["final_desirable_reward"] - out["final_undesirable_reward"]
    return out
