"""The training-method protocol: a method is a module found by name; KTO's mismatched KL pairs."""
import pytest

from rlhf_core.inputs import data
from rlhf_core.train import methods


def test_methods_are_modules_found_by_name():
    for name, model in (("sft", "causal_lm"), ("rm", "reward_model"), ("dpo", "causal_lm"), ("kto", "causal_lm"), ("kd", "causal_lm")):
        m = methods.get(name)
        assert m.MODEL == model and callable(m.step)
    assert not hasattr(methods.get("sft"), "summarize")  # no final pass for sft
    with pytest.raises(ValueError, match="unknown training method 'ppo2': no module rlhf_core/train/methods/ppo2.py"):
        methods.get("ppo2")


def test_kto_records_pair_each_prompt_with_another_rows_completion(tiny):
    """Each record's KL sequence is its own prompt + the completion of another row written for another
    prompt; the pairing is a pure function of the seed."""
    from rlhf_core.inputs import models

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


def test_kd_step_mixes_nll_and_distillation_by_kd_coef(tiny):
    """kd.step on a bare model: kd_coef 0 is sft's loss; kd_coef 1 the token mean of the cross-entropy under
    the teacher; 0.3 the mix 0.7 / 0.3; with the student as its own teacher the KL is 0 and the distillation
    loss its entropy; packed as padded. The teacher gets no gradient; with teacher_offload it is back in host memory after."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.demo import demo_task
    from rlhf_core.train.batches import tokenize_sft

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    student = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recs, _ = tokenize_sft(demo_task.sft_rows(4, 1), tok, 48)
    kd, sft = methods.get("kd"), methods.get("sft")
    spec = lambda c, t=teacher: {"packing_samples": False, "kd_coef": c, "teacher": t, "teacher_offload": True}  # noqa: E731
    pad = tok.pad_token_id
    l0, m0, n0 = kd.step(student, spec(0.0), recs, pad)
    assert l0.item() == pytest.approx(sft.step(student, {"packing_samples": False}, recs, pad)[0].item(), rel=1e-6)
    l1, m1, _ = kd.step(student, spec(1.0), recs, pad)
    n_tok = torch.tensor([len(r["ids"]) - r["start"] for r in recs], dtype=torch.float32)
    assert l1.item() == pytest.approx(float((m1["distill"] * n_tok).sum() / n_tok.sum()), rel=1e-5)
    assert abs(l1.item() - l0.item()) > 1e-3 and (m1["kl"] > 0).all() and torch.equal(m0["kl"], m1["kl"])
    l3, _, _ = kd.step(student, spec(0.3), recs, pad)
    assert l3.item() == pytest.approx(0.7 * l0.item() + 0.3 * l1.item(), rel=1e-5)
    assert kd.step(student, {**spec(0.3), "packing_samples": True}, recs, pad)[0].item() == pytest.approx(l3.item(), rel=1e-4)
    l3.backward()
    assert all(p.grad is None for p in teacher.parameters()) and next(student.parameters()).grad is not None
    assert next(teacher.parameters()).device.type == "cpu" and n0.samples == n0.forwarded == sum(len(r["ids"]) for r in recs)
    _, same, _ = kd.step(student, spec(1.0, student), recs, pad)
    assert same["kl"].abs().max().item() < 1e-5 and (same["distill"] > 0).all()


@pytest.mark.parametrize("spec", [{"packing_samples": False}, {"packing_samples": True},
                                  {"packing_samples": True, "max_len": 40},
                                  {"packing_samples": False, "attn_implementation": "eager"}],
                         ids=["padded", "packed", "packed-rows", "eager"])
def test_kto_kl_pairs_on_the_prompt_cache_equal_the_whole_forward(tiny, spec):
    """kto's KL pairs forwarded on the examples' KV cache (the shared prompt not forwarded again) give the log-probs
    and gradients of forwarding each pair whole, and forward fewer tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.inputs import models

    tok = models.load_tokenizer(tiny.policy_dir)
    rows = data.pairs_to_kto([{"prompt": f"Here is a review of the {t} I saw:", "chosen": f"great {t} , really .",
                               "rejected": f"bad {t} ."} for t in ("tea", "movie", "book", "car", "song")])
    kto = methods.get("kto")
    recs, _ = kto.tokenize(rows, tok, 64, seed=3)
    impl = spec.get("attn_implementation", "sdpa")
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32,
                                                 attn_implementation=impl).eval()
    pad = tok.pad_token_id
    got = kto._kl_on_prefix(model, {**spec, "attn_implementation": impl}, recs, pad)
    assert got is not None
    lp, kl_lp, tokens = got
    lp.sum().backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp2, kl2, tokens2 = kto._apart(model, {**spec, "attn_implementation": impl}, recs, pad)
    lp2.sum().backward()
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl_lp, kl2, rtol=1e-5, atol=1e-5)
    assert not kl_lp.requires_grad
    for a, b in zip(g1, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    prompts = sum(kto.shared_prefix(r) for r in recs)
    # the same samples' tokens for the throughput; the shared prompts not forwarded again
    assert prompts > 0 and tokens.samples == tokens2.samples and tokens.forwarded == tokens2.forwarded - prompts
