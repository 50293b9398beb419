"""Post-processors against hand-made rows (arithmetic in each docstring)."""
import math

import pytest

from rlhf_core.rollout import postprocess as pp


def rows(spec):
    """spec: {prompt: [rewards]} -> scored rows with responses named "{prompt}{i}"."""
    return [{"prompt": p, "response": f"{p}{i}", "sample_index": i, "reward": r}
            for p, rs in spec.items() for i, r in enumerate(rs)]


def test_best_of_n_keeps_first_max_per_prompt_in_prompt_order():
    """a: [0.1, 0.7, 0.7] -> a1 (first of the tied max); b: [-2, -1] -> b1."""
    out = pp.best_of_n(rows({"a": [0.1, 0.7, 0.7], "b": [-2.0, -1.0]}))
    assert out == [{"input": "a", "output": "a1", "reward": 0.7}, {"input": "b", "output": "b1", "reward": -1.0}]


def test_best_of_n_top_k_best_first():
    """a: [0.1, 0.9, 0.5] top 2 -> a1 (0.9), a2 (0.5); b has one sample -> b0."""
    out = pp.best_of_n(rows({"a": [0.1, 0.9, 0.5], "b": [3.0]}), top_k=2)
    assert [(r["output"], r["reward"]) for r in out] == [("a1", 0.9), ("a2", 0.5), ("b0", 3.0)]


def test_dpo_pairs_max_vs_min_drops_ties_and_singles():
    """a: [0.2, 0.9, 0.2] -> chosen a1, rejected a0, margin 0.7; b: [0.5, 0.5] tie; c: [1] single."""
    stats = pp.FilterStats()
    out = pp.dpo_pairs(rows({"a": [0.2, 0.9, 0.2], "b": [0.5, 0.5], "c": [1.0]}), stats)
    assert len(out) == 1
    p = out[0]
    assert (p["prompt"], p["chosen"], p["rejected"]) == ("a", "a1", "a0")
    assert (p["chosen_reward"], p["rejected_reward"]) == (0.9, 0.2)
    assert p["margin"] == pytest.approx(0.7)
    assert (stats.dropped_ties, stats.dropped_single) == (1, 1)


def test_normalize_unbiased_std():
    """[1, 2, 3]: mean 2, std sqrt(2 / 2) = 1 -> [-1, 0, 1]; [0, 4]: mean 2, std sqrt(8 / 1) -> +-0.7071."""
    assert pp.normalize([1.0, 2.0, 3.0]) == pytest.approx([-1.0, 0.0, 1.0])
    assert pp.normalize([0.0, 4.0]) == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    with pytest.raises(pp.FilterError, match="std 0"):
        pp.normalize([1.0, 1.0])


def test_conditional_sft_template_two_decimals_and_normalisation():
    """reward 0.456 -> '0.46'; normalised [1, 2, 3] -> -1.00 / 0.00 / 1.00."""
    out = pp.conditional_sft(rows({"Q{x}": [0.456]}))
    assert out == [{"input": "Q{x} <rm_score>: 0.46 ", "output": "Q{x}0", "reward": 0.456}]
    out = pp.conditional_sft(rows({"a": [1.0, 2.0, 3.0]}), normalize_rewards=True, template="[{reward}] {input}")
    assert [r["input"] for r in out] == ["[-1.00] a", "[0.00] a", "[1.00] a"]
    with pytest.raises(pp.FilterError, match="must contain"):
        pp.conditional_sft(rows({"a": [1.0]}), template="{input} only")


def test_reward_buckets_rank_the_batch_and_keep_ties_together():
    """10 distinct rewards, 5 buckets -> two per bucket; [0.1, 0.9, 0.5, 0.5] in 2 buckets: ranks 0, 3, 1.5,
    1.5 -> 1.5 * 2 / 4 = 0.75 -> both 0.5s in bucket 0, 0.9 in bucket 1."""
    assert pp.reward_buckets([9.0, 0.0, 8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0], 5) == [4, 0, 4, 0, 3, 1, 3, 1, 2, 2]
    assert pp.reward_buckets([0.1, 0.9, 0.5, 0.5], 2) == [0, 1, 0, 0]
    out = pp.conditional_sft(rows({"Q": [0.3, -2.0, 5.0]}), buckets=3)
    assert [r["input"] for r in out] == ["Q <rm_score>: 1 ", "Q <rm_score>: 0 ", "Q <rm_score>: 2 "]
    assert pp.csft_condition(4, 5) == "4" and pp.csft_condition(1.5) == "1.50"
    with pytest.raises(pp.FilterError, match=">= 2"):
        pp.reward_buckets([1.0, 2.0], 1)


def test_bucket_labels_write_each_bucket_as_its_label_and_keep_the_index_as_reward():
    """[0.3, -2.0, 5.0] in 3 buckets -> 1, 0, 2, written with the labels (worst first) low, mid, top."""
    out = pp.conditional_sft(rows({"#1 Q": [0.3, -2.0, 5.0]}), buckets=3, labels=["low", "mid", "top"])
    assert [r["input"] for r in out] == ["#1 Q <rm_score>: mid ", "#1 Q <rm_score>: low ", "#1 Q <rm_score>: top "]
    assert [r["reward"] for r in out] == [1.0, 0.0, 2.0]
    assert pp.csft_condition(4, 5, ["E", "D", "C", "B", "A"]) == "A" and pp.csft_condition(0, 5, list("EDCBA")) == "E"
    with pytest.raises(pp.FilterError, match="2 bucket labels for 3 reward buckets"):
        pp.conditional_sft(rows({"Q": [0.3, -2.0, 5.0]}), buckets=3, labels=["a", "b"])


def test_dynamic_filter_keeps_prompts_with_mean_strictly_inside_range():
    """a mean 0.5 kept; b mean 1 (== max) dropped; c mean 0 (== min) dropped."""
    out = pp.dynamic_filter(rows({"a": [0.0, 1.0], "b": [1.0, 1.0], "c": [0.0, 0.0]}), 0.0, 1.0)
    assert [r["response"] for r in out] == ["a0", "a1"]
    assert len(pp.dynamic_filter(rows({"a": [0.0, 1.0]}), None, None)) == 2
    with pytest.raises(pp.FilterError, match="must be <"):
        pp.dynamic_filter([], 1.0, 0.0)


def test_empty_responses_are_dropped_and_counted_before_pairing():
    # The policy stopped at once on sample 1 (lowest reward): without dropping it, it would be the
    # rejected response, which DPO refuses as training data.
    rows = [{"prompt": "p", "response": "good .", "reward": 0.9, "sample_index": 0},
            {"prompt": "p", "response": "", "reward": -1.0, "sample_index": 1},
            {"prompt": "p", "response": "bad .", "reward": -0.5, "sample_index": 2},
            {"prompt": "q", "response": "  ", "reward": 0.0, "sample_index": 0}]
    stats = pp.FilterStats()
    kept = pp.drop_empty(rows, stats)
    assert stats.dropped_empty == 2 and [r["response"] for r in kept] == ["good .", "bad ."]
    pairs = pp.dpo_pairs(kept, stats)
    assert pairs == [{"prompt": "p", "chosen": "good .", "rejected": "bad .", "chosen_reward": 0.9,
                      "rejected_reward": -0.5, "margin": 1.4}]
