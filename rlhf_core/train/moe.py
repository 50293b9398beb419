"""The MoE load-balancing loss (OpenRLHF's --model.aux_loss_coef): loss = method loss + coef x aux, where aux is
the model's own `load_balancing_loss_func` (Switch Transformer, arXiv:2101.03961 eqs. 4-6, as transformers
implements it in each MoE model file) over the router logits of every layer.

entry.target_logits runs the backbone and the LM head apart, so the logits of the causal-LM class (which
carry `aux_loss`) are never built: a forward hook on the backbone keeps its `router_logits` (transformers
returns them when config.output_router_logits, which OpenRLHF also sets), and the step adds the loss over
every forward that ran with gradients (no-grad forwards, e.g. KTO's KL pass or evaluation, add none). The
tokens that count are the batch's real tokens (entry.batch_of notes them: padding of the padded and
shared-prompt layouts is left out, as transformers leaves out attention_mask == 0).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

_valid: dict = {"mask": None}  # (R, T) bool of the last batch collated: real tokens


def note_tokens(b) -> None:
    """Remember batch `b`'s real tokens (segment < n) for the next forward's router logits."""
    _valid["mask"] = b.segment < b.n


def with_aux_loss(method, model, coef: float):
    """`method` whose step adds coef x the load-balancing loss of `model`'s router logits, and reports it as
    the per-example metric `aux_loss`. Refuses a model without a router (aux_loss_coef > 0 on a dense model)."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = core.config.get_text_config()
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    lb_loss = getattr(sys.modules[type(core).__module__], "load_balancing_loss_func", None)
    if not experts or lb_loss is None or not hasattr(cfg, "output_router_logits"):
        raise SystemExit(f"aux_loss_coef {coef} > 0 needs a mixture-of-experts model; {cfg.model_type} "
                         f"({type(core).__name__}) has no router: set aux_loss_coef=0")
    cfg.output_router_logits = True
    top_k = cfg.num_experts_per_tok
    captured: list = []

    def keep(module, args, kwargs, output):
        if torch.is_grad_enabled() and getattr(output, "router_logits", None):
            ids = kwargs.get("input_ids")
            mask = _valid["mask"]
            captured.append((output.router_logits, mask if mask is not None and ids is not None
                             and mask.shape == ids.shape else None))

    getattr(core, core.base_model_prefix).register_forward_hook(keep, with_kwargs=True)

    def step(engine, spec, recs, pad_id):
        captured.clear()
        loss, met, tokens = method.step(engine, spec, recs, pad_id)
        if not captured:
            return loss, met, tokens
        aux = sum(lb_loss(logits, experts, top_k, None if m is None else m.to(logits[0].device))
                  for logits, m in captured)
        captured.clear()
        return loss + coef * aux, {**met, "aux_loss": aux.detach().expand(len(recs))}, tokens

    return SimpleNamespace(**{**{k: v for k, v in vars(method).items() if not k.startswith("__")}, "step": step})
