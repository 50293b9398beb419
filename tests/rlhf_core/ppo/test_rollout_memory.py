"""The HF rollout hands the CUDA allocator's cached blocks back before it generates (issue 36 item 3:
rlhf_core.ppo.engines.release_cached), and keeps them when told to."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.ppo import engines


def test_without_cuda_nothing_is_released():
    assert engines.release_cached(0.0) is False
    assert engines.release_cached(None) is False


@pytest.mark.gpu
def test_a_generation_hands_back_what_a_training_step_left_cached(tiny):
    """2 GiB allocated and freed (as a learner step's activations are) stay cached; the engine's generate releases
    them (cached-but-unused below 1 GB after), and with release_above_gb None keeps them."""
    eng = engines.HFRollout(str(tiny.policy_dir), bf16=True)
    unused = lambda: torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # noqa: E731
    for release in (None, 1.0):
        x = torch.empty(2 * 2 ** 30, dtype=torch.uint8, device="cuda")
        del x
        assert unused() >= 2 * 2 ** 30
        eng.release_above_gb = release
        out = eng.generate([[5, 6, 7]], 2, 4, 1.0, 1.0, 0, seed=0)
        assert len(out[0]) == 2
        assert (unused() < 2 ** 30) if release is not None else (unused() >= 2 * 2 ** 30)
