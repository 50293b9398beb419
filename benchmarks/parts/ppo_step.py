"""Time per GRPO step: the ppo stage (Ray roles, DeepSpeed learner, HF rollout actor, object-store weight sync,
experience building, bookkeeping) vs a bare single-process loop doing the same work on the same tiny policy
and batch: HF generate -> gold reward -> group-normalised advantages -> clipped loss, one AdamW step (the forward's own log-probs are the old policy's: one update per rollout) -> load_state_dict
into the generating copy. Both fp32, same prompts, samples per prompt,
completion length, batch sizes and steps; stage startup (Ray, actors) is reported apart and left out of the
per-step figure. Goal: stage <= 1.15x the bare loop; the stage's peak memory is in its training log.

    .venv/bin/python benchmarks/parts/ppo_step.py [--steps 8] [--size tiny|57m]
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
SETTINGS = dict(n_samples_per_prompt=4, rollout_batch_size=16, train_batch_size=64, micro_train_batch_size=16,
                generate_max_len=16, actor_learning_rate=5e-4, lr_warmup_ratio=0.0, init_kl_coef=0.0)
# --size: the tiny demo policy (0.4M parameters, overhead-bound) or a ~57M-parameter Llama shape on the same
# tokenizer (hidden 768, 8 layers, 12 heads, MLP 2048: compute-bound on these CPUs)
SIZES = {"tiny": {}, "57m": dict(hidden=768, layers=8, heads=12, intermediate=2048)}


def bare_loop(policy_dir: str, prompt_ids: list[list[int]], pad_id: int, steps: int) -> tuple[list[float], dict]:
    """Seconds per step, and per step the split: rollout (generate + reward), train, weight sync."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.demo import demo_task
    from rlhf_core.rl import rl_math
    from rlhf_core.ppo.batches import collate
    from rlhf_core.ppo.engines import HFRollout
    from rlhf_core.ppo.forward import policy_logprobs

    s = SETTINGS
    tok = AutoTokenizer.from_pretrained(policy_dir)
    rollout = HFRollout(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=s["actor_learning_rate"], betas=(0.9, 0.95))
    R, n, mb = s["rollout_batch_size"], s["n_samples_per_prompt"], s["micro_train_batch_size"]
    times, split = [], {"rollout_s": [], "train_s": [], "weight_sync_s": []}
    for step in range(steps):
        t0 = time.perf_counter()
        idx = list(range((step * R) % len(prompt_ids), (step * R) % len(prompt_ids) + R))
        outs = rollout.generate([prompt_ids[i] for i in idx], n, s["generate_max_len"], 1.0, 1.0, 0, step)
        resp = [o["ids"] for per in outs for o in per]
        b = collate([prompt_ids[i] for i in idx for _ in range(n)], resp, pad_id)
        scores = torch.tensor([demo_task.gold_reward(tok.decode(r, skip_special_tokens=True)) for r in resp])
        adv, _ = rl_math.advantages_and_returns("group_norm", scores, b["mask"], n, torch.zeros_like(b["mask"]), 0.0)
        t1 = time.perf_counter()
        model.train()
        for k in range(0, len(resp), mb):  # one optimizer step per rollout: the forward's own log-probs are the
            sl = slice(k, k + mb)           # old policy's (no separate pass for them)
            mbatch = {key: v[sl] for key, v in b.items()}
            lp = policy_logprobs(model, mbatch)[0]
            loss, _ = rl_math.policy_loss(lp, lp.detach(), adv[sl], mbatch["mask"])
            (loss * mb / s["train_batch_size"]).backward()
            if (k + mb) % s["train_batch_size"] == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        t2 = time.perf_counter()
        rollout.load_weights([{k: v.detach().clone() for k, v in model.state_dict().items()}])
        t3 = time.perf_counter()
        times.append(t3 - t0)
        for k, v in zip(split, (t1 - t0, t2 - t1, t3 - t2)):
            split[k].append(v)
    return times, split


def main(steps: int, size: str) -> None:
    from transformers import AutoTokenizer

    from rlhf_core.demo import demo_task, tiny
    from stages import ppo

    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0, **SIZES[size])
        prompts = Path(d) / "prompts.jsonl"
        rows = demo_task.prompts(SETTINGS["rollout_batch_size"] * steps, 0)
        prompts.write_text("\n".join(json.dumps(r) for r in rows))
        tok = AutoTokenizer.from_pretrained(str(policy))
        ids = [tok(demo_task.INPUT_TEMPLATE.format(r["input"]), add_special_tokens=False).input_ids for r in rows]
        bare, bare_split = bare_loop(str(policy), ids, tok.pad_token_id, steps)
        import resource

        bare_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # GB: this process ran the bare loop
        cfg = ppo.Config(policy_uri=str(policy), prompts_uri=str(prompts), output_uri=str(Path(d) / "out"),
                         reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE,
                         advantage_estimator="group_norm", zero_stage=0, **SETTINGS)
        t0 = time.perf_counter()
        ppo.run(cfg)
        wall = time.perf_counter() - t0
        log = json.loads((Path(d) / "out" / "training_log.json").read_text())
    stage = [h["step_s"] for h in log]
    # the first step of each side warms caches: medians over the rest
    b, s = statistics.median(bare[1:]), statistics.median(stage[1:])
    split = {k: round(statistics.median(h[k] for h in log[1:]), 4)
             for k in ("rollout_s", "reward_s", "reference_s", "old_logp_s", "train_s", "weight_sync_s")}
    print(json.dumps({"steps": steps, "size": size, "settings": SETTINGS, "bare_step_s": round(b, 4), "stage_step_s": round(s, 4),
                      "stage_over_bare": round(s / b, 3), "stage_split_s": split,
                      "bare_split_s": {k: round(statistics.median(v[1:]), 4) for k, v in bare_split.items()},
                      "stage_startup_and_commit_s": round(wall - sum(stage), 2),
                      "peak_rss_gb": {"bare_loop_process": round(bare_rss, 3),
                                      **{k: round(max(h[k] for h in log), 3) for k in
                                         ("policy_peak_mem_gb", "rollout_peak_mem_gb", "driver_peak_mem_gb")}},
                      "load": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    a = ap.parse_args()
    main(a.steps, a.size)
