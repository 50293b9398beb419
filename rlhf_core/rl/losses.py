"""Every training loss as a small pure function: per-example losses plus detached metrics; the caller reduces.

Shapes: B = batch, T = tokens, V = vocabulary. Token-level quantities are `# (B, T)`, one value per example
is `# (B,)`. Equations follow OpenRLHF's openrlhf/models/loss.py and the papers cited at each function;
only the formulas carry over, not the code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

Reduction = Literal["token", "sequence"]


@dataclass
class LossOutput:
    """`losses` is per example (B,) with grad; `metrics` are detached per-example tensors (B,)."""

    losses: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def reduce_tokens(values: torch.Tensor, mask: torch.Tensor, mode: Reduction = "token") -> torch.Tensor:
    """THE token-vs-sequence reduction. values, mask: # (B, T).

    token:    sum(values * mask) / sum(mask)                  (every token weighs the same; OpenRLHF default)
    sequence: mean over examples of (sum_t values * mask / sum_t mask)   (every example weighs the same)
    e.g. values [[1, 2], [3, 0]], mask [[1, 1], [1, 0]]: token = 6 / 3 = 2.0; sequence = (1.5 + 3) / 2 = 2.25.
    """
    mask = mask.to(values.dtype)
    if mode == "token":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if mode == "sequence":
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    raise ValueError(f"unknown reduction {mode!r} (token or sequence)")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) for t = 1..T-1. logits # (B, T, V), input_ids # (B, T) -> # (B, T-1).

    Logits at position t predict token t+1, hence the shift. log_softmax in fp32 for stability."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    return torch.gather(logp, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)


def gathered_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row: logits # (N, V), tokens # (N,) -> # (N,), in fp32
    (logit - logsumexp, without materializing the (N, V) log-probs)."""
    logits = logits.float()
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def sft_loss(summed_logps: torch.Tensor, n_tokens: torch.Tensor, per_token: float | None = None) -> LossOutput:
    """Token-level mean NLL of the response tokens (OpenRLHF's GPTLMLoss: every token of the batch weighs the
    same). summed_logps, n_tokens # (B,): each example's summed target log-probs and target count.
    losses # (B,) are each example's share -sum logp_i / D, so losses.sum() is the batch loss; metric nll is each
    example's own mean NLL. D is this micro-batch's target count sum_j n_j (OpenRLHF), or `per_token`: with
    gradient accumulation, the window's target count over its micro-batches (N_window / M), so that the mean of
    the M micro-batch losses, which DeepSpeed's accumulation takes, is one token mean over the window (TRL's,
    transformers' num_items_in_batch).
    e.g. sums [-6, -2] over [3, 1] tokens: shares [1.5, 0.5], batch loss 8 / 4 = 2.0; nll [2.0, 2.0]; in a window
    of 2 micro-batches with 10 targets (per_token 5): shares [1.2, 0.4], loss 1.6."""
    n = n_tokens.to(summed_logps.dtype)
    d = n.sum().clamp(min=1) if per_token is None else per_token
    return LossOutput(-summed_logps / d, {"nll": (-summed_logps / n.clamp(min=1)).detach()})


def pairwise_rm_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                     kind: Literal["sigmoid", "logexp"] = "sigmoid") -> LossOutput:
    """Bradley-Terry reward-model loss. chosen, rejected, margin # (B,).

    sigmoid: -log sigmoid(r_c - r_r - margin)     (InstructGPT, arXiv:2203.02155 eq. 1; Llama-2 margin)
    logexp:  log(1 + exp(r_r - r_c))              (OpenRLHF LogExpLoss, Anthropic HH arXiv:2204.05862; the same
             value without a margin), computed as softplus(r_r - r_c): log1p(exp(.)) overflows past 88.7 in float32
    e.g. r_c=2, r_r=1, margin 0: -log sigmoid(1) = log(1 + e^-1) = 0.3133; logexp at r_r - r_c = 100: 100.0.
    """
    diff = chosen - rejected  # (B,)
    if kind == "sigmoid":
        losses = -F.logsigmoid(diff - (margin if margin is not None else 0.0))
    elif kind == "logexp":
        if margin is not None:
            raise ValueError("the logexp reward-model loss takes no margin (use kind='sigmoid')")
        losses = F.softplus(-diff)
    else:
        raise ValueError(f"unknown reward-model loss {kind!r} (sigmoid or logexp)")
    d = diff.detach()
    return LossOutput(losses, {"accuracy": (d > 0).float(), "reward_margin": d,
                               "chosen_reward": chosen.detach(), "rejected_reward": rejected.detach()})


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
             label_smoothing: float = 0.0, lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> LossOutput:
    """DPO family on summed response log-probs, all # (B,).

    h = (log pi(y_c) - log pi(y_r)) - (log ref(y_c) - log ref(y_r))
    sigmoid (DPO, arXiv:2305.18290 eq. 7) with cDPO label smoothing eps:
        -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo (arXiv:2310.12036 eq. 17, as in OpenRLHF):  (h - 1 / (2 beta))^2
    ipo with `lengths` (the responses' token counts |y_c|, |y_r| # (B,); TRL's IPO, which its authors confirmed
    to TRL is the paper's form): each response's log-ratio per token,
        h = (log pi(y_c) - log ref(y_c)) / |y_c| - (log pi(y_r) - log ref(y_r)) / |y_r|
    The same beta sets another target: a margin of 1 / (2 beta) in summed log-ratios, or per token (about |y|
    times more in sum); docs/stages/dpo.md compares the two.
    implied rewards: beta (log pi - log ref) per response (summed, either way); accuracy = [r_c > r_r].
    e.g. pc=-1, pr=-3, rc=-2, rr=-2, beta 0.5: h = 2, loss = -log sigmoid(1) = 0.3133, rewards 0.5 / -0.5;
    ipo: (2 - 1)^2 = 1; with lengths 2 and 4: h = 1/2 + 1/4 = 0.75, (0.75 - 1)^2 = 0.0625.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if lengths is not None and loss_type != "ipo":
        raise ValueError(f"length-normalized log-ratios apply to the ipo loss only, not {loss_type!r}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)  # (B,)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing (cDPO) applies to the sigmoid loss only, not ipo")
        if lengths is not None:
            n_c, n_r = (x.to(h.dtype).clamp(min=1) for x in lengths)
            h = (policy_chosen - ref_chosen) / n_c - (policy_rejected - ref_rejected) / n_r
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r} (sigmoid or ipo)")
    rc = beta * (policy_chosen - ref_chosen).detach()
    rr = beta * (policy_rejected - ref_rejected).detach()
    return LossOutput(losses, {"chosen_reward": rc, "rejected_reward": rr, "reward_margin": rc - rr,
                               "reward_accuracy": (rc > rr).float()})


def nll_per_token(summed_logps: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen response's mean NLL, added to DPO as nll_loss_coef * nll (OpenRLHF's `--nll_loss_coef`,
    RPO arXiv:2404.19733). # (B,), # (B,) -> # (B,). e.g. sum logp -6 over 3 tokens: 2.0."""
    return -summed_logps / n_tokens.to(summed_logps.dtype).clamp(min=1)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knowledge distillation per target token (Hinton et al. 2015, arXiv:1503.02531; OpenRLHF's KDLoss, from
    MiniLLM's finetune.py): the cross-entropy of the student's log-probs under the teacher's softmax over the
    vocabulary. student_logits, teacher_logits # (N, V) at the N loss targets -> (ce, kl), each # (N,):
    ce = -sum_v p_t(v) log p_s(v) (the loss; gradient to the student only), and the forward
    kl = KL(p_t || p_s) = ce - H(p_t) (detached: what the loss lowers, 0 when the student equals the teacher).
    Vocabulary entries the student masks with -inf logits count 0 (as OpenRLHF's inf mask), not NaN.
    e.g. teacher logits [0, 0] (p_t = [.5, .5]), student log-probs [log .25, log .75]:
    ce = -(.5 log .25 + .5 log .75) = 0.836988; kl = ce - log 2 = 0.143841."""
    logp_s = torch.log_softmax(student_logits.float(), -1)  # (N, V)
    t = teacher_logits.detach().float()
    p_t, logp_t = torch.softmax(t, -1), torch.log_softmax(t, -1)
    ce = -torch.where(torch.isinf(logp_s), 0.0, p_t * logp_s).sum(-1)
    ent = -torch.where(p_t > 0, p_t * logp_t, 0.0).sum(-1)
    return ce, (ce - ent).detach()


def kto_kl(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0 before clamping: the mean of log pi(y'|x) - log ref(y'|x) over mismatched
    pairs (x, y'), y' another example's completion (arXiv:2402.01306 sec. 4.1, a biased estimate of
    KL(pi || ref)). # (B,), # (B,) -> scalar, detached (no gradient flows through z0, as in the paper, TRL
    and OpenRLHF). Over several ranks the caller averages it before `kto_loss`.
    e.g. policy [-2, -4], ref [-3, -3]: mean(1, -1) = 0."""
    return (policy_kl_logps - ref_kl_logps).detach().float().mean()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> LossOutput:
    """Kahneman-Tversky Optimization (arXiv:2402.01306 eq. 8) on summed completion log-probs, all # (B,);
    desirable # (B,) bool; kl the reference point (kto_kl, averaged over ranks), clamped at 0.

    r = log pi(y|x) - log ref(y|x), z0 = max(kl, 0)
    desirable:   w_D (1 - sigmoid(beta (r - z0)))
    undesirable: w_U (1 - sigmoid(beta (z0 - r)))
    implied reward beta r per example (the paper's value function without the weights).
    e.g. r = 2, z0 = 0, beta 0.5, w_D = 1: 1 - sigmoid(1) = 0.268941; undesirable r = 2, w_U = 2:
    2 (1 - sigmoid(-1)) = 1.462117.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    z0 = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device).clamp(min=0).detach()
    r = policy_logps - ref_logps  # (B,)
    d = desirable.to(torch.bool)
    losses = torch.where(d, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    reward = beta * r.detach()
    df = d.to(reward.dtype)
    return LossOutput(losses, {"reward": reward, "desirable": df, "desirable_reward": reward * df,
                               "undesirable_reward": reward * (1 - df), "kl": z0.expand_as(reward)})
