"""Experience layout of the online-RL loop: prompt + sampled response ids, right padded, with the action mask on
the columns whose target is a response token (column t holds log p(token t + 1))."""
import torch

from rlhf_core.rl import losses
from rlhf_core.ppo.batches import collate


def test_collate_marks_response_columns():
    """prompt [5, 6, 7] + response [8, 9]; prompt [5] + response [8, 9, 10]; L = 5, pad 0.
    ids [[5, 6, 7, 8, 9], [5, 8, 9, 10, 0]]; mask over the 4 shifted columns: row 0 columns 2, 3 (targets 8, 9),
    row 1 columns 0, 1, 2 (targets 8, 9, 10)."""
    b = collate([[5, 6, 7], [5]], [[8, 9], [8, 9, 10]], pad_id=0)
    assert b["ids"].tolist() == [[5, 6, 7, 8, 9], [5, 8, 9, 10, 0]]
    assert b["attn"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b["mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    targets = b["ids"][:, 1:][b["mask"].bool()].tolist()
    assert targets == [8, 9, 8, 9, 10]  # exactly the sampled tokens, in order
    # with logits peaked on each row's next token, the masked log-probs are ~0 (the sampled tokens' own)
    logits = torch.full((2, 5, 11), -30.0)
    for r in range(2):
        for t in range(4):
            logits[r, t, b["ids"][r, t + 1]] = 30.0
    lp = losses.token_logprobs(logits, b["ids"])
    assert lp[b["mask"].bool()].abs().max() < 1e-6
