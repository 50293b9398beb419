"""Per-token log-probs from the last hidden states and the LM head: the fused function (rlhf_core.rl.logprobs,
backend "fused") vs the chunked path it replaces ("chunked": checkpointed head chunks) vs the plain computation
(all logits, fp32 log_softmax, gather), with and without autograd, in time and peak memory above the model.

Model: random Qwen2-shaped, its vocabulary (151,936), a small body (--hidden 512, --layers 2) so the LM head
is the part measured; B x L tokens of random ids, every column an action (the policy forward of the learner).
With autograd: forward + backward of a fixed weighting of the log-probs. Each (path, autograd) runs in a fresh
process: the peak is the first call's (CPU: growth of the anonymous resident memory, sampled every ms; CUDA:
torch.cuda.max_memory_allocated above the start), the time the median of --repeats calls after it.

    .venv/bin/python benchmarks/parts/logprobs.py [--batch 4 --len 512 --repeats 3]
    python3 benchmarks/parts/logprobs.py --device cuda --dtype bf16 --hidden 1536 --layers 4 --batch 8 --len 1024 \\
        --paths plain,chunked,fused,liger      # on a lent GPU (liger where installed)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf_core.rl import logprobs
    from rlhf_core.train.memory import AnonPeak

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
                      num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(a.device)
    ids = torch.randint(0, a.vocab, (a.batch, a.len), device=a.device)
    attn = torch.ones_like(ids)
    w = torch.linspace(-1, 1, a.batch * (a.len - 1), device=a.device).view(a.batch, a.len - 1)
    grad = a.grad == "1"
    if a.path in logprobs.BACKENDS:
        os.environ["RLHF_FLOWS_LOGPROBS"] = a.path

    def run():
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            if a.path == "plain":  # the trainer without chunking: (B, L, V) logits, fp32 log_softmax over all of them
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            else:
                lp = logprobs.token_logprobs(model, ids, attn)[0]
            if grad:
                (lp * w).sum().backward()
        if a.device == "cuda":
            torch.cuda.synchronize()
        return lp.detach()

    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with AnonPeak() as peak:
        first = run()
    peak_gb = ((torch.cuda.max_memory_allocated() - base) if cuda else peak.growth) / 2 ** 30
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return {"path": a.path, "autograd": grad, "s": statistics.median(times), "times": [round(x, 4) for x in times],
            "peak_gb": round(peak_gb, 3), "checksum": float((first * w).sum()),
            "backend_used": logprobs.backend(model.get_output_embeddings(), ids) if a.path != "plain" else "plain"}


def main(a) -> None:
    rows = []
    for grad in ("0", "1"):
        for path in a.paths.split(","):
            cmd = [sys.executable, __file__, "--one", "--path", path, "--grad", grad] + [
                f"--{k}={getattr(a, k)}" for k in ("batch", "len", "vocab", "hidden", "layers", "repeats", "device", "dtype")]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{path} autograd={grad} failed:\n{res.stderr[-2000:]}", flush=True)
                continue
            rows.append(json.loads(line[len("RESULT "):]))
            print(json.dumps(rows[-1]), flush=True)
    out = {"settings": {k: getattr(a, k) for k in ("batch", "len", "vocab", "hidden", "layers", "device", "dtype")},
           "torch_threads": __import__("torch").get_num_threads(), "load": os.getloadavg()[0], "rows": rows}
    for grad in (False, True):
        plain = next((r for r in rows if r["path"] == "plain" and r["autograd"] == grad), None)
        for r in rows:
            if plain and r["autograd"] == grad and r is not plain:
                out[f"{r['path']}_over_plain{'_autograd' if grad else ''}"] = {
                    "time": round(r["s"] / plain["s"], 3), "peak": round(r["peak_gb"] / max(plain["peak_gb"], 1e-9), 3),
                    "checksum_diff": abs(r["checksum"] - plain["checksum"])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="fused")
    ap.add_argument("--grad", default="0")
    ap.add_argument("--paths", default="plain,chunked,fused")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
    else:
        main(args)
