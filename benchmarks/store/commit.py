"""Commit + read of a model folder on the moto S3 endpoint through rlhf_core.store (journal, atomic manifest,
and on the second commit the previous version kept under _versions/) vs plain `s3fs put`/`get` of the same
folder, in one run. Goal (issues 9, 25): versioning and bookkeeping cost <= 10%. The previous version is kept
in place on a bucket with S3 versioning (its manifest names the objects' version ids: nothing copied) and by a
server-side copy on an unversioned bucket; both are measured.

    .venv/bin/python benchmarks/store/commit.py [--mb 1024] [--shards 4] [--repeats 2]

Rows: first commit (empty prefix) + fetch; a re-commit with a changed config (the previous version kept first)
+ fetch, on a versioned and an unversioned bucket; s3fs put + get. Prints a markdown table (median of the
repeats) and ratios.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.artifact_io import start_moto  # noqa: E402
from rlhf_core.inputs import model_inputs  # noqa: E402
from rlhf_core import store
from rlhf_core.store import versions


def make_folder(d: Path, mb: int, shards: int) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}" * 1000)
    per = mb * 1024 * 1024 // shards
    for i in range(shards):
        with open(d / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as f:
            for _ in range(per // (8 << 20)):
                f.write(os.urandom(8 << 20))
            f.write(os.urandom(per % (8 << 20)))


def project(folder: Path, uri: str, cache: Path, version: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    store.commit_model_dir(folder, uri, "bench", {"version": version})
    t1 = time.perf_counter()
    os.environ["RLHF_FLOWS_CACHE"] = str(cache / uuid.uuid4().hex[:6])
    local = model_inputs.fetch_model(uri)
    t2 = time.perf_counter()
    assert (local / "config.json").exists()
    return t1 - t0, t2 - t1


def plain(folder: Path, uri: str, tmp: Path) -> tuple[float, float]:
    fs, path = store.filesystem(uri)
    t0 = time.perf_counter()
    fs.put(str(folder) + "/", path, recursive=True)
    t1 = time.perf_counter()
    dest = tmp / uuid.uuid4().hex[:6]
    fs.get(path + "/", str(dest), recursive=True)
    t2 = time.perf_counter()
    assert (dest / "config.json").exists() or any(dest.rglob("config.json"))
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024, help="model folder size in MiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    proc, _ = start_moto()
    rows: dict[str, list[tuple[float, float]]] = {"store: first commit + fetch": [],
                                                 "store: changed config, versioned bucket (kept in place) + fetch": [],
                                                 "store: changed config, unversioned bucket (server-side copy) + fetch": [],
                                                 "s3fs put + get": [],
                                                 "s3fs put over the previous folder + get, versioned bucket": []}
    fs, _ = store.filesystem("s3://bench-versioned")
    fs.mkdir("bench-versioned")
    fs.call_s3("put_bucket_versioning", Bucket="bench-versioned", VersioningConfiguration={"Status": "Enabled"})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            make_folder(tmp / "model", a.mb, a.shards)
            for _ in range(a.repeats):
                base = f"s3://bench-bucket/{uuid.uuid4().hex[:8]}"
                rows["s3fs put + get"].append(plain(tmp / "model", f"{base}/plain", tmp / "got"))
                rows["store: first commit + fetch"].append(project(tmp / "model", f"{base}/art", tmp / "cache", 1))
                rows["store: changed config, unversioned bucket (server-side copy) + fetch"].append(
                    project(tmp / "model", f"{base}/art", tmp / "cache", 2))
                assert len(versions.versions(f"{base}/art")) == 1
                vbase = f"s3://bench-versioned/{uuid.uuid4().hex[:8]}"
                plain(tmp / "model", f"{vbase}/plain", tmp / "got")  # then overwritten: S3 keeps the old objects
                rows["s3fs put over the previous folder + get, versioned bucket"].append(
                    plain(tmp / "model", f"{vbase}/plain", tmp / "got"))
                project(tmp / "model", f"{vbase}/art", tmp / "cache", 1)
                rows["store: changed config, versioned bucket (kept in place) + fetch"].append(
                    project(tmp / "model", f"{vbase}/art", tmp / "cache", 2))
                kept = versions.versions(f"{vbase}/art")
                assert len(kept) == 1 and kept[0].files_at  # nothing was copied
                shutil.rmtree(tmp / "got", ignore_errors=True)
                shutil.rmtree(tmp / "cache", ignore_errors=True)
                store.filesystem(base)[0].rm(store.filesystem(base)[1], recursive=True)
                vfs, vpath = store.filesystem(vbase)  # every object version, so moto's memory stays bounded
                listed = vfs.call_s3("list_object_versions", Bucket="bench-versioned", Prefix=vpath.split("/", 1)[1])
                for v in listed.get("Versions", []) + listed.get("DeleteMarkers", []):
                    vfs.call_s3("delete_object", Bucket="bench-versioned", Key=v["Key"], VersionId=v["VersionId"])
    finally:
        proc.terminate()
        proc.wait(10)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v)) for k, v in rows.items()}
    ref = sum(med["s3fs put + get"])
    vref = sum(med["s3fs put over the previous folder + get, versioned bucket"])
    print(f"{a.mb} MiB model folder ({a.shards} shards), moto_server on 127.0.0.1, median of {a.repeats}\n")
    print("| variant | write s | read s | total s | vs s3fs | vs s3fs on the versioned bucket |")
    print("|---|---|---|---|---|---|")
    for k, (w, r) in med.items():
        print(f"| {k} | {w:.2f} | {r:.2f} | {w + r:.2f} | {(w + r) / ref:.2f}x | {(w + r) / vref:.2f}x |")


if __name__ == "__main__":
    main()
