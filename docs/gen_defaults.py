"""OpenRLHF's defaults beside the stages': the table of docs/openrlhf-defaults.md, generated at every `mkdocs build`
(a mkdocs hook named in mkdocs.yml; the marker `<!-- openrlhf-defaults -->` is replaced) from the importer's data,
so the page, `rlhf-flows import-openrlhf` and the stages cannot disagree.

A row is an OpenRLHF flag whose default (read from OpenRLHF's argparse parsers at v0.9.5, v0.9.10 and v0.11.0:
flows/openrlhf/flags.yaml `defaults`) differs from the default of the stage key the importer maps it to. The
importer writes these into an imported command's YAML by itself; a config written by hand gets the stage's.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # mkdocs loads this file by path: the project's packages from the repo root
    sys.path.insert(0, str(ROOT))
MARKER = re.compile(r"<!-- openrlhf-defaults -->")

# Why a stage keeps its own default (by stage key). A key not here: a plain difference, set the key to OpenRLHF's.
WHY = {
    "bf16": "fp32 unless set: these CPUs run bf16 about 6x slower (`bf16: true` on GPUs; the GPU configs set it)",
    "max_epochs": "one pass, as the other trainers",
    "train_batch_size": "sized for the CPU demo and tests",
    "micro_train_batch_size": "sized for the CPU demo and tests",
    "rollout_batch_size": "sized for the CPU demo and tests",
    "micro_rollout_batch_size": "unset: micro_train_batch_size",
    "max_len": "sized for the CPU demo and tests",
    "reward_max_len": "the reward model's cap (OpenRLHF's max_len is prompt + response)",
    "vllm_num_engines": "one rollout engine (0 generates with policy rank 0's own model, as OpenRLHF without vLLM)",
    "input_template": "OpenRLHF's applies only without apply_chat_template; here a prompt is used as written",
    "input_key": "the demo data's key",
    "batch_size": "sized for the CPU demo and tests",
    "seed": "the project's seed",
    "learning_rate": "the trainers' common default",
    "output_key": "the demo data's key (null: the last message of input_key's list is the response)",
    "eval_split": "a source's held-out split",
    "prompt_key": "the demo data's key (null: the prompt is part of chosen / rejected)",
    "beta": "TRL's KTO default (0.1)",
    "label_key": "Math-Shepherd-style data's key",
}

PLAIN = "set the key to OpenRLHF's value"

# Differences the importer does not write (no one-to-one value, or a checkpoint / placement setting): by hand.
EXTRA = [
    ("train_ppo_ray", "max_new_tokens", "null: up to max_len (2048) minus the prompt (v0.9.10, v0.11.0)",
     "ppo.generate_max_len", "`64`", "a fixed cap, sized for the CPU demo and tests (the importer writes max_len minus "
     "prompt_max_len)"),
    ("train_ppo_ray", "max_ckpt_num", "`3` (v0.9.10, v0.11.0)", "ppo.max_ckpt_num", "`1`",
     "the store keeps the newest checkpoint unless asked"),
    ("train_sft, _rm, _dpo, _kto, _kd, _prm", "max_ckpt_num", "`3` (v0.9.5, v0.9.10, v0.11.0)",
     "max_ckpt_num of each trainer", "`1`", "the store keeps the newest checkpoint unless asked"),
    ("train_ppo_ray and every trainer", "attn_implementation", "`flash_attention_2` (v0.9.5, v0.9.10, v0.11.0)",
     "attn_implementation of each", "`sdpa`", "the same math; flash_attention_2 needs CUDA and the flash-attn package "
     "(the `gpu` extra and the GPU image install it)"),
    ("train_kto", "output_key", "`null` (v0.9.5: input_key's message list, its last message the response)",
     "kto.output_key", "`completion`", "TRL's unpaired-preference column"),
    ("train_prm", "placeholder_token` / `--reward_tokens", "`null` (v0.9.5: the command must give them)",
     "train_prm.placeholder_token, reward_tokens", "`ки`, `['+', '-']`", "Math-Shepherd's tokens"),
    ("batch_inference", "param_dtype", "`bf16` (v0.9.5)", "generate.dtype, score.dtype", "`auto`",
     "the model's stored dtype"),
    ("batch_inference", "tp_size", "every GPU of the node (v0.9.5)", "generate.tensor_parallel_size", "`1`",
     "one GPU per engine unless set"),
]


def differences() -> list[dict]:
    """One dict per (OpenRLHF module, flag) whose OpenRLHF default differs from its stage key's default."""
    import importlib

    from flows.openrlhf import importer as imp
    from flows.openrlhf.flags import DEFAULTS, FLAGS, STAGES, Fixed, No, NoCounterpart

    rows: dict[tuple, dict] = {}
    for version, modules in DEFAULTS.items():
        for module, flags in modules.items():
            tables = [(t, s) for t, s in (("generate", ["generate"]), ("score", ["score"]))] \
                if module == "batch_inference" else [(module, STAGES[module])]
            for table, sections in tables:
                fields = {s: importlib.import_module(f"stages.{s}").Config.model_fields for s in sections}
                for flag, value in flags.items():
                    rule = FLAGS[table].get(flag, flag if flag in fields[sections[0]] else None)
                    if rule is None or (isinstance(rule, No) and not isinstance(rule, Fixed)):
                        continue  # no counterpart: the importer lists it when a command sets it
                    if isinstance(rule, Fixed):
                        continue  # the stage always behaves as one value (the importer says so)
                    try:
                        keys = imp.targets(rule, value, sections[0], flag)
                    except NoCounterpart:
                        continue
                    for section, key, v in keys:
                        if key not in fields.get(section, {}):
                            continue
                        info = fields[section][key]
                        v = imp.check(info.annotation, v, flag, f"{section}.{key}")
                        if info.is_required():
                            continue  # save_path -> output_uri: given in every config
                        ours = info.get_default(call_default_factory=True)
                        if v == ours or (isinstance(ours, tuple) and list(ours) == v):
                            continue
                        name = module if table == module else f"batch_inference ({table})"
                        row = rows.setdefault((name, flag, section, key), {"module": name, "flag": flag,
                                                                          "key": f"{section}.{key}", "ours": ours,
                                                                          "theirs": {}})
                        row["theirs"][version] = value  # as OpenRLHF writes it
    return sorted(rows.values(), key=lambda r: (r["module"], r["flag"]))


def _value(v) -> str:
    if isinstance(v, str):
        return f"`{v!r}`" if "\n" in v or not v else f"`{v}`"
    return f"`{'null' if v is None else v}`"


def table() -> str:
    lines = ["| OpenRLHF module | flag | OpenRLHF's default | stage key | its default | why it differs |",
             "|---|---|---|---|---|---|"]
    for r in differences():
        versions: dict[str, list[str]] = {}
        for ver, v in sorted(r["theirs"].items()):
            versions.setdefault(_value(v), []).append(ver)
        theirs = "; ".join(f"{v} ({', '.join(vs)})" for v, vs in versions.items())
        key = r["key"].split(".", 1)[1]
        lines.append(f"| {r['module']} | `--{r['flag']}` | {theirs} | `{r['key']}` | {_value(r['ours'])} | "
                     f"{WHY.get(key, PLAIN)} |")
    for module, flag, theirs, key, ours, why in EXTRA:
        lines.append(f"| {module} | `--{flag}` | {theirs} | `{key}` | {ours} | {why} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: table(), markdown)


if __name__ == "__main__":
    print(table())
