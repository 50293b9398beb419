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


@pytest.mark.parametrize("backend", ["fused", "chunked"])
@pytest.mark.parametrize("arch", [LlamaConfig, Gemma2Config])  # Gemma-2: final logit soft-capping
@pytest.mark.parametrize("T", [0.3, 1.0, 1.3])
def test_chunked_logprobs_and_entropy_equal_the_full_softmax(arch, T, backend, monkeypatch):
    monkeypatch.setenv("RLHF_FLOWS_LOGPROBS", backend)
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


@pytest.mark.parametrize("backend", ["fused", "chunked"])
def test_entropy_for_the_log_has_no_graph_and_none_is_not_computed(backend, monkeypatch):
    monkeypatch.setenv("RLHF_FLOWS_LOGPROBS", backend)
    model = tiny(LlamaConfig)
    ids, attn, mask = batch()
    lp, ent = logprobs.token_logprobs(model, ids, attn, mask, 1.0, "metric")
    assert lp.requires_grad and not ent.requires_grad
    assert logprobs.token_logprobs(model, ids, attn, mask)[1] is None
    with torch.no_grad():
        full = losses.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    torch.testing.assert_close(lp.detach(), full * mask, atol=2e-5, rtol=0)


def _by_hand_head(h, w, b, targets, scale, cap, T):
    z = torch.nn.functional.linear(h, w, b) * scale
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    lp = torch.log_softmax(z / T, -1)
    return lp.gather(-1, targets[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("scale,cap,T", [(1.0, None, 1.0), (0.0625, None, 0.7), (1.0, 4.0, 1.0), (3.0, 2.5, 0.6)])
def test_fused_head_gradients_equal_float64_autograd(scale, cap, T):
    """FusedHeadLogprobs's hand-written backward (fp32 inside, as the logits are cast to fp32) against autograd of
    the plain computation in float64: the gradients of h, the weight and the bias through log p and the
    entropy, the scale (Cohere / Granite), the soft-cap (Gemma-2) and the temperature, with chunks (3) that
    cut the tokens apart."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 7, 5, 11
    h, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in ((N, H), (V, H), (V,)))
    t = torch.randint(0, V, (N,), generator=g)
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    lp, ent = logprobs.FusedHeadLogprobs.apply(h, w, b, t, scale, cap, T, "loss", 3)
    got = torch.autograd.grad((lp.double() * up[0]).sum() + (ent.double() * up[1]).sum(), (h, w, b))
    want_lp, want_ent = _by_hand_head(h, w, b, t, scale, cap, T)
    want = torch.autograd.grad((want_lp * up[0]).sum() + (want_ent * up[1]).sum(), (h, w, b))
    torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=0)
    for a, e in zip(got, want):
        assert float(e.abs().max()) > 0.05
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("entropy", [None, "metric", "loss"])
def test_fused_head_equals_autograd_of_the_plain_computation(entropy):
    """fp32, a head with a bias, a frozen weight (no weight gradient asked) and a trainable one: values and
    gradients of h / weight / bias equal autograd through the plain (N, V) computation."""
    g = torch.Generator().manual_seed(1)
    N, H, V = 37, 16, 301
    h0 = torch.randn(N, H, generator=g)
    w0, b0 = torch.randn(V, H, generator=g) * 0.3, torch.randn(V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    up_lp, up_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    for frozen in (False, True):
        h, w, b = h0.clone().requires_grad_(), w0.clone().requires_grad_(not frozen), b0.clone().requires_grad_()
        lp, ent = logprobs.FusedHeadLogprobs.apply(h, w, b, t, 1.0, 3.0, 0.8, entropy, 8)
        loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if entropy == "loss" else 0)
        loss.backward()
        hr, wr, br = h0.clone().requires_grad_(), w0.clone().requires_grad_(not frozen), b0.clone().requires_grad_()
        rlp, rent = _by_hand_head(hr, wr, br, t, 1.0, 3.0, 0.8)
        ((rlp * up_lp).sum() + ((rent * up_ent).sum() if entropy == "loss" else 0)).backward()
        torch.testing.assert_close(lp, rlp.detach(), atol=1e-5, rtol=0)
        if entropy:
            torch.testing.assert_close(ent, rent.detach(), atol=1e-5, rtol=0)
            assert ent.requires_grad == (entropy == "loss")
        else:
            assert ent.numel() == 0
        for got, want in ((h.grad, hr.grad), (b.grad, br.grad)) + (() if frozen else ((w.grad, wr.grad),)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert frozen == (w.grad is None)


def test_the_backend_is_chosen_by_the_head_and_refused_by_name(monkeypatch):
    """Heads that are not a plain Linear go through the module (chunked); a ZeRO-3-partitioned Linear takes the fused
    function (inside the head's call: tests/rlhf_core/rl/test_fused_training.py); an unknown name is refused naming
    the variable."""
    lin = torch.nn.Linear(4, 9, bias=False)
    h = torch.zeros(2, 4)
    assert logprobs.backend(lin, h) == "fused"
    lin.weight.ds_id = 3  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    assert logprobs.backend(lin, h) == "fused"
    assert logprobs.backend(torch.nn.Sequential(torch.nn.Linear(4, 9)), h) == "chunked"
    monkeypatch.setenv("RLHF_FLOWS_LOGPROBS", "triton")
    with pytest.raises(ValueError, match="RLHF_FLOWS_LOGPROBS='triton' is not one of fused, chunked, liger"):
        logprobs.backend(torch.nn.Linear(4, 9), h)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "chunked", "liger"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_on_cuda_equals_the_plain_computation(backend, dtype, monkeypatch):
    """On CUDA: each backend (liger where installed) against autograd through the plain logits, a Gemma-2
    model (soft-capping) at T 0.7: log-probs and the gradients of every parameter, fp32 and bf16."""
    if backend == "liger":
        pytest.importorskip("liger_kernel")
    monkeypatch.setenv("RLHF_FLOWS_LOGPROBS", backend)
    model = tiny(Gemma2Config, final_logit_softcapping=5.0).to("cuda", dtype)
    ids, attn, mask = (x.cuda() for x in batch())
    lp, _ = logprobs.token_logprobs(model, ids, attn, mask, 0.7)
    (lp * mask).sum().backward()
    grads = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad()
    ref_lp, _ = by_hand(model, ids, attn, 0.7)
    (ref_lp * mask).sum().backward()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lp, ref_lp * mask, atol=tol, rtol=0)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad.float(), atol=tol, rtol=tol)


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
