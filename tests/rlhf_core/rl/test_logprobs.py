"""rlhf_core.rl.logprobs: the tempered policy's per-token log-probs and entropy equal the full-vocabulary formula
(values and gradients), and at a Qwen2-7B shape (vocab 152k, 32 x 2048 tokens, on the `meta` device: shapes
without memory) no fp32 tensor of B x L x V elements is ever created, while the plain logits path creates one."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from rlhf_core.rl import logprobs, losses


class LargestTensors(TorchDispatchMode):
    """Records the element count of the largest tensor the ops create, per dtype, and of the largest fp32
    tensor with a vocabulary-sized dimension (`vocab`)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest, self.largest_vocab_fp32 = vocab, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
                if t.dtype == torch.float32 and self.vocab in t.shape:
                    self.largest_vocab_fp32 = max(self.largest_vocab_fp32, t.numel())
        return out


def tiny(config_cls, **extra):
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=128, head_dim=32, **extra)
    return AutoModelForCausalLM.from_config(cfg).eval()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 20), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 15:] = 0
    mask = torch.zeros(3, 19)
    mask[:, 5:14] = 1
    mask[2, 12:] = 0
    return ids, attn, mask


def by_hand(model, ids, attn, T):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / T  # (B, L - 1, V)
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("arch", [LlamaConfig, Gemma2Config])  # Gemma-2: final logit soft-capping
@pytest.mark.parametrize("T", [0.3, 1.0, 1.3])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(arch, T):
    extra = {"final_logit_softcapping": 5.0} if arch is Gemma2Config else {}
    model = tiny(arch, **extra)
    ids, attn, mask = batch()
    lp, ent = logprobs.token_logprobs(model, ids, attn, mask, T, "loss", chunk=7)  # chunks cut rows apart
    (lp.sum() + 0.5 * ent.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, ref_ent = by_hand(model, ids, attn, T)
    torch.testing.assert_close(lp, ref_lp * mask, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent * mask, atol=2e-5, rtol=0)
    ((ref_lp * mask).sum() + 0.5 * (ref_ent * mask).sum()).backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-4)


def test_entropy_for_the_log_has_no_graph_and_none_is_not_computed():
    model = tiny(LlamaConfig)
    ids, attn, mask = batch()
    lp, ent = logprobs.token_logprobs(model, ids, attn, mask, 1.0, "metric")
    assert lp.requires_grad and not ent.requires_grad
    assert logprobs.token_logprobs(model, ids, attn, mask)[1] is None
    with torch.no_grad():
        full = losses.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    torch.testing.assert_close(lp.detach(), full * mask, atol=2e-5, rtol=0)


def qwen2_7b_on_meta():
    cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                      torch_dtype="bfloat16", attn_implementation="eager")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def test_no_fp32_tensor_of_batch_x_length_x_vocab_at_a_7b_shape():
    """32 samples x 2048 tokens at Qwen2-7B's shape (vocab 152,064): B*L*V = 9.97e9 elements (40 GB in fp32).
    The chunked path's largest fp32 tensor is one (chunk, V) block; the plain logits path makes B*L*V."""
    model = qwen2_7b_on_meta()
    B, L, V = 32, 2048, model.config.vocab_size
    ids = torch.zeros(B, L, dtype=torch.long, device="meta")
    attn = torch.ones(B, L, dtype=torch.long, device="meta")
    for grad, entropy in ((False, "metric"), (True, "loss")):
        with torch.set_grad_enabled(grad), LargestTensors(V) as seen:
            lp, ent = logprobs.token_logprobs(model, ids, attn, None, 0.6, entropy)
        assert lp.shape == ent.shape == (B, L - 1) and lp.dtype == torch.float32
        assert seen.largest_vocab_fp32 == logprobs.CHUNK * V  # one chunk's logits
        # the largest fp32 tensor at all is eager attention's (B, heads, L, L) softmax (the trainers' issue)
        assert seen.largest[torch.float32] < B * (L - 1) * V
    with torch.no_grad(), LargestTensors(V) as plain:  # the path the roles used before: logits, then log-softmax
        losses.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    assert plain.largest_vocab_fp32 >= B * (L - 1) * V
