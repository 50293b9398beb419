"""Samples per second of the ppo stage with async_train (rollout of step k+1 overlapping training on step k,
queue 1) vs the same run synchronous: same tiny policy, prompts, GRPO settings, steps, fp32; the stage's
start-up (Ray, actors) and commit are left out (median seconds per step after the first two, from the
committed training_log.json). On 2 CPU cores the rollout actor and the learner share the cores, so the
overlap gains only what one side leaves idle; on GPUs the engines and learners are separate devices.
--split gives generation and training separate cores: the rollout engine's actor one OpenMP thread bound to
core 1, the policy learner's one thread bound to core 0 (OMP_NUM_THREADS=1, OMP_PLACES, OMP_PROC_BIND through
node_store.actor_env), the driver unbound; both modes run with the same split.

    .venv/bin/python benchmarks/parts/ppo_async.py [--steps 10] [--split]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
SETTINGS = dict(n_samples_per_prompt=4, rollout_batch_size=16, train_batch_size=32, micro_train_batch_size=16,
                generate_max_len=16, actor_learning_rate=5e-4, lr_warmup_ratio=0.0, init_kl_coef=0.0, zero_stage=0,
                advantage_estimator="group_norm")


def split_cores() -> None:
    """Generation on core 1, training on core 0: one OpenMP thread per role, bound (libgomp binds the initial
    thread too)."""
    from rlhf_core.ppo import node_store

    base = node_store.actor_env
    cores = {"policy0": 0, "rollout0": 1}

    def env(role: str) -> dict:
        extra = {"OMP_NUM_THREADS": "1", "OMP_PLACES": f"{{{cores[role]}}}", "OMP_PROC_BIND": "true"} \
            if role in cores else {}
        return {**base(role), **extra}

    node_store.actor_env = env


def main(steps: int, split: bool) -> None:
    from rlhf_core.demo import demo_task, tiny
    from stages import ppo

    if split:
        split_cores()
    out = {"steps": steps, "split": split, "settings": SETTINGS, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0)
        prompts = Path(d) / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(SETTINGS["rollout_batch_size"] * steps, 0)))
        for name, extra in (("sync", {}), ("async", {"async_train": True, "async_queue_size": 1})):
            cfg = ppo.Config(policy_uri=str(policy), prompts_uri=str(prompts), output_uri=str(Path(d) / name),
                             reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE,
                             **SETTINGS, **extra)
            t0 = time.perf_counter()
            ppo.run(cfg)
            wall = time.perf_counter() - t0
            log = json.loads((Path(d) / name / "training_log.json").read_text())
            step_s = statistics.median(h["step_s"] for h in log[2:])
            out[name] = {"step_s": round(step_s, 4),
                         "samples_per_s": round(SETTINGS["rollout_batch_size"] * SETTINGS["n_samples_per_prompt"] / step_s, 1),
                         "rollout_wait_s": round(statistics.median(h["rollout_s"] for h in log[2:]), 4),
                         "train_s": round(statistics.median(h["train_s"] for h in log[2:]), 4),
                         "startup_and_commit_s": round(wall - sum(h["step_s"] for h in log), 2),
                         "final_reward": round(log[-1]["reward"], 3)}
    out["async_over_sync_samples_per_s"] = round(out["async"]["samples_per_s"] / out["sync"]["samples_per_s"], 3)
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--split", action="store_true", help="generation and training on separate cores")
    args = ap.parse_args()
    main(args.steps, args.split)
