"""GRPO groups that share their prompt (shared_prompt) vs one padded row per sample: the ppo policy forward
(rlhf_core.ppo.forward.token_outputs) with and without autograd on the same GRPO batch, tokens forwarded and
seconds, at a realistic prompt : response ratio (128-token prompts, 64-token responses, n = 8) and at 1 : 4
(32-token prompts, 128-token responses). Random Llama-shaped policy (--hidden 512, --layers 4, vocab 32,000),
fp32, sdpa (a dense mask for the shared rows on CPU), every sample's response the full length (no padding on
the padded side: the gain is the prompt forwarded once, not padding). Median of --repeats after one warm-up.

    .venv/bin/python benchmarks/parts/grpo_shared_prompt.py [--prompts 2 --n 8 --repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_core.ppo.batches import collate
    from rlhf_core.ppo.forward import token_outputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64), attn_implementation="sdpa")
    out = {"settings": vars(a), "params_m": round(model.num_parameters() / 1e6, 1), "threads": torch.get_num_threads(),
           "load_start": os.getloadavg()[0], "cases": []}
    for P, R in ((128, 64), (32, 128)):
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 32000, (P,), generator=g).tolist() for _ in range(a.prompts)]
        b = collate([p for p in prompts for _ in range(a.n)],
                    [torch.randint(3, 32000, (R,), generator=g).tolist() for _ in range(a.prompts * a.n)], 0)
        w = torch.randn(b["mask"].shape, generator=g) * b["mask"]
        case = {"prompt": P, "response": R, "rows": a.prompts * a.n}
        for name, shared in (("padded", False), ("shared", True)):
            for grad in (False, True):
                times = []
                for _ in range(a.repeats + 1):
                    t = time.perf_counter()
                    with torch.set_grad_enabled(grad):
                        lp, _, tokens = token_outputs(model, b, "policy", 1.0, None, shared=shared)
                        if grad:
                            (lp * w).sum().backward()
                    times.append(time.perf_counter() - t)
                    model.zero_grad(set_to_none=True)
                case[f"{name}_{'train' if grad else 'forward'}_s"] = round(statistics.median(times[1:]), 4)
            case[f"{name}_tokens"] = tokens
        for k in ("forward", "train"):
            case[f"speedup_{k}"] = round(case[f"padded_{k}_s"] / case[f"shared_{k}_s"], 3)
        case["tokens_ratio"] = round(case["padded_tokens"] / case["shared_tokens"], 3)
        out["cases"].append(case)
        print(json.dumps(case), flush=True)
    out["load_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    main(ap.parse_args())
