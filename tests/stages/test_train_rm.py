"""train_rm as a DeepSpeed job: > 0.9 accuracy on the demo's gold-labelled pairs, every
parameter group trained, reward mean/std written into config.json."""
import json
import os

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import train_rm


def pairs_data(root, n, seed=0):
    uri = f"{root}/pairs-{n}-{seed}"
    w = store.ArtifactWriter(uri, "data", {"n": n, "seed": seed})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(demo_task.preference_rows(n, seed), "pairs"))
        w.commit()
    return uri


@pytest.mark.slow
def test_train_rm_reaches_gold_accuracy(tiny, tmp_path):
    out = tmp_path / "rm"
    cfg = train_rm.Config(base_uri=tiny.reward_uri, dataset_uri=pairs_data(tmp_path, 512), output_uri=str(out),
                          learning_rate=1e-3, train_batch_size=32, micro_train_batch_size=32, max_epochs=2, max_len=64,
                          lr_warmup_ratio=0.0, log_steps=8)
    m = train_rm.run(cfg)
    assert m.metrics["steps_done"] == 32 and m.metrics["final_accuracy"] > 0.9
    conf = json.loads((out / "config.json").read_text())
    assert conf["reward_mean"] == pytest.approx(m.metrics["reward_mean"]) and conf["reward_std"] > 0
    before, after = load_file(os.path.join(tiny.reward_dir, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert [k for k in before if torch.equal(before[k], after[k])] == []
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(out), use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    good, bad = "Review of the movie: great excellent superb .", "Review of the movie: awful bad terrible ."
    with torch.no_grad():
        scores = [model(**tok(t, return_tensors="pt")).logits.item() for t in (good, bad)]
    assert scores[0] > scores[1]


def test_bad_pairs_refused(tiny, tmp_path):
    bad_rows = {"empty chosen": [{"prompt": "p", "chosen": " ", "rejected": "x"}],
                "identical": [{"prompt": "p", "chosen": "same", "rejected": "same"}]}
    for what, rows in bad_rows.items():
        src = tmp_path / f"{what.replace(' ', '_')}.jsonl"
        src.write_text("\n".join(json.dumps(r) for r in rows))
        cfg = train_rm.Config(base_uri=tiny.reward_uri, dataset_uri=str(src), output_uri=str(tmp_path / "o"),
                              train_batch_size=1, micro_train_batch_size=1)
        msg = "row 0: key 'chosen' is empty" if what == "empty chosen" else "row 0: 'chosen' and 'rejected' are identical"
        with pytest.raises(data.DataError, match=msg):
            train_rm.run(cfg)
    src = tmp_path / "prompt_only.jsonl"
    src.write_text(json.dumps({"prompt": "only a prompt"}))
    cfg = train_rm.Config(base_uri=tiny.reward_uri, dataset_uri=str(src), output_uri=str(tmp_path / "o"),
                          train_batch_size=1, micro_train_batch_size=1)
    with pytest.raises(data.DataError, match="prompt_only.jsonl row 0: missing key 'chosen'"):
        train_rm.run(cfg)
    with pytest.raises(ValidationError, match="use_margin applies to loss sigmoid only"):
        train_rm.Config(base_uri=tiny.reward_uri, dataset_uri=str(src), output_uri=str(tmp_path / "o"), loss="logexp",
                        use_margin=True)
    assert not store.committed_any(str(tmp_path / "o"))
