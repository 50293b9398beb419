"""GRPO vs TRL beside a fixed background load: grpo_vs_trl.py's two sides (the ppo stage, TRL 1.16's GRPOTrainer at its
best: no gradient checkpointing), each run once as the machine is and once beside a busy loop of our own, and the
ratio of each pair. Ray starts its workers at niceness 15 and TRL trains in one process at 0: on a node where
anything else runs, the stage's roles used to get a core only when nothing else wanted it. The stage now runs them
at its own niceness (rlhf_core/runtime/niceness.py); --ray-default adds a third side, the stage with
RLHF_FLOWS_RAY_NICENESS=ray (Ray's 15), beside the same load.

    .venv/bin/python benchmarks/peers/grpo_vs_trl_busy.py --trl-python /tmp/trl-venv/bin/python --size 57m \\
        --prompt-len 128 --completion-len 64 --n 8 --prompts-per-step 2 --steps 6 --repeats 2 [--ray-default]

Both sides get the same OpenMP barrier spin: our stages start their processes with GOMP_SPINCOUNT=1000
(rlhf_core.runtime.niceness.omp_env), and TRL, at its best, runs with it too (`--trl-default-spin`: OpenMP's default
for TRL, as a user who sets nothing runs it).

The load: one process at this script's niceness spinning on one core (`while True: pass`), started before a side
and stopped by its pid right after it (it also exits by itself when this script is gone or after --busy-max-s). The
"quiet" rounds are quiet only as far as the machine is: on a shared host other jobs run too, so every side reports
the load average (1 min) at its start and end, and the nicenesses of the stage's Ray actors sampled while it ran
(descendants of this process titled ray::..., `ps -o ni` as /proc/PID/stat has it). Rounds alternate quiet / busy,
and the sides alternate within each, so a change in the machine's own load meets all of them.
TRL's environment: the recipe in grpo_vs_trl.py's docstring.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_vs_trl as peer  # noqa: E402  (its sides, its settings as module globals)

BUSY = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    for _ in range(2_000_000):
        pass
    if os.getppid() != parent or time.monotonic() > deadline:  # the benchmark is gone, or ran far too long
        sys.exit(0)
"""


def start_busy(max_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid()), str(max_s)])


def stop_busy(p: subprocess.Popen) -> None:
    p.terminate()  # our own process, by its pid
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, niceness) of `pid` from /proc/PID/stat, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[16])  # ppid is field 4, nice field 19 of the whole line
    except (OSError, IndexError, ValueError):
        return None


class ActorNiceness(threading.Thread):
    """Samples, every `every_s`, the niceness of each descendant of this process whose title is ray::CLASS... (the
    stage's actors: other engineers' Ray processes on a shared host are not our descendants)."""

    def __init__(self, every_s: float = 5.0):
        super().__init__(daemon=True)
        self.every_s, self.seen, self.halt = every_s, {}, threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.halt.wait(self.every_s):
            procs = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
            for pid, (ppid, ni) in procs.items():
                chain, up = set(), ppid
                while up > 1 and up != me and up not in chain and up in procs:
                    chain.add(up)
                    up = procs[up][0]
                if up != me:
                    continue
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                except OSError:
                    continue
                name = title[5:].split(".")[0].split()[0] if title.startswith("ray::") else ""
                if name and name not in ("IDLE", "DashboardAgent", "RuntimeEnvAgent"):  # Ray's own agents run at 0
                    self.seen.setdefault(name, set()).add(ni)

    def stop(self) -> dict:
        self.halt.set()
        self.join()
        return {k: sorted(v) for k, v in sorted(self.seen.items())}


def side(name: str, run, busy: bool, max_s: float) -> dict:
    load0, load_p = os.getloadavg()[0], None
    p = start_busy(max_s) if busy else None
    sampler = ActorNiceness() if name.startswith("ours") else None
    if sampler:
        sampler.start()
    try:
        res = run()
    finally:
        if sampler:
            res_actors = sampler.stop()
        if p is not None:
            stop_busy(p)
    res.update(load_start=round(load0, 2), load_end=round(os.getloadavg()[0], 2), busy_loop=busy)
    if sampler:
        res["actor_niceness"] = res_actors
    print(f"{name} ({'busy' if busy else 'quiet'}): {json.dumps(res)}", flush=True)
    return res


def main(a) -> None:
    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.runtime import niceness

    names = ["ours", "trl_best"] + (["ours_ray_niceness"] if a.ray_default else [])
    out: dict = {"settings": {**vars(a), "this_niceness": os.getpriority(os.PRIO_PROCESS, 0),
                              "cpus": os.cpu_count()}, "quiet": {n: [] for n in names}, "busy": {n: [] for n in names}}

    def ours(rep: int, setting: str | None):
        def run():
            old = os.environ.pop(niceness.ENV, None)
            if setting:
                os.environ[niceness.ENV] = setting
            try:
                return peer.ours_part(d, policy, prompts, not a.no_shared, rep)
            finally:
                os.environ.pop(niceness.ENV, None)
                if old is not None:
                    os.environ[niceness.ENV] = old
        return run

    def trl():  # TRL at its best: with the OpenMP spin our stages give their processes, unless --trl-default-spin
        from rlhf_core.runtime.niceness import SPIN

        old = {k: os.environ.pop(k) for k in SPIN if k in os.environ}
        if not a.trl_default_spin:
            os.environ.update(SPIN)
        try:
            return peer.trl_run(a.trl_python, policy, prompts, a.steps, False)
        finally:
            for k in SPIN:
                os.environ.pop(k, None)
            os.environ.update(old)

    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0, **peer.SIZES[a.size])
        prompts = Path(d) / "prompts.jsonl"
        rows = demo_task.prompts(peer.P * a.steps, 0)
        if a.prompt_len:
            from transformers import AutoTokenizer

            rows = peer.long_prompts(rows, AutoTokenizer.from_pretrained(str(policy)), demo_task.INPUT_TEMPLATE,
                                     a.prompt_len)
        prompts.write_text("\n".join(json.dumps(r) for r in rows))
        k = 0
        for rep in range(a.repeats):
            for mode in (("quiet", "busy") if rep % 2 == 0 else ("busy", "quiet")):
                for name in names:
                    if mode == "quiet" and name == "ours_ray_niceness":
                        continue  # Ray's niceness changes nothing on an idle core: only beside the load
                    run = (ours(k, None) if name == "ours" else ours(k, "ray") if name == "ours_ray_niceness"
                           else trl)
                    k += 1
                    out[mode][name].append(side(name, run, mode == "busy", a.busy_max_s))
    ratio = {}
    for mode in ("quiet", "busy"):
        per = [round(t["step_s"] / o["step_s"], 3) for o, t in zip(out[mode]["ours"], out[mode]["trl_best"])]
        ratio[mode] = {"median": round(statistics.median(per), 3), "per_repeat": per}
    ratio["busy_over_quiet"] = round(ratio["busy"]["median"] / ratio["quiet"]["median"], 3)
    if a.ray_default:
        per = [round(t["step_s"] / o["step_s"], 3) for o, t in zip(out["busy"]["ours_ray_niceness"], out["busy"]["trl_best"])]
        ratio["busy_ours_at_ray_niceness"] = {"median": round(statistics.median(per), 3), "per_repeat": per}
    out["speedup_vs_trl_best"] = ratio  # TRL's s/step over ours: > 1 means ours is faster
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", default="/tmp/trl-venv/bin/python")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--size", choices=sorted(peer.SIZES), default="tiny")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--completion-len", type=int, default=peer.MAX_LEN)
    ap.add_argument("--n", type=int, default=peer.G)
    ap.add_argument("--prompts-per-step", type=int, default=peer.P)
    ap.add_argument("--no-shared", action="store_true", help="ours without shared_prompt")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of quiet and busy sides (alternating order)")
    ap.add_argument("--ray-default", action="store_true", help="also the stage at Ray's niceness, beside the load")
    ap.add_argument("--trl-default-spin", action="store_true",
                    help="TRL with OpenMP's default barrier spin (default: with the GOMP_SPINCOUNT our stages give their "
                         "processes, rlhf_core.runtime.niceness.SPIN: TRL at its best)")
    ap.add_argument("--busy-max-s", type=float, default=3600.0, help="the busy loop exits by itself after this long")
    a = ap.parse_args()
    if not Path(a.trl_python).exists():
        sys.exit(f"--trl-python {a.trl_python}: no such interpreter; build TRL's venv as grpo_vs_trl.py's docstring says")
    peer.P, peer.G, peer.MAX_LEN = a.prompts_per_step, a.n, a.completion_len
    main(a)
