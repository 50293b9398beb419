"""The Ray roles of online RL. Each class is plain Python (usable in-process) and becomes a Ray actor with
`ray.remote(cls)`; the driver (rlhf_core.ppo.loop) places them and moves experience between them.

  Learner     a DeepSpeed engine inside a Ray actor: the policy ("actor" in OpenRLHF's words) or the critic.
              `world` Learners of one kind form a torch.distributed group (gloo on CPU, nccl on GPU) and
              train data-parallel on shards of each batch.
  Reference   the frozen reference policy, forward only (per-token log-probs for the KL term).
(The rollout engines are in engines.py, the weight path into them in weight_sync.py, what each node reads from
and writes to the store in node_store.py.)

Device and dtype: every role's model lives on `device()` (the GPU Ray reserved for the actor, else the CPU)
in bf16 when `bf16` is set; every batch arrives from Ray on the CPU and goes to that device first
(`to_device`), every result goes back to the CPU (`to_host`). Log-probs and entropy are of the tempered policy
softmax(logits / temperature), computed in chunks (rlhf_core.logprobs), experience forwards in
micro_rollout_batch_size rows.

A batch is a dict of tensors over B sequences of width L (prompt + response, right padded):
ids, attn # (B, L); per-token quantities (log-probs, values, advantages, action mask) # (B, L - 1), where
column t belongs to token t + 1 (logits at t predict token t + 1).
"""
from __future__ import annotations

import math
import os
import time

import torch

from rlhf_core import logprobs, losses, rl_math
from rlhf_core.ppo import node_store, weight_sync
from rlhf_core.train import adamw, no_lone_allreduce


def device() -> torch.device:
    """The device a role's model lives on: the GPU Ray gave this actor (it sees only its own), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(batch: dict, dev) -> dict:
    """Every tensor of `batch` on `dev` (batches arrive from Ray as CPU tensors)."""
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A result for the driver: detached, on the CPU. A `meta` tensor (the device tests run models on meta,
    which holds shapes but no values) comes back as zeros of its shape and dtype."""
    if x.device.type == "meta":
        return torch.zeros(x.shape, dtype=x.dtype)
    return x.detach().cpu()


def peak_memory_gb() -> float:
    """This process's peak memory: the GPU allocator's on CUDA, else the peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def policy_logprobs(model, batch: dict, temperature: float = 1.0, entropy: str | None = None):
    """Per-token log-probs # (B, L - 1) of the tempered policy at the action columns (`mask`; all columns
    without one), and entropy # (B, L - 1) or None (rlhf_core.logprobs: no (B, L, V) fp32 tensor)."""
    return logprobs.token_logprobs(model, batch["ids"], batch["attn"], batch.get("mask"), temperature, entropy)


def critic_values(model, batch: dict) -> torch.Tensor:
    """Per-token values # (B, L - 1) from a sequence-classification model's score head applied to every
    hidden state: the value of the state before token t + 1 sits in column t, as the log-probs do."""
    core = getattr(model, model.base_model_prefix)
    h = core(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).last_hidden_state  # (B, L, H)
    return model.score(h).squeeze(-1)[:, :-1].float()


def _rows(batch: dict, idx) -> dict:
    return {k: v[idx] for k, v in batch.items()}


def _micro_batches(batch: dict, size: int):
    n = batch["ids"].shape[0]
    for s in range(0, n, size or n):
        yield {k: v[s:s + (size or n)] for k, v in batch.items()}


class Learner:
    """One rank of the policy or critic group. `hp` holds the training settings (plain dict)."""

    def __init__(self, kind: str, rank: int, world: int):
        self.kind, self.rank, self.world = kind, rank, world

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def setup(self, model_dir: str, hp: dict, master_addr: str, master_port: int, total_steps: int) -> int:
        model_dir = node_store.local_model(model_dir)  # this node's copy
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0" if not torch.cuda.is_available() else os.environ.get("LOCAL_RANK", "0"))
        import deepspeed
        import deepspeed.ops

        cuda = torch.cuda.is_available()
        if not cuda:
            deepspeed.ops.__dict__["__compatible_ops__"] = {}  # skip the 60-80 s shm op build (ENV-NOTES)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        torch.manual_seed(hp["seed"] + self.rank)
        ds = {"train_batch_size": hp["train_batch_size"], "train_micro_batch_size_per_gpu": hp["micro_train_batch_size"],
              "gradient_clipping": hp["max_norm"], "zero_optimization": {"stage": hp["zero_stage"]},
              "bf16": {"enabled": hp["bf16"]}, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
        model = self.load_model(model_dir, hp, ds)
        lr = hp["actor_learning_rate"] if self.kind == "policy" else hp["critic_learning_rate"]
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
        self.engine = no_lone_allreduce(deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)[0])
        self.module, self.device = self.engine.module, self.engine.device
        return self.rank

    def load_model(self, model_dir: str, hp: dict, ds: dict):
        """The policy (causal LM) or critic (scalar head) in the training dtype. Under ZeRO-3, inside DeepSpeed's
        zero.Init (HfDeepSpeedConfig): each parameter is partitioned as it is created, so no rank ever holds the
        whole model, at load time either."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        dtype = torch.bfloat16 if hp["bf16"] else torch.float32
        zero3 = None
        if hp["zero_stage"] == 3:
            from transformers.integrations import HfDeepSpeedConfig

            zero3 = HfDeepSpeedConfig(ds)  # transformers reads it (a weak reference) while this object lives
        if self.kind == "policy":
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=dtype,
                                                                       use_safetensors=True)
        del zero3
        return model

    def param_elements(self) -> int:
        """Parameter elements this rank holds (its ZeRO-3 partitions, else every parameter)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.module.parameters())

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """Log-probs of the tempered policy (policy) or values (critic) # (B, L - 1) of this rank's shard, before
        the update, micro_rollout_batch_size rows at a time (OpenRLHF's experience micro-batches)."""
        self.module.eval()
        outs = []
        for b in _micro_batches(batch, self.hp["micro_rollout_batch_size"]):
            b = to_device(b, self.device)
            out = policy_logprobs(self.module, b, self.hp["temperature"])[0] if self.kind == "policy" \
                else critic_values(self.module, b)
            outs.append(to_host(out.float()))
        return torch.cat(outs)

    # ------------------------------------------------------------------ train
    def loss(self, b: dict, kl_loss_coef: float) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch `b` (moved to this rank's device here) and its detached metrics."""
        b = to_device(b, self.device)
        hp, mask = self.hp, b["mask"]
        agg, max_len = hp["loss_agg"], hp["generate_max_len"]
        if self.kind == "critic":
            v = critic_values(self.module, b)
            loss = rl_math.value_loss(v, b["old_values"], b["returns"], mask, hp["value_clip"], agg)
            return loss, {"critic_loss": loss.detach()}
        lp, ent = policy_logprobs(self.module, b, hp["temperature"], "loss" if hp["entropy_loss_coef"] else "metric")
        reused = "old_logp" not in b  # on-policy single update: this forward is the old policy (loop.train)
        old = lp.detach() if reused else b["old_logp"]
        w = rl_math.rollout_is_weight(old, b["rollout_logp"], *hp["vllm_is_truncated_threshold"],
                                      hp["use_icepop"]) if hp["enable_vllm_is_correction"] else None
        loss, met = rl_math.policy_loss(lp, old, b["adv"], mask, hp["eps_clip_low"], hp["eps_clip_high"],
                                        hp["dual_clip"], agg, max_len, w)
        met = {"policy_loss": loss.detach(), **met, "entropy": losses.reduce_tokens(ent.detach(), mask)}
        if reused and "rollout_logp" in b:
            met["rollout_logprob_gap"] = losses.reduce_tokens((b["rollout_logp"] - old).abs(), mask)
        if w is not None:
            met["is_weight"] = losses.reduce_tokens(w, mask)
            met["is_masked"] = losses.reduce_tokens((w == 0).float(), mask)
        if hp["use_kl_loss"]:
            kl = rl_math.aggregate(rl_math.kl_estimate(lp, b["ref_logp"], hp["kl_estimator"]), mask, agg, max_len)
            loss = loss + kl_loss_coef * kl
            met["kl_loss"] = kl.detach()
        if hp["entropy_loss_coef"]:
            loss = loss - hp["entropy_loss_coef"] * rl_math.aggregate(ent, mask, agg, max_len)
        return loss, met

    def train(self, batch: dict, kl_loss_coef: float) -> dict:
        """max_epochs passes over this rank's shard in micro-batches; one optimizer step per train_batch_size
        samples over all ranks (DeepSpeed accumulates). Returns mean metrics, the trained tokens per second and
        this rank's peak memory."""
        hp, eng = self.hp, self.engine
        eng.train()
        n, mb = batch["ids"].shape[0], hp["micro_train_batch_size"]
        g = torch.Generator().manual_seed(hp["seed"] + int(eng.global_steps))
        sums: dict[str, float] = {}
        count, tokens, t0 = 0, 0, time.perf_counter()
        for _ in range(hp["max_epochs"]):
            order = torch.randperm(n, generator=g)
            for s in range(0, n, mb):
                b = _rows(batch, order[s:s + mb])
                loss, met = self.loss(b, kl_loss_coef)
                eng.backward(loss)
                eng.step()
                for k, val in met.items():
                    sums[k] = sums.get(k, 0.0) + float(val)
                count += 1
                tokens += int(b["attn"].sum())
        out = {k: v / max(1, count) for k, v in sums.items()}
        out[f"{self.kind}_lr"] = eng.get_lr()[0]
        out[f"{self.kind}_tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - t0)
        out[f"{self.kind}_peak_mem_gb"] = peak_memory_gb()
        return out

    # ------------------------------------------------------------------ weights and checkpoints
    def _gathered(self):
        """A context in which module.state_dict() holds every full parameter (all ranks gather under ZeRO-3)."""
        from contextlib import nullcontext

        if self.hp["zero_stage"] != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)

    def _full_state_dict(self) -> dict:
        """A CPU copy of the full state_dict."""
        with self._gathered():
            return {k: v.detach().cpu().clone() for k, v in self.engine.module.state_dict().items()}

    def publish_weights(self) -> list:
        return weight_sync.publish(self)

    def weight_sync(self, name: str, *args, **kwargs):
        """Run rlhf_core.ppo.weight_sync.<name>(this learner, ...) in this actor: the learner's end of the weight
        path lives beside the engines' end."""
        return getattr(weight_sync, name)(self, *args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        return node_store.save_checkpoint(self, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        return node_store.load_checkpoint(self, *args, **kwargs)

    def save_model(self, *args, **kwargs):
        return node_store.save_model(self, *args, **kwargs)


class Reference:
    """The frozen reference policy: per-token log-probs of the tempered policy only (in bf16 with `bf16`)."""

    def __init__(self, model_dir: str, hp: dict):
        from transformers import AutoModelForCausalLM

        self.hp, self.device = hp, device()
        model_dir = node_store.local_model(model_dir)
        dtype = torch.bfloat16 if hp["bf16"] else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
        self.model.to(self.device).eval()

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        return torch.cat([to_host(policy_logprobs(self.model, to_device(b, self.device), self.hp["temperature"])[0])
                          for b in _micro_batches(batch, self.hp["micro_rollout_batch_size"])])
