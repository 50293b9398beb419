"""On-policy distillation's math beside TRL's DistillationTrainer on the same batch (issue 45 item 2): TRL 1.16
minimises, per completion token, the generalized JSD of the student's and the teacher's next-token distributions
(beta 1: the exact reverse KL over the vocabulary, trl/trainer/distillation_trainer.py `_chunked_divergence_loss`);
the ppo stage's distillation (rlhf_core.rl.rl_math.distill_advantages) gives each sampled token the advantage
log p_teacher(y) - log p_student(y) in the policy gradient: one log-prob per token crosses between roles, never a
(B, T, V) tensor. Same random student / teacher hidden states and LM heads on both sides, float32:

  loss       TRL's loss vs the exact reverse KL computed here (must agree to rounding), and the mean over 400,000 of the
             student's sampled tokens of -advantage (a Monte-Carlo estimate of the same number)
  gradient   the gradient of TRL's loss w.r.t. the student's hidden states vs the gradient of the policy-gradient
             surrogate with the distill advantage in exact expectation (sum over the vocabulary weighted by the
             student's probabilities): equal in expectation by the score-function identity

    PYTHONPATH=/tmp/trl-pkgs .venv/bin/python benchmarks/peers/distill_vs_trl.py
    (TRL 1.16 without its dependencies beside the project's venv: pip install --no-deps --target /tmp/trl-pkgs trl==1.16.0)

One JSON line of figures. No timing: this is a check of what is computed, not of speed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch
    import torch.nn.functional as F

    from rlhf_core.rl import rl_math

    try:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    except ImportError as e:
        sys.exit(f"TRL 1.16 is not importable ({e}): see this file's header")
    import trl

    g = torch.Generator().manual_seed(0)
    B, K, H, V = 2, 5, 16, 32
    hs = torch.randn(B, K, H, generator=g, requires_grad=True)
    ht, ws, wt = torch.randn(B, K, H, generator=g), torch.randn(V, H, generator=g) / 2, torch.randn(V, H, generator=g)
    mask = torch.ones(B, K)
    mask[1, 3:] = 0  # a shorter completion
    trl_loss, _, n = _chunked_divergence_loss(hs, ht, ws, wt, mask, beta=1.0)
    (trl_grad,) = torch.autograd.grad(trl_loss, hs)

    s_lp = torch.log_softmax(hs @ ws.T, -1)  # (B, K, V)
    t_lp = torch.log_softmax(ht @ wt.T, -1)
    exact = (F.kl_div(t_lp, s_lp, log_target=True, reduction="none").sum(-1) * mask).sum() / mask.sum()
    adv = rl_math.distill_advantages(s_lp.detach(), [t_lp], torch.ones_like(s_lp))  # every v as the sampled token
    surrogate = -((s_lp.exp().detach() * adv * s_lp).sum(-1) * mask).sum() / mask.sum()
    (pg_grad,) = torch.autograd.grad(surrogate, hs)

    probs = s_lp.detach().exp().reshape(-1, V)
    ys = torch.multinomial(probs, 400_000, replacement=True, generator=g).reshape(B, K, -1)  # (B, K, S)
    sampled = -rl_math.distill_advantages(s_lp.detach().gather(-1, ys), [t_lp.gather(-1, ys)], torch.ones_like(ys))
    mc = float((sampled.mean(-1) * mask).sum() / mask.sum())
    print(json.dumps({"what": "distill_vs_trl", "trl": trl.__version__, "tokens": int(n),
                      "trl_loss": round(trl_loss.item(), 6), "exact_reverse_kl": round(float(exact), 6),
                      "sampled_estimate": round(mc, 6), "sampled_over_trl": round(mc / trl_loss.item(), 4),
                      "grad_max_abs_diff": float((trl_grad - pg_grad).abs().max()),
                      "grad_max_abs": float(trl_grad.abs().max())}))


if __name__ == "__main__":
    main()
