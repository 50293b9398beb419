"""`rlhf-flows import-openrlhf FILE|-`: an OpenRLHF launch command or script -> the equivalent stage YAML.

Reads `deepspeed [launcher args] --module openrlhf.cli.MODULE ...`, `python -m openrlhf.cli.train_ppo_ray ...` and
`ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray ...`, alone or inside a shell script (line
continuations, comments, simple `VAR=value` assignments and OpenRLHF's `read -r -d '' VAR <<EOF` blocks are
substituted), in both of OpenRLHF's dialects: the flat flags of v0.9 (`--pretrain`, `--micro_train_batch_size`)
and the dotted flags of v0.10+ (`--model.model_name_or_path`, `--train.micro_batch_size`). A dotted flag is first
renamed to the flat flag it replaced (from OpenRLHF's commit ed62d0e2 "dotted config hierarchy"), so both
dialects go through one table per module and give the same YAML; each key's comment names the flag as written.
The tables are data: flows/openrlhf_flags.yaml, read by flows/openrlhf_flags.py. A flag without a counterpart is listed at the top with the reason, never dropped; a hub id
(`meta-llama/Meta-Llama-3-8B`) becomes a local-folder placeholder with a "download it and pass the folder" note
(this project never downloads). The YAML is parsed back and validated with each stage's Config before it is
printed.

    rlhf-flows import-openrlhf tests/flows/openrlhf_commands/train_sft_v0.9.10.sh -o sft.yaml
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flows.openrlhf_flags import DEFAULTS, DOTTED, FLAGS, LAUNCHER, STAGES, No, flat_name  # noqa: F401 (the tables' API)


class CommandError(ValueError):
    """A command that cannot be imported; the message names the module, the flag or the line."""


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class Command:
    module: str  # train_sft ...
    launcher: list[tuple[str, Any]]  # (flag, value) before the module
    flags: list[tuple[str, Any]]  # (flag as written, value: str, list of str, or True for a bare flag)
    line: int
    unresolved: list[str] = field(default_factory=list)  # $VARs the script does not set simply

    @property
    def dialect(self) -> str:
        return "v0.10+ dotted flags" if any("." in f for f, _ in self.flags) else "v0.9 flat flags"


def logical_lines(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, text, None) with continuations joined; a `read -r -d '' VAR <<EOF` block is (line, its
    body as one line, VAR)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        heredoc = re.match(r"\s*read\s+(?:-\w+\s+(?:''\s+)?)*(\w+)\s*<<\s*['\"]?(\w+)['\"]?\s*$", line)
        if heredoc:
            var, end = heredoc.groups()
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != end:
                body.append(lines[i])
                i += 1
            out.append((start, " ".join(b.rstrip().removesuffix("\\") for b in body), var))
        else:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            out.append((start, line, None))
        i += 1
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} of the script's simple assignments (others stay as written)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def words(line: str, env: dict[str, str]) -> list[str]:
    """Shell words of a line, comments dropped and $VAR / ${VAR} of simple assignments substituted."""
    try:
        return shlex.split(substitute(line, env), comments=True)
    except ValueError:  # unbalanced quotes: not a line we read
        return []


def find_commands(text: str) -> list[Command]:
    env: dict[str, str] = {}
    found = []
    for no, line, heredoc in logical_lines(text):
        if heredoc:  # substituted where it is used: `deepspeed --module $training_commands` splits it into words
            env[heredoc] = substitute(line, env)
            continue
        assign = re.match(r"\s*(?:export\s+)?(\w+)=(.*)$", line)
        if assign and "$(" not in line and "openrlhf.cli." not in line:  # not `VAR=x python -m openrlhf...`
            if line[0].isspace():  # set inside a loop or a branch: a value the command may or may not see
                continue
            env[assign.group(1)] = " ".join(words(assign.group(2), env))
            continue
        w = words(line, env)
        at = next((k for k, x in enumerate(w) if x.startswith("openrlhf.cli.")), None)
        if at is None:
            continue
        if at == 0 or w[at - 1] not in ("--module", "-m"):
            continue  # e.g. `echo openrlhf.cli.train_sft`
        unresolved = sorted({m for x in w for m in re.findall(r"\$\{?\w+\}?", x)})
        found.append(Command(w[at].removeprefix("openrlhf.cli."), launcher_flags(w[:at - 1]), flag_values(w[at + 1:]), no,
                             unresolved))
    return found


def flag_values(ws: list[str]) -> list[tuple[str, Any]]:
    """--flag v, --flag=v, --flag v1 v2 (nargs), --flag (a switch: True). Negative numbers are values."""
    out: list[tuple[str, Any]] = []
    for x in ws:
        if x.startswith("--"):
            name, eq, v = x[2:].partition("=")
            out.append((name, [v] if eq else []))
        elif out:
            out[-1][1].append(x)
        # a word before any flag (`;`, `&&`...) ends nothing: OpenRLHF commands are one per line
    return [(n, True if not v else v[0] if len(v) == 1 else v) for n, v in out]


def launcher_flags(ws: list[str]) -> list[tuple[str, Any]]:
    if "--" in ws:  # ray job submit [options] -- python3 -m ...
        ws = ws[:ws.index("--")]
    return [(n, v) for n, v in flag_values(ws) if n]


# ---------------------------------------------------------------------------------------------- conversion
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Converted:
    module: str
    dialect: str
    sections: dict[str, dict[str, Any]]
    comments: dict[tuple[str, str], str]  # (section, key) -> "--flag value" or a note
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def stage_of(cmd: Command) -> tuple[str, list[str]]:
    """(table name, sections) of a command; batch_inference's eval_task picks generate or score."""
    if cmd.module == "batch_inference":
        task = dict((flat_name(f), v) for f, v in cmd.flags).get("eval_task", "generate")
        if task in ("generate", "generate_vllm"):
            return "generate", ["generate"]
        if task == "rm":
            return "score", ["score"]
        raise CommandError(f"openrlhf.cli.batch_inference --eval_task {task}: no counterpart (generate, generate_vllm, rm)")
    if cmd.module not in STAGES:
        raise CommandError(f"openrlhf.cli.{cmd.module} (line {cmd.line}) is not an OpenRLHF module this imports; "
                           f"known: {', '.join(sorted([*STAGES, 'batch_inference']))}")
    return cmd.module, STAGES[cmd.module]


def config_class(stage: str):
    import importlib

    return importlib.import_module(f"stages.{stage}").Config


def convert(cmd: Command) -> Converted:
    table_name, sections = stage_of(cmd)
    main = sections[0]
    out = Converted(cmd.module, cmd.dialect, {s: {} for s in sections}, {})
    fields = {s: config_class(s).model_fields for s in sections}
    given: dict[str, Any] = {}
    written = {flat_name(f) for f, _ in cmd.flags}
    defaults = [(f, v) for f, v in DEFAULTS.get(cmd.module, {}).items() if f not in written
                and not (f == "input_template" and "apply_chat_template" in written)]
    for table, flags in ((LAUNCHER, cmd.launcher), (FLAGS[table_name], cmd.flags), (FLAGS[table_name], defaults)):
        for flag, value in flags:
            name = flag if table is LAUNCHER else flat_name(flag)
            rule = table.get(name, name if name in fields[main] else None)
            shown = f"--{flag}" + ("" if value is True else f" {' '.join(value) if isinstance(value, list) else value}")
            if (flag, value) in defaults:
                shown = f"(OpenRLHF's default {shown!r})"
            if rule is None:
                out.unsupported.append(f"{shown}: no counterpart" + ("" if name == flag else f" (--{name})"))
                continue
            if isinstance(rule, No):
                out.unsupported.append(f"{shown}: {rule}")
                continue
            given[name] = value
            for section, key, v in targets(rule, value, main, flag):
                if key not in fields[section]:
                    raise CommandError(f"table error: {section}.{key} (--{flag}) is not a field")
                out.sections[section][key] = check(fields[section][key].annotation, v, flag, f"{section}.{key}")
                out.comments[(section, key)] = shown
    wire(cmd, out, given)
    hub_ids(out)
    return out


def targets(rule, value, main: str, flag: str) -> list[tuple[str, str, Any]]:
    """(section, key, raw value) for each key a flag sets."""
    if callable(rule) and not isinstance(rule, (str, tuple)):
        return [(main, k, v) for k, v in rule(value).items()]
    keys, conv = rule if isinstance(rule, tuple) else (rule, None)
    if conv:
        try:
            value = conv(value)
        except (TypeError, ValueError) as e:
            raise CommandError(f"--{flag} {value}: {e}") from None
    return [(*k.split("."), value) if "." in k else (main, k, value) for k in (keys if isinstance(keys, list) else [keys])]


def check(annotation, value, flag: str, where: str):
    """The value as the field's type (a bare switch is True), or an error naming the flag."""
    from typing import get_args, get_origin

    from pydantic import TypeAdapter, ValidationError

    kinds = {get_origin(t) or t for t in (get_args(annotation) if get_origin(annotation) not in (list, tuple) else ())}
    kinds |= {get_origin(annotation) or annotation}
    if value is True and bool not in kinds:
        raise CommandError(f"--{flag} needs a value ({where})")
    if value == "" and type(None) in kinds:
        return None  # OpenRLHF reads an empty value (--input_template "") as unset
    if isinstance(value, str) and kinds & {list, tuple}:
        value = [value]  # nargs="*" given one value
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as e:
        try:  # a Literal of numbers (zero_stage 3) takes the YAML scalar, not the text
            return TypeAdapter(annotation).validate_python(yaml.safe_load(value) if isinstance(value, str) else value)
        except (ValidationError, yaml.YAMLError):
            raise CommandError(f"--{flag} {value!r}: {e.errors()[0]['msg']} ({where})") from None


def wire(cmd: Command, out: Converted, given: dict) -> None:
    """Keys no single flag gives: the URIs between dpo's three stages, OpenRLHF's defaults for required keys."""
    s, c = out.sections, out.comments
    main = next(iter(s))
    if main == "score":
        out.notes.append("score.samples_uri must be a committed samples artifact (the generate stage's output_uri), "
                         "not a jsonl file")
    out.notes += [f"{v} is not set by a top-level VAR=value line of the script: replace it" for v in cmd.unresolved]
    if cmd.module == "train_dpo":
        save = s["dpo"]["output_uri"]
        policy = s["dpo"].get("policy_uri")
        s["prepare"] = {"kind": "pairs", **s["prepare"], "output_uri": f"{save}-pairs"}
        c[("prepare", "kind")] = "(train_dpo reads preference pairs)"
        c[("prepare", "output_uri")] = "(the pairs the reference stage reads)"
        if s["prepare"].get("apply_chat_template") and policy:
            s["prepare"]["tokenizer_uri"], c[("prepare", "tokenizer_uri")] = policy, "(--pretrain: its chat template)"
        ref = s["reference"]
        ref.update(pairs_uri=s["prepare"]["output_uri"], output_uri=f"{save}-ref")
        c[("reference", "pairs_uri")], c[("reference", "output_uri")] = "(prepare's output)", "(pairs + reference log-probs)"
        if "ref_uri" not in ref and policy:
            ref["ref_uri"], c[("reference", "ref_uri")] = policy, "(--pretrain: OpenRLHF's default reference)"
        for k in ("zero_stage", "num_gpus", "num_nodes", "hostfile"):
            if k in s["dpo"]:
                ref[k], c[("reference", k)] = s["dpo"][k], c[("dpo", k)]
        s["dpo"]["dataset_uri"], c[("dpo", "dataset_uri")] = ref["output_uri"], "(the reference stage's output)"
        order = ["prepare", "reference", "dpo"]
        out.sections = {k: s[k] for k in order}
    if "eval_steps" in s[main] and "eval_dataset" not in s[main] and main != "generate":
        del s[main]["eval_steps"]  # OpenRLHF evaluates nothing without eval data; here that is a refused setting
        out.unsupported.append(f"{c.pop((main, 'eval_steps'))}: no --eval_dataset, so no evaluation (OpenRLHF ignores it)")
    if s[main].get("save_hf_ckpt") and not s[main].get("save_steps"):
        del s[main]["save_hf_ckpt"]  # OpenRLHF writes the HF folder with a checkpoint; there is none to go with
        out.unsupported.append(f"{c.pop((main, 'save_hf_ckpt'))}: no --save_steps, so no checkpoint and no HF folder "
                               f"beside one (OpenRLHF writes none either)")
    if cmd.module == "train_ppo_ray":  # OpenRLHF generates with vLLM engines when it has some, else on the actors
        vllm = s["ppo"].get("vllm_num_engines", 0) > 0
        s["ppo"]["rollout_backend"] = "vllm" if vllm else "hf"
        c[("ppo", "rollout_backend")] = "(--vllm_num_engines > 0: vLLM engines)" if vllm else "(no vLLM engines: generate on the actor)"
    if cmd.module == "train_ppo_ray" and s["ppo"].get("vllm_tensor_parallel_size", 1) > 1:
        # TP > 1 engines take their weights through the object store here (stages/ppo.py refuses the collective
        # group for them: it reaches the engine actor, not vLLM's TP workers)
        s["ppo"]["weight_sync_backend"] = "object_store"
        c[("ppo", "weight_sync_backend")] = " ".join(filter(None, [c.get(("ppo", "weight_sync_backend")),
                                                                 "(TP > 1 engines: object_store here)"]))
    if cmd.module == "train_ppo_ray" and "max_len" in given and "max_new_tokens" not in given:
        ppo = s["ppo"]
        ppo["generate_max_len"] = int(given["max_len"]) - ppo.get("prompt_max_len", 1024)
        c[("ppo", "generate_max_len")] = f"(--max_len {given['max_len']} minus prompt_max_len)"
    if cmd.module.startswith("train_") and cmd.module != "train_ppo_ray" and "num_gpus" not in dict(cmd.launcher):
        out.notes.append("deepspeed without --num_gpus uses every GPU of the node: set num_gpus (default 1 here)")


def hub_ids(out: Converted) -> None:
    """Model and dataset hub ids -> ./hub/<id>, a folder the user downloads to (nothing is downloaded here)."""
    seen = set()
    for section, keys in out.sections.items():
        for key, v in list(keys.items()):
            if not (key.endswith("_uri") or key in ("data", "eval_dataset")) or not isinstance(v, str):
                continue
            parts = [p.strip() for p in v.split(",")]
            hub = [p for p in parts if HUB_ID.match(p.split("@")[0]) and not Path(p.split("@")[0]).exists()]
            if not hub:
                continue
            keys[key] = ",".join(f"./hub/{p}" if p in hub else p for p in parts)
            out.comments[(section, key)] += "  (a hub id: see the notes)"
            for p in [p for p in hub if p not in seen]:
                seen.add(p)
                out.notes.append(f"{p} is a hub id; this project never downloads: download it to ./hub/{p.split('@')[0]} "
                                 f"(or any folder or URI) and pass that folder ({section}.{key})")


# ---------------------------------------------------------------------------------------------- output
def scalar(v) -> str:
    return yaml.safe_dump([v], default_flow_style=True, width=10**6, allow_unicode=True).strip()[1:-1]


def render(converted: list[Converted], source: str) -> str:
    lines = [f"# Imported from {source} by `rlhf-flows import-openrlhf` (each key's comment: the OpenRLHF flag)."]
    for c in converted:
        lines.append(f"# openrlhf.cli.{c.module} ({c.dialect}): run "
                     + " then ".join(f"`rlhf-flows stage {s} --config THIS_FILE`" for s in c.sections))
    notes = [n for c in converted for n in c.notes]
    if notes:
        lines += ["#", "# Notes:"] + [f"#   {n}" for n in notes]
    unsupported = [u for c in converted for u in c.unsupported]
    if unsupported:
        lines += ["#", "# Flags without a counterpart here (not in the YAML below):"] + [f"#   {u}" for u in unsupported]
    for c in converted:
        for section, keys in c.sections.items():
            lines.append(f"{section}:")
            for k, v in keys.items():
                text = f"  {k}: {scalar(v)}"
                note = c.comments.get((section, k))
                lines.append(f"{text:<43} # {note}" if note else text)
    return "\n".join(lines) + "\n"


def validate(text: str, converted: list[Converted]) -> list[str]:
    """Parse the printed YAML back and validate each section with its stage's Config: what is printed loads.
    A key the Config refuses only because this host has no CUDA device (ppo's sleep flags, vLLM TP) is taken
    out, named in the returned list, and the rest validated without it."""
    from pydantic import ValidationError

    data, host = yaml.safe_load(text), []
    for c in converted:
        for section in c.sections:
            keys = dict(data[section])
            while True:
                try:
                    config_class(section).model_validate(keys)
                    break
                except ValidationError as e:
                    msg = e.errors()[0]["msg"].removeprefix("Value error, ")
                    key = re.match(r"\w+", msg)
                    if "CUDA" in msg and key and key.group() in keys:
                        host.append(f"{section}.{key.group()}: {msg}")
                        del keys[key.group()]
                        continue
                    raise CommandError(f"openrlhf.cli.{c.module}: the imported {section} config does not validate: "
                                       + "; ".join(_named(err, section, c) for err in e.errors())) from None
    return host


def _named(err: dict, section: str, c: Converted) -> str:
    key = str(err["loc"][0]) if err["loc"] else ""
    src = c.comments.get((section, key), "").split("  ")[0]
    if err["type"] == "missing":  # name the flag the command lacks
        table = FLAGS["generate" if section == "generate" else "score" if section == "score" else c.module]
        src = " / ".join(f"--{f}" for f, r in table.items() if r in (key, f"{section}.{key}")) or f"--{key}"
        src = f"the command gives no {src}"
    return f"{section}{'.' + key if key else ''}: {err['msg']}" + (f" ({src})" if src else "")


def import_text(text: str, source: str = "<stdin>") -> str:
    commands = find_commands(text)
    if not commands:
        raise CommandError(f"{source}: no OpenRLHF command (deepspeed --module openrlhf.cli.X, python -m "
                           "openrlhf.cli.X, or ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray)")
    converted = []
    for cmd in commands:
        c = convert(cmd)
        clash = set(c.sections) & {s for done in converted for s in done.sections}
        if clash:
            raise CommandError(f"{source} line {cmd.line}: a second command for stage {', '.join(sorted(clash))}: "
                               "import each from its own file")
        converted.append(c)
    text = render(converted, source)
    host = validate(text, converted)
    if host:  # the rest validated; these are refused on this host only
        head, rest = text.split("\n", 1)
        text = "\n".join([head, "# On this host (no CUDA device) these keys are refused; the rest validates without them:",
                           *(f"#   {h}" for h in host), rest])
    return text


def main(path: str, output: str | None) -> int:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    out = import_text(text, "stdin" if path == "-" else path)
    if output:
        Path(output).write_text(out)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0
