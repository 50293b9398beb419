"""Online-RL math against hand-computed values (arithmetic in each docstring)."""
import math

import pytest
import torch

from rlhf_core.rl import rl_math as rm


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
    Two groups of 2 ([0, 1], [5, 5]): group_norm [-0.7071, 0.7071, 0, 0] (std 0 -> the zero-std guard: 0)."""
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


GROUPED = ("group_norm", "rloo", "reinforce_baseline", "dr_grpo")


def test_equal_reward_groups_get_exactly_zero():
    """A group of 8 equal rewards has std 0 and carries no signal: every grouped estimator gives exactly 0
    (GRPO (r - mean) / (std + eps) = 0 / eps = 0; RLOO r - mean of the others = 0; baseline r - mean = 0).
    float32 inputs, as the loop passes them: the float32 mean of eight 0.7s (or -1.234s) is an ulp off, which
    group_norm divided by a ~0 std (|A| 0.9 to 60) and the others left as 6e-8 / 1.2e-7.
    The binary (verifier) cases: all 0 or all 1 -> 0; a mixed group of 0/1 [1, 0, 0, 0, 0, 0, 0, 1] next to an
    equal group keeps its signal: mean 0.25, std (Bessel) sqrt((2 * 0.75^2 + 6 * 0.25^2) / 7) = sqrt(1.5 / 7)
    = 0.462910 -> 1: 0.75 / 0.462910 = 1.620185, 0: -0.25 / 0.462910 = -0.540062. Output float32."""
    for value in (0.7, -1.234, 0.0, 1.0):
        s = torch.full((8,), value, dtype=torch.float32)
        for est in GROUPED:
            out = rm.shape_scores(s, 8, est)
            assert out.dtype == torch.float32 and out.tolist() == [0.0] * 8, (value, est, out.tolist())
    mixed = torch.tensor([0.7] * 8 + [1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.float32)
    gn = rm.shape_scores(mixed, 8, "group_norm")
    assert gn[:8].tolist() == [0.0] * 8
    assert gn[8:].tolist() == pytest.approx([1.620185] + [-0.540062] * 6 + [1.620185], abs=1e-6)
    # through the pipeline (reinforce_baseline is whitened too: mean 0, var 0 floored -> 0)
    mask = torch.ones(8, 3)
    for est in GROUPED:
        adv, _ = rm.advantages_and_returns(est, torch.full((8,), 0.7), mask, 8, torch.zeros(8, 3), 0.0)
        assert adv.abs().max().item() == 0.0, est


def test_kl_estimate_is_clamped_like_openrlhf():
    """OpenRLHF's compute_approx_kl clamps the estimate to [-10, 10] (verl's low_var_kl too). By hand:
    d = -30: k1 = -30 -> -10; k2 = 450 -> 10; k3 = e^30 - 1 - 30 -> 10.
    d = -10: k1 -10; k2 = 50 -> 10; k3 = e^10 - 1 - 10 = 22015.47 -> 10.
    d = -2 (inside): k1 -2, k2 2, k3 = e^2 - 1 - 2 = 4.389056.
    d = 10: k1 10; k2 50 -> 10; k3 = e^-10 - 1 + 10 = 9.000045 (below the clamp).
    d = 30: k1 30 -> 10; k2 450 -> 10; k3 = e^-30 - 1 + 30 = 29 -> 10.
    Unclamped, k3 at d = -30 was e^30 = 1.07e13 per token (and inf past d = -88.7 in float32).
    The gradient stays finite where exp(-d) overflows float32 (d = -100): the clamped estimate passes 0, not
    0 * inf = NaN; inside the window d k3 / d logp = 1 - e^-d = 1 - e^2 = -6.389056 at d = -2."""
    d = torch.tensor([[-30.0, -10.0, -2.0, 10.0, 30.0]])
    ref = torch.zeros_like(d)
    assert rm.kl_estimate(d, ref, "k1")[0].tolist() == pytest.approx([-10, -10, -2, 10, 10])
    assert rm.kl_estimate(d, ref, "k2")[0].tolist() == pytest.approx([10, 10, 2, 10, 10])
    assert rm.kl_estimate(d, ref, "k3")[0].tolist() == pytest.approx([10, 10, 4.389056, 9.000045, 10], abs=1e-5)
    lp = torch.tensor([[-100.0, -2.0, 100.0]], requires_grad=True)
    for kind in ("k1", "k2", "k3"):
        kl = rm.kl_estimate(lp, torch.zeros(1, 3), kind)
        (g,) = torch.autograd.grad(kl.sum(), lp)
        assert torch.isfinite(kl).all() and torch.isfinite(g).all(), kind
        assert g[0, 0].item() == 0.0 and g[0, 2].item() == 0.0, kind  # past the clamp: no gradient
    (g,) = torch.autograd.grad(rm.kl_estimate(lp, torch.zeros(1, 3), "k3").sum(), lp)
    assert g[0, 1].item() == pytest.approx(1 - math.exp(2), abs=1e-5)


def test_policy_loss_log_ratio_clamped_to_20():
    """OpenRLHF's PolicyLoss and verl clamp logp - old_logp to [-20, 20] before exp. float32, eps 0.2, one token:
    log-ratio 100, A = -1: ratio e^20 = 485165195.4; -min(-e^20, -1.2) = e^20 (unclamped: exp(100) = inf in
    float32, loss inf); gradient 0 (past the clamp) instead of NaN.
    log-ratio 100, A = 1: -min(e^20, 1.2) = -1.2; gradient 0 (unclamped: 0 * inf = NaN).
    log-ratio -100, A = 1: ratio e^-20 = 2.061154e-9; -min(e^-20, 0.8) = -2.061154e-9; gradient 0.
    log-ratio 19 (inside), A = -1: loss e^19 = 178482301.0 and d loss / d logp = -A * ratio = e^19."""
    def run(log_ratio, a):
        lp = torch.tensor([[log_ratio]], requires_grad=True)
        loss, _ = rm.policy_loss(lp, torch.zeros(1, 1), torch.tensor([[a]]), torch.ones(1, 1))
        (g,) = torch.autograd.grad(loss, lp)
        return loss.item(), g.item()

    assert run(100.0, -1.0) == (pytest.approx(math.exp(20), rel=1e-6), 0.0)
    assert run(100.0, 1.0) == (pytest.approx(-1.2), 0.0)
    assert run(-100.0, 1.0) == (pytest.approx(-math.exp(-20), rel=1e-5), 0.0)
    assert run(-100.0, -1.0) == (pytest.approx(0.8), 0.0)  # -min(-e^-20, -0.8) = 0.8, clip branch
    loss, g = run(19.0, -1.0)
    assert loss == pytest.approx(math.exp(19), rel=1e-6) and g == pytest.approx(math.exp(19), rel=1e-6)


def test_reward_clip_applies_to_the_shaped_score():
    """OpenRLHF's compute_reward clamps the reward it is given, which is already the group-shaped one.
    rloo on [2, 5] (n 2), clip (-1, 1), one token each, no KL: shaped [2 - 5, 5 - 2] = [-3, 3] -> [-1, 1]
    (clipping the raw scores first gave [1, 1] -> [0, 0]: no signal).
    group_norm on [1, 2, 3, 6], clip (-1, 1): [-0.925820, -0.462910, 0, 1.388730] -> [..., 1.0]
    (raw-first gave [1, 1, 1, 1] -> 0)."""
    mask = torch.ones(2, 1)
    adv, ret = rm.advantages_and_returns("rloo", t(2.0, 5.0), mask, 2, torch.zeros(2, 1), 0.0, reward_clip=(-1.0, 1.0))
    assert adv.flatten().tolist() == pytest.approx([-1.0, 1.0]) and ret.flatten().tolist() == pytest.approx([-1.0, 1.0])
    adv, _ = rm.advantages_and_returns("group_norm", t(1.0, 2.0, 3.0, 6.0), torch.ones(4, 1), 4, torch.zeros(4, 1),
                                       0.0, reward_clip=(-1.0, 1.0))
    assert adv.flatten().tolist() == pytest.approx([-0.925820, -0.462910, 0.0, 1.0], abs=1e-6)


def test_grouped_estimators_refuse_gamma_below_one():
    """The grouped baselines compare whole-sequence scores: OpenRLHF resets gamma to 1 for rloo /
    reinforce_baseline / group_norm / dr_grpo; here gamma 0.9 is refused, naming the estimator and gamma.
    gae and reinforce take gamma 0.9: returns of one token with reward 1 = 1."""
    args = (t(0.0, 1.0), torch.ones(2, 1), 2, torch.zeros(2, 1), 0.0)
    for est in GROUPED:
        with pytest.raises(ValueError, match=rf"{est} needs gamma = 1.*gamma = 0\.9"):
            rm.advantages_and_returns(est, *args, gamma=0.9)
    _, ret = rm.advantages_and_returns("reinforce", *args, gamma=0.9)
    assert ret.flatten().tolist() == pytest.approx([0.0, 1.0])


def test_whiten_variance_floor_and_mean_only():
    """OpenRLHF's advantage normalisation: (x - mean) * rsqrt(clamp(var, min=1e-8)), population variance.
    [0, 2e-4]: mean 1e-4, var 1e-8 -> +-1e-4 * 1e4 = [-1, 1] (the old var + eps form: +-1e-4 / sqrt(2e-8) = 0.7071);
    [0, 2e-5]: var 1e-10 is floored at 1e-8 -> +-1e-5 * 1e4 = [-0.1, 0.1].
    std_norm=False (--no_advantage_std_norm) subtracts the mean only: [1, 5, (pad 100)] -> [-2, 2, 0].
    REINFORCE++ with std_norm=False (scores [1, 0], kl 0.2 on row 0, coef 0.5): returns [[0.8, 0.9], [0, 0]],
    mean 0.425 -> [[0.375, 0.475], [-0.425, -0.425]]; the grouped estimators are never whitened."""
    assert rm.whiten(t([0.0, 2e-4]), t([1, 1]))[0].tolist() == pytest.approx([-1, 1], abs=1e-9)
    assert rm.whiten(t([0.0, 2e-5]), t([1, 1]))[0].tolist() == pytest.approx([-0.1, 0.1], abs=1e-9)
    assert rm.whiten(t([1.0, 5.0, 100.0]), t([1, 1, 0]), std_norm=False)[0].tolist() == pytest.approx([-2, 2, 0])
    adv, _ = rm.advantages_and_returns("reinforce", t(1.0, 0.0), t([1, 1], [1, 1]), 1, t([0.2, 0.2], [0, 0]), 0.5,
                                       std_norm=False)
    assert adv.flatten().tolist() == pytest.approx([0.375, 0.475, -0.425, -0.425], abs=1e-6)


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
    # a gap of 100 overflows float32 (rho = inf): TIS clamps it to high, ICEPOP masks it to 0 (inf * 0 was NaN)
    far = torch.tensor([[100.0, 0.0]])
    assert rm.rollout_is_weight(far, torch.zeros(1, 2), 0.5, 5.0)[0].tolist() == [5.0, 1.0]
    assert rm.rollout_is_weight(far, torch.zeros(1, 2), 0.5, 5.0, icepop=True)[0].tolist() == [0.0, 1.0]


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


# ---------------------------------------------------------------------------------------------- issue 37: OpenRLHF's
def test_sequence_mean_drops_rows_without_action_tokens():
    """values [[1, 2], [3, 0], [5, 5]], mask [[1, 1], [1, 0], [0, 0]] (row 3: an episode of feedback tokens only):
    sequence drop: row means 1.5, 3 (row 3 has none) -> (1.5 + 3) / 2 = 2.25 (OpenRLHF v0.11's aggregate_loss);
    zero: (1.5 + 3 + 0) / 3 = 1.5; token: (1 + 2 + 3) / 3 = 2 either way; seq-sum-norm (max_len 4) counts every
    row: (3/4 + 3/4 + 0) / 3 = 0.5. Every row empty: 0 (not NaN). Gradient of sequence drop w.r.t. values:
    row 1 1/(2*2) = 0.25 per token, row 2 1/(1*2) = 0.5, padding and the empty row 0."""
    v = t([1.0, 2.0], [3.0, 0.0], [5.0, 5.0]).requires_grad_()
    m = t([1, 1], [1, 0], [0, 0])
    drop = rm.aggregate(v, m, "sequence")
    assert drop.item() == pytest.approx(2.25)
    assert rm.aggregate(v, m, "sequence", empty_rows="zero").item() == pytest.approx(1.5)
    assert rm.aggregate(v, m, "token").item() == pytest.approx(2.0)
    assert rm.aggregate(v, m, "token", empty_rows="zero").item() == pytest.approx(2.0)
    assert rm.aggregate(v, m, "seq-sum-norm", max_len=4).item() == pytest.approx(0.5)
    drop.backward()
    assert v.grad.flatten().tolist() == pytest.approx([0.25, 0.25, 0.5, 0.0, 0.0, 0.0])
    assert rm.aggregate(v, torch.zeros_like(m), "sequence").item() == 0.0
    with pytest.raises(ValueError, match="unknown empty_rows"):
        rm.aggregate(v, m, "sequence", empty_rows="skip")
    # the policy and value losses pass it on: advantages [[1, 1], [2, 0], [9, 9]] at ratio 1 -> per-token loss -A;
    # sequence drop: (-1 + -2) / 2 = -1.5; zero: -3 / 3 = -1
    adv, z = t([1.0, 1.0], [2.0, 0.0], [9.0, 9.0]), torch.zeros(3, 2, dtype=torch.float64)
    assert rm.policy_loss(z, z, adv, m, mode="sequence")[0].item() == pytest.approx(-1.5)
    assert rm.policy_loss(z, z, adv, m, mode="sequence", empty_rows="zero")[0].item() == pytest.approx(-1.0)
    # 0.5 (V - R)^2 with V 0, R = adv: row means 1, 4 -> 0.5 * (1 + 4) / 2 = 1.25; zero: 0.5 * 5 / 3
    assert rm.value_loss(z, z, adv, m, mode="sequence").item() == pytest.approx(1.25)
    assert rm.value_loss(z, z, adv, m, mode="sequence", empty_rows="zero").item() == pytest.approx(5 / 6)


def test_kl_loss_is_the_token_mean_whatever_the_policy_reduction():
    """OpenRLHF's ppo_actor: kl_loss = masked_mean(kl, action_mask). d = logp - ref = [[ln 2, ln 2, ln 2, ln 2],
    [ln 4, 0, 0, 0]] with mask [[1, 1, 1, 1], [1, 0, 0, 0]], k1: token (4 ln 2 + 2 ln 2) / 5 = 6 ln 2 / 5 = 0.831777;
    sequence (ln 2 + 2 ln 2) / 2 = 1.039721; seq-sum-norm with max_len 8: (4 ln 2 / 8 + 2 ln 2 / 8) / 2 = 0.259930.
    The default is the token mean."""
    ln2 = math.log(2)
    lp, ref = t([ln2] * 4, [2 * ln2, 0.0, 0.0, 0.0]), torch.zeros(2, 4, dtype=torch.float64)
    m = t([1, 1, 1, 1], [1, 0, 0, 0])
    assert rm.kl_loss(lp, ref, m).item() == pytest.approx(6 * ln2 / 5)
    assert rm.kl_loss(lp, ref, m, "k1", "sequence").item() == pytest.approx(1.5 * ln2)
    assert rm.kl_loss(lp, ref, m, "k1", "seq-sum-norm", max_len=8).item() == pytest.approx(6 * ln2 / 16)
    # k2 = d^2 / 2: token (4 * ln2^2 / 2 + (2 ln2)^2 / 2) / 5 = (2 + 2) ln2^2 / 5 = 0.384362
    assert rm.kl_loss(lp, ref, m, "k2").item() == pytest.approx(4 * ln2 ** 2 / 5)


def test_one_sample_per_prompt_is_refused_by_the_grouped_estimators_and_runs_the_others():
    """n = 1: a grouped baseline would be the sample itself (r - r = 0: no score signal), as OpenRLHF's own
    train_ppo_ray asserts; reinforce and gae run. reinforce with n 1 on scores [2, 4], one token each, no KL: returns
    [2, 4], whitened (mean 3, var 1) -> advantages [-1, 1]."""
    for est in GROUPED:
        with pytest.raises(ValueError, match=f"{est} needs groups of n_samples_per_prompt >= 2 .*OpenRLHF"):
            rm.advantages_and_returns(est, t(2.0, 4.0), torch.ones(2, 1), 1, torch.zeros(2, 1), 0.0)
    adv, ret = rm.advantages_and_returns("reinforce", t(2.0, 4.0), torch.ones(2, 1), 1, torch.zeros(2, 1), 0.0)
    assert ret.flatten().tolist() == pytest.approx([2.0, 4.0]) and adv.flatten().tolist() == pytest.approx([-1.0, 1.0])


def test_openrlhf_reward_clip_bounds_a_reward_model_score():
    """The (-10, 10) default on scores of a reward model far from zero: reinforce, n 1, scores [30, -4, 2], one token
    each, no KL: clipped [10, -4, 2] -> returns [10, -4, 2] (unclipped [30, -4, 2])."""
    mask = torch.ones(3, 1)
    _, ret = rm.advantages_and_returns("reinforce", t(30.0, -4.0, 2.0), mask, 1, torch.zeros(3, 1), 0.0,
                                       reward_clip=(-10.0, 10.0))
    assert ret.flatten().tolist() == pytest.approx([10.0, -4.0, 2.0])
    _, ret = rm.advantages_and_returns("reinforce", t(30.0, -4.0, 2.0), mask, 1, torch.zeros(3, 1), 0.0)
    assert ret.flatten().tolist() == pytest.approx([30.0, -4.0, 2.0])


def test_length_penalties_overlong_and_stop_properly():
    """OpenRLHF's ppo_utils/length_penalty.py. rewards [1, 1, 1], lengths [4, 7, 10], max_new 10, buffer 4, factor 1:
    the penalty starts past 10 - 4 = 6 tokens; excess [-2, 1, 4] -> [1, 1 - 1/4, 1 - 4/4] = [1, 0.75, 0] (2 penalized).
    Stop properly on truncated [F, T, T]: coef 0.5 -> [1, 0.375, 0]; coef 0 (ProRL v2's) -> [1, 0, 0];
    coef -0.5 -> [1, -0.5, -0.5]. A buffer past max_new_tokens and a coef above 1 are refused."""
    r, n = t(1.0, 1.0, 1.0), torch.tensor([4, 7, 10])
    trunc = torch.tensor([False, True, True])
    out, over, stop = rm.length_penalties(r, n, trunc, 10, overlong_buffer_len=4)
    assert out.tolist() == pytest.approx([1.0, 0.75, 0.0]) and (over, stop) == (2, 0)
    out, _, stop = rm.length_penalties(r, n, trunc, 10, overlong_buffer_len=4, stop_properly_penalty_coef=0.5)
    assert out.tolist() == pytest.approx([1.0, 0.375, 0.0]) and stop == 2
    assert rm.length_penalties(r, n, trunc, 10, stop_properly_penalty_coef=0.0)[0].tolist() == [1.0, 0.0, 0.0]
    assert rm.length_penalties(r, n, trunc, 10, stop_properly_penalty_coef=-0.5)[0].tolist() == [1.0, -0.5, -0.5]
    with pytest.raises(ValueError, match="overlong_buffer_len 12"):
        rm.length_penalties(r, n, trunc, 10, overlong_buffer_len=12)
    with pytest.raises(ValueError, match="stop_properly_penalty_coef must be in"):
        rm.length_penalties(r, n, trunc, 10, stop_properly_penalty_coef=1.5)
