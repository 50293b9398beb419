"""Reward-model training as a DeepSpeed job: Bradley-Terry pairwise loss -log sigmoid(r_c - r_r - margin)
(or OpenRLHF's log-exp variant) on a scalar head read at each sequence's last token. After training the
reward mean and std over the training set go into config.json (`reward_mean`, `reward_std`) so the score
stage can normalise. Input: pairs (prompt, chosen, rejected) from an artifact or raw OpenRLHF sources.

    rlhf-flows stage train_rm --config configs/demo.yaml base_uri=... dataset_uri=... output_uri=...
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.train import batches
from rlhf_core.train.launch import TRAIN_RUNTIME, SourceFields, TrainFields, check_hardware, input_manifests, load_rows, split_eval, train_and_commit
from stages.common import StageConfig


class Config(StageConfig, TrainFields, SourceFields):
    base_uri: str = Field(description="Model to start from, committed artifact or plain HF folder (a reward model, or a causal LM: the head is new then).")
    prompt_key: str | None = Field("prompt", description="Prompt key of raw rows.")
    chosen_key: str = Field("chosen", description="Chosen-response key of raw rows.")
    rejected_key: str = Field("rejected", description="Rejected-response key of raw rows.")
    loss: Literal["sigmoid", "logexp"] = Field("sigmoid", description="Pairwise loss (OpenRLHF PairWiseLoss / LogExpLoss).")
    use_margin: bool = Field(False, description="Subtract the rows' `margin` column inside the sigmoid (Llama-2).")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME

    @model_validator(mode="after")
    def _margin_is_sigmoid_only(self):
        if self.use_margin and self.loss != "sigmoid":  # OpenRLHF's LogExpLoss takes no margin
            raise ValueError("use_margin applies to loss sigmoid only (the logexp loss has no margin term)")
        return self


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    base = model_inputs.model_manifest(cfg.base_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "train_rm", cfg.semantic(), {"base": base, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.base_uri, cfg.storage_options, manifest=base)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.base_uri)
    fmt = data.Format(prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key,
                      apply_chat_template=cfg.apply_chat_template, input_template=cfg.input_template)
    rows, eval_rows = split_eval(cfg, lambda ev: load_rows(cfg, "pairs", fmt, tok, eval=ev))

    def tokenize(rs, where):
        return batches.tokenize_pairs(rs, tok, cfg.max_len, cfg.overlong, where=where,
                                      extra=("margin",) if cfg.use_margin else (), model_dir=model_dir)

    records, cut = tokenize(rows, cfg.dataset_uri)
    eval_records = tokenize(eval_rows, cfg.eval_dataset or cfg.dataset_uri)[0] if eval_rows else []
    return train_and_commit(cfg, w, "rm", records, model_dir, tok, {"loss": cfg.loss, "use_margin": cfg.use_margin},
                            {"rows": len(records), "truncated": cut}, model_uri=cfg.base_uri, eval_records=eval_records)
