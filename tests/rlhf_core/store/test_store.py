"""Artifact store against a real S3 endpoint (moto_server) and the local filesystem."""
import json
import time

import pyarrow as pa
import pytest

from rlhf_core.inputs import data, model_inputs
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.store import versions


def _dataset(uri, stage="prepare", config=None, n=10):
    w = store.ArtifactWriter(uri, stage, config or {"n": n})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(n), "sft"))
    return w.commit(metrics={"rows": n})


def test_parquet_and_model_roundtrip_on_s3(s3_root, tiny, tmp_path, monkeypatch):
    m = _dataset(f"{s3_root}/sft", n=25)
    assert m.rows == 25 and m.schema == {"input": "string", "output": "string"}
    back = store.read_table(f"{s3_root}/sft", stage="prepare")
    assert back.num_rows == 25 and back.column("input")[0].as_py().startswith("Review of the")
    assert sum(b.num_rows for b in store.iter_batches(f"{s3_root}/sft", batch_size=7)) == 25

    model_uri = f"{s3_root}/policy"
    mm = store.commit_model_dir(tiny.policy_dir, model_uri, "tiny-model", {"kind": "policy"})
    assert {f["path"] for f in mm.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    local = model_inputs.fetch_model(model_uri)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local)
    assert model.config.hidden_size == 128
    # Downloaded once per machine: with the weights gone from S3, the cached copy still serves.
    fs, path = store.filesystem(model_uri)
    fs.rm(f"{path}/model.safetensors")
    assert model_inputs.fetch_model(model_uri) == local


def test_uncommitted_prefix_is_refused(s3_root):
    fs, path = store.filesystem(f"{s3_root}/half")
    with fs.open(f"{path}/rows.parquet", "wb") as f:  # files without the manifest: a crashed writer
        f.write(b"partial")
    with pytest.raises(store.NotCommittedError, match=r"half is not a committed artifact: it has files but no _MANIFEST.json"):
        store.read_table(f"{s3_root}/half")
    with pytest.raises(store.NotCommittedError, match="does not exist or has no _MANIFEST.json"):
        store.read_manifest(f"{s3_root}/never-written")


def test_manifest_from_another_stage_is_refused(tmp_path):
    _dataset(str(tmp_path / "a"), stage="score")
    with pytest.raises(store.StageMismatchError, match=r"was made by stage 'score', expected 'filter'"):
        store.read_table(str(tmp_path / "a"), stage="filter")


def test_same_fingerprint_is_skipped_and_changed_config_rewrites(tmp_path):
    uri = str(tmp_path / "ds")
    first = _dataset(uri, config={"n": 5})
    w = store.ArtifactWriter(uri, "prepare", {"n": 5})
    assert w.existing().created_at == first.created_at  # a rerun finds the committed artifact
    w2 = store.ArtifactWriter(uri, "prepare", {"n": 6})
    assert w2.fingerprint != first.fingerprint and w2.existing() is None
    w2.begin()  # un-commits: readers refuse the prefix while it is rewritten
    with pytest.raises(store.NotCommittedError):
        store.read_manifest(uri)


def test_fingerprint_follows_stage_config_inputs_and_code():
    a = store.Manifest(stage="x", fingerprint="aaa")
    b = store.Manifest(stage="x", fingerprint="bbb")
    base = store.fingerprint("score", {"k": 1}, [a])
    assert base == store.fingerprint("score", {"k": 1}, [a])
    assert len({base, store.fingerprint("filter", {"k": 1}, [a]), store.fingerprint("score", {"k": 2}, [a]),
                store.fingerprint("score", {"k": 1}, [b]), store.fingerprint("score", {"k": 1}, [a], "v0")}) == 5


def test_manifest_records_lineage_files_and_times(tmp_path):
    src = _dataset(str(tmp_path / "src"))
    w = store.ArtifactWriter(str(tmp_path / "dst"), "filter", {"method": "rs"}, {"scored": src})
    w.begin()
    w.write_table("part-0.parquet", pa.table({"input": ["a"], "output": ["b"]}))
    m = w.commit(metrics={"kept": 1})
    raw = json.loads((tmp_path / "dst" / "_MANIFEST.json").read_text())
    assert raw["inputs"] == [{"name": "scored", "uri": src.uri, "fingerprint": src.fingerprint, "stage": "prepare"}]
    assert raw["files"][0]["path"] == "part-0.parquet" and raw["files"][0]["size"] > 0
    assert raw["rows"] == 1 and raw["metrics"] == {"kept": 1} and raw["created_at"] <= raw["finished_at"]
    assert m.host and m.code_version == store.CODE_VERSION


def test_source_manifest_changes_when_a_raw_file_changes(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"input": "a"}\n')
    one = store.source_manifest(str(f)).fingerprint
    time.sleep(0.01)
    f.write_text('{"input": "a"}\n{"input": "b"}\n')
    assert store.source_manifest(str(f)).fingerprint != one


def test_missing_bucket_is_named(moto_s3):
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        store.check_reachable("s3://no-such-bucket/x")


def test_unreachable_endpoint_fails_fast_without_leaking_credentials(monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDLEAKCHECK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    with pytest.raises(store.StoreUnreachableError) as e:
        store.check_reachable("s3://bucket/run")
    msg = str(e.value)
    assert f"127.0.0.1:{port} is unreachable for s3://bucket/run" in msg
    assert "very-secret-value" not in msg and "AKIDLEAKCHECK" not in msg


def test_redact_hides_secrets(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    assert store.redact("denied for s3cr3t-value and k3y-xyz", {"key": "k3y-xyz"}) == "denied for *** and ***"
    # the hub token of either name (issue 37: huggingface_hub reads both)
    monkeypatch.setenv("HF_TOKEN", "hf_tokenAAAA1111")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_legacyBBBB2222")
    assert store.redact("401 for hf_tokenAAAA1111 / hf_legacyBBBB2222") == "401 for *** / ***"
    from rlhf_core.runtime.ray_jobs import job_env

    assert job_env()["HF_TOKEN"] == "hf_tokenAAAA1111"  # a Ray Job fetches its hub models with it


def test_objects_written_by_another_process_are_seen(s3_root):
    """The cached S3 filesystem must not serve stale listings: training jobs and Ray actors write to the
    store from other processes while the flow process polls it."""
    import subprocess
    import sys

    fs, path = store.filesystem(s3_root)
    fs.pipe_file(f"{path}/ckpt/a", b"1")
    assert [p.rsplit("/", 1)[1] for p in fs.glob(f"{path}/ckpt/*")] == ["a"]  # listing now known to this process
    code = (f"from rlhf_core import store; fs, p = store.filesystem({s3_root!r}); fs.pipe_file(p + '/ckpt/b', b'2')")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert [p.rsplit("/", 1)[1] for p in fs.glob(f"{path}/ckpt/*")] == ["a", "b"]
    assert store.filesystem(s3_root)[0].exists(f"{path}/ckpt/b")


def test_changed_config_keeps_the_previous_version_and_lineage_still_resolves(tmp_path):
    uri = str(tmp_path / "ds")
    v1 = _dataset(uri, config={"n": 5}, n=5)
    down = store.ArtifactWriter(str(tmp_path / "down"), "filter", {}, {"src": v1})
    down.begin()
    down.write_json("x.json", {})
    down.commit()
    v2 = _dataset(uri, config={"n": 7}, n=7)
    assert store.read_table(uri).num_rows == 7  # the prefix holds the new version
    kept = versions.versions(uri)
    assert [m.fingerprint for m in kept] == [v1.fingerprint]
    assert store.read_table(kept[0].uri).num_rows == 5 and kept[0].uri == f"{uri}/_versions/{v1.fingerprint}"
    rec = store.read_manifest(str(tmp_path / "down")).inputs[0]  # the downstream manifest still names what it used
    assert versions.read_version(rec["uri"], rec["fingerprint"]).created_at == v1.created_at
    assert versions.read_version(uri, v2.fingerprint).created_at == v2.created_at
    _dataset(uri, config={"n": 9}, n=9)
    assert len(versions.versions(uri)) == 2
    removed = versions.prune_versions(uri, keep=2)  # the current one + the newest previous
    assert removed == [f"{uri}/_versions/{v1.fingerprint}"]
    assert [m.fingerprint for m in versions.versions(uri)] == [v2.fingerprint] and store.read_table(uri).num_rows == 9


@pytest.mark.slow
def test_changed_model_config_on_s3_keeps_the_previous_model(s3_root, tiny):
    uri = f"{s3_root}/policy"
    a = store.commit_model_dir(tiny.policy_dir, uri, "tiny-model", {"v": 1})
    store.commit_model_dir(tiny.reward_dir, uri, "tiny-model", {"v": 2})
    old = versions.read_version(uri, a.fingerprint)
    fs, _ = store.filesystem(uri)
    assert fs.cat_file(store.filesystem(f"{old.uri}/config.json")[1]) == (tiny.policy_dir / "config.json").read_bytes()
    assert fs.cat_file(store.filesystem(f"{uri}/config.json")[1]) == (tiny.reward_dir / "config.json").read_bytes()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_output_uri_holding_foreign_files_is_refused_and_untouched(where, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_root")
    fs, path = store.filesystem(root)
    for name in ("notes.txt", "photos/a.jpg", "b.csv", "c", "d", "e", "f"):
        fs.makedirs(fs._parent(f"{path}/mine/{name}"), exist_ok=True)
        fs.pipe_file(f"{path}/mine/{name}", b"user data")
    with pytest.raises(store.ForeignFilesError, match=r"mine holds files this project did not write: "
                                                      r"b.csv, c, d, e, f and 2 more"):
        _dataset(f"{root}/mine")
    assert fs.cat_file(f"{path}/mine/notes.txt") == b"user data" and fs.exists(f"{path}/mine/photos/a.jpg")
    assert not fs.exists(f"{path}/mine/_MANIFEST.json")
    # Beside a committed artifact too: a file the user dropped in later is never deleted by a rewrite.
    _dataset(f"{root}/ds", config={"n": 1})
    fs.pipe_file(f"{path}/ds/README.md", b"mine")
    with pytest.raises(store.ForeignFilesError, match="README.md"):
        _dataset(f"{root}/ds", config={"n": 2})
    assert store.read_manifest(f"{root}/ds").config == {"n": 1}


def test_a_crashed_writers_files_are_its_own_on_rerun(tmp_path):
    uri = str(tmp_path / "ds")
    w = store.ArtifactWriter(uri, "prepare", {"n": 3})
    w.begin()
    w.write_table("part-0.parquet", data.to_table(demo_task.sft_rows(3), "sft"))
    # crash before commit: the rerun must not call part-0.parquet foreign
    assert _dataset(uri, config={"n": 3}, n=3).rows == 3
    assert not (tmp_path / "ds" / store.JOURNAL).exists()


def test_commit_is_atomic_for_a_concurrent_reader(tmp_path):
    """Readers polling while manifests are rewritten never see a partial one (the landed code wrote in place)."""
    import threading

    uri = str(tmp_path / "ds")
    w = store.ArtifactWriter(uri, "prepare", {"n": 1})
    w.begin()
    w.write_json("x.json", {})
    big = {f"k{i}": "v" * 200 for i in range(2000)}  # a manifest of ~400 KB: many write() calls
    stop, errors = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                store.read_manifest(uri)
            except store.NotCommittedError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(40):
            w.commit(metrics={**big, "i": i})
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:1]


def test_truncated_manifest_is_named_corrupt_not_unreachable(tmp_path):
    _dataset(str(tmp_path / "ds"))
    p = tmp_path / "ds" / store.MANIFEST
    p.write_text(p.read_text()[:50])
    with pytest.raises(store.ArtifactError, match=r"ds: _MANIFEST.json is corrupt") as e:
        store.read_manifest(str(tmp_path / "ds"))
    assert not isinstance(e.value, store.StoreUnreachableError)
