"""The reference pass: summed response log-probs of a frozen model over tokenized pairs, computed once per
dataset (TRL's precompute_ref_log_probs) so DPO trains one model instead of two. Forward-only and
single-process: it holds no optimizer state to shard."""
from __future__ import annotations

import torch

from rlhf_core import losses
from rlhf_core.train.batches import collate, per_sample_sum, seq_len


@torch.no_grad()
def pair_logps(model, records: list[dict], batch_size: int, pad_id: int) -> tuple[list[float], list[float]]:
    """(chosen, rejected) summed log-probs per record, in record order; batches sorted by length."""
    model.eval()
    order = sorted(range(len(records)), key=lambda i: seq_len(records[i]))
    chosen, rejected = [0.0] * len(records), [0.0] * len(records)
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        recs = [records[i] for i in idx]
        seqs = [r["chosen_ids"] for r in recs] + [r["rejected_ids"] for r in recs]
        starts = [r["chosen_start"] for r in recs] + [r["rejected_start"] for r in recs]
        b = collate(seqs, starts, pad_id)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        lp = per_sample_sum(losses.token_logprobs(logits, b.input_ids), b)  # (2n,)
        for j, i in enumerate(idx):
            chosen[i], rejected[i] = float(lp[j]), float(lp[len(idx) + j])
    return chosen, rejected
