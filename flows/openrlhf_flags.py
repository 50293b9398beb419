"""The importer's flag tables (flows/openrlhf_flags.yaml, the data) as the rules flows/openrlhf_import.py applies.

A rule is a stage key (str), several keys (list), (keys, converter), a callable value -> {key: value}, or
No(reason); the YAML's header says how each is written there. docs/gen_settings.py inverts the same rules into
the settings tables' "OpenRLHF flag" column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DATA = yaml.safe_load((Path(__file__).with_name("openrlhf_flags.yaml")).read_text())


class No(str):
    """A flag without a counterpart here: the string is the reason, printed in the YAML's header."""


# ---------------------------------------------------------------------------------------------- converters
def steps(v):  # OpenRLHF -1 = never; here 0
    return 0 if int(v) < 0 else int(v)


def param_dtype(v):
    if v not in ("bf16", "fp32"):
        raise ValueError(f"{v!r}: bf16 or fp32 here (fp16 has no counterpart)")
    return v == "bf16"


def sync_backend(v):
    return "collective" if v in ("nccl", "gloo") else v  # OpenRLHF's broadcast over a process group


def reward_source(v):  # --remote_rm_url: a Python file of reward_func, or an HTTP reward server
    return {"reward_func_path" if v.endswith(".py") else "remote_rm_url": v}


CONVERTERS = {"steps": steps, "param_dtype": param_dtype, "sync_backend": sync_backend, "text": str,
              "reward_source": reward_source}


def rule(spec) -> Any:
    """One rule of the YAML as the importer applies it."""
    if isinstance(spec, (str, list)):
        return spec
    if set(spec) == {"not_here"}:
        return No(spec["not_here"])
    if set(spec) == {"as"}:
        return CONVERTERS[spec["as"]]
    if set(spec) == {"key", "value"}:
        const = spec["value"]
        return spec["key"], lambda v: const
    if set(spec) == {"key", "as"}:
        return spec["key"], CONVERTERS[spec["as"]]
    raise ValueError(f"flows/openrlhf_flags.yaml: a rule is KEY, [KEYS], {{not_here}}, {{as}}, {{key, as}} or {{key, value}}: {spec!r}")


def table(name: str) -> dict[str, Any]:
    spec = dict(DATA["tables"][name])
    base = spec.pop("base", None)
    return {**(table(base) if base else {}), **{flag: rule(r) for flag, r in spec.items()}}


DOTTED: dict[str, str] = DATA["dotted"]
FLAGS: dict[str, dict[str, Any]] = {name: table(name) for name in DATA["tables"] if name not in ("common", "train")}
LAUNCHER: dict[str, Any] = {flag: rule(r) for flag, r in DATA["launcher"].items()}
STAGES: dict[str, list[str]] = DATA["stages"]
DEFAULTS: dict[str, dict[str, Any]] = DATA["defaults"]


def flat_name(flag: str) -> str:
    """The v0.9 name of a flag (a flat flag is its own)."""
    if "." not in flag:
        return flag
    if flag in DOTTED:
        return DOTTED[flag]
    head, rest = flag.split(".", 1)
    if "." in rest:
        return flag  # unknown: listed as such
    if head in ("ds", "data", "train") or (head in ("actor", "critic", "reward") and not rest.startswith("num_")):
        return rest  # --ds.zero_stage, --data.max_len, --actor.eps_clip, --critic.value_clip, --reward.overlong_buffer_len
    if head in ("vllm", "ref", "reward", "actor", "critic", "muon"):
        return f"{head}_{rest}"  # --vllm.num_engines -> --vllm_num_engines, --ref.num_nodes -> --ref_num_nodes
    return flag  # unknown: listed as such
