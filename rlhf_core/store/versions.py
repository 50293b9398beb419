"""Versions of an artifact: a changed config moves the committed version to `{prefix}/_versions/{fingerprint}/`
(rlhf_core/store.py's writer does that in `begin()`), so a downstream manifest's (uri, fingerprint) still
resolves here (`read_version`); `versions` lists them and `prune_versions` (`rlhf-flows gc`) is the only
code that deletes one.
"""
from __future__ import annotations

from rlhf_core import store


def read_version(uri: str, fp: str, storage_options: dict | None = None) -> store.Manifest:
    """The version of artifact `uri` with fingerprint `fp`: the current one, or one kept under _versions/.
    This is how a downstream manifest's input (uri, fingerprint) resolves after its input changed."""
    try:
        m = store.read_manifest(uri, storage_options=storage_options)
        if m.fingerprint == fp:
            return m
    except store.NotCommittedError:
        pass
    return store.read_manifest(store.join(uri, store.VERSIONS, fp), storage_options=storage_options)


def versions(uri: str, storage_options: dict | None = None) -> list[store.Manifest]:
    """Previous committed versions of `uri` kept under _versions/, newest first."""
    fs, path = store.filesystem(uri, storage_options)
    vdir = store.join(path, store.VERSIONS)
    out = []
    if fs.exists(vdir):
        for p in fs.ls(vdir, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            try:
                out.append(store.read_manifest(store.join(uri, store.VERSIONS, name), storage_options=storage_options))
            except store.NotCommittedError:
                pass
    return sorted(out, key=lambda m: m.finished_at, reverse=True)


def prune_versions(uri: str, keep: int, storage_options: dict | None = None) -> list[str]:
    """Delete all but the `keep` newest versions of artifact `uri` (the current one counts and always stays),
    and any half-archived version folder (one without a manifest: under the artifact's lease no writer is
    archiving it). Each version's manifest goes first, so no manifest ever names deleted files.
    Returns the URIs removed."""
    if keep < 1:
        raise ValueError("keep must be >= 1 (the current version always stays)")
    fs, path = store.filesystem(uri, storage_options)
    vdir = store.join(path, store.VERSIONS)
    if not fs.exists(vdir):
        return []
    names = fs.ls(vdir, detail=False)
    if len(names) <= keep - 1 and len(versions(uri, storage_options)) == len(names):
        return []  # nothing to prune, nothing half-kept: no lease taken (a gc loop must not starve the writers)
    removed = []
    with store.artifact_lease(fs, path, uri, storage_options):
        kept_all = versions(uri, storage_options)  # again, under the lease: a writer may have kept one meanwhile
        kept = {m.fingerprint for m in kept_all[: keep - 1]}
        by_name = {m.fingerprint: m for m in kept_all}
        for p in fs.ls(vdir, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name in kept:
                continue
            m = by_name.get(name)
            if m is None and not fs.find(store.join(vdir, name)):
                continue  # an empty name a listing still shows (a versioned bucket's delete markers)
            store.check_fence()
            if m is not None:
                fs.rm(store.join(vdir, name, store.MANIFEST))
                for f in m.files if m.files_at else ():  # kept in place: its object versions at the root
                    bucket, key = store.join(path, f["path"]).split("/", 1)
                    fs.call_s3("delete_object", Bucket=bucket, Key=key, VersionId=f["version_id"])
            if fs.exists(store.join(vdir, name)):
                fs.rm(store.join(vdir, name), recursive=True)
            removed.append(store.join(uri, store.VERSIONS, name))
        if not fs.exists(vdir) or not fs.ls(vdir, detail=False):
            if fs.exists(vdir):
                fs.rm(vdir, recursive=True)
    return removed
