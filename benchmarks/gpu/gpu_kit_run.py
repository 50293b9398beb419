"""The GPU kit as one prepared call of at most 10 minutes (issue 44 item 5). A task that is lent a GPU gets 15
minutes of it in all, the machine's start (1-2 minutes) included; the kit's four scripts (gpu_issue36.sh,
gpu_trainers.sh, gpu_phases.sh, gpu_smoke.sh) needed about 6.5 + 6.5 + 5 + 5 minutes. This driver measures, in the
order of what decides, each part capped in time, and writes one JSON of figures under $OUT:

  call 1 (the figures that decide)
    learner      the ppo Learner's step vs a bare PyTorch loop on the same batch (gpu_learner.py, Qwen2-0.5B shape,
                 128 rows of 64 + 128 tokens, micro-batch 64: bare, learner_z2; step seconds, MFU, peak memory)
    grpo_vs_trl  our in-process GRPO step vs TRL's GRPOTrainer on the same GPU (gpu_grpo_trl.py: 16 prompts x 8
                 samples, 128 new tokens, 0.5B shape; TRL at its best)
    trainers     DPO / SFT / KTO as the stages run them vs TRL's trainers at their best (gpu_trainers.py, 0.5B shape,
                 256 pairs; work seconds, tokens/s and peak memory ratios)
    phases       the hybrid moments' allocator peaks beside the memory plan's prediction (gpu_phases.py, 0.5B shape,
                 the CUDA IPC leak repro first)
  call 2 (the rest that fits ten minutes)
    gpu_tests    every `-m gpu` test of the log-probs (fused training incl. Liger with the entropy), the ppo roles,
                 layouts, rollout memory and weight sync
    learner_rest micro-batch 16, ZeRO-3 / ZeRO-0 / bf16 bare at 0.5B, the 1.5B shape
    learner_liger the learner at 0.5B with RLHF_FLOWS_LOGPROBS=liger (its log-probs in the training forward)
    trainers_rest train_rm, kd, train_prm and sft with use_liger_kernel, and Liger's `gpu` tests
    phases_1.5b  the moments at the 1.5B shape, then the learner's sleep / wake tests
  Left to their own scripts (a third call): gpu_rollout_after_learner.py and gpu_roles.py (gpu_issue36.sh /
  gpu_smoke.sh), gpu_weight_sync.py's figures, and the ppo stage on Ray (gpu_ray.sh: two runs, Ray's wheel).

Each part is a process group of its own, stopped at its cap (SIGTERM, then SIGKILL 10 s later); what it printed by
then is kept (every script prints one JSON record per measurement). A part that ends early leaves its time to the
next ones; a part that cannot get its minimum in the budget left is skipped and named. $OUT/gpu_kit_call<N>.json is
rewritten after each part (a call cut short still returns it), beside $OUT/gpu_kit_call<N>.log (every line of
every part). Two files: the device tool returns at most 8.

Prepare the wheels once, here, in the repo root (deepspeed, pydantic, TRL, datasets, Liger: ~7.5 MB):

    .venv/bin/python benchmarks/gpu/gpu_kit.py prepare --trl --liger

then, through the device tool (the budget is 560 s of the call's 600):

    run(command="python3 benchmarks/gpu/gpu_kit_run.py", carry=[".whl"], timeout_s=600)
    run(command="python3 benchmarks/gpu/gpu_kit_run.py --call 2", carry=[".whl"], timeout_s=600)

CPU smoke run (the suite runs it: tests/test_gpu_scripts.py): every part of the call at its small size on the CPU,
TRL's side where TRL is importable (else a named skip), the same JSON:

    .venv/bin/python benchmarks/gpu/gpu_kit_run.py --small
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
BUDGET_S = 560  # of the device call's 600 s: the wheels' install, the JSON and a margin come out of the rest
SMALL_BUDGET_S, SMALL_CAP_SCALE = 1000, 4  # the CPU smoke run: a loaded 2-core machine, not the GPU's times
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "--import-mode=importlib", "-q", "-rA"]


@dataclass
class Part:
    name: str
    what: str
    args: list[str]  # after the interpreter
    cap_s: float
    small: list[str] | None = None  # the CPU smoke run's arguments (None: the part is skipped there)
    min_s: float = 30.0  # below this left in the budget the part is skipped, named
    env: dict = field(default_factory=dict)
    figure: str = ""  # the key of `figures` it must fill (a part that ran without it failed)


CALLS: dict[int, list[Part]] = {
    1: [
        Part("learner", "the ppo learner's step vs a bare PyTorch loop (step s, MFU, peak GB)",
             [str(GPU / "gpu_learner.py"), "--plan", "0.5b:64:bare,learner_z2", "--steps", "3"], 95,
             [str(GPU / "gpu_learner.py"), "--device", "cpu", "--small", "--plan", "small:8:bare,learner_z2"], 45,
             figure="learner_vs_bare"),
        Part("grpo_vs_trl", "GRPO: our in-process step vs TRL's GRPOTrainer on the same GPU",
             [str(GPU / "gpu_grpo_trl.py")], 145, [str(GPU / "gpu_grpo_trl.py"), "--device", "cpu", "--small"], 60,
             figure="grpo_vs_trl"),
        Part("trainers_vs_trl", "DPO / SFT / KTO as the stages run them vs TRL's trainers at their best",
             [str(GPU / "gpu_trainers.py"), "--stages", "dpo,sft,kto", "--trl", "dpo,sft,kto", "--rows", "256"], 200,
             [str(GPU / "gpu_trainers.py"), "--device", "cpu", "--small", "--stages", "dpo", "--trl", "dpo"], 60,
             figure="trainers"),
        Part("phases", "the hybrid moments' allocator peaks vs the memory plan",
             [str(GPU / "gpu_phases.py"), "--shapes", "qwen2-0.5b"], 115, [str(GPU / "gpu_phases.py"), "--small"], 40,
             figure="phases"),
    ],
    2: [
        Part("gpu_tests", "every -m gpu test of the log-probs, the ppo roles, layouts, rollout memory, weight sync",
             [*PYTEST, "-m", "gpu", "tests/rlhf_core/rl/test_fused_training.py", "tests/rlhf_core/rl/test_logprobs.py",
              "tests/rlhf_core/ppo/test_gpu_roles.py", "tests/rlhf_core/ppo/test_ppo_layouts.py",
              "tests/rlhf_core/ppo/test_rollout_memory.py", "tests/rlhf_core/ppo/test_gpu_weight_sync.py"], 190,
             [*PYTEST, "-m", "gpu", "tests/rlhf_core/rl/test_fused_training.py"], 60, figure="gpu_tests"),
        Part("learner_rest", "the learner grid's rest: micro-batch 16, ZeRO-3 / ZeRO-0 / bf16 bare, the 1.5B shape",
             [str(GPU / "gpu_learner.py"), "--plan",
              "0.5b:16:bare,learner_z2;0.5b:64:learner_z3,bare_bf16,learner_z0;1.5b:64:bare,learner_z2"], 115,
             [str(GPU / "gpu_learner.py"), "--device", "cpu", "--small", "--plan", "small:4:learner_z3"], 40,
             figure="learner_vs_bare"),
        Part("learner_liger", "the learner with Liger's log-probs in the training forward (RLHF_FLOWS_LOGPROBS=liger)",
             [str(GPU / "gpu_learner.py"), "--plan", "0.5b:64:learner_z2"], 45, None, 40,
             {"RLHF_FLOWS_LOGPROBS": "liger"}, "learner_vs_bare"),
        Part("trainers_rest", "train_rm, kd, train_prm and sft with use_liger_kernel",
             [str(GPU / "gpu_trainers.py"), "--stages", "train_rm,kd,train_prm,sft_liger", "--trl", "", "--rows", "256"],
             110, [str(GPU / "gpu_trainers.py"), "--device", "cpu", "--small", "--stages", "train_rm", "--trl", ""], 60,
             figure="trainers"),
        Part("liger_tests", "Liger's -m gpu tests (use_liger_kernel patched into a model)",
             [*PYTEST, "-m", "gpu", "-k", "liger", "tests/rlhf_core/train/test_scale.py"], 40, None, 20,
             figure="liger_tests"),
        Part("phases_1.5b", "the moments at the 1.5B shape",
             [str(GPU / "gpu_phases.py"), "--shapes", "qwen2-1.5b"], 60, None, 40, figure="phases"),
    ],
}


def command(call: int) -> str:
    return (f'run(command="python3 benchmarks/gpu/gpu_kit_run.py{"" if call == 1 else f" --call {call}"}", '
            'carry=[".whl"], timeout_s=600)')


def install_wheels(log) -> dict:
    """The carried wheels (.whl/, gpu_kit.py prepare) into /tmp/site, as the device README says; {} without them."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return {}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels],
                          capture_output=True, text=True)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"installing .whl/*.whl failed:\n{proc.stderr[-2000:]}")
    return {"wheels": [Path(w).name for w in wheels], "install_s": round(time.monotonic() - t0, 1), "site": "/tmp/site"}


def environment(env: dict) -> dict:
    """The GPU and the versions the parts import (in their environment: the carried wheels first)."""
    code = ("import json, importlib.metadata as m, torch\nv = {}\n"
            "for p in ('torch', 'transformers', 'deepspeed', 'trl', 'datasets', 'liger-kernel', 'peft', 'accelerate'):\n"
            "    try: v[p] = m.version(p)\n    except Exception: v[p] = None\n"
            "v['cuda'] = torch.version.cuda\n"
            "v['device'] = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'\n"
            "print(json.dumps(v))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    rec = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-1000:]}
    if rec.get("device") != "cpu":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                  "--format=csv"], capture_output=True, text=True, timeout=30)
            rec["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else smi.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            rec["nvidia_smi"] = f"not run: {e}"
    return rec


def run_part(part: Part, args: list[str], cap: float, env: dict, log) -> dict:
    """One part in its own process group, stopped at `cap` seconds; its JSON records (stdout lines that parse)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, env={**env, **part.env}, cwd=ROOT)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            log.write(f"[{part.name} {time.monotonic() - t0:6.1f}s] {line}")
            log.flush()
            print(f"[{part.name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=10)
    records = []
    for line in lines:
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the cap
                pass
    out = {"name": part.name, "what": part.what, "command": ["python3", *[os.path.relpath(a, ROOT) if a.startswith(
        str(ROOT)) else a for a in args]], "env": part.env, "cap_s": round(cap, 1),
        "wall_s": round(time.monotonic() - t0, 1), "rc": proc.returncode, "timed_out": timed_out, "records": records,
        "last_line": next((ln.strip() for ln in reversed(lines) if ln.strip()), "")}
    if proc.returncode or timed_out:
        out["tail"] = "".join(lines)[-3000:]
    return out


# ---------------------------------------------------------------------------------------------- figures
def pick(r: dict, keys) -> dict:
    return {k: r[k] for k in keys if r.get(k) is not None}


def figures(parts: list[dict]) -> dict:
    """The decisive numbers of each part, for benchmarks/RESULTS.md to cite."""
    by = {p["name"]: p["records"] for p in parts if "records" in p}
    out: dict = {}
    learner: dict = {}
    for name in ("learner", "learner_rest", "learner_liger"):
        for r in by.get(name, []):
            if r.get("what") != "learner_step":
                continue
            key = f"{r['shape']}_m{r['micro_batch']}" + ("_liger" if name == "learner_liger" else "")
            learner.setdefault(key, {})[r["variant"]] = (
                {"oom": r["oom"]} if "oom" in r else
                pick(r, ("step_s_median", "mfu", "model_tflops_per_s", "peak_allocated_gb")))
    for row in learner.values():
        bare = (row.get("bare") or {}).get("step_s_median")
        for v, fig in list(row.items()):
            if v.startswith("learner") and bare and fig.get("step_s_median"):
                row[f"{v}_over_bare"] = round(fig["step_s_median"] / bare, 3)
    if learner:
        out["learner_vs_bare"] = learner
    grpo = [r for r in by.get("grpo_vs_trl", []) if r.get("what") in ("grpo_vs_trl", "ours", "trl")]
    if grpo:
        out["grpo_vs_trl"] = {
            "ours": next((pick(r, ("step_s", "rollout_s", "train_s", "sync_s", "peak_gpu_gb", "error"))
                          for r in grpo if r["what"] == "ours"), None),
            "trl": [pick(r, ("variant", "step_s", "rollout_s", "peak_gpu_gb", "skipped", "error"))
                    for r in grpo if r["what"] == "trl"],
            "ratios": [{k: v for k, v in r.items() if k != "what"} for r in grpo if r["what"] == "grpo_vs_trl"]}
    trainers = [r for name in ("trainers_vs_trl", "trainers_rest") for r in by.get(name, [])]
    if trainers:
        out["trainers"] = {
            "vs_trl": {r["method"]: {k: r[k] for k in ("speedup", "memory_ratio", "ours_tokens_per_s", "trl_tokens_per_s")}
                       for r in trainers if r.get("what") == "vs_trl"},
            "ours_work_s": {r["stage"]: r["work_s"] if "work_s" in r else "skipped" if "skipped" in r else "failed"
                            for r in trainers if r.get("what") == "ours"}}
    moments = [r for name in ("phases", "phases_1.5b") for r in by.get(name, []) if r.get("what") == "moment"]
    if moments:
        ratios = [r["planned_over_measured"] for r in moments if r.get("planned_over_measured")]
        out["phases"] = {"moments": [pick(r, ("shape", "step", "moment", "measured_peak_gb", "planned_gb",
                                              "planned_over_measured")) for r in moments],
                         "planned_over_measured_min_median_max": (
                             [min(ratios), round(statistics.median(ratios), 3), max(ratios)] if ratios else None)}
    for p in parts:
        if p["name"] in ("gpu_tests", "liger_tests") and "rc" in p:  # pytest's own summary line
            out[p["name"]] = {"rc": p["rc"], "timed_out": p["timed_out"], "summary": p["last_line"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", type=int, choices=sorted(CALLS), default=1)
    ap.add_argument("--small", action="store_true", help="every part at its small size on the CPU (a smoke run)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds for the whole call, install included ({BUDGET_S}; small: {SMALL_BUDGET_S})")
    ap.add_argument("--only", default="", help="these parts of the call (comma-separated), in the call's order")
    ap.add_argument("--cap", action="append", default=[], metavar="PART=S", help="a part's cap, in seconds")
    a = ap.parse_args()
    start = time.monotonic()
    if a.budget_s is None:
        a.budget_s = SMALL_BUDGET_S if a.small else BUDGET_S
    scale = SMALL_CAP_SCALE if a.small else 1
    out_dir = Path(os.environ.get("OUT") or ("/tmp/gpu-kit-small" if a.small else "/tmp/gpu-kit"))
    out_dir.mkdir(parents=True, exist_ok=True)
    caps = {k: float(v) for k, v in (c.split("=", 1) for c in a.cap)}
    parts = [p for p in CALLS[a.call] if not a.only or p.name in a.only.split(",")]
    unknown = (set(caps) | set(filter(None, a.only.split(",")))) - {p.name for p in CALLS[a.call]}
    if unknown:
        raise SystemExit(f"--only / --cap: {sorted(unknown)} not parts of call {a.call} "
                         f"({', '.join(p.name for p in CALLS[a.call])})")
    json_path, log_path = out_dir / f"gpu_kit_call{a.call}.json", out_dir / f"gpu_kit_call{a.call}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    env.pop("OUT", None)  # the parts' own files stay out of $OUT (8 files come back at most): their records are here
    if a.small:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(log_path, "w") as log:
        installed = {} if a.small else install_wheels(log)
        if installed:
            env["PYTHONPATH"] = os.pathsep.join(["/tmp/site", str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        result = {"kit": "benchmarks/gpu/gpu_kit_run.py", "issue": 44, "call": a.call, "small": a.small,
                  "command": command(a.call) if not a.small else "python benchmarks/gpu/gpu_kit_run.py --small",
                  "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "budget_s": a.budget_s,
                  "install": installed, "env": environment(env), "parts": [], "figures": {}}
        if not a.small and not result["env"].get("deepspeed"):  # before any GPU minute goes to a part that needs it
            raise SystemExit("deepspeed is not importable here: prepare .whl/ in the repo root (.venv/bin/python "
                             "benchmarks/gpu/gpu_kit.py prepare --trl --liger) and carry it: carry=[\".whl\"]")

        def write():
            result["wall_s"] = round(time.monotonic() - start, 1)
            result["figures"] = figures(result["parts"])
            json_path.write_text(json.dumps(result, indent=1))

        write()
        saved = 0.0  # seconds earlier parts left unused: the next parts may take them
        for k, part in enumerate(parts):
            args = part.small if a.small else part.args
            if args is None:
                result["parts"].append({"name": part.name, "what": part.what, "skipped": "no small mode (GPU only)"})
                write()
                continue
            left = a.budget_s - (time.monotonic() - start)
            later = sum(p.min_s for p in parts[k + 1:] if not (a.small and p.small is None))
            cap = caps.get(part.name, part.cap_s * scale + saved)
            cap = min(cap, left - later) if k < len(parts) - 1 else min(cap, left)
            if cap < part.min_s and part.name not in caps:
                result["parts"].append({"name": part.name, "what": part.what,
                                        "skipped": f"budget: {left:.0f} s left, {later:.0f} s kept for the parts after "
                                                   f"it, under its minimum {part.min_s:.0f} s"})
                write()
                continue
            rec = run_part(part, args, cap, env, log)
            saved = max(0.0, cap - rec["wall_s"]) if not rec["timed_out"] else 0.0
            result["parts"].append(rec)
            write()
    ran = {p["name"] for p in result["parts"] if "rc" in p}
    failed = [p["name"] for p in result["parts"] if p.get("rc") or p.get("timed_out")]
    missing = [p.name for p in parts if p.name in ran and p.figure not in result["figures"]]
    summary = {"what": "gpu_kit", "call": a.call, "json": str(json_path), "wall_s": result["wall_s"],
               "parts": {p["name"]: ("skipped: " + p["skipped"] if "skipped" in p else "timed out" if p["timed_out"]
                                     else f"rc {p['rc']}") for p in result["parts"]}}
    if failed or missing:
        summary["error"] = f"failed or cut: {failed}; ran without their figures: {missing}"
    print(json.dumps(summary), flush=True)
    sys.exit(1 if failed or missing else 0)


if __name__ == "__main__":
    main()
