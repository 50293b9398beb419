"""Where a command's CPU goes, by kind of process: samples every process on the machine once a second while the
command runs (their utime + stime from /proc), sums the growth by kind (the one-process trainer jobs, Ray's workers
and its own processes, pytest's workers, Prefect, moto ...), and prints the table, largest first. Run it on a quiet
machine: every process is counted, the command's or not.

    .venv/bin/python benchmarks/parts/suite_cpu.py -- .venv/bin/python -m pytest        # the full tier
    .venv/bin/python benchmarks/parts/suite_cpu.py -- .venv/bin/python -m pytest -m "not slow"

A process is classed by its command line when first seen (a Ray worker before it renames itself to its actor), and
what it used before the first sample is not counted; one that lives under a second is missed, so the trainer jobs'
share is a floor.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
KINDS = [  # (substring of the command line, kind): the first that matches
    ("rlhf_core.train.entry", "trainer job"), ("rlhf_core/train/entry", "trainer job"),
    ("rlhf_core.train.reference", "reference job"), ("rlhf_core/train/reference", "reference job"),
    ("rlhf_core.runtime.forkserver", "forked jobs and their server"),  # one-process jobs on a host without a GPU
    ("default_worker.py", "Ray worker (actors)"), ("ray::", "Ray worker (actors)"),
    ("raylet", "Ray system"), ("gcs_server", "Ray system"), ("ray/dashboard", "Ray system"), ("log_monitor", "Ray system"),
    ("autoscaler", "Ray system"), ("runtime_env", "Ray system"),
    ("xdist", "pytest"), ("pytest", "pytest"), ("exec(eval(sys.stdin", "pytest"),
    ("prefect", "Prefect (server, workers, CLI, flow runs)"), ("moto_server", "moto_server"), ("vllm", "vLLM"),
    ("rlhf-flows", "rlhf-flows CLI"), ("benchmarks/", "benchmark scripts"), ("python", "other Python"),
]


def kind(pid: str) -> str | None:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return next((k for s, k in KINDS if s in cmd), "other" if cmd else None)  # "": a kernel thread


def sample(seen: dict, last: dict, total: collections.Counter, first: bool) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key, cpu = (pid, f[19]), (int(f[11]) + int(f[12])) / HZ  # (pid, start time): a reused pid is a new process
        if key not in seen:
            seen[key] = kind(pid)
        if seen[key] and not first:
            total[seen[key]] += cpu - last.get(key, 0.0)
        last[key] = cpu


def main() -> None:
    if "--" not in sys.argv:
        sys.exit(__doc__)
    cmd = sys.argv[sys.argv.index("--") + 1:]
    seen, last, total = {}, {}, collections.Counter()
    sample(seen, last, total, first=True)  # what ran before the command is not counted
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        time.sleep(1)
        sample(seen, last, total, first=False)
    wall = time.time() - t0
    cpus = sum(total.values())
    print(f"\n{' '.join(cmd)}: exit {proc.returncode}, {wall:.0f} s wall, {cpus:.0f} CPU-s counted "
          f"({cpus / wall:.2f} cores busy on average of {os.cpu_count()})")
    for k, s in total.most_common():
        print(f"{s:9.0f} CPU-s {100 * s / max(cpus, 1e-9):5.1f}%  {k}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
