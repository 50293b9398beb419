"""kto: KTO raises the desirable-vs-undesirable implied reward gap on its training data (2 processes, the
KL reference point averaged over them), converts pairs to KTO rows, and refuses one-class data by name."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import kto


def pairs_data(root, n, seed=0):
    uri = f"{root}/pairs-{n}-{seed}"
    w = store.ArtifactWriter(uri, "data", {"n": n, "seed": seed})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(demo_task.preference_rows(n, seed), "pairs"))
        w.commit()
    return uri


@pytest.mark.slow
def test_kto_raises_the_implied_reward_gap(tiny, tmp_path, ranks_abort_at_exit):
    """32 gold-labelled pairs -> 64 KTO rows (32 desirable, 32 undesirable). At step 1 policy == reference:
    every implied reward and the KL estimate are 0. After 8 steps the desirable completions' mean implied
    reward beta * (log pi - log ref) is above the undesirable ones'. Its two jobs (the reference pass and the
    training, 2 ranks each) succeed though each rank would abort in the interpreter's teardown (ranks_abort_at_exit)."""
    out = tmp_path / "kto"
    m = kto.run(kto.Config(policy_uri=tiny.policy_uri, dataset_uri=pairs_data(tmp_path, 32), output_uri=str(out),
                           max_len=64, learning_rate=2e-3, beta=0.1, train_batch_size=16, micro_train_batch_size=8,
                           num_gpus=2, max_epochs=2, lr_warmup_ratio=0.0, log_steps=4))
    assert m.stage == "kto" and m.metrics["steps_done"] == 8 and m.metrics["samples_seen"] == 128
    assert (m.metrics["desirable"], m.metrics["undesirable"]) == (32, 32)
    assert m.metrics["first_reward"] == pytest.approx(0.0, abs=1e-5) and m.metrics["first_kl"] == pytest.approx(0.0, abs=1e-5)
    assert m.metrics["final_reward_gap"] > 0.05, m.metrics
    assert m.metrics["final_desirable_reward"] > 0 > m.metrics["final_undesirable_reward"]
    before, after = load_file(os.path.join(tiny.policy_dir, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_kto_data_unpaired_paired_and_one_class_refused(tiny, tmp_path):
    """Raw unpaired rows (label_key), raw paired rows (one desirable + one undesirable each), a committed
    pairs artifact; data with one class only and a non-boolean label are refused naming file and key, and
    nothing is committed."""
    from rlhf_core.inputs import models

    tok = models.load_tokenizer(tiny.policy_dir)
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text("\n".join(json.dumps({"q": f"Review of the tea {i}:", "a": "great tea .", "ok": i % 2 == 0})
                                  for i in range(4)))
    cfg = dict(policy_uri=tiny.policy_uri, output_uri=str(tmp_path / "o"), train_batch_size=2, micro_train_batch_size=2)
    rows = kto.load_kto_rows(kto.Config(**cfg, dataset_uri=str(unpaired), input_key="q", output_key="a", label_key="ok"), tok)
    assert [r["label"] for r in rows] == [True, False, True, False] and rows[0]["completion"] == "great tea ."
    paired = tmp_path / "paired.jsonl"
    paired.write_text(json.dumps({"prompt": "Review of the tea:", "chosen": "great .", "rejected": "awful ."}))
    rows = kto.load_kto_rows(kto.Config(**cfg, dataset_uri=str(paired)), tok)
    assert rows == [{"prompt": "Review of the tea:", "completion": "great .", "label": True},
                    {"prompt": "Review of the tea:", "completion": "awful .", "label": False}]
    assert len(kto.load_kto_rows(kto.Config(**cfg, dataset_uri=pairs_data(tmp_path, 4)), tok)) == 8

    one = tmp_path / "all_good.jsonl"
    one.write_text("\n".join(json.dumps({"prompt": "p", "completion": f"good {i}", "label": True}) for i in range(4)))
    with pytest.raises(data.DataError, match=r"all_good.jsonl: all 4 rows have 'label' true \(desirable\): KTO needs both"):
        kto.run(kto.Config(**cfg, dataset_uri=str(one)))
    odd = tmp_path / "odd_label.jsonl"
    odd.write_text(json.dumps({"prompt": "p", "completion": "c", "label": "yes"}))
    with pytest.raises(data.DataError, match=r"odd_label.jsonl row 0: key 'label' must be true or false"):
        kto.run(kto.Config(**cfg, dataset_uri=str(odd)))
    assert not store.committed_any(str(tmp_path / "o"))
