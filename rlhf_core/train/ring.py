"""Ring attention (sequence parallelism) for packed micro-batches, on any torch.distributed backend (gloo too).

OpenRLHF's `--ds.ring_attn_size` / `--ds.ring_attn_head_stride`: the ranks form groups of `ring_attn_size`
consecutive ranks; the ranks of a group train on the same micro-batches, each forwarding one contiguous slice
of the packed row (padded to a multiple of the group size), and attention sees the whole row through the
group's keys and values. OpenRLHF runs ring_flash_attn's llama3 varlen function (flash-attn, CUDA only),
which all-gathers K/V over the group `heads_k_stride` heads at a time instead of passing blocks around a
ring (the context parallelism of the Llama 3 paper, arXiv:2407.21783 section 3.3.2: K/V all-gathered, each
rank's queries against them). This module does the same with torch collectives and SDPA:

- `attention` is registered with transformers' AttentionInterface as "ring": it gathers K/V of
  `ring_head_stride` KV heads at a time over the group and runs this rank's queries against them under the
  slice's rows of the block-diagonal causal mask (documents of the packed row never see each other);
- `local_batch` cuts a packed Batch to this rank's slice (targets whose predicting position is in the slice);
- `sum_over_group` adds the slices' per-sample sums, so every rank of a group computes the same loss.

Gradients: each collective's backward is its adjoint under "the objective is the sum of every rank's loss"
(K/V gather -> all-reduce of the gathered gradient, then this rank's slice; all-reduce -> all-reduce). The
group's R ranks each compute the micro-batch loss L, so the objective is R * L; DeepSpeed averages the
gradients over world = dp * R ranks, which leaves the data-parallel mean of dL/dθ: the same step as
`world / R` ranks without ring attention (tests/rlhf_core/train/test_scale.py checks loss and gradients).

Left out: sliding-window and soft-capped attention (refused by name), methods that read hidden states at a
sample's last token (rm, prm, kd: refused before training), and a real ring (blockwise passing, O(T/R)
memory per rank): the gathered K/V of `ring_head_stride` heads is T long on every rank.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

NAME = "ring"
METHODS = ("sft", "dpo", "kto")  # the methods whose loss is a sum over loss targets (entry.forward)
_state = {"group": None, "size": 1, "index": 0, "stride": 1}


def size() -> int:
    """The ring group's size (1: ring attention is off)."""
    return _state["size"]


def setup(rank: int, world: int, ring_size: int, head_stride: int, method: str) -> tuple[int, int]:
    """Create the ring groups (every rank takes part in each new_group call) and register the attention
    function; returns this rank's (data-parallel rank, data-parallel world size)."""
    if world % ring_size:
        raise SystemExit(f"ring_attn_size {ring_size} does not divide the world size {world}")
    if method not in METHODS:
        raise SystemExit(f"ring_attn_size > 1 supports the methods {', '.join(METHODS)}; {method!r} reads a "
                         "sample's last hidden state, which ring attention splits over ranks")
    for g in range(world // ring_size):
        ranks = list(range(g * ring_size, (g + 1) * ring_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _state.update(group=group, size=ring_size, index=rank - g * ring_size, stride=head_stride)
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    return rank // ring_size, world // ring_size


def use_ring_attention(model) -> None:
    """Switch `model` (bare or PEFT-wrapped) to the registered ring attention function."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = core.config.get_text_config()
    for k in ("sliding_window", "attn_logit_softcapping"):
        if getattr(cfg, k, None) and (k != "sliding_window" or getattr(cfg, "use_sliding_window", True)):
            raise SystemExit(f"ring_attn_size > 1: the model's {k}={getattr(cfg, k)} is not implemented by "
                             "rlhf_core.train.ring's attention")
    core.set_attn_implementation(NAME)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (# (B, H, t, D) -> (B, H, R*t, D), group order = slice order); backward:
    the gathered gradient summed over the group (every rank's loss used every slice), this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(_state["size"])]
        dist.all_gather(parts, x.contiguous(), group=_state["group"])
        ctx.t = x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=_state["group"])
        i = _state["index"]
        return g[:, :, i * ctx.t:(i + 1) * ctx.t]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the ring group; backward: the gradient summed over the group (every rank's loss
    read the sum)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_state["group"])
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=_state["group"])
        return g


def sum_over_group(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` # (n,) over the ring group, differentiable."""
    return _SumOverGroup.apply(x)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query # (B, Hq, t, D), key/value # (B, Hk, t, D) of this rank's slice
    (rotary already applied with the slice's position ids), attention_mask # (B, 1, t, T) bool (True = may
    attend) or additive, over the whole row. Returns (# (B, t, Hq, D), None)."""
    if getattr(module, "sliding_window", None):
        raise NotImplementedError("ring attention does not implement sliding-window layers")
    hk, groups = key.shape[1], query.shape[1] // key.shape[1]
    stride = max(1, min(_state["stride"], hk))
    outs = []
    for h in range(0, hk, stride):  # K/V of `stride` KV heads gathered at a time (OpenRLHF's head stride)
        k = _GatherSeq.apply(key[:, h:h + stride])  # (B, s, T, D)
        v = _GatherSeq.apply(value[:, h:h + stride])
        q = query[:, h * groups:(h + stride) * groups]  # (B, s * groups, t, D): GQA's query heads of these KV heads
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=attention_mask,
            dropout_p=dropout if module.training else 0.0, scale=scaling))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


def local_batch(b, pad_id: int):
    """This rank's slice of a packed Batch (one row of T tokens, rlhf_core.train.batches.collate): the row is
    padded to a multiple of the group size R (padding is its own document, segment n) and cut into R equal
    slices; the slice keeps its tokens, position ids and the loss targets its positions predict (explicit
    targets in slice columns, the next token may lie in the next slice), and gets the mask rows of its
    positions over the whole row # (1, 1, t, T)."""
    R, i = _state["size"], _state["index"]
    if b.input_ids.shape[0] != 1:
        raise ValueError("ring attention splits a packed row: set packing_samples=true")
    T = b.input_ids.shape[1]
    pad = (-T) % R
    t = (T + pad) // R
    a = i * t

    def padded(x, fill):  # (1, T) -> (1, T + pad)
        return torch.nn.functional.pad(x, (0, pad), value=fill)

    seg = padded(b.segment, b.n)[0]  # (T + pad,)
    ar = torch.arange(T + pad)
    q = slice(a, a + t)
    att = ((seg[q, None] == seg[None, :]) & (ar[q, None] >= ar[None, :]))[None, None]  # (1, 1, t, T + pad)
    rows, cols, toks, samples = b.targets()
    keep = (cols >= a) & (cols < a + t)
    local_seg = seg[None, q]
    return dataclasses.replace(
        b, input_ids=padded(b.input_ids, pad_id)[:, q], position_ids=padded(b.position_ids, 0)[:, q],
        attention_mask=att, target_mask=padded(b.target_mask, 0)[:, q], segment=local_seg,
        real_tokens=int((local_seg < b.n).sum()), explicit=(rows[keep], cols[keep] - a, toks[keep], samples[keep]))
