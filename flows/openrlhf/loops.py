"""A script's batch_inference and trainer commands as one pipeline (read by flows/openrlhf/importer.py).

OpenRLHF's batch_inference `--eval_task rm --post_processor rs|iter_dpo|csft` writes post-processed rows that
the next trainer reads; here the filter stage does the post-processing, so the trainer reads the filter's output.
A loop around generate -> score -> train (OpenRLHF v0.9.5's iterative DPO and rejection-sampling scripts)
becomes the config of the matching flow, which slices the prompts per iteration (`--iter`), chains each
iteration's policy into the next and resumes from its manifests (the scripts' ITER_LOG_PATH counter):

    post_processor + trainer      flow
    iter_dpo + train_dpo          iterative-dpo
    iter_dpo + train_kto          iterative-dpo (trainer kto)
    rs + train_sft                raft
    rs + train_kd                 raft (trainer kd)
    csft + train_sft              conditional-sft
"""
from __future__ import annotations

import importlib
import posixpath
import re
from typing import Any, Callable

from flows.openrlhf.flags import flat_name

FLOWS = {("iter_dpo", "train_dpo"): ("iterative-dpo", {}), ("iter_dpo", "train_kto"): ("iterative-dpo", {"trainer": "kto"}),
         ("rs", "train_sft"): ("raft", {}), ("rs", "train_kd"): ("raft", {"trainer": "kd"}),
         ("csft", "train_sft"): ("conditional-sft", {})}
TRAINER = {"train_dpo": "dpo", "train_kto": "kto", "train_sft": "sft", "train_kd": "kd"}  # the trainer's stage
SECTION = {"sft": "sft_loop"}  # a trainer stage's section in the flow, where it is not the stage's name
PROMPT_KEYS = {"input_key": "input_key", "label_key": "label_key", "apply_chat_template": "apply_chat_template",
               "input_template": "input_template", "tokenizer_chat_template": "tokenizer_chat_template",
               "prompt_data_probs": "data_probs"}  # generate's prompt formatting: the flow's prepare stage does it


def join(commands: list, convert: Callable, error: Callable) -> list:
    """The converted commands, the trainer reading the filter's output; a loop: one flow config."""
    generated = {v for c in commands for f, v in c.flags if flat_name(f) == "output_path"
                 and dict((flat_name(g), w) for g, w in c.flags).get("eval_task", "generate") != "rm"}
    converted = [convert(c, generated) for c in commands]
    rewire(converted)
    loops = {id(c.loop): c.loop for c in commands if c.loop}
    if not loops:
        return converted
    loop = next(iter(loops.values()))
    if len(loops) > 1 or any(c.loop is None for c in commands):
        raise error(f"the script runs a loop (line {loop.line}) and other commands: import each from its own file")
    return [as_flow(converted, loop, error)]


def rewire(converted: list) -> None:
    """A trainer whose --dataset is a score command's output reads that command's filter output instead."""
    for i, c in enumerate(converted):
        if "filter" not in c.sections:
            continue
        scored, rows, method = (c.sections["filter"][k] for k in ("scored_uri", "output_uri", "method"))
        for t in converted[i + 1:]:
            main = next(iter(t.sections))
            if t.module == "train_dpo" and t.sections["prepare"].get("data") == scored:  # the pairs, formatted already
                prep = t.sections.pop("prepare")
                for k in prep:
                    if (shown := t.comments.pop(("prepare", k), "")).startswith("--") and k != "data":
                        t.unsupported.append(f"{shown}: the {method} filter's pairs are formatted already")
                t.sections["reference"]["pairs_uri"] = rows
                t.comments[("reference", "pairs_uri")] = f"{t.comments.pop(('prepare', 'data'), '')} (the {method} filter's output)"
            elif t.sections[main].get("dataset_uri") == scored:
                t.sections[main]["dataset_uri"] = rows
                t.comments[(main, "dataset_uri")] += f" (the {method} filter's output)"


def as_flow(converted: list, loop, error: Callable):
    by = {s: c for c in converted for s in c.sections}
    gen, sc = by.get("generate"), by.get("score")
    tr = next((c for c in converted if c.module in TRAINER), None)
    modules = " -> ".join(c.module for c in converted)
    if not (gen and sc and tr):
        raise error(f"the loop at line {loop.line} runs {modules}: a flow here loops generate -> score -> filter -> "
                    "train (iterative-dpo, raft, conditional-sft)")
    method = sc.sections.get("filter", {}).get("method")
    if (method, tr.module) not in FLOWS:
        raise error(f"the loop at line {loop.line} runs {modules} with --post_processor {method}: no flow here does "
                    f"that ({'; '.join(f'{p} + {t}: {f}' for (p, t), (f, _) in FLOWS.items())})")
    flow, extra = FLOWS[(method, tr.module)]
    trainer = TRAINER[tr.module]
    out = type(gen)("loop", "", {"": {}}, {}, loop.line, gen.version, flow=flow)
    out.header = (f"# The loop at line {loop.line} (`{loop.header}`) of {modules}: run "
                  f"`rlhf-flows run {flow} --config THIS_FILE` (each iteration's stages under {{root}}/{{run_name}}/iter-k/)")
    for c in converted:
        out.unsupported += c.unsupported
        out.holds += c.holds
        out.notes += [n for n in c.notes if not n.startswith("score.samples_uri")]
    top, t = out.sections[""], tr.sections[trainer]
    policy = gen.sections["generate"]["policy_uri"]
    outputs = [gen.sections["generate"]["output_uri"], sc.sections["score"]["output_uri"], t["output_uri"]]
    common = posixpath.commonpath([posixpath.normpath(o) for o in outputs]) or "."
    root, run = posixpath.split(common)
    top["root"] = f"./{root}" if root and outputs[0].startswith("./") else root or "."
    top["run_name"] = re.sub(r"[^A-Za-z0-9._-]", "-", run) or "run"
    out.comments[("", "root")] = f"(the folder of the loop's outputs: {common})"
    top["iterations"] = loop.iterations or 1
    out.comments[("", "iterations")] = (f"(the loop at line {loop.line}: `{loop.header}`)" if loop.iterations else
                                        "(the loop's bound is not a value the script sets: give it)")
    top["pretrain_uri"], out.comments[("", "pretrain_uri")] = policy, gen.comments[("generate", "policy_uri")]
    for key, flow_key in (("reward_model_uri", "reward_uri"), ("reward_func_path", "reward_func_file"), ("remote_rm_url", "reward_url")):
        if key in sc.sections["score"]:
            top[flow_key], out.comments[("", flow_key)] = sc.sections["score"][key], sc.comments[("score", key)]
    top["prompt_data"], out.comments[("", "prompt_data")] = gen.sections["generate"]["prompts_uri"], gen.comments[("generate", "prompts_uri")]
    if t.get("policy_uri") != policy:
        out.notes.append(f"the trainer's first policy ({t.get('policy_uri')}) is not generate's ({policy}): the flow "
                         "trains the policy it generated with")
    if trainer == "dpo":
        ref = tr.sections["reference"].get("ref_uri")
        if ref not in (policy, t["output_uri"]):
            raise error(f"the loop at line {loop.line} keeps the reference {ref}, neither the initial policy nor the "
                        "previous iteration's: the iterative-dpo flow's ref_policy is initial or previous")
        top["ref_policy"] = "initial" if ref == policy else "previous"
        out.comments[("", "ref_policy")] = tr.comments.get(("reference", "ref_uri"), "(--pretrain)")
    for k, v in extra.items():
        top[k], out.comments[("", k)] = v, f"(openrlhf.cli.{tr.module})"
    move(out, gen, "generate", {k: ("prepare", p) for k, p in PROMPT_KEYS.items()})
    move(out, sc, "score")
    move(out, sc, "filter")
    move(out, tr, trainer, into=SECTION.get(trainer, trainer))
    if trainer == "dpo":  # the flow's reference pass takes dpo's settings unless its own say otherwise
        dpo = out.sections.get("dpo", {})
        move(out, tr, "reference", skip={k for k, v in tr.sections["reference"].items() if dpo.get(k) == v})
    out.holds.append(f"--post_processor {method}: the {flow} flow's filter (method {method}) on each iteration's scores")
    out.notes.append(f"the flow resumes from its manifests under {top['root']}/{top['run_name']}/ (rerun the same "
                     "command), instead of the script's iteration counter file")
    return out


def move(out, c, section: str, to: dict | None = None, into: str | None = None, skip: set = frozenset()) -> None:
    """A stage section's keys into the flow's section `into` (or `to[key]`); a key the flow sets itself is listed
    with its flag."""
    from flows.common import _flow_sets

    for key, value in c.sections.get(section, {}).items():
        shown = c.comments.get((section, key), "")
        dest, dest_key = (to or {}).get(key, (into or section, key))
        if key in skip:
            continue
        if _flow_sets(dest, dest_key):
            if shown.startswith("--"):
                out.holds.append(f"{shown}: set by the flow each iteration ({section}.{key})")
            continue
        out.sections.setdefault(dest, {})[dest_key] = value
        out.comments[(dest, dest_key)] = shown


def validate(flow: str, data: dict[str, Any], error: Callable) -> None:
    """The flow's parameters and every stage config it builds, as `rlhf-flows run FLOW --config FILE` checks them."""
    from pydantic import ValidationError

    from flows import common
    from flows.table import FLOWS as SPECS
    from stages.common import ConfigError

    module = importlib.import_module(SPECS[flow].module)
    try:
        params = module.Params.model_validate(data)
        common.validate(params, flow, module.checks(params))
    except ValidationError as e:
        raise error("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
    except ConfigError as e:
        raise error(" ".join(str(e).split())) from None
