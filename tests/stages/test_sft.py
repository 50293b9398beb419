"""sft as a real DeepSpeed job (ZeRO-2, one CPU process, started directly), packing, LoRA, and the SIGKILL resume."""
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.inputs import data, model_inputs
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.store import versions
from rlhf_core.runtime import faults
from rlhf_core.runtime.jobs import JobFailed
from rlhf_core.train import checkpoints, launch
from rlhf_core.train.launch import TrainingIncomplete  # noqa: F401  (part of the contract)
from stages import sft
from tests.conftest import kill_training_jobs, tb_scalars

FAST = dict(input_template=demo_task.INPUT_TEMPLATE, learning_rate=1e-3, train_batch_size=8, micro_train_batch_size=4,
            max_len=48, lr_warmup_ratio=0.0)


def sft_data(root, n=48, seed=0):
    uri = f"{root}/sft-data-{n}-{seed}"
    w = store.ArtifactWriter(uri, "data", {"n": n, "seed": seed})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(n, seed), "sft"))
        w.commit()
    return uri


def weights(d):
    return load_file(os.path.join(str(d), "model.safetensors"))


@pytest.mark.slow
def test_sft_trains_every_parameter_rerun_is_free_and_a_reverted_config_restores(tiny, tmp_path, monkeypatch):
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(tmp_path), output_uri=str(tmp_path / "sft"), **FAST)
    m = sft.run(cfg)
    assert m.stage == "sft" and m.metrics["steps_done"] == m.metrics["planned_steps"] == 6
    assert m.metrics["samples_seen"] == 48 and m.metrics["last_loss"] < m.metrics["first_loss"]
    before, after = weights(tiny.policy_dir), weights(tmp_path / "sft")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"parameters not trained: {unchanged}"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "sft"), use_safetensors=True)
    AutoTokenizer.from_pretrained(str(tmp_path / "sft"))
    log = json.loads((tmp_path / "sft" / "training_log.json").read_text())
    assert sorted(i for h in log for i in h["samples"]) == list(range(48))  # one epoch: each sample once
    # padded rows forward each sample whole: as many tokens forwarded as the samples hold, padding apart
    assert sum(h["tokens"] for h in log) == m.metrics["tokens"] == m.metrics["tokens_forwarded"] > 48
    assert m.metrics["tokens"] <= m.metrics["positions_forwarded"] == sum(h["positions_forwarded"] for h in log)
    assert not (tmp_path / "sft" / "checkpoints").exists()
    assert sft.run(cfg).created_at == m.created_at  # same fingerprint: no work

    b = sft.run(cfg.model_copy(update={"learning_rate": cfg.learning_rate / 2}))  # a changed config trains again
    assert b.fingerprint != m.fingerprint and versions.versions(cfg.output_uri)[0].fingerprint == m.fingerprint

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(launch, "_train", no_training)
    back = sft.run(cfg)  # reverted: the kept version comes back, the other one is kept in its turn
    assert (back.fingerprint, back.created_at) == (m.fingerprint, m.created_at)
    assert all(torch.equal(after[k], v) for k, v in weights(tmp_path / "sft").items())
    assert [v.fingerprint for v in versions.versions(cfg.output_uri)] == [b.fingerprint]


def test_packed_loss_equals_unpacked(tiny):
    """Packing with per-sample position ids (attention cannot cross samples) gives the same per-sample
    log-probs as padded rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.rl import losses
    from rlhf_core.train import attention
    from rlhf_core.train.batches import collate, per_sample_sum, tokenize_sft

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    recs, _ = tokenize_sft(demo_task.sft_rows(5, 1), tok, 64)
    seqs, starts = [r["ids"] for r in recs], [r["start"] for r in recs]
    out = {}
    for packed in (False, True):
        b = collate(seqs, starts, tok.pad_token_id, packed=packed)
        with torch.no_grad():
            logits = model(**attention.model_inputs(model, b, "cpu")).logits  # a packed row's mask: attention.py
        lp = losses.token_logprobs(logits, b.input_ids)
        out[packed] = (per_sample_sum(lp, b), per_sample_sum(torch.ones_like(lp), b))
        assert b.input_ids.shape[0] == (1 if packed else 5)
    assert torch.equal(out[False][1], out[True][1])  # same target tokens
    assert torch.allclose(out[False][0], out[True][0], atol=1e-4)
    loss = [-lp.sum() / n.sum() for lp, n in out.values()]
    assert loss[0].item() == pytest.approx(loss[1].item(), abs=1e-5)


@pytest.mark.slow
def test_sft_lora_packed_saves_adapter_and_merged_model(tiny, tmp_path):
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(tmp_path, 16), output_uri=str(tmp_path / "lora"),
                     lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], packing_samples=True,
                     zero_stage=0, **{**FAST, "learning_rate": 1e-2})
    m = sft.run(cfg)
    assert m.metrics["steps_done"] == 2
    adapter = load_file(str(tmp_path / "lora" / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    before, after = weights(tiny.policy_dir), weights(tmp_path / "lora")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed)  # merged LoRA deltas only


@pytest.mark.slow
def test_sigkill_mid_run_resumes_from_s3_checkpoint(tiny, s3_root, tmp_path, monkeypatch):
    """Kill the training child (launcher + rank) after its first checkpoint; the rerun resumes from it and
    ends at the same step count having seen every sample exactly once per epoch, with the same weights
    (within float tolerance) as the same job run without interruption. With max_ckpt_num 2 the store keeps the two
    newest checkpoints; save_hf_ckpt puts an HF folder per checkpoint in the artifact, the killed run's included
    (issue 37: OpenRLHF's --max_ckpt_num / --save_hf_ckpt)."""
    data_uri = sft_data(s3_root, 64)
    out = f"{s3_root}/sft-resume"
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=data_uri, output_uri=out, save_steps=2,
                     max_epochs=2, use_tensorboard=True, max_ckpt_num=2, save_hf_ckpt=True, **FAST)
    fs, path = store.filesystem(out)
    killed, live = [], {}

    def killer():
        deadline = time.time() + 300
        while time.time() < deadline and not fs.glob(f"{path}/checkpoints/*/{checkpoints.MARKER}"):
            time.sleep(0.2)
        # TensorBoard events while the job runs; the kill lands once step 6's checkpoint is committed and step 2's
        # pruned (the store holds exactly two), two slow steps before the next save: not while one is being written
        while time.time() < deadline:
            live.update(tb_scalars(store.cache_root() / "jobs" / _fp(cfg) / "tracking"))
            kept = {int(p.rsplit("/", 2)[-2][5:]) for p in fs.glob(f"{path}/checkpoints/*/{checkpoints.MARKER}")}
            if len(kept) == 2 and max(kept) >= 6 and len(live.get("sft/loss", ())) >= 2:
                break
            time.sleep(0.1)
        killed.extend(kill_training_jobs())

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    monkeypatch.setenv(faults.STEP_SLEEP, "0.8")  # slow steps: the kill lands mid-run
    with pytest.raises(JobFailed, match="killed by signal 9"):
        sft.run(cfg)
    monkeypatch.delenv(faults.STEP_SLEEP)
    th.join()
    assert killed and not store.committed_any(out)
    meta = checkpoints.latest(f"{out}/checkpoints", _fp(cfg))
    assert meta is not None and 6 <= meta["step"] < 16
    kept = sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{path}/checkpoints/*/{checkpoints.MARKER}"))
    assert kept == sorted([f"step-{meta['step'] - 2}", f"step-{meta['step']}"])  # max_ckpt_num 2: the newest two
    assert fs.exists(f"{path}/hf_checkpoints/step-2/model.safetensors")
    assert [s for s, _ in live["sft/loss"]][:2] == [1, 2], live  # written live, one event per step
    m = sft.run(cfg)
    assert m.metrics["resumed_from_step"] == meta["step"] > 0
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 16 and m.metrics["samples_seen"] == 128
    with fs.open(f"{path}/training_log.json") as f:
        log = json.loads(f.read())
    assert [h["step"] for h in log] == list(range(1, 17))
    fs.get(f"{path}/tensorboard", str(tmp_path / "tb"), recursive=True)
    events = tb_scalars(tmp_path / "tb")
    assert [s for s, _ in events["sft/loss"]] == list(range(1, 17))  # restored history replayed: every step once
    for epoch in (log[:8], log[8:]):
        assert sorted(i for h in epoch for i in h["samples"]) == list(range(64))
    assert not fs.exists(f"{path}/checkpoints")
    hf = sorted({f["path"].split("/")[1] for f in m.files if f["path"].startswith("hf_checkpoints/")})
    assert hf == sorted(f"step-{s}" for s in range(2, 16, 2))  # before and after the kill; none at the last step
    fs.get(f"{path}/hf_checkpoints/step-2", str(tmp_path / "hf2"), recursive=True)
    from transformers import AutoModelForCausalLM

    assert weights(tmp_path / "hf2").keys() == weights(model_inputs.fetch_model(out)).keys()
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")) is not None
    # the same job uninterrupted (another output_uri: same seed and data) ends with the same weights
    straight = sft.run(cfg.model_copy(update={"output_uri": f"{s3_root}/sft-straight"}))
    assert straight.metrics["resumed_from_step"] == 0
    resumed, uninterrupted = weights(model_inputs.fetch_model(out)), weights(model_inputs.fetch_model(straight.uri))
    assert resumed.keys() == uninterrupted.keys()
    for k in resumed:
        torch.testing.assert_close(resumed[k], uninterrupted[k], rtol=1e-5, atol=1e-6, msg=k)


def _fp(cfg):
    from rlhf_core.train.launch import input_manifests

    model = store.read_manifest(cfg.policy_uri)
    return store.ArtifactWriter(cfg.output_uri, "sft", cfg.semantic(), {"policy": model, **input_manifests(cfg)}).fingerprint


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_config_and_input_refused_before_work(tiny, tmp_path):
    from pydantic import ValidationError

    uri = sft_data(tmp_path, 8)
    with pytest.raises(ValidationError, match="train_batch_size 10 is not divisible by micro_train_batch_size x world size"):
        sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=str(tmp_path / "o"),
                   **{**FAST, "train_batch_size": 10, "micro_train_batch_size": 4})
    with pytest.raises(ValidationError, match="not divisible"):
        sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=str(tmp_path / "o"), num_gpus=2,
                   **{**FAST, "train_batch_size": 4, "micro_train_batch_size": 4})
    out = str(tmp_path / "long")
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=out, **{**FAST, "max_len": 6}, overlong="reject")
    with pytest.raises(data.DataError, match=r"sft-data-8-0 row 0: \d+ tokens exceed max_len 6"):
        sft.run(cfg)
    assert not store.committed_any(out)
    with pytest.raises(ValidationError, match="save_hf_ckpt writes an HF folder with each checkpoint: save_steps is 0"):
        sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=out, save_hf_ckpt=True, **FAST)
    if not torch.cuda.is_available():  # OpenRLHF's --deepcompile: DeepSpeed 0.19.8 runs it on CUDA only
        with pytest.raises(ValueError, match="deepcompile: DeepSpeed 0.19.8 compiles with DeepCompile on CUDA only"):
            sft.run(cfg.model_copy(update={"deepcompile": True, "overlong": "truncate"}))
        assert not store.committed_any(out)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="load_in_4bit .* needs a CUDA GPU"):
            sft.run(cfg.model_copy(update={"load_in_4bit": True, "overlong": "truncate"}))


def test_overlong_truncated_and_counted(tiny):
    from transformers import AutoTokenizer

    from rlhf_core.train.batches import tokenize_sft

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    recs, cut = tokenize_sft(demo_task.sft_rows(4), tok, max_len=8)
    assert cut == 4 and all(len(r["ids"]) == 8 and r["start"] < 8 for r in recs)


@pytest.mark.slow
def test_foreign_checkpoint_is_refused_and_a_corrupt_one_passed_over(tiny, tmp_path, caplog):
    """Another job's checkpoint is a configuration mistake: refused by name, nothing committed. Our own with
    bytes that do not match their sha256 is logged and passed over (none left: training from scratch), and
    the run still trains every step (tests/rlhf_core/train/test_checkpoints.py covers falling back to an older one)."""
    uri = sft_data(tmp_path, 16)
    out = tmp_path / "ck"
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=str(out), **FAST)
    tagdir = out / "checkpoints" / "step-2"
    tagdir.mkdir(parents=True)
    (tagdir / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    marker = {"fingerprint": "someoneelse", "tag": "step-2", "step": 2,
              "files": [{"path": "mp_rank_00_model_states.pt", "size": 7, "sha256": "0" * 64}]}
    (tagdir / checkpoints.MARKER).write_text(json.dumps(marker))
    with pytest.raises(checkpoints.CheckpointError, match="foreign checkpoint .*step-2: made by a job with fingerprint someoneelse"):
        sft.run(cfg)
    assert not store.committed_any(str(out))
    marker["fingerprint"] = _fp(cfg)  # ours, but its bytes do not match their sha256
    (tagdir / checkpoints.MARKER).write_text(json.dumps(marker))
    m = sft.run(cfg)
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 2
    assert "does not match its sha256" in caplog.text and "training from scratch" in caplog.text


@pytest.mark.slow
def test_zero3_gathers_full_weights_for_the_save(tiny, tmp_path):
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(tmp_path, n=16), output_uri=str(tmp_path / "z3"),
                     zero_stage=3, **FAST)
    m = sft.run(cfg)
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 2
    before, after = weights(tiny.policy_dir), weights(tmp_path / "z3")
    assert {k: v.shape for k, v in before.items()} == {k: v.shape for k, v in after.items()}  # not ZeRO-3 shards
    assert all(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("method", ["dpo", "rm"])
def test_pairs_sharing_their_prompt_equal_two_rows(tiny, method):
    """DPO and RM forward a pair as one row [prompt | chosen | rejected] (the prompt once). Per-sample
    log-probs / rewards and the gradients equal the padded two-row layout with full logits, also for a pair
    whose prompts differ (as after truncation) and pairs of different lengths."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_core.rl import losses
    from rlhf_core.train.batches import collate, collate_pairs, per_sample_sum, tokenize_pairs
    from rlhf_core.train.entry import forward
    from rlhf_core.train.methods import rm as rm_method

    tok = AutoTokenizer.from_pretrained(str(tiny.policy_dir))
    recs, _ = tokenize_pairs(demo_task.preference_rows(4, seed=3), tok, 64)
    recs[1]["rejected_ids"] = [recs[1]["rejected_ids"][0] + 1] + recs[1]["rejected_ids"][1:]  # prompts differ
    c, cs = [r["chosen_ids"] for r in recs], [r["chosen_start"] for r in recs]
    r, rs = [r["rejected_ids"] for r in recs], [r["rejected_start"] for r in recs]
    assert collate_pairs(c, cs, r, rs, tok.pad_token_id).input_ids.shape[0] == 4
    torch.manual_seed(0)
    if method == "rm":
        model = AutoModelForSequenceClassification.from_pretrained(str(tiny.reward_dir), dtype=torch.float32, num_labels=1)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32)
    spec = {"method": method, "packing_samples": False}
    if method == "rm":  # the reward model's forward is its method's (rlhf_core.train.methods.rm)
        shared, _ = rm_method.rewards(model, spec, c + r, cs + rs, tok.pad_token_id)
    else:
        shared, _, _ = forward(model, spec, c + r, cs + rs, tok.pad_token_id, pairs=True)
    g_shared = torch.autograd.grad(shared.sum(), [p for p in model.parameters() if p.requires_grad])
    b = collate(c + r, cs + rs, tok.pad_token_id)
    if method == "rm":
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
        h = model.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).last_hidden_state
        two_rows = model.score(h)[b.last[:, 0], b.last[:, 1]].squeeze(-1)
        del out
    else:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        two_rows = per_sample_sum(losses.token_logprobs(logits, b.input_ids), b)
    g_two = torch.autograd.grad(two_rows.sum(), [p for p in model.parameters() if p.requires_grad])
    assert shared.shape == (8,)
    assert torch.allclose(shared, two_rows, atol=1e-4), (shared, two_rows)
    for a, e in zip(g_shared, g_two):
        assert torch.allclose(a, e, atol=1e-4, rtol=1e-3)
