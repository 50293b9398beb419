"""Flow fixtures. `demo_run` runs the iterative-DPO demo once (2 iterations) on the moto S3 endpoint; the other
loop tests start from its SFT policy and reward model so the suite trains those only once."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.flows.flowkit import demo_params, manifests


@pytest.fixture(scope="session")
def demo_run(moto_s3, prefect_harness):
    from flows.iterative_dpo import Params, iterative_dpo

    root = f"s3://{moto_s3.bucket}/flows"
    params = Params(**demo_params(root=root, run_name="dpo", iterations=2))
    t0 = time.time()
    report = iterative_dpo(params)
    run = f"{root}/dpo"
    return SimpleNamespace(params=params, report=report, run=run, seconds=time.time() - t0,
                           manifests=manifests(run), sft=f"{run}/sft", reward=f"{run}/reward_model",
                           inputs=f"{run}/inputs")
