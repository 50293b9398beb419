"""The importer's flag tables (flows/openrlhf/flags.yaml, the data) as the rules flows/openrlhf/importer.py applies.

A rule is a stage key (str), several keys (list), (keys, converter), a callable value -> {key: value}, or
No(reason); the YAML's header says how each is written there. docs/gen_settings.py inverts the same rules into
the settings tables' "OpenRLHF flag" column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DATA = yaml.safe_load((Path(__file__).with_name("flags.yaml")).read_text())


class No(str):
    """A flag without a counterpart here: the string is the reason, printed in the YAML's header."""


class NoCounterpart(ValueError):
    """Raised by a converter for a value without a counterpart (the flag is listed with the message)."""


class Fixed(No):
    """The stage always behaves as the flag set to `value` (no key): listed as holding here; another value is
    listed as having no counterpart (why). A No to whatever only asks which keys a rule sets (docs/gen_settings.py)."""

    def __new__(cls, value: Any, why: str):
        rule = super().__new__(cls, why)
        rule.value, rule.why = value, why
        return rule


class SplitOf(No):
    """OpenRLHF's --dataset_split / --prompt_split X: the split of the sources `source` (a flag) names, written
    here as `@X` after each of them (rlhf_core.inputs.data.source_split); train, the default, holds as it is."""

    def __new__(cls, source: str):
        rule = super().__new__(cls, f"the split of --{source}'s sources: each written as SOURCE@SPLIT")
        rule.source = source
        return rule


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


def icepop(v):  # OpenRLHF's vLLM IS correction type: tis clamps the ratio, icepop zeroes it outside the range
    if v not in ("tis", "icepop"):
        raise NoCounterpart(f"{v}: TIS (clamp) and ICEPOP (zero outside the threshold) only")
    return v == "icepop"


def backend(v):  # batch_inference --eval_task: generate (transformers) or generate_vllm
    return "vllm" if v == "generate_vllm" else "hf"


def include(v):
    """deepspeed --include HOST[:SLOTS][@HOST[:SLOTS]]: the ranks per node (and nodes) it selects."""
    hosts = [h for h in str(v).split("@") if h]
    slots = [len(h.split(":", 1)[1].split(",")) if ":" in h else None for h in hosts]
    if len(set(slots)) > 1:  # None: a host without slots, every GPU it has
        raise NoCounterpart(f"{slots} GPUs on the {len(hosts)} hosts: the stages place the same number per node")
    return {"num_gpus": slots[0] or "all", **({"num_nodes": len(hosts)} if len(hosts) > 1 else {})}


CONVERTERS = {"steps": steps, "param_dtype": param_dtype, "sync_backend": sync_backend, "text": str,
              "reward_source": reward_source, "icepop": icepop, "backend": backend, "include": include}


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
    if set(spec) == {"fixed", "why"}:
        return Fixed(spec["fixed"], spec["why"])
    if set(spec) == {"split_of"}:
        return SplitOf(spec["split_of"])
    raise ValueError(f"flows/openrlhf/flags.yaml: a rule is KEY, [KEYS], {{not_here}}, {{fixed, why}}, {{split_of}}, "
                     f"{{as}}, {{key, as}} or {{key, value}}: {spec!r}")


def table(name: str) -> dict[str, Any]:
    spec = dict(DATA["tables"][name])
    base = spec.pop("base", None)
    return {**(table(base) if base else {}), **{flag: rule(r) for flag, r in spec.items()}}


DOTTED: dict[str, str] = DATA["dotted"]
FLAGS: dict[str, dict[str, Any]] = {name: table(name) for name in DATA["tables"] if name not in ("common", "train")}
LAUNCHER: dict[str, Any] = {flag: rule(r) for flag, r in DATA["launcher"].items()}
STAGES: dict[str, list[str]] = DATA["stages"]
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = DATA["defaults"]  # version -> module -> {flat flag: value}
DEFAULT_WHEN: dict[str, str] = DATA["default_when"]
VLM_FLAGS: list[str] = DATA["vlm_flags"]
SERVE_RM: dict[str, Any] = {flag: rule(r) for flag, r in DATA["serve_rm"].items()}
SERVE_RM_DEFAULTS: dict[str, Any] = DATA["serve_rm_defaults"]
PLACEMENT: dict[str, dict[str, Any]] = DATA["placement_defaults"]
PARSERS: dict[str, set[str]] = {m: set(names) | set(DATA["older_parsers"].get(m, [])) for m, names in DATA["parsers"].items()}


def prefixed(module: str, name: str, table: dict) -> list[str]:
    """The flags of OpenRLHF's parser that `name` abbreviates (argparse's allow_abbrev), when it is no flag itself."""
    if module not in PARSERS or name in PARSERS[module] or name in table:
        return []
    return sorted(f for f in PARSERS[module] if f.startswith(name))


def unknown_flag(module: str, name: str) -> str | None:
    """Why a flag without a rule has none, when OpenRLHF's own parser does not know it either."""
    import difflib

    if module not in PARSERS or name in PARSERS[module]:
        return None
    if len(many := prefixed(module, name, {})) > 1:
        return (f"an ambiguous prefix of {', '.join('--' + f for f in many)}: OpenRLHF's {module} parser refuses the "
                "command")
    near = difflib.get_close_matches(name, PARSERS[module], n=1, cutoff=0.75)
    return (f"not a flag of OpenRLHF's {module} (its parser refuses the command)"
            + (f"; --{near[0]}?" if near else ""))


def version_of(module: str, dotted: bool) -> str:
    """The OpenRLHF version whose defaults a command gets (see the `defaults` comment of the YAML)."""
    if module not in DEFAULTS["v0.11.0"] and module in DEFAULTS["v0.9.5"]:
        return "v0.9.5"
    return "v0.11.0" if dotted else "v0.9.10"


def defaults(module: str, dotted: bool, written: set[str]) -> list[tuple[str, Any]]:
    """(flag, OpenRLHF's default) for the flags a command omits, each applying under its DEFAULT_WHEN."""
    out = []
    for flag, value in {**DEFAULTS[version_of(module, dotted)].get(module, {}), **PLACEMENT.get(module, {})}.items():
        when = DEFAULT_WHEN.get(flag, "")
        if flag in written or (when[:1] == "+" and when[1:] not in written) or (when[:1] == "-" and when[1:] in written):
            continue
        out.append((flag, value))
    return out


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
