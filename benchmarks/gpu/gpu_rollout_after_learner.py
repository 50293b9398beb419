"""The in-process HF rollout alone vs right after a learner step of micro-batch 16 or 64, with the variants that
tell the causes apart (issue 36 item 3: on the lent H200 the rollout after a micro-64 step took 1.7-1.85x its time
after a micro-16 step). One process holds an HFRollout engine and two policy Learners (DeepSpeed bf16, ZeRO-2,
1 rank; micro-batch 16 and 64) at the Qwen2-0.5B shape, random weights; the rollout is 16 prompts x 8 samples,
64 prompt + 128 new tokens, as in the issue.

Conditions (the step just before the rollout): `alone` (another rollout), `after_m16`, `after_m64`. Variants (what
happens between the step and the rollout):

  as_is        nothing: the engine's release_cached turned off (the code before issue 36)
  release      HFRollout.generate's release_cached (the default since issue 36: torch.cuda.empty_cache() when the
               allocator holds over 1 GB cached but unused)
  gc           gc.collect(), then the rollout with the collector frozen (Python-side cost of the step's objects)
  idle         2 s idle (the GPU's clocks / power after a heavy step, work still queued)

Recorded per rollout: wall seconds, this process's CPU seconds (a CPU-bound generate keeps them equal), seconds
inside Python's garbage collector, and the allocator before it (reserved, allocated, inactive split bytes,
segments) and during it (cudaMalloc / cudaFree calls, alloc retries: num_device_alloc, num_device_free,
num_alloc_retries), the SM clock (nvidia-smi) before it. What each hypothesis predicts:

  allocator    after_m64 as_is slow with device allocs / frees or retries during the rollout; release restores the
               alone time (then the default fix holds)
  Python GC    gc seconds grow after the step; gc restores it
  clocks       the clock is lower before the slow rollouts; idle restores them; CPU seconds stay flat
  engine cache alone is as slow as after_m64 (the engine keeps no cache between calls, so this is not expected)

Each (condition, variant) is measured `--repeats` times in an interleaved order after one warm-up of each.

    python3 benchmarks/gpu/gpu_rollout_after_learner.py               (on the lent GPU: bash benchmarks/gpu/gpu_issue36.sh)
    .venv/bin/python benchmarks/gpu/gpu_rollout_after_learner.py --device cpu --small   (CPU smoke run)

One JSON line per rollout and one summary per (condition, variant); with OUT set, also $OUT/gpu_rollout.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core from this checkout (not installed there)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

from gpu_learner import make_batch  # noqa: E402
from gpu_roles import QWEN2_0_5B, SMALL, learner_hp, qwen2, random_model  # noqa: E402

CONDITIONS = ("alone", "after_m16", "after_m64")
VARIANTS = ("as_is", "release", "gc", "idle")
emit = emitter("gpu_rollout.json")  # benchmarks/gpu/records.py


def sm_clock() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except Exception:  # noqa: BLE001  (no nvidia-smi: a CPU smoke run)
        return None


class GCTime:
    """Seconds spent inside Python's garbage collector while active (gc.callbacks)."""

    def __init__(self):
        self.total, self.start = 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self.start = time.perf_counter()
        elif self.start is not None:
            self.total += time.perf_counter() - self.start
            self.start = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def alloc_stats(cuda: bool) -> dict:
    import torch

    if not cuda:
        return {}
    st = torch.cuda.memory_stats()
    return {"reserved_gb": st.get("reserved_bytes.all.current", 0) / 2 ** 30,
            "allocated_gb": st.get("allocated_bytes.all.current", 0) / 2 ** 30,
            "inactive_split_gb": st.get("inactive_split_bytes.all.current", 0) / 2 ** 30,
            "segments": st.get("segment.all.current", 0), "device_allocs": st.get("num_device_alloc", 0),
            "device_frees": st.get("num_device_free", 0), "alloc_retries": st.get("num_alloc_retries", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shape and batches (a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.small:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.repeats = 2, 4, 8, 8, 1
    variants = args.variants.split(",")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.runtime.jobs import free_port
    from rlhf_core.ppo.engines import RELEASE_ABOVE_GB, HFRollout
    from rlhf_core.ppo.roles import Learner

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu --small)")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else QWEN2_0_5B
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    emit({"what": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "release_above_gb": RELEASE_ABOVE_GB})
    with tempfile.TemporaryDirectory(prefix="gpu-rollout-") as work:
        tok = tiny.build_tokenizer(Path(work) / "tokenizer", demo_task.corpus(0))
        model = random_model(qwen2(shape, tok), "cuda" if cuda else "cpu", dtype)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(work + "/policy", safe_serialization=True)
        tok.save_pretrained(work + "/policy")
        del model
        eng = HFRollout(work + "/policy", bf16=cuda)
        rows = args.prompts * args.n
        learners = {}
        for micro in (16, 64):
            mic = max(1, micro * rows // 128)  # the small run keeps the two micro-batch sizes' ratio
            learners[micro] = Learner("policy", 0, 1)
            learners[micro].setup(work + "/policy", learner_hp(cuda, 2, rows, mic, args.new_tokens), "127.0.0.1",
                                  free_port(), total_steps=100)
        batch = make_batch(rows, args.prompt_len, args.new_tokens, shape["vocab"])
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, len(tok), (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]

        def rollout(seed: int):
            return eng.generate(prompts, args.n, args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed)

        def measure(condition: str, variant: str, k: int) -> dict:
            if condition == "alone":
                rollout(10_000 + k)
            else:
                learners[16 if condition == "after_m16" else 64].train(batch, 0.0)
            sync()
            eng.release_above_gb = RELEASE_ABOVE_GB if variant == "release" else None
            if variant == "gc":
                gc.collect()
                gc.freeze()
            elif variant == "idle":
                time.sleep(2.0)
            before, clock = alloc_stats(cuda), sm_clock()
            with GCTime() as gct:
                c0, t0 = time.process_time(), time.perf_counter()
                outs = rollout(k)
                sync()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            after = alloc_stats(cuda)
            if variant == "gc":
                gc.unfreeze()
            rec = {"what": "rollout", "condition": condition, "variant": variant, "repeat": k, "wall_s": round(wall, 4),
                   "cpu_s": round(cpu, 4), "gc_s": round(gct.total, 4), "sm_clock_mhz": clock,
                   "generated_tokens": sum(len(o["ids"]) for per in outs for o in per),
                   **{f"before_{key}": round(v, 3) if isinstance(v, float) else v for key, v in before.items()
                      if key in ("reserved_gb", "allocated_gb", "inactive_split_gb", "segments")},
                   **{f"during_{key}": after[key] - before[key] for key in ("device_allocs", "device_frees", "alloc_retries")
                      if key in before}}
            return rec

        for c in CONDITIONS:  # warm-up: kernels, the allocator, DeepSpeed's buffers
            measure(c, "as_is", -1)
        results: dict[tuple[str, str], list[dict]] = {}
        for k in range(args.repeats):
            for v in variants:
                for c in CONDITIONS:
                    rec = measure(c, v, k)
                    emit(rec)
                    results.setdefault((c, v), []).append(rec)
        base = statistics.median(r["wall_s"] for r in results[("alone", variants[0])])
        for (c, v), recs in results.items():
            med = statistics.median(r["wall_s"] for r in recs)
            emit({"what": "rollout_summary", "condition": c, "variant": v, "wall_s_median": round(med, 4),
                  "vs_alone_first_variant": round(med / base, 3),
                  "cpu_s_median": round(statistics.median(r["cpu_s"] for r in recs), 4),
                  "gc_s_median": round(statistics.median(r["gc_s"] for r in recs), 4),
                  **({"during_device_allocs": sum(r.get("during_device_allocs", 0) for r in recs),
                      "during_alloc_retries": sum(r.get("during_alloc_retries", 0) for r in recs),
                      "before_inactive_split_gb": recs[-1].get("before_inactive_split_gb"),
                      "before_reserved_gb": recs[-1].get("before_reserved_gb")} if cuda else {})})


if __name__ == "__main__":
    main()
