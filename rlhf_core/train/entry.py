"""The training child: `python -m rlhf_core.train.entry SPEC.json`, started by the deepspeed launcher
(or torchrun) from rlhf_core.train.launch. Generic over the training method (sft, rm, dpo, kto, ...): the
spec's `method` names a module of rlhf_core.train.methods, which says what model to load and how a
micro-batch becomes a loss and metrics (protocol in methods/__init__.py). The parent tokenized and validated
the data; this process trains, checkpoints every `save_steps` to the store, evaluates, saves the final model
(safetensors) and writes result.json.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from rlhf_core.rl import logprobs, losses
from rlhf_core.train import adamw, checkpoints, compile_engine, deepspeed_options, no_lone_allreduce, ring, schedule
from rlhf_core.runtime import faults, forkserver
from rlhf_core.train import attention
from rlhf_core.train import memory, moe
from rlhf_core.train.batches import BatchPlan, Tokens, collate, collate_pairs, seq_len
from rlhf_core.train.methods import get as get_method


# Tests: DeepSpeed's stage3_param_persistence_threshold (default 1e5 elements). ZeRO-3 keeps a tensor below it whole
# on every rank, which is every tensor of a tiny test model: 0 partitions them all, as a real model's are.
ZERO3_PERSISTENCE_ENV = "RLHF_FLOWS_TEST_ZERO3_PERSISTENCE"


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def init_distributed():
    """gloo on CPU, nccl on GPU. Outside a launcher, act as rank 0 of 1. DeepSpeed's shared-memory
    allreduce op is switched off on CPU: it JIT-compiles for 60-80 s and gloo is enough here."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from rlhf_core.runtime.jobs import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed
    import deepspeed.ops

    cuda = torch.cuda.is_available()
    if not cuda:
        deepspeed.ops.__dict__["__compatible_ops__"] = {}  # no op is built or probed (see docstring)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return deepspeed, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cuda


def _auto(method):
    """The transformers class and extra from_pretrained kwargs of a method's MODEL."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if method.MODEL == "reward_model":
        return AutoModelForSequenceClassification, {"num_labels": 1}
    return AutoModelForCausalLM, {}


def load_model(spec: dict, cuda: bool, method, ds_config: dict | None = None):
    """The method's model in the training dtype (QLoRA's 4-bit base, LoRA adapters). Under ZeRO-3 (ds_config)
    from_pretrained runs inside DeepSpeed's zero.Init: each parameter is partitioned as it is created, so no
    rank holds the whole model, at load time either. The switch is dropped after the load, so a method's
    setup hook (a frozen teacher) loads whole models again."""
    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    kwargs = {}
    zero3 = None
    if ds_config and spec["zero_stage"] == 3 and not spec.get("load_in_4bit"):
        from transformers.integrations import HfDeepSpeedConfig

        zero3 = HfDeepSpeedConfig(ds_config)  # transformers reads it (a weak reference) while this object lives
    if spec.get("load_in_4bit"):  # QLoRA (arXiv:2305.14314): frozen NF4 base, double quantization, LoRA on top
        if not cuda:
            raise SystemExit("load_in_4bit (QLoRA) needs a CUDA GPU; this host has none")
        from transformers import BitsAndBytesConfig

        kwargs = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype),
                  "device_map": {"": int(os.environ.get("LOCAL_RANK", "0"))}}
    auto, head = _auto(method)
    model = auto.from_pretrained(spec["model_dir"], dtype=dtype, use_safetensors=True, **head, **kwargs,
                                 attn_implementation=spec.get("attn_implementation", "sdpa"))
    del zero3
    if spec.get("use_liger_kernel"):  # Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) patched into this instance
        if not cuda:
            raise SystemExit("use_liger_kernel needs a CUDA GPU (Liger's kernels are Triton GPU kernels); this host has none")
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if spec.get("load_in_4bit"):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gradient_checkpointing"])
    elif spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec["lora_rank"] > 0:
        from peft import LoraConfig, get_peft_model

        task = "SEQ_CLS" if method.MODEL == "reward_model" else "CAUSAL_LM"
        model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"],
                                                 lora_dropout=spec["lora_dropout"], task_type=task,
                                                 target_modules=spec["target_modules"] or "all-linear"))
    return model


def _parts(model):
    """(backbone, LM head) of a causal LM (bare, PEFT-wrapped or inside a DeepSpeed engine), or None when its
    logits are not just head(hidden) (logit soft-capping or scaling): then the full forward is used."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = core.config.get_text_config()
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                              "output_multiplier", "lm_head_multiplier", "logits_scaling")):
        return None
    head = core.get_output_embeddings()
    return (getattr(core, core.base_model_prefix), head) if head is not None else None


def target_logits(engine, b) -> torch.Tensor:
    """The logits at every position of batch `b` that predicts a loss target, # (N, V) in b.targets() order.
    The LM head runs only on those positions (not on prompts or padding). `engine`: a DeepSpeed engine, or a
    bare model (the inline reference pass, a frozen teacher) on its device."""
    model = getattr(engine, "module", engine)
    dev = engine.device
    # use_cache: a KV cache is built by default even in training (transformers 5): work thrown away
    kw = {**attention.model_inputs(model, b, dev), "use_cache": False}
    rows, cols = (t.to(dev) for t in b.targets()[:2])
    parts = _parts(model)
    if parts is None:
        return engine(**kw).logits[rows, cols]  # (N, V)
    backbone, head = parts  # called inside the top module's forward: ZeRO-3 prefetches (logprobs.through_top)
    return logprobs.through_top(model, lambda: head(backbone(**kw).last_hidden_state[rows, cols]))  # (N, V)


def target_logps(engine, b) -> torch.Tensor:
    """log p(target) of every loss target of batch `b`, # (N,) in b.targets() order (log_softmax over the
    target rows only)."""
    return losses.gathered_logprobs(target_logits(engine, b), b.targets()[2].to(engine.device))


def batch_of(spec: dict, seqs: list[list[int]], starts: list[int], pad_id: int, pairs: bool = False):
    """Token lists -> a Batch. `pairs`: seqs are k chosen then k rejected of the same prompts, collated as k
    rows sharing the prompt (rlhf_core.train.batches.collate_pairs) unless packing_samples packs them or flash
    attention runs (its varlen kernel has no shared prefix: the pair's sequences go apart; attention.py).
    packing_samples packs into rows of at most spec["max_len"] tokens (batches.pack_rows; TRL's bins of
    max_length), except in one row where attention already stays within each sample (flash attention's varlen
    kernel reads a single row's position resets) or where ring attention splits the row over ranks."""
    flash = spec.get("attn_implementation", "sdpa").startswith("flash")
    if pairs and not spec["packing_samples"] and not flash:
        k = len(seqs) // 2
        b = collate_pairs(seqs[:k], starts[:k], seqs[k:], starts[k:], pad_id)
    else:
        one_row = flash or ring.size() > 1
        b = collate(seqs, starts, pad_id, packed=spec["packing_samples"], row_len=None if one_row else spec.get("max_len"))
        b = ring.local_batch(b, pad_id) if ring.size() > 1 else b  # this rank's slice of the packed row
    moe.note_tokens(b)  # its real tokens, for the MoE load-balancing loss (aux_loss_coef)
    return b


def forward(engine, spec: dict, seqs: list[list[int]], starts: list[int], pad_id: int, pairs: bool = False):
    """One LM forward over token lists: (summed target log-probs # (n,), target counts # (n,), its batches.Tokens).
    `pairs`: as batch_of. (A reward model's forward is rlhf_core.train.methods.rm.rewards.)"""
    b = batch_of(spec, seqs, starts, pad_id, pairs)
    dev = engine.device
    lp = target_logps(engine, b)
    sample = b.targets()[3].to(dev)
    zeros = torch.zeros(b.n, dtype=lp.dtype, device=dev)
    lp, n = zeros.index_add(0, sample, lp), zeros.index_add(0, sample, torch.ones_like(lp))
    if ring.size() > 1:  # each rank of the ring group holds its slice's part of every sample's sums
        lp, n = ring.sum_over_group(lp), ring.sum_over_group(n)
    return lp, n, b.tokens()


TOKEN_KEYS = ("tokens", "tokens_forwarded", "positions_forwarded")


def token_figures(t: Tokens) -> dict[str, int]:
    """A step's (or the run's) Tokens as the training log names them: `tokens` (each sample's own tokens: what
    tokens/s counts), `tokens_forwarded` (positions that hold a token: a pair's or a group's prompt once),
    `positions_forwarded` (padding included)."""
    return dict(zip(TOKEN_KEYS, (t.samples, t.forwarded, t.positions)))


def all_ranks(t: Tokens, tp: int, device) -> Tokens:
    """`t` summed over every rank of the job; tensor-parallel ranks forwarded the same tokens (counted once), the
    ranks of a ring group their own slices (summed). On the engine's device: NCCL reduces CUDA tensors only."""
    import torch.distributed as dist

    v = torch.tensor([t.samples, t.forwarded, t.positions], dtype=torch.float64, device=device)
    dist.all_reduce(v)
    return Tokens(*(round(x / tp) for x in v.tolist()))


def window_per_token(plan: BatchPlan, records: list[dict], step: int) -> float:
    """loss_token_mean=window (sft): the loss targets of optimizer step `step`'s whole batch (every micro-batch of
    every data-parallel rank) per micro-batch, N_window / M. DeepSpeed's accumulation takes the mean of the M
    micro-batch losses (each divided by the accumulation steps, then averaged over the ranks), so dividing each
    micro-batch's summed NLL by N_window / M makes the step's loss sum NLL / N_window: one token mean over the
    window (TRL's, transformers' num_items_in_batch), where the default divides each micro-batch by its own count.
    e.g. micro-batches of 3 + 2 and 4 + 1 targets: N_window 10, M 2 -> 5.0."""
    from rlhf_core.train.batches import loss_targets

    batch = plan.batch(step)
    n = sum(int(loss_targets(records[i]["start"], len(records[i]["ids"])).sum()) for i in batch)
    return n / math.ceil(len(batch) / plan.micro_batch_size)


def step_figures(parts: list[dict[str, torch.Tensor]], class_means: dict[str, str]) -> dict[str, float]:
    """The logged figures of one optimizer step from its micro-batches' per-example metrics `parts`: each metric's
    mean over the micro-batches of its per-micro-batch means, except a metric of `class_means` (the method's
    CLASS_MEANS: metric -> its 0/1 class metric), the mean over its class's examples (0.0 when the step has none).
    e.g. kto rewards [0.1, 0.3 | -0.2, 0.5], desirable [1, 0 | 1, 1]: desirable_reward 0.4 / 3 = 0.1333 (the mean
    of micro-batch means would give 0.4 / 4 = 0.1), undesirable_reward 0.3 / 1 = 0.3."""
    out: dict[str, float] = {}
    for met in parts:
        for k, v in met.items():
            out[k] = out.get(k, 0.0) + float(v.float().mean()) / len(parts)
    for k, cls in class_means.items():
        total, count = (sum(float(m[x].float().sum()) for m in parts) for x in (k, cls))
        out[k] = total / count if count else 0.0
    return out


def evaluate(engine, spec: dict, method, records: list[dict], rank: int, world: int, pad_id: int) -> dict:
    """The method's metrics over `records` (the training set after training, or the eval records during it),
    in eval mode (no dropout): each per-example metric of `method.step` summed over every record (all ranks),
    then `method.summarize(totals, n)`, or each metric's mean as `final_{name}` for a method without one (sft)."""
    import torch.distributed as dist

    sums: dict[str, float] = {}
    engine.eval()
    mb = spec["micro_train_batch_size"]
    with torch.no_grad():
        for j in range(math.ceil(len(records) / (world * mb))):  # as many forwards on every rank
            k = (j * world + rank) * mb
            if k >= len(records):  # ZeRO-3 gathers parameters collectively: this rank forwards, its metrics dropped;
                if spec["zero_stage"] == 3 or not sums:  # a rank without records forwards once for the metrics' names,
                    _, met, _ = method.step(engine, spec, records[:mb], pad_id)  # else its all-reduce below is empty
                    sums |= {name: sums.get(name, 0.0) for name in met}
                continue
            _, met, _ = method.step(engine, spec, records[k:k + mb], pad_id)
            for name, v in met.items():
                sums[name] = sums.get(name, 0.0) + float(v.sum())
    names = sorted(sums)
    t = torch.tensor([sums[n] for n in names], dtype=torch.float64, device=engine.device)  # NCCL: CUDA tensors only
    dist.all_reduce(t)
    t /= dist.get_world_size() // world  # the ranks of a ring / tensor-parallel group evaluated the same records
    engine.train()
    totals = dict(zip(names, t.tolist()))
    if hasattr(method, "summarize"):
        return method.summarize(totals, len(records))
    return {f"final_{k}": v / len(records) for k, v in totals.items()}


def last_epoch(history: list[dict], method, steps_per_epoch: int, samples_per_step: int) -> dict:
    """The method's `final_*` figures without another pass over the training set: its summarize over the last
    epoch's steps as this rank trained them (each step's per-example means x its samples), the figures the
    progress lines showed. A forward over the whole training set after training would cost a third of an
    epoch (a DPO stage at 57M parameters: about 12 s of a 46 s loop); TRL and OpenRLHF log training metrics
    the same way and measure held-out data with an eval set (eval_dataset / eval_holdout). A method whose
    saved model needs the pass says FINAL_PASS = True (rm: the reward statistics the score stage uses)."""
    steps = history[-steps_per_epoch:]
    if not steps or not hasattr(method, "summarize"):
        return {}
    keys = [k for k in steps[-1] if k not in ("step", "samples", "lr") and not k.startswith("eval_")]
    weight = getattr(method, "CLASS_MEANS", {})  # a class mean x its class's share: the class's sum per example
    totals = {k: sum(h[k] * (h[weight[k]] if k in weight else 1) for h in steps) * samples_per_step for k in keys}
    return method.summarize(totals, len(steps) * samples_per_step)


def eval_metrics(final: dict) -> dict:
    """evaluate()'s `final_*` figures renamed `eval_*` (held-out): eval_loss, eval_reward_accuracy, ... The other
    keys (RM's normalisation statistics, PRM's step count) describe the data, not the model's quality."""
    return {f"eval_{k[len('final_'):]}": v for k, v in final.items() if k.startswith("final_")}


def disable_dropout(model) -> int:
    """Every dropout probability of the model set to 0, as TRL's disable_dropout_in_model (its default for DPO,
    reward and KTO training: dropout makes the policy's log-probs noisy beside the reference's, computed
    without it). nn.Dropout modules, float attributes such as the attention's `attention_dropout` (applied
    functionally in the attention kernel) and the config's fields (saved in config.json). LoRA's dropout is
    its own setting (lora_dropout) and stays. Returns how many values were zeroed."""
    n = 0
    for name, m in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.p, n = 0.0, n + 1
        for k, v in vars(m).items():
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0:
                setattr(m, k, 0.0)
                n += 1
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cfg in {id(c): c for c in (core.config, core.config.get_text_config())}.values():
        for k, v in cfg.to_diff_dict().items():
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0:
                setattr(cfg, k, 0.0)
                n += 1
    return n


def save_final(engine, spec: dict, method, rank: int, extra_config: dict, out: Path | None = None) -> None:
    """save_pretrained (safetensors) + tokenizer into `out` (default the job's model folder); ZeRO-3 weights
    gathered. LoRA: the adapter in adapter/ (under ZeRO-3 only its weights are gathered: no rank holds the
    whole model) and, with lora_merge, the merged model at the root (adapter_merged)."""
    from transformers import AutoTokenizer

    out = out or Path(spec["work_dir"]) / "model"
    model = getattr(engine, "module", engine)  # a DeepSpeed engine, or a bare model (inline reference pass)
    if spec["lora_rank"] > 0:
        sd = gathered_trainable(model, rank)  # all ranks take part; rank 0 keeps it
    else:
        sharded = spec["zero_stage"] == 3 or spec.get("ds_tensor_parallel_size", 1) > 1  # ZeRO-3 or AutoTP shards
        sd = engine._consolidated_16bit_state_dict() if sharded else None  # all ranks take part; rank 0 keeps it
    if rank != 0:
        return
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    for k, v in extra_config.items():
        setattr(core.config, k, v)
    if spec["lora_rank"] > 0:
        model.save_pretrained(str(out / "adapter"), state_dict=sd, safe_serialization=True)
        if spec["lora_merge"]:
            adapter_merged(spec, method, out, core.config).save_pretrained(str(out), safe_serialization=True)
    else:
        model.save_pretrained(str(out), state_dict=sd, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    if spec.get("tokenizer_chat_template"):
        tok.chat_template = spec["tokenizer_chat_template"]
    tok.save_pretrained(str(out))


def gathered_trainable(model, rank: int) -> dict | None:
    """{name: CPU tensor} of every trainable parameter (a LoRA run: the adapter, and a reward model's score head)
    on rank 0, None elsewhere; every rank must call it. Under ZeRO-3 each module's trainable parameters are
    gathered in turn (deepspeed.zero.GatheredParameters), the frozen base never: one module's adapter at a time
    beyond the partitions. Without ZeRO-3 the parameters are whole already (the gather does nothing)."""
    import deepspeed

    out: dict = {}
    for prefix, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):  # read-only
            if rank == 0:
                out |= {f"{prefix}.{n}" if prefix else n: p.detach().to("cpu", copy=True) for n, p in own}
    return out if rank == 0 else None


def adapter_merged(spec: dict, method, out: Path, config):
    """lora_merge: the base as it is on disk with the adapter saved in out/adapter merged into it (peft's
    merge_and_unload, W + (alpha / r) * B @ A: the lora_combine stage's merge), carrying the trained model's
    `config` (disabled dropout, a method's saved figures). The base is frozen, so this is the trained model;
    building it apart leaves the training model as it was (save_hf_ckpt saves mid-run), needs no whole model on
    any rank under ZeRO-3 and merges into unquantized weights under QLoRA. Rank 0 holds one copy of the model
    on CPU meanwhile, as a ZeRO-3 full save gathers one."""
    from peft import PeftModel

    auto, head = _auto(method)
    base = auto.from_pretrained(spec["model_dir"], dtype=torch.bfloat16 if spec["bf16"] else torch.float32,
                                use_safetensors=True, **head)
    merged = PeftModel.from_pretrained(base, str(out / "adapter")).merge_and_unload()
    kept = config.to_dict()
    kept.pop("quantization_config", None)  # QLoRA's base was 4-bit for training; the merged weights are not
    merged.config = type(config).from_dict(kept)
    return merged


def _tracker(spec: dict, history: list[dict]):
    """Rank 0's live TensorBoard / W&B writer into work_dir/tracking, which the stage uploads into the artifact.
    A job restarted from a checkpoint rewrites the folder from the restored history first: every step once."""
    from rlhf_core.runtime.tracking import Tracker

    t = spec["tracking"]
    shutil.rmtree(Path(spec["work_dir"]) / "tracking", ignore_errors=True)
    tracker = Tracker(Path(spec["work_dir"]) / "tracking", tensorboard=t["tensorboard"], wandb=t["wandb"],
                      prefix=spec["method"], project=t["project"], run_name=t["run_name"], run_id=spec["fingerprint"][:32],
                      config=t["config"])
    for h in history:
        tracker.log(h)
    return tracker


def job_spec(ref: str) -> dict:
    """The job spec and this rank's local copies of what it names. The spec lives on the store: a rank whose
    cache (RLHF_FLOWS_CACHE) is the launching host's uses the files the stage prepared there; a rank on
    another node (multi-node without a shared disk) fetches the data, the model and the checkpoint to resume
    from into its own cache: no node needs a path of another. Rank 0 must run on the launching host (the
    first hostfile entry / node_rank 0), where the stage reads the trained model from `work_dir`."""
    from rlhf_core.inputs import model_inputs
    from rlhf_core import store

    if "://" not in ref and Path(ref).exists():  # a local spec (debugging: python -m ... SPEC.json)
        return json.loads(Path(ref).read_text())
    fs, path = store.filesystem(ref)
    spec = json.loads(fs.cat_file(path))
    if str(store.cache_root()) == spec["launch_cache"]:
        return spec
    so = spec.get("storage_options")
    local = store.cache_root() / "jobs" / spec["fingerprint"] / f"rank-{os.environ.get('RANK', '0')}"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    dfs, dpath = store.filesystem(spec["data_uri"], so)
    dfs.get_file(dpath, str(local / "data.parquet"))
    spec["data_path"], spec["local_dir"] = str(local / "data.parquet"), str(local)
    spec["model_dir"] = str(model_inputs.fetch_model(spec["model_uri"], so))
    if spec.get("eval_uri"):
        dfs, dpath = store.filesystem(spec["eval_uri"], so)
        dfs.get_file(dpath, str(local / "eval.parquet"))
        spec["eval_path"] = str(local / "eval.parquet")
    if spec.get("resume"):
        spec["resume_dir"] = str(checkpoints.download(spec["resume"], local / "resume", so))
    return spec


def save_checkpoint(engine, spec: dict, step: int, history: list, rank: int, world: int) -> None:
    """Every rank saves into its own local folder and uploads its own files (its ZeRO shards; rank 0 also
    the module states); rank 0 then commits the marker naming every rank's files."""
    import torch.distributed as dist

    tag = f"step-{step}"
    local = Path(spec.get("local_dir") or spec["work_dir"]) / f"ckpt-out-rank{rank}"
    (local / tag).mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(local), tag=tag, client_state={
        "step": step, "history": history, "rng": torch.get_rng_state().tolist()}, save_latest=False)
    mine = checkpoints.upload_files(local / tag, spec["ckpt_uri"], tag, spec.get("storage_options"))
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    if rank == 0:
        uri = checkpoints.commit(spec["ckpt_uri"], tag, spec["fingerprint"], [f for p in parts for f in p],
                                 {"step": step}, spec.get("storage_options"), spec.get("max_ckpt_num", 1))
        print(f"checkpoint {uri}", flush=True)
    shutil.rmtree(local / tag, ignore_errors=True)
    dist.barrier()


def save_hf(engine, spec: dict, method, rank: int, step: int) -> None:
    """save_hf_ckpt (OpenRLHF's {ckpt_path}/{tag}_hf): the model at `step` as an HF folder, written as the final
    model is (every rank gathers under ZeRO-3), uploaded by rank 0 to {hf_uri}/step-N/ (the stage records those
    files in the artifact at its commit)."""
    import torch.distributed as dist

    from rlhf_core import store

    local = Path(spec.get("local_dir") or spec["work_dir"]) / f"hf-step-{step}"
    save_final(engine, spec, method, rank, {}, out=local)
    if rank == 0:
        fs, root = store.filesystem(spec["hf_uri"], spec.get("storage_options"))
        for p in sorted(local.rglob("*")):
            if p.is_file():
                dest = store.join(root, f"step-{step}", p.relative_to(local).as_posix())
                store.check_fence()
                fs.makedirs(fs._parent(dest), exist_ok=True)
                fs.put_file(str(p), dest)
        print(f"hf checkpoint {spec['hf_uri']}/step-{step}", flush=True)
        shutil.rmtree(local, ignore_errors=True)
    dist.barrier()


def main(spec_ref: str) -> None:
    spec = job_spec(spec_ref)
    if spec.get("fence"):  # the run lock of the flow that launched us, also on nodes that did not inherit its env
        from rlhf_core import store

        os.environ.setdefault(store.FENCE_ENV, spec["fence"])
    deepspeed, rank, world, cuda = init_distributed()
    import pyarrow.parquet as pq
    import torch.distributed as dist

    # ring attention: the ranks of a group of ring_attn_size share each micro-batch (rlhf_core.train.ring);
    # drank / dworld: this rank's place among the data-parallel ranks, which draw different micro-batches
    # and DeepSpeed AutoTP: the ranks of a group of ds_tensor_parallel_size hold slices of each weight
    tp = spec.get("ds_tensor_parallel_size", 1)
    drank, dworld = (ring.setup(rank, world, spec["ring_attn_size"], spec["ring_head_stride"], spec["method"])
                     if spec.get("ring_attn_size", 1) > 1 else (rank // tp, world // tp))
    torch.manual_seed(spec["seed"])
    records = pq.read_table(spec["data_path"]).to_pylist()
    plan = BatchPlan([seq_len(r) for r in records], spec["train_batch_size"], spec["micro_train_batch_size"], dworld,
                     spec["seed"], spec["max_epochs"], spec["length_bucketing"])
    total = plan.total_steps
    method = get_method(spec["method"])
    zero = {"stage": spec["zero_stage"]}
    if spec["zero_stage"] == 3 and os.environ.get(ZERO3_PERSISTENCE_ENV):
        zero["stage3_param_persistence_threshold"] = int(os.environ[ZERO3_PERSISTENCE_ENV])
    if spec["adam_offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    ds_config = {"train_batch_size": spec["train_batch_size"] * (world // dworld),  # DeepSpeed counts every rank as data-parallel
                 "train_micro_batch_size_per_gpu": spec["micro_train_batch_size"],
                 "gradient_clipping": spec["max_norm"], "zero_optimization": zero, "bf16": {"enabled": spec["bf16"]},
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9,
                 "wall_clock_breakdown": False}
    if tp > 1:  # DeepSpeed shards the linear layers when the engine is built (AutoTP training, deepspeed >= 0.16.4)
        ds_config["tensor_parallel"] = {"autotp_size": tp}
    deepspeed_options(spec, ds_config)  # --overlap_comm, --deepcompile
    with memory.AnonPeak() as load_peak:  # this rank's memory during the load (a ZeRO-3 rank: its shard)
        model = load_model(spec, cuda, method, ds_config)
    load_memory: list = [None] * world
    dist.all_gather_object(load_memory, {"rank": rank, **memory.load_report(model, load_peak.growth)})
    if ring.size() > 1:
        ring.use_ring_attention(model)
    if spec.get("aux_loss_coef"):  # MoE: the router's load-balancing loss joins every step's loss
        method = moe.with_aux_loss(method, model, spec["aux_loss_coef"])
    if spec.get("disable_dropout"):
        _say(rank, f"dropout off: {disable_dropout(model)} dropout values set to 0")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, spec["learning_rate"], spec["adam_betas"], spec["l2"])
    warm = schedule.warmup_steps(spec["lr_warmup_ratio"], total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule.lr_factor(
        spec.get("lr_scheduler", "cosine_with_min_lr"), s, warm, total, spec["min_lr_ratio"]))
    engine = no_lone_allreduce(deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)[0])
    compile_engine(engine, spec)
    pad_id = spec["pad_id"]
    if hasattr(method, "setup"):  # e.g. a frozen teacher the method's step forwards
        spec = {**spec, **method.setup(engine, spec)}

    start, history = 0, []
    if spec.get("resume_dir"):
        d = Path(spec["resume_dir"])
        _, client = engine.load_checkpoint(str(d.parent), tag=d.name, load_module_strict=False)
        start, history = client["step"], client["history"]
        torch.set_rng_state(torch.tensor(client["rng"], dtype=torch.uint8))
        _say(rank, f"resumed from checkpoint {spec['resume_uri']} at step {start}/{total}")
    tracker = _tracker(spec, history) if rank == 0 and spec.get("tracking") else None
    eval_records = pq.read_table(spec["eval_path"]).to_pylist() if spec.get("eval_path") else []
    eval_every = spec["eval_steps"] if spec.get("eval_steps") not in (None, -1) else plan.steps_per_epoch  # -1: each epoch's end
    _say(rank, f"training {spec['method']}: {len(records)} samples, {total} steps, world size {world}"
         + (f", {len(eval_records)} eval samples every {eval_every} steps" if eval_records else ""))
    engine.train()  # from_pretrained returns eval mode: dropout and gradient checkpointing act only in train mode
    t0, tokens_done = time.time(), Tokens()
    for step in range(start, total):
        faults.pause_step(spec.get("step_sleep") or 0.0)  # tests slow a job to kill it mid-run (runtime.faults)
        parts, step_tokens = [], Tokens()
        lr = sched.get_last_lr()[0]  # this step's lr (the engine's step moves the schedule on)
        step_spec = {**spec, "window_per_token": window_per_token(plan, records, step)} \
            if spec.get("loss_token_mean") == "window" else spec
        for mb in plan.micro_batches(step, drank):
            loss, met, ntok = method.step(engine, step_spec, [records[i] for i in mb], pad_id)
            engine.backward(loss)
            engine.step()
            step_tokens += ntok
            parts.append(met)
        step_tokens = all_ranks(step_tokens, tp, engine.device)
        tokens_done += step_tokens
        acc = step_figures(parts, getattr(method, "CLASS_MEANS", {}))
        history.append({"step": step + 1, "samples": plan.batch(step), "lr": lr, **acc, **token_figures(step_tokens)})
        if tracker:
            tracker.log(history[-1])
        if rank == 0 and ((step + 1) % spec["log_steps"] == 0 or step + 1 == total):
            from rlhf_core.runtime.progress import eta

            took = time.time() - t0
            print("step %d/%d " % (step + 1, total) + " ".join(f"{k}={v:.4f}" for k, v in acc.items())
                  + f" tokens={history[-1]['tokens']} forwarded={history[-1]['tokens_forwarded']}"
                  + f" tokens/s={tokens_done.samples / max(took, 1e-9):.0f} eta={eta(took / (step + 1 - start) * (total - step - 1))}",
                  flush=True)
        if eval_records and ((step + 1) % eval_every == 0 or step + 1 == total):
            ev = eval_metrics(evaluate(engine, spec, method, eval_records, drank, dworld, pad_id))
            history[-1].update(ev)  # in the checkpoint's history: a resumed job neither repeats nor loses it
            if tracker:
                tracker.log({"step": step + 1, **ev})
            _say(rank, f"eval step {step + 1}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()))
        if spec["save_steps"] and (step + 1) % spec["save_steps"] == 0 and step + 1 < total:
            if spec.get("hf_uri"):  # save_hf_ckpt: the model now as an HF folder, kept in the artifact; written before
                save_hf(engine, spec, method, rank, step + 1)  # the checkpoint commits, so a job killed between the
            save_checkpoint(engine, spec, step + 1, history, rank, world)  # two redoes the folder on resume
    train_s = time.time() - t0
    if tracker:
        tracker.close()
    final = (evaluate(engine, spec, method, records, drank, dworld, pad_id) if getattr(method, "FINAL_PASS", False)
             else last_epoch(history, method, plan.steps_per_epoch, spec["train_batch_size"] // dworld))
    save_final(engine, spec, method, rank, method.saved_config(final, spec) if hasattr(method, "saved_config") else {})
    if rank == 0:
        seen = [i for h in history for i in h["samples"]]
        result = {"steps_done": len(history) and history[-1]["step"], "planned_steps": total, "samples_seen": len(seen),
                  "resumed_from_step": start, "tokens_per_s": tokens_done.samples / max(train_s, 1e-9) if total > start else 0.0,
                  **{k: sum(h.get(k, 0) for h in history) for k in TOKEN_KEYS},  # a resumed job's earlier steps too
                  "train_seconds": train_s, "history": history, "load_memory": load_memory, **final}
        result |= next(({k: v for k, v in h.items() if k.startswith("eval_")} for h in reversed(history)
                        if any(k.startswith("eval_") for k in h)), {})  # the last evaluation's figures
        for k in (k for k in (history[0] if history else {}) if k not in ("step", "samples", "lr", *TOKEN_KEYS) and not k.startswith("eval_")):
            result[f"first_{k}"], result[f"last_{k}"] = history[0][k], history[-1][k]
        (Path(spec["work_dir"]) / "result.json").write_text(json.dumps(result))
        print(f"done: {result['steps_done']}/{total} steps, {result['samples_seen']} samples", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    forkserver.leave(0)  # done: without the interpreter's teardown, where gloo's threads can abort a finished rank
