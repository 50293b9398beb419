"""Losses against hand-computed values (arithmetic in each docstring)."""
import math

import pytest
import torch

from rlhf_core.rl import losses


def t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_reduce_tokens_token_vs_sequence():
    """values [[1,2],[3,0]], mask [[1,1],[1,0]]: token = (1+2+3)/3 = 2; sequence = (1.5 + 3)/2 = 2.25."""
    v, m = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    assert losses.reduce_tokens(v, m, "token").item() == pytest.approx(2.0)
    assert losses.reduce_tokens(v, m, "sequence").item() == pytest.approx(2.25)
    with pytest.raises(ValueError, match="unknown reduction"):
        losses.reduce_tokens(v, m, "batch")


def test_token_logprobs():
    """Uniform logits over V=4: every log-prob is log(1/4)."""
    logits = torch.zeros(1, 3, 4)
    ids = torch.tensor([[0, 1, 2]])
    lp = losses.token_logprobs(logits, ids)
    assert lp.shape == (1, 2)
    assert torch.allclose(lp, torch.full((1, 2), math.log(0.25)))
    # a peaked logit: logits [0, ln 3, 0, 0] -> p(token 1) = 3/6 = 0.5
    logits2 = torch.zeros(1, 2, 4)
    logits2[0, 0, 1] = math.log(3)
    assert losses.token_logprobs(logits2, torch.tensor([[0, 1]])).item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_sft_loss_is_token_level():
    """sums [-6, -2] over [3, 1] tokens: shares 6/4, 2/4 = [1.5, 0.5], batch loss 8/4 = 2.0 (token-level; the
    sequence-level mean of 2.0 and 2.0 would also be 2.0, so a third: sum -1 over 4 tokens -> 9/8 = 1.125
    token-level vs (2 + 2 + 0.25)/3 = 1.4167 sequence-level)."""
    out = losses.sft_loss(t(-6, -2), torch.tensor([3, 1]))
    assert out.losses.tolist() == pytest.approx([1.5, 0.5])
    assert out.metrics["nll"].tolist() == pytest.approx([2.0, 2.0])
    assert losses.sft_loss(t(-6, -2, -1), torch.tensor([3, 1, 4])).losses.sum().item() == pytest.approx(1.125)


def test_pairwise_rm_loss():
    """r_c=2, r_r=1: -log sigmoid(1) = log(1+e^-1) = 0.313262; margin 1: -log sigmoid(0) = log 2;
    r_c=0, r_r=1: accuracy 0, loss log(1+e^1) = 1.313262. logexp equals sigmoid without margin."""
    out = losses.pairwise_rm_loss(t(2, 0), t(1, 1))
    assert out.losses.tolist() == pytest.approx([0.313262, 1.313262], abs=1e-6)
    assert out.metrics["accuracy"].tolist() == [1.0, 0.0]
    assert out.metrics["reward_margin"].tolist() == [1.0, -1.0]
    with_margin = losses.pairwise_rm_loss(t(2), t(1), margin=t(1))
    assert with_margin.losses.item() == pytest.approx(math.log(2))
    assert losses.pairwise_rm_loss(t(2, 0), t(1, 1), kind="logexp").losses.tolist() == pytest.approx([0.313262, 1.313262], abs=1e-6)
    with pytest.raises(ValueError, match="unknown reward-model loss"):
        losses.pairwise_rm_loss(t(1), t(0), kind="hinge")
    with pytest.raises(ValueError, match="logexp reward-model loss takes no margin"):
        losses.pairwise_rm_loss(t(1), t(0), margin=t(1), kind="logexp")


def test_logexp_rm_loss_is_finite_for_large_margins():
    """logexp = log(1 + exp(r_r - r_c)) = softplus(r_r - r_c). float32, as the trainer runs it:
    r_r - r_c = 100: log(1 + e^100) = 100 + log(1 + e^-100) = 100.0 (log1p(exp(100)) was inf);
    gradient d/dr_c = -sigmoid(100) = -1, d/dr_r = 1 (was NaN).
    r_r - r_c = 0: ln 2 = 0.693147, gradient -1/2, 1/2."""
    chosen = torch.tensor([0.0, 0.0], requires_grad=True)
    rejected = torch.tensor([100.0, 0.0], requires_grad=True)
    out = losses.pairwise_rm_loss(chosen, rejected, kind="logexp")
    assert out.losses.tolist() == pytest.approx([100.0, math.log(2)], abs=1e-6)
    gc, gr = torch.autograd.grad(out.losses.sum(), (chosen, rejected))
    assert gc.tolist() == pytest.approx([-1.0, -0.5]) and gr.tolist() == pytest.approx([1.0, 0.5])


def test_dpo_sigmoid_ipo_cdpo():
    """pc=-1, pr=-3, rc=-2, rr=-2, beta=0.5: h = (-1+3) - 0 = 2, beta h = 1.
    sigmoid: -log sigmoid(1) = 0.313262; cDPO eps=0.1: 0.9*0.313262 + 0.1*1.313262 = 0.413262;
    ipo: (2 - 1/(2*0.5))^2 = 1; rewards 0.5*(-1+2) = 0.5 and 0.5*(-3+2) = -0.5, margin 1, accuracy 1."""
    args = (t(-1), t(-3), t(-2), t(-2))
    s = losses.dpo_loss(*args, beta=0.5)
    assert s.losses.item() == pytest.approx(0.313262, abs=1e-6)
    assert s.metrics["chosen_reward"].item() == pytest.approx(0.5)
    assert s.metrics["rejected_reward"].item() == pytest.approx(-0.5)
    assert s.metrics["reward_margin"].item() == pytest.approx(1.0)
    assert s.metrics["reward_accuracy"].item() == 1.0
    assert losses.dpo_loss(*args, beta=0.5, label_smoothing=0.1).losses.item() == pytest.approx(0.413262, abs=1e-6)
    assert losses.dpo_loss(*args, beta=0.5, loss_type="ipo").losses.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        losses.dpo_loss(*args, beta=0.0)
    with pytest.raises(ValueError, match="unknown DPO loss type"):
        losses.dpo_loss(*args, beta=0.5, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing .* sigmoid loss only, not ipo"):
        losses.dpo_loss(*args, beta=0.5, loss_type="ipo", label_smoothing=0.1)


def test_dpo_gradient_flows_only_through_policy():
    pc = torch.tensor([-1.0], requires_grad=True)
    out = losses.dpo_loss(pc, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    out.losses.sum().backward()
    # d/dpc -log sigmoid(beta h) = -beta * (1 - sigmoid(1)) = -0.5 * 0.268941 = -0.134471
    assert pc.grad.item() == pytest.approx(-0.134471, abs=1e-6)
    assert not out.metrics["chosen_reward"].requires_grad


def test_nll_per_token():
    """sum logp -6 over 3 tokens -> 2.0."""
    assert losses.nll_per_token(t(-6), torch.tensor([3])).item() == pytest.approx(2.0)


def test_kto_loss_hand_values():
    """beta 0.5, z0 = 0. Desirable r = 2 (policy -1, ref -3): 1 - sigmoid(1) = 0.268941.
    Undesirable r = 2, w_U = 2: 2 (1 - sigmoid(-1)) = 2 * 0.731059 = 1.462117.
    Undesirable r = -2: 2 (1 - sigmoid(1)) = 0.537883. Implied rewards 0.5 r = 1, 1, -1."""
    out = losses.kto_loss(t(-1, -1, -5), t(-3, -3, -3), torch.tensor([True, False, False]), 0.0, beta=0.5,
                          undesirable_weight=2.0)
    assert out.losses.tolist() == pytest.approx([0.268941, 1.462117, 0.537883], abs=1e-6)
    assert out.metrics["reward"].tolist() == pytest.approx([1.0, 1.0, -1.0])
    assert out.metrics["desirable_reward"].tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert out.metrics["undesirable_reward"].tolist() == pytest.approx([0.0, 1.0, -1.0])


def test_kto_reference_point_from_mismatched_pairs():
    """z0 = mean(pi - ref) over mismatched pairs: policy [-2, -2], ref [-3, -4] -> mean(1, 2) = 1.5.
    Desirable r = 2, beta 1: 1 - sigmoid(2 - 1.5) = 1 - sigmoid(0.5) = 0.377541; undesirable r = 2:
    1 - sigmoid(1.5 - 2) = sigmoid(0.5) = 0.622459. A negative estimate is clamped to 0: policy [-4], ref [-3]
    -> kl -1, loss as with z0 = 0: 1 - sigmoid(2) = 0.119203. No gradient flows into z0."""
    pk = t(-2, -2).requires_grad_()
    kl = losses.kto_kl(pk, t(-3, -4))
    assert kl.item() == pytest.approx(1.5) and not kl.requires_grad
    out = losses.kto_loss(t(-1, -1), t(-3, -3), torch.tensor([True, False]), kl, beta=1.0)
    assert out.losses.tolist() == pytest.approx([0.377541, 0.622459], abs=1e-6)
    assert out.metrics["kl"].tolist() == pytest.approx([1.5, 1.5])
    neg = losses.kto_loss(t(-1), t(-3), torch.tensor([True]), losses.kto_kl(t(-4), t(-3)), beta=1.0)
    assert neg.losses.item() == pytest.approx(0.119203, abs=1e-6)
    with pytest.raises(ValueError, match="beta must be > 0"):
        losses.kto_loss(t(-1), t(-1), torch.tensor([True]), 0.0, beta=0.0)


def test_kto_gradient_raises_desirable_and_lowers_undesirable():
    """d loss / d log pi < 0 for a desirable example (raising it lowers the loss), > 0 for an undesirable one."""
    p = t(-2, -2).requires_grad_()
    losses.kto_loss(p, t(-2, -2), torch.tensor([True, False]), 0.0, beta=0.1).losses.sum().backward()
    assert p.grad[0] < 0 < p.grad[1]


def test_distill_loss_hand_values():
    """teacher p = [.5, .5]; student p = [.25, .75]: ce = -(.5 log .25 + .5 log .75) = 0.836988,
    KL(teacher || student) = ce - log 2 = 0.143841; a student equal to its teacher has KL 0; a -inf student
    logit where the teacher puts no mass counts 0 (not NaN); the gradient reaches the student only."""
    s = torch.tensor([[math.log(.25), math.log(.75)], [1.0, -2.0], [0.0, -math.inf]], requires_grad=True)
    t = torch.tensor([[0.0, 0.0], [1.0, -2.0], [0.0, -math.inf]], requires_grad=True)
    ce, kl = losses.distill_loss(s, t)
    assert ce[0].item() == pytest.approx(0.836988, abs=1e-6) and kl[0].item() == pytest.approx(0.143841, abs=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-6) and ce[2].item() == pytest.approx(0.0, abs=1e-6)
    ce.sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all() and t.grad is None and not kl.requires_grad
