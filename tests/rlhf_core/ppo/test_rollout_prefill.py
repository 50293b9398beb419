"""HFRollout forwards each prompt once for its n samples (prompt_cache): the same tokens and log-probs as
transformers' own expansion (every prompt n times through the prefill), fewer tokens through the model, on
every zoo architecture (sliding windows shorter than the prompts, soft-caps, MoE, tokenizers without a pad)."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.demo.tiny import ZOO
from rlhf_core.ppo.engines import HFRollout

PROMPTS = [list(range(5, 19)), [9, 10, 11], [30, 31, 32, 33, 34, 35, 36]]  # left padded to 14; windows are 8


def generate(eng: HFRollout, share: bool, prompts=PROMPTS, **kw) -> tuple[list, int]:
    """(outputs, tokens forwarded through the embedding)."""
    seen = []
    hook = eng.model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].numel()))
    eng.share_prefill = share
    try:
        return eng.generate(prompts, **kw), sum(seen)
    finally:
        hook.remove()


def same(plain: list, shared: list) -> None:
    for a, b in zip(plain, shared, strict=True):
        assert [o["ids"] for o in a] == [o["ids"] for o in b]
        assert [o["finish_reason"] for o in a] == [o["finish_reason"] for o in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-4)


@pytest.mark.parametrize("arch", sorted(ZOO))
def test_each_prompt_is_forwarded_once_for_its_samples_with_the_same_samples(zoo, arch):
    eng = HFRollout(str(zoo[arch].policy))
    kw = dict(n=4, max_new_tokens=6, temperature=0.8, top_p=0.95, top_k=0, seed=3, repetition_penalty=1.1)
    plain, plain_tokens = generate(eng, False, **kw)
    shared, shared_tokens = generate(eng, True, **kw)
    width, n, p = max(map(len, PROMPTS)), kw["n"], len(PROMPTS)
    # the prefill: P x n x W tokens by transformers' expansion; P x (W - 1) once, then each sample's last prompt token
    # (decoding stops early when every row ended, the same step on both sides)
    assert plain_tokens - shared_tokens == p * n * width - (p * (width - 1) + p * n)
    same(plain, shared)
    assert len({tuple(o["ids"]) for o in shared[0]}) > 1  # the n samples of a prompt differ: sampled, not copied


def test_the_episodes_repeated_prompts_share_their_prefill(tiny):
    """The ppo rollout's shape: each episode its own prompt, n = 1 (rlhf_core.rollout.episodes.EngineClient), a
    group's prompts equal, groups interleaved; and distinct prompts, which keep generate's own prefill."""
    eng = HFRollout(str(tiny.policy_dir))
    kw = dict(n=1, max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=0, seed=7)
    rows = [PROMPTS[i % 2] for i in range(6)]  # two distinct prompts, 3 rows each, alternating
    plain, plain_tokens = generate(eng, False, rows, **kw)
    shared, shared_tokens = generate(eng, True, rows, **kw)
    width = max(map(len, rows))
    assert plain_tokens - shared_tokens == 6 * width - (2 * (width - 1) + 6)
    same(plain, shared)
    distinct, distinct_tokens = generate(eng, True, PROMPTS, **kw)
    assert distinct_tokens == generate(eng, False, PROMPTS, **kw)[1]  # nothing to share: no prefill of its own
    calls = []
    eng.prompt_cache = lambda *a: calls.append(a)
    eng.generate([[5], [5]], **kw)  # one-token prompts: nothing before the last token
    assert calls == []


def test_the_shared_prefill_of_a_peft_policy_keeps_one_position_of_logits(tiny):
    """A LoRA-wrapped policy (the learner's module with lora_rank) takes logits_to_keep through to its base model:
    the prefill computes the last position's logits only, not (prompts, W, V), and samples as generate does."""
    from peft import LoraConfig, get_peft_model

    eng = HFRollout(str(tiny.policy_dir))
    eng.model = get_peft_model(eng.model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    widths = []
    eng.model.get_output_embeddings().register_forward_hook(lambda m, a, out: widths.append(out.shape[1]))
    kw = dict(n=3, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=5)
    shared, _ = generate(eng, True, **kw)
    assert widths[0] == 1  # the prefill's head: one position per prompt
    plain, _ = generate(eng, False, **kw)
    same(plain, shared)
