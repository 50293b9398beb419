"""The settings reference, generated from the pydantic models at every `mkdocs build` (a mkdocs hook, named in
mkdocs.yml; nothing generated is committed). A page holds markers that this hook replaces:

    <!-- docstring: stages/dpo.py -->     the module's docstring (the stage's / flow's own user doc)
    <!-- settings: stage dpo -->          one table of stages/dpo.py's Config
    <!-- settings: flow iterative-dpo --> one table of the flow's Params (stage sections link to their stage)

A table row is the setting's name, type, default, description and the OpenRLHF flag it replaces: the importer's
tables (flows/openrlhf/importer.py: FLAGS, LAUNCHER, DOTTED) inverted, so the reference and `import-openrlhf`
cannot disagree. A marker naming an unknown stage, flow or file fails the build.
"""
from __future__ import annotations

import ast
import functools
import importlib
import json
import re
import sys
import typing
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- (docstring|settings): (?:(stage|flow) )?([\w./-]+) -->")
if str(ROOT) not in sys.path:  # mkdocs loads this file by path: the project's packages from the repo root
    sys.path.insert(0, str(ROOT))


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: expand(m.group(1), m.group(2), m.group(3)), markdown)


def expand(what: str, kind: str | None, name: str) -> str:
    if what == "docstring":
        path = ROOT / name
        if not path.is_file():
            raise ValueError(f"docstring marker: {name} does not exist")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        return docstring_markdown(doc)
    if kind == "stage":
        config = importlib.import_module(f"stages.{name}").Config
        inputs = [f"`{k}`" for k in config.model_fields if k.endswith("_uri") and k != "output_uri"]
        return (f"Inputs (committed artifacts or URIs): {', '.join(inputs) or 'raw sources (`data`)'}; output: one "
                f"artifact at `output_uri`, committed by its `_MANIFEST.json`.\n\n" + settings_table(config, stage=name)
                + "\nOpenRLHF flag: the flags `rlhf-flows import-openrlhf` turns into this key (v0.9's flat name, then "
                "v0.10+'s dotted ones).\n")
    from flows.table import FLOWS

    if name not in FLOWS:
        raise ValueError(f"settings marker: unknown flow {name!r}; choose from {', '.join(FLOWS)}")
    return settings_table(importlib.import_module(FLOWS[name].module).Params, stage=None)


def docstring_markdown(doc: str) -> str:
    """Indented lines (commands, a loop's outline) become a fenced block; prose stays prose."""
    out, block = [], []
    for line in doc.splitlines() + [""]:
        if line.startswith("  "):
            block.append(line)
            continue
        if block:
            indent = min(len(b) - len(b.lstrip()) for b in block)
            out += ["", "```text", *(b[indent:] for b in block), "```", ""]
            block = []
        out.append(line)
    return "\n".join(out).strip() + "\n"


# ---------------------------------------------------------------------------------------------- the flags
@functools.cache
def openrlhf_flags() -> dict[tuple[str, str], list[str]]:
    """(stage, key) -> the OpenRLHF flags the importer turns into that key: its tables' entries, and a flag of
    the key's own name that OpenRLHF's parser has (the importer's rule for a flag its table does not list).
    Each flag with every name it had (v0.9's flat name first, then v0.10+'s dotted ones)."""
    from flows.openrlhf import importer as imp

    parsers = json.loads((ROOT / "docs" / "openrlhf_flags.json").read_text())  # module -> {flat: [names]}
    tables = [(imp.FLAGS[m], sections[0], parsers.get(m, {})) for m, sections in imp.STAGES.items()]
    tables += [(imp.FLAGS[task], task, parsers["batch_inference"]) for task in ("generate", "score")]
    dotted = defaultdict(list)
    for new, flat in imp.DOTTED.items():
        dotted[flat].append(new)
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for table, main, parser in tables:
        fields = importlib.import_module(f"stages.{main}").Config.model_fields
        launcher = {f: r for f, r in imp.LAUNCHER.items() if isinstance(r, str) and r in fields}
        rules = {**launcher, **table, **{k: k for k in fields if k in parser and k not in table}}
        for flag, rule in rules.items():
            names = [f"--{n}" for n in dict.fromkeys([flag, *parser.get(flag, []), *dotted.get(flag, [])])]
            for key in rule_keys(rule):
                section, key = key.split(".", 1) if "." in key else (main, key)
                out[(section, key)] += [n for n in names if n not in out[(section, key)]]
    return out


def rule_keys(rule) -> list[str]:
    """The keys one importer rule sets (see the FLAGS comment in flows/openrlhf/importer.py)."""
    from flows.openrlhf.importer import No

    if isinstance(rule, No):
        return []
    if isinstance(rule, str):
        return [rule]
    if isinstance(rule, list):
        return rule
    if isinstance(rule, tuple):
        return rule_keys(rule[0])
    keys = []  # a callable picks its keys from the value (--remote_rm_url: a .py file or a URL)
    for probe in ("reward.py", "http://host:5000/get_reward"):
        keys += [k for k in rule(probe) if k not in keys]
    return keys


def flag_cell(stage: str, key: str) -> str:
    return " ".join(f"`{f}`" for f in openrlhf_flags().get((stage, key), []))


# ---------------------------------------------------------------------------------------------- the table
def settings_table(model, stage: str | None) -> str:
    flags = stage is not None  # a flow's parameters replace no single OpenRLHF flag
    rows = ["| setting | type | default | description |" + (" OpenRLHF flag |" if flags else ""),
            "|---|---|---|---|" + ("---|" if flags else "")]
    for name, info in model.model_fields.items():
        section = section_stage(info.annotation)
        kind = f"[{section} settings](../stages/{section}.md#settings)" if section else f"`{type_name(info.annotation)}`"
        rows.append(f"| `{name}` | {kind} | {default_cell(info, section)} | {cell(info.description or '')} |"
                    + (f" {flag_cell(stage, name)} |" if flags else ""))
    return "\n".join(rows) + "\n"


def section_stage(annotation) -> str | None:
    """The stage a flow's typed section is made from (flows.common.section titles it 'NAME settings')."""
    for t in typing.get_args(annotation) or (annotation,):
        title = getattr(t, "model_config", {}).get("title") or ""
        if title.endswith(" settings") and (ROOT / "stages" / f"{title.split()[0]}.py").exists():
            return title.split()[0]
    return None


def type_name(annotation) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)


def default_cell(info, section: str | None) -> str:
    from pydantic_core import PydanticUndefined

    if info.is_required():
        return "required"
    if section:
        return "stage defaults"
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is PydanticUndefined:
        return ""
    return f"`{cell(repr(value) if isinstance(value, str) else str(value).replace('None', 'null'))}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":  # print one table: python docs/gen_settings.py stage dpo
    print(expand("settings", sys.argv[1], sys.argv[2]))
