"""Every wait of the ppo driver is bounded (issue 35 item 4): a rollout that never finishes fails the step with an
error naming the phase and the step after role_timeout_s, in the sync feed and in the async one; a rollout that
raises still surfaces its own error. (The waits on Ray actors, placement.wait_all, are tested on real actors in
test_fake_cluster.py.)"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rlhf_core.ppo.feed import RolloutFeed
from rlhf_core.ppo.placement import RoleError


def feed(async_train: bool, produce) -> RolloutFeed:
    cfg = SimpleNamespace(async_train=async_train, async_queue_size=1, role_timeout_s=0.5)
    return RolloutFeed(cfg, produce, [(0, [0]), (1, [1])])


@pytest.mark.parametrize("async_train", [False, True])
def test_a_rollout_that_never_finishes_fails_naming_generate_and_the_step(async_train):
    release = threading.Event()

    def hung(step, idx):  # an engine that never answers (a sleeping vLLM queueing the request)
        release.wait(30)
        return {"step": step}

    f = feed(async_train, hung)
    t0 = time.monotonic()
    try:
        with pytest.raises(RoleError, match=r"rollout of step 1 within 0.5 s while generate \(role_timeout_s\)"):
            f.get(0, [0])
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        f.close()


@pytest.mark.parametrize("async_train", [False, True])
def test_a_rollout_in_time_is_returned_and_a_failing_one_keeps_its_error(async_train):
    def produce(step, idx):
        if step == 1:
            raise ValueError("reward server said no")
        return {"step": step, "idx": idx}

    f = feed(async_train, produce)
    try:
        assert f.get(0, [0])[0] == {"step": 0, "idx": [0]}
        f.synced(0)
        with pytest.raises(ValueError, match="reward server said no"):
            f.get(1, [1])
    finally:
        f.close()
