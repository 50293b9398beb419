"""The prepare stage: OpenRLHF-format sources -> committed, validated artifacts; bad input commits nothing."""
import json

import pytest

from rlhf_core import store
from stages import prepare
from stages.common import ConfigError, load_config


def test_prepare_on_s3_is_idempotent_and_lineaged(s3_root, tiny, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"context_messages": [{"role": "user", "content": f"Review of the tea {i}:"}],
                                       "answer": str(i)}) + "\n" for i in range(6)))
    cfg = prepare.Config(kind="prompts", data=str(src), input_key="context_messages", label_key="answer",
                         apply_chat_template=True, tokenizer_uri=tiny.policy_uri, output_uri=f"{s3_root}/prompts")
    m = prepare.run(cfg)
    assert m.rows == 6 and {i["name"] for i in m.inputs} == {"source0", "tokenizer"}
    rows = store.read_table(m.uri).to_pylist()
    assert rows[5] == {"prompt": "<|user|>Review of the tea 5:\n<|assistant|>", "label": "5", "source": str(src)}
    again = prepare.run(cfg)
    assert again.created_at == m.created_at  # same fingerprint: no work


def test_bad_row_commits_nothing(s3_root, tmp_path):
    src = tmp_path / "sft.jsonl"
    src.write_text('{"input": "a", "output": "b"}\n{"input": "c"}\n')
    cfg = prepare.Config(kind="sft", data=str(src), output_key="output", output_uri=f"{s3_root}/sft")
    with pytest.raises(Exception, match=r"sft.jsonl row 1: missing key 'output'"):
        prepare.run(cfg)
    assert not store.committed_any(f"{s3_root}/sft")


def test_config_typos_and_ranges_are_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kind: prompts\ndata: x.jsonl\noutput_uri: out\nmax_sampels: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: invalid Config:\n  max_sampels: unknown field \(typo\?\)"):
        load_config(prepare.Config, f)
    with pytest.raises(ConfigError, match=r"max_samples: Input should be greater than or equal to 1"):
        load_config(prepare.Config, None, ["kind=prompts", "data=x", "output_uri=o", "max_samples=0"])
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        load_config(prepare.Config, tmp_path / "nope.yaml")


def test_cli_show_prints_lineage(tmp_path, capsys):
    from flows.cli import main

    src = tmp_path / "pairs.jsonl"
    src.write_text('{"prompt": "p", "chosen": "good", "rejected": "bad"}\n')
    out = str(tmp_path / "store" / "pairs")
    assert main(["stage", "prepare", "kind=pairs", f"data={src}", "prompt_key=prompt", f"output_uri={out}"]) == 0
    capsys.readouterr()
    assert main(["show", out]) == 0
    text = capsys.readouterr().out
    m = store.read_manifest(out)
    assert f"fingerprint {m.fingerprint}" in text and "lineage:" in text
    assert f"prepare {m.fingerprint} {out} rows=1" in text and f"source {m.inputs[0]['fingerprint']} {src}" in text
    assert main(["show", str(tmp_path / "store" / "missing")]) == 2
    assert "store/missing does not exist" in capsys.readouterr().err


def test_samples_from_an_existing_dataset_score_and_filter_like_generated_ones(tmp_path):
    """OpenRLHF's csft example scores the `chosen` column of a preference set: prepare kind=samples."""
    from stages import filter as filter_stage, score

    src = tmp_path / "prefs.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": "meh", "id": i}) + "\n"
                           for i, (p, c) in enumerate([("A:", " great good"), ("B:", " bad"), ("A:", " good")])))
    m = prepare.run(prepare.Config(kind="samples", data=str(src), input_key="prompt", output_key="chosen",
                                   label_key="id", output_uri=str(tmp_path / "samples")))
    rows = store.read_table(m.uri).to_pylist()
    assert [(r["prompt"], r["response"], r["sample_index"], r["label"]) for r in rows] == \
        [("A:", " great good", 0, "0"), ("B:", " bad", 0, "1"), ("A:", " good", 1, "2")]
    rf = tmp_path / "rf.py"
    rf.write_text("from rlhf_core.demo.demo_task import reward_func\n")
    scored = score.run(score.Config(samples_uri=m.uri, reward_func_path=str(rf), output_uri=str(tmp_path / "scored")))
    best = filter_stage.run(filter_stage.Config(scored_uri=scored.uri, method="rs", output_uri=str(tmp_path / "best")))
    assert sorted(r["output"] for r in store.read_table(best.uri).to_pylist()) == [" bad", " great good"]


def test_tokenizer_chat_template_replaces_the_tokenizer_s(tiny, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"m": [{"role": "user", "content": "Review of the tea:"}]}) + "\n")
    m = prepare.run(prepare.Config(kind="prompts", data=str(src), input_key="m", apply_chat_template=True,
                                   tokenizer_uri=tiny.policy_uri, output_uri=str(tmp_path / "out"),
                                   tokenizer_chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}>>"))
    assert store.read_table(m.uri).to_pylist()[0]["prompt"] == "<user>Review of the tea:>>"
