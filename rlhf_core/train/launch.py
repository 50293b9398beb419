"""Parent side of a training stage: shared config fields, input loading, and `train_and_commit`, which
launches rlhf_core.train.entry under DeepSpeed, checks the child reached its planned step count, and only
then uploads the model and commits the manifest (a run that stops short is never committed)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, model_validator

from rlhf_core import data, jobs, store
from rlhf_core.train import checkpoints

log = logging.getLogger("rlhf_flows")


class TrainingIncomplete(RuntimeError):
    pass


class TrainFields(BaseModel):
    """Training keys shared by sft / train_rm / dpo, named as OpenRLHF's CLI flags."""

    dataset_uri: str = Field(description="Committed artifact, or raw source(s) 'a.jsonl,b.parquet' (OpenRLHF --dataset).")
    dataset_probs: str | None = Field(None, description="Mixing probabilities of comma-separated sources, e.g. '0.7,0.3'.")
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    input_template: str | None = Field(None, description="e.g. 'User: {}\\nAssistant: ' (without chat template).")
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
    packing_samples: bool = Field(False, description="Pack a micro-batch into one row (per-sample position ids, no cross-sample attention).")
    length_bucketing: bool = Field(True, description="Batch samples of similar length (less padding).")
    lora_rank: int = Field(0, ge=0, description="LoRA rank (0: full fine-tuning).")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | None = Field(None, description="LoRA target modules (default all linear layers).")
    lora_merge: bool = Field(True, description="Save the merged model at the root (the adapter always goes to adapter/).")
    load_in_4bit: bool = Field(False, description="QLoRA 4-bit base (GPU only).")
    # runtime: placement and bookkeeping, left out of the fingerprint
    launcher: Literal["deepspeed", "torchrun", "python"] = Field("deepspeed", description="How the job starts.")
    num_gpus: int = Field(1, ge=1, description="Processes per node (GPUs; CPU processes without a GPU).")
    num_nodes: int = Field(1, ge=1, description="Nodes (with hostfile).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs.")
    save_steps: int = Field(0, ge=0, description="Checkpoint to {output_uri}/checkpoints every N steps (0: never).")
    resume: bool = Field(True, description="Continue from the latest checkpoint of the same job; false deletes checkpoints.")
    log_steps: int = Field(1, ge=1, description="Log metrics every N steps.")
    debug_step_sleep: float = Field(0.0, ge=0, description="Sleep per step (tests that interrupt a job).")
    use_tensorboard: bool = Field(False, description="TensorBoard event files of every step in the artifact's tensorboard/.")
    use_wandb: bool = Field(False, description="A W&B run of every step (online with WANDB_API_KEY, else offline in wandb/).")
    wandb_project: str = Field("rlhf-flows", description="W&B project.")
    wandb_run_name: str | None = Field(None, description="W&B run name (default: the artifact URI's last parts).")

    @model_validator(mode="after")
    def _batches_divide(self):
        per_step = self.micro_train_batch_size * self.num_gpus * self.num_nodes
        if self.train_batch_size % per_step:
            raise ValueError(f"train_batch_size {self.train_batch_size} is not divisible by micro_train_batch_size "
                             f"x world size ({self.micro_train_batch_size} x {self.num_gpus * self.num_nodes} = {per_step})")
        if self.lora_rank and self.zero_stage == 3:
            raise ValueError("LoRA with zero_stage 3 is not supported: use zero_stage 2")
        return self


TRAIN_RUNTIME = {"launcher", "num_gpus", "num_nodes", "hostfile", "save_steps", "resume", "log_steps", "debug_step_sleep",
                 "use_tensorboard", "use_wandb", "wandb_project", "wandb_run_name"}
SPEC_KEYS = set(TrainFields.model_fields) - {"dataset_uri", "dataset_probs", "apply_chat_template", "input_template",
                                             "max_samples", "max_len", "overlong"}


def check_hardware(cfg) -> None:
    import torch

    if cfg.load_in_4bit and not torch.cuda.is_available():
        raise ValueError("load_in_4bit (QLoRA) needs a CUDA GPU; this host has none: set load_in_4bit=false")


def input_manifests(cfg) -> dict[str, store.Manifest]:
    srcs = [s.strip() for s in cfg.dataset_uri.split(",") if s.strip()]
    return {f"dataset{i or ''}": store.source_manifest(data.source_split(s)[0], cfg.storage_options) for i, s in enumerate(srcs)}


def load_rows(cfg, kind: str, fmt: data.Format, tokenizer) -> list[dict]:
    """Rows of `kind` ("sft" or "pairs") from a committed artifact or raw OpenRLHF-format source(s)."""
    uri = cfg.dataset_uri
    if "," not in uri and store.committed_any(uri, cfg.storage_options):
        table = store.read_table(uri, storage_options=cfg.storage_options)
        data.validate_table(table, kind, uri)
        rows = table.to_pylist()
        return rows[: cfg.max_samples] if cfg.max_samples else rows
    raw = data.load_mixture(uri, cfg.dataset_probs, cfg.max_samples, cfg.seed, cfg.storage_options)
    return (data.sft_rows if kind == "sft" else data.pair_rows)(raw, fmt, tokenizer)


def tokenizer_id(tok) -> str:
    """A short hash of a tokenizer's vocabulary and special tokens (policy vs reference check)."""
    import hashlib

    payload = json.dumps([sorted(tok.get_vocab().items()), tok.pad_token, tok.eos_token, tok.bos_token])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def train_and_commit(cfg, w: store.ArtifactWriter, method: str, records: list[dict], model_dir: Path, tokenizer,
                     extra_spec: dict, metrics: dict) -> store.Manifest:
    """Launch the DeepSpeed job on tokenized `records`, then upload model + log and commit `w`."""
    w.begin(keep=("checkpoints",))
    work = store.cache_root() / "jobs" / w.fingerprint
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records), work / "data.parquet")
    ckpt_uri = store.join(w.uri, "checkpoints")
    if not cfg.resume:
        checkpoints.remove_all(ckpt_uri, cfg.storage_options)
    meta = checkpoints.latest(ckpt_uri, w.fingerprint, cfg.storage_options)
    resume_dir = checkpoints.download(meta, work / "resume", cfg.storage_options) if meta else None
    spec = {**{k: getattr(cfg, k) for k in SPEC_KEYS}, **extra_spec, "method": method, "model_dir": str(model_dir),
            "data_path": str(work / "data.parquet"), "work_dir": str(work), "ckpt_uri": ckpt_uri,
            "storage_options": cfg.storage_options, "fingerprint": w.fingerprint, "pad_id": tokenizer.pad_token_id,
            "resume_dir": str(resume_dir) if resume_dir else None, "resume_uri": meta["uri"] if meta else None,
            "step_sleep": cfg.debug_step_sleep}
    (work / "spec.json").write_text(json.dumps(spec, default=list))
    cmd = jobs.launcher_command("rlhf_core.train.entry", [str(work / "spec.json")], cfg.launcher, cfg.num_gpus,
                                cfg.num_nodes, cfg.hostfile)
    jobs.run_job(cmd, env=jobs.job_env(cfg.num_gpus))
    result_path = work / "result.json"
    if not result_path.exists():
        raise TrainingIncomplete(f"training job for {w.uri} exited 0 but wrote no result.json: not committed")
    result = json.loads(result_path.read_text())
    if result["steps_done"] != result["planned_steps"]:
        raise TrainingIncomplete(f"training for {w.uri} stopped at step {result['steps_done']} of "
                                 f"{result['planned_steps']}: not committed")
    w.upload_dir(work / "model")
    history = result.pop("history")
    if cfg.use_tensorboard or cfg.use_wandb:
        from rlhf_core import tracking

        for sub in tracking.write(work / "tracking", [{k: v for k, v in h.items() if k != "samples"} for h in history],
                                  "step", tensorboard=cfg.use_tensorboard, wandb=cfg.use_wandb, prefix=method,
                                  project=cfg.wandb_project, run_name=cfg.wandb_run_name or "/".join(w.uri.split("/")[-3:]),
                                  config=cfg.semantic()):
            w.upload_dir(work / "tracking" / sub, sub)
    w.write_json("training_log.json", history)
    m = w.commit(metrics={**metrics, **result})
    checkpoints.remove_all(ckpt_uri, cfg.storage_options)
    shutil.rmtree(work, ignore_errors=True)
    return m
