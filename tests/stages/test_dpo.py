"""reference + dpo: DPO raises the implied reward margin on its training pairs, trains every parameter
group (ZeRO-2, 2 processes), and refuses bad input by name."""
import json
import os

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core import store
from stages import dpo, reference
from stages.common import ConfigError


def pairs_data(root, n, seed=0, rows=None):
    uri = f"{root}/pairs-{n}-{seed}"
    w = store.ArtifactWriter(uri, "data", {"n": n, "seed": seed})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(rows or demo_task.preference_rows(n, seed), "pairs"))
        w.commit()
    return uri


@pytest.fixture(scope="module")
def ref_pairs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    m = reference.run(reference.Config(pairs_uri=pairs_data(root, 64), ref_uri=tiny.policy_uri,
                                       output_uri=str(root / "ref"), max_len=64, launcher="deepspeed"))
    assert m.metrics["launcher"] == "deepspeed"  # a job, as on a multi-GPU host (auto runs one device inline)
    return m


def test_reference_pass_adds_logps_and_is_computed_once(tiny, ref_pairs):
    t = store.read_table(ref_pairs.uri)
    assert t.num_rows == 64 and {"ref_chosen_logp", "ref_rejected_logp"} <= set(t.column_names)
    assert all(v < 0 for v in t.column("ref_chosen_logp").to_pylist())
    again = reference.run(reference.Config(pairs_uri=ref_pairs.inputs[0]["uri"], ref_uri=tiny.policy_uri,
                                           output_uri=ref_pairs.uri, max_len=64))
    assert again.created_at == ref_pairs.created_at


@pytest.mark.slow
def test_dpo_two_processes_raises_margin_and_trains_all_params(tiny, ref_pairs, tmp_path):
    out = tmp_path / "dpo"
    cfg = dpo.Config(policy_uri=tiny.policy_uri, dataset_uri=ref_pairs.uri, output_uri=str(out), max_len=64,
                     learning_rate=2e-3, beta=0.1, train_batch_size=16, micro_train_batch_size=4, num_gpus=2,
                     max_epochs=2, zero_stage=2, lr_warmup_ratio=0.0, nll_loss_coef=0.1, log_steps=4)
    m = dpo.run(cfg)
    assert m.metrics["steps_done"] == 8 and m.metrics["samples_seen"] == 128
    assert m.metrics["first_reward_margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference at step 1
    assert m.metrics["final_reward_margin"] > 0.05 and m.metrics["final_reward_accuracy"] > 0.6
    # tokens forwarded, both ranks' counted each step: each epoch forwards every pair once, a pair's prompt once
    log = json.loads((out / "training_log.json").read_text())
    per_epoch = [sum(h["tokens"] for h in log[:4]), sum(h["tokens"] for h in log[4:])]
    assert per_epoch[0] == per_epoch[1] and sum(per_epoch) == m.metrics["tokens"]
    assert sum(h["tokens_forwarded"] for h in log) == m.metrics["tokens_forwarded"]
    assert m.metrics["tokens_forwarded"] < m.metrics["tokens"] and m.metrics["tokens_forwarded"] <= m.metrics["positions_forwarded"]
    before, after = load_file(os.path.join(tiny.policy_dir, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_reference_pass_inline_matches_the_job(tiny, ref_pairs, tmp_path):
    inline = reference.run(reference.Config(pairs_uri=ref_pairs.inputs[0]["uri"], ref_uri=tiny.policy_uri, max_len=64,
                                            output_uri=str(tmp_path / "inline"), launcher="inline"))
    assert inline.fingerprint == ref_pairs.fingerprint  # where it runs is not what it computes
    job, here = store.read_table(ref_pairs.uri).to_pylist(), store.read_table(inline.uri).to_pylist()
    for k in ("ref_chosen_logp", "ref_rejected_logp"):
        assert [r[k] for r in here] == pytest.approx([r[k] for r in job], abs=1e-5)


@pytest.mark.slow
def test_implied_margin_is_zero_at_step_zero(tiny, ref_pairs, tmp_path):
    """The reference pass ran as a DeepSpeed job with the training forward, in dpo's dtype (fp32 here): before
    the first update policy == reference, so every implied margin beta * ((pi_c - ref_c) - (pi_r - ref_r)) is 0.
    Accuracy counts margins > 0: 0.0 means no pair's margin is even slightly positive."""
    assert ref_pairs.metrics["bf16"] is False
    m = dpo.run(dpo.Config(policy_uri=tiny.policy_uri, dataset_uri=ref_pairs.uri, output_uri=str(tmp_path / "d"),
                           max_len=64, train_batch_size=64, micro_train_batch_size=16, launcher="python"))
    assert m.metrics["steps_done"] == 1
    assert abs(m.metrics["first_reward_margin"]) < 1e-6
    assert m.metrics["first_reward_accuracy"] == 0.0


def test_dpo_bad_input(tiny, ref_pairs, tmp_path):
    base = dict(policy_uri=tiny.policy_uri, dataset_uri=ref_pairs.uri, output_uri=str(tmp_path / "o"), max_len=64)
    with pytest.raises(ValidationError, match="beta\n.*greater than 0"):
        dpo.Config(**base, beta=0.0)
    with pytest.raises(ValidationError, match="loss_type\n.*'sigmoid' or 'ipo'"):
        dpo.Config(**base, loss_type="kto")
    with pytest.raises(ValidationError, match="label_smoothing \\(cDPO\\) applies to loss_type sigmoid only, not 'ipo'"):
        dpo.Config(**base, loss_type="ipo", label_smoothing=0.1)
    for unread in ("dataset_probs", "apply_chat_template", "input_template"):  # dpo reads a reference artifact only
        with pytest.raises(ValidationError, match=f"{unread}\n.*Extra inputs are not permitted"):
            dpo.Config(**base, **{unread: "x"})
    with pytest.raises(ConfigError, match=r"max_len/overlong/bf16 \(32, 'truncate', False\) differ from the reference pass"):
        dpo.run(dpo.Config(**{**base, "max_len": 32}))
    with pytest.raises(ConfigError, match=r"max_len/overlong/bf16 \(64, 'truncate', True\) differ from the reference pass"):
        dpo.run(dpo.Config(**{**base, "bf16": True}))  # an fp32 reference for a bf16 policy
    with pytest.raises(ConfigError, match=r"dpo attn_implementation=eager differs from the reference pass of .* \(sdpa\)"):
        dpo.run(dpo.Config(**{**base, "attn_implementation": "eager"}))
    # pairs without reference log-probs
    raw = ref_pairs.inputs[0]["uri"]
    with pytest.raises(store.StageMismatchError, match="expected 'reference'"):
        dpo.run(dpo.Config(**{**base, "dataset_uri": raw}))
    # a policy whose tokenizer differs from the reference model's
    other = tmp_path / "other"
    tok = tiny_mod.build_tokenizer(other / "tok", demo_task.corpus(1)[:50], vocab_size=300)
    tiny_mod.build_model(other / "policy", tok, "policy", seed=3)
    store.commit_model_dir(other / "policy", str(tmp_path / "other-policy"), "tiny-model", {"seed": 3})
    with pytest.raises(ConfigError, match="use different tokenizers"):
        dpo.run(dpo.Config(**{**base, "policy_uri": str(tmp_path / "other-policy")}))
    # chosen == rejected inside a reference artifact
    rows = store.read_table(ref_pairs.uri).to_pylist()[:4]
    rows[2]["rejected"] = rows[2]["chosen"]
    bad = tmp_path / "bad-ref"
    w = store.ArtifactWriter(str(bad), "reference", {"x": 1})
    w.begin()
    w.write_table("pairs.parquet", data.to_table(rows, "pairs"))
    w.commit(metrics=ref_pairs.metrics)
    with pytest.raises(data.DataError, match="bad-ref row 2: 'chosen' and 'rejected' are identical"):
        dpo.run(dpo.Config(**{**base, "dataset_uri": str(bad)}))
    assert not store.committed_any(str(tmp_path / "o"))
