"""OpenMP's barrier spin on a busy node: the same two-thread matmul loop with GNU OpenMP's default spin, with the
GOMP_SPINCOUNT the stages give the processes they start (rlhf_core.runtime.niceness.SPIN), with no spin at all
(OMP_WAIT_POLICY=PASSIVE), and on one thread; each on the quiet machine and beside a busy loop of our own.

    .venv/bin/python benchmarks/parts/omp_spin.py [--iters 3000] [--threads 2]

Each case runs in a fresh process (OpenMP reads these variables when it starts): 96x768 @ 768x2048 fp32 matmuls, the
size of one micro-batch's projections in the 57M peers, `--iters` of them after one warm-up pass. The busy loop is one
Python process at this script's niceness spinning on one core, started before the case and stopped by its pid after
it (it also exits by itself when this script is gone). Printed: seconds per case and the ratio of each to the
default in the same condition.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASE = """
import sys, time, torch
torch.manual_seed(0)
x, w = torch.randn(96, 768), torch.randn(768, 2048)
for _ in range(int(sys.argv[1]) // 10):
    x @ w
t = time.perf_counter()
for _ in range(int(sys.argv[1])):
    x @ w
print(time.perf_counter() - t)
"""

BUSY = """
import os, sys
parent = int(sys.argv[1])
while True:
    for _ in range(2_000_000):
        pass
    if os.getppid() != parent:
        sys.exit(0)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from rlhf_core.runtime.niceness import SPIN

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    cases = {"default": {}, "stages' spin": dict(SPIN), "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
             "one thread": {"OMP_NUM_THREADS": "1"}}
    out: dict = {"iters": a.iters, "threads": a.threads, "cpus": os.cpu_count()}
    for mode in ("quiet", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) if mode == "busy" else None
        try:
            for name, env in cases.items():
                env = {"OMP_NUM_THREADS": str(a.threads), **base, **env}
                res = subprocess.run([sys.executable, "-c", CASE, str(a.iters)], env=env, capture_output=True, text=True,
                                     check=True)
                out.setdefault(mode, {})[name] = round(float(res.stdout.split()[-1]), 3)
                print(mode, name, out[mode][name], flush=True)
        finally:
            if busy is not None:
                busy.terminate()  # our own process, by its pid
                busy.wait()
        out[f"{mode}_vs_default"] = {k: round(v / out[mode]["default"], 3) for k, v in out[mode].items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
