"""How a batch's attention layout reaches the model, for every attention implementation.

A Batch is padded (one sample per row: the (R, T) padding mask, from which transformers builds each layer's
own mask: causal, sliding window, padding), packed (samples one after another in one row), pairs (a shared
prompt, then the chosen and the rejected response in one row; batches.collate_pairs) or groups (a shared
prompt, then n responses: GRPO's samples of one prompt; batches.collate_groups). Packed, pairs and groups are one
mask *function* of three # (R, T) tensors, doc (the sequence of a token, -1 padding), branch (0 the shared
prompt, k the k-th response) and pos (position ids): q may attend kv iff same doc, kv <= q, kv in the
shared part or in q's own branch and, on a sliding-window layer, pos[q] - pos[kv] < window. The window counts
positions, not columns: a rejected token sits after the chosen ones but is `pos` tokens from its sequence's
start, as in the two-row layout (transformers' sliding_window_overlay: kv > q - window). From that function,
for each attention type the model's layers use ("full_attention", "sliding_attention"):
- flex_attention: a BlockMask (torch's create_block_mask: no (T, T) tensor);
- sdpa / eager: a dense bool / additive (R, 1, T, T) mask, the fallback (named once in the job log);
- flash_attention_2: no mask: a packed row reaches FlashAttention's varlen kernel through its position-id
  resets (transformers' _flash_attention_forward derives cu_seqlens from them). Varlen cannot express a shared
  prefix, so under flash pairs are forwarded as two sequences (entry.batch_of: packed or padded) and groups
  as packed samples (rlhf_core.ppo.forward).
A model whose layers share one type gets that mask (transformers passes a prepared 4-D mask or BlockMask
through unchanged); one with several (Gemma-2/3 alternate sliding and full) gets {layer type: mask}, which
their forwards take as prepared per-type masks (causal_mask_mapping in modeling_gemma2.py).
"""
from __future__ import annotations

import importlib.util
import os

import torch

IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2")
_SAID: set[str] = set()


def _has_flex() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def available() -> dict[str, str | None]:
    """{implementation: None if this host can run it, else why not}. flex_attention needs CUDA: on CPU torch
    2.13 has no flex backward (NotImplementedError) and its inductor C++ kernel fails to compile for a
    document mask (measured: "'cur_kvSplitSize8' was not declared"); transformers always compiles it. The CPU
    tests run flex uncompiled (torch's reference implementation) for its values."""
    cuda = torch.cuda.is_available()
    why = {"sdpa": None, "eager": None}
    why["flex_attention"] = ("this torch has no torch.nn.attention.flex_attention" if not _has_flex() else
                             "torch's flex_attention needs a CUDA GPU here (on CPU: no backward, and its compiled "
                             "kernel fails for document masks); this host has none" if not cuda else None)
    why["flash_attention_2"] = ("it needs a CUDA GPU; this host has none" if not cuda else
                                "the flash_attn package is not installed" if importlib.util.find_spec("flash_attn") is None
                                else None)
    return why


def check(impl: str, model_dir=None, field: str = "attn_implementation", host: bool = True) -> None:
    """ValueError naming `field` when this host (and, given `model_dir`, the model) cannot run `impl`. `host`
    False: the model's refusals only (a driver whose roles run on other machines: ppo on a Ray cluster)."""
    why = available()
    if impl not in why:
        raise ValueError(f"{field}={impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    ok = [k for k, v in why.items() if v is None] if host else list(IMPLEMENTATIONS)
    if why[impl] and host:
        raise ValueError(f"{field}={impl}: {why[impl]}; available here: {', '.join(ok)}")
    if model_dir is None:
        return
    from transformers import AutoConfig

    import transformers

    cfg = AutoConfig.from_pretrained(str(model_dir))
    text = cfg.get_text_config()
    cls = next((getattr(transformers, a, None) for a in (cfg.architectures or []) if hasattr(transformers, a)), None)
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn", "flash_attention_2": "_supports_flash_attn"}
    if cls is not None and impl in flag and not getattr(cls, flag[impl], False):
        raise ValueError(f"{field}={impl}: {cls.__name__} ({model_dir}) does not support it; use eager"
                         + "".join(f" or {k}" for k in ok if k != "eager" and getattr(cls, flag.get(k, ""), False)))
    if impl == "sdpa" and getattr(text, "attn_logit_softcapping", None):
        # torch's scaled_dot_product_attention has no soft-capping: transformers' sdpa path drops it silently
        raise ValueError(f"{field}=sdpa: {model_dir} soft-caps its attention logits (attn_logit_softcapping="
                         f"{text.attn_logit_softcapping}), which sdpa cannot apply; use eager"
                         + "".join(f" or {k}" for k in ok if k in ("flex_attention", "flash_attention_2")))


def layer_types(config) -> list[str]:
    """The attention type of each layer, as the model's forward picks its mask: config.layer_types where the
    architecture has them (Gemma-2/3, Qwen2), else one type for all (sliding where a window is set: Mistral)."""
    cfg = config.get_text_config()
    if getattr(cfg, "layer_types", None):
        return list(cfg.layer_types)
    return ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * cfg.num_hidden_layers


def mask_function(doc: torch.Tensor, branch: torch.Tensor, pos: torch.Tensor, window: int | None = None):
    """mask_mod(b, h, q, kv) -> True where q may attend kv (flex_attention's signature), for # (R, T) doc,
    branch and pos. It takes index tensors of any broadcastable shape (dense) or scalars (vmap, flex)."""
    def mask_mod(b, h, q, kv):
        ok = (doc[b, q] == doc[b, kv]) & (doc[b, kv] >= 0) & (kv <= q)
        ok = ok & ((branch[b, kv] == 0) | (branch[b, kv] == branch[b, q]))
        if window is not None:
            ok = ok & (pos[b, q] - pos[b, kv] < window)
        return ok | (q == kv)  # padding attends to itself: no all-masked row (NaN in sdpa's softmax)
    return mask_mod


def dense(mask_mod, R: int, T: int, device, q_from: int = 0) -> torch.Tensor:
    """The mask function evaluated everywhere: # (R, 1, T, T) bool; with `q_from`, for the queries q_from..T-1
    only: # (R, 1, T - q_from, T)."""
    ar = torch.arange(T, device=device)
    return mask_mod(torch.arange(R, device=device)[:, None, None, None], None, ar[q_from:][None, None, :, None],
                    ar[None, None, None, :])


def _log_once(msg: str) -> None:
    if msg not in _SAID and os.environ.get("RANK", "0") == "0":
        _SAID.add(msg)
        print(msg, flush=True)


def layout_masks(config, b, device, dtype: torch.dtype):
    """The attention_mask argument for a packed, pairs or groups Batch `b` under config._attn_implementation: one
    mask, or {layer type: mask} for a model with several layer types; None under flash_attention_2."""
    impl = config._attn_implementation
    doc, branch, pos = (t.to(device) for t in (b.doc, b.branch, b.position_ids))
    if impl.startswith("flash_attention"):
        if bool((branch > 0).any()):
            raise ValueError(f"{impl} cannot run the shared-prompt pair layout (varlen has no shared prefix): "
                             "collate pairs as two sequences (entry.batch_of does under flash attention)")
        return None  # FlashAttention varlen: documents from the position-id resets
    return masks_of(config, doc, branch, pos, device, dtype, b.layout)


def continuation_masks(config, doc: torch.Tensor, pos: torch.Tensor, q_from: int, device, dtype: torch.dtype):
    """The attention_mask argument for a forward of new tokens on a KV cache: doc and pos # (R, T) describe the
    columns [cached | new] (the new tokens are columns q_from..T-1, the queries), as for a packed row: a query
    attends the columns of its own doc up to itself (a cached column marked with the query's doc is a prefix it
    continues; -1: not attended). # (R, 1, T - q_from, T), BlockMasks under flex, {layer type: mask} as
    layout_masks. Not for flash attention (its varlen kernel takes no mask)."""
    if config._attn_implementation.startswith("flash_attention"):
        raise ValueError("a forward on a shared prefix's KV cache needs a mask, which flash attention takes none of")
    return masks_of(config, doc.to(device), torch.zeros_like(doc, device=device), pos.to(device), device, dtype,
                    "cache continuation", q_from)


def masks_of(config, doc, branch, pos, device, dtype: torch.dtype, what: str, q_from: int = 0):
    """mask_function's masks for each layer type of `config` under its attention implementation (sdpa / eager:
    dense, flex: BlockMask), for the queries q_from..T-1 over all T columns."""
    impl = config._attn_implementation
    cfg = config.get_text_config()
    R, T = doc.shape
    masks = {}
    for kind in dict.fromkeys(layer_types(config)):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer type {kind!r} of {type(config).__name__} has no packed / shared-prompt mask here: "
                             "set packing_samples=false (pairs: attn_implementation=flash_attention_2 forwards them apart)")
        fn = mask_function(doc, branch, pos, cfg.sliding_window if kind == "sliding_attention" else None)
        if impl == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            # compiled, the mask is built block by block (no (T, T) tensor); eager, create_block_mask evaluates it
            # whole: only on CPU, where flex serves the tests (see available)
            shifted = fn if not q_from else (lambda b_, h, q, kv, fn=fn: fn(b_, h, q + q_from, kv))
            masks[kind] = create_block_mask(shifted, B=R, H=None, Q_LEN=T - q_from, KV_LEN=T, device=device,
                                            _compile=torch.device(device).type != "cpu")
            continue
        _log_once(f"attention: {what} batches under {impl} use a dense (R, 1, T, T) mask "
                  "(attn_implementation=flex_attention builds a block mask instead)")
        m = dense(fn, R, T, device, q_from)
        if impl != "sdpa":  # eager (and other kernels) add the mask to the scores
            m = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
        masks[kind] = m
    return next(iter(masks.values())) if len(masks) == 1 else masks


def model_inputs(model, b, device) -> dict:
    """input_ids, position_ids and attention_mask of Batch `b` for `model` (an HF model or its backbone, bare,
    PEFT-wrapped or inside a DeepSpeed engine): the one place every method's forward gets its mask."""
    inner = getattr(model, "module", model)
    kw = {"input_ids": b.input_ids.to(device), "position_ids": b.position_ids.to(device)}
    if b.attention_mask is not None:  # padded: transformers builds each layer's mask from the (R, T) padding
        kw["attention_mask"] = b.attention_mask.to(device)  # mask (or one prepared for it, e.g. a ring slice's)
    else:
        dtype = next(inner.parameters()).dtype
        kw["attention_mask"] = layout_masks(inner.config, b, device, dtype)
    return kw
