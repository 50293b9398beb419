"""Ray engines that die or hang mid-run: a clear error naming the stage, no hang; the next run works."""
import os
import sys
import time

import pytest

from rlhf_core.rollout import generation


class Flaky:
    """A stand-in engine whose behaviour the shard's first item picks."""

    def __init__(self, *args):
        pass

    def run(self, items):
        if items[0] == "die":
            os._exit(1)  # what an OOM kill or a segfault in the engine looks like to Ray
        if items[0] == "hang":
            time.sleep(120)
        return [x.upper() for x in items]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_dead_engine_and_stalled_engine_fail_naming_the_stage(local_ray):
    with pytest.raises(generation.GenerationError, match=r"generate \(hf\): engine 2 of 2 died mid-run "
                                                         r"\(\w+\); nothing was committed, rerun to resume"):
        generation.run_engines(Flaky, (), "run", ["ok", "die"], {}, num_engines=2, what="generate (hf)")
    t0 = time.time()
    with pytest.raises(generation.GenerationError, match=r"score: no engine finished a chunk for 3s \([12] of 2 chunks "
                                                         r"still running\): stalled"):
        generation.run_engines(Flaky, (), "run", ["ok", "hang"], {}, num_engines=2, stall_timeout_s=3, what="score")
    assert time.time() - t0 < 60
    # the rerun: fresh actors, results in item order
    assert generation.run_engines(Flaky, (), "run", ["a", "b", "c"], {}, num_engines=2) == ["A", "B", "C"]
