"""GRPO on one GPU beside TRL 1.16's GRPOTrainer (issue 44 item 5), each side in its own process, one after the
other, on the same random Qwen2-0.5B-shaped policy (the demo's tiny tokenizer), prompt texts, samples per prompt,
completion length, batch, micro-batch, learning rate and steps:

  ours   the ppo roles in-process, as the stage's GRPO step runs them without Ray: HFRollout.generate (bf16) ->
         the demo's gold reward of each decoded completion -> group_norm advantages -> Learner.train (DeepSpeed
         bf16, ZeRO-2, one optimizer step over the rollout, shared_prompt as the stage's default, no KL) ->
         HFRollout.load_weights (the learner's full state_dict: the weight sync). Ray's actors and the stage's
         bookkeeping are not in it (benchmarks/gpu/gpu_ray_stage.py measures those).
  trl    GRPOTrainer with HF generate (use_vllm False), beta 0, bf16 (its default: fp32 weights, bf16 autocast),
         per_device_train_batch_size = the micro-batch, gradient_accumulation_steps = prompts x n / micro (one
         generation of prompts x n completions per optimizer step, as ours); "best": gradient checkpointing off
         (memory is no constraint at this size); "defaults": on, GRPOConfig's default (--trl-variants).

Per side: median seconds per step after the first (ours: the whole step, weight sync included; TRL: between its
on_step_end callbacks), the rollout's share (ours: generate; TRL: its _generate_and_score_completions, timed
around it), the completions' mean length, and the GPU memory peak of the process (nvidia-smi memory.used above
the idle GPU's, sampled every 0.1 s: the same yardstick for both). Then TRL's step / ours (speedup) and ours / TRL's
memory. Random weights with a 151,936 vocabulary rarely sample EOS: both sides generate the full completion length.

    python3 benchmarks/gpu/gpu_grpo_trl.py                  (on the lent GPU: benchmarks/gpu/gpu_kit_run.py, call 1)
    .venv/bin/python benchmarks/gpu/gpu_grpo_trl.py --device cpu --small   (CPU smoke run: tiny model, fp32; TRL's
                                                            side only where TRL is importable, or --trl-python)

One JSON line per side and per comparison on stdout; with OUT set, also $OUT/gpu_grpo_trl.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # rlhf_core from this checkout (not installed there)
sys.path.insert(0, str(HERE.parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

emit = emitter("gpu_grpo_trl.json")  # benchmarks/gpu/records.py


def build(work: Path, a, cuda: bool) -> dict:
    """The tokenizer, the policy (random weights at the shape) and the prompt texts (the demo's prompts lengthened
    with neutral words to >= prompt_len tokens), written under `work`."""
    import torch
    from transformers import AutoTokenizer

    from gpu_roles import QWEN2_0_5B, SMALL, qwen2, random_model
    from rlhf_core.demo import demo_task, tiny

    tok = tiny.build_tokenizer(work / "tok", demo_task.corpus(0))
    model = random_model(qwen2(SMALL if a.small else QWEN2_0_5B, tok), "cpu",
                         torch.bfloat16 if cuda else torch.float32)  # built on the CPU: the parent keeps off the GPU
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(work / "policy"), safe_serialization=True)
    tok.save_pretrained(str(work / "policy"))
    tk = AutoTokenizer.from_pretrained(str(work / "policy"))
    rng = random.Random(0)
    texts = []
    for r in demo_task.prompts(a.prompts * (a.steps + 1), 0):
        text = demo_task.INPUT_TEMPLATE.format(r["input"])
        while len(tk(text, add_special_tokens=False).input_ids) < a.prompt_len:
            text += " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(8)) + " "
        texts.append(text)
    (work / "prompts.json").write_text(json.dumps(texts))
    return {"prompt_tokens_mean": round(statistics.mean(len(tk(t, add_special_tokens=False).input_ids) for t in texts), 1)}


# ---------------------------------------------------------------------------------------------- one side (child)
def ours(job: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    from gpu_roles import Clock, learner_hp
    from rlhf_core.demo import demo_task
    from rlhf_core.ppo.batches import collate
    from rlhf_core.ppo.engines import HFRollout
    from rlhf_core.ppo.roles import Learner
    from rlhf_core.rl import rl_math
    from rlhf_core.runtime.jobs import free_port

    w, a, cuda = Path(job["work"]), job["args"], job["cuda"]
    P, G = a["prompts"], a["n"]
    policy = str(w / "policy")
    tok = AutoTokenizer.from_pretrained(policy)
    texts = json.loads((w / "prompts.json").read_text())
    clock = Clock(cuda)
    t0 = clock()
    eng = HFRollout(policy, bf16=cuda)
    hp = {**learner_hp(cuda, 2, P * G, a["micro"], a["new_tokens"]), "shared_prompt": True}  # the stage's default
    learner = Learner("policy", 0, 1)
    learner.setup(policy, hp, "127.0.0.1", free_port(), total_steps=a["steps"] + 2)
    setup_s = clock() - t0
    steps = []
    for step in range(a["steps"] + 1):  # step 0 warms up (kernels, allocator, DeepSpeed's buffers)
        prompts = [tok(t, add_special_tokens=False).input_ids for t in texts[step * P:(step + 1) * P]]
        t_step = clock()
        outs = eng.generate(prompts, G, a["new_tokens"], temperature=1.0, top_p=1.0, top_k=0, seed=step)
        rollout_s = clock() - t_step
        resp = [o["ids"] for per in outs for o in per]
        scores = torch.tensor([demo_task.gold_reward(x) for x in tok.batch_decode(resp, skip_special_tokens=True)])
        batch = collate([p for p in prompts for _ in range(G)], resp, eng.pad_id,
                        logprobs=[o["logprobs"] for per in outs for o in per])
        adv, ret = rl_math.advantages_and_returns("group_norm", scores, batch["mask"], G,
                                                  torch.zeros_like(batch["mask"]), 0.0)
        t_train = clock()
        learner.train({**batch, "adv": adv, "returns": ret}, kl_loss_coef=0.0)  # old log-probs: its own first forward
        train_s = clock() - t_train
        t_sync = clock()
        eng.load_weights([learner._full_state_dict()])
        sync_s = clock() - t_sync
        steps.append({"step_s": clock() - t_step, "rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s,
                      "completion_len": statistics.mean(len(r) for r in resp), "reward": float(scores.mean())})
    timed = steps[1:]
    med = (lambda k: round(statistics.median(s[k] for s in timed), 4))  # noqa: E731
    return {"step_s": med("step_s"), "rollout_s": med("rollout_s"), "train_s": med("train_s"), "sync_s": med("sync_s"),
            "completion_len": round(statistics.mean(s["completion_len"] for s in steps), 1),
            "step_s_all": [round(s["step_s"], 4) for s in steps], "setup_s": round(setup_s, 2),
            "reward_first_last": [round(steps[0]["reward"], 4), round(steps[-1]["reward"], 4)]}


def trl_side(job: dict) -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlhf_core.demo import demo_task

    w, a, cuda, variant = Path(job["work"]), job["args"], job["cuda"], job["variant"]
    P, G = a["prompts"], a["n"]
    texts = json.loads((w / "prompts.json").read_text())
    stamps, gen = [], []
    cls = trl.GRPOTrainer
    generate_and_score = cls._generate_and_score_completions

    def timed(self, *x, **k):  # TRL's rollout: generation, reward and advantages of one batch
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = generate_and_score(self, *x, **k)
        if cuda:
            torch.cuda.synchronize()
        gen.append(time.perf_counter() - t)
        return out

    cls._generate_and_score_completions = timed

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    def gold(prompts, completions, **_):
        return [demo_task.gold_reward(c) for c in completions]

    tok = AutoTokenizer.from_pretrained(str(w / "policy"))
    model = AutoModelForCausalLM.from_pretrained(str(w / "policy"), dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(w / f"trl-{variant}"), per_device_train_batch_size=a["micro"],
                          gradient_accumulation_steps=P * G // a["micro"], num_generations=G,
                          max_completion_length=a["new_tokens"], learning_rate=1e-6, beta=0.0, max_steps=a["steps"] + 1,
                          temperature=1.0, bf16=cuda, use_cpu=not cuda, report_to=[], save_strategy="no",
                          logging_steps=1, dataloader_num_workers=0, lr_scheduler_type="constant", seed=42,
                          gradient_checkpointing=variant == "defaults")
    tr = cls(model=model, reward_funcs=[gold], args=args, processing_class=tok,
             train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]), callbacks=[Stamp()])
    t0 = time.perf_counter()
    tr.train()
    per = [b - x for x, b in zip([t0] + stamps[:-1], stamps)]
    lengths = [h["completions/mean_length"] for h in tr.state.log_history if "completions/mean_length" in h]
    timed_steps = per[1:] or per
    return {"step_s": round(statistics.median(timed_steps), 4), "rollout_s": round(statistics.median(gen[1:] or gen), 4),
            "completion_len": round(statistics.mean(lengths), 1) if lengths else None,
            "step_s_all": [round(x, 4) for x in per], "trl": trl.__version__,
            "gradient_checkpointing": variant == "defaults"}


# ---------------------------------------------------------------------------------------------- the run (parent)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model and batch (a CPU smoke run)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (16; small: 2)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (8; small: 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens at least (64; small: 12)")
    ap.add_argument("--new-tokens", type=int, default=None, help="completion tokens (128; small: 8)")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch rows on both sides (16; small: 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (3; small: 1)")
    ap.add_argument("--trl-variants", default="best", help="best,defaults: TRL without / with gradient checkpointing")
    ap.add_argument("--trl-python", default=sys.executable,
                    help="python that runs TRL's side (here: a virtualenv with trl; there: this one, with the wheels)")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: one side in its own process
    a = ap.parse_args()
    if a.job:
        job = json.loads(a.job)
        if not job["cuda"]:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        print("RESULT " + json.dumps(ours(job) if job["side"] == "ours" else trl_side(job)), flush=True)
        return
    for k, (small, full) in dict(prompts=(2, 16), n=(4, 8), prompt_len=(12, 64), new_tokens=(8, 128), micro=(4, 16),
                                 steps=(1, 3)).items():
        if getattr(a, k) is None:
            setattr(a, k, small if a.small else full)
    if (a.prompts * a.n) % a.micro:
        sys.exit(f"--micro {a.micro} must divide prompts x n = {a.prompts * a.n}")
    cuda = a.device == "cuda"
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import importlib.util

    from gpu_trainers import side

    have_trl = a.trl_python != sys.executable or (importlib.util.find_spec("trl") is not None
                                                  and importlib.util.find_spec("datasets") is not None)
    settings = {k: getattr(a, k) for k in ("prompts", "n", "prompt_len", "new_tokens", "micro", "steps")}
    with tempfile.TemporaryDirectory(prefix="gpu-grpo-trl-") as tmp:
        work = Path(tmp)
        built = build(work, a, cuda)
        emit({"what": "env", "device": "cuda" if cuda else "cpu", "small": a.small, **settings, **built})
        job = {"work": str(work), "args": settings, "cuda": cuda}
        r = side({**job, "side": "ours"}, cuda, script=HERE)
        emit({"what": "ours", **r})
        if not have_trl:
            emit({"what": "trl", "skipped": "trl / datasets not importable here (carry them: gpu_kit.py prepare --trl)"})
            return
        for variant in [v for v in a.trl_variants.split(",") if v]:
            t = side({**job, "side": "trl", "variant": variant}, cuda, a.trl_python, script=HERE)
            emit({"what": "trl", "variant": variant, **t})
            if "error" not in r and "error" not in t:
                emit({"what": "grpo_vs_trl", "trl_variant": variant, "samples_per_step": a.prompts * a.n,
                      "ours_step_s": r["step_s"], "trl_step_s": t["step_s"],
                      "speedup": round(t["step_s"] / r["step_s"], 3),
                      "ours_samples_per_s": round(a.prompts * a.n / r["step_s"], 2),
                      "trl_samples_per_s": round(a.prompts * a.n / t["step_s"], 2),
                      "memory_ratio": (round(r["peak_gpu_gb"] / t["peak_gpu_gb"], 3)
                                       if r.get("peak_gpu_gb") and t.get("peak_gpu_gb") else None)})


if __name__ == "__main__":
    main()
