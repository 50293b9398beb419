"""What every stage shares: the config base class, YAML + key=value loading, and the thin Prefect task.

A stage module defines
    class Config(StageConfig): ...           # pydantic; fields with descriptions and bounds
    def run(cfg: Config) -> Manifest: ...    # plain function: the algorithm; idempotent via the manifest
    task = stage_task("name", run)           # the Prefect task flows call
so `rlhf-flows stage NAME --config FILE key=value` can load any of them the same way.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlhf_core import store


class ConfigError(ValueError):
    """A config that cannot run; the message names the file and the field."""


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors (typos), values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    output_uri: str = Field(description="Where the artifact is written (fsspec URI); committed by _MANIFEST.json.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description=
                                            "fsspec options for s3/gs: endpoint, region... never credentials "
                                            "(those come from the environment).")
    _no_secrets = field_validator("storage_options")(classmethod(lambda cls, v: store.check_no_secrets(v)))

    # Fields that do not change what the stage produces (placement, parallelism): left out of the fingerprint.
    runtime_fields: ClassVar[set[str]] = {"output_uri", "storage_options"}

    def semantic(self) -> dict:
        """The config as it enters the fingerprint."""
        return self.model_dump(mode="json", exclude=self.runtime_fields)

    def input_uris(self) -> dict[str, str]:
        """Input artifact URIs by field name: every set field ending in `_uri` except output_uri."""
        return {k: v for k, v in self.model_dump().items() if k.endswith("_uri") and k != "output_uri" and v}


def parse_overrides(pairs: list[str]) -> dict:
    """["a.b=1", "c=x"] -> {"a": {"b": 1}, "c": "x"}; values are parsed as YAML scalars."""
    out: dict = {}
    for p in pairs:
        if "=" not in p:
            raise ConfigError(f"override {p!r} is not key=value")
        key, val = p.split("=", 1)
        node = out
        parts = key.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        try:
            node[parts[-1]] = yaml.safe_load(val) if val else ""
        except yaml.YAMLError:  # not a YAML scalar (e.g. "a: b: c", "..."): the text itself
            node[parts[-1]] = val
    return out


def merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, section by section; `section=null` drops a section `base` sets (its default applies)."""
    out = dict(base)
    for k, v in extra.items():
        if v is None and isinstance(out.get(k), dict):
            del out[k]
        else:
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls: type[BaseModel], path: str | Path | None = None, overrides: list[str] | dict | None = None,
                section: str | None = None) -> BaseModel:
    """A config model from a YAML file plus key=value overrides; errors name the file and the field."""
    data: dict = {}
    where = str(path) if path else "<overrides>"
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        if section:
            data = data.get(section, data)
    data = merge(data, overrides if isinstance(overrides, dict) else parse_overrides(overrides or []))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: invalid {cls.__name__}:\n" + _fields(e)) from None


def _fields(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        msg = "unknown field (typo?)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- Prefect
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

    from rlhf_core import progress

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
    from rlhf_core import progress

    ev = progress.parse(msg)
    if level >= logging.WARNING:
        return True
    if ev:
        return ev.what == "train" and (ev.done in (1, ev.total) or ev.done % max(1, ev.total // 10) == 0)
    return msg.strip().startswith(progress.Display.NOTABLE)


class StageFailed(RuntimeError):
    """A stage failed inside a flow; names the stage and the artifact it was writing."""


def call(stage_task_obj, cfg) -> dict:
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
