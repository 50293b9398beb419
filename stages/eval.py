"""Stage `eval`: how good is a policy? Sample it on held-out prompts and score the samples with the reward
model and, when the task has one, a gold reward function (the demo's exact sentiment score).

The loop flows run it on the initial policy (iteration 0) and after every iteration; its metrics feed the
per-iteration table, the plot and the `stop_when_gain_below` condition. With `reference_uri` it also
reports KL(policy || reference) per response token, the number to watch beside reward: a k1 estimate,
log pi(y|x) - log ref(y|x) summed over the sampled responses' tokens and divided by their count (unbiased
when sampling at temperature 1, top_p 1; http://joschu.net/blog/kl-approx.html), and the mean response length. It reuses the generate and score
machinery (rlhf_core.rollout.generation / rlhf_core.rollout.rewards) in-process by default: eval sets are small.

A process reward model as reward_model_uri scores as in the score stage (`prm_aggregate`, `prm_tokens`;
the loops pass score's settings), so eval's rm_reward is the loop's reward.

    rlhf-flows stage eval policy_uri=... prompts_uri=... reward_model_uri=... output_uri=...
"""
from __future__ import annotations

import statistics
from typing import Literal

import pyarrow as pa
from pydantic import Field

from rlhf_core.inputs import models
from rlhf_core import store
from rlhf_core.rollout.generation import EngineSpec, SamplingSpec, generate, model_input
from rlhf_core.rollout.rewards import RewardSpec, compute_rewards
from rlhf_core.rollout.reward_model import check_reward_model
from stages.common import ConfigError, StageConfig


class Config(StageConfig):
    policy_uri: str = Field(description="Policy to evaluate (model artifact or local HF folder).")
    prompts_uri: str = Field(description="Committed `prompts` artifact of held-out prompts.")
    reward_model_uri: str | None = Field(None, description="Reward model scoring the samples.")
    remote_rm_url: str | None = Field(None, description="Remote reward server scoring the samples (instead of reward_model_uri).")
    gold_reward_file: str | None = Field(None, description="Python file with a gold reward_func(queries, prompts, labels).")
    prm_aggregate: Literal["min", "last", "mean"] | None = Field(None, description="Process reward model only: the "
                                                                 "reward from its step rewards (default min), as score.")
    prm_tokens: list[str] | None = Field(None, min_length=3, description="A plain causal LM as a process reward model: "
                                         "placeholder, then reward tokens (positive first), as score.")
    prm_step_separator: str | None = Field(None, min_length=1, description="Process reward model only: where a step of "
                                           "a sample ends (e.g. a newline); the placeholders are put there, as score.")
    reference_uri: str | None = Field(None, description="Reference model (e.g. the initial policy): report KL(policy || "
                                      "reference) per response token.")
    prompt_template: str | None = Field(None, description="Applied to each prompt, e.g. '{prompt} <rm_score>: 1.00 ' "
                                        "(conditional SFT evaluates under its high-reward condition).")
    samples_per_prompt: int = Field(8, ge=1, description="Samples per prompt (more = less noisy means).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    seed: int = Field(1234, description="Same seed every evaluation, so iterations are compared on equal draws.")
    backend: str = Field("hf", description="'hf' or 'vllm'.")
    num_engines: int = Field(0, ge=0, description="Ray engines (0 = in this process).")
    runtime_fields = StageConfig.runtime_fields | {"num_engines"}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run(cfg: Config) -> store.Manifest:
    if not (cfg.reward_model_uri or cfg.remote_rm_url or cfg.gold_reward_file):
        raise ValueError("eval needs reward_model_uri (or remote_rm_url) or gold_reward_file (or both)")
    policy_dir, policy_m = model_input(cfg.policy_uri, cfg.storage_options)
    prompts_m = store.read_manifest(cfg.prompts_uri, stage="prepare", storage_options=cfg.storage_options)
    inputs = {"policy": policy_m, "prompts": prompts_m}
    if cfg.reward_model_uri:
        inputs["reward_model"] = model_input(cfg.reward_model_uri, cfg.storage_options)[1]
    if cfg.prm_aggregate or cfg.prm_tokens or cfg.prm_step_separator:
        if not cfg.reward_model_uri or check_reward_model(model_input(cfg.reward_model_uri, cfg.storage_options)[0],
                                                          prm_tokens=cfg.prm_tokens) != "prm":
            raise ConfigError(f"eval: prm_aggregate / prm_tokens / prm_step_separator apply to a process reward model; "
                              f"reward_model_uri {cfg.reward_model_uri} is not one")
    if cfg.gold_reward_file:
        inputs["gold_reward"] = store.source_manifest(cfg.gold_reward_file, cfg.storage_options)
    if cfg.reference_uri:
        inputs["reference"] = model_input(cfg.reference_uri, cfg.storage_options)[1]
    w = store.ArtifactWriter(cfg.output_uri, "eval", cfg.semantic(), inputs, cfg.storage_options)
    if (done := w.existing()):
        return done

    rows = store.read_table(cfg.prompts_uri, storage_options=cfg.storage_options).to_pylist()
    if cfg.prompt_template:
        if "{prompt}" not in cfg.prompt_template:
            raise ValueError(f"eval prompt_template {cfg.prompt_template!r} has no {{prompt}} placeholder")
        rows = [{**r, "prompt": cfg.prompt_template.replace("{prompt}", r["prompt"])} for r in rows]
    tok = models.load_tokenizer(policy_dir, where=cfg.policy_uri)
    ids = [models.prompt_ids(tok, r["prompt"]) for r in rows]
    params = SamplingSpec(n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
                          max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    outs = generate(str(policy_dir), ids, params, cfg.backend, cfg.num_engines,
                    engine=EngineSpec(max_model_len=max(map(len, ids)) + cfg.max_new_tokens), logprobs=False)
    samples = [{"prompt": r["prompt"], "sample_index": j, "response": o["response"], "label": r.get("label"),
                "response_tokens": o["response_tokens"], "finish_reason": o["finish_reason"]}
               for r, os_ in zip(rows, outs) for j, o in enumerate(os_)]
    prompts, responses = [s["prompt"] for s in samples], [s["response"] for s in samples]
    labels = [s["label"] for s in samples]
    metrics = {"samples": len(samples), "response_tokens_mean": _mean([s["response_tokens"] for s in samples])}
    if cfg.reference_uri:
        prompt_ids = [p for p, os_ in zip(ids, outs) for _ in os_]
        per_sample, metrics["kl"] = _kl_per_token(
            policy_dir, model_input(cfg.reference_uri, cfg.storage_options)[0], tok, prompt_ids, samples)
        for s, k in zip(samples, per_sample):
            s["kl"] = k
    if cfg.reward_model_uri:
        rm_dir = str(model_input(cfg.reward_model_uri, cfg.storage_options)[0])
        rm = compute_rewards(RewardSpec(model=rm_dir, storage_options=cfg.storage_options, prm_aggregate=cfg.prm_aggregate or "min",
                                        prm_tokens=tuple(cfg.prm_tokens) if cfg.prm_tokens else None,
                                        prm_step_separator=cfg.prm_step_separator), prompts, responses, labels)
        for s, r in zip(samples, rm.rewards):
            s["rm_reward"] = r
        metrics["rm_reward"] = _mean(rm.rewards)
    elif cfg.remote_rm_url:
        rm = compute_rewards(RewardSpec(remote_url=cfg.remote_rm_url), prompts, responses, labels)
        for s, r in zip(samples, rm.rewards):
            s["rm_reward"] = r
        metrics["rm_reward"] = _mean(rm.rewards)
    if cfg.gold_reward_file:
        gold = compute_rewards(RewardSpec(func_path=cfg.gold_reward_file, storage_options=cfg.storage_options),
                               prompts, responses, labels)
        for s, r in zip(samples, gold.rewards):
            s["gold_reward"] = r
        metrics["gold_reward"] = _mean(gold.rewards)
        metrics["gold_reward_std"] = statistics.pstdev(gold.rewards)

    w.begin()
    w.write_table("eval.parquet", pa.Table.from_pylist(samples))
    return w.commit(metrics=metrics)


def _kl_per_token(policy_dir, ref_dir, tok, prompt_ids: list[list[int]], samples: list[dict]) -> tuple[list[float], float]:
    """(per-sample summed log-ratio log pi - log ref over response tokens, their total / response tokens).
    Responses are re-tokenized from their text (+ EOS when generation stopped on it), teacher-forced in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.rl import losses
    from rlhf_core.train.batches import collate, per_sample_sum

    seqs, starts = [], []
    for p, s in zip(prompt_ids, samples):
        eos = [tok.eos_token_id] if s["finish_reason"] == "stop" and tok.eos_token_id is not None else []
        seqs.append(p + tok(s["response"], add_special_tokens=False).input_ids + eos)
        starts.append(len(p))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    sums = []
    for d in (policy_dir, ref_dir):
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        out: list[float] = []
        with torch.no_grad():
            for k in range(0, len(seqs), 64):
                b = collate(seqs[k:k + 64], starts[k:k + 64], pad)
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
                out += per_sample_sum(losses.token_logprobs(logits, b.input_ids), b).tolist()  # (n,)
        sums.append(out)
    per_sample = [a - b for a, b in zip(*sums)]
    tokens = sum(len(q) - max(st, 1) for q, st in zip(seqs, starts))
    return per_sample, sum(per_sample) / max(1, tokens)
