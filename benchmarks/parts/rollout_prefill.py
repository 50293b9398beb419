"""The HF rollout engine with each prompt's prefill shared by its n samples (HFRollout.prompt_cache) vs
transformers' own expansion (every prompt n times through the prefill, as TRL's GRPOTrainer also does): the same
generate call, tokens through the model and seconds, side by side in one process, alternating. The ~57M policy of
benchmarks/peers/grpo_vs_trl.py (demo tokenizer), fp32, random prompt ids, every sample forced to the full
length (min_new_tokens = max_new_tokens) so both sides decode the same steps. Median of --repeats after a warm-up.

    .venv/bin/python benchmarks/parts/rollout_prefill.py [--prompts 2 --n 8 --prompt-len 128 --new 64 --repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main(a) -> None:
    import torch

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.ppo.engines import HFRollout

    out = {"settings": vars(a), "threads": torch.get_num_threads(), "load_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0, hidden=768, layers=8, heads=12,
                                         intermediate=2048)
        eng = HFRollout(str(policy))
        out["params_m"] = round(eng.model.num_parameters() / 1e6, 1)
        vocab = eng.model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
        kw = dict(n=a.n, max_new_tokens=a.new, min_new_tokens=a.new, temperature=1.0, top_p=1.0, top_k=0, seed=0)
        seen = []
        eng.model.get_input_embeddings().register_forward_hook(lambda m, x, y: seen.append(x[0].numel()))
        times = {"expanded": [], "shared": []}
        tokens = {}
        for i in range(a.repeats + 1):
            for name in times:
                eng.share_prefill = name == "shared"
                seen.clear()
                t = time.perf_counter()
                eng.generate(prompts, **kw)
                if i:  # the first round warms both up
                    times[name].append(time.perf_counter() - t)
                tokens[name] = sum(seen)
    for name, ts in times.items():
        out[f"{name}_s"] = round(statistics.median(ts), 3)
        out[f"{name}_tokens"] = tokens[name]
    out["speedup"] = round(out["expanded_s"] / out["shared_s"], 3)
    out["load_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    main(ap.parse_args())
