"""generate: sample best_of_n responses per prompt from a policy -> a `samples` artifact.

OpenRLHF's batch_inference `--eval_task generate_vllm|generate` as a stage: prompts come from a committed
`prompts` artifact or raw OpenRLHF-format sources (comma-separated with `prompt_data_probs`, formatted by
chat template or input_template), are sliced by `iter` * `rollout_batch_size` and `max_samples`, checked
against `prompt_max_len` (keep the last tokens and count, or reject), and sampled by the hf or vllm backend
on `num_engines` Ray actors (rlhf_core.rollout.generation). `condition_template` samples a reward-conditioned policy
under a condition (SteerLM's bootstrapping, OpenRLHF's csft prompt at generation time) while the samples keep
the plain prompt, so they are scored and re-labelled as plain prompts.

    rlhf-flows stage generate policy_uri=... prompts_uri=... output_uri=... backend=vllm num_engines=2
"""
from __future__ import annotations

import time

from pydantic import Field, field_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core.runtime import ray_jobs
from rlhf_core import store
from rlhf_core.rollout.generation import BACKENDS, EngineSpec, SamplingSpec, generate
from stages.common import StageConfig


class Config(StageConfig):
    policy_uri: str = Field(description="Policy model: committed model artifact or plain HF folder on any URI.")
    prompts_uri: str = Field(description="Committed `prompts` artifact, or raw sources (json/jsonl/csv/parquet, "
                                         "comma-separated) in OpenRLHF format.")
    prompt_data_probs: str | None = Field(None, description="Mixing probabilities of the raw sources, e.g. '0.7,0.3'.")
    input_key: str = Field("input", description="Raw sources: key of the prompt (text or message list).")
    label_key: str | None = Field(None, description="Raw sources: key passed through as `label` (for reward_func).")
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    input_template: str | None = Field(None, description="Format prompts as input_template.format(prompt).")
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template replacing the tokenizer's "
                                                "(OpenRLHF --tokenizer_chat_template).")
    condition_template: str | None = Field(None, description="Sample from this text with {prompt} replaced, e.g. "
                                           "'{prompt} <rm_score>: A ' (a conditional-SFT policy asked for the best); "
                                           "the samples keep the plain prompt.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many prompts (before `iter` slicing).")
    iter: int | None = Field(None, ge=0, description="OpenRLHF --iter: use prompts [iter*R, (iter+1)*R).")
    rollout_batch_size: int = Field(2048, ge=1, description="R in the `iter` slice.")
    prompt_max_len: int = Field(1024, ge=1, description="Max prompt tokens.")
    prompt_overflow: str = Field("truncate", description="Longer prompts: 'truncate' (keep the last tokens, counted) "
                                                         "or 'reject' (error naming the row).")
    backend: str = Field("hf", description="'hf' (transformers generate) or 'vllm'.")
    best_of_n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off.")
    max_new_tokens: int = Field(1024, ge=1)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int = Field(42)
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32.")
    logprobs: bool = Field(True, description="Record the sum of the sampled tokens' logprobs.")
    # runtime only (placement and speed): not in the fingerprint
    num_engines: int = Field(1, ge=0, description="Ray actors running the backend (0 = in this process, no Ray).")
    ray_address: str | None = Field(None, description="HEAD:6379 joins that Ray cluster; http://HEAD:8265 runs the "
                                       "stage there as a Ray Job (its job API); default: a local Ray for the stage.")
    batch_size: int = Field(64, ge=1, description="hf: prompts per generate call.")
    max_num_seqs: int | None = Field(None, ge=1, description="vllm: the engine's max_num_seqs (sequences decoded at "
                                     "once, --max_num_seqs); hf: sequences (prompts x best_of_n) per generate call, "
                                     "in place of batch_size.")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs per engine.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vllm: fraction of GPU memory.")
    enable_prefix_caching: bool = Field(False, description="vllm: share KV cache of common prompt prefixes.")
    stall_timeout_s: float = Field(3600.0, gt=0, description="Fail naming the stage when no engine finishes for this long.")

    runtime_fields = StageConfig.runtime_fields | {"num_engines", "ray_address", "batch_size", "max_num_seqs",
                                                   "tensor_parallel_size", "gpu_memory_utilization", "enable_prefix_caching", "stall_timeout_s"}

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in BACKENDS:
            raise ValueError(f"unknown backend {v!r}; choose one of {list(BACKENDS)}")
        return v

    @field_validator("condition_template")
    @classmethod
    def _condition(cls, v: str | None) -> str | None:
        if v is not None and "{prompt}" not in v:
            raise ValueError(f"condition_template {v!r} has no {{prompt}} placeholder")
        return v

    @field_validator("prompt_overflow")
    @classmethod
    def _overflow(cls, v: str) -> str:
        if v not in ("truncate", "reject"):
            raise ValueError(f"prompt_overflow must be 'truncate' or 'reject', got {v!r}")
        return v


def load_prompts(cfg: Config, tokenizer) -> list[dict]:
    """Prompt rows (prompt, label) after max_samples and the iter slice."""
    uris = [u.strip() for u in cfg.prompts_uri.split(",") if u.strip()]
    if len(uris) == 1 and store.committed_any(uris[0], cfg.storage_options):
        table = store.read_table(uris[0], storage_options=cfg.storage_options)
        data.validate_table(table, "prompts", uris[0])
        rows = table.to_pylist()[:cfg.max_samples]
    else:
        fmt = data.Format(input_key=cfg.input_key, label_key=cfg.label_key,
                          apply_chat_template=cfg.apply_chat_template, input_template=cfg.input_template)
        raw = data.load_mixture(uris, cfg.prompt_data_probs, cfg.max_samples, cfg.seed, cfg.storage_options)
        rows = data.prompt_rows(raw, fmt, tokenizer)
    total = len(rows)
    if cfg.iter is not None:
        start = cfg.iter * cfg.rollout_batch_size
        rows = rows[start:start + cfg.rollout_batch_size]
        if not rows:
            raise data.DataError(f"{cfg.prompts_uri}: iter {cfg.iter} slice [{start}, {start + cfg.rollout_batch_size})"
                                 f" of {total} prompts is empty")
    if not rows:
        raise data.DataError(f"{cfg.prompts_uri}: the prompt set is empty")
    return rows


def run(cfg: Config) -> store.Manifest:
    # 1. lineage, and the skip: same inputs and config as a committed output -> nothing to fetch or read
    uris = [u.strip() for u in cfg.prompts_uri.split(",") if u.strip()]
    policy_m = model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options)
    inputs = {"policy": policy_m,
              **{f"prompts{k or ''}": data.source_manifest(u, cfg.storage_options) for k, u in enumerate(uris)}}
    w = store.ArtifactWriter(cfg.output_uri, "generate", cfg.semantic(), inputs, cfg.storage_options)
    if (done := w.existing()):
        return done
    if ray_jobs.is_job_address(cfg.ray_address):  # the stage runs on the cluster as a Ray Job, which commits
        return ray_jobs.run_stage("generate", cfg.model_dump(mode="json", exclude_defaults=True), cfg.ray_address, w)

    # 2. inputs, checked before any work
    policy_dir = model_inputs.fetch_model(cfg.policy_uri, cfg.storage_options, manifest=policy_m)
    tok = models.load_tokenizer(policy_dir, cfg.tokenizer_chat_template, cfg.policy_uri)
    rows = load_prompts(cfg, tok)
    prompt_ids, truncated, bos = [], 0, models.adds_bos(tok)
    sampled = lambda text: cfg.condition_template.replace("{prompt}", text) if cfg.condition_template else text  # noqa: E731
    for i, r in enumerate(rows):
        ids = models.prompt_ids(tok, sampled(r["prompt"]), bos)  # one BOS, also under a chat template that writes it
        if len(ids) > cfg.prompt_max_len:
            if cfg.prompt_overflow == "reject":
                raise data.DataError(f"{cfg.prompts_uri} prompt {i}: {len(ids)} tokens > prompt_max_len "
                                     f"{cfg.prompt_max_len} (prompt_overflow=reject)")
            # keep the end (it holds the turn marker); a condition stays whole, the plain prompt is cut to fit it
            plain = models.prompt_ids(tok, r["prompt"], bos)
            r["prompt"], truncated = tok.decode(plain[len(ids) - cfg.prompt_max_len:]), truncated + 1
            if cfg.condition_template and len(models.prompt_ids(tok, sampled(""), bos)) >= cfg.prompt_max_len:
                raise data.DataError(f"{cfg.prompts_uri} prompt {i}: condition_template {cfg.condition_template!r} "
                                     f"leaves no room for the prompt within prompt_max_len {cfg.prompt_max_len}")
            ids = models.prompt_ids(tok, sampled(r["prompt"]), bos)[-cfg.prompt_max_len:]
        prompt_ids.append(ids)

    w.begin()

    # 3. sample
    params = SamplingSpec(n=cfg.best_of_n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0),
                          max_new_tokens=cfg.max_new_tokens, repetition_penalty=cfg.repetition_penalty, seed=cfg.seed)
    engine = EngineSpec(dtype=cfg.dtype, batch_size=cfg.batch_size, max_num_seqs=cfg.max_num_seqs,
                        tensor_parallel_size=cfg.tensor_parallel_size,
                        gpu_memory_utilization=cfg.gpu_memory_utilization,
                        enable_prefix_caching=cfg.enable_prefix_caching,
                        max_model_len=max(len(p) for p in prompt_ids) + cfg.max_new_tokens,
                        storage_options=cfg.storage_options, stall_timeout_s=cfg.stall_timeout_s)
    model = cfg.policy_uri if cfg.ray_address else str(policy_dir)  # a remote cluster fetches the artifact itself
    t0 = time.perf_counter()
    outs = generate(model, prompt_ids, params, cfg.backend, cfg.num_engines, cfg.ray_address, engine, cfg.logprobs)
    seconds = time.perf_counter() - t0

    # 4. write samples, commit
    samples = [{"prompt": r["prompt"], "sample_index": j, **o, "label": r.get("label")}
               for r, os_ in zip(rows, outs) for j, o in enumerate(os_)]
    w.write_table("samples.parquet", data.to_table(samples, "samples"))
    resp_tokens = sum(s["response_tokens"] for s in samples)
    return w.commit(metrics={
        "prompts": len(rows), "samples": len(samples), "prompts_truncated": truncated,
        "prompt_tokens": sum(len(p) for p in prompt_ids), "response_tokens": resp_tokens,
        "tokens_per_s": resp_tokens / seconds if seconds > 0 else None, "generate_seconds": seconds,
        "finished_stop": sum(s["finish_reason"] == "stop" for s in samples) / len(samples),
        "backend": cfg.backend, "num_engines": cfg.num_engines})
