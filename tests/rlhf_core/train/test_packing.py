"""Packing into rows of at most a token budget (batches.pack_rows, collate(packed=True, row_len=...)): the bins,
and a packed Batch's bookkeeping (rows, positions, last tokens, loss targets) against the padded Batch of the
same samples. Values and gradients through a model: test_attention_layouts.py ("packed rows" cases)."""
from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.train import batches
from rlhf_core.train.entry import batch_of


def test_pack_rows_is_best_fit_decreasing_within_the_budget():
    # longest first: 8 -> row 0 (2 left); 5 -> row 1 (5 left); 4 -> row 1 (1 left); 3 -> row 2 (7 left);
    # 2 fits rows 0 and 2: the fuller one, row 0
    assert batches.pack_rows([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    assert batches.pack_rows([12, 3, 3], 10) == [[0], [1, 2]]  # longer than the budget: a row of its own, never split
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        cap = rng.randint(40, 80)  # every sample fits
        rows = batches.pack_rows(lens, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(lens)))
        assert all(sum(lens[i] for i in r) <= cap or len(r) == 1 for r in rows)
        assert all(r == sorted(r) for r in rows)
        assert sum(lens) / cap <= len(rows) <= len(lens)


@pytest.mark.parametrize("starts", ("int", "spans"))
def test_packed_rows_keep_each_sample_whole_with_its_positions_and_targets(starts):
    rng = random.Random(1)
    seqs = [[rng.randint(3, 99) for _ in range(rng.randint(4, 30))] for _ in range(9)]
    st = ([rng.randint(1, len(s) - 1) for s in seqs] if starts == "int" else
          [[[1, 3], [len(s) - 2, len(s)]] for s in seqs])
    padded = batches.collate(seqs, st, 0)
    b = batches.collate(seqs, st, 0, packed=True, row_len=40)
    assert b.layout == "packed" and b.attention_mask is None and b.n == 9 and b.real_tokens == sum(map(len, seqs))
    R, T = b.input_ids.shape
    assert 1 < R < 9 and T <= 40
    for i, s in enumerate(seqs):
        row, cols = (b.segment == i).nonzero(as_tuple=True)
        assert row.unique().numel() == 1  # one row, contiguous, the sample's tokens in order at positions 0..len-1
        assert torch.equal(cols, torch.arange(cols[0], cols[0] + len(s)))
        assert b.input_ids[row[0], cols].tolist() == s and b.position_ids[row[0], cols].tolist() == list(range(len(s)))
        assert b.doc[row[0], cols].eq(i).all() and b.last[i].tolist() == [row[0].item(), cols[-1].item()]
    assert (b.doc[b.segment == 9] == -1).all() and (b.target_mask[b.segment == 9] == 0).all()  # padding

    def by_sample(x):  # each sample's target tokens in order
        _, cols, toks, samples = x.targets()
        return {i: toks[samples == i][cols[samples == i].argsort()].tolist() for i in range(9)}

    assert by_sample(b) == by_sample(padded)


def test_batch_of_packs_into_max_len_rows_except_under_flash_attention():
    seqs = [[5] * n for n in (30, 20, 10, 25)]
    spec = {"packing_samples": True, "max_len": 40}
    assert batch_of(spec, seqs, [1] * 4, 0).input_ids.shape == (3, 40)  # [30, 10], [25], [20]
    assert batch_of({"packing_samples": True}, seqs, [1] * 4, 0).input_ids.shape == (1, 85)  # no budget: one row
    assert batch_of({**spec, "attn_implementation": "flash_attention_2"}, seqs, [1] * 4, 0).input_ids.shape == (1, 85)


def test_a_batch_counts_each_samples_tokens_the_forwarded_ones_and_every_position():
    prompt = list(range(10, 20))  # a DPO pair: 10 prompt tokens, responses of 5 and 3
    chosen, rejected = prompt + [31, 32, 33, 34, 35], prompt + [41, 42, 43]
    one_row = batches.collate_pairs([chosen], [10], [rejected], [10], 0)
    assert one_row.tokens() == batches.Tokens(samples=28, forwarded=18, positions=18)  # the prompt once
    two_rows = batches.collate([chosen, rejected], [10, 10], 0)
    assert two_rows.tokens() == batches.Tokens(28, 28, 30)  # the prompt twice, the shorter row padded to 15
    packed = batches.collate([chosen, rejected, [7, 8]], [10, 10, 1], 0, packed=True, row_len=16)
    assert packed.tokens() == batches.Tokens(30, 30, 2 * 15)  # rows [15] and [13 + 2]: no padding
    assert one_row.tokens() + two_rows.tokens() == batches.Tokens(56, 46, 48)
