"""DPO training throughput: this project's dpo stage (reference pass once + DeepSpeed job, length bucketing)
vs TRL's DPOTrainer, same tiny model, data, batch size, max_length and one epoch, side by side, both in fp32.

    .venv/bin/python benchmarks/dpo_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                              [--trl-python /tmp/trl-venv/bin/python]

TRL runs in its own process, by default from its own clean virtualenv (`--trl-python`; make one with
`python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install -c requirements/cpu-constraints.txt
torch==2.13.0+cpu transformers==5.19.0 datasets==5.2.0 accelerate==1.15.0 trl==1.16.0`), or from this
venv with `--trl-python .venv/bin/python` after `pip install -e ".[bench]"`.
Each peer at its best: TRL 1.16's DPOConfig defaults to bf16=True, which on CPUs without bf16 instructions
runs autocast matmuls ~6x slower; it is set False here, and a dtype check refuses to report a ratio unless
both sides trained in float32 (TRL: a forward hook on the decoder sees float32 hidden states with CPU autocast off; ours: the
job's config has bf16 off and the trained weights are float32). TRL's best configuration is
precompute_ref_log_probs=True with gradient checkpointing off (its precompute counted); its defaults are
reported too.

Real tokens = prompt + response tokens of chosen and rejected over the epoch (padding not counted).
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
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    seen = set()

    def hook(_module, _args, out):  # what the training forward really computed in (TRL fuses the LM head)
        seen.add((str(out[0].dtype), torch.is_autocast_enabled("cpu")))

    model.get_decoder().register_forward_hook(hook)
    args = DPOConfig(output_dir=spec["out"], per_device_train_batch_size=spec["batch"], max_length=spec["max_len"],
                     num_train_epochs=1, learning_rate=5e-4, beta=0.1, report_to=[], use_cpu=True, save_strategy="no",
                     logging_steps=1000, dataloader_num_workers=0, bf16=False, fp16=False, **spec["extra"])
    tr = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    t = time.time()
    tr.train()
    s = time.time() - t
    import trl

    return {"train_s": s, "dtype": "float32" if seen == {("torch.float32", False)} else f"NOT fp32: {sorted(seen)}",
            "trl": trl.__version__, "torch": torch.__version__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512)
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
    root = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    policy, _ = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"seed": 0})
    # ENV-NOTES' reference figures used prompts of 20-43 tokens and responses of 9-82: lengthen the demo's
    # pairs the same way (neutral words on the prompt, several reviews per response) so ratios compare.
    # The labels then no longer follow the gold reward: this measures speed only.
    rng = random.Random(7)
    rows = demo_task.preference_rows(a.pairs, seed=7)
    for r in rows:
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(14, 36))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(0, 7))])
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs_uri = str(root / "store" / "pairs")
    w = store.ArtifactWriter(pairs_uri, "data", {"n": a.pairs})
    w.begin()
    w.write_table("p.parquet", data.to_table(rows, "pairs"))
    w.commit()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from stages import dpo, reference

    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["prompt"] + r[k])["input_ids"]) + 1 for r in rows for k in ("chosen", "rejected"))

    def ours(i: int) -> dict:
        ref = reference.run(reference.Config(pairs_uri=pairs_uri, ref_uri=policy_uri, output_uri=str(root / f"ref{i}"),
                                             max_len=a.max_len, batch_size=a.batch))
        t1 = time.time()
        m = dpo.run(dpo.Config(policy_uri=policy_uri, dataset_uri=ref.uri, output_uri=str(root / f"dpo{i}"),
                               max_len=a.max_len, train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0,
                               learning_rate=5e-4, beta=0.1, lr_warmup_ratio=0.0, log_steps=1000, bf16=False))
        dtypes = {str(t.dtype) for t in load_file(str(root / f"dpo{i}" / "model.safetensors")).values()}
        fp32 = m.config.get("bf16") is False and dtypes == {"torch.float32"}
        return {"reference_pass_s": ref.metrics["seconds"], "train_loop_s": m.metrics["train_seconds"],
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
    res = {"real_tokens": real, "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
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
