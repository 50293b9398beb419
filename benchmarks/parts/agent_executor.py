"""Episodes/s of the agent executor (rlhf_core.rollout.agent): N multi-turn episodes run concurrently (their turns
batched into one generate call per engine per turn) vs the same N episodes run one at a time, on the same
in-process HF rollout engine (rlhf_core.ppo.engines.HFRollout, fp32) with the tiny demo policy and the shipped
environment configs/agents/review_retry.py (a weak review is sent back, 3 tries at most; the untrained tiny
policy's reviews are weak, so episodes take up to 3 turns). Same prompts, sampling settings and token budget on
both sides; the ratio is the concurrency gain.

    .venv/bin/python benchmarks/parts/agent_executor.py [--episodes 64] [--repeats 2]
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
ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=36, help="token budget per episode (all turns)")
    ap.add_argument("--turn-tokens", type=int, default=10, help="max tokens per turn")
    args = ap.parse_args()

    import torch

    from rlhf_core.rollout import agent

    from rlhf_core.rollout import episodes
    from rlhf_core.demo import demo_task, tiny
    from rlhf_core.inputs import models
    from rlhf_core.ppo.engines import HFRollout

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    policy, _ = tiny.build_tiny_pair(work, demo_task.corpus(0), seed=0)
    tok = models.load_tokenizer(policy)
    engine = HFRollout(str(policy))
    cls = agent.load_agent(str(ROOT / "configs" / "agents" / "review_retry.py"))
    prompts = [demo_task.INPUT_TEMPLATE.format(r["input"]) for r in demo_task.prompts(args.episodes, 0)]
    items = [(i, p, tok(p, add_special_tokens=False).input_ids, None) for i, p in enumerate(prompts)]

    def executor():
        return episodes.Executor(episodes.EngineClient([engine], seed=0),
                              encode=lambda s: tok(s, add_special_tokens=False).input_ids,
                              decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                              sampling=agent.SamplingParams(max_tokens=args.turn_tokens),
                              max_new_tokens=args.max_new, max_turns=3, agent_cls=cls)

    def concurrent():
        ex = executor()
        eps = episodes.run_episodes(ex, items)
        return eps, ex.client.calls

    def one_at_a_time():
        eps, calls = [], 0
        for it in items:
            ex = executor()
            eps += episodes.run_episodes(ex, [it])
            calls += ex.client.calls
        return eps, calls

    episodes.run_episodes(executor(), items[:4])  # warm-up
    out = {}
    for name, fn in (("one_at_a_time", one_at_a_time), ("concurrent", concurrent)):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            eps, calls = fn()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        out[name] = {"episodes_per_s": round(len(eps) / s, 2), "median_s": round(s, 3),
                     "turns": sum(e.turns for e in eps), "engine_calls": calls,
                     "tokens": sum(len(e.ids) for e in eps)}
    out["concurrency_gain"] = round(out["concurrent"]["episodes_per_s"] / out["one_at_a_time"]["episodes_per_s"], 2)
    out["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
