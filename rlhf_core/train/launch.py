"""Parent side of a training stage: shared config fields, input loading, and `train_and_commit`, which
launches rlhf_core.train.entry under DeepSpeed, checks the child reached its planned step count, and only
then uploads the model and commits the manifest (a run that stops short is never committed)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, field_validator, model_validator

from rlhf_core.inputs import data, models
from rlhf_core.runtime import faults, jobs
from rlhf_core import store
from rlhf_core.train import attention, checkpoints

log = logging.getLogger("rlhf_flows")


class TrainingIncomplete(RuntimeError):
    pass


class TrainFields(BaseModel):
    """Training keys shared by sft / train_rm / dpo, named as OpenRLHF's CLI flags."""

    dataset_uri: str = Field(description="Committed artifact, or raw source(s) 'a.jsonl,b.parquet' (OpenRLHF --dataset).")
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template replacing the tokenizer's "
                                                "(OpenRLHF --tokenizer_chat_template); saved with the trained model.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows.")
    max_len: int = Field(512, ge=2, description="Max tokens of prompt + response.")
    overlong: Literal["truncate", "reject"] = Field("truncate", description="Samples longer than max_len: cut and count, or refuse.")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    micro_train_batch_size: int = Field(8, ge=1, description="Samples per rank per forward.")
    train_batch_size: int = Field(16, ge=1, description="Samples per optimizer step over all ranks (-> grad accumulation).")
    learning_rate: float = Field(5e-6, gt=0, description="Peak learning rate.")
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1, description="Fraction of steps of linear warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay ends at learning_rate * this.")
    max_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0: off).")
    l2: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    bf16: bool = Field(False, description="bfloat16 weights/compute (where the hardware has it).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    adam_offload: bool = Field(False, description="ZeRO-offload optimizer states to CPU.")
    max_epochs: int = Field(1, ge=1, description="Passes over the data.")
    seed: int = Field(42, description="Seed of data order and initialisation.")
    packing_samples: bool = Field(False, description="Pack a micro-batch into rows of at most max_len tokens (one row under flash attention or ring attention; per-sample position ids, no cross-sample attention).")
    length_bucketing: bool = Field(True, description="Batch samples of similar length (less padding).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank (0: full fine-tuning).")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | None = Field(None, description="LoRA target modules (default all linear layers).")
    lora_merge: bool = Field(True, description="Save the merged model at the root (the adapter always goes to adapter/).")
    load_in_4bit: bool = Field(False, description="QLoRA: NF4 4-bit frozen base (bitsandbytes, CUDA only) + LoRA (lora_rank > 0).")
    # runtime: placement and bookkeeping, left out of the fingerprint
    launcher: Literal["deepspeed", "torchrun", "python"] = Field("deepspeed", description="How the job starts.")
    num_gpus: int | Literal["all"] = Field(
        1, description="Processes per node (GPUs; CPU processes without a GPU). all: every GPU of each node, as "
        "`deepspeed` without --num_gpus runs (torchrun --nproc_per_node gpu; a hostfile's slots; one process on a "
        "host without GPUs); the checks that need the world size then run at launch.")
    num_nodes: int = Field(1, ge=1, description="Nodes (with hostfile).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs.")
    master_addr: str | None = Field(None, description="torchrun multi-node: address of node 0 (this host); other "
                                    "nodes run the torchrun command the stage logs, fetching everything from the store.")
    master_port: int | None = Field(None, ge=1, le=65535, description="Rendezvous port (default: a free one).")
    save_steps: int = Field(0, ge=0, description="Checkpoint to {output_uri}/checkpoints every N steps (0: never).")
    max_ckpt_num: int = Field(1, ge=1, description="Checkpoints kept on the store, the newest (OpenRLHF --max_ckpt_num, "
                              "its default 3); all are removed once the model is committed.")
    save_hf_ckpt: bool = Field(False, description="With each checkpoint (save_steps), the model as an HF folder in the "
                               "artifact under hf_checkpoints/step-N/ (OpenRLHF --save_hf_ckpt), kept after the run.")
    resume: bool = Field(True, description="Continue from the latest checkpoint of the same job; false deletes checkpoints.")
    log_steps: int = Field(1, ge=1, description="Log metrics every N steps.")
    stall_timeout_s: float = Field(1800.0, gt=0, description="Kill the job and fail when it prints no line for this long.")
    upload_retries: int = Field(3, ge=0, description="Retries of the final upload (the model stays on local disk).")
    use_tensorboard: bool = Field(False, description="TensorBoard event files of every step in the artifact's tensorboard/.")
    use_wandb: bool = Field(False, description="A W&B run of every step (online with WANDB_API_KEY, else offline in wandb/).")
    wandb_project: str = Field("rlhf-flows", description="W&B project.")
    wandb_run_name: str | None = Field(None, description="W&B run name (default: the artifact URI's last parts).")
    # part A (issue 24): attention layouts
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "sdpa", description="transformers' attention kernel (OpenRLHF --flash_attn = flash_attention_2, CUDA + the "
        "flash_attn package). Packed and shared-prompt batches: flex_attention builds a block mask (no (T, T) tensor; "
        "CUDA only), flash_attention_2 packs by position ids (pairs go as two "
        "sequences), sdpa / eager get a dense (T, T) mask. Models with attention soft-capping (Gemma-2): not sdpa.")
    # part B (issue 24): held-out evaluation during training, the learning-rate schedule, dropout
    eval_dataset: str | None = Field(None, description="Held-out data with the training data's schema, evaluated during "
                                     "training: a committed artifact or raw source(s) (OpenRLHF --eval.dataset; dpo: a "
                                     "reference artifact of the eval pairs).")
    eval_split: str = Field("test", description="Split of eval_dataset sources that have splits; a source without splits "
                            "is read whole (OpenRLHF --eval.split).")
    eval_holdout: float = Field(0.0, ge=0, lt=1, description="Fraction of the training rows held out (seeded) as the "
                                "eval data instead of eval_dataset: what a committed artifact, which has no splits, offers.")
    max_eval_samples: int | None = Field(None, ge=1, description="Evaluate at most this many eval rows.")
    eval_steps: int | None = Field(None, ge=-1, description="Evaluate every N optimizer steps and at the end; None or -1: "
                                   "at the end of each epoch (OpenRLHF --eval.steps -1).")
    lr_scheduler: Literal["cosine_with_min_lr", "cosine_warmup_with_min_lr", "constant", "constant_with_warmup", "linear"] = Field(
        "cosine_with_min_lr", description="transformers' get_scheduler schedule (OpenRLHF --lr_scheduler); "
        "warm-up steps = ceil(lr_warmup_ratio x steps), rising from lr 0 at step 1 (from learning_rate / warm-up steps "
        "under cosine_warmup_with_min_lr); min_lr_ratio applies to the two cosine ones.")
    disable_dropout: bool | None = Field(None, description="Set every dropout probability of the model to 0 (not LoRA's); "
                                         "None: on for dpo / rm / kto (TRL's default), off for the others.")
    # part C (issue 24): scale: ring attention, DeepSpeed AutoTP, MoE auxiliary loss, Liger kernels
    ring_attn_size: int = Field(1, ge=1, description="Ranks that split each packed micro-batch's sequence, attention "
                                "seeing the whole row through K/V gathered over the group (OpenRLHF --ds.ring_attn_size; "
                                "needs packing_samples; data-parallel size = world / ring_attn_size; sft, dpo, kto).")
    ring_head_stride: int = Field(1, ge=1, description="KV heads gathered over the ring group at a time (OpenRLHF "
                                  "--ds.ring_attn_head_stride): fewer means less memory for the gathered K/V.")
    ds_tensor_parallel_size: int = Field(1, ge=1, description="DeepSpeed AutoTP training: ranks that each hold a slice of "
                                         "every linear layer (OpenRLHF --ds.tensor_parallel_size; data-parallel size = "
                                         "world / this; ZeRO stage 0-2, full fine-tuning).")
    aux_loss_coef: float = Field(0.0, ge=0, description="MoE load-balancing loss weight (OpenRLHF --model.aux_loss_coef): "
                                 "loss += coef x transformers' load_balancing_loss_func of the router logits; > 0 needs "
                                 "an MoE model; 0: the router trains only through the method's loss.")
    overlap_comm: bool = Field(False, description="DeepSpeed overlaps gradient reduction with the backward "
                               "(zero_optimization overlap_comm + contiguous_gradients, OpenRLHF --overlap_comm); false: "
                               "DeepSpeed's default (on for ZeRO-3 only).")
    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile (compile.deepcompile and engine.compile(), "
                              "OpenRLHF --deepcompile); CUDA only in DeepSpeed 0.19.8: refused by name without CUDA.")
    use_liger_kernel: bool = Field(False, description="Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) patched into the "
                                   "model (OpenRLHF --ds.use_liger_kernel): CUDA only, the liger-kernel package (gpu extra).")

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, v):
        return gpu_count(v)

    @model_validator(mode="after")
    def _batches_divide(self):
        if self.num_gpus != "all":  # "all": at launch, once the count is known (check_world)
            self._batch_divides(self.num_gpus * self.num_nodes)
        elif self.train_batch_size % self.micro_train_batch_size:
            raise ValueError(f"train_batch_size {self.train_batch_size} is not divisible by micro_train_batch_size "
                             f"{self.micro_train_batch_size} (num_gpus all: nor by it x any world size)")
        if self.load_in_4bit and not self.lora_rank:
            raise ValueError("load_in_4bit (QLoRA) trains LoRA adapters on a frozen 4-bit base: set lora_rank > 0")
        if self.load_in_4bit and self.zero_stage == 3:  # ZeRO-3 would partition the packed NF4 weights
            raise ValueError("load_in_4bit (QLoRA) with zero_stage 3 is not supported: use zero_stage 2")
        if self.eval_dataset and self.eval_holdout:
            raise ValueError("give eval_dataset or eval_holdout, not both")
        if not (self.eval_dataset or self.eval_holdout):
            given = [k for k in ("eval_steps", "max_eval_samples") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} set but there is no eval data: set eval_dataset or eval_holdout")
        if self.eval_steps == 0:
            raise ValueError("eval_steps must be >= 1, or -1 / None for each epoch's end")
        if self.save_hf_ckpt and not self.save_steps:
            raise ValueError("save_hf_ckpt writes an HF folder with each checkpoint: save_steps is 0 (no checkpoint)")
        return self

    @model_validator(mode="after")
    def _scale_settings(self):  # part C (issue 24)
        if self.ring_attn_size > 1 and not self.packing_samples:
            raise ValueError("ring_attn_size > 1 splits a packed row over ranks: set packing_samples=true")
        if self.ring_attn_size > 1 and self.ds_tensor_parallel_size > 1:
            raise ValueError("ring_attn_size and ds_tensor_parallel_size together are not supported: use one")
        if self.ring_attn_size > 1 and self.aux_loss_coef:
            raise ValueError("aux_loss_coef with ring_attn_size > 1 is not supported (each rank routes only its slice)")
        if self.num_gpus != "all":
            self._groups_divide(self.num_gpus * self.num_nodes)
        if self.ds_tensor_parallel_size > 1 and (self.zero_stage == 3 or self.lora_rank):
            raise ValueError("ds_tensor_parallel_size > 1 is supported with zero_stage 0-2 and full fine-tuning "
                             "(lora_rank 0)")
        return self

    def _batch_divides(self, world: int, how: str = "") -> None:
        per_step = self.micro_train_batch_size * world
        if self.train_batch_size % per_step:
            raise ValueError(f"train_batch_size {self.train_batch_size} is not divisible by micro_train_batch_size "
                             f"x world size ({self.micro_train_batch_size} x {world} = {per_step}{how and '; ' + how})")

    def _groups_divide(self, world: int, how: str = "num_gpus x num_nodes") -> None:
        for k in ("ring_attn_size", "ds_tensor_parallel_size"):
            if world % getattr(self, k):
                raise ValueError(f"{k} {getattr(self, k)} does not divide the world size {world} ({how})")


def gpu_count(v: int | str) -> int | str:
    """num_gpus: a count >= 1, or "all"."""
    if v != "all" and v < 1:
        raise ValueError(f"num_gpus {v}: give a count >= 1, or all (every GPU of each node)")
    return v


def check_world(cfg) -> int:
    """The job's world size, num_gpus "all" resolved as the launcher will start it (jobs.world_size), after the
    checks a count runs at config time: each refusal names the size it resolved to."""
    world, how = jobs.world_size(cfg.num_gpus, cfg.num_nodes, cfg.hostfile)
    if cfg.num_gpus == "all":
        cfg._batch_divides(world, how)
        cfg._groups_divide(world, how)
    return world


class SourceFields(BaseModel):
    """How raw OpenRLHF-format sources become rows: only for stages that read raw sources (not dpo, whose
    input is a committed reference artifact)."""

    dataset_probs: str | None = Field(None, description="Mixing probabilities of comma-separated sources, e.g. '0.7,0.3'.")
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    input_template: str | None = Field(None, description="e.g. 'User: {}\\nAssistant: ' (without chat template).")


TRAIN_RUNTIME = {"launcher", "num_gpus", "num_nodes", "hostfile", "master_addr", "master_port", "save_steps", "resume",
                 "max_ckpt_num", "save_hf_ckpt", "overlap_comm", "deepcompile",
                 "log_steps", "stall_timeout_s", "upload_retries", "use_tensorboard", "use_wandb",
                 "wandb_project", "wandb_run_name"}
SPEC_KEYS = set(TrainFields.model_fields) - {"dataset_uri", "max_samples", "overlong", "eval_dataset",  # max_len: the
                                             "eval_split", "eval_holdout", "max_eval_samples"}  # packed rows' budget


# Methods that train with dropout off unless disable_dropout says otherwise: TRL's DPOConfig, RewardConfig and
# KTOConfig default to disable_dropout=True (a policy compared with its reference, a reward compared across a
# pair: dropout noise enters the margin). OpenRLHF has no such switch: models train with their config's dropout.
DROPOUT_OFF = {"dpo", "rm", "kto"}


def check_hardware(cfg) -> None:
    import torch

    if cfg.load_in_4bit and not torch.cuda.is_available():
        raise ValueError("load_in_4bit (QLoRA) needs a CUDA GPU; this host has none: set load_in_4bit=false")
    attention.check(cfg.attn_implementation)  # part A: an implementation this host can train with
    check_world(cfg)  # num_gpus all: the world size is known here
    if cfg.deepcompile and not torch.cuda.is_available():  # deepspeed.compile.util.is_deepcompile_supported
        raise ValueError("deepcompile: DeepSpeed 0.19.8 compiles with DeepCompile on CUDA only (torch >= 2.6 on a cuda "
                         "accelerator); this host has none: set deepcompile=false")
    if cfg.use_liger_kernel and not torch.cuda.is_available():  # Liger's kernels are Triton GPU kernels
        raise ValueError("use_liger_kernel needs a CUDA GPU (Liger's Triton kernels); this host has none: "
                         "set use_liger_kernel=false")


def input_manifests(cfg) -> dict[str, store.Manifest]:
    out = {}
    for key, uris in (("dataset", cfg.dataset_uri), ("eval_dataset", cfg.eval_dataset or "")):
        srcs = [s.strip() for s in uris.split(",") if s.strip()]
        out |= {f"{key}{i or ''}": data.source_manifest(s, cfg.storage_options) for i, s in enumerate(srcs)}
    return out


def load_rows(cfg, kind: str, fmt: data.Format, tokenizer, eval: bool = False) -> list[dict]:
    """Rows of `kind` ("sft" or "pairs") from a committed artifact or raw OpenRLHF-format source(s): the training
    data, or with `eval` the eval_dataset (its eval_split, unmixed: OpenRLHF blends eval sources without
    probabilities)."""
    uri, limit = (cfg.eval_dataset, cfg.max_eval_samples) if eval else (cfg.dataset_uri, cfg.max_samples)
    if "," not in uri and store.committed_any(uri, cfg.storage_options):
        table = store.read_table(uri, storage_options=cfg.storage_options)
        data.validate_table(table, kind, uri)
        rows = table.to_pylist()
        return rows[:limit] if limit else rows
    raw = data.load_mixture(uri, None if eval else cfg.dataset_probs, limit, cfg.seed, cfg.storage_options,
                            split=cfg.eval_split if eval else "train")
    return (data.sft_rows if kind == "sft" else data.pair_rows)(raw, fmt, tokenizer)


def split_eval(cfg, load) -> tuple[list, list]:
    """(training rows, eval rows). `load(eval: bool)` reads the training rows or the eval_dataset's rows with the
    same code, so eval data of another schema fails as training data would (source, row, key). eval_holdout:
    a seeded draw of round(eval_holdout x n) training rows (at least one) is held out, never trained on;
    max_eval_samples caps the rows evaluated."""
    rows = load(False)
    if cfg.eval_dataset:
        return rows, load(True)
    if not cfg.eval_holdout:
        return rows, []
    import random

    k = max(1, round(cfg.eval_holdout * len(rows)))
    if k >= len(rows):
        raise data.DataError(f"{cfg.dataset_uri}: eval_holdout {cfg.eval_holdout} of {len(rows)} rows leaves none to train on")
    held = set(random.Random(cfg.seed).sample(range(len(rows)), k))
    evals = [r for i, r in enumerate(rows) if i in held]
    return [r for i, r in enumerate(rows) if i not in held], evals[: cfg.max_eval_samples]


def tokenizer_id(tok) -> str:
    """A short hash of a tokenizer's vocabulary and special tokens (policy vs reference check)."""
    import hashlib

    payload = json.dumps([sorted(tok.get_vocab().items()), tok.pad_token, tok.eos_token, tok.bos_token])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def train_and_commit(cfg, w: store.ArtifactWriter, method: str, records: list[dict], model_dir: Path, tokenizer,
                     extra_spec: dict, metrics: dict, model_uri: str | None = None,
                     eval_records: list[dict] | None = None) -> store.Manifest:
    """Launch the DeepSpeed job on tokenized `records`, then upload model + log and commit `w`. `eval_records`
    (tokenized like `records`) travel with them: the job evaluates on them every eval_steps and at the end, and
    the last evaluation's `eval_*` figures join the manifest's metrics (every one is in training_log.json).

    The job's spec and data also go to `{output_uri}/_job/` (removed when the job exits) so ranks on other
    nodes fetch them (and `model_uri`, and the resume checkpoint) from the store into their own caches:
    multi-node needs no shared disk. The spec holds no credentials (jobs read them from their environment).
    The trained model stays in the local work folder until the commit succeeded: a failed upload is retried
    (`upload_retries`), and a rerun after it failed finds the finished job there and commits without
    retraining."""
    attention.check(cfg.attn_implementation, model_dir)  # part A: one the model supports, before work
    w.begin()  # checkpoints/ is kept: the same job resumes from it
    work = store.cache_root() / "jobs" / w.fingerprint
    result = _finished(work)
    if result:
        log.info("reusing the model trained for %s in %s (its upload had failed): not retraining", w.uri, work)
    else:
        result = _train(cfg, w, work, method, records, model_dir, tokenizer, extra_spec, model_uri, eval_records or [])
    tracked = [sub for sub in ("tensorboard", "wandb") if (work / "tracking" / sub).is_dir()]  # the job wrote them live
    if cfg.save_hf_ckpt:  # the job's ranks uploaded them (a resumed job's earlier ones too): into the manifest
        w.add_files(_listed(store.join(w.uri, "hf_checkpoints"), "hf_checkpoints", cfg.storage_options))
    for attempt in range(cfg.upload_retries + 1):
        try:
            w.upload_dir(work / "model")
            for sub in tracked:
                w.upload_dir(work / "tracking" / sub, sub)
            w.write_json("training_log.json", result["history"])
            m = w.commit(metrics={**metrics, **({"eval_rows": len(eval_records)} if eval_records else {}),
                                  **{k: v for k, v in result.items() if k != "history"}})
            break
        except store.LockLost:
            raise
        except Exception as e:  # noqa: BLE001  a store outage: the model is safe on local disk
            why = store.redact(f"{type(e).__name__}: {e}", cfg.storage_options)
            if attempt == cfg.upload_retries:
                raise store.ArtifactError(f"upload of the trained model to {w.uri} failed {attempt + 1} times ({why}); "
                                          f"the model is kept in {work}: rerun to commit it without retraining") from None
            log.warning("upload to %s failed (%s); retrying in %ss", w.uri, why, 2 ** attempt)
            time.sleep(2 ** attempt)
    checkpoints.remove_all(store.join(w.uri, "checkpoints"), cfg.storage_options)
    shutil.rmtree(work, ignore_errors=True)
    return m


def _listed(uri: str, prefix: str, storage_options: dict | None) -> list[dict]:
    """{"path": prefix/relative path, "size"} of every file under `uri` (none when it does not exist)."""
    fs, root = store.filesystem(uri, storage_options)
    if not fs.exists(root):
        return []
    return [{"path": f"{prefix}/{p[len(root.rstrip('/')) + 1:]}", "size": info["size"]}
            for p, info in sorted(fs.find(root, detail=True).items())]


def _finished(work: Path) -> dict | None:
    """The result of a job that trained to its planned step count in `work` (saved model, or adapter, included)."""
    try:
        result = json.loads((work / "result.json").read_text())
    except (OSError, ValueError):
        return None
    saved = (work / "model" / "config.json").exists() or (work / "model" / "adapter" / "adapter_config.json").exists()
    ok = result.get("steps_done") == result.get("planned_steps") and saved  # a full model, or lora_merge=false's adapter
    return result if ok else None


def _train(cfg, w: store.ArtifactWriter, work: Path, method: str, records: list[dict], model_dir: Path, tokenizer,
           extra_spec: dict, model_uri: str | None, eval_records: list[dict]) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records), work / "data.parquet")
    if eval_records:
        pq.write_table(pa.Table.from_pylist(eval_records), work / "eval.parquet")
    job_uri = store.join(w.uri, "_job")
    fs, job_path = store.filesystem(job_uri, cfg.storage_options)
    fs.makedirs(job_path, exist_ok=True)
    store.check_fence()
    fs.put_file(str(work / "data.parquet"), store.join(job_path, "data.parquet"))
    if eval_records:  # ranks on other nodes fetch it as they fetch data.parquet (entry.job_spec)
        fs.put_file(str(work / "eval.parquet"), store.join(job_path, "eval.parquet"))
    ckpt_uri = store.join(w.uri, "checkpoints")
    hf_uri = store.join(w.uri, "hf_checkpoints") if cfg.save_hf_ckpt else None
    if not cfg.resume:
        checkpoints.remove_all(ckpt_uri, cfg.storage_options)
        checkpoints.remove_all(store.join(w.uri, "hf_checkpoints"), cfg.storage_options)  # this job's own, if any
    if hf_uri:
        w.note({"hf_checkpoints"})  # journalled before the job writes them: a crash leaves files known as ours
    meta, resume_dir = checkpoints.resume_point(ckpt_uri, w.fingerprint, work / "resume", cfg.storage_options)
    spec = {**{k: getattr(cfg, k) for k in SPEC_KEYS}, **extra_spec, "method": method, "model_dir": str(model_dir),
            "data_path": str(work / "data.parquet"), "work_dir": str(work), "ckpt_uri": ckpt_uri,
            "storage_options": store.check_no_secrets(cfg.storage_options), "fingerprint": w.fingerprint,
            "pad_id": models.pad_id(tokenizer, model_dir), "resume_dir": str(resume_dir) if resume_dir else None,
            "resume_uri": meta["uri"] if meta else None, "resume": meta, "step_sleep": faults.step_sleep(),
            "model_uri": model_uri or str(model_dir), "data_uri": store.join(job_uri, "data.parquet"),
            "eval_path": str(work / "eval.parquet") if eval_records else None,
            "disable_dropout": method in DROPOUT_OFF if cfg.disable_dropout is None else cfg.disable_dropout,
            "eval_uri": store.join(job_uri, "eval.parquet") if eval_records else None,
            "launch_cache": str(store.cache_root()), "fence": os.environ.get(store.FENCE_ENV), "hf_uri": hf_uri,
            "tracking": {"tensorboard": cfg.use_tensorboard, "wandb": cfg.use_wandb, "project": cfg.wandb_project,
                         "run_name": cfg.wandb_run_name or "/".join(w.uri.split("/")[-3:]), "config": cfg.semantic()}
            if cfg.use_tensorboard or cfg.use_wandb else None}
    spec_path = work / "spec.json"
    with os.fdopen(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(spec, default=list))
    spec_uri = store.join(job_uri, "spec.json")
    store.check_fence()
    fs.put_file(str(spec_path), store.join(job_path, "spec.json"))
    cmd = jobs.launcher_command("rlhf_core.train.entry", [spec_uri], cfg.launcher, cfg.num_gpus, cfg.num_nodes,
                                cfg.hostfile, cfg.master_port, cfg.master_addr)
    if cfg.launcher == "torchrun" and cfg.num_nodes > 1:
        log.info("start node k = 1..%d with: %s", cfg.num_nodes - 1, " ".join(
            jobs.launcher_command("rlhf_core.train.entry", [spec_uri], "torchrun", cfg.num_gpus, cfg.num_nodes,
                                  None, cfg.master_port, cfg.master_addr, node_rank="k")))
    try:
        jobs.run_job(cmd, env=jobs.job_env(jobs.procs_per_node(cfg.num_gpus)), stall_timeout_s=cfg.stall_timeout_s,
                     what=f"{method} training for {w.uri}")
    finally:
        spec_path.unlink(missing_ok=True)
        try:
            store.check_fence()  # a run that lost its lock leaves _job/ alone: the new holder's job may use it
            if fs.exists(job_path):
                fs.rm(job_path, recursive=True)
        except store.LockLost as e:
            log.error("%s", e)
    result_path = work / "result.json"
    if not result_path.exists():
        raise TrainingIncomplete(f"training job for {w.uri} exited 0 but wrote no result.json: not committed")
    result = json.loads(result_path.read_text())
    if result["steps_done"] != result["planned_steps"]:
        raise TrainingIncomplete(f"training for {w.uri} stopped at step {result['steps_done']} of "
                                 f"{result['planned_steps']}: not committed")
    return result
