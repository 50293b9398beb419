"""Row schemas and loaders for OpenRLHF-style inputs.

Sources are fsspec URIs to json / jsonl / csv / parquet files, `datasets.save_to_disk` folders, committed
artifacts of this project, or hub datasets (`org/name`, `org/name@dir|subset|split`, `hf://datasets/...`:
hub.py), whose lineage carries the commit sha they were read at. Several sources are given comma-separated with mixing probabilities
(OpenRLHF's `--prompt_data a,b --prompt_data_probs 0.7,0.3`). Rows are formatted with a chat template
(`apply_chat_template`, message lists such as `context_messages`) or an `input_template`
("User: {}\\nAssistant: "). Every bad row raises `DataError` naming the file, the row number and the key.
"""
from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core import store
from rlhf_core.inputs import hub

log = logging.getLogger("rlhf_flows")

# Column -> arrow type for each artifact kind (DESIGN.md "Data"). Optional columns may be absent.
SCHEMAS: dict[str, dict[str, pa.DataType]] = {
    "prompts": {"prompt": pa.string(), "label": pa.string(), "source": pa.string()},
    "samples": {"prompt": pa.string(), "response": pa.string(), "sample_index": pa.int32(), "prompt_tokens": pa.int32(),
                "response_tokens": pa.int32(), "finish_reason": pa.string(), "logprob": pa.float64(), "label": pa.string()},
    "scored": {"prompt": pa.string(), "response": pa.string(), "sample_index": pa.int32(), "reward": pa.float64(),
               "score": pa.float64(), "label": pa.string(), "prompt_tokens": pa.int32(), "response_tokens": pa.int32(),
               "finish_reason": pa.string(), "logprob": pa.float64(), "step_rewards": pa.list_(pa.float64())},
    "pairs": {"prompt": pa.string(), "chosen": pa.string(), "rejected": pa.string(), "chosen_reward": pa.float64(),
              "rejected_reward": pa.float64(), "margin": pa.float64(), "ref_chosen_logp": pa.float64(),
              "ref_rejected_logp": pa.float64(), "chosen_finished": pa.bool_(), "rejected_finished": pa.bool_()},
    "sft": {"input": pa.string(), "output": pa.string(), "reward": pa.float64(), "finished": pa.bool_()},
    "kto": {"prompt": pa.string(), "completion": pa.string(), "label": pa.bool_(), "finished": pa.bool_()},
}
REQUIRED = {
    "prompts": ("prompt",),
    "samples": ("prompt", "response", "sample_index"),
    "scored": ("prompt", "response", "sample_index", "reward"),
    "pairs": ("prompt", "chosen", "rejected"),
    "sft": ("input", "output"),
    "kto": ("prompt", "completion", "label"),
}


class DataError(ValueError):
    """Bad input data; the message names file, row and key."""


def to_table(rows: list[dict], kind: str) -> pa.Table:
    """Rows -> an arrow table with the kind's column types (only the columns present in the first row)."""
    if not rows:
        raise DataError(f"no {kind} rows to write (empty dataset)")
    schema = SCHEMAS[kind]
    cols = [c for c in rows[0] if c in schema] + [c for c in rows[0] if c not in schema]
    fields = [pa.field(c, schema.get(c, pa.infer_type([r.get(c) for r in rows[:50]]))) for c in cols]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))


def validate_table(table: pa.Table, kind: str, where: str) -> None:
    missing = [c for c in REQUIRED[kind] if c not in table.column_names]
    if missing:
        raise DataError(f"{where}: {kind} data lacks column(s) {missing}; it has {table.column_names}")
    for c in REQUIRED[kind]:
        nulls = table.column(c).null_count
        if nulls:
            idx = table.column(c).is_null().to_pylist().index(True)
            raise DataError(f"{where} row {idx}: key {c!r} is null ({nulls} null rows)")


# ---------------------------------------------------------------------------------------------- reading sources
SPLIT_NAMED = re.compile(r"^(train|test|validation|valid|dev|eval)(?=[-_.]|$)")


def source_split(source: str) -> tuple[str, str | None]:
    """"uri@split" -> (uri, split): a split picked per source (OpenRLHF's `dataset@dir`); "@" counts only in
    the last path component."""
    head, sep, last = source.rpartition("/")
    if "@" not in last:
        return source, None
    name, split = last.rsplit("@", 1)
    return head + sep + name, split


def source_manifest(source: str, storage_options: dict | None = None) -> store.Manifest:
    """Lineage entry of one data source: a hub dataset's (its commit, checked before any work), else
    `store.source_manifest` of the URI without its "@split"."""
    ref = hub.dataset_ref(source)
    if ref is not None:
        return hub.dataset_manifest(ref)
    return store.source_manifest(source_split(source)[0], storage_options)


def hub_rows(ref: hub.Ref, split: str = "train", limit: int | None = None) -> list[dict]:
    """The rows (the first `limit`) of a hub dataset's split: the one its `@X` names (strict), else `split`
    (OpenRLHF's --dataset_split / --eval_split), else, with a warning, train or the first split there is."""
    ds, own = hub.load_dataset(ref)
    available = list(ds)
    if own is not None and own not in available:
        raise DataError(f"dataset {ref}: {ref.repo} has no folder, subset or split {own!r}; its splits: {available}")
    want = own or split
    if want not in available:
        log.warning("dataset %s has no split %r: reading %r", ref, want, "train" if "train" in available else available[0])
        want = "train" if "train" in available else available[0]
    rows = ds[want]
    return (rows.select(range(min(limit, len(rows)))) if limit else rows).to_list()  # arrow: only these are read


def read_rows(uri: str, storage_options: dict | None = None, split: str = "train", strict: bool = False) -> list[dict]:
    """Every row of one source (of its `split`, where it has splits) as dicts. The format follows the file
    ending or the folder's contents. Splits (OpenRLHF's train_split / eval_split): a save_to_disk
    DatasetDict's split, files named by split (train.jsonl, test-00000-of-00001.parquet), or a sub-folder
    named by split; a folder without splits is the dataset whatever the split. With `strict` (a split named
    per source, "uri@split"), a missing split is an error; otherwise the first split stands in, with a warning."""
    fs, path = store.filesystem(uri, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"data source {uri} does not exist")
    proto = uri.split("://", 1)[0] + "://" if "://" in uri else ""

    def pick(available: list[str]) -> str:
        if split in available:
            return split
        if strict or not available:
            raise DataError(f"{uri}: no split {split!r}; it has {available}")
        log.warning("%s has no split %r: reading %r", uri, split, available[0])
        return "train" if "train" in available else available[0]

    if fs.isdir(path):
        entries = fs.ls(path, detail=False)
        names = {p.rsplit("/", 1)[-1] for p in entries}
        if store.MANIFEST in names:
            return store.read_table(uri, storage_options=storage_options).to_pylist()
        if "dataset_info.json" in names or "state.json" in names or "dataset_dict.json" in names:
            import datasets  # save_to_disk folder

            ds = datasets.load_from_disk(uri, storage_options=dict(storage_options or {}) or None)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[pick(list(ds))]
            return ds.to_list()
        files = sorted(p for p in entries if p.endswith((".jsonl", ".json", ".parquet", ".csv")))
        by_split: dict[str, list[str]] = {}
        for f in files:
            if m := SPLIT_NAMED.match(f.rsplit("/", 1)[-1]):
                by_split.setdefault(m.group(1), []).append(f)
        dirs = sorted(n for n in names if SPLIT_NAMED.fullmatch(n) and fs.isdir(store.join(path, n)))
        if by_split:
            files = by_split[pick(sorted(by_split))]
        elif dirs:
            return read_rows(store.join(uri, pick(dirs)), storage_options)
        elif strict:
            raise DataError(f"{uri}: no split {split!r}: the folder has no split-named files or sub-folders")
        if not files:
            raise DataError(f"{uri}: folder holds no json/jsonl/csv/parquet file and no {store.MANIFEST}")
        return [r for f in files for r in read_rows(proto + f if proto else f, storage_options)]
    if strict:
        raise DataError(f"{uri}: a file has no splits; {split!r} was asked for")
    with fs.open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".parquet"):
        return pq.ParquetFile(pa.BufferReader(raw)).read().to_pylist()
    if path.endswith(".csv"):
        import pyarrow.csv as pcsv

        return pcsv.read_csv(pa.BufferReader(raw)).to_pylist()
    text = raw.decode("utf-8")
    if path.endswith(".jsonl") or (not path.endswith(".json") and text.lstrip()[:1] == "{"):
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{uri} row {i}: not valid JSON ({e.msg})") from None
        return rows
    data = json.loads(text)
    if isinstance(data, dict):  # {"train": [...]} or {"data": [...]}
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise DataError(f"{uri}: a .json source must hold a list of rows")
    return data


def load_mixture(sources: str | list[str], probs: str | list[float] | None = None, max_samples: int | None = None,
                 seed: int = 42, storage_options: dict | None = None, split: str = "train") -> list[tuple[str, int, dict]]:
    """Rows of one or more sources mixed by probability, as (source_uri, row_number, row).

    With probabilities, source i contributes round(p_i * N) rows (N = max_samples, else the total size),
    drawn in a seeded shuffle and cycled if it is smaller, like OpenRLHF's blending of datasets."""
    srcs = [s.strip() for s in sources.split(",")] if isinstance(sources, str) else list(sources)
    srcs = [s for s in srcs if s]
    if not srcs:
        raise DataError("no data source given")
    if isinstance(probs, str):
        try:
            probs = [float(p) for p in probs.split(",")]
        except ValueError:
            raise DataError(f"mixing probabilities {probs!r} are not numbers") from None
    per_source = []
    unmixed = probs is None or len(srcs) == 1  # then only the first max_samples rows of any source can be kept
    for s in srcs:
        if (ref := hub.dataset_ref(s)) is not None:
            per_source.append([(s, i, r) for i, r in enumerate(hub_rows(ref, split, max_samples if unmixed else None))])
            continue
        uri, own = source_split(s)
        per_source.append([(s, i, r) for i, r in enumerate(read_rows(uri, storage_options, own or split, strict=bool(own)))])
    rng = random.Random(seed)
    if probs is None or len(srcs) == 1:
        if probs is not None and len(probs) != 1:
            raise DataError(f"{len(probs)} mixing probabilities for 1 source ({srcs[0]})")
        rows = [r for rs in per_source for r in rs]
    else:
        if len(probs) != len(srcs):
            raise DataError(f"{len(probs)} mixing probabilities for {len(srcs)} sources: {srcs}")
        if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
            raise DataError(f"mixing probabilities {probs} must be >= 0 and sum to 1 (they sum to {sum(probs):g})")
        total = max_samples or sum(len(rs) for rs in per_source)
        rows = []
        for p, rs in zip(probs, per_source):
            if not rs:
                continue
            order = list(range(len(rs)))
            rng.shuffle(order)
            rows += [rs[order[k % len(rs)]] for k in range(round(p * total))]
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise DataError(f"no rows in {', '.join(srcs)}")
    return rows


# ---------------------------------------------------------------------------------------------- formatting
@dataclass
class Format:
    """How raw rows become text: OpenRLHF's keys and templates."""

    input_key: str = "input"
    output_key: str | None = None
    label_key: str | None = None
    prompt_key: str | None = None
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    apply_chat_template: bool = False
    input_template: str | None = None


def _get(row: dict, key: str, src: str, i: int) -> Any:
    if key not in row:
        raise DataError(f"{src} row {i}: missing key {key!r} (row has {sorted(row)})")
    if row[key] is None:
        raise DataError(f"{src} row {i}: key {key!r} is null")
    return row[key]


def _messages(value: Any, src: str, i: int, key: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    raise DataError(f"{src} row {i}: key {key!r} must be a string or a list of {{role, content}} messages, "
                    f"got {type(value).__name__}")


def format_prompt(value: Any, fmt: Format, tokenizer, src: str, i: int, key: str) -> str:
    if fmt.apply_chat_template:
        if tokenizer is None:
            raise DataError("apply_chat_template needs a tokenizer")
        messages = _messages(value, src, i, key)  # validate before touching the tokenizer
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise DataError(f"{src} row {i}: key {key!r} must be a string (set apply_chat_template for message "
                        f"lists), got {type(value).__name__}")
    return fmt.input_template.format(value) if fmt.input_template else value


def prompt_rows(raw: list[tuple[str, int, dict]], fmt: Format, tokenizer=None) -> list[dict]:
    """Raw rows -> `prompts` rows (prompt, label, source)."""
    out = []
    for src, i, row in raw:
        prompt = format_prompt(_get(row, fmt.input_key, src, i), fmt, tokenizer, src, i, fmt.input_key)
        label = row.get(fmt.label_key) if fmt.label_key else None
        if fmt.label_key and fmt.label_key not in row:
            raise DataError(f"{src} row {i}: missing key {fmt.label_key!r} (label_key)")
        out.append({"prompt": prompt, "label": None if label is None else str(label), "source": src})
    return out


def sft_rows(raw: list[tuple[str, int, dict]], fmt: Format, tokenizer=None) -> list[dict]:
    """Raw rows -> `sft` rows (input, output). Without output_key the input must be a message list whose
    last message is the assistant's answer."""
    out = []
    for src, i, row in raw:
        value = _get(row, fmt.input_key, src, i)
        if fmt.output_key:
            inp = format_prompt(value, fmt, tokenizer, src, i, fmt.input_key)
            output = _get(row, fmt.output_key, src, i)
            if not isinstance(output, str):
                raise DataError(f"{src} row {i}: key {fmt.output_key!r} must be a string, got {type(output).__name__}")
        else:
            msgs = _messages(value, src, i, fmt.input_key)
            if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                raise DataError(f"{src} row {i}: without output_key, {fmt.input_key!r} must end with an assistant message")
            inp = format_prompt(msgs[:-1], Format(apply_chat_template=True), tokenizer, src, i, fmt.input_key)
            output = msgs[-1]["content"]
        out.append({"input": inp, "output": output})
    return out


def conversation_rows(raw: list[tuple[str, int, dict]], key: str) -> list[dict]:
    """Raw rows -> {"messages": [...]} for multi-turn SFT: `key` must hold a list of {role, content} messages
    (OpenRLHF's chat format) with at least one assistant message."""
    out = []
    for src, i, row in raw:
        value = _get(row, key, src, i)
        if not (isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                          and isinstance(m.get("content"), str) for m in value)):
            raise DataError(f"{src} row {i}: multiturn needs key {key!r} to be a list of {{role, content}} messages, "
                            f"got {type(value).__name__}")
        if not any(m["role"] == "assistant" for m in value):
            raise DataError(f"{src} row {i}: key {key!r} has no assistant message: nothing to train on")
        out.append({"messages": value})
    return out


def sample_rows(raw: list[tuple[str, int, dict]], fmt: Format, tokenizer=None) -> list[dict]:
    """Raw rows -> `samples` rows (prompt, response, sample_index, label): an existing dataset's responses
    to score and filter like generated ones (OpenRLHF's csft example scores `--input_key chosen` of a
    preference set). Prompt and response are read as for sft rows; sample_index counts per prompt."""
    seen: dict[str, int] = {}
    out = []
    for (src, i, row), r in zip(raw, sft_rows(raw, fmt, tokenizer)):
        label = row.get(fmt.label_key) if fmt.label_key else None
        out.append({"prompt": r["input"], "response": r["output"], "sample_index": seen.get(r["input"], 0),
                    "label": None if label is None else str(label)})
        seen[r["input"]] = seen.get(r["input"], 0) + 1
    return out


def pair_rows(raw: list[tuple[str, int, dict]], fmt: Format, tokenizer=None) -> list[dict]:
    """Raw rows -> `pairs` rows (prompt, chosen, rejected). chosen/rejected may be message lists whose last
    message is the answer (OpenRLHF's reward-dataset format); the rest becomes the prompt."""
    out = []
    for src, i, row in raw:
        chosen, rejected = _get(row, fmt.chosen_key, src, i), _get(row, fmt.rejected_key, src, i)
        if isinstance(chosen, list):
            msgs = _messages(chosen, src, i, fmt.chosen_key)
            rej = _messages(rejected, src, i, fmt.rejected_key)
            prompt = format_prompt(msgs[:-1], Format(apply_chat_template=True), tokenizer, src, i, fmt.chosen_key)
            chosen, rejected = msgs[-1]["content"], rej[-1]["content"]
        else:
            value = _get(row, fmt.prompt_key, src, i) if fmt.prompt_key else ""
            prompt = format_prompt(value, fmt, tokenizer, src, i, fmt.prompt_key or "prompt") if fmt.prompt_key else ""
        for k, v in ((fmt.chosen_key, chosen), (fmt.rejected_key, rejected)):
            if not isinstance(v, str):
                raise DataError(f"{src} row {i}: key {k!r} must be a string, got {type(v).__name__}")
            if not v.strip():
                raise DataError(f"{src} row {i}: key {k!r} is empty")
        if chosen == rejected:  # no preference to learn; DPO and RM training would refuse it later
            raise DataError(f"{src} row {i}: {fmt.chosen_key!r} and {fmt.rejected_key!r} are identical ({chosen[:40]!r})")
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def kto_rows(raw: list[tuple[str, int, dict]], fmt: Format, tokenizer=None) -> list[dict]:
    """Raw rows -> `kto` rows (prompt, completion, label): unpaired rows with `label_key` true (desirable) or
    false (undesirable), OpenRLHF's --input_key / --output_key / --label_key; or paired preference rows
    (chosen_key and rejected_key present, no label_key), each converted to one desirable and one undesirable
    row (TRL's unpair_preference_dataset)."""
    out = []
    for src, i, row in raw:
        if fmt.label_key not in row and fmt.chosen_key in row and fmt.rejected_key in row:
            for p in pair_rows([(src, i, row)], Format(prompt_key=fmt.input_key, chosen_key=fmt.chosen_key,
                                                       rejected_key=fmt.rejected_key, input_template=fmt.input_template,
                                                       apply_chat_template=fmt.apply_chat_template), tokenizer):
                out += pairs_to_kto([p])
            continue
        label = _get(row, fmt.label_key, src, i)
        if not isinstance(label, bool) and label not in (0, 1):
            raise DataError(f"{src} row {i}: key {fmt.label_key!r} must be true or false (desirable or not), got {label!r}")
        r = sft_rows([(src, i, row)], fmt, tokenizer)[0]
        if not r["output"].strip():
            raise DataError(f"{src} row {i}: key {fmt.output_key!r} is empty")
        out.append({"prompt": r["input"], "completion": r["output"], "label": bool(label)})
    return out


def pairs_to_kto(rows: list[dict]) -> list[dict]:
    """`pairs` rows -> `kto` rows: chosen desirable, rejected undesirable, each with the pair's prompt."""
    out = []
    for r in rows:
        for k, label in (("chosen", True), ("rejected", False)):
            row = {"prompt": r.get("prompt") or "", "completion": r[k], "label": label}
            if r.get(f"{k}_finished") is not None:
                row["finished"] = r[f"{k}_finished"]
            out.append(row)
    return out


def check_kto_classes(rows: list[dict], where: str, label_key: str = "label") -> tuple[int, int]:
    """(desirable, undesirable) counts; KTO data with one class only is refused naming the file and key."""
    n_d = sum(bool(r["label"]) for r in rows)
    if n_d == 0 or n_d == len(rows):
        which = "true (desirable)" if n_d else "false (undesirable)"
        raise DataError(f"{where}: all {len(rows)} rows have {label_key!r} {which}: KTO needs both desirable "
                        f"and undesirable examples")
    return n_d, len(rows) - n_d
