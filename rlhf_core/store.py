"""Artifact store: every stage input and output is an fsspec URI (local path, file://, s3://, gs://, memory://).

A prefix becomes an artifact only when its `_MANIFEST.json` exists, and that file is written LAST, in one
atomic step (temp file + rename locally, one PUT on S3): files first, manifest second. A prefix without a
manifest is refused by every reader. The manifest's `fingerprint` (stage + config + input fingerprints +
code version) is what makes a rerun skip finished work: a stage whose output already holds a manifest with
the same fingerprint returns it untouched.

Versions: the current version lives at the prefix itself (an HF folder `from_pretrained` reads). A changed
config first keeps the committed version as `{prefix}/_versions/{fingerprint}/` (its manifest, written last),
so a model that took days is never destroyed and a downstream manifest's (uri, fingerprint) still resolves
(`read_version`, rlhf_core/versions.py). Keeping moves nothing large: on a local disk the files are hard
links; on an S3 bucket with versioning enabled the version stays in place (its manifest names each root
object's version id, `files_at`); only an unversioned bucket pays a server-side copy (logged once per bucket).
A config reverted to a kept fingerprint restores that version instead of redoing the work (`existing`).
Only `prune_versions` (`rlhf-flows gc URI --keep N`) deletes versions. A writer owns only
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
import dataclasses
import datetime as _dt
import errno
import hashlib
import io
import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core import locks
from rlhf_core.locks import LockLost  # noqa: F401  (raised by every write of a process that lost its lock)

log = logging.getLogger("rlhf_flows")
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


class ForeignFilesError(ArtifactError):
    """The output prefix holds files this project did not write: they are never touched."""


JOURNAL = "_WRITING.json"
TEMPS = (f".{MANIFEST}.tmp-", f".{JOURNAL}.tmp-", "_LOCK.json.")  # write_atomic's and the lease's temp files
VERSIONS = "_versions"
LOCK = "_LOCK.json"  # an artifact's lease while its versions are archived or pruned (the run lock has this name too)
LOCK_LEASE_S = 60.0
RESERVED = {MANIFEST, JOURNAL, VERSIONS, LOCK, "checkpoints", "_job"}  # _job: a training job's spec and data


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
        """The committed artifact with this fingerprint: the current one, or a kept version brought back (a
        config reverted to one that ran before restores its output instead of redoing the work)."""
        return committed(self.uri, self.fingerprint, self.storage_options) or self._restore()

    def _restore(self) -> Manifest | None:
        fs, vpath = self.fs, join(self.path, VERSIONS, self.fingerprint)
        if not fs.exists(join(vpath, MANIFEST)):
            return None
        self.begin()  # the current version is kept in turn, the root un-committed (under the lease)
        with self.lease():
            try:
                kept = read_manifest(join(self.uri, VERSIONS, self.fingerprint), storage_options=self.storage_options)
            except NotCommittedError:
                return None  # pruned meanwhile
            for f in kept.files:
                check_fence()
                src, vid = file_location(kept, f)
                dst = join(self.path, f["path"])
                if isinstance(fs, LocalFileSystem):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    os.link(filesystem(src)[1], dst)
                else:  # server-side (multipart above 5 GB), from the kept object version where there is one
                    vfs, path = _versioned_fs(src, vid, self.storage_options)
                    vfs.cp_file(path + (f"?versionId={vid}" if vid else ""), dst)
            m = dataclasses.replace(kept, uri=self.uri, files_at="",
                                    files=[{k: v for k, v in f.items() if k != "version_id"} for f in kept.files])
            self._write_manifest(m)
            fs.rm(join(vpath, MANIFEST))  # now current: the kept copy goes (manifest first, as gc does)
            if not kept.files_at:
                fs.rm(vpath, recursive=True)
        log.info("%s: restored the version with fingerprint %s (finished %s) kept under %s/ instead of redoing it",
                 self.uri, self.fingerprint, m.finished_at, VERSIONS)
        return m

    def begin(self) -> None:
        """Before writing: refuse a prefix holding files we did not write (naming them); move a committed
        version with another fingerprint to _versions/{fingerprint}/ (never delete it); un-commit the prefix.
        A committed prefix is kept under the artifact's lease, which `rlhf-flows gc` takes too: it never prunes a
        version being archived (a first commit keeps nothing: no lease)."""
        check_fence()
        fs, path = self.fs, self.path
        journal = self._read_journal()
        was_committed = fs.exists(join(path, MANIFEST))
        with self.lease() if was_committed else contextlib.nullcontext():
            old = read_manifest(self.uri, storage_options=self.storage_options) if was_committed else None
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
                check_fence()
                fs.rm(join(path, MANIFEST))  # un-committed from here: readers refuse the prefix
                for top in {f["path"].split("/", 1)[0] for f in old.files}:
                    p = join(path, top)
                    if fs.exists(p):
                        fs.rm(p, recursive=True)
        fs.makedirs(path, exist_ok=True)

    def lease(self):
        """This artifact's lease (`{uri}/_LOCK.json`), waited for while another writer or gc holds it."""
        return artifact_lease(self.fs, self.path, self.uri, self.storage_options)

    def _archive(self, old: Manifest) -> None:
        """Keep the committed version as _versions/{fingerprint}/, its manifest LAST (then it counts): hard
        links on a local disk, in place on a versioned S3 bucket (the root objects' current version ids),
        else a server-side copy."""
        fs, vpath = self.fs, join(self.path, VERSIONS, old.fingerprint)
        if fs.exists(join(vpath, MANIFEST)):
            return
        in_place = bucket_versioned(fs, self.path)
        for f in old.files:
            check_fence()
            src, dst = join(self.path, f["path"]), join(vpath, f["path"])
            if in_place:  # the bytes stay where they are: begin() then only hides them behind a delete marker
                bucket, key = src.split("/", 1)
                f["version_id"] = fs.call_s3("head_object", Bucket=bucket, Key=key)["VersionId"]
            elif isinstance(fs, LocalFileSystem):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                if not os.path.exists(dst):
                    os.link(src, dst)  # a hard link: no copy; the root's name is removed after, the bytes stay
            else:
                fs.copy(src, dst)  # server-side copy: no bytes through this machine
        old.files_at = ".." if in_place else ""
        old.uri = join(self.uri, VERSIONS, old.fingerprint)
        check_fence()
        write_atomic(fs, join(vpath, MANIFEST), old.to_json())

    def _read_journal(self) -> set[str]:
        try:
            with self.fs.open(join(self.path, JOURNAL), "r") as f:
                return set(json.loads(f.read()).get("names", []))
        except (FileNotFoundError, ValueError):
            return set()

    def note(self, names: set[str]) -> None:
        """Names another process will write under this prefix (a ppo learner's upload), journalled first."""
        self._note(names)

    def add_files(self, entries: list[dict]) -> None:
        """Files ({"path", "size"}) another process wrote under this prefix, recorded for the commit."""
        paths = {e["path"] for e in entries}
        self.files = [f for f in self.files if f["path"] not in paths] + list(entries)

    def _note(self, names: set[str]) -> None:
        """Record top-level names in the journal BEFORE writing them, so a crashed writer's files read as ours."""
        if not names <= self._journal:
            check_fence()
            self._journal |= names
            write_atomic(self.fs, join(self.path, JOURNAL), json.dumps({"names": sorted(self._journal)}))

    def _record(self, rel: str) -> None:
        size = self.fs.size(join(self.path, rel))
        self.files = [f for f in self.files if f["path"] != rel] + [{"path": rel, "size": size}]

    def write_table(self, name: str, table: pa.Table, row_group_size: int = 65536) -> str:
        self._note({name.split("/", 1)[0]})
        check_fence()
        dest = join(self.path, name)
        with _space(self.uri, name), self.fs.open(dest, "wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=row_group_size)
        self._record(name)
        self.rows = (self.rows or 0) + table.num_rows
        self.schema = {n: str(t) for n, t in zip(table.schema.names, table.schema.types)}
        return join(self.uri, name)

    def write_json(self, name: str, obj: Any) -> str:
        self._note({name.split("/", 1)[0]})
        check_fence()
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
                check_fence()
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
        self._write_manifest(m)
        return m

    def _write_manifest(self, m: Manifest) -> None:
        check_fence()
        with _space(self.uri, MANIFEST):
            write_atomic(self.fs, join(self.path, MANIFEST), m.to_json())  # LAST, in one step: this is the commit
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(join(self.path, JOURNAL))


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
def table_files(m: Manifest) -> list[dict]:
    return [f for f in m.files if f["path"].endswith(".parquet")]


def read_table(uri: str, stage: str | tuple[str, ...] | None = None, storage_options: dict | None = None,
               columns: list[str] | None = None) -> pa.Table:
    """All parquet files of a committed dataset artifact, concatenated."""
    m = read_manifest(uri, stage, storage_options)
    tables = []
    for f in table_files(m):  # one GET per file: parquet's footer-then-columns range reads cost a round trip each
        tables.append(pq.read_table(io.BytesIO(cat_file(m, f, storage_options)), columns=columns))
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
FENCE_ENV = "RLHF_FLOWS_FENCE"  # the run lock as child processes (training jobs, local Ray workers) check it
_fences: list = []  # callables raising LockLost when this process no longer holds its run lock (flows/lock.py)


@contextlib.contextmanager
def fence(check, lock_uri: str, token: str, storage_options: dict | None = None) -> Iterator[None]:
    """While inside, every write under the store first calls `check()` (the run lock's token check); processes
    started meanwhile inherit the lock's URI and token in RLHF_FLOWS_FENCE and check it themselves."""
    _fences.append(check)
    before = os.environ.get(FENCE_ENV)
    os.environ[FENCE_ENV] = json.dumps({"uri": lock_uri, "token": token, "storage_options": storage_options or {}})
    try:
        yield
    finally:
        _fences.remove(check)
        if before is None:
            os.environ.pop(FENCE_ENV, None)
        else:
            os.environ[FENCE_ENV] = before


def check_fence() -> None:
    """Called before every write: raises LockLost (naming the holder) in a process whose run lock was lost."""
    if _fences:
        for check in list(_fences):
            check()
    elif (spec := os.environ.get(FENCE_ENV)):
        spec = json.loads(spec)
        fs, path = filesystem(spec["uri"], spec.get("storage_options"))
        try:
            held = json.loads(fs.cat_file(path) or b"{}")
        except FileNotFoundError:
            held = None
        if not held or held.get("token") != spec["token"]:
            raise LockLost(f"lock {spec['uri']} lost: now held by {locks.describe(held)}; this process "
                           f"(pid {os.getpid()}) stops writing")


def artifact_lease(fs, path: str, uri: str, storage_options: dict | None = None):
    """The lease an artifact's writer (archiving in `begin`) and `prune_versions` take, waiting up to a lease."""
    return locks.lease(fs, join(path, LOCK), join(uri, LOCK), LOCK_LEASE_S, what=f"artifact {uri}",
                       redact=lambda t: redact(t, storage_options), wait_s=LOCK_LEASE_S)


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
