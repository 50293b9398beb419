"""Plain Hugging Face folders as model inputs: content-hash lineage (a changed folder reruns what used it, an
unchanged one does not), fetched once per machine into a cache keyed by content, and bad folders refused by
name before any work, with nothing committed."""
from __future__ import annotations

import shutil

import pytest

from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core.inputs import model_inputs, models
from rlhf_core import store
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


def test_bad_model_inputs_fail_before_work_and_commit_nothing(zoo, tiny, tmp_path, monkeypatch):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n' * 8)
    out = tmp_path / "out"
    base = dict(dataset_uri=str(data), output_uri=str(out), train_batch_size=8, micro_train_batch_size=8)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the tests run with HF_HUB_OFFLINE=1: a hub id not cached
    with pytest.raises(models.ModelInputError, match=r"model meta-llama/Meta-Llama-3-8B \(no local path of that name\): "
                                                     r"HF_HUB_OFFLINE is set and meta-llama/Meta-Llama-3-8B@main is not in "
                                                     r"this node's cache"):
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


def test_plain_folder_fetches_only_what_the_loaders_read(zoo, s3_root, tmp_path, monkeypatch):
    """A hub download of Llama-3 also carries Meta's original/ and, often, the weights twice: the cache entry
    holds what transformers and vLLM load, and only that enters the fingerprint."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    hub = tmp_path / "hub"
    shutil.copytree(zoo["llama3"].policy, hub)
    wanted = sorted(p.name for p in hub.iterdir())
    (hub / "original").mkdir()
    (hub / "original" / "consolidated.00.pth").write_bytes(b"meta" * 256)
    (hub / "original" / "params.json").write_text('{"dim": 128}')
    (hub / "original" / "tokenizer.model").write_bytes(b"tiktoken")
    weights = load_file(str(hub / "model.safetensors"))
    torch.save(weights, hub / "pytorch_model.bin")
    for name in ("model.gguf", "README.md", "training_args.bin"):
        (hub / name).write_bytes(b"x" * 64)
    uri = upload_folder(hub, f"{s3_root}/hf/llama3")

    m = model_inputs.model_manifest(uri)
    local = model_inputs.fetch_model(uri, manifest=m)
    assert [f["path"] for f in m.files] == wanted
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*")) == sorted(wanted + [store.MANIFEST])
    model = AutoModelForCausalLM.from_pretrained(str(local), use_safetensors=True)  # as the training jobs load it
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert len(models.load_tokenizer(local)) == model.config.vocab_size

    fs, path = store.filesystem(uri)
    fs.pipe_file(f"{path}/original/consolidated.00.pth", b"other" * 256)
    fs.pipe_file(f"{path}/pytorch_model.bin", b"other")
    assert model_inputs.model_manifest(uri).fingerprint == m.fingerprint
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "revision": "2"})
    fs.put_file(str(tmp_path / "model.safetensors"), f"{path}/model.safetensors")
    assert model_inputs.model_manifest(uri).fingerprint != m.fingerprint


def test_sharded_folder_fetches_the_shards_its_index_names(zoo, tmp_path):
    """Mistral ships consolidated.safetensors (its own format) beside the sharded checkpoint: transformers and
    vLLM load the shards model.safetensors.index.json names, and so does the fetch; a shard it names that the
    folder lacks is refused up front."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "mistral"
    shutil.copytree(zoo["mistral"].policy, d)
    (d / "model.safetensors").rename(d / "consolidated.safetensors")
    AutoModelForCausalLM.from_pretrained(str(zoo["mistral"].policy)).save_pretrained(str(d), max_shard_size="600KB")
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) > 1
    files = [f["path"] for f in model_inputs.model_manifest(str(d)).files]
    assert "consolidated.safetensors" not in files and set(shards) <= set(files)
    assert "model.safetensors.index.json" in files
    (d / shards[-1]).unlink()
    with pytest.raises(models.ModelInputError, match=f"model folder {d} lacks {shards[-1]}, named by "
                                                    "model.safetensors.index.json"):
        model_inputs.model_manifest(str(d))


def test_bin_only_folder_is_refused_with_how_to_convert(zoo, tmp_path):
    """The training jobs load safetensors only (use_safetensors=True): a folder of pytorch_model.bin is refused
    at the input check, naming it and the conversion, before any work; converted as told, it is accepted."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    d = tmp_path / "bin-only"
    shutil.copytree(zoo["qwen2"].policy, d)
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    data = tmp_path / "sft.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n' * 8)
    out = tmp_path / "out"
    with pytest.raises(models.ModelInputError, match=rf"model folder {d} holds only PyTorch \.bin weights "
                                                    r"\(pytorch_model\.bin\).*save_pretrained\(folder, safe_serialization=True\)"):
        sft.run(sft.Config(policy_uri=str(d), dataset_uri=str(data), output_uri=str(out), train_batch_size=8,
                           micro_train_batch_size=8))
    assert not store.committed_any(str(out)) and not out.exists()
    AutoModelForCausalLM.from_pretrained(str(d)).save_pretrained(str(d), safe_serialization=True)
    assert "pytorch_model.bin" not in [f["path"] for f in model_inputs.model_manifest(str(d)).files]
