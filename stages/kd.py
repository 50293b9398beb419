"""Knowledge distillation as a DeepSpeed job (OpenRLHF train_kd: --teacher_model, --kd_coef, --teacher_offload):
SFT data, and in the same job a frozen teacher forwarded on every micro-batch; the student's loss is
(1 - kd_coef) * NLL + kd_coef * the cross-entropy of its log-probs under the teacher's softmax over the
vocabulary, on response tokens (rlhf_core.train.methods.kd). Student and teacher must share the tokenizer
and the vocabulary size (the distributions are compared entry by entry); a teacher that differs is refused
before any work. Input data as for sft: `sft` rows from a committed artifact or raw OpenRLHF-format sources.

    rlhf-flows stage kd policy_uri=... teacher_uri=... dataset_uri=... output_uri=... kd_coef=0.4
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.train import batches, launch
from rlhf_core.train.launch import TRAIN_RUNTIME, SourceFields, TrainFields, check_hardware, input_manifests, load_rows, split_eval, train_and_commit
from stages.common import ConfigError, StageConfig


class Config(StageConfig, TrainFields, SourceFields):
    policy_uri: str = Field(description="Student to train: a committed artifact or a plain HF folder (OpenRLHF --pretrain).")
    teacher_uri: str = Field(description="Teacher, frozen: a committed artifact or a plain HF folder (OpenRLHF --teacher_model).")
    input_key: str = Field("input", description="Prompt key of raw rows.")
    output_key: str | None = Field("output", description="Response key of raw rows (None: last assistant message).")
    kd_coef: float = Field(0.4, ge=0, le=1, description="Weight of the distillation loss; the NLL gets 1 - kd_coef.")
    teacher_offload: bool = Field(False, description="Keep the teacher in host memory between forwards (moved to the "
                                  "device for each one); no effect on a host without an accelerator.")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME | {"teacher_offload"}


def _vocab_size(model_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir)).get_text_config().vocab_size


def check_teacher(cfg: Config, student_dir, student_tok, teacher_dir) -> None:
    """The teacher's distribution must be comparable entry by entry with the student's."""
    teacher_tok = models.load_tokenizer(teacher_dir, where=cfg.teacher_uri)
    if launch.tokenizer_id(teacher_tok) != launch.tokenizer_id(student_tok):
        raise ConfigError(f"student {cfg.policy_uri} and teacher {cfg.teacher_uri} use different tokenizers: "
                          "the teacher's distribution over its vocabulary cannot teach the student's")
    vs, vt = _vocab_size(student_dir), _vocab_size(teacher_dir)
    if vs != vt:
        raise ConfigError(f"student {cfg.policy_uri} has vocab_size {vs} but teacher {cfg.teacher_uri} has {vt}: "
                          "distillation compares the two distributions entry by entry")


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    student = model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options)
    teacher = model_inputs.model_manifest(cfg.teacher_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "kd", cfg.semantic(), {"policy": student, "teacher": teacher, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.policy_uri, cfg.storage_options, manifest=student)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.policy_uri)
    teacher_dir = model_inputs.fetch_model(cfg.teacher_uri, cfg.storage_options, manifest=teacher)
    check_teacher(cfg, model_dir, tok, teacher_dir)
    fmt = data.Format(input_key=cfg.input_key, output_key=cfg.output_key, apply_chat_template=cfg.apply_chat_template,
                      input_template=cfg.input_template)
    rows, eval_rows = split_eval(cfg, lambda ev: load_rows(cfg, "sft", fmt, tok, eval=ev))
    records, cut = batches.tokenize_sft(rows, tok, cfg.max_len, overlong=cfg.overlong, where=cfg.dataset_uri, model_dir=model_dir)
    eval_records = batches.tokenize_sft(eval_rows, tok, cfg.max_len, overlong=cfg.overlong, where=cfg.eval_dataset or cfg.dataset_uri,
                                        model_dir=model_dir)[0] if eval_rows else []
    spec = {"kd_coef": cfg.kd_coef, "teacher_offload": cfg.teacher_offload, "teacher_dir": str(teacher_dir),
            "teacher_uri": cfg.teacher_uri}
    return train_and_commit(cfg, w, "kd", records, model_dir, tok, spec, {"rows": len(records), "truncated": cut},
                            model_uri=cfg.policy_uri, eval_records=eval_records)
