"""Stages as Prefect tasks: the flows' side of a stage. A stage module is plain (stages/common.py: a Config and a
`run`); here its `run` becomes a Prefect task with a cache key over the stage's source, its config and its inputs'
fingerprints (`task_for`), the task's log carries the job's lines (`run_log`), and `run_stage` trusts a cache hit
only while the store still holds the artifact it recorded.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from rlhf_core import store

PACKAGES = ("rlhf_core", "stages", "flows")


@functools.lru_cache(maxsize=None)
def source_version(root: str = str(Path(__file__).resolve().parents[1])) -> str:
    """A hash of every .py file of the project's packages: any code edit changes it (no manual bump)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for f in sorted((Path(root) / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _cache_key(context, parameters) -> str | None:
    """Prefect cache key: the stage module's own source + the package's source version + config + the
    fingerprints of its committed inputs. The stage's own manifest check (run() returning the committed
    artifact) stays the authority; see `call`."""
    cfg = parameters["cfg"]
    fps = []
    for uri in cfg.input_uris().values():
        try:
            fps.append(store.read_manifest(uri, storage_options=cfg.storage_options).fingerprint)
        except store.ArtifactError:
            return None  # inputs are not all committed: do not cache
    src = getattr(context.task.fn, "stage_source", None) or inspect.getsource(context.task.fn)
    payload = "|".join([context.task.name, src, source_version(), store.CODE_VERSION, cfg.model_dump_json(), *fps])
    return hashlib.sha256(payload.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def task_for(name: str):
    """The Prefect task of stages/<name>.py (one per process)."""
    return stage_task(name, importlib.import_module(f"stages.{name}").run)


def stage_task(name: str, run: Callable, **options):
    """The thin Prefect task around a stage's `run`: returns the manifest as a dict (small, JSON)."""
    from prefect import task

    def body(cfg):
        import dataclasses

        with run_log():
            try:
                return dataclasses.asdict(run(cfg))
            except Exception as e:  # Prefect logs and stores a task's exception: only a redacted one gets there
                clean = store.redact_error(e, cfg.storage_options)
                if clean is e:
                    raise
                raise clean from None

    body.__name__ = f"{name}_task"
    body.__qualname__ = body.__name__
    body.__doc__ = f"Prefect task running stages.{name}.run(cfg); returns the committed manifest."
    body.stage_source = inspect.getsource(sys.modules[run.__module__])  # the generic body is the same for all
    return task(name=name, cache_key_fn=_cache_key, persist_result=True, result_serializer="json",
                task_run_name=f"{name}", **options)(body)


@contextmanager
def run_log():
    """Inside a Prefect task: every `rlhf_flows` line (the training job's step / loss / tokens/s lines,
    DeepSpeed's, progress rows) goes to the task's run logger, so the flow run's log in the UI and API holds
    them. A handler added here, not PREFECT_LOGGING_EXTRA_LOGGERS: Prefect reads that setting when it
    configures logging, which happens before a stage module is imported."""
    import logging

    from prefect.logging import get_run_logger

    from rlhf_core.runtime import progress

    run_logger = get_run_logger()

    class ToRunLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if worth_a_look(msg, record.levelno):
                run_logger.log(record.levelno, "%s", msg)
            else:  # at debug level in the run log; still on the console of a flow run's CLI / the worker, as before
                run_logger.debug("%s", msg)
                sys.stderr.write(msg + "\n")  # not print(): the flows' log_prints would send it to the run log

    progress.install()
    handler, log = ToRunLog(), logging.getLogger("rlhf_flows")
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False  # Prefect's console shows the run log: not twice
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def worth_a_look(msg: str, level: int) -> bool:
    """Whether a job's line stays at its level in the Prefect run log: warnings, what the CLI prints by default
    (progress.Display.NOTABLE) and about every tenth training step line (loss, tokens/s, ETA; the first and the
    last); the other step lines, the launcher's chatter, the generate / score row counts (the progress card
    shows them) and empty lines go at debug level, and to stderr as they are (the console of the
    flow's CLI run or of the worker shows them as before)."""
    from rlhf_core.runtime import progress

    ev = progress.parse(msg)
    if level >= logging.WARNING:
        return True
    if ev:
        return ev.what == "train" and (ev.done in (1, ev.total) or ev.done % max(1, ev.total // 10) == 0)
    return msg.strip().startswith(progress.Display.NOTABLE)


class StageFailed(RuntimeError):
    """A stage failed inside a flow; names the stage and the artifact it was writing."""


def run_stage(stage_task_obj, cfg) -> dict:
    """Run a stage task through Prefect's cache, trusting a cache hit only when the store still holds the
    very artifact the cache recorded (same fingerprint and created_at): persisted results outlive Prefect
    databases and can point at an artifact that was since deleted or rewritten. Otherwise the stage runs
    (and itself skips work if the store holds its fingerprint). A failure is re-raised naming the stage and
    its output URI; nothing was committed there, so a rerun resumes."""
    try:
        out = stage_task_obj.with_options(refresh_cache=not store.committed_any(cfg.output_uri, cfg.storage_options))(cfg)
        try:
            held = store.read_manifest(cfg.output_uri, storage_options=cfg.storage_options)
        except store.NotCommittedError:
            held = None
        if held is None or (held.fingerprint, held.created_at) != (out["fingerprint"], out["created_at"]):
            out = stage_task_obj.with_options(refresh_cache=True)(cfg)
        return out
    except Exception as e:
        err = StageFailed(f"stage {stage_task_obj.name!r} failed writing {cfg.output_uri}: "
                          f"{type(e).__name__}: {store.redact(str(e), cfg.storage_options)}")
        if store.redact_error(e, cfg.storage_options) is e:
            raise err from e
        raise err from None  # the original chain holds a secret: it stays here
