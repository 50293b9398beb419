"""lora_combine: merge a LoRA adapter into its base and commit the result as a plain model artifact
(OpenRLHF's openrlhf/cli/lora_combiner.py, `--is_rm` for reward models).

Input: a model artifact trained with `lora_rank > 0` (its adapter under adapter/; with `lora_merge=false`
the root holds no weights). The base is the one its lineage names (sft/dpo: `policy`, train_rm: `base`, at
the version it was trained on), or `base_uri`. Each adapted weight becomes W + (alpha / r) * B @ A. A reward
model's adapter (peft task SEQ_CLS) merges into a one-label sequence-classification model, with train_rm's
reward_mean / reward_std in its config; `is_rm` states which one you expect and is checked. Output: an HF
folder (safetensors + tokenizer) that every stage loads like any other model.

Stages load adapter-only artifacts on their own (rlhf_core.inputs.model_inputs.fetch_model merges them into a cache once
per machine); this stage is for handing the merged model on (serving, export, another tool).

    rlhf-flows stage lora_combine model_uri=runs/x/sft output_uri=runs/x/sft-merged
    rlhf-flows stage lora_combine model_uri=runs/x/reward_model is_rm=true output_uri=runs/x/rm-merged
"""
from __future__ import annotations

import json
import tempfile

from pydantic import Field

from rlhf_core.inputs import model_inputs, models
from rlhf_core import store
from stages.common import StageConfig


class Config(StageConfig):
    model_uri: str = Field(description="Committed model artifact holding a LoRA adapter in adapter/ (OpenRLHF --lora_path).")
    base_uri: str | None = Field(None, description="Base model (artifact or plain HF folder); default: the one the "
                                 "artifact's lineage names (OpenRLHF --model_path).")
    is_rm: bool | None = Field(None, description="The adapter is a reward model's (OpenRLHF --is_rm); checked against "
                               "the adapter's task type. Unset: taken from it.")
    bf16: bool = Field(False, description="Save the merged weights in bfloat16 (default fp32).")


def run(cfg: Config) -> store.Manifest:
    m = model_inputs.model_manifest(cfg.model_uri, cfg.storage_options)
    files = [f["path"] for f in m.files]
    if m.stage == "source" or f"{models.ADAPTER_DIR}/adapter_config.json" not in files:
        raise models.ModelInputError(f"lora_combine: {cfg.model_uri} holds no LoRA adapter ({models.ADAPTER_DIR}/"
                                    f"adapter_config.json): it is not a model trained with lora_rank > 0")
    base = model_inputs.model_manifest(cfg.base_uri, cfg.storage_options) if cfg.base_uri else model_inputs.adapter_base(m, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "lora_combine", cfg.semantic(), {"adapter": m, "base": base}, cfg.storage_options)
    if (done := w.existing()):
        return done

    artifact_dir = model_inputs.fetch_model(cfg.model_uri, cfg.storage_options, manifest=m, merge=False)
    task = json.loads((artifact_dir / models.ADAPTER_DIR / "adapter_config.json").read_text()).get("task_type")
    if cfg.is_rm is not None and cfg.is_rm != (task == "SEQ_CLS"):
        raise models.ModelInputError(f"lora_combine: is_rm={cfg.is_rm} but the adapter of {cfg.model_uri} has task "
                                    f"type {task!r} ({'a reward model' if task == 'SEQ_CLS' else 'a causal LM'})")
    base_dir = model_inputs.fetch_model(base.uri, cfg.storage_options, manifest=base)
    with tempfile.TemporaryDirectory() as tmp:
        is_rm = models.merge_adapter(base_dir, artifact_dir, tmp, bf16=cfg.bf16, rm_stats=m.metrics)
        w.begin()
        w.upload_dir(tmp)
    return w.commit(metrics={"is_rm": is_rm, "adapter_task": task, "base": base.uri, "bf16": cfg.bf16,
                             **{k: m.metrics[k] for k in ("reward_mean", "reward_std") if is_rm and k in m.metrics}})
