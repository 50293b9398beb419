"""Loaders for OpenRLHF-format inputs, and the named errors for bad rows."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.inputs import data


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reads_every_format_on_s3_and_local(s3_root, tmp_path):
    import datasets
    import fsspec

    rows = [{"input": f"q{i}", "label": str(i)} for i in range(4)]
    local_jsonl = _jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "a.csv").write_text("input,label\n" + "".join(f"q{i},{i}\n" for i in range(4)))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("a.jsonl", "a.json", "a.parquet"):
        fsspec.filesystem("s3", client_kwargs={"endpoint_url": __import__("os").environ["AWS_ENDPOINT_URL"]},
                          skip_instance_cache=True).put_file(str(tmp_path / name), f"{s3_root}/{name}".removeprefix("s3://"))
    for uri in [local_jsonl, str(tmp_path / "a.json"), str(tmp_path / "a.parquet"), str(tmp_path / "saved"),
                f"{s3_root}/a.jsonl", f"{s3_root}/a.json", f"{s3_root}/a.parquet"]:
        got = data.read_rows(uri)
        assert [r["input"] for r in got] == ["q0", "q1", "q2", "q3"], uri
    assert [r["label"] for r in data.read_rows(str(tmp_path / "a.csv"))] == [0, 1, 2, 3]


def test_mixing_probabilities_and_max_samples(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}"} for i in range(10)])
    b = _jsonl(tmp_path / "b.jsonl", [{"input": f"b{i}"} for i in range(10)])
    rows = data.load_mixture(f"{a},{b}", "0.8,0.2", max_samples=10, seed=1)
    assert len(rows) == 10 and sum(r[2]["input"].startswith("a") for r in rows) == 8
    assert len(data.load_mixture(a, None, max_samples=3)) == 3
    with pytest.raises(data.DataError, match=r"1 mixing probabilities for 2 sources"):
        data.load_mixture(f"{a},{b}", "1.0")
    with pytest.raises(data.DataError, match=r"must be >= 0 and sum to 1 \(they sum to 0.9\)"):
        data.load_mixture(f"{a},{b}", "0.5,0.4")


def test_chat_template_and_input_template(tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer_dir)
    raw = [("f", 0, {"context_messages": [{"role": "user", "content": "Review of the tea:"}], "label": 1})]
    out = data.prompt_rows(raw, data.Format(input_key="context_messages", label_key="label", apply_chat_template=True), tok)
    assert out == [{"prompt": "<|user|>Review of the tea:\n<|assistant|>", "label": "1", "source": "f"}]
    out = data.prompt_rows([("f", 0, {"q": "hi"})], data.Format(input_key="q", input_template="User: {}\nAssistant: "))
    assert out[0]["prompt"] == "User: hi\nAssistant: "
    sft = data.sft_rows([("f", 0, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})],
                        data.Format(input_key="messages", apply_chat_template=True), tok)
    assert sft == [{"input": "<|user|>a\n<|assistant|>", "output": "b"}]
    pairs = data.pair_rows([("f", 0, {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
                                      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]})],
                           data.Format(apply_chat_template=True), tok)
    assert pairs == [{"prompt": "<|user|>q\n<|assistant|>", "chosen": "good", "rejected": "bad"}]


def test_missing_key_names_key_file_and_row(tmp_path):
    src = _jsonl(tmp_path / "p.jsonl", [{"input": "ok"}, {"input": "ok"}, {"question": "no input"}])
    with pytest.raises(data.DataError, match=r"p.jsonl row 2: missing key 'input' \(row has \['question'\]\)"):
        data.prompt_rows(data.load_mixture(src), data.Format())


def test_wrong_type_where_messages_expected(tmp_path):
    src = _jsonl(tmp_path / "m.jsonl", [{"context_messages": 42}])
    with pytest.raises(data.DataError, match=r"m.jsonl row 0: key 'context_messages' must be a string or a list of"):
        data.prompt_rows(data.load_mixture(src), data.Format(input_key="context_messages", apply_chat_template=True), object())
    with pytest.raises(data.DataError, match=r"row 0: key 'context_messages' must be a string \(set apply_chat_template"):
        data.prompt_rows(data.load_mixture(src), data.Format(input_key="context_messages"))


def test_empty_dataset_and_bad_json_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(data.DataError, match=r"no rows in .*empty.jsonl"):
        data.load_mixture(str(empty))
    with pytest.raises(data.DataError, match="no sft rows to write"):
        data.to_table([], "sft")
    (tmp_path / "bad.jsonl").write_text('{"input": "a"}\n{"input": \n')
    with pytest.raises(data.DataError, match=r"bad.jsonl row 1: not valid JSON"):
        data.read_rows(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data source .*nope.jsonl does not exist"):
        data.read_rows(str(tmp_path / "nope.jsonl"))


def test_validate_table_names_null_rows():
    t = pa.table({"prompt": ["a", None], "chosen": ["x", "y"], "rejected": ["z", "w"]})
    with pytest.raises(data.DataError, match=r"pairs.parquet row 1: key 'prompt' is null"):
        data.validate_table(t, "pairs", "pairs.parquet")
    with pytest.raises(data.DataError, match=r"lacks column\(s\) \['chosen', 'rejected'\]"):
        data.validate_table(pa.table({"prompt": ["a"]}), "pairs", "x")


def test_train_and_eval_splits_per_config_and_per_source(tmp_path):
    """OpenRLHF's train_split / eval_split: a DatasetDict folder, split-named files, split sub-folders; a
    folder without splits is the dataset; `uri@split` picks per source and is strict."""
    import datasets
    import pytest

    from rlhf_core.inputs.data import DataError, load_mixture, read_rows

    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"input": "t1"}, {"input": "t2"}]),
                          "test": datasets.Dataset.from_list([{"input": "e1"}])}).save_to_disk(str(dd))
    files = tmp_path / "files"
    files.mkdir()
    (files / "train-00000-of-00001.jsonl").write_text('{"input": "ft"}\n')
    (files / "test.jsonl").write_text('{"input": "fe"}\n')
    sub = tmp_path / "sub"
    (sub / "validation").mkdir(parents=True)
    (sub / "validation" / "a.jsonl").write_text('{"input": "sv"}\n')
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.jsonl").write_text('{"input": "p"}\n')

    assert [r["input"] for r in read_rows(str(dd))] == ["t1", "t2"]
    assert [r["input"] for r in read_rows(str(dd), split="test")] == ["e1"]
    assert [r["input"] for r in read_rows(str(files))] == ["ft"]
    assert [r["input"] for r in read_rows(str(files), split="test")] == ["fe"]
    assert [r["input"] for r in read_rows(str(sub), split="validation")] == ["sv"]
    assert [r["input"] for r in read_rows(str(plain), split="test")] == ["p"]  # no splits: the dataset itself
    rows = load_mixture(f"{dd}@test,{files}", split="train")
    assert [r["input"] for _, _, r in rows] == ["e1", "ft"]
    with pytest.raises(DataError, match=r"dd: no split 'dev'; it has \['test', 'train'\]|dd: no split 'dev'; it has \['train', 'test'\]"):
        load_mixture(f"{dd}@dev")
    with pytest.raises(DataError, match=r"plain: no split 'test': the folder has no split-named"):
        load_mixture(f"{plain}@test")
