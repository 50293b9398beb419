"""Manifests: what a committed artifact is (`Manifest`, written last as `_MANIFEST.json`), its fingerprint, reading
it and its files back (a kept version's by S3 version id), and the atomic single-object write a commit is."""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.store.errors import ArtifactError, NotCommittedError, StageMismatchError, StoreUnreachableError
from rlhf_core.store.uris import endpoint_of, filesystem, join, redact

log = logging.getLogger("rlhf_flows")
MANIFEST = "_MANIFEST.json"
# Bump when the meaning of a stage's output changes: it changes every fingerprint, so old artifacts rerun.
CODE_VERSION = "2026.11.1"

JOURNAL = "_WRITING.json"
TEMPS = (f".{MANIFEST}.tmp-", f".{JOURNAL}.tmp-", "_LOCK.json.")  # write_atomic's and the lease's temp files
VERSIONS = "_versions"
LOCK = "_LOCK.json"  # an artifact's lease while its versions are archived or pruned (the run lock has this name too)
LOCK_LEASE_S = 60.0
RESERVED = {MANIFEST, JOURNAL, VERSIONS, LOCK, "checkpoints", "_job"}  # _job: a training job's spec and data


@dataclass
class Manifest:
    stage: str
    fingerprint: str
    uri: str = ""
    inputs: list[dict] = field(default_factory=list)  # [{"name", "uri", "fingerprint", "stage"}]: lineage
    files: list[dict] = field(default_factory=list)  # [{"path" (relative), "size"}]
    rows: int | None = None
    schema: dict | None = None  # column -> arrow type string
    metrics: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    created_at: str = ""
    finished_at: str = ""
    host: str = ""
    code_version: str = CODE_VERSION
    files_at: str = ""  # "": under `uri`; "..": a version kept in place, its files at the artifact's root by version_id

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def fingerprint(stage: str, config: dict, inputs: list["Manifest"] | None = None, code_version: str = CODE_VERSION) -> str:
    """sha256 over stage name, semantic config, input fingerprints (in order) and code version."""
    payload = json.dumps(
        {"stage": stage, "config": config, "inputs": [m.fingerprint for m in inputs or []], "code": code_version},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def read_manifest(uri: str, stage: str | tuple[str, ...] | None = None, storage_options: dict | None = None) -> Manifest:
    """The committed manifest at `uri`, or a NotCommittedError naming the URI. `stage` checks its producer."""
    fs, path = filesystem(uri, storage_options)
    mpath = join(path, MANIFEST)
    try:
        with fs.open(mpath, "r") as f:
            text = f.read()
    except FileNotFoundError:
        what = "has files but no" if _has_files(fs, path) else "does not exist or has no"
        raise NotCommittedError(f"{uri} is not a committed artifact: it {what} {MANIFEST}") from None
    except Exception as e:  # OSError, botocore / aiohttp connection errors
        raise StoreUnreachableError(f"cannot read {uri} (endpoint {endpoint_of(uri, storage_options)}): "
                                    + redact(f"{type(e).__name__}: {e}", storage_options)) from None
    try:
        m = Manifest.from_json(text)
    except (ValueError, TypeError) as e:  # commits are atomic, so only a foreign or damaged file gets here
        raise ArtifactError(f"{uri}: {MANIFEST} is corrupt ({type(e).__name__}: {e})") from None
    stages = (stage,) if isinstance(stage, str) else stage
    if stages and m.stage not in stages:
        raise StageMismatchError(f"{uri} was made by stage {m.stage!r}, expected {' or '.join(map(repr, stages))}")
    m.uri = str(uri)
    return m


def file_location(m: Manifest, f: dict) -> tuple[str, str | None]:
    """(URI, S3 version id or None) of the file entry `f` of manifest `m`."""
    base = m.uri.rsplit("/", 2)[0] if m.files_at else m.uri  # {root}/_versions/{fp} -> {root}
    return join(base, f["path"]), f.get("version_id")


def _versioned_fs(uri: str, version_id: str | None, storage_options: dict | None):
    return filesystem(uri, {**(storage_options or {}), "version_aware": True} if version_id else storage_options)


def get_file(m: Manifest, f: dict, dest: str, storage_options: dict | None = None) -> None:
    """Download one file of a manifest (a kept-in-place version's by its version id)."""
    uri, vid = file_location(m, f)
    fs, path = _versioned_fs(uri, vid, storage_options)
    fs.get_file(path, dest, **({"version_id": vid} if vid else {}))


def cat_file(m: Manifest, f: dict, storage_options: dict | None = None) -> bytes:
    uri, vid = file_location(m, f)
    fs, path = _versioned_fs(uri, vid, storage_options)
    return fs.cat_file(path, **({"version_id": vid} if vid else {}))


_VERSIONING: dict = {}  # (endpoint, bucket) -> whether S3 keeps object versions there


def bucket_versioned(fs, path: str) -> bool:
    """Whether `path` is on an S3 bucket with versioning enabled (asked once per bucket)."""
    if type(fs).__name__ != "S3FileSystem":
        return False
    bucket = path.split("/", 1)[0]
    key = (str((getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")), bucket)
    if key not in _VERSIONING:
        try:
            _VERSIONING[key] = fs.call_s3("get_bucket_versioning", Bucket=bucket).get("Status") == "Enabled"
        except Exception:  # noqa: BLE001  no permission to ask: behave as unversioned (copies, still correct)
            _VERSIONING[key] = False
        if not _VERSIONING[key]:
            log.info("bucket %s has no versioning: keeping a previous version of an artifact copies it server-side; "
                     "enable bucket versioning and versions are kept in place for free", bucket)
    return _VERSIONING[key]


def write_atomic(fs, path: str, text: str) -> None:
    """Replace `path` in one step: readers see the old content or the new, never a partial file."""
    data = text.encode()
    if isinstance(fs, LocalFileSystem):
        parent, name = os.path.split(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    else:  # object stores: one PUT is atomic (s3fs sends bodies under 50 MB as one put_object)
        fs.pipe_file(path, data)


def _has_files(fs, path: str) -> bool:
    try:
        return bool(fs.exists(path) and fs.ls(path))
    except Exception:
        return False


def committed(uri: str, fp: str, storage_options: dict | None = None) -> Manifest | None:
    """The manifest at `uri` if it is committed with fingerprint `fp`, else None."""
    try:
        m = read_manifest(uri, storage_options=storage_options)
    except NotCommittedError:
        return None
    return m if m.fingerprint == fp else None


def table_files(m: Manifest) -> list[dict]:
    return [f for f in m.files if f["path"].endswith(".parquet")]


def read_table(uri: str, stage: str | tuple[str, ...] | None = None, storage_options: dict | None = None,
               columns: list[str] | None = None) -> pa.Table:
    """All parquet files of a committed dataset artifact, concatenated."""
    m = read_manifest(uri, stage, storage_options)
    tables = []
    # one GET per file (parquet's footer-then-columns range reads cost a round trip each), read by ParquetFile: pq.read_table's
    # dataset scanner drops its last reference to the Python buffer on an Arrow thread, after the call returned; at the
    # interpreter's exit that thread cannot take the GIL and the process aborts (terminate called without an active exception)
    for f in table_files(m):
        tables.append(pq.ParquetFile(pa.BufferReader(cat_file(m, f, storage_options))).read(columns=columns))
    if not tables:
        raise ArtifactError(f"{uri} holds no parquet file")
    return pa.concat_tables(tables)


def iter_batches(uri: str, batch_size: int = 65536, storage_options: dict | None = None) -> Iterator[pa.RecordBatch]:
    """Stream a dataset artifact batch by batch (for files larger than memory)."""
    m = read_manifest(uri, storage_options=storage_options)
    for f in table_files(m):
        where, vid = file_location(m, f)
        fs, path = _versioned_fs(where, vid, storage_options)
        with fs.open(path, "rb", **({"version_id": vid} if vid else {})) as fh:
            yield from pq.ParquetFile(fh).iter_batches(batch_size=batch_size)


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_FLOWS_CACHE", Path.home() / ".cache" / "rlhf-flows"))


def committed_any(uri: str, storage_options: dict | None = None) -> bool:
    """Whether `uri` holds a committed manifest (whatever its fingerprint)."""
    fs, path = filesystem(uri, storage_options)
    return fs.exists(join(path, MANIFEST))


def source_manifest(uri: str, storage_options: dict | None = None) -> Manifest:
    """Lineage entry for an input: its manifest if it is a committed artifact, else a stand-in for a raw
    file or folder (stage "source") whose fingerprint follows its files' sizes and modification times /
    ETags, so editing a raw input file changes every downstream fingerprint."""
    if committed_any(uri, storage_options):
        return read_manifest(uri, storage_options=storage_options)
    fs, path = filesystem(uri, storage_options)
    if not fs.exists(path):
        raise FileNotFoundError(f"input {uri} does not exist")
    infos = [fs.info(p) for p in (fs.find(path) if fs.isdir(path) else [path])]
    sig = [(i["name"], i.get("size"), str(i.get("ETag") or i.get("mtime") or i.get("LastModified") or "")) for i in infos]
    return Manifest(stage="source", fingerprint=fingerprint("source", {"files": sig}), uri=str(uri))
