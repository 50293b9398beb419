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
softmax(logits / temperature), computed in chunks (rlhf_core.rl.logprobs), experience forwards in
micro_rollout_batch_size rows.

A batch is a dict of tensors over B sequences of width L (prompt + response, right padded):
ids, attn # (B, L); per-token quantities (log-probs, values, advantages, action mask) # (B, L - 1), where
column t belongs to token t + 1 (logits at t predict token t + 1).
"""
from __future__ import annotations

import os
import time

import torch

from rlhf_core.rl import losses, rl_math
from rlhf_core.ppo import node_store, weight_sync
from rlhf_core.ppo.forward import (experience, grouped_order, micro_batches, model_kwargs, rows_of, token_outputs,
                                   trimmed)
from rlhf_core.runtime import residency
from rlhf_core.runtime.devices import device, peak_memory_gb, to_device, to_host  # noqa: F401  (the roles' helpers)
from rlhf_core.train import adamw, compile_engine, deepspeed_options, no_lone_allreduce, schedule


class Learner:
    """One rank of the policy or critic group. `hp` holds the training settings (plain dict)."""

    def __init__(self, kind: str, rank: int, world: int):
        self.kind, self.rank, self.world = kind, rank, world

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on that node, for its group's rendezvous: rank 0 binds it, so the
        port is chosen here, on the host that binds it (not on the driver's)."""
        import ray

        from rlhf_core.runtime.jobs import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, model_dir: str, hp: dict, master_addr: str, master_port: int, total_steps: int) -> int:
        model_dir = node_store.local_model(model_dir)  # this node's copy
        if self.kind == "critic":  # an OpenRLHF-format reward model (backbone + value head) as the critic
            from rlhf_core.rollout.reward_model import check_reward_model, head_prefix, value_head_as_seq_cls

            prefix = head_prefix(model_dir, hp["value_head_prefix"])
            if check_reward_model(model_dir, prefix) == "value_head":
                model_dir = value_head_as_seq_cls(model_dir, prefix, node_store._rank_dir(self, "value-head", model_dir))
        self.pretrain: list[list[int]] | None = None
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
              "bf16": {"enabled": hp["bf16"], "check_grad_overflow": False}, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
        # check_grad_overflow (DeepSpeed 0.19.8 turns it on for bf16, its PR #6976): ZeRO-1/2 would scan every
        # gradient, wait on the host each step and skip a step with an inf / NaN gradient, which neither the bare
        # torch loop (clip_grad_norm_) nor older DeepSpeed releases did (issue 36; tests/.../test_learner_step.py)
        if hp["use_dynamic_batch"]:  # the learner marks each step's last micro-batch (OpenRLHF does the same)
            ds.update(train_batch_size=self.world, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
        if hp["adam_offload"]:  # ZeRO-Offload: fp32 master weights and Adam's moments in host memory
            ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        deepspeed_options(hp, ds)  # --overlap_comm, --deepcompile
        model = self.load_model(model_dir, hp, ds)
        lr = hp["actor_learning_rate"] if self.kind == "policy" else hp["critic_learning_rate"]
        if hp["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model_dir, self.hp = model_dir, hp
        if hp["deepspeed_enable_sleep"] and hp["zero_stage"] == 3:
            # ZeRO-3's offload_states moves the states of DeepSpeed's FusedAdam only (it asserts so), the optimizer
            # OpenRLHF trains with; AdamW all the same (on a host without CUDA DeepSpeed builds its CPU kernel once)
            from deepspeed.ops.adam import FusedAdam

            opt = FusedAdam(model.parameters(), lr=lr, betas=tuple(hp["adam_betas"]), weight_decay=hp["l2"],
                            adam_w_mode=True)
        else:
            opt = adamw([q for q in model.parameters() if q.requires_grad], lr, hp["adam_betas"], hp["l2"])  # LoRA: the adapter
        # OpenRLHF's get_scheduler(lr_scheduler, num_warmup_steps=ceil(steps x ratio), min_lr = lr x min_lr_ratio):
        # the trainers' schedule (transformers' formulas)
        warm = schedule.warmup_steps(hp["lr_warmup_ratio"], total_steps)
        name = hp.get("lr_scheduler", "cosine_with_min_lr")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule.lr_factor(name, s, warm, total_steps,
                                                                                    hp["min_lr_ratio"]))
        self.engine = compile_engine(no_lone_allreduce(deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                                            config=ds)[0]), hp)
        self.module, self.device = self.engine.module, self.engine.device
        self.forwarded_tokens = 0  # tokens through the model (padding included), for the padding count
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
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True,
                                                         **model_kwargs(hp, model_dir))
        else:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=dtype,
                                                                       use_safetensors=True, **model_kwargs(hp, model_dir))
        del zero3
        if hp.get("lora_rank"):  # LoRA RL: the adapters train, the weights stay frozen (the critic's head trains too)
            from rlhf_core.ppo.lora import lora_wrapped

            # kept to save the adapter; the model trained is its injected base
            self.peft = lora_wrapped(model, hp, "CAUSAL_LM" if self.kind == "policy" else "SEQ_CLS")
            model = self.peft.get_base_model()
        return model

    def param_elements(self) -> int:
        """Parameter elements this rank holds (its ZeRO-3 partitions, else every parameter)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.module.parameters())

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    def set_pretrain(self, rows: list[list[int]]) -> int:
        """PTX (OpenRLHF's --pretrain_data): the token ids of the pretrain rows this rank draws from."""
        self.pretrain = rows
        return len(rows)

    @torch.no_grad()
    def generate(self, *args, **kwargs) -> list[list[dict]]:
        """vllm_num_engines 0: policy rank 0 generates the rollouts with the model it trains (OpenRLHF without
        vLLM generates with the actor's own HF model), the engines' call (engines.HFRollout.generate)."""
        from transformers import AutoTokenizer

        from rlhf_core.inputs import models
        from rlhf_core.ppo.engines import HFRollout

        tok = AutoTokenizer.from_pretrained(self.model_dir)
        me = HFRollout.__new__(HFRollout)  # an engine over the trained module (its shared prefill included)
        me.model, me.device, me.pad_id = self.module, self.device, models.pad_id(tok, self.model_dir)
        me.eos_ids = set(models.eos_ids(tok, self.model_dir))
        self.module.eval()
        return me.generate(*args, **kwargs)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """Log-probs of the tempered policy (policy) or values (critic) # (B, L - 1) of this rank's shard, before
        the update, in experience micro-batches (micro_batches: micro_rollout_batch_size rows, OpenRLHF's
        experience micro-batches, or token-bounded with use_dynamic_batch)."""
        self.module.eval()
        return experience(batch, self.hp, self.device, lambda b, host: self._outputs(b, host=host)[0])

    def _outputs(self, b: dict, entropy: str | None = None, host: dict | None = None):
        lp, ent, n = token_outputs(self.module, b, self.kind, self.hp["temperature"], entropy,
                                   self.hp["packing_samples"], self.hp.get("shared_prompt", False), host)
        self.forwarded_tokens += n
        return lp, ent

    # ------------------------------------------------------------------ train
    def loss(self, b: dict, kl_loss_coef: float) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch `b` (moved to this rank's device here) and its detached metrics (on the device:
        `train` reads them once per call, so no micro-batch waits on the host). The layout work (prompt groups, packing,
        action columns) reads the CPU batch: on a GPU each value read from the device would be a host sync."""
        host, b = b, to_device(b, self.device)
        hp, mask = self.hp, b["mask"]
        agg, max_len, empty = hp["loss_agg"], hp["generate_max_len"], hp.get("loss_agg_empty_rows", "drop")
        if self.kind == "critic":
            v = self._outputs(b, host=host)[0]
            loss = rl_math.value_loss(v, b["old_values"], b["returns"], mask, hp["value_clip"], agg, empty)
            return loss, {"critic_loss": loss.detach()}
        lp, ent = self._outputs(b, "loss" if hp["entropy_loss_coef"] else "metric", host)
        reused = "old_logp" not in b  # on-policy single update: this forward is the old policy (loop.train)
        old = lp.detach() if reused else b["old_logp"]
        w = rl_math.rollout_is_weight(old, b["rollout_logp"], *hp["vllm_is_truncated_threshold"],
                                      hp["use_icepop"]) if hp["enable_vllm_is_correction"] else None
        loss, met = rl_math.policy_loss(lp, old, b["adv"], mask, hp["eps_clip_low"], hp["eps_clip_high"],
                                        hp["dual_clip"], agg, max_len, w, empty)
        met = {"policy_loss": loss.detach(), **met, "entropy": losses.reduce_tokens(ent.detach(), mask)}
        if reused and "rollout_logp" in b:
            met["rollout_logprob_gap"] = losses.reduce_tokens((b["rollout_logp"] - old).abs(), mask)
        if w is not None:
            met["is_weight"] = losses.reduce_tokens(w, mask)
            met["is_masked"] = losses.reduce_tokens((w == 0).float(), mask)
        if hp["use_kl_loss"]:
            kl = rl_math.kl_loss(lp, b["ref_logp"], mask, hp["kl_estimator"], hp.get("kl_loss_agg", "token"), max_len,
                                 empty)  # the token mean, as OpenRLHF, unless kl_loss_agg says otherwise
            loss = loss + kl_loss_coef * kl
            met["kl_loss"] = kl.detach()
        if hp["entropy_loss_coef"]:
            loss = loss - hp["entropy_loss_coef"] * rl_math.aggregate(ent, mask, agg, max_len, empty)
        if self.pretrain and hp["ptx_coef"] > 0:
            ptx = self.ptx_loss(b["ids"].shape[0])
            loss = loss + hp["ptx_coef"] * ptx
            met["ptx_loss"] = ptx.detach()
        return loss, met

    def ptx_loss(self, rows: int) -> torch.Tensor:
        """The NLL of `rows` pretrain rows, every token a target, averaged over the tokens (OpenRLHF v0.7's PPO-ptx,
        openrlhf/trainer/ray/ppo_actor.py training_step_actor: GPTLMLoss on a pretrain micro-batch; labels are the
        attended tokens). OpenRLHF runs a second backward of ptx_coef x ptx_loss before the same optimizer step;
        adding it to the loss of one backward gives the same gradient. Rows are drawn from a generator seeded
        by (seed, optimizer step, rank): a resumed run draws the same ones."""
        from rlhf_core.ppo.batches import collate

        if getattr(self, "_ptx_gen", None) is None:
            self._ptx_gen = torch.Generator().manual_seed(self.hp["seed"] + 7919 * int(self.engine.global_steps)
                                                          + 104729 * self.rank)
        pick = torch.randint(len(self.pretrain), (rows,), generator=self._ptx_gen).tolist()
        rows_ids = [self.pretrain[i] for i in pick]
        b = collate([r[:1] for r in rows_ids], [r[1:] for r in rows_ids], 0)  # mask: every token after the first
        host, b = b, to_device(b, self.device)
        lp = token_outputs(self.module, b, "policy", 1.0, None, self.hp["packing_samples"], host=host)[0]  # (B, L - 1)
        return -losses.reduce_tokens(lp, b["mask"])

    def _steps(self, batch: dict, order: torch.Tensor):
        """(micro-batch, loss scale, last of its optimizer step) in training order. Fixed micro-batches:
        micro_train_batch_size rows, DeepSpeed counts the steps and divides each loss by the accumulation steps.
        use_dynamic_batch (OpenRLHF's replay_buffer.setup_dynamic_batch): each optimizer step's rows
        (train_batch_size / world of them on this rank) in token-bounded micro-batches, each loss scaled by its
        share of the step's rows, so the step's gradient is the same row-weighted sum as with fixed
        micro-batches; the learner marks the last micro-batch as the step's boundary."""
        hp = self.hp
        if not hp["use_dynamic_batch"]:
            mb = hp["micro_train_batch_size"]
            for s in range(0, len(order), mb):
                yield rows_of(batch, order[s:s + mb]), 1.0, None
            return
        local = hp["train_batch_size"] // self.world
        for s in range(0, len(order), local):
            rows = rows_of(batch, order[s:s + local])
            mbs = micro_batches(rows, hp, rollout=False)
            for k, idx in enumerate(mbs):
                yield trimmed(rows_of(rows, idx)), len(idx) / rows["ids"].shape[0], k == len(mbs) - 1

    def train(self, batch: dict, kl_loss_coef: float) -> dict:
        """max_epochs passes over this rank's shard in micro-batches; one optimizer step per train_batch_size
        samples over all ranks. Returns mean metrics, the trained tokens per second, the padding tokens
        forwarded and this rank's peak memory."""
        hp, eng = self.hp, self.engine
        eng.train()
        n = batch["ids"].shape[0]
        g = torch.Generator().manual_seed(hp["seed"] + int(eng.global_steps))
        sums: dict[str, torch.Tensor] = {}  # on the device, float64: read once at the end (one host sync per call)
        count, tokens, t0, forwarded = 0, 0, time.perf_counter(), self.forwarded_tokens
        self._ptx_gen = None  # PTX rows of this call drawn from (seed, optimizer step, rank)
        for _ in range(hp["max_epochs"]):
            order = grouped_order(batch, g) if hp.get("shared_prompt") else torch.randperm(n, generator=g)  # whole groups
            for b, scale, boundary in self._steps(batch, order):  # b: CPU rows (the loss moves its own copy)
                loss, met = self.loss(b, kl_loss_coef)
                if boundary is not None:
                    eng.set_gradient_accumulation_boundary(boundary)
                eng.backward(loss * scale if scale != 1.0 else loss)
                eng.step()
                for k, val in met.items():
                    val = torch.as_tensor(val, device=self.device).detach().double()
                    sums[k] = sums[k] + val if k in sums else val
                count += 1
                tokens += int(b["attn"].sum())
        keys = list(sums)
        means = torch.stack([sums[k] for k in keys]).cpu().tolist() if keys else []
        out = {k: v / max(1, count) for k, v in zip(keys, means)}
        out[f"{self.kind}_lr"] = eng.get_lr()[0]
        out[f"{self.kind}_tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - t0)
        out[f"{self.kind}_padding_tokens"] = self.forwarded_tokens - forwarded - tokens
        out[f"{self.kind}_peak_mem_gb"] = peak_memory_gb()
        return out

    # ------------------------------------------------------------------ the hybrid engine
    def sleep(self) -> None:
        """deepspeed_enable_sleep: the optimizer states, fp32 master weights and gradient buffers to host memory
        (DeepSpeed's offload_states with OpenRLHF's list, deepspeed_utils.offload_deepspeed_states): the bf16
        weights stay, for the weight sync and the next forward. The driver calls it for generate and sync
        (rlhf_core.ppo.plan.role_states)."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

        cuda = self.device.type == "cuda"
        with residency.moving(to_host=True):
            self.engine.offload_states(include=[S.optim_states, S.contiguous_grad_buffer, S.hp_params, S.lp_grads],
                                       pin_memory=cuda, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        with residency.moving(to_host=False):
            self.engine.reload_states()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def holdings(self) -> dict:
        """Bytes of device memory this rank holds, by the memory plan's kinds, read from the tensors themselves
        (rlhf_core.runtime.residency: their device on a GPU; on a host without one, whether an offload moved them):
        weights (its parameters, its partitions under ZeRO-3), optimizer (fp32 masters, every tensor of the
        optimizer's state: Adam's moments and any buffer kept beside them), grads (gradients and DeepSpeed's
        gradient buffers). The weight sync's gathered bucket is held only inside its call (`held_inside`)."""
        opt = self.engine.optimizer
        params = list(self.module.parameters())
        masters = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", [])
        inner = getattr(opt, "optimizer", opt)
        states = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        buffers = [getattr(opt, n, None) for n in ("grads_in_partition", "grad_partitions_flat_buffer",
                                                   "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer")]
        buffers += list(getattr(opt, "ipg_buffer", None) or [])
        buffers += [b.buffer for b in getattr(opt, "ipg_buckets", {}).values() if getattr(b, "buffer", None) is not None]
        grads = [p.grad for p in params] + [m.grad for m in masters] + [
            g for gs in (getattr(opt, "averaged_gradients", None) or {}).values() for g in (gs or [])]
        return {"weights": residency.device_bytes(getattr(p, "ds_tensor", p) for p in params),
                "optimizer": residency.device_bytes([*masters, *states]),
                "grads": residency.device_bytes([*grads, *buffers])}

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
    """The frozen reference policy: per-token log-probs of the tempered policy only (in bf16 with `bf16`).

    One rank (ref_num_nodes x ref_num_gpus_per_node = 1) holds the whole model. Several ranks are ZeRO-3
    inference ranks (OpenRLHF's reference under --zero_stage 3): their own torch.distributed group, each
    parameter partitioned across them (built inside zero.Init, no optimizer), each rank forwarding its shard
    of the batch while gathering each layer's parameters from the others, so every rank runs the same number
    of micro-batches (micro_batches syncs the count). Several ranks start in `setup`, once the driver knows
    rank 0's address; one rank loads here. ref_reward_offload: between forwards the weights wait in host
    memory (one rank: the model moves; ZeRO-3: DeepSpeed's offload_param to the CPU)."""

    def __init__(self, model_dir: str, hp: dict, rank: int = 0, world: int = 1):
        self.hp, self.device, self.rank, self.world = hp, device(), rank, world
        self.model_dir = node_store.local_model(model_dir)
        self.dtype = torch.bfloat16 if hp["bf16"] else torch.float32
        if world == 1:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, use_safetensors=True,
                                                              **model_kwargs(hp, self.model_dir))
            self.model.to("cpu" if self._offload() else self.device).eval()

    def _offload(self) -> bool:
        return bool(self.hp.get("ref_reward_offload")) and self.device.type == "cuda"

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on that node, for its group's rendezvous: rank 0 binds it, so the
        port is chosen here, on the host that binds it (not on the driver's)."""
        import ray

        from rlhf_core.runtime.jobs import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the reference group and load this rank's partition of every parameter (world > 1)."""
        import deepspeed
        import deepspeed.ops
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        cuda = self.device.type == "cuda"
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0") if cuda else "0")
        if not cuda:
            deepspeed.ops.__dict__["__compatible_ops__"] = {}  # skip the 60-80 s shm op build (ENV-NOTES)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        zero = {"stage": 3, **({"offload_param": {"device": "cpu", "pin_memory": True}} if self._offload() else {})}
        ds = {"train_batch_size": self.world, "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "bf16": {"enabled": self.hp["bf16"]}, "steps_per_print": 10 ** 9}
        keep = HfDeepSpeedConfig(ds)  # noqa: F841  from_pretrained builds inside zero.Init while it lives
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, use_safetensors=True,
                                                     **model_kwargs(self.hp, self.model_dir))
        del keep
        self.model = deepspeed.initialize(model=model, config=ds)[0].module.eval()
        return self.rank

    def param_elements(self) -> int:
        """Parameter elements this rank holds (its ZeRO-3 partitions, else every parameter)."""
        return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.model.parameters())

    def holdings(self) -> dict:
        """Bytes of device memory by the memory plan's kinds, read from its tensors: its weights (partitions)."""
        return {"weights": residency.device_bytes(getattr(p, "ds_tensor", p) for p in self.model.parameters())}

    def peak_memory_gb(self) -> float:
        return peak_memory_gb()

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """Log-probs # (B, L - 1) of this rank's shard of the batch, in experience micro-batches."""
        moved = self._offload() and self.world == 1
        if moved:
            self.model.to(self.device)
        hp = self.hp
        out = experience(batch, hp, self.device, lambda b, host: token_outputs(
            self.model, b, "policy", hp["temperature"], packing=hp["packing_samples"],
            shared=hp.get("shared_prompt", False), host=host)[0])
        if moved:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        return out
