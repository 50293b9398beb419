"""What a short one-rank trainer job costs to start: forked from the warm server (rlhf_core/runtime/forkserver.py, the
default on a host without a GPU) or launched as a new process (RLHF_FLOWS_FORKSERVER=0).

    .venv/bin/python benchmarks/parts/job_start.py [--jobs 4] [--repeats 2]

Each repeat runs, in a fresh process per mode (the modes alternating), `--jobs` sft stages one after another on the
demo's tiny model (8 steps each, each to its own output folder, so none is skipped as already done). Per mode: each
stage's wall time, and the CPU seconds of that process and of everything it started and reaped (getrusage: the job
processes, or the server and, through it, the jobs it forked). The first forked job pays the server's imports. Run it
on a quiet machine; one JSON line per mode and repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stages(root: Path, jobs: int) -> dict:
    """In this process: build the tiny model and 32 sft rows under `root`, then run `jobs` sft stages."""
    sys.path.insert(0, str(ROOT))
    from rlhf_core import store
    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.inputs import data
    from stages import sft

    policy, _ = tiny.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"kind": "policy", "seed": 0})
    rows_uri = str(root / "store" / "rows")
    w = store.ArtifactWriter(rows_uri, "data", {"n": 32, "kind": "sft"})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(32, 0), "sft"))
    w.commit()
    walls = []
    for k in range(jobs):
        cfg = sft.Config(policy_uri=policy_uri, dataset_uri=rows_uri, output_uri=str(root / "store" / f"sft-{k}"),
                         input_template=demo_task.INPUT_TEMPLATE, train_batch_size=8, micro_train_batch_size=4,
                         max_len=48, max_epochs=2, lr_warmup_ratio=0.0)
        t0 = time.perf_counter()
        m = sft.run(cfg)
        walls.append(round(time.perf_counter() - t0, 2))
        assert m.metrics["steps_done"] == 8, m.metrics
    return {"stage_wall_s": walls}


def measure(mode: str, jobs: int) -> dict:
    env = {**os.environ, "RLHF_FLOWS_FORKSERVER": "1" if mode == "forked" else "0"}
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--one", tmp, "--jobs", str(jobs)], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{mode}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"mode": mode, "jobs": jobs, "process_wall_s": round(wall, 2), "cpu_s": round(cpu, 2), **got,
            "stages_wall_s": round(sum(got["stage_wall_s"]), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(stages(Path(a.one), a.jobs)), flush=True)
        return
    for r in range(a.repeats):
        for mode in (("launched", "forked") if r % 2 == 0 else ("forked", "launched")):
            print(json.dumps({"repeat": r + 1, **measure(mode, a.jobs)}), flush=True)


if __name__ == "__main__":
    main()
