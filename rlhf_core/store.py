"""Artifact store: every stage input and output is an fsspec URI (local path, file://, s3://, gs://, memory://).

A prefix becomes an artifact only when its `_MANIFEST.json` exists, and that file is written LAST, in one
atomic step (temp file + rename locally, one PUT on S3): files first, manifest second. A prefix without a
manifest is refused by every reader. The manifest's `fingerprint` (stage + config + input fingerprints +
code version) is what makes a rerun skip finished work: a stage whose output already holds a manifest with
the same fingerprint returns it untouched.

Versions: the current version lives at the prefix itself (an HF folder `from_pretrained` reads). A changed
config first moves the committed version to `{prefix}/_versions/{fingerprint}/` (with its manifest), so a
model that took days is never destroyed and a downstream manifest's (uri, fingerprint) still resolves
(`read_version`). Only `prune_versions` (`rlhf-flows gc URI --keep N`) deletes versions. A writer owns only
what it wrote: `_MANIFEST.json`, `_versions/`, `checkpoints/`, `_job/`, the files its manifests list and the names its
journal `_WRITING.json` recorded before writing them; any other file under `output_uri` is refused by name.

Credentials come from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ... of the process,
which training jobs and Ray workers inherit; flows can fill it from a Prefect Secret block). `storage_options`
holds only non-secret settings (endpoint, region, timeouts): `check_no_secrets` refuses key/secret/token there,
because options travel as Prefect parameters (stored in its database, shown in the UI), spec files and Ray
actor arguments. Secrets never enter a manifest, a log line or an error message (see `redact`).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
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


class LockLost(ArtifactError):
    """This process no longer holds its run lock (the fencing check before a commit): it must stop."""


class ForeignFilesError(ArtifactError):
    """The output prefix holds files this project did not write: they are never touched."""


JOURNAL = "_WRITING.json"
TEMPS = (f".{MANIFEST}.tmp-", f".{JOURNAL}.tmp-")  # write_atomic's temp files
VERSIONS = "_versions"
RESERVED = {MANIFEST, JOURNAL, VERSIONS, "checkpoints", "_job"}  # _job: a training job's spec and data


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


SECRET_KEYS = {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
               "aws_session_token", "session_token", "access_key", "secret_key", "account_key", "sas_token",
               "connection_string", "credentials", "token_file"}
SECRET_ENV = ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"]  # + names a credentials block set


def check_no_secrets(options: dict | None, where: str = "storage_options") -> dict:
    """Refuse credentials in `options` (nested dicts too), naming the keys: they belong in the environment."""
    found = []

    def walk(d, prefix):
        for k, v in (d or {}).items():
            if str(k).lower() in SECRET_KEYS:
                found.append(prefix + str(k))
            elif isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
    walk(options, f"{where}.")
    if found:
        raise ValueError(f"{', '.join(found)}: credentials are not accepted here (parameters are stored by Prefect "
                         f"and shown in its UI); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment of "
                         f"the process or worker, or name a Prefect Secret block in credentials_block")
    return options or {}


def _secrets(storage_options: dict | None) -> list[str]:
    vals = [os.environ.get(k, "") for k in SECRET_ENV]
    for k in ("secret", "key", "token"):
        vals.append(str((storage_options or {}).get(k, "")))
    return [v for v in vals if len(v) >= 4]


def redact(text: str, storage_options: dict | None = None) -> str:
    for s in _secrets(storage_options):
        text = text.replace(s, "***")
    return text


def redact_error(e: BaseException, storage_options: dict | None = None) -> BaseException:
    """`e` itself when no message in its chain holds a secret, else a RuntimeError carrying the redacted
    type and message of each link (raise it `from None`: the originals must not travel on)."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = " <- ".join(f"{type(x).__name__}: {x}" for x in chain)
    if redact(text, storage_options) == text:
        return e
    return RuntimeError(redact(text, storage_options))


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


def read_version(uri: str, fp: str, storage_options: dict | None = None) -> Manifest:
    """The version of artifact `uri` with fingerprint `fp`: the current one, or one kept under _versions/.
    This is how a downstream manifest's input (uri, fingerprint) resolves after its input changed."""
    try:
        m = read_manifest(uri, storage_options=storage_options)
        if m.fingerprint == fp:
            return m
    except NotCommittedError:
        pass
    return read_manifest(join(uri, VERSIONS, fp), storage_options=storage_options)


def versions(uri: str, storage_options: dict | None = None) -> list[Manifest]:
    """Previous committed versions of `uri` kept under _versions/, newest first."""
    fs, path = filesystem(uri, storage_options)
    vdir = join(path, VERSIONS)
    out = []
    if fs.exists(vdir):
        for p in fs.ls(vdir, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            try:
                out.append(read_manifest(join(uri, VERSIONS, name), storage_options=storage_options))
            except NotCommittedError:
                pass
    return sorted(out, key=lambda m: m.finished_at, reverse=True)


def prune_versions(uri: str, keep: int, storage_options: dict | None = None) -> list[str]:
    """Delete all but the `keep` newest versions of artifact `uri` (the current one counts and always stays),
    and any half-archived version folder. Returns the URIs removed."""
    if keep < 1:
        raise ValueError("keep must be >= 1 (the current version always stays)")
    fs, path = filesystem(uri, storage_options)
    vdir = join(path, VERSIONS)
    if not fs.exists(vdir):
        return []
    kept = {m.fingerprint for m in versions(uri, storage_options)[: keep - 1]}
    removed = []
    for p in fs.ls(vdir, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name not in kept:
            fs.rm(join(vdir, name), recursive=True)
            removed.append(join(uri, VERSIONS, name))
    if not fs.ls(vdir, detail=False):
        fs.rm(vdir, recursive=True)
    return removed


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
    """Writes one artifact: `begin()` keeps the previous version and checks the prefix holds only our files,
    files go in, `commit()` writes the manifest atomically.

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
        self._journal: set[str] = set()

    def existing(self) -> Manifest | None:
        return committed(self.uri, self.fingerprint, self.storage_options)

    def begin(self) -> None:
        """Before writing: refuse a prefix holding files we did not write (naming them); move a committed
        version with another fingerprint to _versions/{fingerprint}/ (never delete it); un-commit the prefix."""
        fs, path = self.fs, self.path
        old = None
        if fs.exists(join(path, MANIFEST)):
            old = read_manifest(self.uri, storage_options=self.storage_options)
        journal = self._read_journal()
        if fs.exists(path):
            ours = RESERVED | journal | {f["path"].split("/", 1)[0] for f in (old.files if old else [])}
            foreign = sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
                             if n not in ours and not n.startswith(TEMPS))
            if foreign:
                more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
                raise ForeignFilesError(
                    f"{self.uri} holds files this project did not write: {', '.join(foreign[:5])}{more}; refusing to "
                    f"write there (nothing was changed): choose an empty or new output_uri")
        if old is not None:
            self._archive(old)
        self._note({f["path"].split("/", 1)[0] for f in (old.files if old else [])} | journal)
        if old is not None:
            fs.rm(join(path, MANIFEST))  # un-committed from here: readers refuse the prefix
            for top in {f["path"].split("/", 1)[0] for f in old.files}:
                p = join(path, top)
                if fs.exists(p):
                    fs.rm(p, recursive=True)
        fs.makedirs(path, exist_ok=True)

    def _archive(self, old: Manifest) -> None:
        """Copy the committed version under _versions/{fingerprint}/, its manifest LAST (then it counts)."""
        fs, vpath = self.fs, join(self.path, VERSIONS, old.fingerprint)
        if fs.exists(join(vpath, MANIFEST)):
            return
        for f in old.files:
            src, dst = join(self.path, f["path"]), join(vpath, f["path"])
            if isinstance(fs, LocalFileSystem):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if not os.path.exists(dst):
                    os.link(src, dst)  # a hard link: no copy; the root's name is removed after, the bytes stay
            else:
                fs.copy(src, dst)  # server-side copy: no bytes through this machine
        old.uri = join(self.uri, VERSIONS, old.fingerprint)
        write_atomic(fs, join(vpath, MANIFEST), old.to_json())

    def _read_journal(self) -> set[str]:
        try:
            with self.fs.open(join(self.path, JOURNAL), "r") as f:
                return set(json.loads(f.read()).get("names", []))
        except (FileNotFoundError, ValueError):
            return set()

    def _note(self, names: set[str]) -> None:
        """Record top-level names in the journal BEFORE writing them, so a crashed writer's files read as ours."""
        if not names <= self._journal:
            self._journal |= names
            write_atomic(self.fs, join(self.path, JOURNAL), json.dumps({"names": sorted(self._journal)}))

    def _record(self, rel: str) -> None:
        size = self.fs.size(join(self.path, rel))
        self.files = [f for f in self.files if f["path"] != rel] + [{"path": rel, "size": size}]

    def write_table(self, name: str, table: pa.Table, row_group_size: int = 65536) -> str:
        self._note({name.split("/", 1)[0]})
        dest = join(self.path, name)
        with _space(self.uri, name), self.fs.open(dest, "wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=row_group_size)
        self._record(name)
        self.rows = (self.rows or 0) + table.num_rows
        self.schema = {n: str(t) for n, t in zip(table.schema.names, table.schema.types)}
        return join(self.uri, name)

    def write_json(self, name: str, obj: Any) -> str:
        self._note({name.split("/", 1)[0]})
        with _space(self.uri, name), self.fs.open(join(self.path, name), "w") as f:
            f.write(json.dumps(obj, indent=2, sort_keys=True, default=str))
        self._record(name)
        return join(self.uri, name)

    def upload_dir(self, local_dir: str | Path, sub: str = "") -> None:
        """Copy a local directory (an HF `save_pretrained` folder) under the prefix."""
        local_dir = Path(local_dir)
        self._note({sub.strip("/").split("/", 1)[0]} if sub else {p.name for p in local_dir.iterdir()})
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                rel = join(sub, p.relative_to(local_dir).as_posix()).lstrip("/") if sub else p.relative_to(local_dir).as_posix()
                dest = join(self.path, rel)
                self.fs.makedirs(self.fs._parent(dest), exist_ok=True)
                with _space(self.uri, rel):
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
        check_fence()
        with _space(self.uri, MANIFEST):
            write_atomic(self.fs, join(self.path, MANIFEST), m.to_json())  # LAST, in one step: this is the commit
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(join(self.path, JOURNAL))
        return m


@contextlib.contextmanager
def _space(uri: str, name: str) -> Iterator[None]:
    """A full disk (or quota, or file-size limit) under the store becomes one clear error naming the file."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise ArtifactError(f"{uri}: no space left writing {name} ({os.strerror(e.errno)}); nothing was committed: "
                            f"free space or choose another output_uri, then rerun") from None


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
                manifest: Manifest | None = None, merge: bool = True) -> Path:
    """A local directory holding the model at `uri` (a committed artifact or a plain HF folder), downloaded
    once per machine into a cache keyed by content: a plain folder's content hash, or a committed
    artifact's fingerprint + created_at + file list (a rewritten artifact gets a new entry). Local inputs are
    used in place. This is where every stage gets its models, so an adapter-only artifact (LoRA trained
    with `lora_merge=false`) is merged here into the base its lineage names (`merge=False`: its raw files)."""
    m = manifest or model_manifest(uri, storage_options)
    stages = (stage,) if isinstance(stage, str) else stage
    if stages and m.stage != "source" and m.stage not in stages:
        raise StageMismatchError(f"{uri} was made by stage {m.stage!r}, expected {' or '.join(map(repr, stages))}")
    local = _fetch_files(uri, m, storage_options)
    from rlhf_core import models

    if merge and m.stage != "source" and models.adapter_only([f["path"] for f in m.files]):
        return _merged_model(uri, local, m, storage_options)
    return local


def _fetch_files(uri: str, m: Manifest, storage_options: dict | None) -> Path:
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
        _publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _publish(tmp: Path, dest: Path) -> None:
    try:
        tmp.rename(dest)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)


def adapter_base(m: Manifest, storage_options: dict | None = None) -> Manifest:
    """The model an adapter-only artifact was trained from: its lineage's `policy` (sft, dpo) or `base`
    (train_rm) input, at the version the adapter was trained on (a changed base is kept under _versions/)."""
    src = next((i for i in m.inputs if i["name"] in ("policy", "base")), None)
    if src is None:
        raise ModelInputError(f"{m.uri}: its adapter's lineage names no base model (inputs: "
                              f"{', '.join(i['name'] for i in m.inputs) or 'none'}): merge it with "
                              f"`rlhf-flows stage lora_combine model_uri={m.uri} base_uri=... output_uri=...`")
    if src["stage"] == "source":
        base = model_manifest(src["uri"], storage_options)
        if base.fingerprint != src["fingerprint"]:
            raise ModelInputError(f"{m.uri}: its base model folder {src['uri']} changed since the adapter was trained "
                                  f"on it: merge it with `rlhf-flows stage lora_combine base_uri=...` naming that base")
        return base
    try:
        return read_version(src["uri"], src["fingerprint"], storage_options)
    except (NotCommittedError, FileNotFoundError):
        raise ModelInputError(f"{m.uri}: the base model its adapter was trained on ({src['uri']}, fingerprint "
                              f"{src['fingerprint']}) is no longer in the store") from None


def _merged_model(uri: str, artifact_dir: Path, m: Manifest, storage_options: dict | None) -> Path:
    """Base + adapter merged once per machine into the cache, keyed by the artifact and its base."""
    from rlhf_core import models

    base = adapter_base(m, storage_options)
    key = "merged-" + hashlib.sha256(json.dumps([m.fingerprint, m.created_at, m.files, base.fingerprint],
                                                sort_keys=True).encode()).hexdigest()[:24]
    dest = cache_root() / "models" / key
    if (dest / MANIFEST).exists():
        return dest
    base_dir = fetch_model(base.uri, storage_options, manifest=base)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
    try:
        models.merge_adapter(base_dir, artifact_dir, tmp, rm_stats=m.metrics)
        (tmp / MANIFEST).write_text(m.to_json())
        _publish(tmp, dest)
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


# ---------------------------------------------------------------------------------------------- fencing
_fences: list = []  # callables raising when this process no longer holds the run lock (flows/runtime.py)


@contextlib.contextmanager
def fence(check) -> Iterator[None]:
    """While inside, every commit first calls `check()` (the run lock's fencing-token check)."""
    _fences.append(check)
    try:
        yield
    finally:
        _fences.remove(check)


def check_fence() -> None:
    for check in list(_fences):
        check()


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
