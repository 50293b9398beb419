"""What a step's log shows beyond its losses (issue 45 item 5): the step's estimated FLOPs, tokens per second per device
of the run and MFU (`model_sizes` once per run, `throughput` per step), and a sample of its rollouts
(`rollout_sample`: the artifact's rollouts/step-NNNNNN.parquet). loop.py calls them."""
from __future__ import annotations

import torch

from rlhf_core.ppo import plan
from rlhf_core.ppo.placement import Roles


# dense bf16 TFLOP/s of a GPU by name (vendor data sheets, no sparsity): the MFU's peak when peak_tflops_per_gpu is unset
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "B200": 2250.0, "GH200": 989.0}


def model_sizes(roles: Roles, cfg) -> dict:
    """Parameters of each model the step runs (a ZeRO-3 group's ranks summed, a replica's once), the run's devices
    (bundles) and the peak TFLOP/s of one (peak_tflops_per_gpu, else the bf16 figure of policy rank 0's GPU)."""
    def total(group: list, sharded: bool) -> int:
        got = roles.wait([a.param_elements.remote() for a in group], group, "reporting the parameters each rank holds")
        return sum(got) if sharded else got[0]

    out = {"policy": total(roles.policy, cfg.zero_stage == 3),
           "critic": total(roles.critic, cfg.zero_stage == 3) if roles.critic else 0,
           "reward": total(roles.rewards, plan.reward_ranks(cfg)[1]) if roles.rewards else 0,
           "teachers": sum(total([t], False) for t in roles.teachers),
           "devices": 1 + max(b for _, b in roles.plan)}
    peak = getattr(cfg, "peak_tflops_per_gpu", None)
    if peak is None and roles.gpus and cfg.bf16:
        name = roles.wait([roles.policy[0].__ray_call__.remote(
            lambda me: torch.cuda.get_device_name() if torch.cuda.is_available() else "")], roles.policy[:1],
            "reporting its GPU")[0]
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    out["peak_tflops"] = peak
    return out


def throughput(cfg, sizes: dict, batch: dict, step_s: float, old_reused: bool, use_ref: bool, critic: bool,
                trained: bool) -> dict:
    """The step's estimated FLOPs, tokens per second per device over every device of the run (the rollout engines'
    too) and MFU (those FLOPs over the devices' peak for the step's seconds, when the peak is known). FLOPs: 2N per
    token a model forwards, 6N per token it trains on (forward and backward; Kaplan et al. 2020, arXiv:2001.08361
    sec. 2.1), over the batch's tokens (prompt and response): the rollout's generation, the old log-probs (unless
    the training forward serves), the reference, the critic's values, the reward model, distillation teachers, and
    max_epochs updates of the
    policy (and critic); attention's context term is left out (small at these lengths) and a mixture of experts is
    counted with all its parameters (an overestimate)."""
    tokens = float(batch["attn"].sum())
    forwards = sizes["policy"] * (1 + (not old_reused)) + sizes["policy"] * use_ref + sizes["critic"] + sizes["reward"] + \
        sizes.get("teachers", 0)
    trains = cfg.max_epochs * (sizes["policy"] * trained + sizes["critic"] * critic)
    flops = tokens * (2 * forwards + 6 * trains)
    out = {"step_tflops": flops / 1e12, "devices": sizes["devices"],
           "tokens_per_s_per_device": tokens / max(1e-9, step_s) / sizes["devices"]}
    if sizes["peak_tflops"]:
        out["mfu"] = flops / max(1e-9, step_s) / (sizes["devices"] * sizes["peak_tflops"] * 1e12)
    return out


def rollout_sample(cfg, tok, prompts: list[dict], idx: list[int], batch: dict, raw: list, adv: torch.Tensor,
                   truncated: list | None, step: int):
    """The first rollout_samples_per_step rollouts of a step as a table: prompt, completion (the sampled tokens,
    decoded), reward, advantage (its mean over the sampled tokens), length (sampled tokens), stop reason."""
    import pyarrow as pa

    n, k = cfg.n_samples_per_prompt, min(cfg.rollout_samples_per_step, batch["ids"].shape[0])
    rows = []
    for r in range(k):
        mask = batch["mask"][r] > 0  # (L - 1,): column t is token t + 1
        sampled = batch["ids"][r, 1:][mask].tolist()
        rows.append({"step": step, "prompt_index": idx[r // n], "sample_index": r % n, "prompt": prompts[idx[r // n]]["prompt"],
                     "completion": tok.decode(sampled, skip_special_tokens=False), "reward": float(raw[r]),
                     "advantage": float(adv[r][mask].mean()) if mask.any() else 0.0, "length": len(sampled),
                     "stop_reason": "length" if truncated and truncated[r] else "stop"})
    return pa.Table.from_pylist(rows)
