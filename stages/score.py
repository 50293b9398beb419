"""score: add a reward to every sample -> a `scored` artifact.

OpenRLHF's batch_inference `--eval_task rm` (and `--remote_rm_url`) as a stage. The reward comes from one
source (rlhf_core.rollout.rewards): a reward model (sequence classifier or OpenRLHF value head, batched by length on
`num_engines` Ray actors, normalised by the mean/std in its config), a Python file with OpenRLHF's
`reward_func(queries, prompts, labels)`, or a remote reward server (OpenRLHF serve_rm shape). Rewards must
be finite. Note: a remote server's model is outside the fingerprint; only its URL enters it.
A process reward model (from train_prm; recognised by its config.json, no flag) scores every step that ends
with its placeholder token: `step_rewards` (a list column) holds the steps' rewards, `reward` their
`prm_aggregate` (min by default: the weakest step, as Math-Shepherd ranks solutions; or last, or mean).
A causal-LM PRM trained elsewhere is named by `prm_tokens` (placeholder, then reward tokens, positive first).
Samples whose response has no placeholder are refused by row before any scoring, unless
`prm_step_separator` (e.g. "\n") names where a step ends: then the placeholders are put there for scoring
(rlhf_core.rollout.reward_model.mark_steps), the samples keep their text, and a response already holding one is refused.

    rlhf-flows stage score samples_uri=... reward_model_uri=... output_uri=...
    rlhf-flows serve-rm s3://b/rm --port 5000     # then, elsewhere:
    rlhf-flows stage score samples_uri=... remote_rm_url=http://127.0.0.1:5000/ output_uri=...
"""
from __future__ import annotations

import json
import math
import time
from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.inputs import data, model_inputs
from rlhf_core.runtime import ray_jobs
from rlhf_core import store
from rlhf_core.rollout.rewards import RewardSpec, compute_rewards, load_reward_func
from rlhf_core.rollout.reward_model import check_reward_model
from stages.common import ConfigError, StageConfig


class Config(StageConfig):
    samples_uri: str = Field(description="Committed `samples` artifact (from generate).")
    reward_model_uri: str | None = Field(None, description="Reward model: committed artifact or plain HF folder on any URI.")
    reward_func_path: str | None = Field(None, description="Python file defining reward_func(queries, prompts, labels).")
    remote_rm_url: str | None = Field(None, description="HTTP reward server (POST query/prompts/labels -> rewards).")
    value_head_prefix: str = Field("value_head", description="OpenRLHF value-head weight name in the reward model.")
    prm_aggregate: Literal["min", "last", "mean"] | None = Field(None, description=
                                    "Process reward model only: the reward from the step rewards (default min, "
                                    "the weakest step, as Math-Shepherd; last; mean).")
    prm_tokens: list[str] | None = Field(None, min_length=3, description=
                                         "A plain causal LM as a process reward model (one not trained here, e.g. "
                                         "Math-Shepherd's): its placeholder token, then its reward tokens, the "
                                         "positive first, e.g. [ки, +, -]. A train_prm artifact names its own.")
    prm_step_separator: str | None = Field(None, min_length=1, description=
                                           "Process reward model only: split each response into steps at this string "
                                           "(e.g. a newline) and end each step with the placeholder before scoring, for "
                                           "policies whose samples hold no placeholders.")
    normalize_reward: bool = Field(True, description="Apply reward_mean/reward_std from the reward model's config.")
    max_len: int = Field(2048, ge=2, description="Max tokens of prompt + response scored by the reward model.")
    append_eos: bool = Field(True, description="Append EOS before scoring with the reward model (as OpenRLHF does).")
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32.")
    # runtime only: not in the fingerprint
    num_engines: int = Field(1, ge=0, description="Ray actors for the reward model (0 = in this process, no Ray).")
    ray_address: str | None = Field(None, description="HEAD:6379 joins that Ray cluster; http://HEAD:8265 runs the "
                                       "stage there as a Ray Job (its job API); default: a local Ray for the stage.")
    batch_size: int = Field(64, ge=1, description="Rows per forward pass / reward_func call / HTTP request.")
    timeout_s: float = Field(30.0, gt=0, description="Remote reward server: seconds per request.")
    retries: int = Field(3, ge=1, description="Remote reward server: attempts per request.")

    runtime_fields = StageConfig.runtime_fields | {"num_engines", "ray_address", "batch_size", "timeout_s", "retries"}

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("reward_model_uri", "reward_func_path", "remote_rm_url") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"set exactly one of reward_model_uri, reward_func_path, remote_rm_url (got {given or 'none'})")
        return self


def run(cfg: Config) -> store.Manifest:
    # 1. lineage, and the skip: same inputs and config as a committed output -> nothing to read or load
    inputs = {"samples": store.read_manifest(cfg.samples_uri, storage_options=cfg.storage_options)}
    if cfg.reward_model_uri:
        inputs["reward_model"] = model_inputs.model_manifest(cfg.reward_model_uri, cfg.storage_options)
    elif cfg.reward_func_path:
        inputs["reward_func"] = store.source_manifest(cfg.reward_func_path, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "score", cfg.semantic(), inputs, cfg.storage_options)
    if (done := w.existing()):
        return done
    if ray_jobs.is_job_address(cfg.ray_address):  # the stage runs on the cluster as a Ray Job, which commits
        return ray_jobs.run_stage("score", cfg.model_dump(mode="json", exclude_defaults=True), cfg.ray_address, w)

    # 2. inputs, checked before any work
    table = store.read_table(cfg.samples_uri, storage_options=cfg.storage_options)
    data.validate_table(table, "samples", cfg.samples_uri)
    rows = table.to_pylist()
    if not rows:
        raise data.DataError(f"{cfg.samples_uri}: no samples to score")
    model, kind = None, None
    if cfg.reward_model_uri:
        rm_dir = model_inputs.fetch_model(cfg.reward_model_uri, cfg.storage_options, manifest=inputs["reward_model"])
        kind = check_reward_model(rm_dir, cfg.value_head_prefix, cfg.prm_tokens)
        model = cfg.reward_model_uri if cfg.ray_address else str(rm_dir)
    elif cfg.reward_func_path:
        load_reward_func(cfg.reward_func_path, cfg.storage_options)  # exists and defines reward_func
    for k in ("prm_aggregate", "prm_tokens", "prm_step_separator"):
        if getattr(cfg, k) and kind != "prm":
            raise ConfigError(f"{k}={getattr(cfg, k)!r} applies to a process reward model; "
                              f"{cfg.reward_model_uri or cfg.reward_func_path or cfg.remote_rm_url} is not one")
    if kind == "prm":  # every response must hold steps the PRM can rate
        token = (cfg.prm_tokens or [json.loads((rm_dir / "config.json").read_text())["prm_placeholder_token"]])[0]
        sep = cfg.prm_step_separator
        bad = [i for i, r in enumerate(rows) if (token in r["response"]) == (sep is not None)]
        if bad and sep is None:
            raise data.DataError(f"{cfg.samples_uri} row {bad[0]}: key 'response' has no step placeholder {token!r} "
                                 f"of the process reward model {cfg.reward_model_uri} ({len(bad)} of {len(rows)} rows "
                                 f"lack it): a PRM scores steps that end with it (or set prm_step_separator)")
        if bad:
            raise data.DataError(f"{cfg.samples_uri} row {bad[0]}: key 'response' already holds the step placeholder "
                                 f"{token!r} ({len(bad)} of {len(rows)} rows do), and prm_step_separator={sep!r} would "
                                 "add more: give one or the other")
    w.begin()

    # 3. score
    spec = RewardSpec(model=model, func_path=cfg.reward_func_path, remote_url=cfg.remote_rm_url,
                      value_head_prefix=cfg.value_head_prefix, prm_aggregate=cfg.prm_aggregate or "min",
                      prm_tokens=tuple(cfg.prm_tokens) if cfg.prm_tokens else None, prm_step_separator=cfg.prm_step_separator,
                      normalize=cfg.normalize_reward, max_len=cfg.max_len,
                      append_eos=cfg.append_eos, batch_size=cfg.batch_size, dtype=cfg.dtype, timeout_s=cfg.timeout_s,
                      retries=cfg.retries, storage_options=cfg.storage_options)
    t0 = time.perf_counter()
    out = compute_rewards(spec, [r["prompt"] for r in rows], [r["response"] for r in rows],
                          [r.get("label") for r in rows], cfg.num_engines, cfg.ray_address)
    seconds = time.perf_counter() - t0

    # 4. write scored rows, commit
    for k, r in enumerate(rows):
        r["reward"] = out.rewards[k]
        r["score"] = out.scores[k] if out.scores is not None else None
        if out.step_rewards is not None:
            r["step_rewards"] = out.step_rewards[k]
    w.write_table("scored.parquet", data.to_table(rows, "scored"))
    rw = out.rewards
    mean = sum(rw) / len(rw)
    std = math.sqrt(sum((x - mean) ** 2 for x in rw) / len(rw))
    tokens = sum((r.get("prompt_tokens") or 0) + (r.get("response_tokens") or 0) for r in rows)
    return w.commit(metrics={
        "rows": len(rows), "reward_mean": mean, "reward_std": std, "reward_min": min(rw), "reward_max": max(rw),
        "score_seconds": seconds, "rows_per_s": len(rows) / seconds if seconds > 0 else None,
        "tokens_per_s": tokens / seconds if seconds > 0 and tokens else None,
        **({"prm_aggregate": cfg.prm_aggregate or "min", "prm_steps": sum(map(len, out.step_rewards))}
           if out.step_rewards is not None else {}),
        "source": "reward_model" if cfg.reward_model_uri else "reward_func" if cfg.reward_func_path else "remote",
        **{f"extra/{k}": v for k, v in out.extra_logs.items()}})
