"""Flow fixtures. `demo_run` runs the iterative-DPO demo (2 iterations) on the moto S3 endpoint once per pytest run
(tests/conftest.py's run_once: the first worker to ask builds it, the other reads the same objects); the other loop
tests start from its SFT policy and reward model so the suite trains those only once. Only the tests of the demo run's
own stages (tests/flows/test_loops.py, one group, in order) rerun it; the others read it."""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from rlhf_core import store
from tests.conftest import SHARED_RAY, run_once
from tests.flows.flowkit import demo_params, manifests

DEMO_ARTIFACT_KEYS = ("iterative-dpo-iterations", "iterative-dpo-report", "iterative-dpo-progress", "iterative-dpo-plot")


def _prefect_record(flow_run_id: str) -> dict:
    """What Prefect's API (the builder's) holds of the demo's flow run right after it: the UI's view of it, read here
    so that a test on another worker (another Prefect database) checks the same."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId,
                                                LogFilter, LogFilterFlowRunId)

    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(flow_run_id)
        tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        artifacts = {key: [{"data": a.data, "created": a.created.isoformat(), "flow_run_id": str(a.flow_run_id)}
                           for a in c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))]
                     for key in DEMO_ARTIFACT_KEYS}
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return {"flow_run_name": fr.name, "task_runs": [{"name": t.name, "tags": sorted(t.tags)} for t in tasks],
            "artifacts": artifacts, "logs": [e.message for e in logs]}


@pytest.fixture(scope="session")
def demo_run(moto_s3, prefect_harness):
    from flows.iterative_dpo import Params, iterative_dpo

    root = f"s3://{moto_s3.bucket}/flows"
    params = Params(**demo_params(root=root, run_name="dpo", iterations=2))
    run = f"{root}/dpo"

    def build() -> dict:
        SHARED_RAY.up()  # the demo's generate stages join it (a test file that shares none shuts it down)
        t0 = time.time()
        report = iterative_dpo(params)
        return {"report": report, "seconds": time.time() - t0, "prefect": _prefect_record(report["flow_run_id"]),
                "manifests": {k: dataclasses.asdict(m) for k, m in manifests(run).items()}}

    built = run_once("demo-run", build)
    return SimpleNamespace(params=params, report=built["report"], run=run, seconds=built["seconds"],
                           manifests={k: store.Manifest(**m) for k, m in built["manifests"].items()},
                           prefect=built["prefect"], sft=f"{run}/sft", reward=f"{run}/reward_model", inputs=f"{run}/inputs")

