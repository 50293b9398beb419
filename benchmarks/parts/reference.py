"""Reference-pass throughput: rlhf_core.train.reference.compute (length-sorted batches, the training forward,
summed response log-probs) vs a bare batched forward of the same model on the same tokenized pairs (pairs in
file order, padded, log-softmax gather) at the same batch size, dtype and device. Tokens/s = real (non-pad)
tokens forwarded / wall seconds. Goal: >= 0.9x the bare forward.

Variants: `inline` (in this process) and `job` (a `python -m` child with DeepSpeed initialisation, as the
stage runs by default), each as the forwards alone (what the stage records as `seconds`) and, for the job,
as wall time with process start, imports and model load (the stage's `job_seconds`).
fp32 on CPU; bf16 when a GPU is present (--bf16 to force).

    .venv/bin/python benchmarks/parts/reference.py [--pairs 512] [--batch 16] [--bf16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(n: int, batch: int, bf16: bool, repeats: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.inputs import models
    from rlhf_core.train import batches
    from rlhf_core.train.reference import compute

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if bf16 else torch.float32
    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0)
        tok = models.load_tokenizer(policy)
        rows = demo_task.preference_rows(n)
        for i, r in enumerate(rows):  # ENV-NOTES' shape: longer prompts and responses than the toy's
            r["prompt"] = " ".join([r["prompt"]] * (1 + i % 3))
            r["chosen"] = " ".join([r["chosen"]] * (1 + i % 4))
            r["rejected"] = " ".join([r["rejected"]] * (1 + (i + 1) % 4))
        records, _ = batches.tokenize_pairs(rows, tok, 160, model_dir=policy)
        pad = models.pad_id(tok, policy)
        real = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in records)
        model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=dtype).to(device).eval()

        @torch.no_grad()
        def bare():
            out = []
            for s in range(0, n, batch):
                recs = records[s:s + batch]
                seqs = [r["chosen_ids"] for r in recs] + [r["rejected_ids"] for r in recs]
                width = max(map(len, seqs))
                ids = torch.full((len(seqs), width), pad)
                mask = torch.zeros((len(seqs), width), dtype=torch.long)
                for k, x in enumerate(seqs):
                    ids[k, :len(x)], mask[k, :len(x)] = torch.tensor(x), 1
                ids, mask = ids.to(device), mask.to(device)
                logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
                tok_lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]  # (2B, T-1)
                out += tok_lp.sum(-1).tolist()
            return out

        work = Path(d) / "job"
        kw = dict(bf16=bf16, batch_size=batch)
        inner: dict[str, float] = {}

        def ours(launcher):
            def fn():
                inner[launcher] = compute(records, policy, pad, work, launcher=launcher, **kw)[2]
            return fn

        variants = {"bare batched forward": bare, "reference pass, inline": ours("inline"),
                    "reference pass, job (python -m)": ours("python")}
        print(f"device {device}, {dtype}, torch threads {torch.get_num_threads()}; {n} pairs, {real} real tokens, "
              f"batch {batch} pairs, median of {repeats}")
        print("| variant | seconds | tokens/s | vs bare |\n|---|---|---|---|")
        base = None
        for name, fn in variants.items():
            fn()  # warm-up (page cache, allocator)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            base = base or real / s
            if name == "bare batched forward":
                print(f"| {name} | {s:.2f} | {real / s:,.0f} | 1.00x |")
                continue
            launcher = "inline" if "inline" in name else "python"
            f = inner[launcher]  # the forwards alone, last repeat
            print(f"| {name}: forwards | {f:.2f} | {real / f:,.0f} | {real / f / base:.2f}x |")
            if launcher == "python":
                print(f"| {name}: wall, start + load counted | {s:.2f} | {real / s:,.0f} | {real / s / base:.2f}x |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import torch

    main(a.pairs, a.batch, a.bf16 or torch.cuda.is_available(), a.repeats)
