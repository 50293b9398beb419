"""HFRollout forwards each prompt once for its n samples (prompt_cache): the same tokens and log-probs as
transformers' own expansion (every prompt n times through the prefill), fewer tokens through the model, on
every zoo architecture (sliding windows shorter than the prompts, soft-caps, MoE, tokenizers without a pad)."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.demo.tiny import ZOO
from rlhf_core.ppo.engines import HFRollout

PROMPTS = [list(range(5, 19)), [9, 10, 11], [30, 31, 32, 33, 34, 35, 36]]  # left padded to 14; windows are 8


def generate(eng: HFRollout, share: bool, **kw) -> tuple[list, int]:
    """(outputs, tokens forwarded through the embedding)."""
    seen = []
    hook = eng.model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].numel()))
    eng.share_prefill = share
    try:
        return eng.generate(PROMPTS, **kw), sum(seen)
    finally:
        hook.remove()


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
    for a, b in zip(plain, shared):
        assert [o["ids"] for o in a] == [o["ids"] for o in b]
        assert [o["finish_reason"] for o in a] == [o["finish_reason"] for o in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-4)
    assert len({tuple(o["ids"]) for o in shared[0]}) > 1  # the n samples of a prompt differ: sampled, not copied


def test_one_sample_or_one_token_prompts_take_generates_own_path(tiny):
    eng = HFRollout(str(tiny.policy_dir))
    calls = []
    eng.prompt_cache = lambda *a: calls.append(a) or None
    eng.generate([[5, 6, 7]], n=1, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    eng.generate([[5], [6]], n=3, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    assert calls == []
    out = eng.generate([[5, 6], [7]], n=2, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    assert len(calls) == 1 and [len(x) for x in out] == [2, 2]  # a cache it cannot repeat: generate expands
