"""The ppo roles' forwards in every layout equal the padded rows (issue 35 item 7, issue 36 item 4).

Layouts of rlhf_core.ppo.forward.token_outputs: padded (the ground truth: transformers' own masks from the (B, L)
padding mask, eager attention), packed (packing_samples) and shared (shared_prompt: GRPO's n samples of a prompt
as one row, the prompt once, n branches each attending to the prompt and itself: batches.collate_groups). Each
gives the policy's log-probs and entropy and the critic's values, and the same gradients of a fixed random
weighting of them (fp32, atol 1e-4), on every zoo architecture, among them Mistral v0.1 (every layer slides,
window 8) and Gemma-2 (alternating sliding / full, soft-caps) with sequences longer than the window. Groups of
4 samples (responses of different lengths) over 3 prompts of different lengths; responses that begin alike,
so a shared prefix runs into them (the first prompt's responses begin alike). flex_attention has no backward on CPU: values only there (gradients in the
`gpu` test, beside flash_attention_2, under which groups go packed).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_core.ppo.batches import collate
from rlhf_core.ppo.forward import grouped_order, prompt_groups, token_outputs
from rlhf_core.train import batches

ATOL = 1e-4
ARCHS = ("llama3", "qwen2", "mistral", "phi3", "gemma2", "mistral-sw")


def grpo_batch(vocab: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts, resp = [], []
    for k, P in enumerate((9, 14, 6)):
        p = torch.randint(3, vocab, (P,), generator=g).tolist()
        for j in range(n):
            prompts.append(p)
            resp.append(torch.randint(3, vocab, (5 + 3 * j + k,), generator=g).tolist())
    for j in range(1, n):  # the first prompt's responses begin alike: its shared prefix runs past the prompt
        resp[j][:2] = resp[0][:2]
    b = collate(prompts, resp, pad_id=0)
    if n > 3:
        b["mask"][3, -4:] *= 0  # a row whose last action columns are masked out (multi-turn feedback)
    return b


def _models(zoo, arch):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(str(zoo[arch].policy), dtype=torch.float32, attn_implementation="eager")
    critic = AutoModelForSequenceClassification.from_pretrained(str(zoo[arch].reward), dtype=torch.float32,
                                                                num_labels=1, attn_implementation="eager")
    return policy, critic


def _run(model, batch, kind, **layout):
    out, ent, tokens = token_outputs(model, batch, kind, 0.8, "loss" if kind == "policy" else None, **layout)
    return (out if ent is None else torch.cat([out, ent])), tokens


def _grads(value, model, weight_of):
    return torch.autograd.grad((value * weight_of).sum(), [p for p in model.parameters() if p.requires_grad],
                               allow_unused=True)


def test_groups_are_found_by_prompt_and_the_layout_forwards_each_prompt_once():
    b = grpo_batch(300)
    assert prompt_groups(b) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    order = grouped_order(b, torch.Generator().manual_seed(3)).tolist()
    assert sorted(order) == list(range(12)) and all(order[k:k + 4] in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
                                                     for k in (0, 4, 8))
    lens = b["attn"].sum(-1).tolist()
    seqs = [b["ids"][i, :n].tolist() for i, n in enumerate(lens)]
    gb, where = batches.collate_groups([seqs[0:4], seqs[4:8], seqs[8:12]], 0)
    assert gb.input_ids.shape[0] == 3 and gb.real_tokens == sum(lens)
    assert int(((gb.branch[0] == 0) & (gb.doc[0] >= 0)).sum()) == 9 + 2  # the prompt and the 2 tokens its responses share
    for j, s in enumerate(seqs):  # every sample's tokens sit where the map says, at the positions they have alone
        flat = gb.input_ids.reshape(-1)[where[j]]
        assert flat.tolist() == s and gb.position_ids.reshape(-1)[where[j]].tolist() == list(range(len(s)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_and_packed_layouts_equal_the_padded_rows_in_values_and_gradients(zoo, arch):
    policy, critic = _models(zoo, arch)
    b = grpo_batch(policy.config.vocab_size)
    real = int(b["attn"].sum())
    checked = []
    for kind, model in (("policy", policy), ("critic", critic)):
        model.set_attn_implementation("eager")
        want, padded_tokens = _run(model, b, kind)
        rel = torch.cat([b["mask"]] * 2) if kind == "policy" else b["attn"][:, 1:].float()
        w = torch.linspace(-1, 1.5, rel.numel()).view(rel.shape) * rel
        want_g = _grads(want, model, w)
        assert padded_tokens == b["ids"].numel()
        for impl in ("eager", "sdpa", "flex_attention"):
            if impl == "sdpa" and arch == "gemma2":  # sdpa cannot soft-cap (refused: attention.check)
                continue
            model.set_attn_implementation(impl)
            grad = impl != "flex_attention"
            for layout in ({"shared": True}, {"packing": True}):
                with torch.set_grad_enabled(grad), _uncompiled_flex(not grad):
                    got, tokens = _run(model, b, kind, **layout)
                assert torch.allclose(got.detach() * rel, want.detach() * rel, atol=ATOL), \
                    (arch, kind, impl, layout, (got.detach() - want.detach()).mul(rel).abs().max())
                if layout.get("shared"):  # each prompt forwarded once
                    assert tokens < real < padded_tokens, (tokens, real)
                else:
                    assert tokens == real
                if grad:
                    for a, e in zip(_grads(got, model, w), want_g):
                        if e is not None:
                            assert torch.allclose(a, e, atol=ATOL, rtol=1e-3), (arch, kind, impl, layout)
                checked.append((kind, impl, str(layout)))
        model.set_attn_implementation("eager")
    assert len(checked) == 2 * 2 * (2 if arch == "gemma2" else 3)


def test_without_shared_prompts_the_rows_stay_padded():
    """No two rows with one prompt (n_samples_per_prompt 1): shared_prompt changes nothing (padded rows)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=64))
    b = grpo_batch(300, n=1)
    _, tokens = _run(model, b, "policy", shared=True)
    assert tokens == b["ids"].numel()


def test_the_roles_load_the_setting_and_refuse_what_this_host_cannot_run(tiny, zoo, tmp_path):
    """attn_implementation reaches the policy / critic / reference models (a Config field named as the trainers');
    a kernel this host lacks is refused on the role's host naming the field, and Gemma-2 under sdpa by the stage
    before Ray starts."""
    import json

    from rlhf_core.ppo import loop
    from rlhf_core.ppo.roles import Learner, Reference
    from stages import ppo

    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", rollout_batch_size=2,
                n_samples_per_prompt=2, advantage_estimator="group_norm", train_batch_size=4, micro_train_batch_size=2,
                zero_stage=0)
    hp = loop.learner_settings(ppo.Config(**base, attn_implementation="eager"))
    assert hp["attn_implementation"] == "eager" and hp["shared_prompt"] is True
    assert Reference(str(tiny.policy_dir), hp).model.config._attn_implementation == "eager"
    assert Learner("policy", 0, 1).load_model(str(tiny.policy_dir), hp, {}).config._attn_implementation == "eager"
    assert Learner("critic", 0, 1).load_model(str(tiny.reward_dir), hp, {}).config._attn_implementation == "eager"
    for impl, why in (("flash_attention_2", "it needs a CUDA GPU; this host has none"),
                      ("flex_attention", "torch's flex_attention needs a CUDA GPU")):
        if not torch.cuda.is_available():
            bad = loop.learner_settings(ppo.Config(**base, attn_implementation=impl))
            with pytest.raises(ValueError, match=f"attn_implementation={impl}: {why}"):
                Reference(str(tiny.policy_dir), bad)
            with pytest.raises(ValueError, match=f"attn_implementation={impl}: {why}"):
                Learner("policy", 0, 1).load_model(str(tiny.policy_dir), bad, {})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    cfg = ppo.Config(**{**base, "policy_uri": str(zoo["gemma2"].policy), "prompts_uri": str(prompts),
                        "output_uri": str(tmp_path / "out"), "reward_func_path": str(tmp_path / "r.py")})
    with pytest.raises(ValueError, match=r"attn_implementation=sdpa: .*soft-caps its attention logits"):
        ppo.run(cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("_MANIFEST.json"))


@contextlib.contextmanager
def _uncompiled_flex(on: bool):
    """flex_attention uncompiled (torch's reference implementation: its CPU kernel fails to compile here), as in
    tests/rlhf_core/train/test_attention_layouts.py."""
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


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ("flex_attention", "flash_attention_2"))
def test_layouts_on_gpu_with_gradients(zoo, impl):
    """On CUDA: flex (compiled block masks, with backward; fp32) and flash attention (bf16; groups go packed) give
    the padded eager rows' values and gradients, for the policy and the critic of every zoo architecture."""
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-3
    for arch in ARCHS:
        policy, critic = (m.to("cuda", dtype) for m in _models(zoo, arch))
        b = {k: v.cuda() for k, v in grpo_batch(policy.config.vocab_size).items()}
        for kind, model in (("policy", policy), ("critic", critic)):
            rel = torch.cat([b["mask"]] * 2) if kind == "policy" else b["attn"][:, 1:].float()
            w = torch.linspace(-1, 1.5, rel.numel(), device="cuda").view(rel.shape) * rel
            model.set_attn_implementation("eager")
            want, _ = _run(model, b, kind)
            want_g = _grads(want.float(), model, w)
            model.set_attn_implementation(impl)
            for layout in ({"shared": True}, {"packing": True}):
                got, _ = _run(model, b, kind, **layout)
                assert torch.allclose(got.float() * rel, want.float() * rel, atol=tol, rtol=tol), (arch, kind, layout)
                for a, e in zip(_grads(got.float(), model, w), want_g):
                    if e is not None:
                        assert torch.allclose(a.float(), e.float(), atol=tol, rtol=tol), (arch, kind, layout)


def test_a_dense_mask_shares_only_where_it_pays():
    """Under a dense mask (sdpa) a row of a short prompt and 8 long branches costs more attention than it saves
    (measured: 32 : 128 took 1.8x the padded time on CPU): such a batch stays padded, a long prompt with short
    responses is shared (rlhf_core.ppo.forward._shared_pays)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1,
                                                         num_attention_heads=1, intermediate_size=64))
    g = torch.Generator().manual_seed(0)
    for P, R, shares in ((4, 60, False), (60, 4, True)):
        p = torch.randint(3, 300, (P,), generator=g).tolist()
        b = collate([p] * 8, [torch.randint(3, 300, (R,), generator=g).tolist() for _ in range(8)], 0)
        _, tokens = _run(model, b, "policy", shared=True)
        assert (tokens == P + 8 * R) if shares else (tokens == b["ids"].numel()), (P, R, tokens)
