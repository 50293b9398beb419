"""Process reward model (PRM) training as a DeepSpeed job (OpenRLHF train_prm; Math-Shepherd, arXiv:2312.08935):
a causal LM learns to put, at the placeholder token that ends each reasoning step, the reward token of that
step's label ("+" / "-"); the loss is rlhf_core.train.methods.prm's cross-entropy over the reward tokens'
logits at the placeholders. The saved model's config.json names its placeholder and reward tokens, so the
score stage (and every flow whose reward_uri is this artifact) recognises it as a PRM and scores per step.

Data: OpenRLHF's / Math-Shepherd's rows, `input_key` a text whose steps each end with `placeholder_token`,
`label_key` a list with one label per step: a reward token, or a number in [0, 1] (soft label, two reward
tokens). Raw json/jsonl/csv/parquet sources or a committed artifact with those columns. The placeholder and
every reward token must be one token of the model's tokenizer; a row without the placeholder, or with a
label count that differs from its placeholder count, is refused naming source, row and key.

    rlhf-flows stage train_prm base_uri=... dataset_uri=steps.jsonl output_uri=... input_key=input label_key=value
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.train.launch import TRAIN_RUNTIME, TrainFields, check_hardware, input_manifests, split_eval, train_and_commit
from rlhf_core.train.methods import prm
from stages.common import ConfigError, StageConfig


class Config(StageConfig, TrainFields):
    base_uri: str = Field(description="Causal LM to start from: committed artifact or plain HF folder (OpenRLHF --pretrain).")
    input_key: str = Field("input", description="Key of the step text (OpenRLHF --input_key).")
    label_key: str = Field("value", description="Key of the per-step labels (OpenRLHF --label_key; Math-Shepherd's 'value').")
    placeholder_token: str = Field("ки", min_length=1, description="Token ending every step (OpenRLHF --placeholder_token).")
    reward_tokens: list[str] = Field(["+", "-"], min_length=2, description="Label tokens, the positive (good step) "
                                     "first: a step's reward is its probability (OpenRLHF --reward_tokens).")
    dataset_probs: str | None = Field(None, description="Mixing probabilities of comma-separated sources, e.g. '0.7,0.3'.")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME

    @field_validator("reward_tokens")
    @classmethod
    def _distinct(cls, v):
        if len(set(v)) != len(v) or any(not t for t in v):
            raise ValueError(f"reward tokens must be distinct and non-empty, got {v}")
        return v


def load_rows(cfg: Config, eval: bool = False) -> list[tuple[str, int, dict]]:
    """(source, row number, row) from a committed artifact or raw OpenRLHF-format source(s): the training data,
    or with `eval` the eval_dataset (its eval_split, unmixed)."""
    uri, limit = (cfg.eval_dataset, cfg.max_eval_samples) if eval else (cfg.dataset_uri, cfg.max_samples)
    if "," not in uri and store.committed_any(uri, cfg.storage_options):
        rows = store.read_table(uri, storage_options=cfg.storage_options).to_pylist()
        return [(uri, i, r) for i, r in enumerate(rows[:limit] if limit else rows)]
    return data.load_mixture(uri, None if eval else cfg.dataset_probs, limit, cfg.seed, cfg.storage_options,
                             split=cfg.eval_split if eval else "train")


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    if cfg.placeholder_token in cfg.reward_tokens:
        raise ConfigError(f"placeholder_token {cfg.placeholder_token!r} is also one of the reward_tokens {cfg.reward_tokens}")
    base = model_inputs.model_manifest(cfg.base_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "train_prm", cfg.semantic(), {"base": base, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.base_uri, cfg.storage_options, manifest=base)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.base_uri)
    try:  # each must be one token: the loss reads one logit per reward token at one position per step
        ph = prm.token_id(tok, cfg.placeholder_token, f"{cfg.base_uri}: placeholder_token")
        reward_ids = [prm.token_id(tok, t, f"{cfg.base_uri}: reward token") for t in cfg.reward_tokens]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rows, eval_rows = split_eval(cfg, lambda ev: load_rows(cfg, ev))
    records, cut = prm.tokenize(rows, tok, cfg.input_key, cfg.label_key, cfg.placeholder_token, cfg.reward_tokens,
                                cfg.max_len, cfg.overlong)
    eval_records = prm.tokenize(eval_rows, tok, cfg.input_key, cfg.label_key, cfg.placeholder_token, cfg.reward_tokens,
                                cfg.max_len, cfg.overlong)[0] if eval_rows else []
    steps = sum(len(r["targets"]) for r in records)
    positive = sum(r["targets"][s][0] for r in records for s in range(len(r["targets"])))
    spec = {"placeholder_token": cfg.placeholder_token, "reward_tokens": cfg.reward_tokens, "placeholder_id": ph,
            "reward_ids": reward_ids}
    return train_and_commit(cfg, w, "prm", records, model_dir, tok, spec,
                            {"rows": len(records), "truncated": cut, "steps": steps, "positive_fraction": positive / steps},
                            model_uri=cfg.base_uri, eval_records=eval_records)
