"""Stage `prepare`: OpenRLHF-format data sources -> one committed dataset artifact (prompts, sft or pairs).

`kind=samples` turns an existing dataset's responses into a `samples` artifact that score, then the rs or
csft filter, take as if generated (OpenRLHF's csft example scores the `chosen` column of a preference set):

    rlhf-flows stage prepare kind=samples data=prefs.jsonl input_key=prompt output_key=chosen output_uri=...

(for OpenRLHF's message-list format: `input_key=chosen apply_chat_template=true tokenizer_uri=...`; the last
message is the response).

Reads json / jsonl / csv / parquet files or `save_to_disk` folders on any fsspec URI, or hub datasets
(`org/name`, `org/name@dir`, `hf://datasets/org/name@rev/path`: docs/models.md), comma-separated with
mixing probabilities (`--prompt_data a,b --prompt_data_probs 0.7,0.3`), formats rows with OpenRLHF's keys
(`input_key`, `output_key`, `label_key`, `prompt_key`, `chosen_key`, `rejected_key`) and
`apply_chat_template` / `input_template`, checks every row, and commits parquet. Every later stage then
reads typed, validated rows; a bad row stops here, naming file, row and key, with nothing committed.

    rlhf-flows stage prepare kind=prompts data=s3://b/prompts.jsonl output_uri=...
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.inputs import data, model_inputs
from rlhf_core import store
from stages.common import StageConfig


class Config(StageConfig):
    kind: Literal["prompts", "sft", "pairs", "samples"] = Field(
        description="Which artifact to produce; `samples`: an existing dataset's responses (input_key / output_key, "
                    "or a message list ending with the answer) to score and filter like generated ones.")
    data: str = Field(description="Source URI(s), comma-separated (OpenRLHF --prompt_data / --dataset).")
    data_probs: str | None = Field(None, description="Mixing probabilities, comma-separated, one per source.")
    max_samples: int | None = Field(None, ge=1, description="Keep at most this many rows.")
    split: str = Field("train", description="Split of sources that have splits (OpenRLHF --train_split / --eval_split); "
                       "per source: 'uri@split'.")
    seed: int = Field(42, description="Seed of the mixing shuffle.")
    input_key: str = Field("input", description="Prompt / input column (a string or a message list).")
    output_key: str | None = Field(None, description="SFT answer column; None: last assistant message.")
    label_key: str | None = Field(None, description="Label column passed to reward functions.")
    prompt_key: str | None = Field(None, description="Prompt column of preference data.")
    chosen_key: str = Field("chosen", description="Chosen column of preference data.")
    rejected_key: str = Field("rejected", description="Rejected column of preference data.")
    apply_chat_template: bool = Field(False, description="Format with the tokenizer's chat template.")
    input_template: str | None = Field(None, description='e.g. "User: {}\\nAssistant: "')
    tokenizer_uri: str | None = Field(None, description="Model (artifact or plain HF folder) whose tokenizer formats chat templates.")
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template replacing the tokenizer's "
                                                "(OpenRLHF --tokenizer_chat_template).")


def run(cfg: Config) -> store.Manifest:
    if cfg.input_template is not None and "{}" not in cfg.input_template:
        raise ValueError(f"input_template {cfg.input_template!r} has no '{{}}' placeholder")
    if cfg.apply_chat_template and not cfg.tokenizer_uri:
        raise ValueError("apply_chat_template needs tokenizer_uri (a model artifact with a chat template)")
    sources = [s.strip() for s in cfg.data.split(",") if s.strip()]
    inputs = {f"source{i}": data.source_manifest(s, cfg.storage_options) for i, s in enumerate(sources)}
    if cfg.tokenizer_uri:
        inputs["tokenizer"] = model_inputs.model_manifest(cfg.tokenizer_uri, cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "prepare", cfg.semantic(), inputs, cfg.storage_options)
    if (done := w.existing()):
        return done

    tokenizer = None
    if cfg.tokenizer_uri:
        from rlhf_core.inputs import models

        tok_dir = model_inputs.fetch_model(cfg.tokenizer_uri, cfg.storage_options, manifest=inputs["tokenizer"])
        tokenizer = models.load_tokenizer(tok_dir, cfg.tokenizer_chat_template, cfg.tokenizer_uri)
    raw = data.load_mixture(sources, cfg.data_probs, cfg.max_samples, cfg.seed, cfg.storage_options, cfg.split)
    fmt = data.Format(**cfg.model_dump(include=set(data.Format.__dataclass_fields__)))
    rows = {"prompts": data.prompt_rows, "sft": data.sft_rows, "pairs": data.pair_rows,
            "samples": data.sample_rows}[cfg.kind](raw, fmt, tokenizer)
    table = data.to_table(rows, cfg.kind)
    data.validate_table(table, cfg.kind, cfg.data)

    w.begin()
    w.write_table(f"{cfg.kind}.parquet", table)
    return w.commit(metrics={"rows": table.num_rows, "sources": len(sources)})
