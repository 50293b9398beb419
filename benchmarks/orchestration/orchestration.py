"""Orchestration overhead and demo timings, in one process on Prefect's local API:

1. the iterative-DPO demo (configs/demo.yaml) on a fresh root, after Prefect's local API is up (its start
   is timed apart): flow wall time vs the sum of its stages' own times (manifest created_at ->
   finished_at, demo-input building included); overhead = (wall - sum) / wall;
2. the same flow again (everything committed: every stage skipped), after Prefect is up;
3. the RAFT demo (configs/demo_raft.yaml) for its gold-reward table.

    .venv/bin/python benchmarks/orchestration/orchestration.py [--skip-raft]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def stage_intervals(run_uri: str) -> dict[str, tuple[dt.datetime, dt.datetime]]:
    """Every artifact's [created_at, finished_at] under a run folder."""
    from rlhf_core import store

    fs, path = store.filesystem(run_uri)
    out = {}
    for p in fs.find(path):
        if p.endswith(store.MANIFEST):  # demo inputs included: building them is work, not orchestration
            m = store.read_manifest(p[: -len(store.MANIFEST) - 1])
            rel = p[len(path) + 1: -len(store.MANIFEST) - 1]
            out[rel] = (dt.datetime.fromisoformat(m.created_at), dt.datetime.fromisoformat(m.finished_at))
    return out


def union_seconds(intervals) -> float:
    """Length of the union: artifacts built in one step (the demo's two tiny models) overlap."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += (b - a).total_seconds()
            end = b
        elif b > end:
            total += (b - end).total_seconds()
            end = b
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-raft", action="store_true")
    a = ap.parse_args()
    from flows import conditional_sft, iterative_dpo, raft  # noqa: F401
    from flows.cli import format_report
    from stages.common import load_config

    import os

    from prefect import flow

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    @flow
    def warm_up() -> None:
        pass

    t = time.perf_counter()
    warm_up()  # starts Prefect's local API; timed apart from the demo
    api_start = time.perf_counter() - t

    tmp = tempfile.mkdtemp(prefix="rlhf-bench-")
    params = load_config(iterative_dpo.Params, ROOT / "configs" / "demo.yaml", [f"root={tmp}", "run_name=dpo"])
    t0 = time.perf_counter()
    report = iterative_dpo.iterative_dpo(params)
    wall = time.perf_counter() - t0
    intervals = stage_intervals(f"{tmp}/dpo")
    stages = {k: (b - a).total_seconds() for k, (a, b) in intervals.items()}
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
    total = union_seconds(intervals.values())
    print(f"\nPrefect local API start (first flow of the process): {api_start:.1f} s")
    print(f"flow wall {wall:.1f} s, sum of stage times {total:.1f} s, orchestration overhead {(wall - total) / wall:.1%}")
    print(f"rerun of the finished flow (every stage skipped): {rerun:.1f} s")

    if not a.skip_raft:
        params = load_config(raft.Params, ROOT / "configs" / "demo_raft.yaml", [f"root={tmp}", "run_name=raft"])
        t2 = time.perf_counter()
        rep = raft.raft(params)
        print(f"\nRAFT demo: {time.perf_counter() - t2:.1f} s (SFT warm-up and RM trained again in its own run)")
        print(format_report(rep))


if __name__ == "__main__":
    main()
