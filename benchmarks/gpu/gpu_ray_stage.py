"""The ppo stage on Ray on the one lent GPU vs the same roles called in-process (issue 36 item 6, layer b without
vLLM): colocated roles (colocate_all_models: the policy learner and an HF rollout engine share the GPU), the weight
sync by CUDA IPC, bf16, ZeRO-2 and ZeRO-3, GRPO (group_norm, no reference), two steps each, on a random
Qwen2-0.5B-shaped policy built there (the demo tokenizer; the demo's reward function). Then the same settings'
roles in this process (rlhf_core.ppo.roles.Learner and engines.HFRollout on the stage's own learner settings,
loop.learner_settings(cfg), and prompts, stages.ppo.load_prompts), one warm-up and two steps: generate, train, the
engine's weights copied from the learner's on the GPU. Per zero stage: the stage's second step (its first pays
the kernels' and allocator's warm-up) beside the in-process median, part by part (rollout, train, weight sync,
step), and the ratio: what Ray's actors, placement and the driver's round trips add on one GPU.

Ray 2.60 travels as two parts (benchmarks/gpu/gpu_kit.py; bash benchmarks/gpu/gpu_ray.sh runs this there). vLLM's
CUDA wheel cannot travel (several hundred MB, its own torch pin): the rollout engine is transformers' generate.

    python3 benchmarks/gpu/gpu_ray_stage.py                      (there, after gpu_ray.sh installed Ray)
    .venv/bin/python benchmarks/gpu/gpu_ray_stage.py --device cpu --small     (CPU run: tiny shapes, fp32, no IPC)

One JSON line per measurement on stdout; with OUT set, also $OUT/gpu_ray.json (a list, rewritten after each).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rlhf_core and stages from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import emitter  # noqa: E402  (this folder, on the path when run as a script)

from gpu_roles import QWEN2_0_5B, SMALL, qwen2, random_model  # noqa: E402

emit = emitter("gpu_ray.json")  # benchmarks/gpu/records.py
PARTS = ("rollout_s", "train_s", "weight_sync_s", "step_s")


def config(args, work: Path, zero_stage: int, cuda: bool):
    from rlhf_core.demo import demo_task
    from stages import ppo

    return ppo.Config(policy_uri=str(work / "policy"), prompts_uri=str(work / "prompts.jsonl"),
                      output_uri=str(work / f"ppo-z{zero_stage}"), reward_func_path=demo_task.__file__,
                      input_template=demo_task.INPUT_TEMPLATE, advantage_estimator="group_norm",
                      n_samples_per_prompt=args.n, rollout_batch_size=args.prompts, max_samples=2 * args.prompts,
                      train_batch_size=args.prompts * args.n, micro_train_batch_size=args.micro,
                      generate_max_len=args.new_tokens, actor_learning_rate=1e-6, lr_warmup_ratio=0.0, init_kl_coef=0.0,
                      bf16=cuda, zero_stage=zero_stage, rollout_backend="hf", vllm_num_engines=1,
                      colocate_all_models=True, seed=0)


def in_process(cfg, steps: int, cuda: bool) -> list[dict]:
    """The stage's roles without Ray: generate, the demo reward, group_norm advantages, one optimizer step, the
    engine's weights copied from the learner's (GPU to GPU, gathered under ZeRO-3)."""
    import torch

    from rlhf_core.inputs import models
    from rlhf_core.rl import rl_math
    from rlhf_core.rollout.rewards import RewardSpec, compute_rewards
    from rlhf_core.runtime.jobs import free_port
    from rlhf_core.ppo import batches, loop
    from rlhf_core.ppo.engines import HFRollout
    from rlhf_core.ppo.roles import Learner
    from stages import ppo

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tok = models.load_tokenizer(cfg.policy_uri)
    rows, prompt_ids, _ = ppo.load_prompts(cfg, tok)
    eng = HFRollout(cfg.policy_uri, bf16=cfg.bf16)
    learner = Learner("policy", 0, 1)
    learner.setup(cfg.policy_uri, loop.learner_settings(cfg), "127.0.0.1", free_port(), total_steps=steps + 2)
    spec = RewardSpec(func_path=cfg.reward_func_path)
    out = []
    for step in range(steps + 1):
        idx = list(range((step % 2) * cfg.rollout_batch_size, (step % 2 + 1) * cfg.rollout_batch_size))
        sync()
        t_step = time.perf_counter()
        outs = eng.generate([prompt_ids[i] for i in idx], cfg.n_samples_per_prompt, cfg.generate_max_len,
                            cfg.temperature, cfg.top_p, cfg.top_k, seed=step)
        resp = [o["ids"] for per in outs for o in per]
        texts = [tok.decode(r, skip_special_tokens=True) for r in resp]
        prompts = [rows[i]["prompt"] for i in idx for _ in range(cfg.n_samples_per_prompt)]
        raw = compute_rewards(spec, prompts, texts, [rows[i].get("label") for i in idx
                                                     for _ in range(cfg.n_samples_per_prompt)]).rewards
        sync()
        t_rollout = time.perf_counter() - t_step
        batch = batches.collate([prompt_ids[i] for i in idx for _ in range(cfg.n_samples_per_prompt)], resp, eng.pad_id,
                             logprobs=[o["logprobs"] for per in outs for o in per])
        adv, ret = rl_math.advantages_and_returns("group_norm", torch.tensor(raw, dtype=torch.float32), batch["mask"],
                                                  cfg.n_samples_per_prompt, torch.zeros_like(batch["mask"]), 0.0)
        t0 = time.perf_counter()
        learner.train({**batch, "adv": adv, "returns": ret}, 0.0)
        sync()
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad(), learner._gathered():
            eng.model.load_state_dict(learner.module.state_dict(), strict=False)
        sync()
        t_sync = time.perf_counter() - t0
        if step:  # the first step warms up
            out.append({"rollout_s": t_rollout, "train_s": t_train, "weight_sync_s": t_sync,
                        "step_s": time.perf_counter() - t_step})
    del learner, eng
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes and batches (a CPU run)")
    ap.add_argument("--zero-stages", default="2,3")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--micro", type=int, default=16)
    args = ap.parse_args()
    if args.small:
        args.prompts, args.n, args.new_tokens, args.micro = 4, 4, 8, 8
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's workers import rlhf_core and what travelled as wheels: this checkout first on their path too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    import ray
    import torch

    from rlhf_core.demo import demo_task, tiny
    from stages import ppo

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu --small)")
    emit({"what": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "ray": ray.__version__, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
          "micro": args.micro})
    with tempfile.TemporaryDirectory(prefix="gpu-ray-") as tmp:
        work = Path(tmp)
        tok = tiny.build_tokenizer(work / "tokenizer", demo_task.corpus(0))
        model = random_model(qwen2(SMALL if args.small else QWEN2_0_5B, tok), "cpu", torch.bfloat16 if cuda else torch.float32)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(work / "policy"), safe_serialization=True)
        tok.save_pretrained(str(work / "policy"))
        del model
        (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in demo_task.prompts(2 * args.prompts)))
        for z in (int(s) for s in args.zero_stages.split(",")):
            cfg = config(args, work, z, cuda)
            t0 = time.perf_counter()
            m = ppo.run(cfg)
            wall = time.perf_counter() - t0
            log = json.loads((work / f"ppo-z{z}" / "training_log.json").read_text())
            stage = {k: log[-1][k] for k in PARTS}
            emit({"what": "ppo_stage_on_ray", "zero_stage": z, "steps": m.metrics["steps_done"], "wall_s": round(wall, 2),
                  "weight_sync_method": log[-1]["weight_sync_method"], "per_step": [{k: round(r[k], 4) for k in PARTS}
                                                                                   for r in log],
                  "policy_peak_mem_gb": log[-1].get("policy_peak_mem_gb")})
            steps = in_process(cfg, 2, cuda)
            here = {k: statistics.median(s[k] for s in steps) for k in PARTS}
            emit({"what": "ray_vs_in_process", "zero_stage": z, "stage_step2": {k: round(v, 4) for k, v in stage.items()},
                  "in_process_median": {k: round(v, 4) for k, v in here.items()},
                  "ratio_stage_over_in_process": {k: round(stage[k] / max(here[k], 1e-9), 3) for k in PARTS}})
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
