"""The ppo Learner's training step vs a bare PyTorch loop doing the same work vs the GPU's peak (MFU), in one run
(issue 36 item 2), in-process (no Ray), on random Qwen2-shaped models built on the machine:

  bare        fp32 master weights, bf16 autocast, fused torch AdamW, clip_grad_norm_ 1.0: the issue's reference.
              The same loss as the learner's (rlhf_core's fused log-probs with the entropy metric, PPO's clipped
              surrogate), micro-batches of `micro` rows, one optimizer step per 128 rows.
  bare_bf16   the same with bf16 weights and no autocast (a floor: no fp32 master weights).
  learner_zN  rlhf_core.ppo.roles.Learner.train on one rank, DeepSpeed bf16, ZeRO stage N (the stage's learner
              settings, benchmarks/gpu/gpu_roles.learner_hp; shared_prompt off: rows padded as the bare loop's).
  learner_z2_scan  ZeRO-2 with DeepSpeed's bf16 overflow scan back on (check_grad_overflow, its 0.19.8 default,
              which the learner turns off since issue 36): what the scan costs.

Per variant, medians over the timed steps (one warm-up first): step seconds; the same split by phase with CUDA
events (forward + loss, backward, optimizer step: no host sync added); MFU = 6 x parameters x trained tokens /
step seconds / peak (989 TFLOP/s, H100 SXM bf16 dense; --peak-flops); the allocator's peak and its retries
(cudaMalloc failures that freed the cache: num_alloc_retries); and, from one more step under
torch.cuda.set_sync_debug_mode, the host synchronisations by the code that made them. The batch is 128 rows of
a 64-token prompt and a 128-token response (GRPO's 16 prompts x 8 at the issue's lengths), every row full, random
tokens and advantages. `--profile` adds torch.profiler tables of one step (learner_z2 and bare, first shape and
micro-batch of the plan) to $OUT/profile_*.txt: the kernels and CPU ops where the time goes.

    python3 benchmarks/gpu/gpu_learner.py --plan 0.5b:64:bare,learner_z2 --profile   (on the lent GPU:
                                                                 bash benchmarks/gpu/gpu_issue36.sh)
    .venv/bin/python benchmarks/gpu/gpu_learner.py --device cpu --small               (CPU smoke run, fp32)

One JSON line per measurement on stdout; with OUT set, also $OUT/gpu_learner.json (a list, rewritten after each).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core from this checkout (not installed there)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

from gpu_roles import H100_BF16_DENSE, QWEN2_0_5B, QWEN2_1_5B, SMALL, learner_hp, qwen2  # noqa: E402

SHAPES = {"0.5b": QWEN2_0_5B, "1.5b": QWEN2_1_5B, "small": SMALL}
VARIANTS = ("bare", "bare_bf16", "learner_z2", "learner_z3", "learner_z0", "learner_z2_scan")
DEFAULT_PLAN = "0.5b:64:bare,learner_z2,learner_z2_scan;0.5b:16:bare,learner_z2;0.5b:64:bare_bf16,learner_z3,learner_z0"
emit = emitter("gpu_learner.json")  # benchmarks/gpu/records.py


def parse_plan(text: str) -> list[tuple[str, int, list[str]]]:
    """'0.5b:64:bare,learner_z2;1.5b:16:bare' -> [(shape, micro, [variants])], in the order given (by value)."""
    plan = []
    for part in filter(None, text.split(";")):
        shape, micro, names = part.split(":")
        bad = [n for n in names.split(",") if n not in VARIANTS]
        if shape not in SHAPES or bad:
            raise SystemExit(f"--plan {part!r}: shape one of {sorted(SHAPES)}, variants of {VARIANTS}")
        plan.append((shape, int(micro), names.split(",")))
    return plan


class Phases:
    """Seconds per phase of a step without adding a host sync: CUDA events read after the step (CPU: wall time)."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda, self.torch, self.marks = cuda, torch, []

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            if self.cuda:
                s, e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*a, **k)
                e.record()
                self.marks.append((name, s, e))
            else:
                t0 = time.perf_counter()
                out = fn(*a, **k)
                self.marks.append((name, t0, time.perf_counter()))
            return out
        return timed

    def read(self) -> dict:
        out: dict[str, float] = {}
        for name, s, e in self.marks:
            out[name] = out.get(name, 0.0) + (s.elapsed_time(e) / 1e3 if self.cuda else e - s)
        self.marks = []
        return out


def host_syncs(fn) -> dict:
    """Host synchronisations of one fn() call under torch.cuda.set_sync_debug_mode, by the first caller outside torch."""
    import torch

    seen: dict[str, int] = {}
    saved = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return saved(message, category, filename, lineno, file, line)
        where = "?"
        for fr in reversed(traceback.extract_stack()[:-1]):
            if "/torch/" not in fr.filename and "warnings.py" not in fr.filename:
                where = f"{'/'.join(Path(fr.filename).parts[-3:])}:{fr.lineno} {fr.name}"
                break
        seen[where] = seen.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = saved
    return {"total": sum(seen.values()), "by_source": dict(sorted(seen.items(), key=lambda kv: -kv[1])[:8])}


def make_batch(rows: int, prompt_len: int, response_len: int, vocab: int) -> dict:
    import torch

    from rlhf_core.ppo.batches import collate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    resp = [torch.randint(3, vocab, (response_len,), generator=g).tolist() for _ in range(rows)]
    b = collate(prompts, resp, 0, logprobs=[(-torch.rand(response_len, generator=g)).tolist() for _ in range(rows)])
    b["adv"] = torch.randn(b["mask"].shape, generator=g)
    return b


def bare_step(model, opt, batch: dict, micro: int, dev, autocast: bool, phases: Phases):
    """One optimizer step of the bare loop over `batch` in micro-batches of `micro` rows."""
    import torch

    from rlhf_core.rl import rl_math
    from rlhf_core.ppo.forward import policy_logprobs
    from rlhf_core.runtime.devices import to_device

    rows = batch["ids"].shape[0]
    model.train()

    def loss_of(mb):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            lp = policy_logprobs(model, mb, 1.0, "metric")[0]
            return rl_math.policy_loss(lp, lp.detach(), mb["adv"], mb["mask"])[0]

    fwd, bwd = phases.wrap("forward_loss_s", loss_of), phases.wrap("backward_s", lambda l: l.backward())

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for s in range(0, rows, micro):
        mb = to_device({k: v[s:s + micro] for k, v in batch.items()}, dev)
        bwd(fwd(mb) / (rows // micro))
    phases.wrap("optimizer_s", optimizer)()


def run_variant(name: str, shape_name: str, micro: int, args, model_dir: str, batch: dict, params: int, dev, clock,
                profile_dir: Path | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cuda = dev.type == "cuda"
    bf16 = cuda
    rows = batch["ids"].shape[0]
    phases = Phases(cuda)
    learner = model = opt = None
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    start_gb = torch.cuda.memory_allocated() / 2 ** 30 if cuda else None  # what earlier variants left (a leak shows)
    t0 = clock()
    if name.startswith("bare"):
        master = torch.float32 if name == "bare" or not bf16 else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=master, attn_implementation="sdpa").to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        step = lambda: bare_step(model, opt, batch, micro, dev, name == "bare" and bf16, phases)  # noqa: E731
    else:
        from rlhf_core.runtime.jobs import free_port
        from rlhf_core.ppo.roles import Learner

        stage = int(name.split("_z")[1][0])
        learner = Learner("policy", 0, 1)
        learner.setup(model_dir, learner_hp(bf16, stage, rows, micro, args.response_len), "127.0.0.1", free_port(),
                      total_steps=args.steps + 4)
        if name.endswith("_scan"):
            learner.engine.optimizer.check_grad_overflow = True  # DeepSpeed 0.19.8's bf16 default
        learner.loss = phases.wrap("forward_loss_s", learner.loss)
        learner.engine.backward = phases.wrap("backward_s", learner.engine.backward)
        learner.engine.step = phases.wrap("optimizer_s", learner.engine.step)  # a no-op off the step's boundary
        step = lambda: learner.train(batch, 0.0)  # noqa: E731
    setup_s = clock() - t0
    times, splits = [], []
    for i in range(args.steps + 1):
        t0 = clock()
        step()
        times.append(clock() - t0)
        splits.append(phases.read())
    times, splits = times[1:], splits[1:]
    sec = statistics.median(times)
    tokens = int(batch["attn"].sum())
    flops = 6 * params * tokens / sec
    rec = {"what": "learner_step", "shape": shape_name, "micro_batch": micro, "variant": name, "rows": rows,
           "tokens": tokens, "setup_s": round(setup_s, 2), "step_s_median": round(sec, 4),
           "step_s_all": [round(t, 4) for t in times],
           **{k: round(statistics.median(s[k] for s in splits), 4) for k in splits[0]},
           "model_tflops_per_s": round(flops / 1e12, 2),
           "mfu": round(flops / args.peak_flops, 4) if cuda else None}
    if cuda:
        st = torch.cuda.memory_stats()
        rec.update(start_allocated_gb=round(start_gb, 2), peak_allocated_gb=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
                   reserved_gb=round(torch.cuda.memory_reserved() / 2 ** 30, 2),
                   alloc_retries=st.get("num_alloc_retries", 0) - retries0, syncs=host_syncs(step))
        if profile_dir is not None and name in ("bare", "learner_z2"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            table = prof.key_averages()
            path = profile_dir / f"profile_{shape_name}_m{micro}_{name}.txt"
            path.write_text(table.table(sort_by="cuda_time_total", row_limit=30) + "\n\n"
                            + table.table(sort_by="self_cpu_time_total", row_limit=30))
            rec["profile"] = path.name
    emit(rec)
    del learner, model, opt, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shape and batch (a CPU smoke run)")
    ap.add_argument("--plan", default=None, help=f"shape:micro:variant,...;... in order (default {DEFAULT_PLAN})")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of the first plan entry")
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE)
    args = ap.parse_args()
    if args.small:
        args.rows, args.prompt_len, args.response_len, args.steps = 16, 8, 8, 2
        args.plan = args.plan or "small:8:bare,bare_bf16,learner_z2,learner_z2_scan;small:4:learner_z3,learner_z0"
    plan = parse_plan(args.plan or DEFAULT_PLAN)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu --small)")
    import deepspeed

    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def clock() -> float:
        sync()
        return time.perf_counter()

    emit({"what": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "transformers": transformers.__version__, "deepspeed": deepspeed.__version__, "plan": args.plan or DEFAULT_PLAN,
          "rows": args.rows, "prompt_len": args.prompt_len, "response_len": args.response_len, "peak_flops": args.peak_flops})
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    with tempfile.TemporaryDirectory(prefix="gpu-learner-") as work:
        built: dict[str, tuple[str, int]] = {}
        for k, (shape_name, micro, names) in enumerate(plan):
            shape = SHAPES[shape_name]
            if shape_name not in built:
                torch.manual_seed(0)
                with torch.device(dev):
                    m = AutoModelForCausalLM.from_config(qwen2(shape), dtype=torch.bfloat16 if cuda else torch.float32)
                path = str(Path(work) / shape_name)
                m.save_pretrained(path, safe_serialization=True)
                built[shape_name] = (path, sum(p.numel() for p in m.parameters()))  # tied head counted once
                del m
            path, params = built[shape_name]
            batch = make_batch(args.rows, args.prompt_len, args.response_len, shape["vocab"])
            for name in names:
                try:
                    run_variant(name, shape_name, micro, args, path, batch, params, dev, clock,
                                out if (args.profile and k == 0 and out is not None) else None)
                except torch.cuda.OutOfMemoryError as e:
                    emit({"what": "learner_step", "shape": shape_name, "micro_batch": micro, "variant": name,
                          "oom": str(e).splitlines()[0]})
                    gc.collect()
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
