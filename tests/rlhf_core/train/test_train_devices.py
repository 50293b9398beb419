"""The training stages' forwards (rlhf_core.train.entry: every LM method and the reference pass; the reward
model's rlhf_core.train.methods.rm) put every input on the model's device: the model is moved to `meta` and
hooks fail on any tensor left on the CPU (tests/rlhf_core/ppo/test_ppo_roles.py has the harness and the why)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf_core.train import entry
from rlhf_core.train.methods import rm
from tests.rlhf_core.ppo.test_ppo_roles import META, device_guard, on_meta

SEQS = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 10, 11], [1, 5, 6, 12], [1, 5, 6, 13, 14, 15]]  # 2 chosen, 2 rejected
STARTS = [3, 3, 3, 3]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_lm_forward_of_the_trainers_and_reference_moves_inputs(tiny, packing, pairs):
    model = on_meta(AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32))
    seen = device_guard(model)
    summed, counts, _ = entry.forward(model, {"packing_samples": packing}, SEQS, STARTS, pad_id=0, pairs=pairs)
    assert summed.device == META and summed.shape == (4,) and counts.shape == (4,)
    assert "model.embed_tokens" in seen and "lm_head" in seen


def test_reward_model_training_forward_moves_inputs(tiny):
    model = on_meta(AutoModelForSequenceClassification.from_pretrained(str(tiny.reward_dir), dtype=torch.float32))
    seen = device_guard(model)
    r, _ = rm.rewards(model, {"packing_samples": False}, SEQS, STARTS, pad_id=0)
    assert r.device == META and r.shape == (4,) and "score" in seen
