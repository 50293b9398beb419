"""The reference pass: reads a `pairs` artifact and the reference model `ref_uri` (usually the initial
policy, as in Online-RLHF) and writes the same pairs plus ref_chosen_logp / ref_rejected_logp, the summed
response log-probs DPO needs. Computed once per dataset, like TRL's precompute_ref_log_probs; dpo then
trains a single model. Tokenization (max_len, overlong) must match the dpo stage: dpo checks it.
"""
from __future__ import annotations

import time

from pydantic import Field
from typing import Literal

from rlhf_core import data, models, store
from rlhf_core.train import batches
from rlhf_core.train.launch import tokenizer_id
from rlhf_core.train.reference import pair_logps
from stages.common import StageConfig, stage_task


class Config(StageConfig):
    pairs_uri: str = Field(description="Committed `pairs` artifact (prompt, chosen, rejected).")
    ref_uri: str = Field(description="Reference model: committed artifact or plain HF folder on any URI.")
    max_len: int = Field(512, ge=2, description="Max tokens of prompt + response (must equal dpo's).")
    overlong: Literal["truncate", "reject"] = Field("truncate", description="Samples longer than max_len: cut or refuse.")
    batch_size: int = Field(16, ge=1, description="Pairs per forward.")


def run(cfg: Config) -> store.Manifest:
    pairs_m = store.read_manifest(cfg.pairs_uri, storage_options=cfg.storage_options)
    ref_m = store.model_manifest(cfg.ref_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "reference", cfg.semantic(), {"pairs": pairs_m, "ref": ref_m},
                             cfg.storage_options)
    if (done := w.existing()):
        return done
    import torch
    from transformers import AutoModelForCausalLM

    table = store.read_table(cfg.pairs_uri, storage_options=cfg.storage_options)
    data.validate_table(table, "pairs", cfg.pairs_uri)
    rows = table.to_pylist()
    ref_dir = store.fetch_model(cfg.ref_uri, cfg.storage_options, manifest=ref_m)
    tok = models.load_tokenizer(ref_dir, where=cfg.ref_uri)
    records, cut = batches.tokenize_pairs(rows, tok, cfg.max_len, cfg.overlong, where=cfg.pairs_uri, model_dir=ref_dir)
    w.begin()
    t0 = time.time()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32, use_safetensors=True)
    chosen, rejected = pair_logps(model, records, cfg.batch_size, models.pad_id(tok, ref_dir))
    for r, c, j in zip(rows, chosen, rejected):
        r["ref_chosen_logp"], r["ref_rejected_logp"] = c, j
    w.write_table("pairs.parquet", data.to_table(rows, "pairs"))
    return w.commit(metrics={"tokenizer_id": tokenizer_id(tok), "max_len": cfg.max_len, "overlong": cfg.overlong,
                             "truncated": cut, "seconds": time.time() - t0,
                             "ref_chosen_logp_mean": sum(chosen) / len(chosen),
                             "ref_rejected_logp_mean": sum(rejected) / len(rejected)})


task = stage_task("reference", run)
