"""The run lock: one writer per run folder, held in `{root}/{run_name}/_LOCK.json` for the whole flow run.

A lease (rlhf_core/store/locks.py): a second live starter gets LockHeld naming the holder; a stale lock (its lease
expired, or its process dead in this pid namespace) is taken over. While held, it is the store's fence: every
write of this process, and of the training jobs and local Ray workers it starts (RLHF_FLOWS_FENCE), first
checks that the lock still holds this run's token, so a run that lost its lock (paused past its lease, cut off
from the store) writes nothing more and stops with LockLost naming the new holder.

Holding the lock also settles what a dead attempt left in Prefect: its task runs (and its flow run, for a
rerun) stay "Running" forever after a kill -9, so they are set Crashed here, and a takeover is said in the
run log (flows/report.py adds the dead attempt's seconds to the run's wall_s from the stale lock).
"""
from __future__ import annotations

from contextlib import contextmanager

from flows.calls import run_logger

DEFAULT_ROOT = "runs"  # LoopParams.root's default (flows/common.py reads it from here)
from rlhf_core.store import locks
from rlhf_core import store
from rlhf_core.store.locks import LockHeld, LockLost  # noqa: F401  (what a flow run may raise)

LOCK = "_LOCK.json"
held: dict[str, locks.Lease] = {}  # run URI -> this process's lease on it (its start, and the stale one it replaced)


@contextmanager
def run_lock(root: str, run_name: str, lease_s: float = 120.0, storage_options: dict | None = None):
    """Hold the run `{root}/{run_name}` for the block; yields the fencing check."""
    run_uri = store.join(root, run_name)
    fs, path = store.filesystem(run_uri, storage_options)
    fs.makedirs(path, exist_ok=True)
    with locks.lease(fs, store.join(path, LOCK), store.join(run_uri, LOCK), lease_s, what=f"run {run_uri}",
                     redact=lambda t: store.redact(t, storage_options),
                     hint="; wait for it, or pick another run_name") as lease:
        with store.fence(lease.check, store.join(run_uri, LOCK), lease.me["token"], storage_options):
            if lease.took_over:
                run_logger().warning("took over the stale lock of run %s from %s (refreshed %.0fs before)", run_uri,
                                  locks.describe(lease.took_over), lease.me["acquired_at"] - lease.took_over.get("refreshed_at", 0))
            try:
                crash_dead_attempts(run_name, root)
            except Exception as e:  # noqa: BLE001  bookkeeping in Prefect's records: never a reason to stop the run
                run_logger().warning("could not mark a dead attempt's task runs Crashed: %s: %s", type(e).__name__, e)
            held[run_uri] = lease
            try:
                yield lease.check
            finally:
                held.pop(run_uri, None)


def crash_dead_attempts(run_name: str, root: str) -> None:
    """Task runs of this run (tag `run:NAME`, flow parameter `root`) still Running in Prefect belong to an attempt
    that died without telling the API (we hold the lock, so none is alive): set them, and their flow run if it
    is not this one, Crashed."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (TaskRunFilter, TaskRunFilterState, TaskRunFilterStateType,
                                                TaskRunFilterTags)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    log, me = run_logger(), ctx.flow_run.id
    with get_client(sync_client=True) as client:
        running = client.read_task_runs(task_run_filter=TaskRunFilter(
            tags=TaskRunFilterTags(all_=[f"run:{run_name}"]),
            state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]), name=None)))
        flow_runs: dict = {}
        for tr in running:
            if tr.flow_run_id not in flow_runs:
                flow_runs[tr.flow_run_id] = client.read_flow_run(tr.flow_run_id)
            p = flow_runs[tr.flow_run_id].parameters.get("params") or {}  # a deployment run's: merged (common.run_params)
            if str(p.get("root", DEFAULT_ROOT)).rstrip("/") != str(root).rstrip("/"):
                continue  # the same run name under another root
            why = f"its attempt died (flow run {tr.flow_run_id} lost its process); run {run_name} is held by this attempt now"
            client.set_task_run_state(tr.id, Crashed(message=why), force=True)
            log.warning("%s: marked Crashed (%s)", tr.name, why)
        for fid, fr in flow_runs.items():
            if fid != me and fr.state and fr.state.type == StateType.RUNNING:
                client.set_flow_run_state(fid, Crashed(message=f"its process died; run {run_name} was taken over by "
                                                              f"flow run {me}"), force=True)
