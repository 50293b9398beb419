"""CPU and wall time of a stage's Ray actors starting, forked from the warm workers' server or started by Ray.

A local Ray as the stages start it (rlhf_core.rollout.generation._ray_up), then N actors with the roles' runtime_env
(niceness, OpenMP) that each import the roles' module and load the tiny policy with transformers (what every ppo
role does before its first call), then ray.kill, ray.shutdown. Whole-machine CPU seconds (/proc/stat) from just before
Ray starts to 3 s after the shutdown (the workers' server's own imports included), so run it on a quiet machine.

    .venv/bin/python benchmarks/parts/actor_start.py [--actors 4] [--repeats 3]

Each repeat runs the cycle twice, each in a fresh process: "forked" (the default) and "launched"
(RLHF_FLOWS_FORKSERVER=0: every worker a new interpreter, as on a GPU host), alternating; one JSON line per cycle,
then the medians and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine_cpu_s() -> float:
    f = open("/proc/stat").readline().split()[1:]
    return sum(int(x) for x in f[:3] + f[5:8]) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal


class Role:
    """What a ppo role does before its first call: import the roles' module, load the policy."""

    def __init__(self, model_dir: str):
        import rlhf_core.ppo.roles  # noqa: F401
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir)

    def pid(self) -> int:
        return os.getpid()


def cycle(mode: str, actors: int, model_dir: str) -> dict:
    import ray

    from rlhf_core.rollout.generation import _ray_up
    from rlhf_core.runtime import niceness

    time.sleep(1)
    c0, t0 = machine_cpu_s(), time.time()
    _ray_up(None)
    up = time.time() - t0
    env = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", **niceness.actor_env(), **niceness.omp_env()}}}
    role = ray.remote(niceness.at_launcher_priority(Role) if niceness.actor_env() else Role)
    started = [role.options(num_cpus=0.5, **env).remote(model_dir) for _ in range(actors)]
    pids = ray.get([a.pid.remote() for a in started])
    ready = time.time() - t0
    for a in started:
        ray.kill(a)
    ray.shutdown()
    wall = time.time() - t0
    time.sleep(3)  # Ray's processes exit after the shutdown returns
    return {"mode": mode, "actors": len(set(pids)), "cpu_s": round(machine_cpu_s() - c0, 2), "init_s": round(up, 2),
            "actors_ready_s": round(ready, 2), "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, default=4, help="actors per cycle (a ppo stage: learner, reference, "
                                                           "rollout, reward)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", choices=["forked", "launched"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(cycle(a.one, a.actors, a.model_dir)), flush=True)
        return
    from rlhf_core.demo import demo_task, tiny

    with tempfile.TemporaryDirectory() as tmp:
        policy, _ = tiny.build_tiny_pair(Path(tmp), demo_task.corpus(0), seed=0)
        runs: dict[str, list[dict]] = {"forked": [], "launched": []}
        for _ in range(a.repeats):
            for mode in runs:
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                env["RLHF_FLOWS_FORKSERVER"] = "0" if mode == "launched" else "1"
                out = subprocess.run([sys.executable, __file__, "--one", mode, "--actors", str(a.actors), "--model-dir",
                                      str(policy)], cwd=ROOT, capture_output=True, text=True, env=env)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(json.dumps({"mode": mode, "error": out.stderr[-1500:]}), flush=True)
                    continue
                runs[mode].append(json.loads(line[7:]))
                print(line[7:], flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("cpu_s", "actors_ready_s", "wall_s")}
           for m, rs in runs.items() if rs}
    if len(med) == 2:
        print(json.dumps({"median": med, "launched_over_forked": {
            k: round(med["launched"][k] / med["forked"][k], 2) for k in med["forked"]}}))


if __name__ == "__main__":
    main()
