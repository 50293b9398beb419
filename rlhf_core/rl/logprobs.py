"""Per-token log-probs and entropy of a causal LM's tempered policy, without a (B, L, V) fp32 tensor.

A 7B policy with a 152k vocabulary at 32 x 2048 tokens would need 40 GB for one fp32 log-softmax over every
position. Here the model's body runs once (hidden states # (B, L, H)); the LM head then runs only on the
action columns, `chunk` positions at a time, each chunk's logits cast to fp32 for the reduction (logsumexp
and the gathered target), so the largest tensor is # (chunk, V). Under autograd each chunk is checkpointed:
its logits are recomputed in backward instead of kept, so memory does not grow with the number of chunks.

The policy is softmax(transform(logits) / T): T is the sampling temperature (OpenRLHF divides the logits by
it too), transform the architecture's own logit scaling (Gemma-2's final soft-capping, Cohere's logit_scale,
Granite's logits_scaling). top-p / top-k truncation is not applied (as in OpenRLHF and verl).

Columns follow rlhf_core.rl.losses.token_logprobs: column t of # (B, L - 1) is token t + 1 given tokens <= t.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 1024  # positions per LM-head chunk: (1024, 152k) fp32 logits = 0.6 GB at Qwen2's vocabulary


def through_top(model, fn):
    """fn() run as the forward of `model` (an HF model, PEFT-wrapped or not), so the hooks on the top module run:
    DeepSpeed ZeRO-3 resets its parameter coordinator's step in the top module's forward pre-hook, and only a
    trace recorded between two such resets is replayed to prefetch each layer's gather ahead of its use. A
    forward that calls the backbone and the head apart never resets it: the trace stays INVALID and every
    gather waits on the critical path (issue 35 item 6). The instance's own `forward` (accelerate's hooks set
    one) is put back afterwards."""
    own = model.__dict__.get("forward")
    model.forward = fn  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    try:
        return model()
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _head_logits(head, config, h: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits of the tempered policy for hidden states # (N, H) -> # (N, V)."""
    logits = head(h).float()
    if (scale := getattr(config, "logit_scale", None)) is not None:  # Cohere
        logits = logits * scale
    if (div := getattr(config, "logits_scaling", None)) is not None:  # Granite
        logits = logits / div
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:  # Gemma-2
        logits = torch.tanh(logits / cap) * cap
    return logits / temperature if temperature != 1.0 else logits


def _chunk(head, config, h, targets, temperature: float, with_entropy: bool):
    logits = _head_logits(head, config, h, temperature)  # (N, V) fp32
    lse = torch.logsumexp(logits, -1)  # (N,)
    lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, None
    ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)  # H = logsumexp - E_p[logit]
    return lp, ent


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
    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, hs.shape[0], chunk):
        args = (head, model.config, hs[s:s + chunk], tg[s:s + chunk], temperature)
        if grad and entropy == "loss":
            lp, ent = checkpoint(_chunk, *args, True, use_reentrant=False)
        elif grad:
            lp, _ = checkpoint(_chunk, *args, False, use_reentrant=False)
            if entropy == "metric":
                with torch.no_grad():
                    _, ent = _chunk(*args, True)
        else:
            lp, ent = _chunk(*args, entropy is not None)
        lps.append(lp)
        if entropy:
            ents.append(ent)
    out = []
    for parts in (lps, ents if entropy else None):
        if parts is None:
            out.append(None)
            continue
        flat = torch.cat(parts) if parts else hs.new_zeros(0, dtype=torch.float32)
        if select:
            out.append(torch.zeros(cols.shape, dtype=torch.float32, device=h.device).masked_scatter(cols, flat))
        else:
            full = flat.view(targets.shape)
            out.append(full if mask is None else full * mask.to(full.dtype))
    return out[0], out[1]
