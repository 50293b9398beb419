"""Orchestration overhead and demo timings, in one process on Prefect's local API:

1. the iterative-DPO demo (configs/demo.yaml) on a fresh root: flow wall time vs the sum of its stages'
   own times (manifest created_at -> finished_at); overhead = (wall - sum) / wall;
2. the same flow again (everything committed: every stage skipped), after Prefect is up;
3. the RAFT demo (configs/demo_raft.yaml) for its gold-reward table.

    .venv/bin/python benchmarks/orchestration.py [--skip-raft]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stage_seconds(run_uri: str) -> dict[str, float]:
    from rlhf_core import store

    fs, path = store.filesystem(run_uri)
    out = {}
    for p in fs.find(path):
        if p.endswith(store.MANIFEST) and "/inputs/" not in p:
            m = store.read_manifest(p[: -len(store.MANIFEST) - 1])
            rel = p[len(path) + 1: -len(store.MANIFEST) - 1]
            out[rel] = (dt.datetime.fromisoformat(m.finished_at) - dt.datetime.fromisoformat(m.created_at)).total_seconds()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-raft", action="store_true")
    a = ap.parse_args()
    from flows import conditional_sft, iterative_dpo, raft  # noqa: F401
    from flows.cli import format_report
    from stages.common import load_config

    tmp = tempfile.mkdtemp(prefix="rlhf-bench-")
    params = load_config(iterative_dpo.Params, ROOT / "configs" / "demo.yaml", [f"root={tmp}", "run_name=dpo"])
    t0 = time.perf_counter()
    report = iterative_dpo.iterative_dpo(params)
    wall = time.perf_counter() - t0
    stages = stage_seconds(f"{tmp}/dpo")
    t1 = time.perf_counter()
    iterative_dpo.iterative_dpo(params)
    rerun = time.perf_counter() - t1

    print(format_report(report), "\n")
    by_kind: dict[str, float] = {}
    for rel, s in stages.items():
        by_kind[rel.rsplit("/", 1)[-1]] = by_kind.get(rel.rsplit("/", 1)[-1], 0.0) + s
    print("| stage | total s (all iterations) |\n|---|---|")
    for k, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {s:.1f} |")
    total = sum(stages.values())
    print(f"\nflow wall {wall:.1f} s (Prefect's local API start included), sum of stage times {total:.1f} s, "
          f"orchestration overhead {(wall - total) / wall:.1%}")
    print(f"rerun of the finished flow (every stage skipped): {rerun:.1f} s")

    if not a.skip_raft:
        params = load_config(raft.Params, ROOT / "configs" / "demo_raft.yaml", [f"root={tmp}", "run_name=raft"])
        t2 = time.perf_counter()
        rep = raft.raft(params)
        print(f"\nRAFT demo: {time.perf_counter() - t2:.1f} s (SFT warm-up and RM trained again in its own run)")
        print(format_report(rep))


if __name__ == "__main__":
    main()
