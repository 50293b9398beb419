"""The training stages' jobs on the lent GPU in bf16 at the Qwen2-0.5B shape, and DPO / SFT / KTO side by side with
TRL's trainers at their best, in one run (issue 36 item 5), plus use_liger_kernel against the liger-kernel release
that travelled (issue 36 item 7).

  ours   each stage as a user runs it (stages.<name>.run: its DeepSpeed job in a child process, bf16, ZeRO-2, one
         GPU): sft (packing_samples), train_rm, dpo (the reference stage's pass first, counted), kto (its reference
         pass counted), kd (a second random 0.5B as the teacher), train_prm; and sft with use_liger_kernel.
  trl    TRL 1.16's DPOTrainer, SFTTrainer and KTOTrainer on the same rows, model and max_length, bf16 (its default:
         fp32 weights, bf16 autocast) at their best on one GPU: gradient checkpointing off, precompute_ref_log_probs
         (DPO, KTO; the precompute counted), packing (SFT, its "bfd" bins of max_length tokens).

Every side runs in its own process, one at a time (on a CPU run, ours run in this process, one after another:
there is no GPU memory to keep apart, and each stage's job is then forked from one warm server); its GPU memory is sampled every 0.1 s (nvidia-smi memory.used
above the idle GPU's: the whole process, context included, the same yardstick for both sides). Per side: seconds of
work (reference pass + training loop: ours from the stage's metrics, TRL's train() plus its precompute), real
tokens per second, peak GPU memory; per method: ours / TRL's speed and memory. Random weights at real shapes, the
demo's tiny tokenizer (with the PRM's step tokens), the demo's pairs lengthened (prompts ~60-130 tokens, responses
~20-320): only speed and memory mean anything.

    python3 benchmarks/gpu/gpu_trainers.py                  (on the lent GPU: bash benchmarks/gpu/gpu_trainers.sh)
    .venv/bin/python benchmarks/gpu/gpu_trainers.py --device cpu --small   (CPU smoke run: tiny model, fp32; TRL's
                                                            side only where TRL is importable)

One JSON line per side and per comparison on stdout; with OUT set, also $OUT/gpu_trainers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # rlhf_core and stages from this checkout (not installed there)
sys.path.insert(0, str(HERE.parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

STAGES = ("sft", "train_rm", "dpo", "kto", "kd", "train_prm", "sft_liger")
TRL = {"dpo": ("DPOConfig", "DPOTrainer", {"precompute_ref_log_probs": True, "gradient_checkpointing": False}),
       "sft": ("SFTConfig", "SFTTrainer", {"packing": True, "gradient_checkpointing": False}),
       "kto": ("KTOConfig", "KTOTrainer", {"precompute_ref_log_probs": True, "gradient_checkpointing": False})}
emit = emitter("gpu_trainers.json")  # benchmarks/gpu/records.py


class GPUMemory:
    """Peak of nvidia-smi's memory.used (MiB) while the block runs, above its value before (None without a GPU)."""

    def __init__(self, cuda: bool):
        self.cuda, self.peak, self.base = cuda, None, None

    @staticmethod
    def used() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])

    def _poll(self):
        while not self._stop.wait(0.1):
            self.peak = max(self.peak or 0, self.used())

    def __enter__(self):
        if self.cuda:
            self.base, self._stop = self.used(), threading.Event()
            self._t = threading.Thread(target=self._poll, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._stop.set()
            self._t.join()

    def gb(self) -> float | None:
        return None if self.peak is None else round((self.peak - self.base) / 1024, 2)


# ---------------------------------------------------------------------------------------------- data and models
def build(work: Path, small: bool, cuda: bool, rows: int | None = None) -> dict:
    """The tokenizer (demo corpus + the PRM's step tokens), the policy, a teacher and a PRM base (the policy's
    folder), the data files and artifacts; the real tokens of each method's data."""
    import torch
    from transformers import AutoTokenizer

    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.inputs import data
    from rlhf_core import store
    from gpu_roles import QWEN2_0_5B, SMALL, qwen2, random_model

    tok = tiny.build_tokenizer(work / "tok", demo_task.corpus(0), added_tokens=(demo_task.PLACEHOLDER, *demo_task.REWARD_TOKENS))
    shape = SMALL if small else QWEN2_0_5B
    dtype = torch.bfloat16 if cuda else torch.float32
    for name, seed in (("policy", 0), ("teacher", 1)):
        torch.manual_seed(seed)
        model = random_model(qwen2(shape, tok), "cpu", dtype)  # built on the CPU: the parent keeps off the GPU
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(work / name), safe_serialization=True)
        tok.save_pretrained(str(work / name))
        del model
    rng = random.Random(7)
    pairs = demo_task.preference_rows(rows or (16 if small else 512), seed=7)  # small: two steps of 8, a smoke run
    for r in pairs:  # lengthened: the demo's pairs are 20-43 / 9-82 tokens, short for a GPU
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(20, 60))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(1, 14))])

    def commit(name: str, rows: list[dict], kind: str) -> str:
        uri = str(work / "store" / name)
        w = store.ArtifactWriter(uri, "data", {"n": len(rows)})
        w.begin()
        w.write_table("rows.parquet", data.to_table(rows, kind))
        w.commit()
        return uri

    sft_rows = [{"input": r["prompt"], "output": r["chosen"]} for r in pairs]
    kto_rows = data.pairs_to_kto(pairs)
    random.Random(8).shuffle(kto_rows)  # TRL samples sequentially: no alternating labels
    steps = demo_task.step_rows(rows or (16 if small else 512), seed=0)
    (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    (work / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (work / "trl_dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (work / "trl_sft.jsonl").write_text("".join(json.dumps({"prompt": r["input"], "completion": r["output"]}) + "\n"
                                                for r in sft_rows))
    (work / "trl_kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kto_rows))
    tk = AutoTokenizer.from_pretrained(str(work / "policy"))
    n = lambda text: len(tk(text)["input_ids"]) + 1  # noqa: E731  (+ EOS)
    return {"pairs_uri": commit("pairs", pairs, "pairs"), "kto_uri": commit("kto", kto_rows, "kto"),
            "tokens": {"sft": sum(n(r["input"] + r["output"]) for r in sft_rows),
                       "dpo": sum(n(r["prompt"] + r[k]) for r in pairs for k in ("chosen", "rejected")),
                       "kto": sum(n(r["prompt"] + r["completion"]) for r in kto_rows)},
            "rows": {"pairs": len(pairs), "kto": len(kto_rows), "steps": len(steps)}}


# ---------------------------------------------------------------------------------------------- one side (child)
def ours(job: dict) -> dict:
    """One stage, as a user runs it; seconds of work from its manifest."""
    from rlhf_core.demo import demo_task
    from stages import dpo, kd, kto, reference, sft, train_prm, train_rm

    w, a = Path(job["work"]), job["args"]
    name = job["stage"]
    common = dict(max_len=a["max_len"], train_batch_size=a["batch"], micro_train_batch_size=a["batch"], zero_stage=2,
                  learning_rate=1e-6, lr_warmup_ratio=0.0, log_steps=10 ** 6, bf16=job["cuda"], max_epochs=1)
    out = str(w / f"out-{name}")
    ref_s = 0.0
    if name in ("sft", "sft_liger"):
        m = sft.run(sft.Config(policy_uri=str(w / "policy"), dataset_uri=str(w / "sft.jsonl"), output_uri=out,
                               packing_samples=True, use_liger_kernel=name == "sft_liger", **common))
    elif name == "train_rm":
        m = train_rm.run(train_rm.Config(base_uri=str(w / "policy"), dataset_uri=job["data"]["pairs_uri"],
                                         output_uri=out, **common))
    elif name == "dpo":
        ref = reference.run(reference.Config(pairs_uri=job["data"]["pairs_uri"], ref_uri=str(w / "policy"),
                                             output_uri=str(w / "ref"), max_len=a["max_len"], batch_size=a["batch"],
                                             bf16=job["cuda"]))
        ref_s = ref.metrics["seconds"]
        m = dpo.run(dpo.Config(policy_uri=str(w / "policy"), dataset_uri=ref.uri, output_uri=out, beta=0.1, **common))
    elif name == "kto":
        m = kto.run(kto.Config(policy_uri=str(w / "policy"), dataset_uri=job["data"]["kto_uri"], output_uri=out,
                               beta=0.1, **common))
        ref_s = m.metrics.get("reference_seconds", 0.0)
    elif name == "kd":
        m = kd.run(kd.Config(policy_uri=str(w / "policy"), teacher_uri=str(w / "teacher"), dataset_uri=str(w / "sft.jsonl"),
                             output_uri=out, input_template=demo_task.INPUT_TEMPLATE, **common))
    else:
        m = train_prm.run(train_prm.Config(base_uri=str(w / "policy"), dataset_uri=str(w / "steps.jsonl"), output_uri=out,
                                           **common))
    return {"work_s": ref_s + m.metrics["train_seconds"], "reference_s": ref_s, "train_s": m.metrics["train_seconds"],
            "steps": m.metrics.get("steps_done"), "bf16": m.config.get("bf16")}


def trl_side(job: dict) -> dict:
    """TRL's trainer at its best (TRL above), bf16 on the GPU (fp32 on a CPU smoke run)."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w, a, method = Path(job["work"]), job["args"], job["method"]
    config_cls, trainer_cls, best = TRL[method]
    rows = [json.loads(x) for x in (w / f"trl_{method}.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(w / "policy"))
    model = AutoModelForCausalLM.from_pretrained(str(w / "policy"), dtype=torch.float32)
    beta = {} if method == "sft" else {"beta": 0.1}
    args = getattr(trl, config_cls)(output_dir=str(w / f"trl-{method}"), per_device_train_batch_size=a["batch"],
                                    max_length=a["max_len"], num_train_epochs=1, learning_rate=1e-6, report_to=[],
                                    save_strategy="no", logging_steps=10 ** 6, dataloader_num_workers=0,
                                    bf16=job["cuda"], use_cpu=not job["cuda"], **beta, **best)
    cls, pre = getattr(trl, trainer_cls), [0.0]
    if hasattr(cls, "_precompute_ref_logps"):  # TRL 1.16 precomputes in __init__: timed and counted
        precompute = cls._precompute_ref_logps

        def timed(self, *x, **k):
            t0 = time.time()
            try:
                return precompute(self, *x, **k)
            finally:
                pre[0] += time.time() - t0

        cls._precompute_ref_logps = timed
    tr = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    t0 = time.time()
    tr.train()
    s = time.time() - t0
    return {"work_s": s + pre[0], "reference_s": pre[0], "train_s": s, "trl": trl.__version__, "settings": best}


# ---------------------------------------------------------------------------------------------- the run (parent)
def side(job: dict, cuda: bool, python: str = sys.executable, script: Path = HERE) -> dict:
    """`job` run by `script --job` in its own process (GPU memory sampled meanwhile): its RESULT line, wall seconds
    and peak GPU GB, or the error's tail."""
    if not cuda and python == sys.executable and script == HERE and "stage" in job:  # ours on a CPU run: here
        t0 = time.time()
        try:
            return {**ours(job), "wall_s": round(time.time() - t0, 1), "peak_gpu_gb": None}
        except Exception:  # noqa: BLE001  (reported as a side's failure is: the error's tail)
            import traceback

            return {"error": traceback.format_exc()[-2500:], "wall_s": round(time.time() - t0, 1)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), *filter(None, os.environ.get(
        "PYTHONPATH", "").split(os.pathsep))])}
    if python != sys.executable:  # TRL's own virtualenv (a CPU smoke run): it sees only itself
        env.pop("PYTHONPATH")
    with GPUMemory(cuda) as mem:
        t0 = time.time()
        proc = subprocess.run([python, str(script), "--job", json.dumps(job)], capture_output=True, text=True, env=env)
        wall = time.time() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or not line:
        return {"error": (proc.stdout[-1500:] + proc.stderr[-2500:]).strip(), "wall_s": round(wall, 1)}
    return {**json.loads(line[len("RESULT "):]), "wall_s": round(wall, 1), "peak_gpu_gb": mem.gb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model and data (a CPU smoke run)")
    ap.add_argument("--stages", default="dpo,sft,kto,train_rm,kd,train_prm,sft_liger",
                    help=f"ours, in this order (of {', '.join(STAGES)})")
    ap.add_argument("--trl", default="dpo,sft,kto", help="TRL's trainers run beside ours (after ours of the same method)")
    ap.add_argument("--rows", type=int, default=None, help="pairs (and PRM rows) of the data (512; small: 16)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--trl-python", default=sys.executable,
                    help="python that runs TRL's side (here: a virtualenv with trl; there: this one, with the wheels)")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: one side in its own process
    a = ap.parse_args()
    if a.job:
        job = json.loads(a.job)
        if not job["cuda"]:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        print("RESULT " + json.dumps(ours(job) if "stage" in job else trl_side(job)), flush=True)
        return
    if a.small:
        a.batch, a.max_len = 8, 128
    cuda = a.device == "cuda"
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import importlib.util

    have_trl = (a.trl_python != sys.executable or importlib.util.find_spec("trl") is not None
                and importlib.util.find_spec("datasets") is not None)
    have_liger = importlib.util.find_spec("liger_kernel") is not None
    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "trl", "datasets", "liger_kernel"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001
            versions[pkg] = None
    emit({"what": "env", "device": "cuda" if cuda else "cpu", **versions, "batch": a.batch, "max_len": a.max_len,
          "small": a.small})
    with tempfile.TemporaryDirectory(prefix="gpu-trainers-") as tmp:
        work = Path(tmp)
        data = build(work, a.small, cuda, a.rows)
        emit({"what": "data", **data["rows"], "real_tokens": data["tokens"]})
        args = {"batch": a.batch, "max_len": a.max_len}
        trl_methods = [m for m in a.trl.split(",") if m] if have_trl else []
        results: dict[str, dict] = {}
        for stage in [s for s in a.stages.split(",") if s]:
            if stage == "sft_liger" and not (cuda and have_liger):
                emit({"what": "ours", "stage": stage, "skipped": "needs CUDA and liger-kernel"})
                continue
            r = side({"stage": stage, "work": str(work), "args": args, "data": data, "cuda": cuda}, cuda)
            emit({"what": "ours", "stage": stage, **r})
            results[f"ours_{stage}"] = r
            if stage in trl_methods:
                t = side({"method": stage, "work": str(work), "args": args, "cuda": cuda}, cuda, a.trl_python)
                emit({"what": "trl", "method": stage, **t})
                if "error" not in r and "error" not in t:
                    tokens = data["tokens"][stage]
                    emit({"what": "vs_trl", "method": stage, "real_tokens": tokens,
                          "ours_tokens_per_s": round(tokens / r["work_s"], 1),
                          "trl_tokens_per_s": round(tokens / t["work_s"], 1),
                          "speedup": round(t["work_s"] / r["work_s"], 3),
                          "memory_ratio": (round(r["peak_gpu_gb"] / t["peak_gpu_gb"], 3)
                                           if r.get("peak_gpu_gb") and t.get("peak_gpu_gb") else None)})
        if not have_trl:
            emit({"what": "trl", "skipped": "trl / datasets not importable here (carry them: gpu_kit.py prepare --trl)"})
        if "ours_sft" in results and "ours_sft_liger" in results and "error" not in results["ours_sft_liger"]:
            s, lg = results["ours_sft"], results["ours_sft_liger"]
            emit({"what": "liger_vs_plain_sft", "liger_kernel": versions["liger_kernel"],
                  "speedup": round(s["train_s"] / lg["train_s"], 3),
                  "memory_ratio": round(lg["peak_gpu_gb"] / s["peak_gpu_gb"], 3) if s.get("peak_gpu_gb") else None})


if __name__ == "__main__":
    main()
