"""DPO as a DeepSpeed job on one model: the loss compares the policy's summed response log-probs with the
reference log-probs stored as columns of the pairs artifact (stage `reference`, computed once per dataset).
Losses: sigmoid (DPO), ipo (on summed log-probs as OpenRLHF, or per token as TRL with length_normalize), cDPO
via label_smoothing; optional NLL on chosen (nll_loss_coef). Logged: implied rewards beta * (log pi - log ref),
reward accuracy and margins.

    rlhf-flows stage reference pairs_uri=... ref_uri=... output_uri=.../ref
    rlhf-flows stage dpo --config configs/demo.yaml policy_uri=... dataset_uri=.../ref output_uri=...
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.train import batches
from rlhf_core.train.launch import (TRAIN_RUNTIME, TrainFields, check_hardware, input_manifests, split_eval, tokenizer_id,
                                    train_and_commit)
from stages.common import ConfigError, StageConfig

REF_COLUMNS = ("ref_chosen_logp", "ref_rejected_logp")


class Config(StageConfig, TrainFields):
    policy_uri: str = Field(description="Policy to train: committed artifact or plain HF folder (usually the reference model too).")
    beta: float = Field(0.1, gt=0, description="KL strength beta of DPO.")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="DPO loss: sigmoid (DPO) or ipo.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO: assumed probability that a label is flipped.")
    nll_loss_coef: float = Field(0.0, ge=0, description="Weight of the chosen responses' NLL added to the loss.")
    length_normalize: bool = Field(False, description="ipo: each response's log-ratio divided by its token count "
                                   "(TRL's IPO: the same beta then asks for a margin of 1/(2 beta) per token, not in "
                                   "sum); false: summed log-probs (OpenRLHF's). See the stage's page.")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME

    @model_validator(mode="after")
    def _smoothing_is_sigmoid_only(self):
        if self.label_smoothing and self.loss_type != "sigmoid":  # IPO's squared loss has no label-flip term
            raise ValueError(f"label_smoothing (cDPO) applies to loss_type sigmoid only, not {self.loss_type!r}")
        if self.length_normalize and self.loss_type != "ipo":
            raise ValueError(f"length_normalize applies to loss_type ipo only, not {self.loss_type!r}")
        return self


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    policy = model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "dpo", cfg.semantic(), {"policy": policy, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.policy_uri, cfg.storage_options, manifest=policy)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.policy_uri)
    rows, eval_rows = split_eval(cfg, lambda ev: reference_rows(cfg, tok, ev))
    records, cut = batches.tokenize_pairs(rows, tok, cfg.max_len, cfg.overlong, where=cfg.dataset_uri, extra=REF_COLUMNS,
                                          model_dir=model_dir)
    eval_records = batches.tokenize_pairs(eval_rows, tok, cfg.max_len, cfg.overlong, where=cfg.eval_dataset or cfg.dataset_uri,
                                          extra=REF_COLUMNS, model_dir=model_dir)[0] if eval_rows else []
    spec = {k: getattr(cfg, k) for k in ("beta", "loss_type", "label_smoothing", "nll_loss_coef", "length_normalize")}
    return train_and_commit(cfg, w, "dpo", records, model_dir, tok, spec, {"rows": len(records), "truncated": cut},
                            model_uri=cfg.policy_uri, eval_records=eval_records)


def reference_rows(cfg: Config, tok, eval: bool) -> list[dict]:
    """Pairs with reference log-probs: the rows of a committed `reference` artifact (the training data, or with
    `eval` the eval_dataset: the reference stage run on the eval pairs), checked comparable with this run (the
    same tokenizer, max_len, overlong and dtype as its reference pass)."""
    uri, limit = (cfg.eval_dataset, cfg.max_eval_samples) if eval else (cfg.dataset_uri, cfg.max_samples)
    if eval and not store.committed_any(uri, cfg.storage_options):
        raise data.DataError(f"eval_dataset {uri}: dpo evaluates on pairs with reference log-probs {list(REF_COLUMNS)}, "
                             "a committed reference artifact: run the reference stage on the eval pairs, or set eval_holdout")
    table = store.read_table(uri, storage_options=cfg.storage_options)
    missing = [c for c in REF_COLUMNS if c not in table.column_names]
    if eval and missing:  # other pairs than the reference stage's: say what they lack
        raise data.DataError(f"eval_dataset {uri}: pairs lack {missing}: run the reference stage on them first")
    pairs = store.read_manifest(uri, "reference", cfg.storage_options)  # pairs + reference log-probs
    data.validate_table(table, "pairs", uri)
    if missing:
        raise data.DataError(f"{uri}: pairs lack {missing}: run the reference stage on them first")
    if (ref_tok := pairs.metrics.get("tokenizer_id")) != tokenizer_id(tok):
        raise ConfigError(f"policy {cfg.policy_uri} and the reference model of {uri} use different "
                          f"tokenizers ({tokenizer_id(tok)} vs {ref_tok}): their log-probs are not comparable")
    mine, theirs = (cfg.max_len, cfg.overlong, cfg.bf16), tuple(pairs.metrics.get(k, False) for k in ("max_len", "overlong", "bf16"))
    if mine != theirs:  # other tokens or another dtype: log-probs not comparable, margin != 0 at step 0
        raise ConfigError(f"dpo max_len/overlong/bf16 {mine} differ from the reference pass of {uri} "
                          f"{theirs}: rerun the reference stage with dpo's settings")
    if (ref_attn := pairs.metrics.get("attn_implementation", "sdpa")) != cfg.attn_implementation:
        # another kernel, another mask path: log-probs differ (gemma2 eager vs sdpa: 3.7e-3), margin != 0 at step 0
        raise ConfigError(f"dpo attn_implementation={cfg.attn_implementation} differs from the reference pass of {uri} "
                          f"({ref_attn}): rerun the reference stage with attn_implementation={cfg.attn_implementation}")
    rows = table.to_pylist()
    return rows[:limit] if limit else rows
