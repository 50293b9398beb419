"""Stages on the work pool that fits them, in one flow (issue 26 item 1).

`pools: {generate: gpu-vllm, score: gpu-vllm, dpo: gpu-train}` runs those stages as flow runs of the
deployment `rlhf-stage/<pool>` on their pools; every other stage runs in the flow's own process as before.

- One deployment per pool, of the small `rlhf-stage` flow below (parameters: the stage's name, its Config as
  JSON, the run lock's fence, where to beat). The loop starts it with Prefect's `run_deployment(...,
  as_subflow=True)`, so the UI shows each remote stage as a child flow run of the loop's run, named like its task
  run would be (`iter-1/dpo`, tags `run:` / `stage:` / `iter:`). The pool is a run parameter, not fixed where
  the flow is defined, which is why this rather than Prefect's infrastructure decorators.
- `check` (in `flows.common.setup`, before any stage runs) refuses a key that is no stage of the flow, a pool the
  server does not have (naming the ones it has) and a run with no API server. For a process pool it (re)creates
  the deployment pointing at this project folder (the pull step of deployments/prefect.yaml); a docker or
  kubernetes pool's deployment must exist already, built on an image holding this project (docs/how-to/pools.md).
- The child runs the stage as the flow process would (flows.tasks.run_stage) and commits to the store; the parent
  then reads the committed manifest from the store, never a Prefect result: any worker that reaches the store
  will do, and resume stays the manifests' job. The child's writes are fenced by the parent's run lock
  (RLHF_FLOWS_FENCE: the lock's URI and token), so a run that lost its lock stops its remote stages too.
- A dead worker (killed with its flow process): the child writes a heartbeat object to the store
  (`{run}/_pools/`) every lease / 4 seconds while its stage runs, and the parent polls it with the child's flow
  run state. A started child whose heartbeat has not changed for the run lock's lease (`lock_lease_s`; three
  leases before its first beat, while its process starts) is dead: the parent marks it Crashed and fails the stage
  naming the pool and the worker; a rerun resumes (a training stage from its last checkpoint). The store, not
  Prefect's signals: it is what every worker and the parent share on any infrastructure, whereas a worker is
  only marked OFFLINE by the server after three missed 30 s heartbeats, and runner heartbeats need an automation.
  A child still Scheduled waits for a worker on its pool, without a limit (a restarted worker picks it up).
- Resume without hand-over: once a child committed, the parent records `{run}/_pools/<label>.json`: the call's
  key (stage, store.CODE_VERSION, the whole config, input fingerprints: what the manifest's fingerprint follows)
  and the manifest it committed, with the pool, worker
  and hand-over seconds. A rerun whose key matches and whose output still holds that manifest skips the stage
  without starting a flow run.
- Hand-over: seconds from the `run_deployment` call to the child starting its stage (the child's clock minus the
  parent's, so a clock skew between hosts adds in), logged per stage and kept in that record.
- Cancellation: the parent cancels its child when it stops waiting for it (the parent failed or killed by a
  signal), and while it waits it watches its own flow run: cancelled (from the UI or `prefect flow-run cancel`),
  it cancels the child and ends Cancelled itself (RunCancelled). A loop started from the command line (`run`) has no worker to act on a
  cancel request, and Prefect's server cancels the subflows of a flow run only once that run is Cancelled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from prefect import flow
from prefect.exceptions import Abort

from flows import table
from rlhf_core import store
from flows.tasks import StageFailed
from stages.common import ConfigError

FLOW = "rlhf-stage"
PROJECT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/pools.py:stage_flow"


class RunCancelled(Abort):
    """The loop's flow run was cancelled while a stage ran on a pool. An Abort, so that Prefect's engine leaves the
    run Cancelled (an ordinary exception would be proposed as Failed over it)."""


# ---------------------------------------------------------------------------------------------- before any work
def stages_of(flow_name: str) -> list[str]:
    """Every stage `flow_name` may call: the shared ones, its iteration's in every variant, its optional ones."""
    spec = table.FLOWS[flow_name]
    names = [*table.SHARED, *spec.iteration, *(s for _, _, v in spec.variants for s in v), *(s for s, _ in spec.optional)]
    return list(dict.fromkeys(names))


def check(pools: dict[str, str], flow_name: str) -> None:
    """Every key of `pools` is a stage of the flow, every pool is on the Prefect API server, and its `rlhf-stage`
    deployment exists (created for a process pool); else a ConfigError naming the key or pool."""
    known = stages_of(flow_name)
    if unknown := [s for s in pools if s not in known]:
        raise ConfigError(f"pools: {', '.join(map(repr, unknown))} is no stage of flow {flow_name} "
                          f"(its stages: {', '.join(known)})")
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise ConfigError("pools: stages on work pools need a Prefect API server with workers, and PREFECT_API_URL "
                          "is not set (docs/how-to/pools.md)")
    with get_client(sync_client=True) as client:
        if (err := client.api_healthcheck()) is not None:
            raise ConfigError(f"pools: no Prefect API server answers at {api} ({type(err).__name__})")
        have = {wp.name: wp for wp in client.read_work_pools()}
        if missing := {s: p for s, p in pools.items() if p not in have}:
            raise ConfigError(f"pools: no work pool {', '.join(f'{p!r} (for {s})' for s, p in missing.items())} on {api}; "
                              f"its pools: {', '.join(sorted(have)) or 'none'}")
        for name in sorted(set(pools.values())):
            deployment(client, have[name])


def deployment(client, pool) -> str:
    """The `rlhf-stage/<pool>` deployment: (re)made from this project folder on a process pool, as
    deployments/prefect.yaml does; on any other pool it must exist (built on an image holding this project)."""
    from prefect.exceptions import ObjectNotFound
    from prefect.utilities.callables import parameter_schema

    name = f"{FLOW}/{pool.name}"
    if pool.type == "process":
        flow_id = client.create_flow_from_name(FLOW)
        client.create_deployment(flow_id, pool.name, work_pool_name=pool.name, entrypoint=ENTRYPOINT, path=str(PROJECT),
                                 pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT)}}],
                                 parameter_openapi_schema=parameter_schema(stage_flow.fn).model_dump(),
                                 description="One stage of an rlhf-flows loop run, on this pool (flows/pools.py).")
        return name
    try:
        client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise ConfigError(f"pools: work pool {pool.name!r} is a {pool.type} pool: deploy {name} (entrypoint {ENTRYPOINT}) "
                          "with an image holding this project first (docs/how-to/pools.md)") from None
    return name


def loop_param(name: str):
    """A parameter of the running loop flow (its `params`: a LoopParams or its dict), None outside one."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    p = (ctx.parameters or {}).get("params") if ctx else None
    return p.get(name) if isinstance(p, dict) else getattr(p, name, None)


def pool_of(stage_name: str) -> str | None:
    """The pool the running loop flow gives `stage_name` (its `pools` parameter), or None: run it in-process."""
    return (loop_param("pools") or {}).get(stage_name)


# ---------------------------------------------------------------------------------------------- the parent's side
def run_on_pool(name: str, cfg, label: str, tags: list[str], pool: str) -> dict:
    """Stage `name` with `cfg` as a child flow run on `pool`; returns the manifest it committed, read from the store."""
    from prefect.logging import get_run_logger

    so, log = cfg.storage_options, get_run_logger()
    fence = json.loads(os.environ[store.FENCE_ENV]) if os.environ.get(store.FENCE_ENV) else None
    if not fence or not loop_param("run_name"):
        raise ConfigError(f"{label}: a stage runs on a work pool only inside a loop flow's run (which holds its lock)")
    run_uri, lease_s = store.join(loop_param("root"), loop_param("run_name")), float(loop_param("lock_lease_s"))
    slug = label.replace("/", "-")
    record_uri = store.join(run_uri, "_pools", f"{slug}.json")
    key = call_key(name, cfg)
    rec = _read(record_uri, so)
    if key and rec and rec.get("key") == key:
        m = store.committed(cfg.output_uri, rec["fingerprint"], so)
        if m is not None and m.created_at == rec["created_at"]:
            return dataclasses.asdict(m)  # committed by an earlier child with this very call: no hand-over

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    beat_uri = store.join(run_uri, "_pools", f"{slug}.beat-{uuid.uuid4().hex[:8]}.json")
    t0 = time.time()
    child = run_deployment(f"{FLOW}/{pool}", parameters=dict(stage=name, config=cfg.model_dump(mode="json"), label=label,
                                                             tags=tags, fence=fence, beat_uri=beat_uri, beat_s=lease_s / 4,
                                                             credentials_block=loop_param("credentials_block")),
                           flow_run_name=label, tags=tags, timeout=0, as_subflow=True)
    log.info("%s: flow run %s on pool %s (deployment %s/%s)", label, child.id, pool, FLOW, pool)
    with get_client(sync_client=True) as client:
        fr, beat = watch(client, child, beat_uri, so, lease_s, label, pool, t0)
        worker = fr.labels.get("prefect.worker.name") or beat.get("worker")
        _settle_parent_task(client, fr)
    if not fr.state.is_completed():
        raise StageFailed(f"stage {name!r} on pool {pool!r} (worker {worker}) failed writing {cfg.output_uri}: "
                          f"flow run {fr.id} {fr.state.name}: {store.redact(fr.state.message or '', so)}")
    try:
        m = store.read_manifest(cfg.output_uri, storage_options=so)
    except store.NotCommittedError:
        raise StageFailed(f"stage {name!r} on pool {pool!r} (worker {worker}) completed but committed nothing at "
                          f"{cfg.output_uri}") from None
    handover = round(beat["started_at"] - t0, 2) if "started_at" in beat else None
    _write(record_uri, so, {"key": key, "fingerprint": m.fingerprint, "created_at": m.created_at, "pool": pool,
                            "worker": worker, "flow_run_id": str(fr.id), "handover_s": handover,
                            "stage_s": round(beat["ended_at"] - beat["started_at"], 2) if beat.get("ended_at") else None})
    _remove(beat_uri, so)
    return dataclasses.asdict(m)


def watch(client, child, beat_uri: str, so: dict, lease_s: float, label: str, pool: str, t0: float):
    """Wait for the child flow run to end; returns it and its last heartbeat. A started child whose heartbeat
    is older than `lease_s` (3 x before its first beat) is marked Crashed and StageFailed raised. A child not
    yet final when this stops waiting (cancel, signal, failure) is cancelled."""
    from prefect.client.schemas.objects import StateType
    from prefect.context import FlowRunContext
    from prefect.logging import get_run_logger
    from prefect.states import Cancelled, Cancelling

    log = get_run_logger()
    seen, heard, said, waiting_said = None, time.time(), False, time.time()
    fr, me = child, FlowRunContext.get().flow_run.id
    try:
        while True:
            parent = client.read_flow_run(me)
            if parent.state and parent.state.type in (StateType.CANCELLING, StateType.CANCELLED):
                # a loop started from the command line has no worker to stop it: it stops here, its child first (finally)
                client.set_flow_run_state(me, Cancelled(message=f"cancelled while {label} ran on pool {pool}"), force=True)
                raise RunCancelled(f"{label}: the loop's flow run was cancelled; its flow run on pool {pool!r} is cancelled")
            fr = client.read_flow_run(child.id)
            beat = _read(beat_uri, so) or {}
            worker = fr.labels.get("prefect.worker.name") or beat.get("worker")
            if not said and "started_at" in beat:
                said = True
                log.info("%s: on pool %s (worker %s), hand-over %.1f s", label, pool, worker, beat["started_at"] - t0)
            if fr.state and fr.state.is_final():
                return fr, beat
            now = time.time()
            if beat.get("beat") != seen:
                seen, heard = beat.get("beat"), now
            elif not beat and fr.state and fr.state.type == StateType.SCHEDULED:
                heard = now  # no worker has taken it yet: waiting is not death
                if now - waiting_said >= 60:  # said after a minute, then each minute
                    waiting_said = now
                    log.info("%s: waiting for a worker on pool %s", label, pool)
            limit = lease_s if beat else 3 * lease_s
            if now - heard > limit:
                why = (f"no heartbeat from flow run {fr.name} ({fr.id}) on pool {pool!r} (worker {worker}) for "
                       f"{now - heard:.0f} s (lock_lease_s={lease_s:g}): its worker or its process died")
                fr = _crash(client, fr, why)
                raise StageFailed(f"{label}: {why}; rerun to resume (nothing it left is committed)")
            time.sleep(1.0)
    finally:
        if fr.state is None or not fr.state.is_final():
            try:
                scheduled = fr.state is None or fr.state.type == StateType.SCHEDULED
                client.set_flow_run_state(fr.id, Cancelled() if scheduled else Cancelling(), force=True)
            except Exception:  # noqa: BLE001  the API gone too: the server cancels subflows of a cancelled run
                pass


def _crash(client, fr, why: str):
    """A dead child: its flow run and the task runs it left Running set Crashed (nothing else will: their process
    is gone), and its stand-in task run in the parent Failed. Returns the flow run as it is now."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterState,
                                                TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    client.set_flow_run_state(fr.id, Crashed(message=why), force=True)
    running = TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]), name=None)
    for tr in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])),
                                    task_run_filter=TaskRunFilter(state=running)):
        client.set_task_run_state(tr.id, Crashed(message=why), force=True)
    fr = client.read_flow_run(fr.id)
    _settle_parent_task(client, fr)
    return fr


def _settle_parent_task(client, fr) -> None:
    """run_deployment's stand-in task run in the parent (Pending as created) takes the child's final state."""
    from prefect.states import Completed, Failed

    if fr.parent_task_run_id and fr.state and fr.state.is_final():
        state = Completed() if fr.state.is_completed() else Failed(message=f"flow run {fr.id}: {fr.state.name}")
        try:
            client.set_task_run_state(fr.parent_task_run_id, state, force=True)
        except Exception:  # noqa: BLE001  cosmetic: never a reason to fail the stage
            pass


def call_key(name: str, cfg) -> str | None:
    """What decides a stage call's result, as its manifest's fingerprint does: stage, CODE_VERSION, config (here
    all of it) and its inputs' fingerprints (None: an input is not a committed artifact, so no skip)."""
    fps = []
    for uri in cfg.input_uris().values():
        try:
            fps.append(store.read_manifest(uri, storage_options=cfg.storage_options).fingerprint)
        except (store.ArtifactError, FileNotFoundError, OSError):
            return None
    payload = "|".join([name, store.CODE_VERSION, cfg.model_dump_json(), *fps])
    return hashlib.sha256(payload.encode()).hexdigest()


def _read(uri: str, so: dict) -> dict | None:
    fs, path = store.filesystem(uri, so)
    try:
        return json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError):
        return None


def _write(uri: str, so: dict, data: dict) -> None:
    store.check_fence()
    fs, path = store.filesystem(uri, so)
    fs.pipe_file(path, json.dumps(data).encode())


def _remove(uri: str, so: dict) -> None:
    fs, path = store.filesystem(uri, so)
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------------- the child's side
@contextmanager
def fenced(fence: dict | None):
    """The parent's run lock as this process's fence (and its jobs'): every write checks the lock's token."""
    before = os.environ.get(store.FENCE_ENV)
    if fence:
        os.environ[store.FENCE_ENV] = json.dumps(fence)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(store.FENCE_ENV, None)
        else:
            os.environ[store.FENCE_ENV] = before


@contextmanager
def heartbeat(uri: str, so: dict, every_s: float):
    """Beat `uri` every `every_s` seconds while inside (who runs the stage, since when); the last beat, written
    on a normal exit, holds `ended_at`."""
    from prefect.runtime import flow_run

    me = {"flow_run_id": str(flow_run.id), "worker": os.environ.get("PREFECT__WORKER_NAME"), "host": socket.gethostname(),
          "pid": os.getpid(), "started_at": time.time(), "beat": 0}
    stop = threading.Event()
    _write(uri, so, me)

    def beat():
        while not stop.wait(every_s):
            me["beat"] += 1
            try:
                _write(uri, so, me)
            except Exception:  # noqa: BLE001  a lost lock or an unreachable store: the parent sees no beat
                return

    t = threading.Thread(target=beat, name="rlhf-stage-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    me.update(beat=me["beat"] + 1, ended_at=time.time())
    _write(uri, so, me)


@flow(name=FLOW, log_prints=True)
def stage_flow(stage: str, config: dict, beat_uri: str, label: str, tags: list[str], beat_s: float = 30.0,
               fence: dict | None = None, credentials_block: str | None = None) -> dict:
    """One stage of a loop run, on the pool its deployment belongs to: flows.tasks.run_stage as the loop's own
    process would run it (its task run named and tagged as there, the loop's credentials block loaded), fenced by
    the loop's run lock; returns (and commits) the manifest."""
    import importlib

    from flows.credentials import use_credentials
    from flows.tasks import run_stage, task_for

    if credentials_block:
        use_credentials(credentials_block)
    so = config.get("storage_options") or {}
    with fenced(fence), heartbeat(beat_uri, so, beat_s):  # beating from here: the stage's imports count as its time
        module = importlib.import_module(f"stages.{stage}")
        out = run_stage(task_for(stage).with_options(task_run_name=label, tags=tags), module.Config(**config))
    return {k: out[k] for k in ("uri", "stage", "fingerprint", "created_at")}
