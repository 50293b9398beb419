"""Per-token log-probs and entropy of a causal LM's tempered policy, without a (B, L, V) fp32 tensor.

A 7B policy with a 152k vocabulary at 32 x 2048 tokens would need 40 GB for one fp32 log-softmax over every
position. Here the model's body runs once (hidden states # (B, L, H)); the LM head then runs only on the
action columns, `chunk` positions at a time, each chunk's logits cast to fp32 for the reduction (logsumexp,
the gathered target, the entropy), so the largest tensors are a few # (chunk, V).

Under autograd the head runs as one fused function (`FusedHeadLogprobs`, the default "fused" backend): its
forward keeps no logits, only h, the head's weight and per-token logsumexp / entropy # (N,); its backward
recomputes each chunk's logits once and writes the gradients of h, the weight and the bias by hand
(d log p_y / dz = onehot(y) - p; d H / dz = p * (E_p[z] - z); then through the temperature, soft-cap and
scale). That is the least work a per-token output allows: the upstream gradient of every token is unknown in
the forward, so the weight's gradient (a sum over tokens weighted by it) cannot be formed there as Liger's
fused linear cross-entropy does for a reduced loss. The log-probs and the entropy come out of the same pass over
each chunk's logits, so the learner's training forward (which always asks for the entropy: as a metric, or in
the loss with entropy_loss_coef) costs no more than the log-probs alone. The weight's (and bias's) gradient is
summed over the chunks in fp32 (a bf16 sum lost half the precision of plain bf16 autograd: relative error 0.0054
against 0.0029, at N 16384, H 64, V 512), one bf16 product per chunk accumulated in fp32 on CUDA (cuBLAS's
out_dtype), fp32 operands elsewhere; transient, V x H x 4 bytes (2.2 GB at Qwen2-7B's head).

A ZeRO-3-partitioned head (its weight an empty placeholder outside the head module's own call) runs the same
function inside that call (through_top on the head): DeepSpeed's hooks gather the weight for the forward,
gather it again before the backward of the outputs and take the gradient to its partitions. The "chunked"
backend (torch's checkpoint around each chunk: recompute under autograd, then autograd's own backward through
every elementwise op) serves heads that are not a plain nn.Linear (e.g. LoRA on the LM head).

On CUDA, Liger-Kernel's fused linear cross-entropy ("liger", >= 0.8.2: earlier releases give wrong weight
gradients with reduction="none", linkedin/Liger-Kernel#1298; checked when a role starts and at the first
forward) can give the log-probs: RLHF_FLOWS_LOGPROBS=liger, for a head without bias, its weight gradient
accumulated in fp32 (accum_dtype). Its kernel returns no entropy: the entropy comes from the fused pass beside it
(no gradient for the metric: one more pass over the logits in the forward; in the loss: that pass and its
backward too), so with an entropy it does more work than "fused" and is worth it only where the kit measures it
faster (`benchmarks/parts/logprobs.py --device cuda`, benchmarks/gpu/gpu_kit_run.py). Apple's cut-cross-entropy
was an option until issue 44: its one PyPI release (25.1.1) accumulates the weight's gradient in bf16 with no
fp32 option and returns no entropy either, so it was removed rather than pinned.

The policy is softmax(transform(logits) / T): T is the sampling temperature (OpenRLHF divides the logits by
it too), transform the architecture's own logit scaling (Gemma-2's final soft-capping, Cohere's logit_scale,
Granite's logits_scaling). top-p / top-k truncation is not applied (as in OpenRLHF and verl).

Columns follow rlhf_core.rl.losses.token_logprobs: column t of # (B, L - 1) is token t + 1 given tokens <= t.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 1024  # positions per LM-head chunk: (1024, 152k) fp32 logits = 0.6 GB at Qwen2's vocabulary
BACKENDS = ("fused", "chunked", "liger")
LIGER_MIN = "0.8.2"  # the first release whose reduction="none" weight gradients are right (Liger-Kernel#1298)


def through_top(model, fn, *args):
    """fn(*args) run as the forward of `model` (an HF model, PEFT-wrapped or not), so the hooks on the top module run:
    DeepSpeed ZeRO-3 resets its parameter coordinator's step in the top module's forward pre-hook, and only a
    trace recorded between two such resets is replayed to prefetch each layer's gather ahead of its use. A
    forward that calls the backbone and the head apart never resets it: the trace stays INVALID and every
    gather waits on the critical path (issue 35 item 6). The instance's own `forward` (accelerate's hooks set
    one) is put back afterwards. `args` go through the call (the module's hooks may wrap them: fn takes them)."""
    own = model.__dict__.get("forward")
    model.forward = fn  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    try:
        return model(*args)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def transform(config) -> tuple[float, float | None]:
    """(scale, soft-cap) of an architecture's logits: logits = cap * tanh(scale * (h W^T + b) / cap)."""
    scale = 1.0
    if (m := getattr(config, "logit_scale", None)) is not None:  # Cohere
        scale *= m
    if (d := getattr(config, "logits_scaling", None)) is not None:  # Granite
        scale /= d
    return scale, getattr(config, "final_logit_softcapping", None)  # Gemma-2


def _logits(h, weight, bias, scale: float, cap: float | None, T: float) -> torch.Tensor:
    """fp32 logits of the tempered policy for hidden states # (n, H) -> # (n, V), transformed in place."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    if scale != 1.0:
        z.mul_(scale)
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
    return z.div_(T) if T != 1.0 else z


def _chunk_stats(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """(log p(target), logsumexp, entropy or None), each # (n,), of tempered fp32 logits z # (n, V)."""
    lse = torch.logsumexp(z, -1)
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, lse, None
    return lp, lse, lse - (z - lse[:, None]).exp_().mul_(z).sum(-1)  # H = logsumexp - E_p[z]


def _fused_forward(h, weight, bias, targets, scale, cap, T, with_entropy: bool, chunk: int):
    lp, lse, ent = [], [], []
    for s in range(0, h.shape[0], chunk):
        a, b, c = _chunk_stats(_logits(h[s:s + chunk], weight, bias, scale, cap, T), targets[s:s + chunk], with_entropy)
        lp.append(a)
        lse.append(b)
        if with_entropy:
            ent.append(c)
    cat = (lambda x: torch.cat(x) if x else h.new_zeros(0, dtype=torch.float32))  # noqa: E731
    return cat(lp), cat(lse), cat(ent) if with_entropy else None


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in fp32 (or fp64) and a, b in the head's dtype, without rounding the product to that dtype:
    on CUDA one bf16 / fp16 product accumulated in fp32 (addmm's out_dtype, sm80+), elsewhere in acc's dtype
    (the same sums: a product of two bf16 values is exact in fp32)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and _OUT_DTYPE and torch.cuda.get_device_capability(a.device)[0] >= 8:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)  # addmm(out_dtype=)


class FusedHeadLogprobs(torch.autograd.Function):
    """(log p(targets), entropy) # (N,) each of softmax(transform(h W^T + b) / T) for h # (N, H): chunked, no
    logits kept; the backward recomputes each chunk's logits once (see the module docstring). `entropy`:
    None (an empty tensor is returned), "metric" (returned without a gradient) or "loss". An output nobody
    differentiates costs nothing in the backward (its part of the logits' gradient is skipped)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, scale, cap, T, entropy, chunk):
        lp, lse, ent = _fused_forward(h, weight, bias, targets, scale, cap, T, entropy is not None, chunk)
        ctx.save_for_backward(h, weight, bias, targets, lse, ent if ent is not None else lse.new_zeros(0))
        ctx.consts = (scale, cap, T, entropy == "loss", chunk)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        if ent is None:
            ent = lp.new_zeros(0)
        if entropy != "loss":
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, targets, lse, ent = ctx.saved_tensors
        scale, cap, T, ent_grad, chunk = ctx.consts
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_ent = g_ent if ent_grad else None
        if g_lp is None and g_ent is None:
            return (None,) * 9
        acc = torch.promote_types(weight.dtype, torch.float32)  # the weight's and bias's sums over chunks: fp32
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, h.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = _logits(h[sl], weight, bias, scale, cap, T)  # (n, V) fp32, tempered
            g = (z - lse[sl, None]).exp_()  # p
            if g_ent is not None:  # dH/dz = p * (E_p[z] - z), E_p[z] = lse - H
                ge = (lse[sl] - ent[sl])[:, None].sub(z).mul_(g).mul_(g_ent[sl, None])
            if g_lp is not None:  # d log p_y / dz = onehot(y) - p
                g.mul_(-g_lp[sl, None]).scatter_add_(1, targets[sl, None], g_lp[sl, None].to(g.dtype))
            else:
                g.zero_()
            if g_ent is not None:
                g.add_(ge)
                del ge
            if cap is not None:  # through cap * tanh(u / cap): 1 - tanh^2, tanh = z * T / cap
                g.mul_(z.mul_(T / cap).square_().neg_().add_(1))
            g.mul_(scale / T)  # through the scale and the temperature
            del z
            gd = g.to(h.dtype)
            if need_h:
                dh[sl] = gd @ weight
            if need_w:
                _add_product(dw, gd.t(), h[sl])
            if need_b:
                db.add_(g.sum(0))
        return (dh, dw.to(weight.dtype) if need_w else None, db.to(bias.dtype) if need_b else None,
                None, None, None, None, None, None)


def _chunked(head, config, h, targets, temperature: float, entropy: str | None, chunk: int):
    """The head module per chunk, each chunk checkpointed (recomputed under autograd in backward)."""
    scale, cap = transform(config)

    def one(hc, tc, with_entropy):
        return _chunk_stats(_logits_of(head, hc, scale, cap, temperature), tc, with_entropy)

    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        hc, tc = h[s:s + chunk], targets[s:s + chunk]
        if grad:  # the entropy in the same pass (a metric: detached, recomputed with the rest in the backward)
            lp, _, ent = checkpoint(one, hc, tc, entropy is not None, use_reentrant=False)
            if entropy == "metric":
                ent = ent.detach()
        else:
            lp, _, ent = one(hc, tc, entropy is not None)
        lps.append(lp)
        ents.append(ent)
    cat = (lambda x: torch.cat(x) if x else h.new_zeros(0, dtype=torch.float32))  # noqa: E731
    return cat(lps), cat(ents) if entropy else None


def _logits_of(head, h, scale, cap, T):
    z = head(h).float()
    if scale != 1.0:
        z = z * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z / T if T != 1.0 else z


def _liger_logprobs(weight, h, targets, scale, cap, T):
    """log p(targets) # (N,) by Liger's fused linear cross-entropy on CUDA (reduction "none", the weight's gradient
    summed in fp32). It computes cross-entropy of softcap' * tanh((h' W^T) / softcap'), so the temperature goes
    into h' = h * scale / T and softcap' = cap / T: (cap / T) tanh((scale h W^T / T) / (cap / T)) =
    cap tanh(scale h W^T / cap) / T. With reduction "none" Liger keeps the weight (a detached view) for its backward:
    under ZeRO-3 the gathered head weight stays alive from the forward to the backward."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    hs = h * (scale / T) if scale / T != 1.0 else h
    softcap = cap / T if cap is not None else None
    ce = LigerFusedLinearCrossEntropyLoss(reduction="none", softcap=softcap, accum_dtype=torch.float32)
    return -ce(weight, hs, targets).float()


def check_backend() -> str:
    """RLHF_FLOWS_LOGPROBS's backend, refused by name when unknown, and for "liger" when liger-kernel is missing or
    older than LIGER_MIN (its per-token weight gradients were wrong): the roles call it as they load their model
    (ppo.forward.model_kwargs), so a bad setting stops a run before any work."""
    want = os.environ.get("RLHF_FLOWS_LOGPROBS", "fused")
    if want not in BACKENDS:
        raise ValueError(f"RLHF_FLOWS_LOGPROBS={want!r} is not one of {', '.join(BACKENDS)}"
                         + (" (cut-cross-entropy was removed in issue 44: use liger or fused)" if want == "cce" else ""))
    if want == "liger":
        from importlib import metadata

        from packaging.version import Version

        fix = f"pip install 'liger-kernel>={LIGER_MIN}' (the gpu extra), or RLHF_FLOWS_LOGPROBS=fused"
        try:
            have = metadata.version("liger-kernel")
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"RLHF_FLOWS_LOGPROBS=liger needs liger-kernel >= {LIGER_MIN}, and it is not installed "
                               f"on this host: {fix}") from None
        if Version(have) < Version(LIGER_MIN):
            raise RuntimeError(f"RLHF_FLOWS_LOGPROBS=liger needs liger-kernel >= {LIGER_MIN}; this host has {have}, "
                               "whose per-token (reduction='none') weight gradients are wrong (linkedin/Liger-Kernel"
                               f"#1298): {fix}")
    return want


@functools.lru_cache(maxsize=None)
def _checked(want: str) -> str:
    return check_backend()


def backend(head, h: torch.Tensor) -> str:
    """The backend the head's log-probs use (module docstring): RLHF_FLOWS_LOGPROBS (check_backend, once per value)
    where it can serve this head; "chunked" for a head that is not a plain nn.Linear; "fused" for liger off CUDA
    or with a bias. A ZeRO-3-partitioned Linear takes the fused paths too (inside the head's call)."""
    want = _checked(os.environ.get("RLHF_FLOWS_LOGPROBS", "fused"))
    if type(head) is not torch.nn.Linear:
        return "chunked"
    if want == "liger" and (h.device.type != "cuda" or head.bias is not None):
        return "fused"
    return want


def head_logprobs(head, config, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  entropy: str | None = None, chunk: int = CHUNK):
    """(log p(targets), entropy or None) # (N,) each, fp32, of the tempered policy at hidden states h # (N, H)."""
    name = backend(head, h)
    if name == "chunked":
        return _chunked(head, config, h, targets, temperature, entropy, chunk)
    scale, cap = transform(config)

    def run(x):  # inside the head's own call where ZeRO-3 partitions its weight: its hooks gather it
        w, b = head.weight, head.bias
        if name == "liger":
            lp = _liger_logprobs(w, x, targets, scale, cap, temperature)
            if entropy == "loss":  # the fused pass's entropy (its log-probs unused: no gradient work for them)
                return lp, FusedHeadLogprobs.apply(x, w, b, targets, scale, cap, temperature, "loss", chunk)[1]
            if entropy == "metric":
                with torch.no_grad():
                    return lp, _fused_forward(x, w, b, targets, scale, cap, temperature, True, chunk)[2]
            return lp, None
        if not torch.is_grad_enabled():
            lp, _, ent = _fused_forward(x, w, b, targets, scale, cap, temperature, entropy is not None, chunk)
            return lp, ent
        lp, ent = FusedHeadLogprobs.apply(x, w, b, targets, scale, cap, temperature, entropy, chunk)
        return lp, ent if entropy else None

    if hasattr(head.weight, "ds_id"):  # ds_id: a ZeRO-3-partitioned parameter
        return through_top(head, run, h)
    return run(h)


def selected_logprobs(model, inputs: dict, index: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      entropy: str | None = None, chunk: int = CHUNK):
    """(log p(targets), entropy or None) # (N,) each, where token targets[j] is predicted by the hidden state at
    flat position index[j] (row * T + column) of the model's forward over `inputs` (input_ids, position_ids,
    attention_mask of any layout: rlhf_core.train.attention.model_inputs). Body and head run inside the top
    module's call (through_top)."""
    def run():
        body = getattr(model, model.base_model_prefix)
        h = body(**inputs, use_cache=False).last_hidden_state  # (R, T, H)
        return head_logprobs(model.get_output_embeddings(), model.config, h.reshape(-1, h.shape[-1])[index], targets,
                             temperature, entropy, chunk)
    return through_top(model, run)


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor | None = None,
                   temperature: float = 1.0, entropy: str | None = None, chunk: int = CHUNK, position_ids=None):
    """log pi(x_{t+1} | x_<=t) under softmax(logits / temperature), # (B, L - 1) fp32, zero where `mask` is 0
    (only the masked-in columns are computed; mask None: every column).
    entropy: None (not computed), "metric" (computed without autograd: for the log) or "loss" (with autograd:
    entropy_loss_coef > 0). Returns (logp, entropy # (B, L - 1) or None).
    e.g. logits [0, ln 3] at T 1 for target 1: log(3/4) = -0.2877; at T 0.5: logits [0, 2 ln 3] -> log(9/10).
    Packed rows (samples one after another, rlhf_core.train.batches): `attn` is the prepared layout mask
    (attention.model_inputs) and `position_ids` restart at each sample."""
    return through_top(model, lambda: _token_logprobs(model, ids, attn, mask, temperature, entropy, chunk, position_ids))


def _token_logprobs(model, ids, attn, mask, temperature, entropy, chunk, position_ids):
    body = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    pos = {} if position_ids is None else {"position_ids": position_ids}
    h = body(input_ids=ids, attention_mask=attn, use_cache=False, **pos).last_hidden_state[:, :-1]  # (B, L - 1, H)
    targets = ids[:, 1:]  # (B, L - 1)
    # Only the action columns go through the head; a meta tensor (memory and device tests) has no values to
    # select by, so there every column is computed and the mask applied after.
    select = mask is not None and h.device.type != "meta"
    cols = mask > 0 if select else None
    hs, tg = (h[cols], targets[cols]) if select else (h.reshape(-1, h.shape[-1]), targets.reshape(-1))  # (N, H), (N,)
    lp, ent = head_logprobs(head, model.config, hs, tg, temperature, entropy, chunk)
    out = []
    for flat in (lp, ent):
        if flat is None:
            out.append(None)
        elif select:
            out.append(torch.zeros(cols.shape, dtype=torch.float32, device=h.device).masked_scatter(cols, flat))
        else:
            full = flat.view(targets.shape)
            out.append(full if mask is None else full * mask.to(full.dtype))
    return out[0], out[1]
