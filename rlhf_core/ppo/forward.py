"""The roles' forwards over a batch of experience: per-token log-probs (and entropy) of the tempered policy and
critic values, padded, packed into one row without padding, or with each prompt once and a branch per sample
(shared_prompt: GRPO's groups) (`token_outputs`), and how a batch is cut into
micro-batches (a fixed number of rows, or use_dynamic_batch's token bound). Shared by the Learner and the
Reference (roles.py).

A batch is a dict of tensors over B sequences of width L (prompt + response, right padded):
ids, attn # (B, L); per-token quantities # (B, L - 1), where column t belongs to token t + 1.
"""
from __future__ import annotations

import torch

from rlhf_core.rl import logprobs
from rlhf_core.runtime.devices import device, to_device, to_host


def model_kwargs(hp: dict, model_dir) -> dict:
    """from_pretrained's extra arguments of a role's model: the attention implementation (attn_implementation,
    OpenRLHF's --flash_attn = flash_attention_2), refused here, on the role's own host, when this host or the
    model cannot run it (rlhf_core.train.attention.check names the field and what this host has); and the log-prob
    backend RLHF_FLOWS_LOGPROBS names, checked here too (logprobs.check_backend: a liger-kernel too old or missing)."""
    from rlhf_core.train import attention

    impl = hp.get("attn_implementation", "sdpa")
    attention.check(impl, model_dir)
    logprobs.check_backend()
    return {"attn_implementation": impl}


def policy_logprobs(model, batch: dict, temperature: float = 1.0, entropy: str | None = None):
    """Per-token log-probs # (B, L - 1) of the tempered policy at the action columns (`mask`; all columns
    without one), and entropy # (B, L - 1) or None (rlhf_core.rl.logprobs: no (B, L, V) fp32 tensor)."""
    return logprobs.token_logprobs(model, batch["ids"], batch["attn"], batch.get("mask"), temperature, entropy)


def critic_values(model, batch: dict) -> torch.Tensor:
    """Per-token values # (B, L - 1) from a sequence-classification model's score head applied to every
    hidden state: the value of the state before token t + 1 sits in column t, as the log-probs do."""
    core = getattr(model, model.base_model_prefix)  # through the top module: ZeRO-3 prefetches (logprobs.through_top)
    return logprobs.through_top(model, lambda: model.score(core(
        input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).last_hidden_state).squeeze(-1)[:, :-1].float())


def prompt_groups(batch: dict) -> list[list[int]]:
    """Row indices of `batch` grouped by prompt (the tokens before the first action column; a row without one is
    its own group), groups in order of first appearance: GRPO's n samples of a prompt form one group."""
    ids, mask = batch["ids"], batch.get("mask")
    lens = batch["attn"].sum(-1).tolist()
    groups: dict[tuple, list[int]] = {}
    for i, n in enumerate(lens):
        act = (mask[i] > 0).nonzero() if mask is not None else []
        p = int(act[0]) + 1 if len(act) else n
        groups.setdefault(tuple(ids[i, :p].tolist()) if len(act) else ("row", i), []).append(i)
    return list(groups.values())


def grouped_order(batch: dict, generator: torch.Generator) -> torch.Tensor:
    """A random order of the rows that keeps each prompt group together (groups shuffled, rows in place), so the
    training micro-batches hold whole groups and their prompt is forwarded once (shared_prompt)."""
    groups = prompt_groups(batch)
    return torch.tensor([i for k in torch.randperm(len(groups), generator=generator).tolist() for i in groups[k]])


def _layout(batch: dict, groups: list[list[int]] | None):
    """The rows of a right-padded batch without padding, as one packed row (rlhf_core.train.batches.collate:
    position ids restart at each sample) or, given `groups` (prompt_groups), one row per group with the prompt once
    (batches.collate_groups); and the map back: padded (rows, cols) # (M,) each <- flat position `flat` # (M,)
    (row * T + column) of the layout, for every column t < n_i - 1 of sample i."""
    from rlhf_core.train import batches

    lens = batch["attn"].sum(-1).tolist()
    seqs = [batch["ids"][i, :n].tolist() for i, n in enumerate(lens)]
    if groups:
        b, where = batches.collate_groups([[seqs[i] for i in g] for g in groups], 0)
        at = dict(zip((i for g in groups for i in g), where))
    else:
        b = batches.collate(seqs, [0] * len(seqs), 0, packed=True)
        offsets = [0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]
        at = {i: torch.arange(n) + o for i, (n, o) in enumerate(zip(lens, offsets))}
    rows = torch.cat([torch.full((n - 1,), i) for i, n in enumerate(lens)])
    cols = torch.cat([torch.arange(n - 1) for n in lens])
    flat = torch.cat([at[i][:n - 1] for i, n in enumerate(lens)])  # the last token of a sample predicts nothing
    return b, (rows, cols, flat)


def _shared_pays(batch: dict, groups: list[list[int]], model, packing: bool) -> bool:
    """Whether a dense attention mask (sdpa / eager) makes the shared rows cheaper than the rows without sharing.
    A dense mask computes every (query, key) pair of a row, so a row of the prompt and n long branches costs
    (P + nR)^2 in attention against n (P + R)^2: at 32-token prompts and 128-token responses, n 8, the shared
    rows took 1.8x the padded rows' time on CPU (benchmarks/RESULTS.md), at 128 : 64 half. Cost per row of T
    tokens: T + T^2 / hidden (projections and MLP per token; attention per pair, its measured weight on CPU).
    flex_attention computes only the blocks the mask allows: there sharing always pays."""
    H = model.config.get_text_config().hidden_size
    lens = batch["attn"].sum(-1).tolist()
    cost = (lambda T: T + T * T / H)  # noqa: E731
    without = cost(sum(lens)) if packing else len(lens) * cost(max(lens))
    shared = 0.0
    for g in groups:
        s = [batch["ids"][i, :lens[i]].tolist() for i in g]
        L = min(map(len, s)) - 1
        for x in s[1:]:
            L = next((k for k in range(L) if x[k] != s[0][k]), L)
        shared += cost(L + sum(len(x) - L for x in s))
    return shared < without


def _on_host(batch: dict, host: dict | None) -> dict:
    """The layout's inputs (ids, attn, mask) on the CPU: `host` (the caller's CPU copy), else one copy of each from the
    device; read there row by row, so a GPU waits once per tensor rather than once per row (a host sync each)."""
    if host is not None or batch["ids"].device.type in ("cpu", "meta"):
        return batch if host is None else host
    return {k: batch[k].cpu() for k in ("ids", "attn", "mask") if k in batch}


def token_outputs(model, batch: dict, kind: str, temperature: float = 1.0, entropy: str | None = None,
                  packing: bool = False, shared: bool = False, host: dict | None = None):
    """(log-probs of the tempered policy (kind "policy") or values ("critic") # (B, L - 1), entropy or None,
    tokens forwarded). With `packing` (OpenRLHF's --packing_samples) the rows go through the model as one
    packed row (no padding forwarded); with `shared` (shared_prompt) the rows of one prompt go as one row with
    the prompt once and a branch per sample (batches.collate_groups; where no two rows share a prompt, or under
    flash_attention_2, whose varlen kernel has no shared prefix: padded or packed as without it). The mask comes from rlhf_core.train.attention (flex / flash where the
    model uses them, else a dense mask, logged once); the outputs come back in the padded (B, L - 1) layout.
    `host`: the same batch on the CPU, where the layout is worked out (_on_host)."""
    # shared: where rows share a prompt (a meta tensor, in the device tests, has no tokens to compare)
    on_meta = batch["ids"].device.type == "meta"
    hb = _on_host(batch, host) if (shared or packing) and not on_meta else batch
    groups = prompt_groups(hb) if shared and not on_meta else None
    if groups is None or all(len(g) == 1 for g in groups) or model.config._attn_implementation.startswith("flash"):
        groups = None
    elif model.config._attn_implementation != "flex_attention" and not _shared_pays(hb, groups, model, packing):
        groups = None
    if not (packing or groups):
        tokens = batch["ids"].numel()
        if kind == "policy":
            return (*policy_logprobs(model, batch, temperature, entropy), tokens)
        return critic_values(model, batch), None, tokens
    from rlhf_core.train import attention

    dev = batch["ids"].device
    pb, (rows, cols, flat) = _layout(hb, groups)
    kw = attention.model_inputs(model, pb, dev)
    B, T = batch["ids"].shape[0], batch["ids"].shape[1] - 1

    def unpack(x, r, c):  # (M,) -> (B, L - 1), zeros where a row has no output (autograd flows through)
        return x.new_zeros(B, T).index_put((r, c), x)

    if kind == "critic":
        rows, cols, flat = rows.to(dev), cols.to(dev), flat.to(dev)
        core = getattr(model, model.base_model_prefix)
        v = logprobs.through_top(model, lambda: model.score(core(**kw, use_cache=False).last_hidden_state))  # (R, T', 1)
        return unpack(v.reshape(-1)[flat].float(), rows, cols), None, pb.input_ids.numel()
    mask = hb.get("mask")
    if mask is not None:  # only the action columns go through the head (selected on the host: no sync)
        sel = mask[rows, cols] > 0
        rows, cols, flat = rows[sel], cols[sel], flat[sel]
    targets = hb["ids"][rows, cols + 1].to(dev)
    rows, cols, flat = rows.to(dev), cols.to(dev), flat.to(dev)
    lp, ent = logprobs.selected_logprobs(model, kw, flat, targets, temperature, entropy)
    return unpack(lp, rows, cols), unpack(ent, rows, cols) if ent is not None else None, pb.input_ids.numel()


def rows_of(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def trimmed(b: dict) -> dict:
    """`b` without the columns past its longest row (ids / attn # (B, W), per-token tensors # (B, W - 1)):
    a token-bounded micro-batch forwards only its own width."""
    L, w = b["ids"].shape[1], int(b["attn"].sum(-1).max())
    return {k: v[:, :w if v.shape[1] == L else w - 1] if torch.is_tensor(v) and v.dim() == 2 else v
            for k, v in b.items()}


def token_cost(lengths: list[int], packing: bool) -> int:
    """Tokens one micro-batch of rows with these lengths forwards: their sum packed, rows x the longest padded."""
    return sum(lengths) if packing else len(lengths) * max(lengths, default=0)


def token_bounded(lengths: list[int], bound: int, packing: bool, at_least: int = 0) -> list[list[int]]:
    """Row indices of micro-batches whose token_cost stays <= `bound` (use_dynamic_batch): first fit over
    the rows longest first, as OpenRLHF's get_minimum_num_micro_batch_size (a row longer than the bound
    alone); then the fullest micro-batches are halved until there are `at_least` of them (every rank of a
    group must run the same number of forwards: ZeRO-3 gathers parameters in each)."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b in bins:
            if token_cost([lengths[j] for j in b + [i]], packing) <= bound:
                b.append(i)
                break
        else:
            bins.append([i])
    while len(bins) < at_least:
        big = max(range(len(bins)), key=lambda k: len(bins[k]))
        if len(bins[big]) < 2:
            raise ValueError(f"cannot make {at_least} micro-batches of {len(lengths)} rows")
        b = bins.pop(big)
        bins += [b[:len(b) // 2], b[len(b) // 2:]]
    return bins


def _group_max(n: int) -> int:
    """The largest `n` over this process's torch.distributed group (n itself without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    # nccl reduces CUDA tensors only: the count goes on this rank's GPU there, on the CPU under gloo
    t = torch.tensor([n], device=device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def micro_batches(batch: dict, hp: dict, rollout: bool) -> list[list[int]]:
    """Row indices of each micro-batch of `batch`: micro_rollout_batch_size (experience forwards, `rollout`)
    or micro_train_batch_size rows in order; with use_dynamic_batch, token-bounded micro-batches
    (rollout_max_tokens_per_gpu / train_max_tokens_per_gpu), as many on every rank of the group."""
    n = batch["ids"].shape[0]
    if not hp.get("use_dynamic_batch"):
        size = hp["micro_rollout_batch_size" if rollout else "micro_train_batch_size"] or n
        return [list(range(s, min(n, s + size))) for s in range(0, n, size)]
    lengths = batch["attn"].sum(-1).tolist()
    bound = hp["rollout_max_tokens_per_gpu" if rollout else "train_max_tokens_per_gpu"]
    bins = token_bounded(lengths, bound, hp["packing_samples"])
    return token_bounded(lengths, bound, hp["packing_samples"], _group_max(len(bins)))


def experience(batch: dict, hp: dict, dev, fn) -> torch.Tensor:
    """fn(micro-batch on `dev`, the same on the CPU) -> per-token outputs, over the experience micro-batches of
    `batch`, gathered back in row order on the CPU # (B, L - 1) (token-bounded micro-batches are cut to their own
    width)."""
    out = torch.zeros(batch["ids"].shape[0], batch["ids"].shape[1] - 1)  # (B, L - 1)
    for idx in micro_batches(batch, hp, rollout=True):
        rows = rows_of(batch, idx)
        rows = trimmed(rows) if hp["use_dynamic_batch"] else rows  # on the CPU: no host sync
        o = to_host(fn(to_device(rows, dev), rows).float())
        out[idx, :o.shape[1]] = o
    return out
