"""`rlhf-flows import-openrlhf FILE|- [-- ARG...]`: an OpenRLHF launch command or script -> the equivalent stage or
flow YAML.

The script is read as bash reads it (flows/openrlhf/shell.py: quoting and ANSI-C strings, arrays and appends,
here documents, sourced files, functions, decidable `if`s, `bash -c`, the ARGs as $1 $2 ...), and every command
that launches `openrlhf.cli.X` (`deepspeed --module`, `python -m`, `torchrun -m`, `ray job submit ... --`, or
`python openrlhf/cli/X.py`) is read as OpenRLHF's argparse reads it, in both of its dialects: the flat flags of
v0.9 (`--pretrain`) and the dotted flags of v0.10.2+ (`--model.model_name_or_path`), an unambiguous prefix being
the flag it abbreviates (`--max_epoch`). A dotted flag is first renamed to the flat flag it replaced, so both
dialects go through one table per module and give the same YAML; each key's comment names the flag as written.
The tables are data: flows/openrlhf/flags.yaml, read by flows/openrlhf/flags.py.

Every flag of the command is a commented key, or listed at the top: without a counterpart (with the reason), or
holding here without a key; the output is checked for it before it is printed (`unaccounted`). Flags the
command omits get OpenRLHF's default of the version its dialect belongs to (flat: v0.9.10; dotted: v0.11.0; kto
/ kd / prm / batch_inference: v0.9.5) where it differs from the stage's, and the header says which version was
assumed; placement too: train_ppo_ray's 8 GPUs per node for each role it starts, and `deepspeed` without
--num_gpus (every GPU of the node: `num_gpus: all`, which the stages count at launch). Model and
dataset hub ids (`org/name[@rev]`) are written as given, OpenRLHF's `json@DIR` as the folder DIR; a W&B key
is never written (the note says where it goes). `batch_inference --post_processor rs|iter_dpo|csft` becomes score
then the filter stage, the trainer reading the filter's output; a script's generate -> score -> train loop
becomes the matching flow (flows/openrlhf/loops.py). A reward server the script starts beside the trainer
(`openrlhf.cli.serve_rm`, a fork's own) is named as the step it is. What has no counterpart at all is refused
in one line naming it: serve_rm alone (with the serve-rm command that replaces it), vision-language runs, a
setting the stages refuse (named with the flags that set it), a line bash would fail on. The YAML is parsed back
and validated with each stage's (or the flow's) Config before it is printed.

    rlhf-flows import-openrlhf tests/flows/openrlhf_commands/v0.9.10/train_sft.sh -o sft.yaml
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flows.openrlhf.flags import (DEFAULTS, DOTTED, FLAGS, LAUNCHER, SERVE_RM, SERVE_RM_DEFAULTS, STAGES,  # noqa: F401
                                  VLM_FLAGS, Fixed, No, NoCounterpart, SplitOf, defaults, flat_name, prefixed,
                                  unknown_flag, version_of)
from flows.openrlhf.shell import Command, Script, ShellError, find_commands, read_script  # noqa: F401 (the API)

SECRETS = {"use_wandb"}  # flags whose value is a key: never written into the YAML
SOURCES = {"dataset", "prompt_data", "eval_dataset", "pretrain_data"}  # flags naming data sources


class CommandError(ValueError):
    """A command that cannot be imported; the message names the module, the flag or the line."""


@dataclass
class Converted:
    module: str
    dialect: str
    sections: dict[str, dict[str, Any]]
    comments: dict[tuple[str, str], str]  # (section, key) -> "--flag value" or a note
    line: int = 0
    version: str = ""  # the OpenRLHF version whose defaults were assumed
    unsupported: list[str] = field(default_factory=list)  # flags without a counterpart, with the reason
    holds: list[str] = field(default_factory=list)  # flags whose effect holds here without a key
    notes: list[str] = field(default_factory=list)
    flow: str | None = None  # a loop imported as this flow's config (sections[""]: its top-level keys)
    header: str = ""
    steps: list[str] = field(default_factory=list)  # what the script runs beside it (a reward server)


def where(cmd: Command) -> str:
    return f"openrlhf.cli.{cmd.module} (line {cmd.line}{', in ' + cmd.source if cmd.source else ''})"


def refuse_unsupported(cmd: Command) -> None:
    """One line for a command with no counterpart here at all."""
    if cmd.module == "serve_rm":
        raise CommandError(f"{where(cmd)} serves a reward model over HTTP (a server, not a stage): run "
                           f"{serve_rm_command(cmd)}")
    vlm = [f"--{f}" + ("" if v is True else f" {v}") for f, v in cmd.flags if flat_name(f) in VLM_FLAGS and str(v) != "0"]
    if vlm:
        raise CommandError(f"{where(cmd)} is a vision-language run ({', '.join(vlm)}): vision-language models are not "
                           "supported here (text models only)")
    if cmd.module not in STAGES and cmd.module != "batch_inference":
        raise CommandError(f"{where(cmd)} is not an OpenRLHF module this imports; known: "
                           f"{', '.join(sorted([*STAGES, 'batch_inference', 'serve_rm']))}")


def serve_rm_command(cmd: Command) -> str:
    """`rlhf-flows serve-rm MODEL ...` for an `openrlhf.cli.serve_rm` command, flags without an option named."""
    written = {flat_name(f) for f, _ in cmd.flags}
    model, opts, left = "MODEL", [], []
    for flag, value in [*cmd.flags, *((k, v) for k, v in SERVE_RM_DEFAULTS.items() if k not in written)]:
        rule = SERVE_RM.get(flat_name(flag))
        if rule == "MODEL":
            model = value
        elif isinstance(rule, str) and not isinstance(rule, No):
            opts += [rule, str(value)]
        elif flag != "normalize_reward" and flat_name(flag) != "normalize_reward":
            left.append(f"--{flag}: {rule or 'no counterpart'}")
    if "normalize_reward" not in written:  # OpenRLHF serves raw scores unless --normalize_reward
        opts.append("--no-normalize-reward")
    return f"`{shlex.join(['rlhf-flows', 'serve-rm', str(model), *opts])}`" + (f" ({'; '.join(left)})" if left else "")


def stage_of(cmd: Command, generated: set[str]) -> tuple[str, list[str]]:
    """(table name, sections) of a command; batch_inference's eval_task picks generate or score (score of a
    dataset the script did not generate reads it through prepare kind=samples)."""
    if cmd.module == "batch_inference":
        flags = {flat_name(f): v for f, v in cmd.flags}
        task = flags.get("eval_task", "generate")
        if task in ("generate", "generate_vllm"):
            return "generate", ["generate"]
        if task == "rm":
            raw = flags.get("dataset") not in generated
            return ("score_raw", ["score", "prepare", "filter"]) if raw else ("score", ["score", "filter"])
        raise CommandError(f"{where(cmd)} --eval_task {task}: no counterpart (generate, generate_vllm, rm)")
    return cmd.module, STAGES[cmd.module]


def config_class(stage: str):
    import importlib

    return importlib.import_module(f"stages.{stage}").Config


def convert(cmd: Command, generated: set[str] = frozenset()) -> Converted:
    refuse_unsupported(cmd)
    table_name, sections = stage_of(cmd, generated)
    main, dotted = sections[0], any("." in f for f, _ in cmd.flags)
    out = Converted(cmd.module, cmd.dialect, {s: {} for s in sections}, {}, cmd.line, version_of(cmd.module, dotted))
    fields = {s: config_class(s).model_fields for s in sections}
    given: dict[str, Any] = {}
    placed: dict[str, list[tuple[str, str]]] = {}  # flag -> the (section, key) it set
    splits: list[tuple[str, str, Any, str]] = []  # (shown, flag, value, source flag) of --dataset_split & co.
    flags = [(flag, *as_openrlhf_reads(cmd, flag, value, FLAGS[table_name], out)) for flag, value in cmd.flags]
    launcher = [(flag, flag if flag in LAUNCHER else flag.replace("-", "_"), value) for flag, value in cmd.launcher]
    assumed = [(flag, flag, value) for flag, value in defaults(cmd.module, dotted, {n for _, n, _ in flags})]
    for table, items, default in ((LAUNCHER, launcher, False), (FLAGS[table_name], flags, False),
                                  (FLAGS[table_name], assumed, True)):
        for flag, name, value in items:
            rule = table.get(name, name if name in fields[main] else None)
            shown = f"--{flag}" + ("" if value is True else f" {show(value)}")
            if name in SECRETS and not default and str(value).lower() != "true":
                shown = f"--{flag} KEY"  # a secret: neither in the YAML nor in its comments
                out.notes.append(f"--{flag} KEY: the W&B key is not written here: give it to the run as WANDB_API_KEY "
                                 "(the environment of `rlhf-flows stage`, or for a flow a Prefect Secret block named by "
                                 'credentials_block holding {"WANDB_API_KEY": "..."}); without it W&B logs offline')
            if name == "use_tensorboard" and value is not True and not default:
                out.notes.append(f"--{flag} {show(value)}: the event files go to the artifact's tensorboard/ folder, "
                                 f"not {show(value)}")
            if default:
                shown = f"(OpenRLHF {out.version}'s default '{shown}')"
            if isinstance(rule, SplitOf):
                if not default:
                    splits.append((shown, name, value, rule.source))
                continue
            if rule is None or (isinstance(rule, No) and not isinstance(rule, Fixed)):
                if not default:  # a default without a counterpart changes nothing the user wrote
                    why = rule or (table is not LAUNCHER and unknown_flag(cmd.module, name)) or "no counterpart"
                    out.unsupported.append(f"{shown}: {why}" + ("" if name == flag else f" (--{name})"))
                continue
            if isinstance(rule, Fixed):
                same = str(value).lower() == str(rule.value).lower()
                if not default:
                    (out.holds if same else out.unsupported).append(
                        f"{shown}: {rule.why}" if same else f"{shown}: no counterpart: {rule.why}")
                continue
            try:
                keys = targets(rule, value, main, flag)
            except NoCounterpart as e:
                out.unsupported.append(f"{shown}: {e}")
                continue
            if default and {(sec, key) for sec, key, _ in keys} & {x for xs in placed.values() for x in xs}:
                continue  # a flag the command gives sets it (--bf16 beside the default --param_dtype bf16)
            for section, key, v in keys:
                if key not in fields[section]:  # tests/flows/test_import_openrlhf.py checks the tables name fields
                    out.unsupported.append(f"{shown}: no field {section}.{key} in stages/{section}.py")
                    continue
                try:
                    v = check(fields[section][key].annotation, v, flag, f"{section}.{key}")
                except CommandError:
                    if "$" not in str(value):
                        raise
                    out.unsupported.append(f"{shown}: the script sets it when it runs: give {section}.{key}")
                    continue
                info = fields[section][key]
                if default and not info.is_required() and v == info.get_default(call_default_factory=True):
                    continue  # the stage's default already
                given[name] = value
                placed.setdefault(name, []).append((section, key))
                out.sections[section][key] = v
                out.comments[(section, key)] = shown
    for shown, name, value, source in splits:
        name_split(out, shown, str(value), source, placed.get(source, []))
    if cmd.elided:
        out.notes.append(f"`...` (line {cmd.elided}): the command is a fragment (as OpenRLHF's docs write them: other "
                         "flags left out); the flags it does not give take OpenRLHF's defaults")
    placement(cmd, out)
    wire(cmd, out, given)
    return out


def as_openrlhf_reads(cmd: Command, flag: str, value, table: dict, out: Converted) -> tuple[str, Any]:
    """(the flat flag OpenRLHF's argparse takes it for, the value as OpenRLHF reads it): an unambiguous prefix is the
    flag it abbreviates; `json@DIR` (OpenRLHF's local files: load_dataset("json", data_dir=DIR)) is the folder DIR,
    whose files the stages read; several reward URLs: OpenRLHF shares each batch out among them."""
    name = flat_name(flag)
    if len(full := prefixed(cmd.module, name, table)) == 1:
        out.notes.append(f"--{flag}: OpenRLHF's argparse reads it as --{full[0]} (an unambiguous prefix)")
        name = full[0]
    if name in SOURCES and isinstance(value, str):
        local = re.compile(r"^(json|jsonl|csv|parquet|arrow)@(.+)$")
        sources = [src.strip() for src in value.split(",")]
        if any(local.match(src) for src in sources):
            value = ",".join(m.group(2) if (m := local.match(src)) else src for src in sources)
            out.notes.append(f"--{flag}: OpenRLHF's FORMAT@DIR (its local files, load_dataset(FORMAT, data_dir=DIR)) "
                             f"read as the folder: {value} (the stages read its json / jsonl / csv / parquet files)")
    if name == "input_template" and isinstance(value, str) and value and "{}" not in value:
        out.notes.append(f"--{flag} {show(value)}: no {{}} in it, so OpenRLHF sets it to None (its warning)")
        value = ""
    elif name == "input_template" and isinstance(value, str) and "\\n" in value:
        out.notes.append(f"--{flag} {show(value)}: a backslash and an n, not a newline, as OpenRLHF warns (bash "
                         "writes a newline as $'...\\n...')")
    if name == "remote_rm_url" and isinstance(value, str) and "," in value:
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if urls[0].endswith(".py"):
            out.notes.append(f"--{flag}: OpenRLHF loads reward_func from the first file only ({urls[0]}); the rest "
                             f"({', '.join(urls[1:])}) are not used there either")
        else:
            out.notes.append(f"--{flag}: OpenRLHF shares each batch of queries out among these {len(urls)} reward "
                             f"servers (replicas of one reward); here every query goes to {urls[0]} (the stage takes "
                             f"one URL): put {', '.join(urls[1:])} behind it, or drop them")
        value = urls[0]
    return name, value


def show(v) -> str:
    """A flag's value as a shell word (one line: a newline shows as $'\\n')."""
    if isinstance(v, list):
        return " ".join(show(x) for x in v)
    v = str(v)
    if any(ord(ch) < 32 for ch in v):
        return "$'" + v.encode("unicode_escape").decode().replace("'", "\\'") + "'"
    return shlex.quote(v) if not v or re.search(r"\s", v) else v


def placement(cmd: Command, out: Converted) -> None:
    """`deepspeed` picks its ranks: --include HOST:SLOTS (beside --num_gpus / --num_nodes DeepSpeed refuses it),
    CUDA_VISIBLE_DEVICES, or every GPU of the node."""
    main = next(iter(out.sections))
    if cmd.runner != "deepspeed" or "num_gpus" not in config_class(main).model_fields:
        return
    launch = {flag.replace("-", "_") for flag, _ in cmd.launcher}
    if launch & {"include", "exclude"}:
        if launch & {"num_gpus", "num_nodes"}:
            raise CommandError(f"{where(cmd)}: deepspeed refuses --include / --exclude beside --num_gpus / --num_nodes "
                               "(\"Cannot specify num_nodes/gpus with include/exclude\")")
        return
    if "num_gpus" in launch:
        return
    if cuda := cmd.env.get("CUDA_VISIBLE_DEVICES"):
        put(out, main, "num_gpus", len([d for d in cuda.split(",") if d.strip()]),
            f"(CUDA_VISIBLE_DEVICES={cuda}: deepspeed starts a rank per GPU it lists)")
        return
    put(out, main, "num_gpus", "all", "(deepspeed without --num_gpus: every GPU of the node, counted at launch)")


def name_split(out: Converted, shown: str, split: str, source: str, where: list[tuple[str, str]]) -> None:
    """--dataset_split X (--prompt_split, --train_split): each source of --{source} read at split X, written as
    SOURCE@X (train, OpenRLHF's default and the stages', holds as it is). A source that names its own `@...` (a
    hub dataset's folder or subset) cannot take a second one: listed."""
    if split == "train":
        out.holds.append(f"{shown}: the stages read the train split of a source that has splits")
        return
    if not where:
        out.unsupported.append(f"{shown}: no --{source} to read split {split} of")
        return
    for section, key in where:
        sources = [u.strip() for u in str(out.sections[section][key]).split(",")]
        own = [u for u in sources if "@" in u.rsplit("/", 1)[-1]]
        if own:
            out.unsupported.append(f"{shown}: {', '.join(own)} already name(s) a folder, subset or split with @ (the "
                                   f"stages take one per source): give {split} there instead")
            return
        out.sections[section][key] = ",".join(f"{u}@{split}" for u in sources)
        out.comments[(section, key)] += f" {shown}"


def targets(rule, value, main: str, flag: str) -> list[tuple[str, str, Any]]:
    """(section, key, raw value) for each key a flag sets."""
    if callable(rule) and not isinstance(rule, (str, tuple)):
        return [(main, k, v) for k, v in rule(value).items()]
    keys, conv = rule if isinstance(rule, tuple) else (rule, None)
    if conv:
        try:
            value = conv(value)
        except NoCounterpart:
            raise
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


def put(out: Converted, section: str, key: str, value, why: str) -> None:
    out.sections[section][key], out.comments[(section, key)] = value, why


def drop(out: Converted, section: str, key: str, why: str) -> None:
    """Take a key out and list its flag with why."""
    del out.sections[section][key]
    out.unsupported.append(f"{out.comments.pop((section, key))}: {why}")


def wire(cmd: Command, out: Converted, given: dict) -> None:
    """What no single flag gives: the URIs between dpo's three stages, OpenRLHF's rules between flags."""
    s, c = out.sections, out.comments
    main = next(iter(s))
    shown = [str(v) for f, v in [*cmd.launcher, *cmd.flags] if flat_name(f) not in SECRETS]  # a key stays unnamed
    out.notes += [f"{v} is not set by a VAR=value line the script runs: replace it" for v in cmd.unresolved
                  if any(v in x for x in shown)]
    out.notes += [f"{w} (line {cmd.line}) is set only when the script runs: the flags it may hold are not read here "
                  "(add them to the YAML)" for w in cmd.opaque]
    if cmd.runner == "torchrun" and "launcher" in config_class(main).model_fields:
        put(out, main, "launcher", "torchrun", "(torchrun -m)")
    if cmd.module == "train_dpo":
        save, policy = s["dpo"]["output_uri"], s["dpo"].get("policy_uri")
        s["prepare"] = {"kind": "pairs", **s["prepare"], "output_uri": f"{save}-pairs"}
        c[("prepare", "kind")], c[("prepare", "output_uri")] = "(train_dpo reads preference pairs)", "(the pairs the reference stage reads)"
        if s["prepare"].get("apply_chat_template") and policy:
            put(out, "prepare", "tokenizer_uri", policy, "(--pretrain: its chat template)")
        ref = s["reference"]
        ref.update(pairs_uri=s["prepare"]["output_uri"], output_uri=f"{save}-ref")
        c[("reference", "pairs_uri")], c[("reference", "output_uri")] = "(prepare's output)", "(pairs + reference log-probs)"
        if "ref_uri" not in ref and policy:
            put(out, "reference", "ref_uri", policy, "(--pretrain: OpenRLHF's default reference)")
        for k in ("zero_stage", "num_gpus", "num_nodes", "hostfile", "launcher"):
            if k in s["dpo"]:
                put(out, "reference", k, s["dpo"][k], c[("dpo", k)])
        put(out, "dpo", "dataset_uri", ref["output_uri"], "(the reference stage's output)")
        out.sections = {k: s[k] for k in ["prepare", "reference", "dpo"]}
    held_out = "eval_dataset" in s[main] or "eval_prompts_uri" in s[main]  # the trainers' name, ppo's
    if "eval_steps" in s[main] and not held_out and main != "generate":
        drop(out, main, "eval_steps", "no --eval_dataset, so no evaluation (OpenRLHF ignores it)")
    if "eval_prompts_uri" in s[main] and not s[main].get("eval_steps"):
        drop(out, main, "eval_prompts_uri", "--eval_steps -1 (its default): OpenRLHF never evaluates it")
    if s[main].get("save_hf_ckpt") and not s[main].get("save_steps"):  # OpenRLHF writes the HF folder with a checkpoint
        drop(out, main, "save_hf_ckpt", "no --save_steps, so no checkpoint and no HF folder beside one (OpenRLHF writes none either)")
    if main == "score":
        if s["filter"] and "method" not in s["filter"]:  # OpenRLHF reads these in its post-processor only
            for k in list(s["filter"]):
                out.holds.append(f"{c.pop(('filter', k))}: read by --post_processor only, and there is none: a no-op "
                                 "in OpenRLHF's batch_inference too (the scores are written as computed)")
            s["filter"].clear()
        if not s["filter"]:
            del s["filter"]
        else:  # batch_inference applies the post-processor to the scores; here the filter stage does
            base = re.sub(r"\.jsonl?$", "", s["score"]["output_uri"])
            put(out, "filter", "scored_uri", s["score"]["output_uri"], "(score's output)")
            put(out, "filter", "output_uri", f"{base}-{s['filter']['method']}", "(the post-processed rows)")
        if "prepare" in s:  # a dataset the script did not generate: its rows become samples first
            prep = {"kind": "samples", **s["prepare"]}
            c[("prepare", "kind")] = "(a dataset's responses, scored as samples)"
            if prep.get("apply_chat_template"):
                prep["tokenizer_uri"], c[("prepare", "tokenizer_uri")] = s["score"]["reward_model_uri"], "(--pretrain: its chat template)"
            prep["output_uri"], c[("prepare", "output_uri")] = f"{re.sub(r'.jsonl?$', '', s['score']['output_uri'])}-samples", "(the samples score reads)"
            put(out, "score", "samples_uri", prep["output_uri"], "(prepare's output)")
            out.sections = {"prepare": prep, **{k: v for k, v in s.items() if k != "prepare"}}
        else:
            out.notes.append("score.samples_uri must be a committed samples artifact (the generate stage's output_uri), "
                             "not a jsonl file")
    if cmd.module == "train_ppo_ray":
        ppo_rules(out, given)


def ppo_rules(out: Converted, given: dict) -> None:
    """OpenRLHF's train_ppo_ray rules between flags, as this stage's keys."""
    p, c = out.sections["ppo"], out.comments
    roles(out)
    engines = p.get("vllm_num_engines", config_class("ppo").model_fields["vllm_num_engines"].default) > 0
    put(out, "ppo", "rollout_backend", "vllm" if engines else "hf",
        "(--vllm_num_engines > 0: vLLM engines)" if engines else "(no vLLM engines: generate on the actor)")
    if "max_len" in given:  # OpenRLHF caps prompt + response at max_len (vLLM's max_model_len)
        max_len = int(given["max_len"])
        if "max_new_tokens" in given and max_len > int(given["max_new_tokens"]):
            put(out, "ppo", "prompt_max_len", max_len - int(given["max_new_tokens"]),
                f"(--max_len {max_len} minus --max_new_tokens {given['max_new_tokens']})")
        elif "max_new_tokens" not in given and "generate_max_len" not in given:
            prompt = min(p.get("prompt_max_len", 1024), max_len // 2)
            p["prompt_max_len"], p["generate_max_len"] = prompt, max_len - prompt
            c[("ppo", "prompt_max_len")] = c.get(("ppo", "prompt_max_len"), "(part of --max_len)")
            c[("ppo", "generate_max_len")] = f"(--max_len {max_len} minus prompt_max_len)"
            out.notes.append(f"OpenRLHF without --max_new_tokens lets each response fill --max_len {max_len} minus its "
                             f"prompt; here prompt_max_len {prompt} + generate_max_len {max_len - prompt} split it (a "
                             f"longer prompt keeps its last {prompt} tokens, counted in the metrics): set them as you need")
    rewards_from = next((k for k in ("reward_func_path", "remote_rm_url", "agent_func_path") if p.get(k)), None)
    if p.get("advantage_estimator", "gae") == "gae" and rewards_from and not p.get("critic_uri") and p.get("policy_uri"):
        put(out, "ppo", "critic_uri", p["policy_uri"], f"(--pretrain: OpenRLHF's critic without a reward model, "
            f"{rewards_from} given)")
    if p.get("normalize_reward") and not p.get("reward_model_uri"):
        drop(out, "ppo", "normalize_reward", f"no reward model ({rewards_from} gives the rewards): a no-op in OpenRLHF "
             "(its critic has no stored mean/std)")
    if p.get("async_train") and p.get("colocate_all_models"):  # OpenRLHF warns and colocates the DeepSpeed models only
        drop(out, "ppo", "colocate_all_models", "with --async_train OpenRLHF colocates the DeepSpeed models only "
             "(its warning): colocate_actor_ref / colocate_critic_reward here, the vLLM engines on GPUs of their own")
        put(out, "ppo", "colocate_actor_ref", True, "(--colocate_all_models with --async_train)")
        if p.get("advantage_estimator", "gae") == "gae" and p.get("reward_model_uri"):  # a critic beside the RM
            put(out, "ppo", "colocate_critic_reward", True, "(--colocate_all_models with --async_train)")
    if p.get("async_train") and p.get("deepspeed_enable_sleep"):
        drop(out, "ppo", "deepspeed_enable_sleep", "with --async_train the learners train while the engines generate: "
             "here they never sleep (a memory saving in OpenRLHF, not a change to what trains)")
    if p.get("vllm_enable_sleep") and not p.get("colocate_all_models"):
        drop(out, "ppo", "vllm_enable_sleep", "OpenRLHF turns it off without --colocate_all_models")
    if out.version == "v0.9.10" and any(not c.get(("ppo", k), "").startswith("--")  # a default was assumed
                                        for k in ("micro_train_batch_size", "micro_rollout_batch_size")):
        out.notes.append("flat flags: OpenRLHF v0.9.10's defaults assumed; v0.10.0 and v0.10.1 (also flat flags) default "
                         "micro_train_batch_size and micro_rollout_batch_size to 1")


def roles(out: Converted) -> None:
    """The roles train_ppo_ray starts (its placement flags name GPUs of the others, which OpenRLHF leaves idle): a
    reference only with init_kl_coef > 0, a critic only for gae, a reward model only without --remote_rm_url /
    --agent_func_path. Their placement is listed (a written flag) or dropped (a default)."""
    p, fields = out.sections["ppo"], config_class("ppo").model_fields
    value = lambda k: p.get(k, fields[k].default)  # noqa: E731
    rewards_from = next((k for k in ("reward_func_path", "remote_rm_url", "agent_func_path", "agent_executor_path")
                         if p.get(k)), None)
    absent = {"ref": float(value("init_kl_coef")) == 0 and "init_kl_coef 0: OpenRLHF starts no reference model",
              "critic": value("advantage_estimator") != "gae" and
              f"advantage_estimator {value('advantage_estimator')}: OpenRLHF starts no critic",
              "reward": rewards_from is not None and f"{rewards_from} gives the rewards: OpenRLHF starts no reward model"}
    for role, why in absent.items():
        for key in (f"{role}_num_nodes", f"{role}_num_gpus_per_node"):
            if key in p and why:
                shown = out.comments.pop(("ppo", key))
                del p[key]
                if shown.startswith("--"):
                    out.holds.append(f"{shown}: {why}")
            elif key in p and p[key] == 0:
                raise CommandError(f"openrlhf.cli.train_ppo_ray (line {out.line}): {out.comments[('ppo', key)]}: "
                                   f"OpenRLHF would start no rank for the {role} model this command uses")


# ---------------------------------------------------------------------------------------------- output
def scalar(v) -> str:
    if isinstance(v, str) and "\n" in v:  # one line: a JSON string is a YAML double-quoted scalar
        return json.dumps(v, ensure_ascii=False)
    return yaml.safe_dump([v], default_flow_style=True, width=10**6, allow_unicode=True).strip()[1:-1]


def render(converted: list[Converted], source: str) -> str:
    lines = [f"# Imported from {source} by `rlhf-flows import-openrlhf` (each key's comment: the OpenRLHF flag)."]
    for c in converted:
        lines.append(c.header or f"# openrlhf.cli.{c.module} ({c.dialect}; OpenRLHF {c.version}'s defaults): run "
                     + " then ".join(f"`rlhf-flows stage {s} --config THIS_FILE`" for s in c.sections))
    steps = [st for c in converted for st in c.steps]
    if steps:
        lines += ["#", "# The script also starts (keep it running beside the stage):"] + [f"#   {st}" for st in steps]
    for title, items in (("Notes:", [n for c in converted for n in c.notes]),
                         ("Flags without a counterpart here (not in the YAML below):", [u for c in converted for u in c.unsupported]),
                         ("Flags that hold here without a key:", [h for c in converted for h in c.holds])):
        if items:
            lines += ["#", f"# {title}"] + [f"#   {n}" for n in items]
    for c in converted:
        for section, keys in c.sections.items():
            indent = "" if section == "" else "  "
            if section:
                lines.append(f"{section}:" + (" {}" if not keys else ""))
            for k, v in keys.items():
                text = f"{indent}{k}: {scalar(v)}"
                note = c.comments.get((section, k))
                lines.append(f"{text:<43} # {note}" if note else text)
    return "\n".join(lines) + "\n"


def validate(text: str, converted: list[Converted]) -> list[str]:
    """Parse the printed YAML back and validate each section with its stage's Config (a flow's with the flow's
    parameters): what is printed loads. ppo is validated as for the GPU cluster it names (accelerator gpu, the
    cluster's resources checked when the stage joins it); the settings only roles on GPUs run (stages.ppo.CUDA_ONLY)
    that this host could not run are returned, to be named in the header."""
    from pydantic import ValidationError

    data, host = yaml.safe_load(text), []
    for c in converted:
        if c.flow:
            from flows.openrlhf import loops

            loops.validate(c.flow, data, lambda msg: CommandError(f"the imported {c.flow} config does not validate: {msg}"))
            continue
        for section in c.sections:
            keys, config = dict(data[section]), config_class(section)
            if "accelerator" in config.model_fields and "accelerator" not in keys:
                keys.update(accelerator="gpu", ray_address=keys.get("ray_address") or "gpu-cluster:6379")
                host += [f"{section}.{k}" for k in cuda_only(section) if data[section].get(k, cuda_only(section)[k]) != cuda_only(section)[k]]
            try:
                config.model_validate(keys)
            except ValidationError as e:
                raise CommandError(f"openrlhf.cli.{c.module} (line {c.line}): the imported {section} config is "
                                   "refused: " + "; ".join(_named(err, section, c) for err in e.errors())) from None
    return host


def cuda_only(section: str) -> dict:
    """A stage's settings that only roles on GPUs run, with their off values; {} on a host with CUDA."""
    import importlib

    import torch

    return {} if torch.cuda.is_available() else getattr(importlib.import_module(f"stages.{section}"), "CUDA_ONLY", {})


def _named(err: dict, section: str, c: Converted) -> str:
    key = str(err["loc"][0]) if err["loc"] else ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":  # name the flag the command lacks
        table = FLAGS["generate" if section == "generate" else "score" if section == "score" else c.module]
        src = " / ".join(f"--{f}" for f, r in table.items() if r in (key, f"{section}.{key}")) or f"--{key}"
        return f"{section}.{key}: {msg} (the command gives no {src})"
    if key:
        src = c.comments.get((section, key), "").split("  ")[0]
        return f"{section}.{key}: {msg}" + (f" ({src})" if src else "")
    # a check across keys: the flags that set the keys its message names
    words = {"LoRA": "lora_rank", "QLoRA": "load_in_4bit"}  # how the stages' messages name some keys
    named = [c.comments[(section, k)] for k in c.sections[section] if (section, k) in c.comments
             and (re.search(rf"\b{k}\b", msg) or any(w in msg and k == key for w, key in words.items()))]
    return f"{section}: {msg}" + (f" ({', '.join(named)})" if named else "")


def import_text(text: str, source: str = "<stdin>", folder: Path | None = None, args: list[str] | None = None) -> str:
    """The YAML of a script's OpenRLHF commands; `args`: the script's own arguments ($1 $2 ...)."""
    from flows.openrlhf import loops

    try:
        script = read_script(text, folder, args, source)
    except ShellError as e:
        raise CommandError(f"{source} {e}: bash would refuse the script") from None
    if script.orphans:
        first, last, words, cmd = script.orphans[0]
        lines = f"line {first}" if first == last else f"lines {first}-{last}"
        between = [(k, line.strip()) for k, line in enumerate(text.splitlines()[cmd.end:first - 1], cmd.end + 1)]
        comment = next((k for k, line in between if line.startswith("#")), None) if not cmd.source else None
        cause = (f"line {comment} is a comment inside the command, and a comment ends it (its backslash is part of "
                 "the comment)" if comment else f"line {cmd.end} ends {where(cmd)} without a backslash")
        raise CommandError(f"{source} {lines}: `{words}` is a command of its own: {cause}, so bash runs the trainer "
                           f"without these flags and then fails on `{words.split()[0]}`"
                           + ("" if comment else f"; end line {cmd.end} with ` \\` to pass them"))
    trainers = [c for c in script.commands if c.module != "serve_rm"]
    servers = [c for c in script.commands if c.module == "serve_rm"] if trainers else []  # beside a trainer: a step
    commands = trainers or script.commands
    if not commands:
        raise CommandError(f"{source}: no OpenRLHF command (deepspeed --module openrlhf.cli.X, python -m / torchrun -m "
                           "openrlhf.cli.X, or ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray)"
                           + (f"; line {script.exit_line} exits before one" + (" (no script arguments given: pass them "
                              "after `--`)" if not args else f" with the arguments {shlex.join(args)}")
                              if script.exit_line else "")
                           + (f"; it runs `{script.unread[0]}`, which is not beside it: import that file"
                              if script.unread else ""))
    converted = loops.join(commands, convert, CommandError)
    first = converted[0]
    for c in servers:
        first.steps.append(f"line {c.line}: `{command_text(c)}` (OpenRLHF's reward server): here run "
                           f"{serve_rm_command(c)}")
    for srv in script.servers:
        first.steps.append(f"line {srv.line}{', in ' + srv.source if srv.source else ''}: `{srv.text}` (the "
                           "script's own reward server, not OpenRLHF's): start it as the script does")
    first.notes += [f"the script reads {n}, and no argument gives it: read as empty (`rlhf-flows import-openrlhf "
                    f"{source} -- ARG...` passes the script's arguments)" for n in script.positional]
    first.notes += [f"line {line}: `{test}` is decided when the script runs: every branch of it was read (its "
                    "commands found, its assignments not taken)" for line, test in script.undecided]
    seen: set[str] = set()
    for c in converted:
        if clash := set(c.sections) & seen - {""}:
            raise CommandError(f"{source} line {c.line}: a second command for stage {', '.join(sorted(clash))}: "
                               "import each from its own file")
        seen |= set(c.sections)
    text = render(converted, source)
    if lost := unaccounted(text, script.commands):
        raise CommandError(f"{source}: {', '.join(lost)} would be dropped without a word (an importer bug: every "
                           "flag is a key's comment or listed)")
    host = validate(text, converted)
    if host:  # the rest validated; these are refused on this host only
        head, rest = text.split("\n", 1)
        text = "\n".join([head, "# On this host (no CUDA device) these keys are refused (settings only roles on GPUs run; "
                                 "a GPU cluster runs them):", *(f"#   {h}" for h in host), rest])
    return text


def command_text(cmd: Command) -> str:
    launcher = " ".join(f"--{f}" + ("" if v is True else f" {show(v)}") for f, v in cmd.launcher)
    flags = " ".join(f"--{f}" + ("" if v is True else f" {show(v)}") for f, v in cmd.flags)
    return " ".join(x for x in (cmd.runner, launcher, "-m" if not cmd.by_path else "", cmd.by_path or
                                f"openrlhf.cli.{cmd.module}", flags) if x)


def unaccounted(text: str, commands: list[Command]) -> list[str]:
    """The flags of `commands` that no comment of the output names (each must be a key's comment or listed)."""
    comments = "\n".join(line[line.index("#"):] for line in text.splitlines() if "#" in line)
    return [f"--{flag}" for c in commands for flag, _ in [*c.launcher, *c.flags]
            if not re.search(rf"(?<![\w.-])--{re.escape(flag)}(?![\w.-])", comments)]


def main(path: str, output: str | None, args: list[str] | None = None) -> int:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    out = import_text(text, "stdin" if path == "-" else path, None if path == "-" else Path(path).parent, args)
    if output:
        Path(output).write_text(out)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0
