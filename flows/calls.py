"""How a flow runs a stage: the stage's Config from the flow's settings plus the URIs it wires in
(`stage_config`), then the Prefect task (`call`), which also moves the run's progress bar and stops a run that
lost its lock before the stage starts. Every flow reaches every stage through these two functions.
"""
from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import re
import time

from pydantic import ValidationError

from rlhf_core import store
from flows.tasks import run_stage, task_for
from stages.common import ConfigError

_progress: dict = {}  # the running flow's Prefect progress artifact: {"id", "done", "total"}


def stage(name: str):
    """The stage module stages/<name>.py."""
    return importlib.import_module(f"stages.{name}")


def settings(section) -> dict:
    """The settings a flow's stage section holds beyond the stage's defaults (a typed section from
    flows.common.section, or a plain dict)."""
    if isinstance(section, dict):
        return section
    fields = type(section).model_fields
    return {k: v for k, v in section.model_dump().items() if v != fields[k].get_default(call_default_factory=True)}


def stage_config(module, base, **fields):
    """module.Config from a flow's stage section (or dict) plus the URIs the flow wires in."""
    try:
        return module.Config(**{**settings(base), **fields})
    except ValidationError as e:
        name = module.__name__.rsplit(".", 1)[-1]
        lines = [f"  {name}.{'.'.join(map(str, err['loc']))}: "
                 + ("unknown field (typo?)" if err["type"] == "extra_forbidden" else err["msg"]) for err in e.errors()]
        raise ConfigError(f"invalid flow config for stage {name}:\n" + "\n".join(lines)) from None


def call(module, cfg) -> dict:
    """Run one stage, stages/<name>.py given as its module, as a Prefect task (flows.tasks.run_stage, or on the work pool the flow's `pools` names for it: flows/pools.py)
    and advance the flow's progress artifact: per stage, and inside an in-process stage per training step line /
    finished generate or score chunk (at most once a second). A run whose lock was lost stops here, before the
    next stage starts."""
    from flows import pools
    from rlhf_core.runtime import progress

    store.check_fence()
    name = module.__name__.rsplit(".", 1)[-1]
    label, tags = task_run_label(name, cfg.output_uri)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")  # as manifests write times
    if (pool := pools.pool_of(name)):  # a child flow run on its work pool (flows/pools.py)
        run = functools.partial(pools.run_on_pool, name, cfg, label, tags, pool)
    else:
        run = functools.partial(run_stage, task_for(name).with_options(task_run_name=label, tags=tags), cfg)
    if not _progress.get("id"):
        return _said(label, run(), started)
    from prefect.artifacts import update_progress_artifact

    last = [0.0]

    def within(ev: progress.Event) -> None:
        if time.time() - last[0] >= 1.0 or ev.done >= ev.total:
            last[0] = time.time()
            frac = min(1.0, ev.done / max(1, ev.total))
            update_progress_artifact(_progress["id"], progress=min(100.0, 100.0 * (_progress["done"] + frac) / _progress["total"]))

    progress.listeners.append(within)
    try:
        out = run()
    finally:
        progress.listeners.remove(within)
    _progress["done"] += 1
    update_progress_artifact(_progress["id"], progress=min(100.0, 100.0 * _progress["done"] / _progress["total"]))
    return _said(label, out, started)


def _said(label: str, out: dict, started: str) -> dict:
    """One line in the run log per stage call: what it committed, or that it was committed before this call
    began (a rerun or a retry skips it)."""
    logger = run_logger()
    if out["created_at"] < started:
        logger.info("%s: committed at %s, skipped", label, out["finished_at"])
    else:
        logger.info("%s: committed %s", label, out["uri"])
    return out


def run_logger():
    """The flow run's logger (its lines are the run log in the UI); the `rlhf_flows` logger outside a flow run."""
    import logging

    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001  outside a flow run
        return logging.getLogger("rlhf_flows")


def task_run_label(stage: str, output_uri: str) -> tuple[str, list[str]]:
    """What the UI shows for a stage call: its place in the run (`iter-2/dpo`, `prompts`, `iter-1/eval_low`)
    as the task run's name, and tags `run:NAME`, `stage:dpo`, `iter:2` to filter by."""
    parts = str(output_uri).rstrip("/").split("/")
    if len(parts) >= 3 and re.fullmatch(r"iter-\d+", parts[-2]):
        run, label, it = parts[-3], "/".join(parts[-2:]), parts[-2].split("-")[1]
        return label, [f"run:{run}", f"stage:{stage}", f"iter:{it}"]
    return parts[-1], [f"run:{parts[-2] if len(parts) >= 2 else parts[-1]}", f"stage:{stage}"]


def scheduled_name(name: str) -> str:
    """`name` with `{scheduled}` replaced by the flow run's scheduled start (UTC, to the minute; now outside a
    flow run): a scheduled deployment's run folder per night (flows/promotion.py), the same for its retries."""
    if "{scheduled}" not in name:
        return name
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time.astimezone(dt.timezone.utc)
    return name.replace("{scheduled}", when.strftime("%Y-%m-%dT%H%MZ"))


def start_progress(flow: str, stages: int) -> None:
    """A progress bar in the UI for this flow run: stage calls done of `stages` planned (a retry moves the card
    its earlier attempt left, from 0)."""
    _progress.clear()
    if not stages:
        return
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        _progress.update(id=card(f"{flow}-progress", f"{flow}: stages done of {stages} planned", progress=0.0),
                         done=0, total=stages)


_cards: dict[tuple[str, str], object] = {}  # (flow run id, key) -> artifact id


def card(key: str, description: str, *, table: list[dict] | None = None, markdown: str | None = None,
         progress: float | None = None):
    """This flow run's one artifact `key`, updated in place: Prefect keeps every version created under a key, so
    a card created at each publish (and again by each retry) would fill the run's Artifacts tab with copies.
    Created the first time, found again by a retry of the same flow run (its earlier attempt's card), then
    updated. Returns the artifact id."""
    from prefect.artifacts import (TableArtifact, create_markdown_artifact, create_progress_artifact,
                                   create_table_artifact, update_progress_artifact)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.context import FlowRunContext

    run_id = str(FlowRunContext.get().flow_run.id)
    if (run_id, key) not in _cards:
        with get_client(sync_client=True) as client:
            old = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])),
                sort=ArtifactSort.CREATED_DESC, limit=1)
        if old:
            _cards[run_id, key] = old[0].id
    art = _cards.get((run_id, key))
    if art is None:
        made = (create_table_artifact(table, key=key, description=description) if table is not None
                else create_markdown_artifact(markdown, key=key, description=description) if markdown is not None
                else create_progress_artifact(progress, key=key, description=description))
        _cards[run_id, key] = made
        return made
    if progress is not None:
        update_progress_artifact(art, progress=progress, description=description)
        return art
    data = json.dumps(TableArtifact._sanitize(table)) if table is not None else markdown
    with get_client(sync_client=True) as client:
        client.update_artifact(art, ArtifactUpdate(data=data, description=description))
    return art


def finish_progress() -> None:
    """An early stop skips planned stages: the bar ends at 100%."""
    if _progress.get("id"):
        from prefect.artifacts import update_progress_artifact

        update_progress_artifact(_progress["id"], progress=100.0)
