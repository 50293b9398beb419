"""Hub models and datasets against the hub stand-in (tests/hubstub.py): names resolved to a commit sha that the
lineage records, only the loaded files fetched and once per node, moved branches and pinned shas, gated repos,
offline mode and the store mirror, and each failure one line naming the repo."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core import store
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core.inputs import data, hub, model_inputs
from tests.hubstub import GATED_TOKEN, use_hub


@pytest.fixture
def hf(hub_stub, monkeypatch, tmp_path):
    """The stand-in, with this test's own HF_HOME and model cache (a fresh node), and no memory of earlier
    resolutions."""
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "_resolved", {})
    use_hub(hub_stub, monkeypatch, tmp_path / "hf")
    return hub_stub


def _gets(hub_stub, since: int, what: str = "/resolve/") -> list[str]:
    return [r["path"] for r in hub_stub.requests()[since:] if r["method"] == "GET" and what in r["path"]]


def test_names_hub_or_local(tmp_path, monkeypatch):
    assert hub.model_ref("meta-llama/Meta-Llama-3-8B") == hub.Ref("model", "meta-llama/Meta-Llama-3-8B")
    assert hub.model_ref("org/m@v1.0") == hub.Ref("model", "org/m", "v1.0")
    assert hub.model_ref("hf://org/m@refs%2Fpr%2F3") == hub.Ref("model", "org/m", "refs/pr/3")
    assert hub.model_ref("s3://b/org/m") is None and hub.model_ref("/abs/org/m") is None
    assert hub.dataset_ref("OpenRLHF/prompt-collection-v0.1") == hub.Ref("dataset", "OpenRLHF/prompt-collection-v0.1")
    assert hub.dataset_ref("org/d@sub") == hub.Ref("dataset", "org/d", at="sub")
    assert hub.dataset_ref("hf://datasets/org/d@v2/data/x.parquet") == hub.Ref("dataset", "org/d", "v2", path="data/x.parquet")
    assert hub.dataset_ref("data/prompts.jsonl") is None  # a data file's name is a file, never a hub name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "m").mkdir(parents=True)
    assert hub.model_ref("org/m") is None and hub.dataset_ref("org/m@train") is None  # an existing local path
    with pytest.raises(hub.HubError, match="hf://datasets/org/d is not a hub model name"):
        hub.model_ref("hf://datasets/org/d")
    with pytest.raises(hub.HubError, match="hf://org/m is not a hub dataset name: hf://datasets/org/name"):
        hub.dataset_ref("hf://org/m")


def test_model_resolves_to_its_commit_and_fetches_only_what_the_loaders_read_once(hf, tiny, tmp_path):
    """A hub repo also carries README, Meta's original/ and the weights again as .bin: the manifest and the
    download hold what transformers and vLLM load; a second fetch on the node asks the hub for nothing."""
    repo = Path(shutil.copytree(tiny.policy_dir, tmp_path / "repo"))
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (repo / "README.md").write_text("# tiny\n")
    sha = hf.add("t-org/extras", repo)
    m = model_inputs.model_manifest("t-org/extras")
    assert (m.stage, m.uri, m.config["sha"]) == ("source", f"hf://t-org/extras@{sha}", sha)
    loaded = {f["path"] for f in m.files}
    assert "model.safetensors" in loaded and "config.json" in loaded
    assert not loaded & {"README.md", "pytorch_model.bin", "original/consolidated.00.pth"}
    assert {f["path"]: f["size"] for f in m.files}["model.safetensors"] == (repo / "model.safetensors").stat().st_size

    seen = len(hf.requests())
    local = model_inputs.fetch_model("t-org/extras", manifest=m)
    assert local == tmp_path / "hf" / "hub" / "models--t-org--extras" / "snapshots" / sha
    assert sorted(p.name for p in local.iterdir()) == sorted(loaded)
    assert sorted(Path(p).name for p in _gets(hf, seen)) == sorted(loaded)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(local), use_safetensors=True)
    AutoTokenizer.from_pretrained(str(local))
    seen = len(hf.requests())
    assert model_inputs.fetch_model("t-org/extras", manifest=m) == local
    assert _gets(hf, seen) == []  # once per node


def test_sharded_model_is_checked_from_its_index_and_fetches_the_shards_it_names(hf, tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir)).save_pretrained(str(repo), max_shard_size="600KB")
    AutoTokenizer.from_pretrained(str(tiny.policy_dir)).save_pretrained(str(repo))
    shutil.copy(Path(tiny.policy_dir) / "model.safetensors", repo / "consolidated.safetensors")  # Mistral's copy
    shards = sorted(set(json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    hf.add("t-org/sharded", repo)
    seen = len(hf.requests())
    m = model_inputs.model_manifest("t-org/sharded")
    assert [Path(p).name for p in _gets(hf, seen)] == ["model.safetensors.index.json"]  # no weight before the check
    loaded = {f["path"] for f in m.files}
    assert set(shards) <= loaded and "consolidated.safetensors" not in loaded
    local = model_inputs.fetch_model("t-org/sharded", manifest=m)
    assert not (local / "consolidated.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(str(local), use_safetensors=True)


def test_moved_branch_changes_the_fingerprint_a_pinned_sha_never(hf, tiny, tmp_path):
    first = hf.add("t-org/moving", Path(tiny.policy_dir))
    before = model_inputs.model_manifest("t-org/moving")
    assert model_inputs.model_manifest(f"t-org/moving@{first}").fingerprint == before.fingerprint
    assert model_inputs.model_manifest(f"hf://t-org/moving@{first}").fingerprint == before.fingerprint
    assert model_inputs.model_manifest("t-org/moving").fingerprint == before.fingerprint  # nothing moved: same

    other = tiny_mod.build_zoo_model(tmp_path / "v2", "llama3", demo_task.corpus(0), "policy", seed=5)
    second = hf.add("t-org/moving", other)  # main moves to a new commit
    after = model_inputs.model_manifest("t-org/moving")
    assert (after.config["sha"], after.uri) == (second, f"hf://t-org/moving@{second}")
    assert after.fingerprint != before.fingerprint
    assert model_inputs.model_manifest(f"t-org/moving@{first}").fingerprint == before.fingerprint
    assert model_inputs.fetch_model("t-org/moving", manifest=after) != model_inputs.fetch_model(f"t-org/moving@{first}")


def test_missing_repo_revision_and_bad_repo_are_one_line_before_any_download(hf, tiny, tmp_path):
    with pytest.raises(hub.HubError) as e:
        model_inputs.model_manifest("t-org/no-such-model")
    assert str(e.value) == (f"model t-org/no-such-model: no such model repo at {hf.url} (a private repo needs "
                            f"HF_TOKEN), and no local path of that name")
    with pytest.raises(hub.HubError, match=f"model tiny-org/policy@nope: tiny-org/policy has no revision 'nope' at "
                                           f"{hf.url}: name a branch, tag or commit sha"):
        model_inputs.model_manifest("tiny-org/policy@nope")
    no_weights = Path(shutil.copytree(tiny.policy_dir, tmp_path / "nw"))
    (no_weights / "model.safetensors").unlink()
    sha = hf.add("t-org/no-weights", no_weights)
    seen = len(hf.requests())
    with pytest.raises(model_inputs.models.ModelInputError,
                       match=rf"hub model t-org/no-weights \(commit {sha}\) lacks weights \(\*.safetensors\)"):
        model_inputs.model_manifest("t-org/no-weights")
    assert _gets(hf, seen) == []  # refused from the file list: nothing downloaded


def test_gated_repo_needs_a_granted_token_that_reaches_no_log_manifest_or_error(hf, monkeypatch, tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(hub.HubError) as e:
        model_inputs.model_manifest("tiny-org/gated-policy")
    assert str(e.value) == (f"model tiny-org/gated-policy is gated at {hf.url}: set HF_TOKEN to a token of an account "
                            f"granted access ({hf.url}/tiny-org/gated-policy)")
    wrong = "hf_wrongTokenNotGranted42"
    monkeypatch.setenv("HF_TOKEN", wrong)
    with pytest.raises(hub.HubError) as e:
        model_inputs.model_manifest("tiny-org/gated-policy")
    assert str(e.value) == (f"model tiny-org/gated-policy is gated at {hf.url} and HF_TOKEN's account has not been "
                            f"granted access: request it at {hf.url}/tiny-org/gated-policy, then rerun")
    assert [r["status"] for r in hf.requests()[-2:]] == [401, 403]

    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    hf.add("t-org/gated-data", {"train.jsonl": '{"input": "a"}\n{"input": "b"}\n'}, kind="dataset", gated=True)
    from stages import prepare

    out = tmp_path / "prompts"
    cfg = prepare.Config(kind="prompts", data="t-org/gated-data", tokenizer_uri="tiny-org/gated-policy",
                         apply_chat_template=True, output_uri=str(out))
    m = prepare.run(cfg)
    assert m.rows == 2 and {i["uri"] for i in m.inputs} == {
        f"hf://datasets/t-org/gated-data@{hub.resolve(hub.dataset_ref('t-org/gated-data')).sha}",
        model_inputs.model_manifest("tiny-org/gated-policy").uri}
    assert all(r["token"] for r in hf.requests()[-3:])
    text = caplog.text + "".join(capfd.readouterr()) + str(cfg.model_dump())
    text += "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    text += "".join(p.read_text(errors="replace") for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.stat().st_size < 1e5)
    assert GATED_TOKEN not in text and wrong not in text


def test_offline_reads_the_cache_and_a_miss_is_one_line(hf, monkeypatch, tmp_path):
    online = model_inputs.model_manifest("tiny-org/policy")
    local = model_inputs.fetch_model("tiny-org/policy", manifest=online)
    rows = data.load_mixture("tiny-org/sft-data", split="test")
    lineage = data.source_manifest("tiny-org/sft-data")

    seen = len(hf.requests())
    use_hub(None, monkeypatch, tmp_path / "hf", offline=True)  # HF_HUB_OFFLINE=1, and the endpoint a closed port
    m = model_inputs.model_manifest("tiny-org/policy")
    assert (m.fingerprint, m.uri, m.files) == (online.fingerprint, online.uri, online.files)
    assert model_inputs.fetch_model("tiny-org/policy", manifest=m) == local
    assert data.load_mixture("tiny-org/sft-data", split="test") == rows
    assert data.source_manifest("tiny-org/sft-data").fingerprint == lineage.fingerprint
    assert hf.requests()[seen:] == []
    with pytest.raises(hub.HubError) as e:
        model_inputs.model_manifest("tiny-org/gated-policy")
    cache = tmp_path / "hf" / "hub" / "models--tiny-org--gated-policy"
    assert str(e.value) == (f"model tiny-org/gated-policy (no local path of that name): HF_HUB_OFFLINE is set and "
                            f"tiny-org/gated-policy@main is not in this node's cache ({cache}): download it once where "
                            f"the hub is reachable (`hf download tiny-org/gated-policy --revision main` with the same "
                            f"HF_HOME), or unset HF_HUB_OFFLINE")

    # what the line says to do, done with huggingface_hub's own CLI, makes the offline run work
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hf.url, "HF_TOKEN": GATED_TOKEN}
    subprocess.run([str(Path(sys.executable).parent / "hf"), "download", "tiny-org/gated-policy", "--revision", "main"],
                   env=env, check=True, capture_output=True, timeout=300)
    m = model_inputs.model_manifest("tiny-org/gated-policy")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(model_inputs.fetch_model("tiny-org/gated-policy", manifest=m)), use_safetensors=True)


def test_store_mirror_serves_a_node_that_never_asks_the_hub(hf, s3_root, monkeypatch, tmp_path):
    driver = model_inputs.model_manifest("tiny-org/policy")
    model_inputs.fetch_model("tiny-org/policy", manifest=driver)  # in the driver's cache before there is a mirror
    monkeypatch.setenv(hub.MIRROR_ENV, f"{s3_root}/hub")
    seen = len(hf.requests())
    model_inputs.fetch_model("tiny-org/policy", manifest=driver)  # a cache hit, copied to the mirror
    assert _gets(hf, seen) == []
    rows = data.load_mixture("tiny-org/sft-data@data")  # OpenRLHF's name@data_dir: downloaded, then mirrored
    sha = driver.config["sha"]
    held = store.read_manifest(f"{s3_root}/hub/models/tiny-org/policy/{sha}")
    assert sorted(f["path"] for f in held.files) == sorted(f["path"] for f in driver.files)
    fs, path = store.filesystem(f"{s3_root}/hub/models/tiny-org/policy/refs/main")
    assert fs.cat_file(path).decode() == sha

    # another node: empty caches, offline (no route to the hub), the same mirror
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "node2-cache"))
    monkeypatch.setattr(hub, "_resolved", {})
    use_hub(None, monkeypatch, tmp_path / "node2-hf", offline=True)
    seen = len(hf.requests())
    m = model_inputs.model_manifest("tiny-org/policy")
    assert (m.fingerprint, m.uri) == (driver.fingerprint, driver.uri)
    local = model_inputs.fetch_model("tiny-org/policy", manifest=m)
    assert local.parent == tmp_path / "node2-cache" / "models"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(local), use_safetensors=True)
    assert data.load_mixture("tiny-org/sft-data@data") == rows
    assert hf.requests()[seen:] == []


def test_dataset_forms_splits_subsets_and_mixtures(hf, tmp_path):
    train = data.load_mixture("tiny-org/sft-data")
    assert len(train) == 16 and set(train[0][2]) == {"question", "response"}
    assert data.load_mixture("tiny-org/sft-data", max_samples=3) == train[:3]
    assert len(data.load_mixture("tiny-org/sft-data", split="test")) == 4  # --eval_split test
    assert len(data.load_mixture("tiny-org/sft-data@test")) == 4  # the split named per source
    one = data.load_mixture("hf://datasets/tiny-org/sft-data/data/test-00000-of-00001.parquet")  # data_files
    assert [r for _, _, r in one] == [r for _, _, r in data.load_mixture("tiny-org/sft-data", split="test")]
    with pytest.raises(data.DataError, match=r"dataset tiny-org/sft-data@nope: tiny-org/sft-data has no folder, "
                                             r"subset or split 'nope'; its splits: \['train', 'test'\]"):
        data.load_mixture("tiny-org/sft-data@nope")

    card = ("---\nconfigs:\n- config_name: easy\n  data_files: easy/*.jsonl\n- config_name: hard\n"
            "  data_files:\n  - split: train\n    path: hard/train.jsonl\n---\n")
    sha = hf.add("t-org/subsets", {"README.md": card, "easy/a.jsonl": '{"input": "e1"}\n{"input": "e2"}\n',
                                   "hard/train.jsonl": '{"input": "h1"}\n'}, kind="dataset")
    seen = len(hf.requests())
    assert [r["input"] for _, _, r in data.load_mixture("t-org/subsets@hard")] == ["h1"]
    assert not any("easy/" in p for p in _gets(hf, seen))  # only the subset's files
    m = data.source_manifest("t-org/subsets@hard")
    assert (m.uri, m.config["read"]) == (f"hf://datasets/t-org/subsets@{sha}",
                                         {"subset": "hard", "data_files": {"train": ["hard/train.jsonl"]}})
    assert m.fingerprint != data.source_manifest("t-org/subsets@easy").fingerprint

    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"question": f"l{i}", "response": "x"}) + "\n" for i in range(20)))
    mixed = data.load_mixture(f"tiny-org/sft-data,{local}", "0.25,0.75", max_samples=8)
    assert [s for s, _, _ in mixed].count("tiny-org/sft-data") == 2 and len(mixed) == 8
