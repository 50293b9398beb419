"""The PRM method's math against a plain forward: the loss is the cross-entropy over the reward tokens' logits
at each placeholder position (no shift), padded and packed batches agree, soft labels and truncation."""
import pytest
import torch

from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core.train.methods import prm


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    from transformers import LlamaForCausalLM

    tok = tiny_mod.build_tokenizer(tmp_path_factory.mktemp("prm-tok"), demo_task.corpus(0),
                                   added_tokens=(demo_task.PLACEHOLDER, *demo_task.REWARD_TOKENS))
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_mod.llama_config(tok)).eval(), tok


def test_step_loss_is_cross_entropy_over_reward_tokens_at_placeholders(model_tok):
    """Two rows (3 + 2 steps, one soft label 0.25): loss = mean over the 5 steps of
    -sum_k target_k log softmax(logits[pos, reward_ids])_k, with logits from a plain full forward of each row
    alone at its placeholder positions; packing gives the same loss."""
    model, tok = model_tok
    rows = [("x", 0, {"input": "Review: great ки\nbad so ки\nnice ки", "value": ["+", "-", "+"]}),
            ("x", 1, {"input": "Review: awful ки\nthe good ки", "value": ["-", 0.25]})]
    recs, cut = prm.tokenize(rows, tok, "input", "value", "ки", ["+", "-"], max_len=64)
    assert cut == 0 and recs[1]["targets"] == [[0.0, 1.0], [0.25, 0.75]]
    ph, rid = tok.convert_tokens_to_ids("ки"), [tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")]
    spec = {"placeholder_id": ph, "reward_ids": rid, "packing_samples": False}
    expected, acc = [], []
    with torch.no_grad():
        for r in recs:
            logits = model(input_ids=torch.tensor([r["ids"]])).logits[0]  # (T, V)
            pos = [i for i, t in enumerate(r["ids"]) if t == ph]
            lp = torch.log_softmax(logits[pos][:, rid], -1)  # (steps, 2)
            t = torch.tensor(r["targets"])
            expected += (-(t * lp).sum(-1)).tolist()
            acc += (lp.argmax(-1) == t.argmax(-1)).tolist()
        loss, met, _ = prm.step(model, spec, recs, tok.pad_token_id)
        packed, _, _ = prm.step(model, {**spec, "packing_samples": True}, recs, tok.pad_token_id)
    assert float(loss) == pytest.approx(sum(expected) / 5, abs=1e-5)
    assert float(packed) == pytest.approx(float(loss), abs=1e-5)
    assert met["steps"].tolist() == [3, 2] and met["correct"].sum() == sum(acc)
    assert met["loss"].tolist() == pytest.approx([sum(expected[:3]) / 3, sum(expected[3:]) / 2], abs=1e-5)


def test_truncation_keeps_the_labels_of_steps_within_max_len(model_tok):
    _, tok = model_tok
    row = ("x", 0, {"input": "Review: great ки\nbad ки\nnice ки", "value": ["+", "-", "+"]})
    full, _ = prm.tokenize([row], tok, "input", "value", "ки", ["+", "-"], max_len=64)
    second = [i for i, t in enumerate(full[0]["ids"]) if t == tok.convert_tokens_to_ids("ки")][1]
    recs, cut = prm.tokenize([row], tok, "input", "value", "ки", ["+", "-"], max_len=second + 1)
    assert cut == 1 and recs[0]["targets"] == [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(ValueError, match=r"x row 0: \d+ tokens exceed max_len"):
        prm.tokenize([row], tok, "input", "value", "ки", ["+", "-"], max_len=second + 1, overlong="reject")
    assert prm.aggregate([0.9, 0.2, 0.6], "min") == 0.2 and prm.aggregate([0.9, 0.2, 0.6], "last") == 0.6
    assert prm.aggregate([0.9, 0.2, 0.6], "mean") == pytest.approx(1.7 / 3)
