"""Supervised fine-tuning as a DeepSpeed job: next-token cross-entropy on response tokens (prompt masked),
or on every token with `pretrain_mode`. Input: `sft` rows (input, output) from a committed artifact or raw
OpenRLHF-format sources (input_key / output_key, chat template or input_template). Output: an HF model
directory (safetensors + tokenizer), committed after the job reached its planned step count.
`multiturn` (OpenRLHF --multiturn): raw rows whose input_key holds a conversation (a list of {role, content}
messages), rendered with the chat template, the loss on every assistant turn (batches.tokenize_multiturn),
not only the last.

    rlhf-flows stage sft --config configs/demo.yaml policy_uri=... dataset_uri=... output_uri=...
    multi-GPU: num_gpus=8; multi-node: hostfile=/job/hostfile num_nodes=2
"""
from __future__ import annotations

import functools
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.train import batches
from rlhf_core.train.launch import TRAIN_RUNTIME, SourceFields, TrainFields, check_hardware, input_manifests, load_rows, split_eval, train_and_commit
from stages.common import ConfigError, StageConfig


class Config(StageConfig, TrainFields, SourceFields):
    policy_uri: str = Field(description="Model to fine-tune: a committed artifact or a plain HF folder on any URI (OpenRLHF --pretrain).")
    input_key: str = Field("input", description="Prompt key of raw rows.")
    output_key: str | None = Field("output", description="Response key of raw rows (None: last assistant message).")
    pretrain_mode: bool = Field(False, description="Loss on all tokens, prompt included.")
    multiturn: bool = Field(False, description="Rows are conversations under input_key (lists of {role, content}), "
                            "rendered with the chat template; the loss covers every assistant turn (OpenRLHF --multiturn).")
    loss_token_mean: Literal["micro_batch", "window"] = Field(
        "micro_batch", description="With gradient accumulation (train_batch_size > micro_train_batch_size x ranks): "
        "micro_batch, each micro-batch's token mean and the step their mean (OpenRLHF's); window, one token mean over "
        "every micro-batch of the optimizer step (TRL's, transformers' num_items_in_batch).")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME

    @model_validator(mode="after")
    def _multiturn_reads_conversations(self):
        if self.multiturn:
            given = [k for k in ("pretrain_mode", "input_template") if getattr(self, k)]
            given += ["output_key"] if "output_key" in self.model_fields_set and self.output_key else []
            if given:
                raise ValueError(f"multiturn reads whole conversations from input_key with the chat template: "
                                 f"it does not use {', '.join(given)}")
        return self


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    model = model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "sft", cfg.semantic(), {"policy": model, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.policy_uri, cfg.storage_options, manifest=model)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.policy_uri)
    if cfg.multiturn:
        if not tok.chat_template:
            raise ConfigError(f"multiturn: the tokenizer of {cfg.policy_uri} has no chat template "
                              "(set tokenizer_chat_template)")
        if "," not in cfg.dataset_uri and store.committed_any(cfg.dataset_uri, cfg.storage_options):
            raise ConfigError(f"multiturn: {cfg.dataset_uri} is a committed artifact of (input, output) rows, "
                              "not conversations: give raw rows with message lists")

        def conversations(ev: bool) -> list[dict]:  # the training data, or eval_dataset's eval_split (unmixed)
            uri, probs, limit = ((cfg.eval_dataset, None, cfg.max_eval_samples) if ev
                                 else (cfg.dataset_uri, cfg.dataset_probs, cfg.max_samples))
            raw = data.load_mixture(uri, probs, limit, cfg.seed, cfg.storage_options, split=cfg.eval_split if ev else "train")
            return data.conversation_rows(raw, cfg.input_key)

        rows, eval_rows = split_eval(cfg, conversations)
        tokenize = functools.partial(batches.tokenize_multiturn, tok=tok, max_len=cfg.max_len, overlong=cfg.overlong,
                                     model_dir=model_dir)
    else:
        fmt = data.Format(input_key=cfg.input_key, output_key=cfg.output_key, apply_chat_template=cfg.apply_chat_template,
                          input_template=cfg.input_template)
        rows, eval_rows = split_eval(cfg, lambda ev: load_rows(cfg, "sft", fmt, tok, eval=ev))
        tokenize = functools.partial(batches.tokenize_sft, tok=tok, max_len=cfg.max_len, pretrain_mode=cfg.pretrain_mode,
                                     overlong=cfg.overlong, model_dir=model_dir)
    records, cut = tokenize(rows, where=cfg.dataset_uri)
    eval_records = tokenize(eval_rows, where=cfg.eval_dataset or cfg.dataset_uri)[0] if eval_rows else []
    return train_and_commit(cfg, w, "sft", records, model_dir, tok, {"loss_token_mean": cfg.loss_token_mean},
                            {"rows": len(records), "truncated": cut},
                            model_uri=cfg.policy_uri, eval_records=eval_records)
