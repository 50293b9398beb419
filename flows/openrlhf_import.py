"""`rlhf-flows import-openrlhf FILE|-`: an OpenRLHF launch command or script -> the equivalent stage or flow YAML.

Reads the commands a script launches (`deepspeed --module openrlhf.cli.X`, `python -m`, `torchrun -m`, `ray job
submit ... --`, inside `srun ... bash -c "..."`, with its variables, bash arrays, heredocs and sourced files:
flows/openrlhf_shell.py) in both of OpenRLHF's dialects: the flat flags of v0.9 (`--pretrain`,
`--micro_train_batch_size`) and the dotted flags of v0.10.2+ (`--model.model_name_or_path`,
`--train.micro_batch_size`). A dotted flag is first renamed to the flat flag it replaced, so both dialects go
through one table per module and give the same YAML; each key's comment names the flag as written. The tables
are data: flows/openrlhf_flags.yaml, read by flows/openrlhf_flags.py.

Every flag of the command is a commented key, or listed at the top: without a counterpart (with the reason), or
holding here without a key. Flags the command omits get OpenRLHF's default of the version its dialect belongs
to (flat: v0.9.10; dotted: v0.11.0; kto / kd / prm / batch_inference: v0.9.5) where it differs from the stage's,
and the header says which version was assumed. Model and dataset hub ids (`org/name[@rev]`) are written as
given. `batch_inference --post_processor rs|iter_dpo|csft` becomes score then the filter stage, the trainer
reading the filter's output; a script's generate -> score -> train loop becomes the matching flow
(flows/openrlhf_loops.py). What has no counterpart at all is refused in one line naming it: serve_rm (with the
serve-rm command that replaces it), vision-language runs, a setting the stages refuse (named with
the flags that set it). The YAML is parsed back and validated with each stage's (or the flow's) Config before it
is printed.

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

from flows.openrlhf_flags import (DEFAULTS, DOTTED, FLAGS, LAUNCHER, SERVE_RM, SERVE_RM_DEFAULTS, STAGES, VLM_FLAGS,  # noqa: F401
                                  Fixed, No, NoCounterpart, SplitOf, defaults, flat_name, unknown_flag, version_of)
from flows.openrlhf_shell import Command, find_commands, unread_sources  # noqa: F401 (the importer's API)


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
    written = {flat_name(f) for f, _ in cmd.flags}
    assumed = defaults(cmd.module, dotted, written)
    for table, flags, default in ((LAUNCHER, cmd.launcher, False), (FLAGS[table_name], cmd.flags, False),
                                  (FLAGS[table_name], assumed, True)):
        for flag, value in flags:
            name = flag if table is LAUNCHER else flat_name(flag)
            rule = table.get(name, name if name in fields[main] else None)
            shown = f"--{flag}" + ("" if value is True else f" {' '.join(map(str, value)) if isinstance(value, list) else value}")
            if default:
                shown = f"(OpenRLHF {out.version}'s default {shown!r})"
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
    wire(cmd, out, given)
    return out


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
    out.notes += [f"{v} is not set by a VAR=value line the script runs: replace it" for v in cmd.unresolved]
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
    if "eval_steps" in s[main] and "eval_dataset" not in s[main] and main != "generate":
        drop(out, main, "eval_steps", "no --eval_dataset, so no evaluation (OpenRLHF ignores it)")
    if s[main].get("save_hf_ckpt") and not s[main].get("save_steps"):  # OpenRLHF writes the HF folder with a checkpoint
        drop(out, main, "save_hf_ckpt", "no --save_steps, so no checkpoint and no HF folder beside one (OpenRLHF writes none either)")
    if main == "score":
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
    elif cmd.module.startswith("train_") and cmd.runner == "deepspeed" and "num_gpus" not in dict(cmd.launcher):
        out.notes.append("deepspeed without --num_gpus uses every GPU of the node: set num_gpus (default 1 here)")


def ppo_rules(out: Converted, given: dict) -> None:
    """OpenRLHF's train_ppo_ray rules between flags, as this stage's keys."""
    p, c = out.sections["ppo"], out.comments
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
    if out.version == "v0.9.10" and any(k not in given for k in ("micro_train_batch_size", "micro_rollout_batch_size")):
        out.notes.append("flat flags: OpenRLHF v0.9.10's defaults assumed; v0.10.0 and v0.10.1 (also flat flags) default "
                         "micro_train_batch_size and micro_rollout_batch_size to 1")


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
            from flows import openrlhf_loops

            openrlhf_loops.validate(c.flow, data, lambda msg: CommandError(f"the imported {c.flow} config does not validate: {msg}"))
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


def import_text(text: str, source: str = "<stdin>", folder: Path | None = None) -> str:
    from flows import openrlhf_loops

    commands = find_commands(text, folder)
    if not commands:
        unread = unread_sources(text, folder)
        raise CommandError(f"{source}: no OpenRLHF command (deepspeed --module openrlhf.cli.X, python -m / torchrun -m "
                           "openrlhf.cli.X, or ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray)"
                           + (f"; it runs `{unread[0]}`, which is not beside it: import that file" if unread else ""))
    converted = openrlhf_loops.join(commands, convert, CommandError)
    seen: set[str] = set()
    for c in converted:
        if clash := set(c.sections) & seen - {""}:
            raise CommandError(f"{source} line {c.line}: a second command for stage {', '.join(sorted(clash))}: "
                               "import each from its own file")
        seen |= set(c.sections)
    text = render(converted, source)
    host = validate(text, converted)
    if host:  # the rest validated; these are refused on this host only
        head, rest = text.split("\n", 1)
        text = "\n".join([head, "# On this host (no CUDA device) these keys are refused (settings only roles on GPUs run; "
                                 "a GPU cluster runs them):", *(f"#   {h}" for h in host), rest])
    return text


def main(path: str, output: str | None) -> int:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    out = import_text(text, "stdin" if path == "-" else path, None if path == "-" else Path(path).parent)
    if output:
        Path(output).write_text(out)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0
