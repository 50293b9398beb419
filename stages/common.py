"""What every stage shares: the config base class and YAML + key=value loading.

A stage module defines
    class Config(StageConfig): ...           # pydantic; fields with descriptions and bounds
    def run(cfg: Config) -> Manifest: ...    # plain function: the algorithm; idempotent via the manifest
so `rlhf-flows stage NAME --config FILE key=value` can load any of them the same way. Stages import neither
Prefect nor Ray (a stage that starts actors imports Ray inside the function that does): the flows own Prefect
and wrap each stage's `run` in a task (flows/tasks.py), so a stage runs where only its own dependencies are
installed (a training stage on a GPU machine with DeepSpeed and pydantic).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

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
