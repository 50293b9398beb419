"""In-process engines (num_engines=0, as the eval stage runs them) must not switch autograd off for their
caller: a training step later in the same process needs it."""
import torch

from rlhf_core.rollout.generation import SamplingSpec, generate
from rlhf_core.rollout.rewards import RewardSpec, compute_rewards


def test_generation_and_scoring_leave_autograd_on(tiny):
    assert torch.is_grad_enabled()
    out = generate(str(tiny.policy_dir), [[5, 6, 7], [8, 9]], SamplingSpec(n=2, max_new_tokens=3))
    assert [len(o) for o in out] == [2, 2]
    rewards = compute_rewards(RewardSpec(model=str(tiny.reward_dir)), ["a", "b"], [" good", " bad"])
    assert len(rewards.rewards) == 2
    assert torch.is_grad_enabled()
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()
    assert w.grad.tolist() == [3.0, 3.0]
