"""The training-method protocol: a method is a module found by name; KTO's mismatched KL pairs."""
import pytest

from rlhf_core import data
from rlhf_core.train import methods


def test_methods_are_modules_found_by_name():
    for name, model in (("sft", "causal_lm"), ("rm", "reward_model"), ("dpo", "causal_lm"), ("kto", "causal_lm")):
        m = methods.get(name)
        assert m.MODEL == model and callable(m.step)
    assert not hasattr(methods.get("sft"), "summarize")  # no final pass for sft
    with pytest.raises(ValueError, match="unknown training method 'ppo2': no module rlhf_core/train/methods/ppo2.py"):
        methods.get("ppo2")


def test_kto_records_pair_each_prompt_with_another_rows_completion(tiny):
    """Each record's KL sequence is its own prompt + the completion of another row written for another
    prompt; the pairing is a pure function of the seed."""
    from rlhf_core import models

    tok = models.load_tokenizer(tiny.policy_dir)
    rows = data.pairs_to_kto([{"prompt": f"Review of the {t}:", "chosen": f"great {t} .", "rejected": f"bad {t} ."}
                              for t in ("tea", "movie", "book", "car")])
    kto = methods.get("kto")
    recs, cut = kto.tokenize(rows, tok, 64, seed=3)
    assert cut == 0 and [r["desirable"] for r in recs] == [True, False] * 4
    for i, r in enumerate(recs):
        assert r["kl_ids"][:r["kl_start"]] == r["ids"][:r["start"]]  # same prompt
        other = r["kl_ids"][r["kl_start"]:]
        donors = [j for j, s in enumerate(recs) if s["ids"][s["start"]:] == other]
        assert donors and all(rows[j]["prompt"] != rows[i]["prompt"] for j in donors)
    assert kto.tokenize(rows, tok, 64, seed=3)[0] == recs and kto.tokenize(rows, tok, 64, seed=4)[0] != recs
    with pytest.raises(data.DataError, match="KTO needs at least 2 rows"):
        kto.tokenize(rows[:1], tok, 64)
