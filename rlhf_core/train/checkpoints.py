"""Training checkpoints on the store: `{output_uri}/checkpoints/step-{N}/` holds DeepSpeed's files, and
`_CHECKPOINT.json` (written LAST, in one atomic step) names the job fingerprint, the step, and every file with
size and sha256. Every write (file, marker, prune) first checks the run lock's fence (`store.check_fence`).

A folder without the marker is an interrupted upload and is ignored. A marker with another fingerprint
(foreign) or files that do not match it (corrupt) is refused by name: training never continues from
garbage. DeepSpeed loads its files with torch.load(weights_only=False), so files are loaded only after
their sha256 matched the marker written by the job that saved them.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rlhf_core import store

MARKER = "_CHECKPOINT.json"
log = logging.getLogger("rlhf_flows")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be resumed from; the message names it. `tag` is set for a corrupt one."""

    def __init__(self, msg: str, tag: str | None = None):
        super().__init__(msg)
        self.tag = tag


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def upload(local_dir: str | Path, root_uri: str, tag: str, fingerprint: str, state: dict,
           storage_options: dict | None = None, keep_last: int = 1) -> str:
    """Copy a DeepSpeed checkpoint folder to `{root_uri}/{tag}/`, marker last; drop older checkpoints."""
    files = upload_files(local_dir, root_uri, tag, storage_options)
    return commit(root_uri, tag, fingerprint, files, state, storage_options, keep_last)


def upload_files(local_dir: str | Path, root_uri: str, tag: str, storage_options: dict | None = None) -> list[dict]:
    """Copy one rank's (or one node's) checkpoint files to `{root_uri}/{tag}/`; their marker entries."""
    local_dir = Path(local_dir)
    fs, root = store.filesystem(root_uri, storage_options)
    files = []
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local_dir).as_posix()
            dest = store.join(root, tag, rel)
            store.check_fence()  # a process that lost its run lock writes nothing more
            fs.makedirs(fs._parent(dest), exist_ok=True)
            fs.put_file(str(p), dest)
            files.append({"path": rel, "size": p.stat().st_size, "sha256": _sha256(p)})
    return files


def commit(root_uri: str, tag: str, fingerprint: str, files: list[dict], state: dict,
           storage_options: dict | None = None, keep_last: int = 1) -> str:
    """Write the marker naming every rank's files (the commit), then drop older checkpoints."""
    fs, root = store.filesystem(root_uri, storage_options)
    files = sorted({f["path"]: f for f in files}.values(), key=lambda f: f["path"])
    store.check_fence()
    # in one step (temp file + rename locally, one PUT on S3): a crash never leaves a partial marker
    store.write_atomic(fs, store.join(root, tag, MARKER),
                       json.dumps({"fingerprint": fingerprint, "tag": tag, "files": files, **state}, indent=1))
    for old in sorted(_tags(fs, root), key=_step)[:-keep_last]:
        if old != tag:
            store.check_fence()
            fs.rm(store.join(root, old), recursive=True)
    return store.join(root_uri, tag)


def _tags(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p)]


def _step(tag: str) -> int:
    try:
        return int(tag.rsplit("-", 1)[-1])
    except ValueError:
        return -1


def latest(root_uri: str, fingerprint: str, storage_options: dict | None = None, skip: set = frozenset()) -> dict | None:
    """The newest committed checkpoint's marker (plus "uri"), None if there is none; CheckpointError if the
    newest is foreign or corrupt. Tags in `skip` are passed over."""
    fs, root = store.filesystem(root_uri, storage_options)
    for tag in sorted(set(_tags(fs, root)) - set(skip), key=_step, reverse=True):
        uri, mpath = store.join(root_uri, tag), store.join(root, tag, MARKER)
        if not fs.exists(mpath):
            log.warning("ignoring incomplete checkpoint %s (no %s)", uri, MARKER)
            continue
        try:
            with fs.open(mpath, "r") as f:
                meta = json.loads(f.read())
            files, fp = meta["files"], meta["fingerprint"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"corrupt checkpoint {uri}: unreadable {MARKER} ({type(e).__name__}: {e}); "
                                  f"delete it to train from scratch", tag) from None
        if fp != fingerprint:
            raise CheckpointError(f"foreign checkpoint {uri}: made by a job with fingerprint {fp}, this job is "
                                  f"{fingerprint} (another config or input); delete it or set resume=false")
        for fi in files:
            p = store.join(root, tag, fi["path"])
            if not fs.exists(p) or fs.size(p) != fi["size"]:
                raise CheckpointError(f"corrupt checkpoint {uri}: file {fi['path']} is missing or has the wrong "
                                      f"size (expected {fi['size']} bytes); delete it to train from scratch", tag)
        return {**meta, "uri": uri}
    return None


def download(meta: dict, local_dir: str | Path, storage_options: dict | None = None) -> Path:
    """Fetch a checkpoint found by `latest` into `local_dir/{tag}` and verify every file's sha256."""
    fs, path = store.filesystem(meta["uri"], storage_options)
    dest = Path(local_dir) / meta["tag"]
    for fi in meta["files"]:
        target = dest / fi["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(store.join(path, fi["path"]), str(target))
        if _sha256(target) != fi["sha256"]:
            raise CheckpointError(f"corrupt checkpoint {meta['uri']}: file {fi['path']} does not match its sha256 "
                                  f"in {MARKER}; delete it to train from scratch", meta["tag"])
    return dest


def rank_files(files: list[dict], prefix: str, rank: int) -> list[dict]:
    """The entries under `prefix` (one group's folder of a checkpoint marker, e.g. "actor/") that data-parallel
    rank `rank` loads: the module states every rank reads (DeepSpeed's mp_rank_00_model_states.pt) and its own
    ZeRO partition (zero_pp_rank_{rank}_*: its optimizer states, and under ZeRO-3 its module partition). DeepSpeed
    loads no other rank's partition (engine._get_all_zero_checkpoint_state_dicts reads the current rank's file
    only, elastic checkpoints aside), nor the scripts it copies beside them (zero_to_fp32.py)."""
    import re

    out = []
    for f in files:
        name = f["path"].rsplit("/", 1)[-1]
        if f["path"].startswith(prefix) and name.endswith(".pt"):
            other = re.search(r"zero_pp_rank_(\d+)_", name)
            if other is None or int(other.group(1)) == rank:
                out.append(f)
    return out


def resume_point(root_uri: str, fingerprint: str, local_dir: str | Path,
                 storage_options: dict | None = None, fetch=None) -> tuple[dict | None, Path | None]:
    """The newest checkpoint that verifies (marker, sizes, every sha256), downloaded: a corrupt one is logged
    and passed over for the previous one, and with none left training starts fresh (also logged). A foreign
    checkpoint (another job's) still stops with CheckpointError: that is a configuration mistake.
    `fetch(meta) -> Path`: how the files come down (default: all of them into `local_dir`); a job whose ranks
    each fetch their own part (ppo's learners on their own nodes) raises CheckpointError(msg, tag) for a
    corrupt one."""
    skip: set[str] = set()
    while True:
        try:
            meta = latest(root_uri, fingerprint, storage_options, skip)
            if meta is None:
                if skip:
                    log.warning("no intact checkpoint left under %s: training from scratch", root_uri)
                return None, None
            return meta, (fetch or (lambda m: download(m, local_dir, storage_options)))(meta)
        except CheckpointError as e:
            if e.tag is None:
                raise
            log.warning("%s: passing over it for the previous checkpoint", str(e).split(";")[0])
            skip.add(e.tag)


def remove_all(root_uri: str, storage_options: dict | None = None) -> None:
    fs, root = store.filesystem(root_uri, storage_options)
    if fs.exists(root):
        fs.rm(root, recursive=True)
