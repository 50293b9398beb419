"""KTO (Kahneman-Tversky Optimization, arXiv:2402.01306): unpaired desirable / undesirable completions.

Each record is one (prompt, completion, label) and one mismatched pair (the same prompt with another
record's completion) whose log-ratio estimates the reference point z0 ~ KL(pi || ref) (paper sec. 4.1; TRL
and OpenRLHF pair within a micro-batch, here a seeded derangement over the dataset, fixed before training so
that the reference log-probs of both are precomputed once by rlhf_core.train.reference, as for DPO).
A step forwards the examples with gradient, then their mismatched pairs without gradient (z0 is detached),
averages z0 over the ranks and takes losses.kto_loss. The loss needs no pairs: paired preference data becomes
one desirable and one undesirable row per pair (data.pairs_to_kto).

A KL pair repeats its example's prompt, so its forward continues the examples' forward on the KV cache of
that prompt (`_kl_on_prefix`): only the KL completion (and the prompt's last token) is forwarded, each
attending its own row's prompt columns of the cache and itself (attention.continuation_masks), at the
positions it has alone: the log-probs of the whole pair's forward, without forwarding the prompt twice. At
~57M parameters on CPU the KL pairs' prompts were ~half of the tokens of that no-gradient forward
(benchmarks/RESULTS.md, KTO). Where no KV cache can be shared (flash attention: no mask for it; ring
attention; gradient checkpointing, under which transformers keeps no cache) the pairs are forwarded whole,
as before.
"""
from __future__ import annotations

import random

import torch

from rlhf_core.rl import logprobs, losses
from rlhf_core.inputs.data import DataError
from rlhf_core.train import attention, ring
from rlhf_core.train.batches import Encoder, Tokens, _padded
from rlhf_core.train.entry import _parts, batch_of, forward

MODEL = "causal_lm"
# Logged per step as class means (sum over the class's examples / their count, TRL's rewards/chosen and
# rewards/rejected), not as means over the batch, which would scale them by the class's share
CLASS_MEANS = {"desirable_reward": "desirable", "undesirable_reward": "undesirable"}


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


def shared_prefix(r: dict) -> int:
    """How many leading tokens of record r's KL sequence its KL forward takes from the example's KV cache: their
    common prefix (the prompt), one token short of the first KL target, whose logits must come from a token
    the KL forward computes."""
    a, b = r["ids"], r["kl_ids"]
    top = min(len(a), max(r["kl_start"], 1) - 1)
    k = 0
    while k < top and a[k] == b[k]:
        k += 1
    return k


def _kl_on_prefix(engine, spec: dict, recs: list[dict], pad_id: int):
    """(summed log-probs of the examples # (n,), with gradient; of their KL pairs # (n,), without; batches.Tokens
    of both forwards: a KL pair's own tokens counted whole in `samples`, only its suffix in `forwarded`), the KL
    pairs forwarded on the examples' KV cache; None where no cache can be shared."""
    from transformers import DynamicCache

    model = getattr(engine, "module", engine)
    if spec.get("gradient_checkpointing") or ring.size() > 1 or spec.get("attn_implementation", "sdpa").startswith("flash"):
        return None
    parts = _parts(model)
    dev = engine.device

    def run(kw, rows, cols):
        """(logits at (rows, cols) # (N, V), the KV cache): the LM head on those positions only, as
        entry.target_logits, or the full forward where the logits are not just head(hidden)."""
        if parts is None:
            out = engine(**kw)
            return out.logits[rows, cols], out.past_key_values
        backbone, head = parts

        def fn():
            out = backbone(**kw)
            return head(out.last_hidden_state[rows, cols]), out.past_key_values
        return logprobs.through_top(model, fn)

    b = batch_of(spec, [r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    rows, cols, toks, samples = (t.to(dev) for t in b.targets())
    # a full-length cache for every layer (no config: sliding layers would keep only their window)
    kw = {**attention.model_inputs(model, b, dev), "use_cache": True, "past_key_values": DynamicCache()}
    logits, cache = run(kw, rows, cols)
    n = b.n
    lp = torch.zeros(n, dtype=logits.dtype, device=dev).index_add(0, samples, losses.gathered_logprobs(logits, toks))
    R, T = b.input_ids.shape
    if cache is None or cache.get_seq_length() != T:  # the model kept no cache after all: the pairs whole
        with torch.no_grad():
            kl_lp, _, kl_tokens = forward(engine, spec, [r["kl_ids"] for r in recs], [r["kl_start"] for r in recs], pad_id)
        return lp, kl_lp, b.tokens() + kl_tokens
    # The KL forward: row r carries the KL suffixes of the samples of example row r (their prompts are there),
    # each at the positions it has alone; the cache's columns are marked with their sample where they lie in
    # that sample's shared prefix (-1: not attended).
    shared = [shared_prefix(r) for r in recs]
    order = sorted(range(n), key=lambda i: (int(b.last[i, 0]), int(b.last[i, 1])))
    ids, pos, doc = [[] for _ in range(R)], [[] for _ in range(R)], [[] for _ in range(R)]
    kr, kc, kt, ks = [], [], [], []
    for i in order:
        r, kl, s = int(b.last[i, 0]), recs[i]["kl_ids"], shared[i]
        base = len(ids[r]) - s  # column of token t of the suffix: base + t
        first = max(recs[i]["kl_start"], 1)
        kr += [r] * (len(kl) - first)
        kc += range(base + first - 1, base + len(kl) - 1)  # token t predicted by the logits of token t - 1
        kt += kl[first:]
        ks += [i] * (len(kl) - first)
        ids[r] += kl[s:]
        pos[r] += range(s, len(kl))
        doc[r] += [i] * (len(kl) - s)
    W = max(map(len, ids))
    seg = b.segment
    prefix = torch.tensor(shared + [0])[seg]  # (R, T): the shared prefix length of each column's sample
    cached_doc = torch.where((seg < n) & (b.position_ids < prefix), seg, -1)
    all_doc = torch.cat([cached_doc, _padded(doc, -1, W)], 1)  # (R, T + W)
    all_pos = torch.cat([b.position_ids, _padded(pos, 0, W)], 1)
    dtype = next(model.parameters()).dtype
    kw = {"input_ids": _padded(ids, pad_id, W).to(dev), "position_ids": all_pos[:, T:].to(dev), "use_cache": True,
          "past_key_values": cache,
          "attention_mask": attention.continuation_masks(model.config, all_doc, all_pos, T, dev, dtype)}
    kr, kc, kt, ks = (torch.tensor(x, dtype=torch.long, device=dev) for x in (kr, kc, kt, ks))
    with torch.no_grad():  # z0 carries no gradient: this forward keeps no activations
        kl_logits = run(kw, kr, kc)[0]  # (N', V)
        kl_lp = torch.zeros(n, dtype=kl_logits.dtype, device=dev).index_add(0, ks, losses.gathered_logprobs(kl_logits, kt))
    del cache
    return lp, kl_lp, b.tokens() + Tokens(sum(len(r["kl_ids"]) for r in recs), sum(len(x) for x in doc), R * W)


def _apart(engine, spec: dict, recs: list[dict], pad_id: int):
    """As _kl_on_prefix, the KL pairs forwarded whole (prompt included)."""
    with torch.no_grad():  # z0 carries no gradient: this forward keeps no activations
        kl_lp, _, kl_tokens = forward(engine, spec, [r["kl_ids"] for r in recs], [r["kl_start"] for r in recs], pad_id)
    lp, _, tokens = forward(engine, spec, [r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    return lp, kl_lp, tokens + kl_tokens


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    """(loss, per-example metrics, batches.Tokens) of one micro-batch."""
    lp, kl_lp, tokens = _kl_on_prefix(engine, spec, recs, pad_id) or _apart(engine, spec, recs, pad_id)
    dev = lp.device
    ref = torch.tensor([r["ref_logp"] for r in recs], device=dev, dtype=lp.dtype)
    ref_kl = torch.tensor([r["ref_kl_logp"] for r in recs], device=dev, dtype=lp.dtype)
    kl = losses.kto_kl(kl_lp, ref_kl)
    if torch.is_grad_enabled():  # training: every rank runs the same micro-batches, so the mean is collective
        kl = _mean_over_ranks(kl)
    desirable = torch.tensor([r["desirable"] for r in recs], device=dev)
    o = losses.kto_loss(lp, ref, desirable, kl, spec["beta"], spec["desirable_loss_weight"], spec["undesirable_loss_weight"])
    return o.losses.mean(), {"loss": o.losses.detach(), **o.metrics, "undesirable": 1 - o.metrics["desirable"]}, tokens


def summarize(totals: dict[str, float], n: int) -> dict:
    """Final metrics over the training set: class means of the implied reward and their gap."""
    n_d = totals["desirable"]
    out = {f"final_{k}": totals[k] / n for k in ("loss", "kl", "reward")}
    out["final_desirable_reward"] = totals["desirable_reward"] / max(n_d, 1)
    out["final_undesirable_reward"] = totals["undesirable_reward"] / max(n - n_d, 1)
    out["final_reward_gap"] = out["final_desirable_reward"] - out["final_undesirable_reward"]
    return out
