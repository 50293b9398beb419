"""Artifact store against a real S3 endpoint (moto_server) and the local filesystem."""
import json
import time

import pyarrow as pa
import pytest

from rlhf_core import data, demo_task, store


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
    local = store.fetch_model(model_uri)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local)
    assert model.config.hidden_size == 128
    # Downloaded once per machine: with the weights gone from S3, the cached copy still serves.
    fs, path = store.filesystem(model_uri)
    fs.rm(f"{path}/model.safetensors")
    assert store.fetch_model(model_uri) == local


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
