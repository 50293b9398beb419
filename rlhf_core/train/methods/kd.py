"""Knowledge distillation (Hinton et al. 2015, arXiv:1503.02531; OpenRLHF train_kd): on SFT records, the student
trains on (1 - kd_coef) * NLL + kd_coef * distillation, both token means over the micro-batch's response
tokens, the distillation term being the cross-entropy of the student's log-probs under a frozen teacher's
softmax over the whole vocabulary at the same positions (losses.distill_loss, OpenRLHF's KDLoss).

`setup` loads the teacher (the stage fetched it: a committed artifact or a plain HF folder) in the training
dtype, in eval mode, without gradients: one full copy per rank (ZeRO does not shard it). `teacher_offload`:
the teacher's weights stay in host memory and move to the rank's device for each forward, then back
(OpenRLHF offloads its teacher likewise), trading transfer time for device memory; on a host without an
accelerator the device is the CPU and the move changes nothing.
"""
from __future__ import annotations

import torch

from rlhf_core.rl import losses
from rlhf_core.train.entry import batch_of, target_logits

MODEL = "causal_lm"


def setup(engine, spec: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf_core.inputs import model_inputs
    from rlhf_core import store

    path = spec["teacher_dir"]
    if spec.get("launch_cache") not in (None, str(store.cache_root())):  # a rank on another node: its own copy
        path = str(model_inputs.fetch_model(spec["teacher_uri"], spec.get("storage_options")))
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if spec["bf16"] else torch.float32,
                                                   use_safetensors=True)
    teacher.eval().requires_grad_(False)
    return {"teacher": teacher.to("cpu" if spec["teacher_offload"] else engine.device)}


def teacher_logits(spec: dict, b, device) -> torch.Tensor:
    """The teacher's logits at batch `b`'s targets # (N, V), on `device`."""
    teacher = spec["teacher"]
    with torch.no_grad():
        if spec["teacher_offload"]:
            teacher.to(device)
        out = target_logits(teacher, b)
        if spec["teacher_offload"]:
            teacher.to("cpu")
    return out


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    """(loss, per-example metrics nll / distill / kl, batches.Tokens) of one micro-batch."""
    b = batch_of(spec, [r["ids"] for r in recs], [r["start"] for r in recs], pad_id)
    dev = engine.device
    logits = target_logits(engine, b)  # (N, V)
    tokens, sample = (t.to(dev) for t in b.targets()[2:])
    nll = -losses.gathered_logprobs(logits, tokens)  # (N,)
    ce, kl = losses.distill_loss(logits, teacher_logits(spec, b, dev))  # (N,), (N,)
    c = spec["kd_coef"]
    loss = ((1 - c) * nll + c * ce).mean()  # token means, as OpenRLHF mixes GPTLMLoss and KDLoss
    zeros = torch.zeros(b.n, dtype=nll.dtype, device=dev)
    n = zeros.index_add(0, sample, torch.ones_like(nll)).clamp(min=1)
    per = {k: zeros.index_add(0, sample, v.detach()) / n for k, v in (("nll", nll), ("distill", ce), ("kl", kl))}
    return loss, {"loss": loss.detach().expand(b.n), **per}, b.tokens()


def summarize(totals: dict[str, float], n: int) -> dict:
    """Final metrics over the training set: each example's per-token NLL, distillation loss and
    KL(teacher || student), averaged over examples."""
    return {f"final_{k}": totals[k] / n for k in ("loss", "nll", "distill", "kl")}
