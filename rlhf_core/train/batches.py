"""Tokenized training examples, the deterministic data order, and batch collation (padded or packed).

The data order is a pure function of (seed, epoch, step), so a resumed job trains exactly the samples the
killed one had not reached: no checkpointed iterator is needed, only the step number.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_core.inputs.data import DataError


# ---------------------------------------------------------------------------------------------- tokenizing (parent)
def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _fit(prompt: list[int], response: list[int], max_len: int, overlong: str, where: str,
         bos_id: int | None = None) -> tuple[list[int], bool]:
    """prompt + response within max_len: the response is cut (then the prompt from the left, keeping its BOS,
    `bos_id`, in front) or the row refused."""
    from rlhf_core.inputs.models import keep_last

    ids = prompt + response
    if len(ids) <= max_len:
        return ids, False
    if overlong == "reject":
        raise DataError(f"{where}: {len(ids)} tokens exceed max_len {max_len} (set overlong=truncate to cut it)")
    if len(prompt) >= max_len:  # keep the prompt's end (and its BOS) and one response token
        prompt = keep_last(prompt, max_len - 1, bos_id)
    return (prompt + response)[:max_len], True


class Encoder:
    """(prompt, response) -> token ids, the one tokenization of training (sft, rm, dpo, reference pass) and
    reward-model scoring: prompt with one BOS (rlhf_core.inputs.models.prompt_ids), response without special tokens,
    the tokenizer's EOS after a finished response only (a response cut at the length limit did not end
    there), then cut to max_len by `_fit`. Prompt and response are tokenized apart, so the loss boundary
    falls between tokens."""

    def __init__(self, tok, max_len: int, overlong: str = "truncate", model_dir=None):
        from rlhf_core.inputs import models

        self.tok, self.max_len, self.overlong = tok, max_len, overlong
        self.bos, self.eos = models.adds_bos(tok), models.eos_id(tok, model_dir)

    def prompt(self, text: str) -> list[int]:
        from rlhf_core.inputs import models

        return models.prompt_ids(self.tok, text or "", self.bos)

    def __call__(self, prompt: str | list[int], response: str, finished: bool | None = True,
                 where: str = "") -> tuple[list[int], int, bool]:
        """(ids, start of the response, whether it was cut)."""
        p = self.prompt(prompt) if isinstance(prompt, str) else prompt
        r = _ids(self.tok, response) + ([self.eos] if finished is not False else [])
        ids, cut = _fit(p, r, self.max_len, self.overlong, where, self.tok.bos_token_id if self.bos else None)
        return ids, min(len(p), len(ids) - 1), cut


def tokenize_sft(rows: list[dict], tok, max_len: int, pretrain_mode: bool = False, overlong: str = "truncate",
                 where: str = "sft data", model_dir=None) -> tuple[list[dict], int]:
    """sft rows (input, output, finished?) -> {ids, start}: loss on ids[start:] (0 in pretrain_mode).
    Returns (records, n_cut)."""
    enc = Encoder(tok, max_len, overlong, model_dir)
    out, cut = [], 0
    for i, r in enumerate(rows):
        if not str(r["output"]).strip():
            raise DataError(f"{where} row {i}: key 'output' is empty")
        ids, start, c = enc(r["input"], r["output"], r.get("finished"), f"{where} row {i}")
        cut += c
        out.append({"ids": ids, "start": 0 if pretrain_mode else start})
    return out, cut


def tokenize_multiturn(rows: list[dict], tok, max_len: int, overlong: str = "truncate", where: str = "sft data",
                       model_dir=None) -> tuple[list[dict], int]:
    """Conversations ({"messages": [{role, content}, ...]}) -> {ids, start: [[a, b], ...]}: the loss covers
    every assistant turn (OpenRLHF --multiturn). The chat template renders the conversation; a turn's span is
    the text the template adds for it (content and end-of-turn markup): the render up to and including the
    turn minus the render of the turns before it with the generation prompt. The text is tokenized piece by
    piece at those boundaries, so each span boundary falls between tokens (as Encoder does for prompt and
    response), the first piece with one BOS. A conversation ending on an assistant turn whose span holds no
    EOS id gets the tokenizer's EOS there, as single-turn SFT appends it. Longer than max_len: cut from the
    right (spans clipped) or, with overlong=reject, refused. Returns (records, n_cut)."""
    from rlhf_core.inputs import models

    bos, eos = models.adds_bos(tok), models.eos_ids(tok, model_dir)

    def render(msgs, gen=False):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    out, cut = [], 0
    for i, r in enumerate(rows):
        msgs = r["messages"]
        full = render(msgs)
        ids, spans, pos = [], [], 0
        for j in (j for j, m in enumerate(msgs) if m["role"] == "assistant"):
            before, through = render(msgs[:j], True), render(msgs[:j + 1])
            if not (through.startswith(before) and full.startswith(through) and len(before) >= pos):
                raise DataError(f"{where} row {i}: the chat template does not render assistant message {j} as an "
                                "extension of the messages before it, which multiturn needs")
            ids += models.prompt_ids(tok, full[:len(before)], bos) if pos == 0 else _ids(tok, full[pos:len(before)])
            spans.append([len(ids), len(ids) + len(turn := _ids(tok, full[len(before):len(through)]))])
            ids += turn
            pos = len(through)
        if msgs[-1]["role"] == "assistant" and not set(ids[spans[-1][0]:]) & set(eos):
            ids.append(eos[0])
            spans[-1][1] += 1
        ids += _ids(tok, full[pos:])
        if len(ids) > max_len:
            if overlong == "reject":
                raise DataError(f"{where} row {i}: {len(ids)} tokens exceed max_len {max_len} (set overlong=truncate to cut it)")
            ids, cut = ids[:max_len], cut + 1
            spans = [[a, min(b, max_len)] for a, b in spans if min(b, max_len) > max(a, 1)]
            if not spans:
                raise DataError(f"{where} row {i}: no assistant token within max_len {max_len}")
        out.append({"ids": ids, "start": spans})
    return out, cut


def tokenize_pairs(rows: list[dict], tok, max_len: int, overlong: str = "truncate", where: str = "pairs data",
                   extra: tuple[str, ...] = (), model_dir=None) -> tuple[list[dict], int]:
    """pairs rows (prompt, chosen, rejected, chosen_finished?, rejected_finished?) ->
    {chosen_ids, chosen_start, rejected_ids, rejected_start, *extra}."""
    enc = Encoder(tok, max_len, overlong, model_dir)
    out, cut = [], 0
    for i, r in enumerate(rows):
        for k in ("chosen", "rejected"):
            if not isinstance(r.get(k), str) or not r[k].strip():
                raise DataError(f"{where} row {i}: key {k!r} is empty or missing (prompt-only rows cannot be trained on)")
        if r["chosen"] == r["rejected"]:
            raise DataError(f"{where} row {i}: 'chosen' and 'rejected' are identical ({r['chosen'][:40]!r})")
        prompt = enc.prompt(r.get("prompt") or "")
        rec = {}
        for k in ("chosen", "rejected"):
            ids, start, c = enc(prompt, r[k], r.get(f"{k}_finished"), f"{where} row {i} ({k})")
            cut += c
            rec[f"{k}_ids"], rec[f"{k}_start"] = ids, start
        for k in extra:
            if r.get(k) is None:
                raise DataError(f"{where} row {i}: key {k!r} is missing or null")
            rec[k] = float(r[k])
        out.append(rec)
    return out, cut


def seq_len(rec: dict) -> int:
    return len(rec["ids"]) if "ids" in rec else len(rec["chosen_ids"]) + len(rec["rejected_ids"])


# ---------------------------------------------------------------------------------------------- data order
@dataclass
class BatchPlan:
    """Which sample ids each optimizer step and each rank's micro-batches train on.

    Epoch e is a seeded permutation; with `bucketing`, windows of 8 global batches are sorted by length and
    cut into batches (batch order re-shuffled), so a micro-batch pads only to similar lengths."""

    lengths: list[int]
    train_batch_size: int
    micro_batch_size: int
    world_size: int
    seed: int
    max_epochs: int
    bucketing: bool = True

    def __post_init__(self):
        self.steps_per_epoch = len(self.lengths) // self.train_batch_size
        if self.steps_per_epoch == 0:
            raise DataError(f"{len(self.lengths)} samples are fewer than one train_batch_size ({self.train_batch_size})")
        self.total_steps = self.steps_per_epoch * self.max_epochs
        self._epochs: dict[int, list[list[int]]] = {}

    def _epoch(self, e: int) -> list[list[int]]:
        if e not in self._epochs:
            rng = random.Random(self.seed * 1000 + e)
            order = list(range(len(self.lengths)))
            rng.shuffle(order)
            order = order[: self.steps_per_epoch * self.train_batch_size]
            B = self.train_batch_size
            batches = []
            win = B * (8 if self.bucketing else 1)
            for w in range(0, len(order), win):
                chunk = order[w:w + win]
                if self.bucketing:
                    chunk = sorted(chunk, key=lambda i: self.lengths[i])
                part = [chunk[k:k + B] for k in range(0, len(chunk), B)]
                if self.bucketing:
                    rng.shuffle(part)
                batches += part
            self._epochs = {e: batches}  # keep one epoch in memory
        return self._epochs[e]

    def batch(self, step: int) -> list[int]:
        """The global batch (all ranks) of optimizer step `step` (0-based)."""
        return self._epoch(step // self.steps_per_epoch)[step % self.steps_per_epoch]

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        ids = sorted(self.batch(step), key=lambda i: self.lengths[i])
        m = self.micro_batch_size
        mbs = [ids[k:k + m] for k in range(0, len(ids), m)]
        return mbs[rank::self.world_size]


# ---------------------------------------------------------------------------------------------- collation
@dataclass(frozen=True)
class Tokens:
    """What a forward costs, in tokens: `samples`, the tokens of its samples each on its own (prompt + response;
    a prompt that pairs or groups share, once per sample: the throughput figure, comparable with a peer's);
    `forwarded`, the positions the model ran that hold a token (a shared prompt once); `positions`, every position
    it ran, padding included (rows x columns). e.g. a DPO pair with a 10-token prompt and 5 + 3 response tokens,
    one row: samples 28, forwarded 18, positions 18; the same pair as two padded rows: 28, 28, 30."""

    samples: int = 0
    forwarded: int = 0
    positions: int = 0

    def __add__(self, other: "Tokens") -> "Tokens":
        return Tokens(self.samples + other.samples, self.forwarded + other.forwarded, self.positions + other.positions)


@dataclass
class Batch:
    """Sequences as rows (layout "padded", R = n), packed one after another into one row or into rows of at
    most a token budget ("packed", R <= n), or pairs sharing their prompt ("pairs", R = n / 2). input_ids, position_ids, target_mask, segment: # (R, T); segment = sample
    index, n for padding; last: # (n, 2) (row, column) of each sample's last token; `explicit`: the targets when
    they are not the next column. Attention: padded rows carry attention_mask # (R, T) (1 = token); packed and
    pairs carry no (T, T) mask but doc # (R, T) (the sequence of each token, -1 padding) and branch # (R, T)
    (0 shared prompt, 1 chosen, 2 rejected), from which rlhf_core.train.attention.model_inputs builds each
    layer's mask for the model's attention implementation (attention_mask is None for them)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    target_mask: torch.Tensor
    segment: torch.Tensor
    last: torch.Tensor
    n: int
    real_tokens: int
    explicit: tuple | None = None
    doc: torch.Tensor | None = None
    branch: torch.Tensor | None = None
    layout: str = "padded"

    def tokens(self) -> Tokens:
        """This batch's Tokens: real_tokens (each sample whole), the positions holding a token (segment < n: a shared
        prompt is one sample's), every position."""
        return Tokens(self.real_tokens, int((self.segment < self.n).sum()), self.input_ids.numel())

    def targets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, tokens, samples), each # (N,): token tokens[j] of sample samples[j] is predicted by the
        logits at (rows[j], cols[j]). One entry per loss target, so the LM head runs on these positions only."""
        if self.explicit is not None:
            return self.explicit
        r, c = self.target_mask[:, 1:].nonzero(as_tuple=True)
        return r, c, self.input_ids[r, c + 1], self.segment[r, c + 1]


def loss_targets(start: int | list, length: int) -> torch.Tensor:
    """Which tokens of a sample are loss targets, # (length,) bool: t >= start, or, when `start` is a list
    of [a, b) spans (multi-turn SFT: every assistant turn), t in a span; never t = 0 (the first token of a
    sample is not predicted from inside the sample)."""
    return torch.tensor(_target_list(start, length), dtype=torch.bool)


def _target_list(start: int | list, length: int) -> list[int]:
    m = [0] * length
    for a, b in ([(start, length)] if isinstance(start, int) else start):
        lo, hi = max(a, 1), min(b, length)
        m[lo:hi] = [1] * max(0, hi - lo)
    return m


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing (TRL's packing_strategy "bfd"): sample indices per row, longest samples first, each
    into the fullest row it still fits in, so that no row holds more than `capacity` tokens (a sample longer than
    `capacity` gets a row of its own; none is ever split). Within a row the samples keep their index order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r, f in enumerate(free) if f >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: free[r])
            rows[r].append(i)
            free[r] -= lengths[i]
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return [sorted(r) for r in rows]


def collate(seqs: list[list[int]], starts: list, pad_id: int, packed: bool = False, row_len: int | None = None) -> Batch:
    """Token lists -> a Batch. The loss targets of sample i are loss_targets(starts[i], len(seqs[i])).
    `packed`: samples one after another, each with its own positions, attending within itself only: in one
    row (`row_len` None), or in rows of at most `row_len` tokens (pack_rows), right-padded to the longest row,
    so that attention costs sum(row^2) instead of (all tokens)^2 and no sample pays for another's padding."""
    n = len(seqs)
    real = sum(len(s) for s in seqs)
    if packed:
        rows = pack_rows([len(s) for s in seqs], row_len) if row_len else [list(range(n))]
        ids, pos, seg, tgt, last = [], [], [], [], [[0, 0]] * n
        for r, members in enumerate(rows):
            ids.append([t for i in members for t in seqs[i]])
            pos.append([p for i in members for p in range(len(seqs[i]))])
            seg.append([i for i in members for _ in seqs[i]])
            tgt.append([m for i in members for m in _target_list(starts[i], len(seqs[i]))])
            end = -1
            for i in members:
                end += len(seqs[i])
                last[i] = [r, end]
        T = max(len(x) for x in ids)
        seg = _padded(seg, n, T)
        doc = torch.where(seg < n, seg, -1)  # -1: padding
        # No mask tensor: the documents (doc) and positions say it (attention.model_inputs).
        return Batch(_padded(ids, pad_id, T), _padded(pos, 0, T), None, _padded(tgt, 0, T), seg,
                     torch.from_numpy(np.array(last, dtype=np.int64)), n, real, doc=doc,
                     branch=torch.zeros(seg.shape, dtype=torch.long), layout="packed")
    T = max(len(s) for s in seqs)
    ids = _padded(seqs, pad_id, T)
    att = _padded([[1] * len(s) for s in seqs], 0, T)
    tgt = _padded([_target_list(st, len(s)) for s, st in zip(seqs, starts)], 0, T)
    seg = _padded([[i] * len(s) for i, s in enumerate(seqs)], n, T)
    pos = torch.arange(T).expand(n, T).clone()
    last = torch.stack([torch.arange(n), torch.tensor([len(s) - 1 for s in seqs])], 1)
    return Batch(ids, pos, att, tgt, seg, last, n, real)


def _padded(rows: list[list[int]], fill: int, width: int) -> torch.Tensor:
    """int lists -> # (len(rows), width) int64, right-padded with `fill` (numpy: ~6x faster than torch.tensor)."""
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return torch.from_numpy(out)


def collate_pairs(chosen: list[list[int]], c_starts: list[int], rejected: list[list[int]], r_starts: list[int],
                  pad_id: int) -> Batch:
    """Preference pairs, one row each: [shared prompt | chosen response | rejected response], so the prompt
    is forwarded once per pair instead of twice (prefix sharing, Wang et al. 2024, arXiv:2410.20305). Each
    response attends to the prompt and to itself only, with the positions it would have alone, so every
    log-prob equals that of the padded two-row layout (the mask: attention.mask_function). Samples 0..k-1 are the chosen, k..2k-1 the rejected
    (the order of `collate(chosen + rejected, ...)`). The shared part is the common prefix of the two token
    lists, at most up to the earlier response start (after truncation the two prompts may differ).
    Built as Python lists and turned into tensors once: collation is on every step's critical path."""
    k = len(chosen)
    ids, pos, part, seg, last = [], [], [], [], [[0, 0]] * (2 * k)
    tr, tc, tt, ts = [], [], [], []
    for i, (c, cs, r, rs) in enumerate(zip(chosen, c_starts, rejected, r_starts)):
        L = 0
        while L < min(cs, rs) and c[L] == r[L]:
            L += 1
        nc, nr = len(c), len(r)
        ids.append(c + r[L:])
        pos.append(list(range(nc)) + list(range(L, nr)))
        part.append([0] * L + [1] * (nc - L) + [2] * (nr - L))  # 0 prompt, 1 chosen, 2 rejected, -1 padding
        seg.append([i] * nc + [k + i] * (nr - L))
        # token t is predicted by the logits of token t - 1; rejected token p sits at column p (p < L) or nc + p - L
        pc, pr = range(max(cs, 1) - 1, nc - 1), range(max(rs, 1) - 1, nr - 1)
        tc += [*pc, *(p if p < L else nc + p - L for p in pr)]
        tt += [*c[max(cs, 1):], *r[max(rs, 1):]]
        tr += [i] * (len(pc) + len(pr))
        ts += [i] * len(pc) + [k + i] * len(pr)
        last[i], last[k + i] = [i, nc - 1], [i, nc + nr - L - 1 if nr - 1 >= L else nr - 1]
    T = max(len(row) for row in ids)
    ids, pos, part, seg = _padded(ids, pad_id, T), _padded(pos, 0, T), _padded(part, -1, T), _padded(seg, 2 * k, T)
    doc = torch.where(part >= 0, 0, -1)  # one sequence per row; -1 padding
    explicit = tuple(torch.from_numpy(np.array(x, dtype=np.int64)) for x in (tr, tc, tt, ts))
    real = sum(len(c) + len(r) for c, r in zip(chosen, rejected))
    last = torch.from_numpy(np.array(last, dtype=np.int64))
    return Batch(ids, pos, None, torch.zeros((k, T), dtype=torch.long), seg, last, 2 * k, real, explicit,
                 doc=doc, branch=part.clamp(min=0), layout="pairs")


def collate_groups(groups: list[list[list[int]]], pad_id: int) -> tuple[Batch, list[torch.Tensor]]:
    """Samples that share their prompt (GRPO's n samples of a prompt), one row per group: [shared prefix | branch 1
    | ... | branch n], the prefix forwarded once instead of n times; collate_pairs's layout with n branches. Each
    branch attends to the prefix and to itself only, at the positions it would have alone (branch = k for the
    k-th sample, 0 for the prefix: attention.mask_function), so every output equals the padded layout's. The
    prefix is the common prefix of the group's token lists, kept one token short of the shortest (each branch
    holds a token): it may run past the prompt into responses that begin alike, which is exact too (a shared
    token has the same context in every sample). Returns the Batch (layout "groups", no loss targets: the
    caller reads outputs by position) and, per sample in group order, the flat index (row * T + column) of each
    of its tokens # (n_j,)."""
    ids, pos, part, where = [], [], [], []
    for g in groups:
        L = min(len(s) for s in g) - 1
        for s in g[1:]:
            L = next((k for k in range(L) if s[k] != g[0][k]), L)
        row, rpos, rpart = list(g[0][:L]), list(range(L)), [0] * L
        for k, s in enumerate(g, 1):
            where.append((len(ids), list(range(L)) + list(range(len(row), len(row) + len(s) - L))))
            row += s[L:]
            rpos += range(L, len(s))
            rpart += [k] * (len(s) - L)
        ids.append(row)
        pos.append(rpos)
        part.append(rpart)
    T = max(len(r) for r in ids)
    ids, pos, part = _padded(ids, pad_id, T), _padded(pos, 0, T), _padded(part, -1, T)
    doc = torch.where(part >= 0, 0, -1)  # one sequence per row; -1 padding
    n = sum(len(g) for g in groups)
    seg = torch.full(ids.shape, n, dtype=torch.long)
    real = sum(len(s) for g in groups for s in g)
    b = Batch(ids, pos, None, torch.zeros_like(ids), seg, torch.zeros((n, 2), dtype=torch.long), n, real,
              doc=doc, branch=part.clamp(min=0), layout="groups")
    return b, [torch.tensor(cols, dtype=torch.long) + r * T for r, cols in where]


def per_sample_sum(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum of next-token values over each sample's targets. values # (R, T-1) aligned to targets 1..T-1 -> # (n,)."""
    seg = batch.segment[:, 1:].reshape(-1)
    w = values * batch.target_mask[:, 1:].to(values.dtype)
    return torch.zeros(batch.n + 1, dtype=values.dtype, device=values.device).index_add(0, seg, w.reshape(-1))[: batch.n]
