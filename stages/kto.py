"""KTO as a DeepSpeed job (arXiv:2402.01306; OpenRLHF train_kto, TRL KTOTrainer): unpaired completions
labelled desirable / undesirable, the loss rlhf_core.rl.losses.kto_loss with the KL reference point estimated
from mismatched (prompt, completion) pairs. The reference model's log-probs of every example and of its
mismatched pair are computed first, once, by the reference pass the dpo pipeline uses
(rlhf_core.train.reference: inline on one device, else a DeepSpeed job, ZeRO-3-sharded with zero_stage 3),
in the training dtype, so policy and reference agree at step 0; then one model trains.

Data: a committed `kto` artifact (prompt, completion, label), a committed `pairs` artifact (each pair becomes
one desirable and one undesirable row; the iterative loop feeds the pairs filter's output here), or raw
OpenRLHF-format sources: unpaired rows (input_key, output_key, label_key true/false) or paired rows
(chosen_key, rejected_key). Data with one class only is refused.

    rlhf-flows stage kto policy_uri=... dataset_uri=.../pairs output_uri=... beta=0.1 max_len=48
"""
from __future__ import annotations

import logging
from typing import ClassVar

from pydantic import Field

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.runtime import jobs
from rlhf_core.train import launch
from rlhf_core.train.launch import TRAIN_RUNTIME, SourceFields, TrainFields, check_hardware, input_manifests, train_and_commit
from rlhf_core.train.methods import kto
from rlhf_core.train.reference import compute
from stages.common import ConfigError, StageConfig

log = logging.getLogger("rlhf_flows")


class Config(StageConfig, TrainFields, SourceFields):
    policy_uri: str = Field(description="Policy to train: committed artifact or plain HF folder.")
    ref_uri: str | None = Field(None, description="Reference model (default: the policy itself).")
    input_key: str = Field("prompt", description="Prompt key of raw rows.")
    output_key: str = Field("completion", description="Completion key of raw unpaired rows.")
    label_key: str = Field("label", description="Key of raw unpaired rows: true = desirable, false = undesirable.")
    chosen_key: str = Field("chosen", description="Chosen key of raw paired rows (converted to desirable rows).")
    rejected_key: str = Field("rejected", description="Rejected key of raw paired rows (converted to undesirable rows).")
    beta: float = Field(0.1, gt=0, description="KTO beta (the implied reward's scale).")
    desirable_loss_weight: float = Field(1.0, gt=0, description="lambda_D, weight of desirable examples' losses.")
    undesirable_loss_weight: float = Field(1.0, gt=0, description="lambda_U, weight of undesirable examples' losses.")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | TRAIN_RUNTIME


def load_kto_rows(cfg: Config, tok, eval: bool = False) -> list[dict]:
    """kto rows from a committed kto or pairs artifact, or raw unpaired / paired sources: the training data, or
    with `eval` the eval_dataset (its eval_split, unmixed)."""
    uri, limit = (cfg.eval_dataset, cfg.max_eval_samples) if eval else (cfg.dataset_uri, cfg.max_samples)
    if "," not in uri and store.committed_any(uri, cfg.storage_options):
        table = store.read_table(uri, storage_options=cfg.storage_options)
        if "completion" in table.column_names:
            data.validate_table(table, "kto", uri)
            rows = table.to_pylist()
        else:
            data.validate_table(table, "pairs", uri)
            rows = data.pairs_to_kto(table.to_pylist())
        return rows[:limit] if limit else rows
    raw = data.load_mixture(uri, None if eval else cfg.dataset_probs, limit, cfg.seed, cfg.storage_options,
                            split=cfg.eval_split if eval else "train")
    fmt = data.Format(input_key=cfg.input_key, output_key=cfg.output_key, label_key=cfg.label_key, chosen_key=cfg.chosen_key,
                      rejected_key=cfg.rejected_key, apply_chat_template=cfg.apply_chat_template,
                      input_template=cfg.input_template)
    return data.kto_rows(raw, fmt, tok)


def run(cfg: Config) -> store.Manifest:
    check_hardware(cfg)
    policy = model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options)
    ref = model_inputs.model_manifest(cfg.ref_uri, cfg.storage_options) if cfg.ref_uri else policy
    w = store.ArtifactWriter(cfg.output_uri, "kto", cfg.semantic(), {"policy": policy, "ref": ref, **input_manifests(cfg)},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    model_dir = model_inputs.fetch_model(cfg.policy_uri, cfg.storage_options, manifest=policy)
    tok = models.load_tokenizer(model_dir, cfg.tokenizer_chat_template, cfg.policy_uri)
    rows, eval_rows = launch.split_eval(cfg, lambda ev: load_kto_rows(cfg, tok, ev))
    n_d, n_u = data.check_kto_classes(rows, cfg.dataset_uri, cfg.label_key)
    ratio = cfg.desirable_loss_weight * n_d / (cfg.undesirable_loss_weight * n_u)
    if not 1 <= ratio <= 4 / 3:  # the paper's sec. 4.2 advice; TRL warns likewise
        log.warning("kto: desirable_loss_weight x %d desirable / (undesirable_loss_weight x %d undesirable) = %.2f, "
                    "outside the recommended [1, 4/3]", n_d, n_u, ratio)
    records, cut = kto.tokenize(rows, tok, cfg.max_len, cfg.overlong, where=cfg.dataset_uri, seed=cfg.seed, model_dir=model_dir)
    eval_records = kto.tokenize(eval_rows, tok, cfg.max_len, cfg.overlong, where=cfg.eval_dataset or cfg.dataset_uri,
                                seed=cfg.seed, model_dir=model_dir)[0] if eval_rows else []

    ref_dir = model_inputs.fetch_model(cfg.ref_uri, cfg.storage_options, manifest=ref) if cfg.ref_uri else model_dir
    if cfg.ref_uri and launch.tokenizer_id(models.load_tokenizer(ref_dir, where=cfg.ref_uri)) != launch.tokenizer_id(tok):
        raise ConfigError(f"policy {cfg.policy_uri} and reference {cfg.ref_uri} use different tokenizers: "
                          "their log-probs are not comparable")
    one_device = jobs.world_size(cfg.num_gpus, cfg.num_nodes, cfg.hostfile)[0] == 1 and cfg.zero_stage != 3  # "all" too
    w.begin()
    pairs = [{"chosen_ids": r["ids"], "chosen_start": r["start"], "rejected_ids": r["kl_ids"], "rejected_start": r["kl_start"]}
             for r in records + eval_records]  # the reference pass forwards (example, mismatched pair) as (chosen, rejected)
    ref_lp, ref_kl, ref_s = compute(pairs, ref_dir, models.pad_id(tok, model_dir), store.cache_root() / "jobs" / f"{w.fingerprint}-ref",
                                    bf16=cfg.bf16, zero_stage=3 if cfg.zero_stage == 3 else 0, batch_size=cfg.micro_train_batch_size,
                                    packing_samples=cfg.packing_samples, launcher="inline" if one_device else cfg.launcher,
                                    num_gpus=cfg.num_gpus, num_nodes=cfg.num_nodes, hostfile=cfg.hostfile,
                                    attn_implementation=cfg.attn_implementation, max_len=cfg.max_len)
    for r, a, b in zip(records + eval_records, ref_lp, ref_kl):  # one pass for training and eval records
        r["ref_logp"], r["ref_kl_logp"] = a, b
    spec = {k: getattr(cfg, k) for k in ("beta", "desirable_loss_weight", "undesirable_loss_weight")}
    return train_and_commit(cfg, w, "kto", records, model_dir, tok, spec,
                            {"rows": len(records), "desirable": n_d, "undesirable": n_u, "truncated": cut,
                             "reference_seconds": ref_s}, model_uri=cfg.policy_uri, eval_records=eval_records)
