"""Artifact store: every stage input and output is an fsspec URI (local path, file://, s3://, gs://, memory://).

A prefix becomes an artifact only when its `_MANIFEST.json` exists, and that file is written LAST: files
first, manifest second. A prefix without a manifest is refused by every reader. The manifest's
`fingerprint` (stage + config + input fingerprints + code version) is what makes a rerun skip finished
work: a stage whose output already holds a manifest with the same fingerprint returns it untouched.

S3 settings come from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION) or from `storage_options`; credentials never enter a manifest,
a log line or an error message (see `redact`).
"""
from __future__ import annotations

import datetime as _dt
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "_MANIFEST.json"
# Bump when the meaning of a stage's output changes: it changes every fingerprint, so old artifacts rerun.
CODE_VERSION = "2026.11.1"


class ArtifactError(RuntimeError):
    """Base class for store errors; the message always names the URI."""


class NotCommittedError(ArtifactError):
    pass


class StageMismatchError(ArtifactError):
    pass


class StoreUnreachableError(ArtifactError):
    pass


# ---------------------------------------------------------------------------------------------- URIs
def join(uri: str, *parts: str) -> str:
    out = str(uri).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def run_prefix(root: str, run_name: str, stage: str, iteration: int | None = None) -> str:
    """`{root}/{run_name}/iter-{k}/{stage}` inside a loop, `{root}/{run_name}/{stage}` outside."""
    if iteration is None:
        return join(root, run_name, stage)
    return join(root, run_name, f"iter-{iteration}", stage)


def _secrets(storage_options: dict | None) -> list[str]:
    vals = [os.environ.get(k, "") for k in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")]
    for k in ("secret", "key", "token"):
        vals.append(str((storage_options or {}).get(k, "")))
    return [v for v in vals if len(v) >= 4]


def redact(text: str, storage_options: dict | None = None) -> str:
    for s in _secrets(storage_options):
        text = text.replace(s, "***")
    return text


def storage_options_for(uri: str, storage_options: dict | None = None) -> dict:
    """Options for fsspec. For s3 we add short timeouts so an unreachable endpoint fails in seconds."""
    opts = dict(storage_options or {})
    if str(uri).startswith(("s3://", "s3a://")):
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
        client_kwargs = dict(opts.pop("client_kwargs", {}) or {})
        if endpoint:
            client_kwargs.setdefault("endpoint_url", endpoint)
        opts["client_kwargs"] = client_kwargs
        config_kwargs = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}
        config_kwargs.update(opts.pop("config_kwargs", {}) or {})
        opts["config_kwargs"] = config_kwargs
        # fsspec reuses one filesystem per settings (one S3 client, not one per call), but its listing cache
        # never expires and other processes (training jobs, Ray actors, a rerun elsewhere) write here too.
        opts.setdefault("use_listings_cache", False)
    return opts


def endpoint_of(uri: str, storage_options: dict | None = None) -> str:
    opts = storage_options_for(uri, storage_options)
    return opts.get("client_kwargs", {}).get("endpoint_url") or "default AWS endpoint"


def filesystem(uri: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(uri), **storage_options_for(uri, storage_options))
    return fs, path


def check_reachable(uri: str, storage_options: dict | None = None) -> None:
    """Fail fast (seconds, not minutes) when an object store or its bucket cannot be reached."""
    if not str(uri).startswith(("s3://", "s3a://", "gs://", "gcs://")):
        return
    fs, path = filesystem(uri, storage_options)
    bucket = path.split("/", 1)[0]
    try:
        fs.info(bucket)  # unlike exists(), info() lets connection errors through
        ok = True
    except FileNotFoundError:
        ok = False
    except Exception as e:  # botocore raises many types for a dead endpoint
        raise StoreUnreachableError(
            f"object store endpoint {endpoint_of(uri, storage_options)} is unreachable for {uri}: "
            + redact(f"{type(e).__name__}: {e}", storage_options)
        ) from None
    if not ok:
        raise FileNotFoundError(f"bucket {bucket!r} does not exist at {endpoint_of(uri, storage_options)} (for {uri})")


# ---------------------------------------------------------------------------------------------- manifests
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
            m = Manifest.from_json(f.read())
    except FileNotFoundError:
        what = "has files but no" if _has_files(fs, path) else "does not exist or has no"
        raise NotCommittedError(f"{uri} is not a committed artifact: it {what} {MANIFEST}") from None
    except Exception as e:  # OSError, botocore / aiohttp connection errors
        raise StoreUnreachableError(f"cannot read {uri} (endpoint {endpoint_of(uri, storage_options)}): "
                                    + redact(f"{type(e).__name__}: {e}", storage_options)) from None
    stages = (stage,) if isinstance(stage, str) else stage
    if stages and m.stage not in stages:
        raise StageMismatchError(f"{uri} was made by stage {m.stage!r}, expected {' or '.join(map(repr, stages))}")
    m.uri = str(uri)
    return m


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


# ---------------------------------------------------------------------------------------------- writing
class ArtifactWriter:
    """Writes one artifact: `begin()` un-commits a stale prefix, files go in, `commit()` writes the manifest.

        w = ArtifactWriter(out_uri, "filter", cfg_dict, inputs={"scored": scored_manifest})
        if (done := w.existing()): return done          # same fingerprint: skip the work
        w.begin(); w.write_table("pairs.parquet", table); return w.commit(metrics={...})
    """

    def __init__(self, uri: str, stage: str, config: dict, inputs: dict[str, Manifest] | None = None,
                 storage_options: dict | None = None):
        self.uri, self.stage, self.config = str(uri).rstrip("/"), stage, config
        self.inputs = dict(inputs or {})
        self.storage_options = storage_options
        self.fs, self.path = filesystem(self.uri, storage_options)
        self.fingerprint = fingerprint(stage, config, list(self.inputs.values()))
        self.files: list[dict] = []
        self.rows: int | None = None
        self.schema: dict | None = None
        self.created_at = _now()

    def existing(self) -> Manifest | None:
        return committed(self.uri, self.fingerprint, self.storage_options)

    def begin(self, keep: tuple[str, ...] = ()) -> None:
        """Remove a stale manifest (other fingerprint) so the prefix reads as uncommitted while we rewrite.
        Old data files are deleted too, except subfolders named in `keep` (training checkpoints)."""
        mpath = join(self.path, MANIFEST)
        if self.fs.exists(mpath):
            self.fs.rm(mpath)
        if self.fs.exists(self.path):
            for p in self.fs.ls(self.path, detail=False):
                if Path(p).name not in keep:
                    self.fs.rm(p, recursive=True)
        self.fs.makedirs(self.path, exist_ok=True)

    def _record(self, rel: str) -> None:
        size = self.fs.size(join(self.path, rel))
        self.files = [f for f in self.files if f["path"] != rel] + [{"path": rel, "size": size}]

    def write_table(self, name: str, table: pa.Table, row_group_size: int = 65536) -> str:
        dest = join(self.path, name)
        with self.fs.open(dest, "wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=row_group_size)
        self._record(name)
        self.rows = (self.rows or 0) + table.num_rows
        self.schema = {n: str(t) for n, t in zip(table.schema.names, table.schema.types)}
        return join(self.uri, name)

    def write_json(self, name: str, obj: Any) -> str:
        with self.fs.open(join(self.path, name), "w") as f:
            f.write(json.dumps(obj, indent=2, sort_keys=True, default=str))
        self._record(name)
        return join(self.uri, name)

    def upload_dir(self, local_dir: str | Path, sub: str = "") -> None:
        """Copy a local directory (an HF `save_pretrained` folder) under the prefix."""
        local_dir = Path(local_dir)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                rel = join(sub, p.relative_to(local_dir).as_posix()).lstrip("/") if sub else p.relative_to(local_dir).as_posix()
                dest = join(self.path, rel)
                self.fs.makedirs(self.fs._parent(dest), exist_ok=True)
                self.fs.put_file(str(p), dest)
                self._record(rel)

    def commit(self, metrics: dict | None = None, rows: int | None = None) -> Manifest:
        m = Manifest(
            stage=self.stage, fingerprint=self.fingerprint, uri=self.uri,
            inputs=[{"name": k, "uri": v.uri, "fingerprint": v.fingerprint, "stage": v.stage} for k, v in self.inputs.items()],
            files=sorted(self.files, key=lambda f: f["path"]), rows=rows if rows is not None else self.rows,
            schema=self.schema, metrics=metrics or {}, config=self.config, created_at=self.created_at,
            finished_at=_now(), host=socket.gethostname(),
        )
        with self.fs.open(join(self.path, MANIFEST), "w") as f:  # LAST: this is the commit
            f.write(m.to_json())
        return m


# ---------------------------------------------------------------------------------------------- reading
def table_files(m: Manifest) -> list[str]:
    return [join(m.uri, f["path"]) for f in m.files if f["path"].endswith(".parquet")]


def read_table(uri: str, stage: str | tuple[str, ...] | None = None, storage_options: dict | None = None,
               columns: list[str] | None = None) -> pa.Table:
    """All parquet files of a committed dataset artifact, concatenated."""
    m = read_manifest(uri, stage, storage_options)
    fs, _ = filesystem(uri, storage_options)
    tables = []
    for f in table_files(m):  # one GET per file: parquet's footer-then-columns range reads cost a round trip each
        tables.append(pq.read_table(io.BytesIO(fs.cat_file(filesystem(f, storage_options)[1])), columns=columns))
    if not tables:
        raise ArtifactError(f"{uri} holds no parquet file")
    return pa.concat_tables(tables)


def iter_batches(uri: str, batch_size: int = 65536, storage_options: dict | None = None) -> Iterator[pa.RecordBatch]:
    """Stream a dataset artifact batch by batch (for files larger than memory)."""
    m = read_manifest(uri, storage_options=storage_options)
    fs, _ = filesystem(uri, storage_options)
    for f in table_files(m):
        with fs.open(filesystem(f, storage_options)[1], "rb") as fh:
            yield from pq.ParquetFile(fh).iter_batches(batch_size=batch_size)


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_FLOWS_CACHE", Path.home() / ".cache" / "rlhf-flows"))


# ---------------------------------------------------------------------------------------------- model inputs
class ModelInputError(ArtifactError):
    """A model input that cannot be used (a hub id, a folder lacking config, weights or tokenizer)."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _sha256_file(path: str) -> str:
    """sha256 of a local file, remembered under the cache by (path, size, mtime) so an 8B folder is hashed
    once per machine, not once per stage."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_root() / "sha256" / key
    if memo.exists():
        return memo.read_text()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(h.hexdigest())
    return h.hexdigest()


def _content_id(fs, name: str, info: dict) -> str:
    """A content hash of one file: sha256 for local files, the object store's ETag (an MD5 of the content,
    or of its parts) where there is one, else sha256 of the bytes."""
    if isinstance(fs, LocalFileSystem):
        return "sha256:" + _sha256_file(name)
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if etag:
        return f"etag:{str(etag).strip(chr(34))}"
    h = hashlib.sha256()
    with fs.open(name, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def model_manifest(uri: str, storage_options: dict | None = None) -> Manifest:
    """Lineage entry of a model input: its manifest if it is a committed artifact, else a plain Hugging Face
    folder (what `save_pretrained` writes) on any fsspec URI, checked up front and entered as a `source`
    whose fingerprint hashes its files' content: a changed folder changes every downstream fingerprint."""
    uri = str(uri)
    if committed_any(uri, storage_options):
        return read_manifest(uri, storage_options=storage_options)
    if "://" not in uri and _HUB_ID.match(uri) and not Path(uri).exists():
        raise ModelInputError(f"model {uri!r} looks like a Hugging Face hub id: there is no hub access here; "
                              f"download it and pass the folder (a local path or s3://...)")
    fs, path = filesystem(uri, storage_options)
    if not fs.isdir(path):
        raise ModelInputError(f"model {uri} is neither a committed artifact nor a folder (it does not exist)")
    root = path.rstrip("/")
    infos = {n[len(root) + 1:]: i for n, i in fs.find(root, detail=True).items()
             if not any(part.startswith(".") for part in n[len(root) + 1:].split("/"))}  # skip .cache/ and the like
    names = set(infos)
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(fnmatch.fnmatch(n, pat) for n in names for pat in WEIGHTS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not names & set(TOKENIZER_FILES):
        missing.append(f"a tokenizer ({', '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelInputError(f"model folder {uri} lacks {' and '.join(missing)}: pass a folder written by "
                              f"save_pretrained (model and tokenizer)")
    content = [[rel, infos[rel].get("size"), _content_id(fs, join(root, rel), infos[rel])] for rel in sorted(infos)]
    return Manifest(stage="source", fingerprint=fingerprint("model-folder", {"files": content}), uri=uri,
                    files=[{"path": rel, "size": size} for rel, size, _ in content], config={"content": content})


def fetch_model(uri: str, storage_options: dict | None = None, stage: str | tuple[str, ...] | None = None,
                manifest: Manifest | None = None) -> Path:
    """A local directory holding the model at `uri` (a committed artifact or a plain HF folder), downloaded
    once per machine into a cache keyed by content: a plain folder's content hash, or a committed
    artifact's fingerprint + created_at + file list (a rewritten artifact gets a new entry). Local inputs are
    used in place."""
    m = manifest or model_manifest(uri, storage_options)
    stages = (stage,) if isinstance(stage, str) else stage
    if stages and m.stage != "source" and m.stage not in stages:
        raise StageMismatchError(f"{uri} was made by stage {m.stage!r}, expected {' or '.join(map(repr, stages))}")
    fs, path = filesystem(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    key = m.fingerprint if m.stage == "source" else hashlib.sha256(json.dumps(
        [m.fingerprint, m.created_at, m.files], sort_keys=True).encode()).hexdigest()[:24]
    dest = cache_root() / "models" / key
    if (dest / MANIFEST).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
    try:
        for f in m.files:
            target = tmp / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(join(path, f["path"]), str(target))
        (tmp / MANIFEST).write_text(m.to_json())
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def commit_model_dir(local_dir: str | Path, uri: str, stage: str, config: dict, inputs: dict[str, Manifest] | None = None,
                     metrics: dict | None = None, storage_options: dict | None = None) -> Manifest:
    """Upload an HF model folder and commit it (used by the tiny-model builder and training stages)."""
    w = ArtifactWriter(uri, stage, config, inputs, storage_options)
    if (done := w.existing()):
        return done
    w.begin()
    w.upload_dir(local_dir)
    return w.commit(metrics=metrics)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


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
