"""Models and datasets on the Hugging Face hub, named as in an OpenRLHF command, resolved to a commit and
fetched with huggingface_hub once per node (docs/models.md has the user's view).

Names (an existing local path stays a local path; a name ending in a data file's extension is a file):
  model    `org/name`, `org/name@rev` (a branch, tag or commit sha), `hf://org/name[@rev]`
  dataset  `org/name`, `org/name@X` (OpenRLHF's `data_dir` X; here a subset the card declares comes first, a
           split last), `hf://datasets/org/name[@rev][/path]` (a folder -> data_dir, a file or glob -> data_files)

`resolve` asks the hub for the revision's commit and file list; lineage carries `hf://org/name@<sha>` and the
fingerprint the sha, so a moved branch changes every downstream fingerprint and a pinned sha never does. A
read in the same process reuses the sha its stage's lineage resolved (`fresh=False`): what is read is what is
recorded. `fetch` gets only the files asked for: from this node's huggingface_hub cache, its copy of the store
mirror, the mirror, or the hub, in that order; online, it copies to the mirror what the mirror lacks.

Settings come from the environment when a stage runs and are passed to huggingface_hub (which reads its own
once, at import): HF_ENDPOINT, HF_TOKEN (read by huggingface_hub only: never in a config, manifest, log line
or error here), HF_HUB_OFFLINE (no request at all: the sha from the mirror's or the cache's ref), HF_HOME /
HF_HUB_CACHE, and RLHF_FLOWS_HUB_MIRROR=s3://bucket/hub (`{mirror}/{models|datasets}/org/name/{sha}/`, its
_MANIFEST.json last; `.../refs/{rev}` the sha last resolved at the hub). Every failure is one `HubError` line
naming the repo and what to do.
"""
from __future__ import annotations

import fnmatch
import glob
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core import store
from rlhf_core.inputs import models

log = logging.getLogger("rlhf_flows")

MIRROR_ENV = "RLHF_FLOWS_HUB_MIRROR"
DATA_EXT = tuple(e + z for e in (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt")
                 for z in ("", ".gz", ".zst", ".bz2", ".xz"))
_REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_PLAIN = re.compile(rf"^(?P<repo>{_REPO})(?:@(?P<at>[^@\s]+))?$")
_HF = re.compile(rf"^hf://(?:(?P<type>models|datasets|spaces)/)?(?P<repo>{_REPO})(?:@(?P<rev>[^/]+))?(?:/(?P<path>.*))?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class HubError(store.ArtifactError):
    """A hub model or dataset that cannot be used (missing, gated, unknown revision, unreachable, not cached
    offline); the message names the repo and what to do, and never the token."""


class HubModelError(HubError, models.ModelInputError):
    """A hub model that cannot be used: caught wherever a model input's error is."""


def _error(ref: Ref, message: str) -> HubError:
    return (HubModelError if ref.kind == "model" else HubError)(message)


@dataclass(frozen=True)
class Ref:
    """A hub name as given: kind "model" or "dataset", the repo, the revision asked for, and for a dataset
    the path inside the repo (hf://) or OpenRLHF's `@X`."""

    kind: str
    repo: str
    revision: str = "main"
    path: str = ""
    at: str | None = None

    def __str__(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        if self.kind == "model":
            return f"{self.repo}{rev}"
        if self.path or rev:
            return f"hf://datasets/{self.repo}{rev}" + (f"/{self.path}" if self.path else "")
        return self.repo + (f"@{self.at}" if self.at else "")


@dataclass
class Snapshot:
    """A resolved revision: its commit sha and files (path in the repo -> size)."""

    ref: Ref
    sha: str
    files: dict[str, int | None] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        """The pinned name that lineage records: `hf://[datasets/]org/name@<sha>[/path]`."""
        kind = "datasets/" if self.ref.kind == "dataset" else ""
        return f"hf://{kind}{self.ref.repo}@{self.sha}" + (f"/{self.ref.path}" if self.ref.path else "")


# ---------------------------------------------------------------------------------------------- names
def _local(repo: str, name: str) -> bool:
    return Path(repo).exists() or Path(name).exists()


def model_ref(uri: str) -> Ref | None:
    """The hub model `uri` names, or None for anything else (a local path, an fsspec URI, an artifact)."""
    uri = str(uri)
    if uri.startswith("hf://"):
        m = _HF.match(uri)
        if not m or m["type"] in ("datasets", "spaces") or m["path"]:
            raise HubModelError(f"{uri} is not a hub model name: a model is a whole model repo, hf://org/name or "
                                f"hf://org/name@revision")
        return Ref("model", m["repo"], urllib.parse.unquote(m["rev"] or "main"))
    m = _PLAIN.match(uri)
    if "://" in uri or not m or _local(m["repo"], uri):
        return None
    return Ref("model", m["repo"], m["at"] or "main")


def dataset_ref(source: str) -> Ref | None:
    """The hub dataset one data source names, or None for a file, folder, fsspec URI or artifact."""
    source = str(source).strip()
    if source.startswith("hf://"):
        m = _HF.match(source)
        if not m or m["type"] != "datasets":
            raise HubError(f"{source} is not a hub dataset name: hf://datasets/org/name[@revision][/path]")
        return Ref("dataset", m["repo"], urllib.parse.unquote(m["rev"] or "main"), path=(m["path"] or "").strip("/"))
    m = _PLAIN.match(source)
    if "://" in source or not m or m["repo"].lower().endswith(DATA_EXT) or _local(m["repo"], source):
        return None
    return Ref("dataset", m["repo"], at=m["at"])


# ---------------------------------------------------------------------------------------------- settings
def endpoint(shown: bool = False) -> str:
    """HF_ENDPOINT (default the public hub); `shown`: without a user:password part, for messages."""
    url = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    u = urllib.parse.urlsplit(url)
    return u._replace(netloc=u.netloc.rpartition("@")[2]).geturl() if shown else url


def offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir(what: str = "hub") -> Path:
    """The node's huggingface_hub cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), or with
    `what="datasets"` the datasets library's (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") if what == "hub" else \
        os.environ.get("HF_DATASETS_CACHE")
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(explicit or os.path.join(home, what))))


def mirror() -> str | None:
    return os.environ.get(MIRROR_ENV) or None


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _redact(text: str) -> str:
    for secret in {os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN"), _token()}:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _cache_repo(ref: Ref) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=ref.repo, repo_type=ref.kind)


# ---------------------------------------------------------------------------------------------- resolution
_resolved: dict[tuple, Snapshot] = {}


def resolve(ref: Ref, fresh: bool = True) -> Snapshot:
    """The commit `ref`'s revision names and its files: asked at the hub, or with HF_HUB_OFFLINE from the store
    mirror's ref and copy, else this node's cache. `fresh=False` reuses this process's last answer (a read
    after the stage's lineage)."""
    key = (ref.kind, ref.repo, ref.revision, endpoint())
    if not fresh and key in _resolved:
        return Snapshot(ref, _resolved[key].sha, _resolved[key].files)
    snap = _resolve_offline(ref) if offline() else _resolve_online(ref)
    _resolved[key] = snap
    log.info("%s %s resolved to commit %s", ref.kind, ref, snap.sha)
    return snap


def _resolve_online(ref: Ref) -> Snapshot:
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint()).repo_info(ref.repo, repo_type=ref.kind, revision=ref.revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line (_hub_error)
        raise _hub_error(ref, e) from None
    return Snapshot(ref, info.sha, {s.rfilename: s.size for s in info.siblings or []})


def _resolve_offline(ref: Ref) -> Snapshot:
    sha = ref.revision if _SHA.match(ref.revision) else None
    if sha is None and (m := mirror()):
        sha = _read(store.join(m, f"{ref.kind}s", ref.repo, "refs", ref.revision))
    if sha is None and (p := _cache_repo(ref) / "refs" / ref.revision).is_file():
        sha = p.read_text().strip()
    files = {**_mirror_files(ref, sha), **_files_in(_cache_repo(ref) / "snapshots" / sha)} if sha else {}
    if not files:
        raise _error(ref, _offline_miss(ref))
    return Snapshot(ref, sha, files)


def _offline_miss(ref: Ref, what: str = "") -> str:
    where = f"this node's cache ({_cache_repo(ref)})" + (f" nor the mirror {mirror()}" if mirror() else "")
    kind = " --repo-type dataset" if ref.kind == "dataset" else ""
    return (f"{ref.kind} {ref} (no local path of that name): HF_HUB_OFFLINE is set and "
            f"{what or f'{ref.repo}@{ref.revision}'} is not in {where}: "
            f"download it once where the hub is reachable (`hf download {ref.repo} --revision {ref.revision}{kind}` "
            f"with the same HF_HOME), or unset HF_HUB_OFFLINE")


def _hub_error(ref: Ref, e: BaseException) -> HubError:
    """One line for a failed hub call, from the error's type; only an unexpected error's own text is shown,
    redacted."""
    from huggingface_hub import errors

    at, token = endpoint(shown=True), _token()
    page = f"{at}/{'datasets/' if ref.kind == 'dataset' else ''}{ref.repo}"
    name = f"{ref.kind} {ref}"
    if isinstance(e, errors.GatedRepoError):
        if token:
            msg = (f"{name} is gated at {at} and HF_TOKEN's account has not been granted access: request it at "
                   f"{page}, then rerun")
        else:
            msg = f"{name} is gated at {at}: set HF_TOKEN to a token of an account granted access ({page})"
    elif isinstance(e, errors.RevisionNotFoundError):
        msg = f"{name}: {ref.repo} has no revision {ref.revision!r} at {at}: name a branch, tag or commit sha"
    elif isinstance(e, errors.RepositoryNotFoundError):
        private = "" if token else " (a private repo needs HF_TOKEN)"
        msg = f"{name}: no such {ref.kind} repo at {at}{private}, and no local path of that name"
    elif isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        msg = f"{name}: the hub at {at} answered HTTP {e.response.status_code}: retry later, or set HF_ENDPOINT to a mirror"
    elif isinstance(e, (OSError, TimeoutError)) or "Connect" in type(e).__name__ or "Timeout" in type(e).__name__:
        msg = (f"{name} (no local path of that name): the hub at {at} is unreachable ({type(e).__name__}): set "
               f"HF_ENDPOINT to a reachable hub or mirror, or HF_HUB_OFFLINE=1 to use this node's cache")
    else:
        msg = f"{name}: {type(e).__name__}: {_redact(str(e)).splitlines()[0] if str(e) else ''}"
    return _error(ref, msg)


# ---------------------------------------------------------------------------------------------- fetching
def fetch(snap: Snapshot, files: list[str]) -> Path:
    """A local folder holding `files` of the snapshot, downloaded once per node: this node's huggingface_hub
    cache, else its copy of the store mirror, else the mirror (into that copy), else the hub. Online, what the
    node holds is also copied to the mirror (once) and the revision's ref recorded there and in the cache."""
    want = {f: snap.files.get(f) for f in files}
    online = not offline()
    if online and snap.ref.revision != snap.sha:  # as huggingface_hub records it: offline runs resolve by it
        ref_file = _cache_repo(snap.ref) / "refs" / snap.ref.revision
        if not ref_file.is_file() or ref_file.read_text() != snap.sha:
            ref_file.parent.mkdir(parents=True, exist_ok=True)
            ref_file.write_text(snap.sha)
    local = next((f for f in (_cache_repo(snap.ref) / "snapshots" / snap.sha, _mirror_copy(snap)) if _has(f, want)), None)
    if local is None and mirror() and _has_mirror(snap, want):
        local = _from_mirror(snap, want)
    if local is None and not online:
        raise _error(snap.ref, _offline_miss(snap.ref, f"commit {snap.sha} (all of {', '.join(sorted(want))})"))
    if local is None:
        local = _download(snap, want)
    if online and mirror():
        _to_mirror(snap, local, want)
    return _touch(local)


def _download(snap: Snapshot, want: dict[str, int | None]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(snap.ref.repo, repo_type=snap.ref.kind, revision=snap.sha, endpoint=endpoint(),
                                       cache_dir=cache_dir(), allow_patterns=[glob.escape(f) for f in want]))
    except Exception as e:  # noqa: BLE001
        raise _hub_error(snap.ref, e) from None
    if not _has(local, want):
        lost = ", ".join(f for f in want if not (local / f).is_file())
        raise _error(snap.ref, f"{snap.ref.kind} {snap.ref}: the hub at {endpoint(shown=True)} served an incomplete copy "
                               f"of commit {snap.sha} (missing or cut: {lost or 'a file of the wrong size'})")
    return local


def _has(folder: Path, want: dict[str, int | None]) -> bool:
    for f, size in want.items():
        p = folder / f
        if not p.is_file() or (size is not None and p.stat().st_size != size):
            return False
    return True


def _files_in(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and p.name != store.MANIFEST} if folder.is_dir() else {}


def _touch(folder: Path) -> Path:
    """Stamp a model-cache entry's last use (prune_cache drops the least recently used)."""
    if (folder / store.MANIFEST).exists():
        try:
            os.utime(folder / store.MANIFEST)
        except OSError:
            pass
    return folder


# ---------------------------------------------------------------------------------------------- the store mirror
def _mirror_at(ref: Ref, sha: str) -> str:
    return store.join(mirror(), f"{ref.kind}s", ref.repo, sha)


def _mirror_copy(snap: Snapshot) -> Path:
    """This node's copy of mirrored files, in the model cache (so `rlhf-flows gc --cache-max-gb` prunes it)."""
    return store.cache_root() / "models" / f"hub--{snap.ref.kind}s--{snap.ref.repo.replace('/', '--')}--{snap.sha}"


def _read(uri: str) -> str | None:
    try:
        fs, path = store.filesystem(uri)
        return fs.cat_file(path).decode().strip()
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - an unreachable store or no credentials: one line
        raise HubError(f"the hub mirror {mirror()} ({MIRROR_ENV}) cannot be read: "
                       f"{store.redact(f'{type(e).__name__}: {e}').splitlines()[0]}") from None


def _mirror_files(ref: Ref, sha: str) -> dict[str, int | None]:
    if not mirror():
        return {}
    text = _read(store.join(_mirror_at(ref, sha), store.MANIFEST))
    return {f["path"]: f.get("size") for f in store.Manifest.from_json(text).files} if text else {}


def _has_mirror(snap: Snapshot, want: dict[str, int | None]) -> bool:
    held = _mirror_files(snap.ref, snap.sha)
    return all(f in held and (size is None or held[f] == size) for f, size in want.items())


def _from_mirror(snap: Snapshot, want: dict[str, int | None]) -> Path:
    dest = _mirror_copy(snap)
    fs, root = store.filesystem(_mirror_at(snap.ref, snap.sha))
    for f, size in want.items():
        target = dest / f
        if target.is_file() and (size is None or target.stat().st_size == size):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        fs.get_file(store.join(root, f), str(tmp))
        os.replace(tmp, target)  # a concurrent reader sees a whole file or none
    (dest / store.MANIFEST).write_text(store.Manifest(stage="hub-mirror", fingerprint=snap.sha, uri=snap.uri).to_json())
    log.info("%s %s: commit %s read from the mirror %s", snap.ref.kind, snap.ref, snap.sha, mirror())
    return dest


def _to_mirror(snap: Snapshot, local: Path, want: dict[str, int | None]) -> None:
    """Copy to the mirror what it lacks of `want` (its manifest last), and point the revision's ref at the sha;
    nothing is written when it holds both. A mirror this process cannot write is a warning: the stage has its
    files."""
    try:
        fs, root = store.filesystem(_mirror_at(snap.ref, snap.sha))
        held = _mirror_files(snap.ref, snap.sha)
        if missing := [f for f in want if f not in held]:
            for f in missing:
                fs.put_file(str(local / f), store.join(root, f))
            files = sorted({**held, **{f: (local / f).stat().st_size for f in want}}.items())
            m = store.Manifest(stage="hub-mirror", fingerprint=snap.sha, uri=snap.uri, files=[
                {"path": f, "size": size} for f, size in files], config={"repo": snap.ref.repo, "sha": snap.sha})
            fs.pipe_file(store.join(root, store.MANIFEST), m.to_json().encode())
        ref = store.join(mirror(), f"{snap.ref.kind}s", snap.ref.repo, "refs", snap.ref.revision)
        if snap.ref.revision != snap.sha and _read(ref) != snap.sha:
            rfs, rpath = store.filesystem(ref)
            rfs.pipe_file(rpath, snap.sha.encode())
    except Exception as e:  # noqa: BLE001
        log.warning("could not copy %s %s (commit %s) to the hub mirror %s: %s", snap.ref.kind, snap.ref, snap.sha,
                    mirror(), store.redact(f"{type(e).__name__}: {e}"))


# ---------------------------------------------------------------------------------------------- datasets
def dataset_manifest(ref: Ref) -> store.Manifest:
    """Lineage entry of a hub dataset: the commit and what of it is read, checked before any work."""
    snap = resolve(ref)
    kw, files = _dataset_plan(snap)
    return store.Manifest(stage="source", uri=snap.uri,
                          fingerprint=store.fingerprint("hub-dataset", {"repo": ref.repo, "sha": snap.sha, "read": kw}),
                          files=[{"path": f, "size": snap.files.get(f)} for f in files],
                          config={"repo": ref.repo, "revision": ref.revision, "sha": snap.sha, "read": kw})


def load_dataset(ref: Ref):
    """(DatasetDict, split named by `@X` or None) of the hub dataset `ref`, read by `datasets` from this node's
    copy of exactly the files it reads."""
    import datasets

    snap = resolve(ref, fresh=False)
    kw, files = _dataset_plan(snap)
    local = fetch(snap, files)
    kw.pop("subset", None)
    split = kw.pop("split", None)
    return datasets.load_dataset(str(local), cache_dir=str(cache_dir("datasets")), **kw), split


def _dataset_plan(snap: Snapshot) -> tuple[dict, list[str]]:
    """What `datasets.load_dataset` is given (data_dir or data_files; a subset's own data_files, since datasets
    would otherwise want every subset's files; the split `@X` names) and the files to fetch for it: the data
    files it reads and the dataset card."""
    ref, names = snap.ref, sorted(snap.files)
    data = [f for f in names if f.lower().endswith(DATA_EXT) and not any(p.startswith(".") for p in f.split("/"))]
    card = ["README.md"] if "README.md" in snap.files else []
    in_dir = lambda d: [f for f in data if f.startswith(d.rstrip("/") + "/")]  # noqa: E731
    matching = lambda pats: [f for f in data if any(fnmatch.fnmatch(f, p) for p in pats)]  # noqa: E731
    if ref.path:
        kw = {"data_dir": ref.path} if in_dir(ref.path) else {"data_files": ref.path}
        picked = in_dir(ref.path) or matching([ref.path])
    elif ref.at and (subset := _subsets(snap, card).get(ref.at)) is not None:
        kw = {"subset": ref.at, **subset}
        picked = in_dir(subset["data_dir"]) if "data_dir" in subset else data if "name" in subset else \
            matching([p for pats in subset["data_files"].values() for p in pats])
    elif ref.at and in_dir(ref.at):
        kw, picked = {"data_dir": ref.at}, in_dir(ref.at)  # OpenRLHF: load_dataset(name, data_dir=X)
    else:
        kw, picked = ({"split": ref.at} if ref.at else {}), data
    if not picked:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise HubError(f"dataset {ref}: no data file (json, jsonl, csv, parquet, arrow, txt) to read in {ref.repo} at "
                       f"commit {snap.sha} (it has {shown or 'no files'})")
    return kw, sorted(set(picked) | set(card))


def _subsets(snap: Snapshot, card: list[str]) -> dict[str, dict]:
    """The subsets (configs) the dataset card declares: name -> what loads it, {"data_files": {split: [patterns]}}
    (passed instead of the name: datasets would want every subset's files), {"data_dir": folder} or {"name": it}."""
    if not card:
        return {}
    import yaml

    text = (fetch(snap, card) / "README.md").read_text(errors="replace")
    head = re.match(r"^---\s*\n(.*?)\n---", text, re.S)
    meta = yaml.safe_load(head.group(1)) if head else None
    out = {}
    for c in (meta or {}).get("configs") or []:
        name, files = c.get("config_name", "default"), c.get("data_files")
        if not files:  # the files are inferred, from its data_dir or the whole repo
            out[name] = {"data_dir": c["data_dir"]} if c.get("data_dir") else {"name": name}
            continue
        if isinstance(files, (str, dict)) or (isinstance(files, list) and files and isinstance(files[0], str)):
            files = [{"split": k, "path": v} for k, v in files.items()] if isinstance(files, dict) else \
                [{"split": "train", "path": files}]
        out[name] = {"data_files": {x.get("split", "train"): [x["path"]] if isinstance(x["path"], str) else list(x["path"])
                                    for x in files}}
    return out
