"""Packed and shared-prompt layouts equal the padded layout, for every method that uses one, every attention
implementation this host runs, and zoo models with sliding windows (rlhf_core.train.attention).

The ground truth is transformers' own: padded rows with a (R, T) padding mask under eager attention, from which
each layer builds its mask (causal, the layer's sliding window) and applies the architecture's soft-caps. Each
layout under each implementation must give the same values (summed response log-probs, rewards, PRM step
logits) and the same gradients of a fixed random weighting of them. flex_attention has no backward on CPU:
there it is checked in values (gradients in the `gpu` test). The models: Llama-3 (full attention), Mistral
v0.1-shaped (every layer slides, window 8) and Gemma-2-shaped (sliding and full layers alternating, window 8,
attention and final-logit soft-caps), all with sequences longer than the window. Tolerance: ATOL on log-prob
sums / rewards (fp32, sums of ~30 terms), grads atol ATOL, rtol 1e-3.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core.inputs import models
from rlhf_core.train import attention, batches
from rlhf_core.train.entry import forward
from rlhf_core.train.methods import prm, rm

ATOL = 1e-4
ARCHS = ("llama3", "mistral-sw", "gemma2")
CPU_IMPLS = ("eager", "sdpa", "flex_attention")


@pytest.fixture(scope="module")
def setup(zoo):
    """Per arch: tokenizer, policy and reward model (fp32), 4 pairs (one whose prompts differ) and their seqs."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    out = {}
    for arch in ARCHS:
        tok = models.load_tokenizer(zoo[arch].policy)
        recs, _ = batches.tokenize_pairs(demo_task.preference_rows(4, seed=3), tok, 64, model_dir=zoo[arch].policy)
        recs[1]["rejected_ids"] = [recs[1]["rejected_ids"][0] + 1] + recs[1]["rejected_ids"][1:]  # prompts differ
        c, cs = [r["chosen_ids"] for r in recs], [r["chosen_start"] for r in recs]
        r, rs = [r["rejected_ids"] for r in recs], [r["rejected_start"] for r in recs]
        assert min(map(len, c + r)) > 8 + 4  # longer than the window (8): it must cut something
        policy = AutoModelForCausalLM.from_pretrained(str(zoo[arch].policy), dtype=torch.float32, attn_implementation="eager")
        reward = AutoModelForSequenceClassification.from_pretrained(str(zoo[arch].reward), dtype=torch.float32, num_labels=1,
                                                                    attn_implementation="eager")
        out[arch] = dict(tok=tok, pad=models.pad_id(tok, zoo[arch].policy), policy=policy, reward=reward,
                         seqs=c + r, starts=cs + rs)
    return out


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _grads(value: torch.Tensor, model) -> list[torch.Tensor]:
    w = torch.linspace(-1.0, 1.5, value.numel())  # a fixed weighting: every output enters the gradient differently
    return torch.autograd.grad((value.flatten() * w).sum(), _params(model))


def _two_rows_lm(model, seqs, starts, pad):
    """Summed target log-probs per sample # (n,), padded rows, the model's own masks (HF forward, no helper of ours)."""
    from rlhf_core.rl import losses

    b = batches.collate(seqs, starts, pad)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    return batches.per_sample_sum(losses.token_logprobs(logits, b.input_ids), b)


def _two_rows_rm(model, seqs, pad):
    b = batches.collate(seqs, [0] * len(seqs), pad)
    h = model.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).last_hidden_state
    return model.score(h[b.last[:, 0], b.last[:, 1]]).squeeze(-1)


def _placeholder(seqs) -> int:
    """A token id frequent in the sequences: the PRM's step placeholder for this test (several per sample)."""
    ids, counts = torch.tensor([t for s in seqs for t in s[1:]]).unique(return_counts=True)
    return int(ids[counts.argmax()])


def _rows(seqs) -> dict:
    """packing_samples with a row budget that packs these samples into several rows of several samples each
    (the longest and the shortest fit together; not all of them do)."""
    lens = sorted(map(len, seqs))
    rows = batches.pack_rows(list(map(len, seqs)), lens[-1] + lens[0])
    assert 1 < len(rows) < len(seqs), rows
    return {"packing_samples": True, "max_len": lens[-1] + lens[0]}


# method -> (what the layout computes, its ground truth), both fn(policy, reward, seqs, starts, pad)
CASES = {
    "sft/kto packed": (lambda p, r, s, st, pad: forward(p, {"packing_samples": True}, s, st, pad)[0],
                       lambda p, r, s, st, pad: _two_rows_lm(p, s, st, pad)),
    "sft/kto packed rows": (lambda p, r, s, st, pad: forward(p, _rows(s), s, st, pad)[0],
                            lambda p, r, s, st, pad: _two_rows_lm(p, s, st, pad)),
    "dpo/kto-reference pairs": (lambda p, r, s, st, pad: forward(p, {"packing_samples": False}, s, st, pad, pairs=True)[0],
                                lambda p, r, s, st, pad: _two_rows_lm(p, s, st, pad)),
    "rm pairs": (lambda p, r, s, st, pad: rm.rewards(r, {"packing_samples": False}, s, st, pad)[0],
                 lambda p, r, s, st, pad: _two_rows_rm(r, s, pad)),
    "rm packed": (lambda p, r, s, st, pad: rm.rewards(r, {"packing_samples": True}, s, st, pad)[0],
                  lambda p, r, s, st, pad: _two_rows_rm(r, s, pad)),
    "rm packed rows": (lambda p, r, s, st, pad: rm.rewards(r, _rows(s), s, st, pad)[0],
                       lambda p, r, s, st, pad: _two_rows_rm(r, s, pad)),
    "prm packed": (lambda p, r, s, st, pad: prm.reward_logits(p, s, pad, _placeholder(s), [5, 6], packed=True)[0],
                   lambda p, r, s, st, pad: prm.reward_logits(p, s, pad, _placeholder(s), [5, 6], packed=False)[0]),
}


@contextlib.contextmanager
def _uncompiled_flex(on: bool):
    """flex_attention uncompiled: torch's reference implementation (same BlockMask, mask_mod and score_mod), as
    its CPU kernel fails to compile here (attention.available). Dynamo off makes transformers' compiled wrapper
    call it directly; torch's own debug switch keeps flex_attention from compiling itself."""
    import torch.nn.attention.flex_attention as fa

    if not on:
        yield
        return
    saved = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved


def _model_of(case: str, policy, reward):
    return reward if case.startswith("rm") else policy


@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_equal_the_padded_layout_in_values_and_gradients(setup, arch):
    s = setup[arch]
    policy, reward = s["policy"], s["reward"]
    args = (s["seqs"], s["starts"], s["pad"])
    truth = {}
    for m in (policy, reward):
        m.set_attn_implementation("eager")
    for case, (_, ref) in CASES.items():
        v = ref(policy, reward, *args)
        truth[case] = (v.detach(), _grads(v, _model_of(case, policy, reward)))
    checked = []
    for impl in CPU_IMPLS:
        if impl == "sdpa" and arch == "gemma2":  # sdpa cannot soft-cap: refused (test_bad_settings_are_refused)
            continue
        for m in (policy, reward):
            m.set_attn_implementation(impl)
        grad = impl != "flex_attention"  # no flex backward on CPU
        for case, (layout, _) in CASES.items():
            with torch.set_grad_enabled(grad), _uncompiled_flex(not grad):
                v = layout(policy, reward, *args)
            want, want_g = truth[case]
            assert v.shape == want.shape
            assert torch.allclose(v.detach(), want, atol=ATOL), (arch, impl, case, (v.detach() - want).abs().max())
            if grad:
                for a, e in zip(_grads(v, _model_of(case, policy, reward)), want_g):
                    assert torch.allclose(a, e, atol=ATOL, rtol=1e-3), (arch, impl, case, (a - e).abs().max())
            checked.append((impl, case))
    assert len(checked) == len(CASES) * (2 if arch == "gemma2" else 3)


def _pairs_with_mask(model, b, mask_of) -> torch.Tensor:
    """Summed log-probs of a pairs Batch under the masks mask_of(layer type) -> bool # (R, 1, T, T), eager."""
    from rlhf_core.rl import losses

    types = attention.layer_types(model.config)
    m = {t: torch.zeros(mask_of(t).shape).masked_fill(~mask_of(t), torch.finfo(torch.float32).min) for t in set(types)}
    logits = model(input_ids=b.input_ids, position_ids=b.position_ids,
                   attention_mask=m[types[0]] if len(m) == 1 else m).logits
    rows, cols, toks, samples = b.targets()
    lp = losses.gathered_logprobs(logits[rows, cols], toks)
    return torch.zeros(b.n).index_add(0, samples, lp)


@pytest.mark.parametrize("arch", ("mistral-sw", "gemma2"))
def test_the_comparison_fails_when_the_mask_is_broken(setup, arch):
    """The masks the layouts get, broken on purpose, fed to the same model: dropping the window, or counting it
    in columns instead of positions, moves the log-probs far beyond ATOL; the intact mask stays within it."""
    s = setup[arch]
    model = s["policy"]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = _two_rows_lm(model, s["seqs"], s["starts"], s["pad"])
        k = len(s["seqs"]) // 2
        b = batches.collate_pairs(s["seqs"][:k], s["starts"][:k], s["seqs"][k:], s["starts"][k:], s["pad"])
        R, T = b.input_ids.shape
        cols = torch.arange(T).expand(R, T)
        window = model.config.sliding_window

        def built(pos, keep_window=True):
            return lambda t: attention.dense(attention.mask_function(
                b.doc, b.branch, pos, window if keep_window and t == "sliding_attention" else None), R, T, "cpu")

        intact = _pairs_with_mask(model, b, built(b.position_ids))
        no_window = _pairs_with_mask(model, b, built(b.position_ids, keep_window=False))
        column_window = _pairs_with_mask(model, b, built(cols))
    assert (intact - want).abs().max() < ATOL
    assert (no_window - want).abs().max() > 100 * ATOL, (no_window - want).abs().max()
    assert (column_window - want).abs().max() > 100 * ATOL, (column_window - want).abs().max()


def test_rm_under_eager_gets_an_additive_mask(setup):
    """The issue's RM bug: a boolean (T, T) mask handed to eager attention is added to the scores (True = 1,
    False = 0), so nothing is masked. The reward of that forward is far from the two-row reward; rm.rewards
    (the mask from attention.model_inputs) is within ATOL."""
    s = setup["llama3"]
    model = s["reward"]
    model.set_attn_implementation("eager")
    k = len(s["seqs"]) // 2
    with torch.no_grad():
        want = _two_rows_rm(model, s["seqs"], s["pad"])
        got = rm.rewards(model, {"packing_samples": False}, s["seqs"], s["starts"], s["pad"])[0]
        b = batches.collate_pairs(s["seqs"][:k], s["starts"][:k], s["seqs"][k:], s["starts"][k:], s["pad"])
        R, T = b.input_ids.shape
        boolean = attention.dense(attention.mask_function(b.doc, b.branch, b.position_ids), R, T, "cpu")
        h = model.model(input_ids=b.input_ids, attention_mask=boolean, position_ids=b.position_ids).last_hidden_state
        old = model.score(h[b.last[:, 0], b.last[:, 1]]).squeeze(-1)
    assert (got - want).abs().max() < ATOL
    assert (old - want).abs().max() > 0.01, (old - want).abs().max()


def test_masks_per_layer_type_without_a_dense_tensor_under_flex(setup):
    """Gemma-2's alternating layers get one mask each ({layer type: mask}); under flex they are BlockMasks
    (no (T, T) tensor); the dense fallback is a (R, 1, T, T) bool mask for sdpa, additive for eager."""
    from torch.nn.attention.flex_attention import BlockMask

    s = setup["gemma2"]
    k = len(s["seqs"]) // 2
    b = batches.collate_pairs(s["seqs"][:k], s["starts"][:k], s["seqs"][k:], s["starts"][k:], s["pad"])
    R, T = b.input_ids.shape
    assert b.attention_mask is None and b.layout == "pairs"
    cfg = s["policy"].config
    for impl, kind in (("flex_attention", BlockMask), ("eager", torch.Tensor), ("sdpa", torch.Tensor)):
        cfg._attn_implementation = impl
        m = attention.layout_masks(cfg, b, "cpu", torch.float32)
        assert set(m) == {"sliding_attention", "full_attention"} and all(isinstance(v, kind) for v in m.values())
        if impl != "flex_attention":
            assert m["full_attention"].shape == (R, 1, T, T)
            assert m["full_attention"].dtype == (torch.bool if impl == "sdpa" else torch.float32)
    cfg._attn_implementation = "eager"
    # Mistral's layers share one type: one mask, which its forward passes through as prepared
    assert isinstance(attention.layout_masks(setup["mistral-sw"]["policy"].config, b, "cpu", torch.float32), torch.Tensor)


def test_bad_settings_are_refused_before_work(zoo):
    from pydantic import ValidationError

    from rlhf_core.train.launch import TrainFields, check_hardware

    with pytest.raises(ValueError, match="attn_implementation=flash_attention_2: it needs a CUDA GPU; this host has "
                                         "none; available here: sdpa, eager"):
        attention.check("flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation=flex_attention: torch's flex_attention needs a CUDA GPU"):
        attention.check("flex_attention")
    with pytest.raises(ValueError, match=r"attn_implementation=sdpa: .*gemma2.* soft-caps its attention logits "
                                         r"\(attn_logit_softcapping=0.3\), which sdpa cannot apply; use eager"):
        attention.check("sdpa", zoo["gemma2"].policy)
    attention.check("eager", zoo["gemma2"].policy)
    with pytest.raises(ValidationError, match="attn_implementation"):
        TrainFields(dataset_uri="x", attn_implementation="flash")
    with pytest.raises(ValueError, match="attn_implementation=flash_attention_2"):
        check_hardware(TrainFields(dataset_uri="x", attn_implementation="flash_attention_2"))


def test_the_setting_reaches_the_trainer_and_the_reference_pass(setup, zoo, tmp_path):
    """entry.load_model loads the spec's implementation; the reference pass forwards with it: on Gemma-2, sdpa
    (which drops the attention soft-cap) gives other log-probs than eager, and eager's equal the two-row truth."""
    from rlhf_core.train import entry, reference
    from rlhf_core.train.methods import get

    spec = {"bf16": False, "zero_stage": 0, "gradient_checkpointing": False, "lora_rank": 0,
            "model_dir": str(zoo["gemma2"].policy), "attn_implementation": "eager"}
    assert entry.load_model(spec, False, get("dpo")).config._attn_implementation == "eager"
    s = setup["gemma2"]
    k = len(s["seqs"]) // 2
    recs = [{"chosen_ids": c, "chosen_start": cs, "rejected_ids": r, "rejected_start": rs}
            for c, cs, r, rs in zip(s["seqs"][:k], s["starts"][:k], s["seqs"][k:], s["starts"][k:])]
    got = {impl: torch.tensor(reference.compute(recs, zoo["gemma2"].policy, s["pad"], tmp_path / impl, launcher="inline",
                                                attn_implementation=impl)[0]) for impl in ("eager", "sdpa")}
    s["policy"].set_attn_implementation("eager")
    with torch.no_grad():
        want = _two_rows_lm(s["policy"], s["seqs"], s["starts"], s["pad"])[:k]
    assert torch.allclose(got["eager"], want, atol=ATOL)
    assert (got["sdpa"] - want).abs().max() > 10 * ATOL  # measured 3.7e-3 (eager: within 2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ("flex_attention", "flash_attention_2"))
def test_layouts_on_gpu_with_gradients(setup, impl):
    """On CUDA: flex (compiled, block masks, with backward) in fp32 and flash attention (packed rows by position
    ids; pairs forwarded as two sequences, entry.batch_of) in bf16 equal eager's padded rows in the same dtype."""
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-3
    spec = {"attn_implementation": impl}  # batch_of's flash fallback reads it
    cases = {  # (layout under impl, ground truth under eager)
        "sft/kto packed": lambda p, r, s, st, pad: forward(p, {**spec, "packing_samples": True}, s, st, pad)[0],
        "dpo pairs": lambda p, r, s, st, pad: forward(p, {**spec, "packing_samples": False}, s, st, pad, pairs=True)[0],
        "rm pairs": lambda p, r, s, st, pad: rm.rewards(r, {**spec, "packing_samples": False}, s, st, pad)[0],
    }
    truth_of = {"sft/kto packed": CASES["sft/kto packed"][1], "dpo pairs": CASES["dpo/kto-reference pairs"][1],
                "rm pairs": CASES["rm pairs"][1]}
    for arch in ARCHS:
        s = setup[arch]
        policy, reward = s["policy"].to("cuda", dtype), s["reward"].to("cuda", dtype)
        args = (s["seqs"], s["starts"], s["pad"])
        try:
            for case, layout in cases.items():
                model = _model_of(case, policy, reward)
                model.set_attn_implementation("eager")
                want = truth_of[case](policy, reward, *args)
                want_g = _grads(want.float().cpu(), model)
                model.set_attn_implementation(impl)
                got = layout(policy, reward, *args)
                assert torch.allclose(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol), (arch, case)
                for a, e in zip(_grads(got.float().cpu(), model), want_g):
                    assert torch.allclose(a.float(), e.float(), atol=tol, rtol=tol), (arch, case)
        finally:
            for m in (policy, reward):
                m.set_attn_implementation("eager")
            s["policy"], s["reward"] = policy.to("cpu", torch.float32), reward.to("cpu", torch.float32)
