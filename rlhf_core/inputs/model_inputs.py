"""Model inputs: what a stage gets when a config names a model (a committed artifact, a plain Hugging Face
folder on any fsspec URI, or a hub model `org/name[@rev]` / `hf://...`: hub.py). `model_manifest` checks a
folder up front and gives it a content fingerprint (a hub model: its commit sha),
`fetch_model` downloads it once per machine into the cache (keyed by content), and an adapter-only artifact
(LoRA trained with `lora_merge=false`) is merged there into the base its lineage names. `prune_cache` keeps
that cache under a size (`rlhf-flows gc --cache-max-gb X`), least recently used entries first.

What a plain folder contributes is what transformers, vLLM and peft read from it, nothing else: a hub
download also carries Meta's `original/` (consolidated.*.pth, params.json, tokenizer.model for Meta's own
code), the same weights in other formats (pytorch_model.bin next to model.safetensors, tf_model.h5,
flax_model.msgpack, *.onnx, *.gguf) and Mistral's consolidated.safetensors next to the shards its index
names. Fetching those doubles an 8B download, and fingerprinting them reruns stages over a file none reads.
Fetched and fingerprinted (`loaded_files`), root files only:
  weights   *.safetensors (with an index, only the shards it names: what transformers and vLLM load), or,
            only where there are none, pytorch_model*.bin + its index, which the check then refuses: the
            training loaders read safetensors only (use_safetensors=True);
  *.json    config.json, generation_config.json, tokenizer_config.json, tokenizer.json,
            special_tokens_map.json, added_tokens.json, adapter_config.json, preprocessor_config.json, ...
            (the index of a weight format not loaded excepted);
  tokenizer vocabularies and templates: *.model (sentencepiece), *.txt (vocab.txt, merges.txt), *.tiktoken,
            *.spm, bpe.codes, tokenizer.model.v*, chat_template.jinja, additional_chat_templates/*.jinja;
  *.py      custom code (trust_remote_code).
Not fetched: other subfolders (original/, .cache/), other frameworks' weights (*.pth, *.pt, *.h5, *.msgpack,
*.onnx, *.gguf, *.ckpt), training_args.bin, README.md, images. A committed artifact is fetched whole (the
project wrote it). A hub model is checked and fetched by the same rule, from its file list at the commit.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from rlhf_core.inputs import hub, models
from rlhf_core import store
from rlhf_core.store import versions

def _sha256_file(path: str) -> str:
    """sha256 of a local file, remembered under the cache by (path, size, mtime) so an 8B folder is hashed
    once per machine, not once per stage."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = store.cache_root() / "sha256" / key
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


def model_manifest(uri: str, storage_options: dict | None = None) -> store.Manifest:
    """Lineage entry of a model input: its manifest if it is a committed artifact; a hub model (`org/name[@rev]`,
    `hf://...`) entered with its commit sha (a moved branch changes every downstream fingerprint, a pinned
    sha never does); else a plain Hugging Face folder (what `save_pretrained` writes) on any fsspec URI, entered
    as a `source` whose fingerprint hashes its files' content. Each is checked up front."""
    uri = str(uri)
    if (ref := hub.model_ref(uri)) is not None:
        return _hub_manifest(ref)
    if store.committed_any(uri, storage_options):
        return store.read_manifest(uri, storage_options=storage_options)
    fs, path = store.filesystem(uri, storage_options)
    if not fs.isdir(path):
        raise models.ModelInputError(f"model {uri} is neither a committed artifact nor a folder (it does not exist)")
    root = path.rstrip("/")
    infos = {n[len(root) + 1:]: i for n, i in fs.find(root, detail=True).items()
             if not any(part.startswith(".") for part in n[len(root) + 1:].split("/"))}  # skip .cache/ and the like
    names = set(infos)
    loaded = loaded_files(names, lambda rel: json.loads(fs.cat_file(store.join(root, rel))), uri)
    _check_files(names, loaded, f"model folder {uri}", convert=(
        "convert it once with `AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
        "safe_serialization=True)` (AutoModelForSequenceClassification for a reward model): the .bin files are then ignored"))
    content = [[rel, infos[rel].get("size"), _content_id(fs, store.join(root, rel), infos[rel])] for rel in loaded]
    return store.Manifest(stage="source", fingerprint=store.fingerprint("model-folder", {"files": content}), uri=uri,
                    files=[{"path": rel, "size": size} for rel, size, _ in content], config={"content": content})


def _hub_manifest(ref: hub.Ref) -> store.Manifest:
    """A hub model's lineage entry, checked from its file list before any weight is downloaded (a sharded
    model's index is fetched first: it names the shards)."""
    snap = hub.resolve(ref)
    names = set(snap.files)
    loaded = loaded_files(names, lambda rel: json.loads((hub.fetch(snap, [rel]) / rel).read_text()), str(ref))
    _check_files(names, loaded, f"hub model {ref} (commit {snap.sha})", convert=(
        "download it, convert it with `AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
        "safe_serialization=True)` and pass the folder, or name a revision with safetensors weights (org/name@rev)"))
    return store.Manifest(stage="source", uri=snap.uri,
                          fingerprint=store.fingerprint("hub-model", {"repo": ref.repo, "sha": snap.sha, "files": loaded}),
                          files=[{"path": rel, "size": snap.files[rel]} for rel in loaded],
                          config={"repo": ref.repo, "revision": ref.revision, "sha": snap.sha})


def _check_files(names: set[str], loaded: list[str], where: str, convert: str) -> None:
    """A model's files hold what the stages load: config, safetensors weights, a tokenizer."""
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    bins = [n for n in loaded if n.endswith(".bin")]
    if not bins and not any(n.endswith(".safetensors") for n in loaded):
        missing.append("weights (*.safetensors)")
    if not names & set(models.TOKENIZER_FILES):
        missing.append(f"a tokenizer ({', '.join(models.TOKENIZER_FILES)})")
    if missing:
        raise models.ModelInputError(f"{where} lacks {' and '.join(missing)}: pass a folder written by "
                                     f"save_pretrained (model and tokenizer)")
    if bins:
        raise models.ModelInputError(
            f"{where} holds only PyTorch .bin weights ({', '.join(bins[:3])}{', ...' if len(bins) > 3 else ''}): "
            f"the stages load safetensors (transformers' use_safetensors=True); {convert}")


_ROOT_FILES = ("*.json", "*.py", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.spm", "*.codes", "tokenizer.model.v*")


def loaded_files(names: set[str], read_json, where: str) -> list[str]:
    """The files of a plain folder (relative names) that the loaders read, sorted (see the module docstring).
    `read_json(rel)`: a weight index's content, read only when there is one."""
    root = {n for n in names if "/" not in n}
    fmt = ".safetensors" if any(n.endswith(".safetensors") for n in root) else ".bin"
    weights = {n for n in root if n.endswith(".safetensors")} if fmt == ".safetensors" else \
        {n for n in root if fnmatch.fnmatch(n, "pytorch_model*.bin") or n == "adapter_model.bin"}
    indexes = {n for n in root if n.endswith(f"{fmt}.index.json")}
    if indexes:  # sharded: the shards the index names (not consolidated.safetensors beside them), and the adapter
        shards = {s for i in indexes for s in read_json(i).get("weight_map", {}).values()}
        if shards - root:
            raise models.ModelInputError(f"model folder {where} lacks {', '.join(sorted(shards - root))}, named by "
                                         f"{', '.join(sorted(indexes))}")
        weights = {n for n in weights if n in shards or n.startswith("adapter_model.")}
    other = {n for n in root if any(fnmatch.fnmatch(n, p) for p in _ROOT_FILES) and not n.endswith(".index.json")}
    templates = {n for n in names if re.fullmatch(r"additional_chat_templates/[^/]+\.jinja", n)}
    return sorted(weights | indexes | other | templates)


def fetch_model(uri: str, storage_options: dict | None = None, stage: str | tuple[str, ...] | None = None,
                manifest: store.Manifest | None = None, merge: bool = True) -> Path:
    """A local directory holding the model at `uri` (a committed artifact or a plain HF folder), downloaded
    once per machine into a cache keyed by content: a plain folder's content hash, or a committed
    artifact's fingerprint + created_at + file list (a rewritten artifact gets a new entry). Local inputs are
    used in place. This is where every stage gets its models, so an adapter-only artifact (LoRA trained
    with `lora_merge=false`) is merged here into the base its lineage names (`merge=False`: its raw files)."""
    m = manifest or model_manifest(uri, storage_options)
    stages = (stage,) if isinstance(stage, str) else stage
    if stages and m.stage != "source" and m.stage not in stages:
        raise store.StageMismatchError(f"{uri} was made by stage {m.stage!r}, expected {' or '.join(map(repr, stages))}")
    local = _fetch_files(uri, m, storage_options)
    if merge and m.stage != "source" and models.adapter_only([f["path"] for f in m.files]):
        return _merged_model(uri, local, m, storage_options)
    return local


def _fetch_files(uri: str, m: store.Manifest, storage_options: dict | None) -> Path:
    if m.stage == "source" and m.uri.startswith("hf://"):  # a hub model: this node's hub cache or the mirror
        ref = hub.Ref("model", m.config["repo"], m.config["revision"])
        snap = hub.Snapshot(ref, m.config["sha"], {f["path"]: f["size"] for f in m.files})
        return hub.fetch(snap, [f["path"] for f in m.files])
    fs, path = store.filesystem(uri, storage_options)
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    key = m.fingerprint if m.stage == "source" else hashlib.sha256(json.dumps(
        [m.fingerprint, m.created_at, m.files], sort_keys=True).encode()).hexdigest()[:24]

    def download(tmp: Path) -> None:
        for f in m.files:
            target = tmp / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            store.get_file(m, f, str(target), storage_options)  # a kept-in-place version's by its version id

    return _cache_entry(key, m, download)


def _cache_entry(key: str, m: store.Manifest, fill) -> Path:
    """The model cache's entry `key`, made once per machine: `fill(tmp)` writes a temp folder that is
    published by one rename (a concurrent maker's loses and uses the winner's)."""
    dest = store.cache_root() / "models" / key
    if (dest / store.MANIFEST).exists():
        return _mark_used(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
    try:
        fill(tmp)
        (tmp / store.MANIFEST).write_text(m.to_json())
        _publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _mark_used(dest)


def _publish(tmp: Path, dest: Path) -> None:
    try:
        tmp.rename(dest)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)


def adapter_base(m: store.Manifest, storage_options: dict | None = None) -> store.Manifest:
    """The model an adapter-only artifact was trained from: its lineage's `policy` (sft, dpo) or `base`
    (train_rm) input, at the version the adapter was trained on (a changed base is kept under _versions/)."""
    src = next((i for i in m.inputs if i["name"] in ("policy", "base")), None)
    if src is None:
        raise models.ModelInputError(f"{m.uri}: its adapter's lineage names no base model (inputs: "
                              f"{', '.join(i['name'] for i in m.inputs) or 'none'}): merge it with "
                              f"`rlhf-flows stage lora_combine model_uri={m.uri} base_uri=... output_uri=...`")
    if src["stage"] == "source":
        base = model_manifest(src["uri"], storage_options)
        if base.fingerprint != src["fingerprint"]:
            raise models.ModelInputError(f"{m.uri}: its base model folder {src['uri']} changed since the adapter was trained "
                                  f"on it: merge it with `rlhf-flows stage lora_combine base_uri=...` naming that base")
        return base
    try:
        return versions.read_version(src["uri"], src["fingerprint"], storage_options)
    except (store.NotCommittedError, FileNotFoundError):
        raise models.ModelInputError(f"{m.uri}: the base model its adapter was trained on ({src['uri']}, fingerprint "
                              f"{src['fingerprint']}) is no longer in the store") from None


def _merged_model(uri: str, artifact_dir: Path, m: store.Manifest, storage_options: dict | None) -> Path:
    """Base + adapter merged once per machine into the cache, keyed by the artifact and its base."""
    base = adapter_base(m, storage_options)
    key = "merged-" + hashlib.sha256(json.dumps([m.fingerprint, m.created_at, m.files, base.fingerprint],
                                                sort_keys=True).encode()).hexdigest()[:24]
    return _cache_entry(key, m, lambda tmp: models.merge_adapter(fetch_model(base.uri, storage_options, manifest=base),
                                                                 artifact_dir, tmp, rm_stats=m.metrics))


# ---------------------------------------------------------------------------------------------- cache size
IN_USE_S = 3600  # younger than this: a temp dir is a fetch in progress, an entry may be open in a running stage


def _mark_used(entry: Path) -> Path:
    """Stamp the entry's last use (its manifest's mtime) each time a stage gets it: prune_cache drops the
    least recently used first. A read-only shared cache keeps its stamps."""
    try:
        os.utime(entry / store.MANIFEST)
    except OSError:
        pass
    return entry


def _tree(path: Path) -> tuple[int, float]:
    """Bytes under `path` and the newest mtime there (a file being downloaded keeps moving it)."""
    size, newest = 0, path.lstat().st_mtime
    for d, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(d, f))
            except FileNotFoundError:  # removed under us
                continue
            size, newest = size + st.st_size, max(newest, st.st_mtime)
    return size, newest


def _last_use(entry: Path) -> float:
    try:
        return (entry / store.MANIFEST).stat().st_mtime
    except FileNotFoundError:
        return entry.lstat().st_mtime


def prune_cache(max_bytes: int, now: float | None = None) -> tuple[list[tuple[Path, int, float]], int]:
    """Delete entries of the model cache (`cache_root()/models/`), least recently used first, until it holds
    at most `max_bytes`: returns the removed (path, bytes, last use) and the bytes left. Never deleted:
    an entry used in the last IN_USE_S seconds (a running stage may still be reading it) and a temp dir
    `.{key}-xxxx` written to in that time (a fetch or merge in progress); older temp dirs are the leftovers
    of a killed fetch and go first. An entry is renamed to a temp name before it is deleted, so a
    concurrent fetch never sees half of one: it downloads the entry again."""
    root = store.cache_root() / "models"
    now = time.time() if now is None else now
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir():
            size, newest = _tree(p)
            temp = p.name.startswith(".")
            found.append((not temp, newest if temp else _last_use(p), p, size))
    total = sum(size for *_, size in found)
    removed = []
    for published, used, p, size in sorted(found, key=lambda e: e[:2]):  # dead temp dirs, then oldest use
        if total <= max_bytes:
            break
        if now - (_last_use(p) if published else used) < IN_USE_S:  # re-read: a fetch may have just used it
            continue
        doomed = p.with_name(f".{p.name}-gc-{os.getpid()}") if published else p
        try:
            p.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        total -= size
        removed.append((p, size, used))
    return removed, total
