"""Reward-model scoring throughput: rlhf_core.rollout.reward_model.RMEngine (length-sorted batches, left padding,
position ids from the mask, last-token head) vs a bare forward loop (tokenizer padding, the HF
sequence-classification model's own pooling) over the same texts and batch size, tiny RM, fp32 CPU.
Tokens/s = real (non-pad) tokens scored / wall seconds. Goal: >= 0.9x the bare loop.

    .venv/bin/python benchmarks/parts/score.py
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def texts(n: int) -> tuple[list[str], list[str]]:
    from rlhf_core.demo import demo_task

    rng = random.Random(0)
    prompts = [demo_task.prompt_for(rng.choice(demo_task.THINGS)) for _ in range(n)]
    responses = [" " + " ".join(demo_task.random_review(rng) for _ in range(rng.randint(1, 6))) for _ in range(n)]
    return prompts, responses


def main(n: int = 2048, batch: int = 32, repeats: int = 3) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.rollout.rewards import RewardSpec
    from rlhf_core.rollout.reward_model import RMEngine

    with tempfile.TemporaryDirectory() as d:
        _, rm_dir = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0)
        tok = AutoTokenizer.from_pretrained(rm_dir)
        model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
        engine = RMEngine(str(rm_dir), RewardSpec(model=str(rm_dir), batch_size=batch))
        dtypes = ({p.dtype for p in model.parameters()}, {p.dtype for p in engine.body.parameters()} | {engine.head.weight.dtype})
        if dtypes[0] != dtypes[1] or len(dtypes[0]) != 1:  # peers compare only in the same precision
            raise SystemExit(f"refusing to compare: dtypes differ {dtypes}")
        prompts, responses = texts(n)
        full = [p + r + tok.eos_token for p, r in zip(prompts, responses)]
        real = sum(len(tok(t, add_special_tokens=False).input_ids) for t in full)

        def bare():
            out = []
            with torch.no_grad():
                for s in range(0, n, batch):
                    enc = tok(full[s:s + batch], return_tensors="pt", padding=True, add_special_tokens=False)
                    out += model(**enc).logits[:, 0].tolist()
            return out

        def ours():
            return engine.score(list(zip(prompts, responses)))

        print(f"torch threads {torch.get_num_threads()}; {n} texts, {real} real tokens, batch {batch}")
        print("| variant | seconds (median of 3) | tokens/s |\n|---|---|---|")
        rate = {}
        for name, fn in (("bare forward loop", bare), ("RMEngine (sorted by length)", ours)):
            fn()  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times)
            rate[name] = real / sec
            print(f"| {name} | {sec:.2f} | {real / sec:,.0f} |")
        print(f"ratio RMEngine / bare = {rate['RMEngine (sorted by length)'] / rate['bare forward loop']:.2f}")


if __name__ == "__main__":
    main()
