"""Process reward model (PRM): a causal LM that rates every reasoning step (Math-Shepherd, arXiv:2312.08935;
OpenRLHF train_prm, its ProcessRewardDataset and PRMLoss).

Each step of an input text ends with a placeholder token (Math-Shepherd's "ки"); the step's label is one of
the reward tokens (e.g. "+" good, "-" bad), or a number in [0, 1] (a soft label: the probability that the
step is good, with exactly two reward tokens). The loss is the cross-entropy of the LM's logits AT each
placeholder position (no shift: the placeholder's own output predicts the label), restricted to the reward
tokens' logits, averaged over the placeholders of a micro-batch. The step reward at scoring time is the
softmax probability of the first (positive) reward token over the reward tokens (rlhf_core.rollout.rewards).
The placeholder and the reward tokens must each be one token of the tokenizer (`token_id` refuses others).
"""
from __future__ import annotations

import torch

from rlhf_core.inputs.data import DataError

MODEL = "causal_lm"
CONFIG_KEYS = ("prm_placeholder_token", "prm_reward_tokens")  # written into the saved config.json: a PRM knows itself


def token_id(tok, token: str, what: str) -> int:
    """The single id of `token`; ValueError naming `what` when the tokenizer splits it (OpenRLHF asserts the same)."""
    ids = tok.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{what} {token!r} is {len(ids)} tokens in this tokenizer ({tok.convert_ids_to_tokens(ids)}), "
                         f"not one: add it to the tokenizer (tokenizer.add_tokens) or choose a token it has")
    return ids[0]


def encode(tok, text: str, placeholder_id: int, max_len: int, bos: bool) -> tuple[list[int], int]:
    """(token ids of the text, cut to max_len from the right; placeholders present in them). The whole text is
    tokenized at once (as OpenRLHF and Math-Shepherd do), with one BOS in front where the tokenizer uses one
    (rlhf_core.inputs.models.prompt_ids, this project's convention; Math-Shepherd's inference has it, OpenRLHF's PRM
    dataset leaves it out). Training and scoring both come through here."""
    from rlhf_core.inputs.models import prompt_ids

    ids = prompt_ids(tok, text, bos)[:max_len]
    return ids, sum(t == placeholder_id for t in ids)


def tokenize(rows: list[tuple[str, int, dict]], tok, input_key: str, label_key: str, placeholder: str,
             reward_tokens: list[str], max_len: int, overlong: str = "truncate") -> tuple[list[dict], int]:
    """Raw (source, row number, row) -> {ids, targets}: targets # (steps, K) is the label distribution over the
    K reward tokens of each placeholder that survived the cut to max_len. Every bad row names source, row, key."""
    from rlhf_core.inputs.models import adds_bos

    ph = token_id(tok, placeholder, "placeholder_token")
    bos, K = adds_bos(tok), len(reward_tokens)
    out, cut = [], 0
    for src, i, row in rows:
        where = f"{src} row {i}"
        text, labels = row.get(input_key), row.get(label_key)
        if not isinstance(text, str):
            raise DataError(f"{where}: key {input_key!r} must be a string (the steps, each ending in {placeholder!r}), "
                            f"got {type(text).__name__}" + ("" if input_key in row else f" (row has {sorted(row)})"))
        if not isinstance(labels, list) or not labels:
            raise DataError(f"{where}: key {label_key!r} must be a non-empty list of step labels, got {labels!r}"[:300])
        if placeholder not in text:
            raise DataError(f"{where}: key {input_key!r} has no placeholder token {placeholder!r}: every step must end "
                            f"with it (placeholder_token)")
        targets = []
        for s, v in enumerate(labels):
            if isinstance(v, str) and v in reward_tokens:
                targets.append([float(k == reward_tokens.index(v)) for k in range(K)])
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 and K == 2:
                targets.append([float(v), 1.0 - float(v)])  # soft label: P(good step)
            else:
                raise DataError(f"{where}: key {label_key!r} step {s} is {v!r}: a step label is one of the reward_tokens "
                                f"{reward_tokens}" + (" or a number in [0, 1]" if K == 2 else ""))
        full, n_ph = encode(tok, text, ph, 10 ** 9, bos)
        if n_ph != len(labels):
            raise DataError(f"{where}: {len(labels)} step labels in {label_key!r} but {n_ph} placeholder tokens "
                            f"{placeholder!r} in the tokenized {input_key!r}: one label per step")
        if len(full) > max_len:
            if overlong == "reject":
                raise DataError(f"{where}: {len(full)} tokens exceed max_len {max_len} (set overlong=truncate to cut it)")
            cut += 1
        ids, kept = encode(tok, text, ph, max_len, bos)
        if kept == 0:
            raise DataError(f"{where}: no step placeholder within max_len {max_len} tokens (the first is at token "
                            f"{full.index(ph)}): raise max_len")
        out.append({"ids": ids, "targets": targets[:kept]})  # OpenRLHF likewise drops the labels of cut steps
    return out, cut


def reward_logits(model, seqs: list[list[int]], pad_id: int, placeholder_id: int, reward_ids: list[int],
                  packed: bool = False):
    """Logits over the reward tokens at every placeholder # (N, K), and the sample of each # (N,), in order of
    samples then positions. `model`: a DeepSpeed engine, a (PEFT-wrapped) HF causal LM. The LM head runs on the
    placeholder rows only (entry._parts), with the full forward where the head is not a plain projection."""
    from rlhf_core.rl import logprobs
    from rlhf_core.train import attention
    from rlhf_core.train.batches import collate
    from rlhf_core.train.entry import _parts

    b = collate(seqs, [0] * len(seqs), pad_id, packed=packed)
    dev = model.device
    inner = getattr(model, "module", model)
    kw = {**attention.model_inputs(inner, b, dev), "use_cache": False}
    at = (b.input_ids == placeholder_id) & (b.segment < b.n)  # # (R, T), padding excluded (pad may equal it)
    rows, cols = at.nonzero(as_tuple=True)
    parts = _parts(inner)
    rows, cols = rows.to(dev), cols.to(dev)
    if parts is None:
        logits = inner(**kw).logits[rows, cols]  # (N, V)
    else:  # inside the top module's forward: ZeRO-3 prefetches (logprobs.through_top)
        backbone, head = parts
        logits = logprobs.through_top(inner, lambda: head(backbone(**kw).last_hidden_state[rows, cols]))  # (N, V)
    return logits[:, reward_ids].float(), b.segment.to(dev)[rows, cols], b.tokens()


def step(engine, spec: dict, recs: list[dict], pad_id: int):
    """Cross-entropy over the reward tokens at the placeholders (mean over the micro-batch's steps)."""
    logits, sample, tokens = reward_logits(engine, [r["ids"] for r in recs], pad_id, spec["placeholder_id"],
                                           spec["reward_ids"], spec["packing_samples"])
    target = torch.tensor([t for r in recs for t in r["targets"]], device=logits.device)  # (N, K)
    ce = -(target * torch.log_softmax(logits, -1)).sum(-1)  # (N,)
    correct = (logits.argmax(-1) == target.argmax(-1)).float()  # (N,)
    zeros = torch.zeros(len(recs), device=logits.device)
    steps = zeros.index_add(0, sample, torch.ones_like(ce))
    per_loss = zeros.index_add(0, sample, ce.detach()) / steps  # (B,) each sample's mean step loss
    n_correct = zeros.index_add(0, sample, correct)
    return ce.mean(), {"loss": per_loss, "step_accuracy": n_correct / steps, "steps": steps, "correct": n_correct}, tokens


def summarize(totals: dict[str, float], n: int) -> dict:
    """Final step accuracy over every step of the training set, and the mean per-sample loss."""
    return {"final_loss": totals["loss"] / n, "final_step_accuracy": totals["correct"] / totals["steps"],
            "steps": int(totals["steps"])}


def saved_config(final: dict, spec: dict) -> dict:
    return dict(zip(CONFIG_KEYS, (spec["placeholder_token"], list(spec["reward_tokens"]))))


def aggregate(step_rewards: list[float], how: str = "min") -> float:
    """One reward from a solution's step rewards: min (its weakest step; Math-Shepherd's verifier), the last
    step's, or the mean."""
    if how == "min":
        return min(step_rewards)
    if how == "last":
        return step_rewards[-1]
    if how == "mean":
        return sum(step_rewards) / len(step_rewards)
    raise ValueError(f"unknown prm_aggregate {how!r}: min, last or mean")
