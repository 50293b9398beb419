"""Online-RL math against hand-computed values (arithmetic in each docstring)."""
import math

import pytest
import torch

from rlhf_core import rl_math as rm


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_kl_estimators():
    """d = log 2: k1 = 0.693147; k2 = 0.693147^2 / 2 = 0.240227; k3 = e^-d - 1 + d = 0.5 - 1 + 0.693147 = 0.193147.
    d = 0: all three are 0."""
    lp, ref = t([math.log(2), 0.0]), t([0.0, 0.0])
    assert rm.kl_estimate(lp, ref, "k1")[0].tolist() == pytest.approx([0.693147, 0.0], abs=1e-6)
    assert rm.kl_estimate(lp, ref, "k2")[0].tolist() == pytest.approx([0.240227, 0.0], abs=1e-6)
    assert rm.kl_estimate(lp, ref, "k3")[0].tolist() == pytest.approx([0.193147, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="unknown kl_estimator"):
        rm.kl_estimate(lp, ref, "k4")


def test_token_rewards_put_score_on_last_action_token():
    """score 1, kl [0.1, 0.2, 0.3], coef 0.5, mask [1, 1, 0]: [-0.05, -0.1 + 1, 0] = [-0.05, 0.9, 0].
    score 5 clipped to (-2, 2) on a 1-token response: [2, 0, 0]."""
    r = rm.token_rewards(t(1.0, 5.0), t([0.1, 0.2, 0.3], [0.0, 0.0, 0.0]), t([1, 1, 0], [1, 0, 0]), 0.5, (-2, 2))
    assert r[0].tolist() == pytest.approx([-0.05, 0.9, 0.0])
    assert r[1].tolist() == pytest.approx([2.0, 0.0, 0.0])


def test_group_baselines():
    """One group [1, 2, 3, 6]: mean 3; reinforce_baseline / dr_grpo [-2, -1, 0, 3];
    rloo r_i - mean of the others: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3 = [-2.6667, -1.3333, 0, 4];
    group_norm: std (Bessel) = sqrt((4 + 1 + 0 + 9) / 3) = 2.160247 -> [-0.925820, -0.462910, 0, 1.388730].
    Two groups of 2 ([0, 1], [5, 5]): group_norm [-0.7071, 0.7071, 0, 0] (std 0 -> 0 / eps = 0)."""
    s = t(1.0, 2.0, 3.0, 6.0)
    assert rm.shape_scores(s, 4, "reinforce_baseline").tolist() == pytest.approx([-2, -1, 0, 3])
    assert rm.shape_scores(s, 4, "dr_grpo").tolist() == pytest.approx([-2, -1, 0, 3])
    assert rm.shape_scores(s, 4, "rloo").tolist() == pytest.approx([-8 / 3, -4 / 3, 0, 4], abs=1e-6)
    assert rm.shape_scores(s, 4, "group_norm").tolist() == pytest.approx([-0.925820, -0.462910, 0, 1.388730], abs=1e-6)
    assert rm.shape_scores(t(0.0, 1.0, 5.0, 5.0), 2, "group_norm").tolist() == pytest.approx([-0.707107, 0.707107, 0, 0], abs=1e-6)
    assert rm.shape_scores(s, 4, "reinforce").tolist() == s.tolist()
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        rm.shape_scores(s, 1, "rloo")
    with pytest.raises(ValueError, match="unknown advantage_estimator"):
        rm.shape_scores(s, 4, "ppo2")


def test_discounted_returns_and_gae():
    """returns of r [-0.05, 0.9]: gamma 1 [0.85, 0.9]; gamma 0.5 [-0.05 + 0.45, 0.9] = [0.4, 0.9].
    GAE r [0, 1], V [0.5, 0.2], gamma 1, lambda 0.5: delta = [0 + 0.2 - 0.5, 1 + 0 - 0.2] = [-0.3, 0.8];
    A = [-0.3 + 0.5 * 0.8, 0.8] = [0.1, 0.8]; returns = A + V = [0.6, 1.0]. A padded token stays 0."""
    mask = t([1, 1, 0])
    assert rm.discounted_returns(t([-0.05, 0.9, 0.0]), mask, 1.0)[0].tolist() == pytest.approx([0.85, 0.9, 0])
    assert rm.discounted_returns(t([-0.05, 0.9, 0.0]), mask, 0.5)[0].tolist() == pytest.approx([0.4, 0.9, 0])
    adv, ret = rm.gae(t([0.0, 1.0, 7.0]), t([0.5, 0.2, 9.0]), mask, gamma=1.0, lambd=0.5)
    assert adv[0].tolist() == pytest.approx([0.1, 0.8, 0.0])
    assert ret[0].tolist() == pytest.approx([0.6, 1.0, 0.0])


def test_whiten_and_reinforce_pp_pipeline():
    """whiten [1, 3, (pad 100)]: mean 2, var 1 -> [-1, 1, 0].
    REINFORCE++ on scores [1, 0] with kl [[0.2, 0.2], [0, 0]], coef 0.5, mask all 1, gamma 1:
    token rewards [[-0.1, 0.9], [0, 0]] -> returns [[0.8, 0.9], [0, 0]]; whitened over 4 tokens:
    mean 0.425, var (0.375^2 + 0.475^2 + 2 * 0.425^2) / 4 = (0.140625 + 0.225625 + 0.36125) / 4 = 0.181875,
    std 0.426468 -> [[0.879315, 1.113800], [-0.996557, -0.996557]]."""
    assert rm.whiten(t([1.0, 3.0, 100.0]), t([1, 1, 0]))[0].tolist() == pytest.approx([-1, 1, 0], abs=1e-6)
    adv, ret = rm.advantages_and_returns("reinforce", t(1.0, 0.0), t([1, 1], [1, 1]), 1, t([0.2, 0.2], [0, 0]), 0.5)
    assert ret.flatten().tolist() == pytest.approx([0.8, 0.9, 0, 0])
    assert adv.flatten().tolist() == pytest.approx([0.879315, 1.113800, -0.996557, -0.996557], abs=1e-5)


def test_grpo_pipeline_is_not_whitened_and_gae_needs_values():
    """group_norm on one group [0, 1] (n 2), no KL, 2 tokens each: scores -> [-0.7071, 0.7071], placed on the last
    token; returns with gamma 1 broadcast back: [[-0.7071, -0.7071], [0.7071, 0.7071]] = advantages (no whitening)."""
    adv, _ = rm.advantages_and_returns("group_norm", t(0.0, 1.0), t([1, 1], [1, 1]), 2, torch.zeros(2, 2), 0.0)
    assert adv.flatten().tolist() == pytest.approx([-0.707107, -0.707107, 0.707107, 0.707107], abs=1e-6)
    with pytest.raises(ValueError, match="critic's values"):
        rm.advantages_and_returns("gae", t(0.0, 1.0), t([1, 1], [1, 1]), 1, torch.zeros(2, 2), 0.0)


def test_policy_loss_clip_asymmetric_dual():
    """ratio 2 (logp - old = ln 2), eps 0.2: A = 1: -min(2, 1.2) = -1.2; A = -1: -min(-2, -1.2) = 2.
    Asymmetric eps_high 0.28, A = 1: -min(2, 1.28) = -1.28.
    ratio 4, A = -1: -min(-4, -1.2) = 4; dual_clip 3 caps it: 3.
    Token mean of [-1.2, 2] = 0.4; both clipped (surr2 < surr1 for A=1: 1.2 < 2; for A=-1: -2 < -1.2? no) -> 0.5."""
    lp = t([math.log(2), math.log(2)])
    loss, met = rm.policy_loss(lp, torch.zeros_like(lp), t([1.0, -1.0]), t([1, 1]))
    assert loss.item() == pytest.approx(0.4)
    assert met["clip_ratio"].item() == pytest.approx(0.5)
    asym, _ = rm.policy_loss(lp[:, :1], torch.zeros(1, 1, dtype=torch.float64), t([1.0]), t([1]), 0.2, 0.28)
    assert asym.item() == pytest.approx(-1.28)
    four = t([math.log(4)])
    assert rm.policy_loss(four, torch.zeros_like(four), t([-1.0]), t([1]))[0].item() == pytest.approx(4.0)
    assert rm.policy_loss(four, torch.zeros_like(four), t([-1.0]), t([1]), dual_clip=3.0)[0].item() == pytest.approx(3.0)


def test_policy_loss_gradient_and_aggregations():
    """At ratio 1 the gradient of -ratio * A w.r.t. logp is -A / (#tokens) under token mean:
    A = [[1, 2], [3, 0(pad)]]: d/dlogp = [[-1/3, -2/3], [-1, 0]].
    Aggregations of values [[1, 2], [3, 0]], mask [[1, 1], [1, 0]]: token 2.0, sequence 2.25,
    seq-sum-norm with max_len 4: ((1 + 2) / 4 + 3 / 4) / 2 = 0.75."""
    lp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    adv, mask = t([1.0, 2.0], [3.0, 0.0]), t([1, 1], [1, 0])
    loss, _ = rm.policy_loss(lp, torch.zeros(2, 2, dtype=torch.float64), adv, mask)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 3, -2 / 3, -1, 0])
    v = t([1.0, 2.0], [3.0, 0.0])
    assert rm.aggregate(v, mask, "token").item() == pytest.approx(2.0)
    assert rm.aggregate(v, mask, "sequence").item() == pytest.approx(2.25)
    assert rm.aggregate(v, mask, "seq-sum-norm", max_len=4).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="max_len"):
        rm.aggregate(v, mask, "seq-sum-norm")


def test_value_loss_clipped():
    """V 1.0, V_old 0.5, R 0.0, clip 0.2: clipped V = 0.7; max(1.0, 0.49) / 2 = 0.5. R 2.0: max(1.0, 1.69) / 2 = 0.845.
    Unclipped, R 2.0: 1.0 / 2 = 0.5."""
    v, old, m = t([1.0]), t([0.5]), t([1])
    assert rm.value_loss(v, old, t([0.0]), m, clip=0.2).item() == pytest.approx(0.5)
    assert rm.value_loss(v, old, t([2.0]), m, clip=0.2).item() == pytest.approx(0.845)
    assert rm.value_loss(v, old, t([2.0]), m).item() == pytest.approx(0.5)


def test_entropy():
    """Uniform over 4: ln 4 = 1.386294; a one-hot-like distribution (logit 100) ~ 0."""
    logits = torch.zeros(1, 2, 4)
    logits[0, 1, 2] = 100.0
    assert rm.entropy(logits)[0].tolist() == pytest.approx([1.386294, 0.0], abs=1e-5)


def test_kl_controllers():
    """Adaptive: coef 0.1, target 1, horizon 10, KL 2 over 5 steps: err = clip(2 - 1) = 0.2,
    coef = 0.1 * (1 + 0.2 * 5 / 10) = 0.11; then KL 0.5: err -0.5 -> -0.2: 0.11 * (1 - 0.1) = 0.099. Fixed: unchanged."""
    c = rm.KLController(0.1, target=1.0, horizon=10)
    c.update(2.0, 5)
    assert c.value == pytest.approx(0.11)
    c.update(0.5, 5)
    assert c.value == pytest.approx(0.099)
    f = rm.KLController(0.1)
    f.update(100.0, 5)
    assert f.value == 0.1


def test_running_moments():
    """Batches [1, 3] then [5]: count 3, mean 3, sum of squared deviations 4 + 0 + 4 = 8, std sqrt(8 / 2) = 2;
    normalising 5 gives (5 - 3) / 2 = 1."""
    rmo = rm.RunningMoments()
    rmo.update(t(1.0, 3.0))
    rmo.update(t(5.0))
    assert (rmo.count, rmo.mean, rmo.m2) == (3, pytest.approx(3.0), pytest.approx(8.0))
    assert rmo.std == pytest.approx(2.0)
    assert rmo.normalize(t(5.0)).item() == pytest.approx(1.0)


def test_rollout_is_weight_tis_and_icepop():
    """old - rollout = [ln 0.25, 0, ln 3, ln 8] -> rho [0.25, 1, 3, 8]; window [0.5, 5]:
    TIS clamps: [0.5, 1, 3, 5]; ICEPOP zeroes outside: [0, 1, 3, 0]; TIS with low 0, C = 2 (min(rho, C)):
    [0.25, 1, 2, 2]."""
    old = t([math.log(0.25), 0.0, math.log(3), math.log(8)])
    roll = torch.zeros_like(old)
    assert rm.rollout_is_weight(old, roll, 0.5, 5.0)[0].tolist() == pytest.approx([0.5, 1, 3, 5])
    assert rm.rollout_is_weight(old, roll, 0.5, 5.0, icepop=True)[0].tolist() == pytest.approx([0, 1, 3, 0])
    assert rm.rollout_is_weight(old + 1.0, roll + 1.0, 0.0, 2.0)[0].tolist() == pytest.approx([0.25, 1, 2, 2])


def test_policy_loss_with_is_weight():
    """ratio 1 (logp = old), A = [1, -2], weights [0.5, 0] (an ICEPOP-masked second token): per-token losses
    [-1, 2] -> weighted [-0.5, 0]; token mean over the 2 masked-in tokens: -0.25 (unweighted: 0.5). The gradient
    of the zero-weight token is 0."""
    logp = t([0.0, 0.0]).requires_grad_()
    loss, _ = rm.policy_loss(logp, t([0.0, 0.0]), t([1.0, -2.0]), t([1.0, 1.0]), 0.2,
                             is_weight=t([0.5, 0.0]))
    assert loss.item() == pytest.approx(-0.25)
    loss.backward()
    assert logp.grad[0, 1].item() == 0 and logp.grad[0, 0].item() == pytest.approx(-0.25)
    assert rm.policy_loss(t([0.0, 0.0]), t([0.0, 0.0]), t([1.0, -2.0]), t([1.0, 1.0]))[0].item() == pytest.approx(0.5)
