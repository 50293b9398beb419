"""The padded batch every ppo role reads: prompt + response rows with the action mask and the rollout log-probs."""
from __future__ import annotations

import torch


def collate(prompt_ids: list[list[int]], responses: list[list[int]], pad_id: int,
            action_masks: list[list[int]] | None = None, logprobs: list[list[float]] | None = None) -> dict:
    """prompt + response per row, right padded: ids, attn # (B, L); mask # (B, L - 1) marks the columns
    whose target token is a response token the model generated (column t predicts token t + 1): with
    `action_masks` (multi-turn) only the entries that are 1, so environment feedback carries no loss.
    `logprobs` (the rollout engine's, per response token) go into rollout_logp # (B, L - 1) on the same columns."""
    L = max(len(p) + len(r) for p, r in zip(prompt_ids, responses))
    B = len(responses)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
        cols = slice(len(p) - 1, len(p) - 1 + len(r))
        mask[i, cols] = torch.tensor(action_masks[i], dtype=torch.float32) if action_masks else 1
        if logprobs:
            rollout_lp[i, cols] = torch.tensor(logprobs[i], dtype=torch.float32)
    out = {"ids": ids, "attn": attn, "mask": mask}
    if logprobs:
        out["rollout_logp"] = rollout_lp
    return out
