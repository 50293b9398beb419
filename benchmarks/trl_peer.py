"""What the trainer-vs-TRL benchmarks share (dpo_vs_trl.py, kto_vs_trl.py): the command line, the tiny
policy and the lengthened demo pairs, the TRL run in TRL's own process, and the side-by-side comparison
(alternating runs, a float32 check on every side, medians, ratios). Standard library only at import: the
TRL side imports this file too, inside TRL's own virtualenv."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"trl_defaults": {}, "trl_best": {"precompute_ref_log_probs": True, "gradient_checkpointing": False}}


def parser(pairs_help: str = "preference pairs") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512, help=pairs_help)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; medians reported")
    ap.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help="python of TRL's own venv")
    ap.add_argument("--trl-peer", help=argparse.SUPPRESS)  # internal: run one TRL variant from a JSON spec
    return ap


def trl_train(spec: dict, config_cls: str, trainer_cls: str) -> dict:
    """One TRL run (TRL's venv: torch, transformers, datasets, trl only): trainer.train() seconds and the
    dtype the training forward really ran in (a hook on the decoder; TRL fuses the LM head)."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    seen = set()

    def hook(_module, _args, out):
        seen.add((str(out[0].dtype), torch.is_autocast_enabled("cpu")))

    model.get_decoder().register_forward_hook(hook)
    args = getattr(trl, config_cls)(output_dir=spec["out"], per_device_train_batch_size=spec["batch"],
                                    max_length=spec["max_len"], num_train_epochs=1, learning_rate=5e-4, beta=0.1,
                                    report_to=[], use_cpu=True, save_strategy="no", logging_steps=1000,
                                    dataloader_num_workers=0, bf16=False, fp16=False, **spec["extra"])
    tr = getattr(trl, trainer_cls)(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                   processing_class=tok)
    t = time.time()
    tr.train()
    s = time.time() - t
    return {"train_s": s, "dtype": "float32" if seen == {("torch.float32", False)} else f"NOT fp32: {sorted(seen)}",
            "trl": trl.__version__, "torch": torch.__version__}


def setup(prefix: str, n_pairs: int) -> tuple[Path, Path, str, list[dict]]:
    """(root folder, tiny policy folder, its committed URI, n demo pairs lengthened to ENV-NOTES' shape).
    ENV-NOTES' reference figures used prompts of 20-43 tokens and responses of 9-82: the demo's pairs get
    neutral words on the prompt and several reviews per response. The labels then no longer follow the gold
    reward: these benchmarks measure speed only."""
    import logging
    import random

    from rlhf_core import demo_task, store, tiny as tiny_mod

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    policy, _ = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"seed": 0})
    rng = random.Random(7)
    pairs = demo_task.preference_rows(n_pairs, seed=7)
    for r in pairs:
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(14, 36))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(0, 7))])
    return root, policy, policy_uri, pairs


def float32_trained(manifest, model_dir: Path) -> str:
    """'float32' when our job ran with bf16 off and saved float32 weights, else what it saved."""
    from safetensors.torch import load_file

    dtypes = {str(t.dtype) for t in load_file(str(model_dir / "model.safetensors")).values()}
    return "float32" if manifest.config.get("bf16") is False and dtypes == {"torch.float32"} else f"NOT fp32: {dtypes}"


def compare(a, script: str, root: Path, policy: Path, ours, real: int, extra: dict | None = None) -> None:
    """Run `ours(i)` and every TRL variant `a.repeats` times, alternating, refuse unless every side trained
    in float32, and print medians, tokens/s (`real` tokens, reference pass counted) and our speedups."""
    import torch

    def trl(name: str, i: int) -> dict:
        spec = {"rows": str(root / "rows.jsonl"), "policy": str(policy), "out": str(root / f"{name}{i}"),
                "batch": a.batch, "max_len": a.max_len, "extra": VARIANTS[name]}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # TRL's venv sees only itself
        out = subprocess.run([a.trl_python, script, "--trl-peer", json.dumps(spec)], capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or not line:
            sys.exit(f"TRL run {name} failed ({a.trl_python}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return json.loads(line[len("RESULT "):])

    runs: dict[str, list[dict]] = {"ours": [], **{n: [] for n in VARIANTS}}
    for i in range(a.repeats):  # alternate, so drifting machine load hits both sides alike
        runs["ours"].append(ours(i))
        print("ours:", json.dumps(runs["ours"][-1]), flush=True)
        for name in VARIANTS:
            runs[name].append(trl(name, i))
            print(f"{name}:", json.dumps(runs[name][-1]), flush=True)
    bad = {n: r["dtype"] for n, rs in runs.items() for r in rs if r["dtype"] != "float32"}
    if bad:
        sys.exit(f"refusing to compare: not every side trained in float32: {bad}")
    med = statistics.median
    ref_s, loop_s = med([r["reference_pass_s"] for r in runs["ours"]]), med([r["train_loop_s"] for r in runs["ours"]])
    ours_tps = real / (ref_s + loop_s)
    res = {**(extra or {}), "real_tokens": real, "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
           "ours": {"reference_pass_s": ref_s, "train_loop_s": loop_s, "tokens_per_s_ref_counted": ours_tps,
                    "train_loop_tokens_per_s": real / loop_s,
                    "stage_wall_s": med([r["stage_wall_s"] for r in runs["ours"]])}}
    for name in VARIANTS:
        s = med([r["train_s"] for r in runs[name]])
        res[name] = {"train_s": s, "tokens_per_s_ref_counted": real / s, "trl": runs[name][0]["trl"]}
        res[f"speedup_vs_{name}"] = ours_tps / (real / s)
    res["runs"] = runs
    print(json.dumps(res, indent=1))
