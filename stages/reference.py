"""The reference pass: reads a `pairs` artifact and the reference model `ref_uri` (usually the initial
policy, as in Online-RLHF) and writes the same pairs plus ref_chosen_logp / ref_rejected_logp, the summed
response log-probs DPO needs. Computed once per dataset, like TRL's precompute_ref_log_probs; dpo then
trains a single model. It runs on the training hardware in the training dtype (rlhf_core.train.reference:
a DeepSpeed job, ZeRO-3-sharded when zero_stage=3, or inline on this process's device), so DPO's implied
margin is 0 at step 0. Tokenization (max_len, overlong) and dtype must match the dpo stage: dpo checks it.

    rlhf-flows stage reference pairs_uri=... ref_uri=... output_uri=... bf16=true num_gpus=8 zero_stage=3
"""
from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from rlhf_core.inputs import data, model_inputs, models
from rlhf_core import store
from rlhf_core.runtime import jobs
from rlhf_core.train import attention, batches
from rlhf_core.train.launch import gpu_count, tokenizer_id
from rlhf_core.train.reference import compute
from stages.common import StageConfig


class Config(StageConfig):
    pairs_uri: str = Field(description="Committed `pairs` artifact (prompt, chosen, rejected).")
    ref_uri: str = Field(description="Reference model: committed artifact or plain HF folder on any URI.")
    max_len: int = Field(512, ge=2, description="Max tokens of prompt + response (must equal dpo's).")
    overlong: Literal["truncate", "reject"] = Field("truncate", description="Samples longer than max_len: cut or refuse.")
    bf16: bool = Field(False, description="bfloat16 weights and compute, as the dpo stage trains (must equal dpo's).")
    packing_samples: bool = Field(False, description="Pack each batch into one row, as dpo does with packing_samples.")
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel, as dpo's (rlhf_core.train.attention).")
    # runtime: where it runs, not what it computes
    batch_size: int = Field(16, ge=1, description="Pairs per forward (per rank).")
    launcher: Literal["auto", "deepspeed", "torchrun", "python", "inline"] = Field(
        "auto", description="A job like the training stages (deepspeed, torchrun, python), or `inline` in this "
                            "process on its one device; auto: inline for one device without ZeRO-3, else deepspeed.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="3: shard the weights over the ranks (models too big for one device).")
    num_gpus: int | Literal["all"] = Field(
        1, description="Processes per node (GPUs; CPU processes without a GPU); all: every GPU of each node, as the "
        "training stages take it.")
    num_nodes: int = Field(1, ge=1, description="Nodes (with hostfile).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs.")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | {
        "batch_size", "launcher", "zero_stage", "num_gpus", "num_nodes", "hostfile"}

    @field_validator("num_gpus")
    @classmethod
    def _gpus(cls, v):
        return gpu_count(v)


def run(cfg: Config) -> store.Manifest:
    pairs_m = store.read_manifest(cfg.pairs_uri, storage_options=cfg.storage_options)
    ref_m = model_inputs.model_manifest(cfg.ref_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "reference", cfg.semantic(), {"pairs": pairs_m, "ref": ref_m},
                             cfg.storage_options)
    if (done := w.existing()):
        return done

    table = store.read_table(cfg.pairs_uri, storage_options=cfg.storage_options)
    data.validate_table(table, "pairs", cfg.pairs_uri)
    rows = table.to_pylist()
    ref_dir = model_inputs.fetch_model(cfg.ref_uri, cfg.storage_options, manifest=ref_m)
    tok = models.load_tokenizer(ref_dir, where=cfg.ref_uri)
    records, cut = batches.tokenize_pairs(rows, tok, cfg.max_len, cfg.overlong, where=cfg.pairs_uri, model_dir=ref_dir)
    attention.check(cfg.attn_implementation, ref_dir)
    w.begin()
    t0 = time.time()
    one_device = jobs.world_size(cfg.num_gpus, cfg.num_nodes, cfg.hostfile)[0] == 1 and cfg.zero_stage != 3
    launcher = cfg.launcher if cfg.launcher != "auto" else "inline" if one_device else "deepspeed"
    chosen, rejected, seconds = compute(records, ref_dir, models.pad_id(tok, ref_dir), store.cache_root() / "jobs" / w.fingerprint,
                               bf16=cfg.bf16, zero_stage=cfg.zero_stage, batch_size=cfg.batch_size,
                               packing_samples=cfg.packing_samples, launcher=launcher, num_gpus=cfg.num_gpus,
                               num_nodes=cfg.num_nodes, hostfile=cfg.hostfile, attn_implementation=cfg.attn_implementation)
    for r, c, j in zip(rows, chosen, rejected):
        r["ref_chosen_logp"], r["ref_rejected_logp"] = c, j
    w.write_table("pairs.parquet", data.to_table(rows, "pairs"))
    tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in records)
    wall = time.time() - t0
    return w.commit(metrics={"tokenizer_id": tokenizer_id(tok), "max_len": cfg.max_len, "overlong": cfg.overlong,
                             "bf16": cfg.bf16, "launcher": launcher, "attn_implementation": cfg.attn_implementation, "truncated": cut, "seconds": seconds, "job_seconds": wall, "tokens": tokens,
                             "tokens_per_s": tokens / seconds if seconds > 0 else None,
                             "ref_chosen_logp_mean": sum(chosen) / len(chosen),
                             "ref_rejected_logp_mean": sum(rejected) / len(rejected)})
