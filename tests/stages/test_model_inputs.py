"""Plain Hugging Face folders as model inputs: content-hash lineage (a changed folder reruns what used it, an
unchanged one does not), fetched once per machine into a cache keyed by content, and bad folders refused by
name before any work, with nothing committed."""
from __future__ import annotations

import shutil

import pytest

from rlhf_core import demo_task, model_inputs, models, store, tiny as tiny_mod
from stages import generate, sft
from tests.conftest import upload_folder


def test_changed_plain_folder_reruns_the_stage_and_gets_a_new_cache_entry(zoo, s3_root, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    policy = upload_folder(zoo["llama3"].policy, f"{s3_root}/hf/policy")
    prompts = f"{s3_root}/prompts.jsonl"
    fs, path = store.filesystem(prompts)
    fs.pipe_file(path, b'{"input": "Review of the tea:"}\n{"input": "Review of the film:"}\n')
    cfg = generate.Config(policy_uri=policy, prompts_uri=prompts, backend="hf", num_engines=0, best_of_n=2,
                          max_new_tokens=4, output_uri=f"{s3_root}/samples")
    first = generate.run(cfg)
    src = {i["name"]: i for i in first.inputs}["policy"]
    assert src["stage"] == "source" and src["uri"] == policy
    first_dir = model_inputs.fetch_model(policy)
    assert first_dir.parent == tmp_path / "cache" / "models" and (first_dir / "model.safetensors").exists()
    assert generate.run(cfg).created_at == first.created_at  # same content: no work

    # Same file names, other weights (a re-download of a newer revision): new content hash -> rerun.
    other = tiny_mod.build_zoo_model(tmp_path / "v2", "llama3", demo_task.corpus(0), "policy", seed=5)
    upload_folder(other, policy)
    second = generate.run(cfg)
    assert second.fingerprint != first.fingerprint and second.created_at != first.created_at
    assert {i["name"]: i for i in second.inputs}["policy"]["fingerprint"] != src["fingerprint"]
    assert model_inputs.fetch_model(policy) != first_dir


def test_bad_model_inputs_fail_before_work_and_commit_nothing(zoo, tiny, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n' * 8)
    out = tmp_path / "out"
    base = dict(dataset_uri=str(data), output_uri=str(out), train_batch_size=8, micro_train_batch_size=8)
    with pytest.raises(models.ModelInputError, match="'meta-llama/Meta-Llama-3-8B' looks like a Hugging Face hub id"):
        sft.run(sft.Config(policy_uri="meta-llama/Meta-Llama-3-8B", **base))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(zoo["mistral"].policy, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(models.ModelInputError, match=f"model folder {no_weights} lacks weights"):
        sft.run(sft.Config(policy_uri=str(no_weights), **base))
    big = tmp_path / "big-vocab"
    shutil.copytree(zoo["mistral"].policy, big)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(big))
    tok.add_tokens(["<extra_a>", "<extra_b>"])
    tok.save_pretrained(str(big))
    with pytest.raises(models.ModelInputError, match=f"model {big}: its tokenizer has {len(tok)} tokens but the "
                                                    f"model's embeddings have {len(tok) - 2} rows"):
        sft.run(sft.Config(policy_uri=str(big), **base))
    assert not store.committed_any(str(out))
