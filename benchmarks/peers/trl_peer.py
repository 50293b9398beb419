"""What the trainer-vs-TRL benchmarks share (dpo_vs_trl.py, kto_vs_trl.py, rm_vs_trl.py, ...): the command line, the tiny
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
SIZES = {"tiny": {}, "57m": {"hidden": 768, "layers": 8, "heads": 12, "intermediate": 2048}}


class PeakRSS:
    """Peak memory (MB) of a process tree, sampled every 50 ms while the block runs: the process `pid` (default:
    this one) and all its descendants, or with `children_only` its descendants only (our stage's training job,
    without the benchmark process that runs the stage), or with `alone` that process only. Each process counts its
    proportional set size (PSS: a page that n processes share counts 1/n in each), so a job forked from the warm
    fork server (rlhf_core/runtime/forkserver.py) and the server do not both count the imports they share; for one
    process, as TRL's side, PSS is its RSS less its share of pages other processes map too (shared libraries)."""

    def __init__(self, pid: int | None = None, children_only: bool = False, alone: bool = False):
        self.pid, self.children_only, self.alone, self.peak_mb = pid or os.getpid(), children_only, alone, 0.0

    def _sample(self):
        import psutil

        while not self._stop.wait(0.05):
            try:
                root = psutil.Process(self.pid)
                procs = [*([] if self.children_only else [root]), *([] if self.alone else root.children(recursive=True))]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                self.peak_mb = max(self.peak_mb, total / 2 ** 20)
            except psutil.Error:
                return

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def parser(pairs_help: str = "preference pairs") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512, help=pairs_help)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; medians reported")
    ap.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help="python of TRL's own venv")
    ap.add_argument("--model", choices=sorted(SIZES), default="tiny",
                    help="tiny (the demo's, ~0.9M parameters: overhead-bound) or 57m (Llama-shaped, hidden 768, 8 "
                         "layers, 12 heads, MLP 2048, the tiny tokenizer: matmul-bound on these CPUs)")
    ap.add_argument("--trl-variants", help="comma-separated TRL variants to run (default: all of the script's)")
    ap.add_argument("--no-bare", action="store_true", help="leave out the plain PyTorch loop over our batches")
    ap.add_argument("--trl-peer", help=argparse.SUPPRESS)  # internal: run one TRL variant from a JSON spec
    return ap


def trl_train(spec: dict, config_cls: str, trainer_cls: str) -> dict:
    """One TRL run (TRL's venv: torch, transformers, datasets, trl only): its work in seconds, trainer.train()
    plus the reference precompute where precompute_ref_log_probs runs it (TRL 1.16's DPOTrainer and KTOTrainer
    call _precompute_ref_logps in __init__, before train(): timed apart and counted, as our reference pass is),
    and the dtype the training forward really ran in (a hook on the decoder; TRL fuses the LM head)."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    torch.manual_seed(0)
    if trainer_cls == "RewardTrainer":  # a causal LM's body under a new scalar head, as our train_rm loads it
        model = AutoModelForSequenceClassification.from_pretrained(spec["policy"], dtype=torch.float32, num_labels=1)
        model.config.pad_token_id = tok.pad_token_id
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    seen = set()

    def hook(_module, _args, out):
        seen.add((str(out[0].dtype), torch.is_autocast_enabled("cpu")))

    getattr(model, model.base_model_prefix).register_forward_hook(hook)
    beta = {} if config_cls in ("SFTConfig", "RewardConfig") else {"beta": 0.1}
    args = getattr(trl, config_cls)(output_dir=spec["out"], per_device_train_batch_size=spec["batch"],
                                    max_length=spec["max_len"], num_train_epochs=1, learning_rate=5e-4, **beta,
                                    report_to=[], use_cpu=True, save_strategy="no", logging_steps=1000,
                                    dataloader_num_workers=0, bf16=False, fp16=False, **spec["extra"])
    cls, pre = getattr(trl, trainer_cls), [0.0]
    if hasattr(cls, "_precompute_ref_logps"):
        precompute = cls._precompute_ref_logps

        def timed(self, *a, **k):
            t0 = time.time()
            try:
                return precompute(self, *a, **k)
            finally:
                pre[0] += time.time() - t0

        cls._precompute_ref_logps = timed
    tr = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    t = time.time()
    tr.train()
    s = time.time() - t
    return {"train_s": s + pre[0], "train_only_s": s, "ref_precompute_s": pre[0],
            "dtype": "float32" if seen == {("torch.float32", False)} else f"NOT fp32: {sorted(seen)}",
            "trl": trl.__version__, "torch": torch.__version__}


def setup(prefix: str, n_pairs: int, model: str = "tiny") -> tuple[Path, Path, str, list[dict]]:
    """(root folder, tiny policy folder, its committed URI, n demo pairs lengthened to ENV-NOTES' shape).
    ENV-NOTES' reference figures used prompts of 20-43 tokens and responses of 9-82: the demo's pairs get
    neutral words on the prompt and several reviews per response. The labels then no longer follow the gold
    reward: these benchmarks measure speed only."""
    import logging
    import random

    from rlhf_core.demo import demo_task, tiny as tiny_mod
    from rlhf_core import store

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    policy, _ = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0, **SIZES[model])
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"seed": 0})
    rng = random.Random(7)
    pairs = demo_task.preference_rows(n_pairs, seed=7)
    for r in pairs:
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(14, 36))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(0, 7))])
    return root, policy, policy_uri, pairs


def commit_rows(root: Path, rows: list[dict], kind: str, name: str) -> str:
    """`rows` twice: as root/rows.jsonl (what the TRL side reads) and as a committed data artifact of `kind` under
    root/store/`name` (what our stage reads); the artifact's URI."""
    from rlhf_core import store
    from rlhf_core.inputs import data

    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    uri = str(root / "store" / name)
    w = store.ArtifactWriter(uri, "data", {"n": len(rows)})
    w.begin()
    w.write_table(f"{kind}.parquet", data.to_table(rows, kind))
    w.commit()
    return uri


def float32_trained(manifest, model_dir: Path) -> str:
    """'float32' when our job ran with bf16 off and saved float32 weights, else what it saved."""
    from safetensors.torch import load_file

    dtypes = {str(t.dtype) for t in load_file(str(model_dir / "model.safetensors")).values()}
    return "float32" if manifest.config.get("bf16") is False and dtypes == {"torch.float32"} else f"NOT fp32: {dtypes}"


def compare(a, script: str, root: Path, policy: Path, ours, real: int, extra: dict | None = None,
            variants: dict | None = None, bare=None) -> None:
    """Run `ours(i)`, every TRL variant and (if given) `bare(i)`, `a.repeats` times each, alternating, refuse
    unless every side trained in float32, and print medians with ranges (min-max), tokens/s (`real` tokens,
    reference pass counted), peak memory of each side's process tree, and our ratios.

    `ours(i)` -> {reference_pass_s, train_loop_s, stage_wall_s, dtype}; `bare(i)` -> {train_loop_s, dtype}:
    a plain PyTorch loop over the same batches (forward, loss, backward, clip, fused AdamW), no engine."""
    import torch

    variants = variants or VARIANTS
    if a.trl_variants:
        unknown = set(a.trl_variants.split(",")) - set(variants)
        if unknown:
            sys.exit(f"--trl-variants: {sorted(unknown)} not among {sorted(variants)}")
        variants = {k: v for k, v in variants.items() if k in a.trl_variants.split(",")}
    bare = None if a.no_bare else bare

    def trl(name: str, i: int) -> dict:
        spec = {"rows": str(root / "rows.jsonl"), "policy": str(policy), "out": str(root / f"{name}{i}"),
                "batch": a.batch, "max_len": a.max_len, "extra": variants[name]}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # TRL's venv sees only itself
        proc = subprocess.Popen([a.trl_python, script, "--trl-peer", json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        with PeakRSS(proc.pid) as peak:
            stdout, stderr = proc.communicate()
        line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or not line:
            sys.exit(f"TRL run {name} failed ({a.trl_python}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
        return {**json.loads(line[len("RESULT "):]), "peak_rss_mb": peak.peak_mb}

    def measured(fn, i, **which):
        with PeakRSS(**which) as peak:
            r = fn(i)
        return {**r, "peak_rss_mb": peak.peak_mb}

    # peak memory: ours, the training job's processes (the stage's process, which here is this benchmark, runs an
    # inline reference pass before it; the job and the fork server it was forked from); bare, this process alone (not
    # the idle fork server that ours left); TRL, its process.
    sides = {"ours": lambda i: measured(ours, i, children_only=True),
             **({"bare": lambda i: measured(bare, i, alone=True)} if bare else {}),
             **{n: (lambda i, n=n: trl(n, i)) for n in variants}}
    runs: dict[str, list[dict]] = {n: [] for n in sides}
    for i in range(a.repeats):  # alternate, so drifting machine load hits every side alike
        for name, fn in sides.items():
            runs[name].append(fn(i))
            print(f"{name}:", json.dumps(runs[name][-1]), flush=True)
    bad = {n: r["dtype"] for n, rs in runs.items() for r in rs if r["dtype"] != "float32"}
    if bad:
        sys.exit(f"refusing to compare: not every side trained in float32: {bad}")
    med = statistics.median

    def spread(name, key):
        v = [r[key] for r in runs[name]]
        return {"median": med(v), "min": min(v), "max": max(v)}

    ours_s = [r["reference_pass_s"] + r["train_loop_s"] for r in runs["ours"]]
    ours_tps = real / med(ours_s)
    res = {**(extra or {}), "model": a.model, "real_tokens": real, "torch_threads": torch.get_num_threads(),
           "load_avg_1m": os.getloadavg()[0],
           "ours": {"reference_pass_s": spread("ours", "reference_pass_s"), "train_loop_s": spread("ours", "train_loop_s"),
                    "work_s": {"median": med(ours_s), "min": min(ours_s), "max": max(ours_s)},
                    "tokens_per_s_ref_counted": ours_tps, "stage_wall_s": spread("ours", "stage_wall_s"),
                    "wall_over_work": med(r["stage_wall_s"] / (r["reference_pass_s"] + r["train_loop_s"]) for r in runs["ours"]),
                    "peak_rss_mb": spread("ours", "peak_rss_mb")}}
    if bare:
        loop = med(r["train_loop_s"] for r in runs["ours"])
        res["bare"] = {"train_loop_s": spread("bare", "train_loop_s"), "peak_rss_mb": spread("bare", "peak_rss_mb")}
        res["ours_loop_vs_bare_loop"] = med(r["train_loop_s"] for r in runs["bare"]) / loop  # >1: ours faster
    for name in variants:
        t = spread(name, "train_s")
        res[name] = {"train_s": t, "tokens_per_s_ref_counted": real / t["median"], "trl": runs[name][0]["trl"],
                     "peak_rss_mb": spread(name, "peak_rss_mb"),
                     **{k: spread(name, k) for k in ("ref_precompute_s", "train_only_s") if k in runs[name][0]}}
        res[f"speedup_vs_{name}"] = ours_tps / (real / t["median"])
        # pairwise: each repeat's ours against the same repeat's TRL run (neighbours in time)
        res[f"speedup_vs_{name}_per_repeat"] = [r["train_s"] / o for r, o in zip(runs[name], ours_s)]
    res["runs"] = runs
    print(json.dumps(res, indent=1))


def bare_loop(cfg, method: str, records: list[dict], model_dir: Path, pad_id: int, extra_spec: dict) -> dict:
    """The same work as our training job in a plain PyTorch loop: the stage's config `cfg`, its tokenized
    `records`, the same batch order (BatchPlan), the method's own step (collation, forward, loss), backward,
    gradient clipping and fused AdamW on the model loaded in float32. What it leaves out is what the job adds:
    the DeepSpeed engine, metrics bookkeeping, the learning-rate schedule and logging. {train_loop_s, dtype}."""
    import torch
    from rlhf_core.train import adamw
    from rlhf_core.train.batches import BatchPlan, seq_len
    from rlhf_core.train.entry import _auto
    from rlhf_core.train.launch import SPEC_KEYS
    from rlhf_core.train.methods import get

    spec = {**{k: getattr(cfg, k) for k in SPEC_KEYS}, **extra_spec, "pad_id": pad_id}
    step = get(method).step
    auto, kw = _auto(get(method))  # the job's model class: a causal LM, or a scalar head for rm
    plan = BatchPlan([seq_len(r) for r in records], cfg.train_batch_size, cfg.micro_train_batch_size, 1, cfg.seed,
                     cfg.max_epochs, cfg.length_bucketing)
    torch.manual_seed(cfg.seed)
    model = auto.from_pretrained(str(model_dir), dtype=torch.float32, **kw)
    model.train()
    opt = adamw(model.parameters(), cfg.learning_rate, cfg.adam_betas, cfg.l2)
    t = time.time()
    for s in range(plan.total_steps):
        mbs = plan.micro_batches(s, 0)
        for mb in mbs:
            loss = step(model, spec, [records[i] for i in mb], pad_id)[0]
            (loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"train_loop_s": time.time() - t, "dtype": "float32" if next(model.parameters()).dtype == torch.float32 else "?"}
