"""CPU of one local Ray cycle as a stage runs it: ray.init as rlhf_core.rollout.generation._ray_up starts it, one actor
with a runtime_env (the stages' niceness and OpenMP variables) that imports torch, ray.kill, ray.shutdown. The whole
machine's CPU seconds (/proc/stat) from just before ray.init to 3 s after the shutdown, so run it on a quiet machine.

    .venv/bin/python benchmarks/parts/ray_cycle.py [--repeats 3]

Each repeat runs the cycle twice in fresh processes, with Ray's worker prestart as it is and with it off
(`prestart_worker_first_driver` / `enable_worker_prestart` false), alternating, and prints one JSON line per cycle.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine_cpu_s() -> float:
    f = open("/proc/stat").readline().split()[1:]
    return sum(int(x) for x in f[:3] + f[5:8]) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal


def cycle(mode: str) -> dict:
    import ray

    from rlhf_core.runtime import niceness

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    time.sleep(1)
    c0, t0 = machine_cpu_s(), time.time()
    config = dict(niceness.system_config())
    if mode == "no-prestart":
        config.update(prestart_worker_first_driver=False, enable_worker_prestart=False)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=200 * 1024 ** 2, log_to_driver=True,
             _system_config=config)
    up = time.time() - t0

    @ray.remote(num_cpus=1)
    class Probe:
        def pid(self) -> int:
            import torch  # noqa: F401  (what every role and engine imports)

            return os.getpid()

    actor = Probe.options(runtime_env={"env_vars": {**niceness.actor_env(), **niceness.omp_env()}}).remote()
    ray.get(actor.pid.remote())
    ready = time.time() - t0
    ray.kill(actor)
    ray.shutdown()
    wall = time.time() - t0
    time.sleep(3)  # Ray's processes exit after the shutdown returns
    return {"mode": mode, "cpu_s": round(machine_cpu_s() - c0, 2), "init_s": round(up, 2), "actor_ready_s": round(ready, 2),
            "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", choices=["default", "no-prestart"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(cycle(a.one)), flush=True)
        return
    for _ in range(a.repeats):
        for mode in ("default", "no-prestart"):
            out = subprocess.run([sys.executable, __file__, "--one", mode], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            print(line[7:] if line else json.dumps({"mode": mode, "error": out.stderr[-500:]}), flush=True)


if __name__ == "__main__":
    main()
