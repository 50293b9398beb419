"""GPU layer (a): the CUDA-IPC weight hand-over (colocate_all_models on CUDA) timed at real shapes, beside the
full CPU state_dict round trip the object_store path makes (GPU -> CPU copy of every weight, then
load_state_dict back onto the engine's GPU: a lower bound of that path, Ray's serialization left out).

Two processes on one GPU, as a policy rank and its colocated engine: the source holds a random Qwen2-shaped model
in bf16 (built on the machine, nothing downloaded) and hands each bucket's IPC handle over a queue
(rlhf_core.ppo.weight_sync.ipc_handles); the engine (rlhf_core.ppo.engines.HFRollout) copies each bucket into its
parameters (receive_ipc) and acks. Each timed sync starts after the source changed its weights; after the last one
the engine's weights are compared with the source's, bit for bit.

    python3 benchmarks/gpu/gpu_weight_sync.py                  (on the lent GPU: benchmarks/gpu/gpu_smoke.sh runs it)
    python3 benchmarks/gpu/gpu_weight_sync.py --shape small    (smoke run; still needs CUDA)

One JSON line per shape on stdout; with OUT set, also $OUT/gpu_weight_sync.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core from this checkout (not installed there)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_roles import QWEN2_0_5B, QWEN2_1_5B, SMALL, qwen2, random_model  # noqa: E402

SHAPES = {"0.5b": QWEN2_0_5B, "1.5b": QWEN2_1_5B, "small": SMALL}


def source(model_dir: str, bucket_bytes: int, reps: int, to_engine, from_engine) -> None:
    """The policy rank's end: per sync, new weights, then one IPC handle per bucket (the engine acks each)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.ppo import weight_sync

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    learner = SimpleNamespace(engine=SimpleNamespace(module=model), hp={"zero_stage": 0}, rank=0)
    to_engine.put(weight_sync.layout(learner, bucket_bytes))
    for rep in range(reps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        torch.cuda.synchronize()
        from_engine.get()  # the engine's clock starts
        for i, handle, _ in weight_sync.ipc_handles(learner):
            to_engine.put((i, handle))
            from_engine.get()  # copied: this bucket's buffer may go
        to_engine.put(None)
    to_engine.put({k: v.detach().cpu() for k, v in model.named_parameters()})
    from_engine.get()  # CPU tensors cross the queue as shared-memory fds: live until received


def measure(shape_name: str, reps: int, bucket_mb: int, work: Path) -> dict:
    import multiprocessing as mp

    import torch

    from rlhf_core.ppo.engines import HFRollout

    shape = SHAPES[shape_name]
    model_dir = work / shape_name
    random_model(qwen2(shape), "cuda", torch.bfloat16).save_pretrained(model_dir)
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    to_engine, from_engine = ctx.Queue(), ctx.Queue()
    src = ctx.Process(target=source, args=(str(model_dir), bucket_mb << 20, reps, to_engine, from_engine))
    src.start()
    try:
        engine = HFRollout(str(model_dir), bf16=True)
        layout = to_engine.get(timeout=300)
        engine.join_weights(None, None, 0, 0, layout)
        ipc_s = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            from_engine.put(True)
            while (msg := to_engine.get(timeout=300)) is not None:
                engine.receive_ipc(*msg)
                torch.cuda.synchronize()
                from_engine.put(True)
            engine.receive_ipc(None)
            ipc_s.append(time.perf_counter() - t0)
        expected = to_engine.get(timeout=300)
        got = engine.weights()
        from_engine.put(True)
        src.join(timeout=120)
        equal = all(torch.equal(got[k], v) for k, v in expected.items())
        nbytes = sum(v.numel() * v.element_size() for v in expected.values())
        # the object_store path's copies, without Ray: every weight to the CPU, then back into the engine
        cpu_s = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sd = {k: v.detach().to("cpu") for k, v in engine.model.state_dict().items()}
            engine.model.load_state_dict(sd, strict=True)
            torch.cuda.synchronize()
            cpu_s.append(time.perf_counter() - t0)
        ipc, cpu = statistics.median(ipc_s), statistics.median(cpu_s)
        return {"what": "cuda_ipc_weight_sync", "shape": shape_name, "params": sum(v.numel() for v in expected.values()),
                "bytes": nbytes, "buckets": len(layout), "bucket_mb": bucket_mb, "reps": reps, "ipc_s_median": round(ipc, 4),
                "ipc_s": [round(x, 4) for x in ipc_s], "ipc_gb_per_s": round(nbytes / ipc / 1e9, 1),
                "cpu_roundtrip_s_median": round(cpu, 4), "cpu_roundtrip_over_ipc": round(cpu / ipc, 2),
                "bit_equal": equal, "device": torch.cuda.get_device_name()}
    finally:
        if src.is_alive():
            src.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.5b,1.5b", help="comma-separated: 0.5b, 1.5b, small")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=256, help="the stage's weight_sync_bucket_mb default")
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.shape.split(","):
            rec = measure(name, args.reps, args.bucket_mb, Path(work))
            out.append(rec)
            print(json.dumps(rec), flush=True)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], "gpu_weight_sync.json").write_text(json.dumps(out, indent=1))
    if not all(r["bit_equal"] for r in out):
        sys.exit("the engine's weights differ from the source's after the hand-over")


if __name__ == "__main__":
    main()
