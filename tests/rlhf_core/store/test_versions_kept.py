"""Keeping versions moves nothing large, a reverted config restores its kept version, and gc never races a
writer (issue 25): local folders, an unversioned and a versioned S3 bucket on the moto endpoint."""
import threading
import uuid

import pytest

from rlhf_core.inputs import data, model_inputs
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.store import versions


@pytest.fixture
def versioned_root(moto_s3) -> str:
    """A prefix on a bucket with S3 versioning enabled."""
    bucket = "rlhf-versioned"
    fs, _ = store.filesystem(f"s3://{bucket}")
    if not fs.exists(bucket):
        fs.mkdir(bucket)
        fs.call_s3("put_bucket_versioning", Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return f"s3://{bucket}/{uuid.uuid4().hex[:10]}"


def _dataset(uri, n, files=1):
    w = store.ArtifactWriter(uri, "prepare", {"n": n})
    if (done := w.existing()):
        return done
    w.begin()
    for i in range(files):
        w.write_table(f"rows-{i}.parquet", data.to_table(demo_task.sft_rows(n), "sft"))
    return w.commit(metrics={"rows": n})


def _object_versions(fs, prefix: str) -> set[tuple[str, str]]:
    bucket, key = prefix.split("/", 1)
    out = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=key)
    return {(v["Key"], v["VersionId"]) for v in out.get("Versions", [])}


def test_versioned_bucket_keeps_a_model_in_place_restores_it_and_gc_deletes_its_object_versions(versioned_root, tiny,
                                                                                                  tmp_path, caplog,
                                                                                                  monkeypatch):
    uri = f"{versioned_root}/policy"
    a = store.commit_model_dir(tiny.policy_dir, uri, "tiny-model", {"v": 1})
    b = store.commit_model_dir(tiny.reward_dir, uri, "tiny-model", {"v": 2})
    fs, path = store.filesystem(uri)
    # kept in place: under _versions/ only its manifest, which names each root object's version id
    assert fs.find(f"{path}/_versions") == [f"{path}/_versions/{a.fingerprint}/{store.MANIFEST}"]
    kept = versions.read_version(uri, a.fingerprint)
    assert kept.files_at and all(f.get("version_id") for f in kept.files)
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    local = model_inputs.fetch_model(kept.uri, manifest=kept)  # what a downstream stage of version a gets
    assert (local / "model.safetensors").read_bytes() == (tiny.policy_dir / "model.safetensors").read_bytes()
    assert fs.cat_file(f"{path}/config.json") == (tiny.reward_dir / "config.json").read_bytes()

    # the config reverted: the kept version comes back as it was, nothing is redone
    with caplog.at_level("INFO", logger="rlhf_flows"):
        again = store.commit_model_dir(tiny.reward_dir, uri, "tiny-model", {"v": 1})  # reward_dir: not uploaded
    assert (again.fingerprint, again.created_at, again.finished_at) == (a.fingerprint, a.created_at, a.finished_at)
    assert f"restored the version with fingerprint {a.fingerprint}" in caplog.text
    assert fs.cat_file(f"{path}/model.safetensors") == (tiny.policy_dir / "model.safetensors").read_bytes()
    assert store.read_manifest(uri).fingerprint == a.fingerprint
    assert [v.fingerprint for v in versions.versions(uri)] == [b.fingerprint]  # b is kept in its turn
    kept_b = versions.read_version(uri, b.fingerprint)
    b_versions = {(f"{path.split('/', 1)[1]}/{f['path']}", f["version_id"]) for f in kept_b.files}
    assert b_versions <= _object_versions(fs, path)

    assert versions.prune_versions(uri, keep=1) == [f"{uri}/_versions/{b.fingerprint}"]
    assert not b_versions & _object_versions(fs, path)  # its bytes are gone, not only hidden
    assert fs.cat_file(f"{path}/model.safetensors") == (tiny.policy_dir / "model.safetensors").read_bytes()


def test_a_reverted_config_restores_the_kept_dataset_locally(tmp_path):
    uri = str(tmp_path / "ds")
    v1 = _dataset(uri, 5)
    v2 = _dataset(uri, 7)
    back = _dataset(uri, 5)
    assert (back.fingerprint, back.created_at) == (v1.fingerprint, v1.created_at)
    assert store.read_table(uri).num_rows == 5
    assert [v.fingerprint for v in versions.versions(uri)] == [v2.fingerprint]
    assert not (tmp_path / "ds" / "_versions" / v1.fingerprint).exists()


@pytest.mark.slow
def test_gc_in_a_loop_never_leaves_a_version_naming_missing_files(s3_root):
    """A writer re-commits with a changed config 20 times (each keeps the previous version: a server-side copy
    of 8 files on this unversioned bucket) while gc prunes in a loop. After every round, with gc paused,
    every manifest (the current one and each kept version) names files that exist."""
    uri = f"{s3_root}/ds"
    fs, path = store.filesystem(uri)
    stop, idle, go = threading.Event(), threading.Event(), threading.Event()
    errors: list = []
    go.set()

    def gc_loop():
        while not stop.is_set():
            if not go.is_set():
                idle.set()
                go.wait()
                continue
            idle.clear()
            try:
                versions.prune_versions(uri, keep=2)
            except FileNotFoundError:
                pass  # the prefix is being created
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            stop.wait(0.02)

    t = threading.Thread(target=gc_loop, daemon=True)
    t.start()
    try:
        for r in range(20):
            _dataset(uri, 3 + r, files=8)
            go.clear()
            idle.wait(60)
            manifests = [store.read_manifest(uri)] + versions.versions(uri)
            for m in manifests:
                missing = [f["path"] for f in m.files if not fs.exists(store.filesystem(store.file_location(m, f)[0])[1])]
                assert not missing, f"round {r}: {m.uri} names missing files {missing}"
            go.set()
    finally:
        stop.set()
        go.set()
        t.join(30)
    assert not errors, errors
