"""Online-RL math as pure functions: KL estimators, token rewards, the six advantage estimators, the PPO
policy and value losses, entropy, KL controllers and running reward statistics.

Shapes: B = sequences (prompts x n_samples_per_prompt, grouped: rows k*n .. k*n+n-1 share a prompt),
T = response tokens (right padded; `mask` # (B, T) marks the action tokens). Formulas follow OpenRLHF
(openrlhf/trainer/ppo_utils/experience_maker.py, openrlhf/models/loss.py) and the papers cited at each
function; only the formulas carry over, not the code.

Estimators (`advantage_estimator`):
  gae                 critic values, GAE(gamma, lambda)                       PPO, arXiv:1707.06347 / 1506.02438
  reinforce           token-level KL-penalised returns, global normalisation  REINFORCE++, arXiv:2501.03262
  reinforce_baseline  the prompt's mean score subtracted first, then as reinforce
  rloo                leave-one-out baseline: r_i - mean_{j != i} r_j         RLOO, arXiv:2402.14740
  group_norm          (r_i - mean_group) / (std_group + eps)                  GRPO, arXiv:2402.03300
  dr_grpo             r_i - mean_group, loss summed per sequence / max_len    Dr. GRPO, arXiv:2503.20783
Group statistics are taken in float64 and a group of equal scores gets exactly 0 (no signal, not float noise);
the grouped estimators need gamma = 1 and n_samples_per_prompt >= 2 (OpenRLHF's train_ppo_ray asserts n > 1 for
rloo / reinforce_baseline / group_norm at every release from v0.7 to v0.11, and for dr_grpo from v0.11: with one
sample the group baseline is the sample itself and every score advantage is 0). The reward clip applies to the
shaped score (OpenRLHF's compute_reward; its default range is (-10, 10)).

Aggregation (`aggregate`), as OpenRLHF's loss.aggregate_loss: token (the masked mean over the micro-batch's
tokens, OpenRLHF's default and its only mode for the KL loss), sequence (the mean of each row's token mean, rows
with no action token left out, as OpenRLHF v0.11 and verl do) or seq-sum-norm (Dr. GRPO's constant normaliser).
Guards against overflow, as in the peers: the KL estimate is clamped to [-10, 10] (OpenRLHF), the PPO log-ratio
to [-20, 20] before exp (OpenRLHF / verl).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.rl.losses import reduce_tokens

Estimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "distill"]
# distill: on-policy distillation alone, no reward in the advantage (distill_advantages is the whole of it)
ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "distill")
GROUPED = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")  # need n_samples_per_prompt >= 2
GLOBALLY_NORMALISED = ("gae", "reinforce", "reinforce_baseline")  # OpenRLHF whitens these over the batch
Aggregation = Literal["token", "sequence", "seq-sum-norm"]


# ---------------------------------------------------------------------------------------------- KL
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL Divergence", 2020,
    http://joschu.net/blog/kl-approx.html). logp, ref_logp # (B, T) -> # (B, T). With d = logp - ref_logp:
      k1 = d                         unbiased, can be negative
      k2 = d^2 / 2                   biased, low variance
      k3 = exp(-d) - 1 + d           unbiased, always >= 0
    then clamped to [-10, 10], as OpenRLHF's compute_approx_kl clamps its estimate (verl's low_var_kl the same).
    d itself is first clamped to [-20, 20] (verl's k3) so exp(-d) stays finite and the gradient is never
    0 * inf = NaN; that changes no value, every estimate is already at its +-10 clamp before |d| = 20.
    e.g. d = log 2: k1 = 0.693147, k2 = 0.240227, k3 = 0.5 - 1 + 0.693147 = 0.193147;
    d = -30: k1 -10, k2 450 -> 10, k3 e^30 - 31 -> 10; d = 30: k1 10, k2 10, k3 29 -> 10.
    """
    d = (logp.float() - ref_logp.float()).clamp(-20, 20)
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = d * d / 2
    elif kind == "k3":
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown kl_estimator {kind!r} (k1, k2 or k3)")
    return kl.clamp(-10, 10)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                  clip_range: tuple[float, float] | None = None) -> torch.Tensor:
    """The RLHF reward per token (InstructGPT arXiv:2203.02155 eq. 2, token-level as in OpenRLHF):
    -kl_coef * kl_t on every action token, plus the (clipped) sequence score on the last action token.
    scores # (B,), kl, mask # (B, T) -> # (B, T).
    e.g. score 1, kl [0.1, 0.2], coef 0.5, mask [1, 1]: [-0.05, -0.1 + 1] = [-0.05, 0.9]."""
    m = mask.float()
    if clip_range is not None:
        scores = scores.clamp(*clip_range)
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & (m > 0)  # the last action token of each row
    return -kl_coef * kl * m + last.float() * scores.float().unsqueeze(-1)


def length_penalties(rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, max_new_tokens: int,
                     overlong_buffer_len: float | None = None, overlong_penalty_factor: float = 1.0,
                     stop_properly_penalty_coef: float | None = None) -> tuple[torch.Tensor, int, int]:
    """OpenRLHF's length penalties on the sequence rewards, before any baseline (its ppo_utils/length_penalty.py):
      overlong (DAPO, arXiv:2503.14476 sec. 3.4): a response longer than max_new_tokens - buffer gets
        -min(length - (max_new_tokens - buffer), buffer) / buffer * factor added;
      stop properly (ProRL v2): a truncated response (the generation hit its length cap) gets its reward times
        coef (0 <= coef <= 1), or exactly coef when coef < 0.
    rewards, lengths (response tokens) # (B,), truncated # (B,) bool -> (rewards, penalized by overlong, by stop).
    e.g. rewards [1, 1, 1], lengths [4, 7, 10], max_new 10, buffer 4, factor 1: expected 6; exceed [-2, 1, 4] ->
    [1, 1 - 0.25, 1 - 1] = [1, 0.75, 0]; then stop properly 0.5 with truncated [F, F, T]: [1, 0.75, 0];
    coef -0.5: [1, 0.75, -0.5]."""
    r = rewards.float().clone()
    over = stopped = 0
    if overlong_buffer_len is not None:
        if not 0 < overlong_buffer_len <= max_new_tokens:
            raise ValueError(f"overlong_buffer_len {overlong_buffer_len} must be in (0, max_new_tokens {max_new_tokens}]")
        exceed = torch.clamp(lengths.float() - (max_new_tokens - overlong_buffer_len), max=overlong_buffer_len)
        hit = exceed > 0
        r = torch.where(hit, r - exceed / overlong_buffer_len * overlong_penalty_factor, r)
        over = int(hit.sum())
    if stop_properly_penalty_coef is not None:
        if stop_properly_penalty_coef > 1:
            raise ValueError(f"stop_properly_penalty_coef must be in [0, 1] or negative, got {stop_properly_penalty_coef}")
        t = truncated.bool()
        r = torch.where(t, torch.full_like(r, stop_properly_penalty_coef) if stop_properly_penalty_coef < 0
                        else r * stop_properly_penalty_coef, r)
        stopped = int(t.sum())
    return r, over, stopped


# ---------------------------------------------------------------------------------------------- advantages
def shape_scores(scores: torch.Tensor, n: int, estimator: str, eps: float = 1e-9) -> torch.Tensor:
    """Per-sequence score after the estimator's group baseline. scores # (B,) grouped by prompt, B = k * n
    -> # (B,) float32.
      rloo                r_i - (sum_g r - r_i) / (n - 1)
      reinforce_baseline  r_i - mean_g r           (dr_grpo the same)
      group_norm          (r_i - mean_g r) / (std_g r + eps), std with Bessel's correction as torch.std
      gae, reinforce      unchanged
    The statistics are taken in float64, and a group whose scores are all equal (std 0) gets exactly 0: in
    float32 the mean of eight 0.7s is an ulp off, and group_norm divided that ulp by a ~0 std (|advantage| 0.9,
    or 60 where the std rounded to 0).
    e.g. one group [1, 2, 3, 6]: mean 3 -> baseline-subtracted [-2, -1, 0, 3]; rloo: 1 - (11/3) = -2.6667,
    2 - 10/3, 3 - 3, 6 - 2 = [-2.6667, -1.3333, 0, 4]; std = sqrt(14/3) = 2.1602 -> group_norm [-0.9258, ...];
    [0.7] * 8 -> [0] * 8 for every grouped estimator."""
    if estimator in ("gae", "reinforce"):
        return scores.float()
    if estimator == "distill":  # the teacher's per-token term is the advantage (distill_advantages): no score in it
        return torch.zeros_like(scores, dtype=torch.float32)
    if estimator not in GROUPED:
        raise ValueError(f"unknown advantage_estimator {estimator!r}; choose one of {list(ESTIMATORS)}")
    if n < 2 or scores.numel() % n:
        raise ValueError(f"{estimator} needs groups of n_samples_per_prompt >= 2 samples (with one, every score "
                         f"advantage is 0; OpenRLHF's train_ppo_ray asserts the same); got {scores.numel()} scores "
                         f"with n = {n}")
    g = scores.double().view(-1, n)  # (prompts, n)
    flat = g.amax(-1, keepdim=True) == g.amin(-1, keepdim=True)  # (prompts, 1): std 0, no signal
    if estimator == "rloo":
        out = g - (g.sum(-1, keepdim=True) - g) / (n - 1)
    elif estimator == "group_norm":
        out = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + eps)
    else:
        out = g - g.mean(-1, keepdim=True)
    return out.masked_fill(flat, 0.0).float().reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over action tokens. # (B, T) -> # (B, T).
    e.g. r [-0.05, 0.9], gamma 1: [0.85, 0.9]; gamma 0.5: [-0.05 + 0.45, 0.9] = [0.4, 0.9]."""
    r = rewards.float() * mask
    out = torch.zeros_like(r)
    acc = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        acc = r[:, t] + gamma * acc
        out[:, t] = acc
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lambd: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438 eq. 16):
    delta_t = r_t + gamma V_{t+1} - V_t (V beyond the last action token = 0), A_t = delta_t + gamma lambda A_{t+1},
    returns = A + V (the critic's target). rewards, values, mask # (B, T) -> (advantages, returns) # (B, T).
    e.g. r [0, 1], V [0.5, 0.2], gamma 1, lambda 0.5: delta = [0 + 0.2 - 0.5, 1 - 0.2] = [-0.3, 0.8];
    A = [-0.3 + 0.5 * 0.8, 0.8] = [0.1, 0.8]; returns [0.6, 1.0]."""
    m = mask.float()
    r, v = rewards.float() * m, values.float() * m
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])
    T = r.shape[1]
    for t in reversed(range(T)):
        nxt = v[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = r[:, t] + gamma * nxt - v[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    return adv * m, (adv + v) * m


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, *, std_norm: bool = True) -> torch.Tensor:
    """Global (batch) normalisation over action tokens, as OpenRLHF normalises advantages:
    (x - mean) * rsqrt(max(var, eps)), population variance (a floor on var, not var + eps); std_norm=False
    (OpenRLHF's --no_advantage_std_norm) subtracts the mean only. x, mask # (B, T) -> # (B, T), 0 on padding.
    e.g. [1, 3] (both masked): mean 2, var 1 -> [-1, 1]; std_norm=False: [-1, 1] as well, [1, 5] -> [-2, 2];
    [0, 2e-4]: var 1e-8 (at the floor) -> [-1, 1] (var + eps would give [-0.7071, 0.7071])."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    if not std_norm:
        return (x - mean) * m
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var.clamp(min=eps)) * m


def advantages_and_returns(estimator: str, scores: torch.Tensor, mask: torch.Tensor, n: int, kl: torch.Tensor,
                           kl_coef: float, gamma: float = 1.0, lambd: float = 0.95, values: torch.Tensor | None = None,
                           reward_clip: tuple[float, float] | None = None, *,
                           std_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """From sequence scores # (B,) and per-token KL # (B, T) to (advantages, returns) # (B, T), as OpenRLHF's
    compute_advantages_and_returns: shape_scores -> reward_clip on the shaped score -> token_rewards (KL penalty
    in the reward when kl_coef > 0) -> GAE with the critic's values (gae) or discounted returns (the rest) ->
    global whitening for gae / reinforce / reinforce_baseline (`whiten`; std_norm=False: mean only).
    The grouped estimators need gamma = 1 (their baseline is a whole-sequence score; OpenRLHF resets gamma to 1
    for them with a warning, here it is refused).
    e.g. rloo on one group [2, 5], clip (-1, 1): shaped [-3, 3] -> [-1, 1] (clipping the raw scores first
    would give [1, 1] -> [0, 0], no signal)."""
    if estimator in GROUPED and gamma != 1:
        raise ValueError(f"advantage_estimator {estimator} needs gamma = 1 (its group baseline compares whole-"
                         f"sequence scores; OpenRLHF forces gamma to 1 for it), got gamma = {gamma}")
    r = token_rewards(shape_scores(scores, n, estimator), kl, mask, kl_coef, reward_clip)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values")
        adv, ret = gae(r, values, mask, gamma, lambd)
    else:
        ret = discounted_returns(r, mask, gamma)
        adv = ret
    if estimator in GLOBALLY_NORMALISED:
        adv = whiten(adv, mask, std_norm=std_norm)
    return adv, ret


def distill_advantages(student_logp: torch.Tensor, teacher_logps: list[torch.Tensor], mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """On-policy distillation's per-token advantage # (B, T): coef x (log pi_T(y_t) - log pi(y_t)) over the sampled
    tokens `mask` # (B, T), from the student's log-probs of its own samples and each teacher's of the same tokens
    (several teachers: the mean of their log-probs). The sampled token's negative reverse-KL estimate: its expectation
    under the student is -KL(pi || pi_T) at that prefix, so with it as a (per-token, undiscounted) advantage the policy
    gradient is in expectation the gradient of -KL(pi || pi_T) summed over the sampled prefixes, what TRL's
    DistillationTrainer minimises with beta = 1 exactly over the vocabulary (Agarwal et al., On-Policy Distillation of
    Language Models, arXiv:2306.13649); here one teacher log-prob per token crosses between roles, never (B, T, V).
    e.g. student [-1.0, -2.0], teachers [-0.5, -2.5] and [-1.5, -1.5]: mean [-1.0, -2.0] -> [0, 0]; with the first
    alone: [0.5, -0.5]."""
    teacher = torch.stack([t.float() for t in teacher_logps]).mean(0)
    return coef * (teacher - student_logp.float()) * mask


# ---------------------------------------------------------------------------------------------- losses
def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token", max_len: int | None = None,
              empty_rows: Literal["drop", "zero"] = "drop"):
    """A per-token loss # (B, T) over the action tokens `mask` # (B, T) -> a scalar.
      token         sum(values * mask) / sum(mask)  (losses.reduce_tokens)
      sequence      the mean over rows of each row's token mean; a row with no action token (an agent episode
                    whose tokens are all feedback) has no mean: empty_rows "drop" leaves it out of the mean
                    (OpenRLHF v0.11's aggregate_loss excludes fully masked sequences; verl the same), "zero"
                    counts it as 0 (this project before issue 37)
      seq-sum-norm  (Dr. GRPO, arXiv:2503.20783) the mean over rows of sum_t values / max_len, a constant
                    normaliser so a sequence's length does not scale its tokens' weight (every row counts)
    e.g. values [[1, 2], [3, 0]], mask [[1, 1], [1, 0]]: token 6 / 3 = 2; sequence (1.5 + 3) / 2 = 2.25;
    seq-sum-norm, max_len 4: ((1 + 2) / 4 + 3 / 4) / 2 = 0.75. With a third row [5, 5] masked [0, 0]:
    sequence drop (1.5 + 3) / 2 = 2.25, zero (1.5 + 3 + 0) / 3 = 1.5; token still 2."""
    if mode == "seq-sum-norm":
        if not max_len:
            raise ValueError("seq-sum-norm needs max_len (the generation length)")
        return ((values * mask.float()).sum(-1) / max_len).mean()
    if mode == "sequence" and empty_rows == "drop":
        m = mask.to(values.dtype)
        n = m.sum(-1)  # (B,) action tokens per row
        rows = (n > 0).to(values.dtype)
        return ((values * m).sum(-1) / n.clamp(min=1) * rows).sum() / rows.sum().clamp(min=1)
    if empty_rows not in ("drop", "zero"):
        raise ValueError(f"unknown empty_rows {empty_rows!r} (drop or zero)")
    return reduce_tokens(values, mask, mode)


def rollout_is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float, high: float,
                      icepop: bool = False) -> torch.Tensor:
    """Off-policy correction for rollouts from an inference engine (vLLM) whose probabilities differ from the
    trainer's: the per-token importance ratio rho = pi_old / pi_rollout = exp(old_logp - rollout_logp), detached.
      TIS (truncated importance sampling; Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy
      RL Training", https://fengyao.notion.site/off-policy-rl, 2025): w = clamp(rho, low, high); with low = 0
      this is their min(rho, C).
      ICEPOP (Ling team, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model", arXiv:2510.18855,
      IcePop): w = rho where low <= rho <= high, else 0: tokens whose engine and trainer disagree too much are
      masked out of the gradient instead of being clamped.
    OpenRLHF's --enable_vllm_is_correction / --vllm_is_truncated_threshold low high / --use_icepop; the weight
    multiplies the per-token policy loss. All # (B, T).
    e.g. old - rollout = [ln 0.25, 0, ln 3, ln 8], low 0.5, high 5: rho [0.25, 1, 3, 8];
    TIS [0.5, 1, 3, 5]; ICEPOP [0, 1, 3, 0]; a gap of 100 (rho = inf in float32): TIS high, ICEPOP 0 (not NaN)."""
    rho = torch.exp(old_logp.float() - rollout_logp.float()).detach()
    if icepop:  # where, not rho * in_window: inf * 0 would be NaN
        return torch.where((rho >= low) & (rho <= high), rho, 0.0)
    return rho.clamp(low, high)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
                mode: Aggregation = "token", max_len: int | None = None,
                is_weight: torch.Tensor | None = None, empty_rows: str = "drop") -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (arXiv:1707.06347 eq. 7) with asymmetric clip [1 - eps_low, 1 + eps_high] (DAPO,
    arXiv:2503.14476) and dual clip (arXiv:1912.09729): for A < 0 the loss is capped at -dual_clip * A.
    All # (B, T); returns (scalar loss, detached metrics).
      ratio = exp(clamp(logp - old_logp, -20, 20)); loss_t = -min(ratio A, clip(ratio) A); dual: min(loss_t, -c A)
      where A < 0. The log-ratio clamp is OpenRLHF's and verl's: past 88.7 exp overflows float32 and one token
      makes the loss inf and the gradient NaN; clamped, such a token's gradient is 0.
    e.g. ratio 2 (logp - old = ln 2), eps 0.2: A = 1: -min(2, 1.2) = -1.2; A = -1: -min(-2, -1.2) = 2, with
    dual_clip 3 still 2; ratio 4, A = -1: -min(-4, -1.2) = 4 -> with dual_clip 3: 3.
    `is_weight` # (B, T) (rollout_is_weight) multiplies each token's loss: the off-policy correction; `mode`,
    `max_len` and `empty_rows` reduce it (aggregate)."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    m = mask.float()
    if is_weight is not None:
        loss = loss * is_weight
    metrics = {"clip_ratio": reduce_tokens((surr2 < surr1).float(), m).detach(),
               "ratio": reduce_tokens(ratio.detach(), m)}
    return aggregate(loss, m, mode, max_len, empty_rows), metrics


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k1",
            mode: Aggregation = "token", max_len: int | None = None, empty_rows: str = "drop") -> torch.Tensor:
    """The KL term of the loss (use_kl_loss, GRPO arXiv:2402.03300 eq. 3): kl_estimate(logp, ref_logp) reduced over
    the action tokens. OpenRLHF always takes the token mean here (ppo_actor.py: masked_mean(kl, action_mask)),
    whatever the policy loss's reduction: mode "token" by default; another mode reduces it as the policy loss.
    All # (B, T) -> scalar. e.g. d = logp - ref = [[ln 2, ln 2], [ln 2, 0]] masked [[1, 1], [1, 0]], k1:
    token 3 ln 2 / 3 = 0.693147; sequence (ln 2 + ln 2) / 2 = 0.693147; seq-sum-norm, max_len 4:
    (2 ln 2 / 4 + ln 2 / 4) / 2 = 0.259930."""
    return aggregate(kl_estimate(logp, ref_logp, kind), mask, mode, max_len, empty_rows)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None, mode: Aggregation = "token", empty_rows: str = "drop") -> torch.Tensor:
    """0.5 * (V - R)^2, or with value_clip c: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).
    All # (B, T) -> scalar. e.g. V 1.0, V_old 0.5, R 0.0, c 0.2: max(1.0, 0.49) / 2 = 0.5; R 2.0:
    max(1.0, (0.7 - 2)^2 = 1.69) / 2 = 0.845. seq-sum-norm is a policy-loss normaliser: the critic takes the token
    mean then."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * aggregate(loss, mask, "token" if mode == "seq-sum-norm" else mode, empty_rows=empty_rows)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution, -sum_v p log p. logits # (B, T, V) -> # (B, T).
    e.g. uniform over 4: ln 4 = 1.386294."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------- controllers
@dataclass
class KLController:
    """kl_coef for the reward. Fixed when kl_target is None; otherwise adaptive (Ziegler et al.,
    arXiv:1909.08593 sec. 2.2): e = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + e * n_steps / horizon.
    e.g. coef 0.1, target 1, horizon 10, KL 2, 5 steps: e = 0.2, coef = 0.1 * (1 + 0.2 * 0.5) = 0.11."""

    value: float
    target: float | None = None
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target is None:
            return
        err = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon


@dataclass
class RunningMoments:
    """Running mean / std of rewards over every batch seen (Chan et al. parallel update), for running_reward_norm:
    r' = (r - mean) / std. e.g. batches [1, 3] then [5]: count 3, mean 3, population var (4 + 0 + 4) / 3 = 8/3,
    std (Bessel) sqrt(8 / 2) = 2."""

    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations
    count: int = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.double().reshape(-1)
        n, mean = x.numel(), x.mean().item()
        m2 = ((x - mean) ** 2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.std + 1e-8)
