"""The writer of one artifact: keeps the previous version, refuses foreign files, journals names before writing
them, and commits by writing the manifest last."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.store.errors import ArtifactError, ForeignFilesError, NotCommittedError
from rlhf_core.store.fence import artifact_lease, check_fence
from rlhf_core.store.manifest import (JOURNAL, MANIFEST, RESERVED, TEMPS, VERSIONS, Manifest, _now, _versioned_fs,
                                      bucket_versioned, committed, file_location, fingerprint, read_manifest,
                                      write_atomic)
from rlhf_core.store.uris import filesystem, join

log = logging.getLogger("rlhf_flows")


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

    def record_dir(self, sub: str) -> None:
        """Record for the commit every file now under `sub` of this prefix (written by another process, possibly by
        an earlier attempt of this stage), with the size the store holds."""
        top = join(self.path, sub)
        for f in sorted(self.fs.find(top)) if self.fs.exists(top) else []:
            self._record(sub + "/" + f[len(top.rstrip("/")) + 1:])

    def _note(self, names: set[str]) -> None:
        """Record top-level names in the journal BEFORE writing them, so a crashed writer's files read as ours."""
        if not names <= self._journal:
            check_fence()
            self._journal |= names
            write_atomic(self.fs, join(self.path, JOURNAL), json.dumps({"names": sorted(self._journal)}))

    def _record(self, rel: str) -> None:
        size = self.fs.size(join(self.path, rel))
        self.files = [f for f in self.files if f["path"] != rel] + [{"path": rel, "size": size}]

    def write_table(self, name: str, table: pa.Table, row_group_size: int = 65536, counted: bool = True) -> str:
        """A parquet file under the prefix; `counted`: its rows and schema are the artifact's (False: a side table of
        another kind of artifact, a ppo run's rollout samples)."""
        self._note({name.split("/", 1)[0]})
        check_fence()
        dest = join(self.path, name)
        self.fs.makedirs(self.fs._parent(dest), exist_ok=True)
        with _space(self.uri, name), self.fs.open(dest, "wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=row_group_size)
        self._record(name)
        if counted:
            self.rows = (self.rows or 0) + table.num_rows
            self.schema = {n: str(t) for n, t in zip(table.schema.names, table.schema.types)}
        return join(self.uri, name)

    def write_json(self, name: str, obj: Any) -> str:
        self._note({name.split("/", 1)[0]})
        check_fence()
        self.fs.makedirs(self.fs._parent(join(self.path, name)), exist_ok=True)
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


def commit_model_dir(local_dir: str | Path, uri: str, stage: str, config: dict, inputs: dict[str, Manifest] | None = None,
                     metrics: dict | None = None, storage_options: dict | None = None) -> Manifest:
    """Upload an HF model folder and commit it (used by the tiny-model builder and training stages)."""
    w = ArtifactWriter(uri, stage, config, inputs, storage_options)
    if (done := w.existing()):
        return done
    w.begin()
    w.upload_dir(local_dir)
    return w.commit(metrics=metrics)
