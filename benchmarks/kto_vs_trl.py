"""KTO training throughput: this project's kto stage (reference pass once over the examples and their
mismatched KL pairs + DeepSpeed job, length bucketing) vs TRL's KTOTrainer, same tiny model, data, batch
size, max_length and one epoch, side by side, both in fp32. Structure and recipe of benchmarks/dpo_vs_trl.py.

    .venv/bin/python benchmarks/kto_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                              [--trl-python /tmp/trl-venv/bin/python]

TRL runs in its own process from its own clean virtualenv (`--trl-python`; see benchmarks/dpo_vs_trl.py for
how to make one). Each peer at its best: TRL 1.16's KTOConfig defaults to bf16=True (about 6x slower autocast
matmuls on CPUs without bf16 instructions) and gradient_checkpointing=True; bf16 is set False for every TRL
variant, and a dtype check refuses to report a ratio unless both sides trained in float32 (TRL: a forward
hook on the decoder sees float32 hidden states with CPU autocast off; ours: the job's config has bf16 off
and the trained weights are float32). TRL's best configuration is precompute_ref_log_probs=True (reference
log-probs of the completions and the KL completions once, counted) with gradient checkpointing off; its
defaults are reported too. Both sides estimate the KL reference point from mismatched pairs, which each
forwards without gradient (TRL: completions cycled within a batch; ours: a seeded derangement).

Data: the demo's gold-labelled pairs lengthened as in dpo_vs_trl.py, unpaired into KTO rows (chosen
desirable, rejected undesirable: 2 x pairs rows). Real tokens = prompt + completion (+ EOS) tokens of the
examples over the epoch (the KL pairs' forwards and padding not counted, on both sides).
Ours: reference-pass seconds + training-loop seconds (launcher start reported separately).
TRL: trainer.train() seconds (precompute_ref_log_probs counted in it when enabled).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

TRL_VARIANTS = {"trl_defaults": {}, "trl_best": {"precompute_ref_log_probs": True, "gradient_checkpointing": False}}


def trl_peer(spec: dict) -> dict:
    """One TRL run (in TRL's own process/venv: imports only torch, transformers, datasets, trl)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    seen = set()

    def hook(_module, _args, out):  # what the training forward really computed in
        seen.add((str(out[0].dtype), torch.is_autocast_enabled("cpu")))

    model.get_decoder().register_forward_hook(hook)
    args = KTOConfig(output_dir=spec["out"], per_device_train_batch_size=spec["batch"], max_length=spec["max_len"],
                     num_train_epochs=1, learning_rate=5e-4, beta=0.1, report_to=[], use_cpu=True, save_strategy="no",
                     logging_steps=1000, dataloader_num_workers=0, bf16=False, fp16=False, **spec["extra"])
    tr = KTOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    t = time.time()
    tr.train()
    s = time.time() - t
    import trl

    return {"train_s": s, "dtype": "float32" if seen == {("torch.float32", False)} else f"NOT fp32: {sorted(seen)}",
            "trl": trl.__version__, "torch": torch.__version__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512, help="preference pairs, unpaired into 2x KTO rows")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; medians reported")
    ap.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help="python of TRL's own venv")
    ap.add_argument("--trl-peer", help=argparse.SUPPRESS)  # internal: run one TRL variant from a JSON spec
    a = ap.parse_args()
    if a.trl_peer:
        print("RESULT " + json.dumps(trl_peer(json.loads(a.trl_peer))), flush=True)
        return

    import logging
    import random

    from rlhf_core import data, demo_task, store, tiny as tiny_mod

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="kto-bench-"))
    policy, _ = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"seed": 0})
    rng = random.Random(7)  # lengthened as in dpo_vs_trl.py (speed only: labels no longer follow the gold reward)
    pairs = demo_task.preference_rows(a.pairs, seed=7)
    for r in pairs:
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(14, 36))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(0, 7))])
    rows = data.pairs_to_kto(pairs)
    random.Random(8).shuffle(rows)  # TRL samples sequentially: do not hand it alternating labels
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kto_uri = str(root / "store" / "kto-rows")
    w = store.ArtifactWriter(kto_uri, "data", {"n": len(rows)})
    w.begin()
    w.write_table("k.parquet", data.to_table(rows, "kto"))
    w.commit()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from stages import kto

    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows)

    def ours(i: int) -> dict:
        t1 = time.time()
        m = kto.run(kto.Config(policy_uri=policy_uri, dataset_uri=kto_uri, output_uri=str(root / f"kto{i}"),
                               max_len=a.max_len, train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0,
                               learning_rate=5e-4, beta=0.1, lr_warmup_ratio=0.0, log_steps=1000, bf16=False))
        dtypes = {str(t.dtype) for t in load_file(str(root / f"kto{i}" / "model.safetensors")).values()}
        fp32 = m.config.get("bf16") is False and dtypes == {"torch.float32"}
        return {"reference_pass_s": m.metrics["reference_seconds"], "train_loop_s": m.metrics["train_seconds"],
                "stage_wall_s": time.time() - t1, "dtype": "float32" if fp32 else f"NOT fp32: {dtypes}"}

    def trl(name: str, i: int) -> dict:
        spec = {"rows": str(root / "rows.jsonl"), "policy": str(policy), "out": str(root / f"{name}{i}"),
                "batch": a.batch, "max_len": a.max_len, "extra": TRL_VARIANTS[name]}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # TRL's venv sees only itself
        out = subprocess.run([a.trl_python, str(Path(__file__).resolve()), "--trl-peer", json.dumps(spec)],
                             capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or not line:
            raise SystemExit(f"TRL run {name} failed ({a.trl_python}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return json.loads(line[len("RESULT "):])

    runs: dict[str, list[dict]] = {"ours": [], **{n: [] for n in TRL_VARIANTS}}
    for i in range(a.repeats):  # alternate, so drifting machine load hits both sides alike
        runs["ours"].append(ours(i))
        print("ours:", json.dumps(runs["ours"][-1]), flush=True)
        for name in TRL_VARIANTS:
            runs[name].append(trl(name, i))
            print(f"{name}:", json.dumps(runs[name][-1]), flush=True)
    bad = {n: r["dtype"] for n, rs in runs.items() for r in rs if r["dtype"] != "float32"}
    if bad:
        raise SystemExit(f"refusing to compare: not every side trained in float32: {bad}")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    ref_s, loop_s = med([r["reference_pass_s"] for r in runs["ours"]]), med([r["train_loop_s"] for r in runs["ours"]])
    ours_tps = real / (ref_s + loop_s)
    res = {"rows": len(rows), "real_tokens": real, "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
           "ours": {"reference_pass_s": ref_s, "train_loop_s": loop_s, "tokens_per_s_ref_counted": ours_tps,
                    "train_loop_tokens_per_s": real / loop_s,
                    "stage_wall_s": med([r["stage_wall_s"] for r in runs["ours"]])}}
    for name in TRL_VARIANTS:
        s = med([r["train_s"] for r in runs[name]])
        res[name] = {"train_s": s, "tokens_per_s_ref_counted": real / s, "trl": runs[name][0]["trl"]}
        res[f"speedup_vs_{name}"] = ours_tps / (real / s)
    res["runs"] = runs
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
