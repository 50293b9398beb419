"""Each node's own copy of what the roles read and write, so that no two nodes share a path (multi-node without a
shared disk, as the training jobs of rlhf_core.train.entry):

  models       every role fetches its model from the store (a committed artifact or a plain HF folder on any URI)
               into its own node's cache (RLHF_FLOWS_CACHE), once per node (rlhf_core.inputs.model_inputs, keyed by
               content), its files checked against the model's manifest; a local folder is used in place.
  checkpoints  every learner rank saves its own DeepSpeed files (rank 0 the module states, every rank its ZeRO
               shard) into its node's cache and uploads them itself to `{ckpt_uri}/{tag}/{actor|critic}/`; the
               driver commits the marker naming every rank's files (rlhf_core.train.checkpoints.commit) only after
               all uploads returned. On resume every rank downloads only the files it loads (its own ZeRO
               partition and the shared module states: checkpoints.rank_files) into its own cache and verifies
               their sha256 before any rank loads.
  final model  one bucket of weight_sync_bucket_mb gathered at a time (every rank takes part under ZeRO-3), rank 0
               writing each as a safetensors shard into its node's cache as it comes (no rank holds the model
               on the host: the others only gather), then, once the driver has noted the names in the artifact's
               journal, uploading the HF folder under the stage's output prefix; the stage commits from the
               store (the driver never holds a copy). save_hf_ckpt folders the same way.

The driver passes the store's options (never secrets: store.check_no_secrets) and its run lock's fence to every
actor through `actor_env`. RLHF_FLOWS_ROLE_CACHES=<dir> in the driver's environment gives each role's actor its
own cache folder <dir>/<role> on one machine: what separate nodes would have (the tests show nothing crosses).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

OPTIONS_ENV = "RLHF_FLOWS_STORAGE_OPTIONS"
ROLE_ENV = "RLHF_FLOWS_ROLE"
ROLE_CACHES_ENV = "RLHF_FLOWS_ROLE_CACHES"
_options: dict = {}  # the run's storage options, set by the driver (`use_store`) before the actors start


def use_store(storage_options: dict | None) -> None:
    """The driver's storage options, handed to every actor started from now on (`actor_env`)."""
    global _options
    _options = dict(storage_options or {})


def actor_env(role: str) -> dict:
    """Environment variables of the Ray actor of `role` ("policy0", "critic1", "reference", "reward", "rollout0"
    ...: placement.bundle_plan's names), beside the placement's own: the store's options, the run lock's fence
    (actors on other nodes do not inherit the driver's environment) and, with RLHF_FLOWS_ROLE_CACHES, the
    role's own cache folder."""
    from rlhf_core import store

    env = {ROLE_ENV: role, OPTIONS_ENV: json.dumps(_options)}
    if os.environ.get(store.FENCE_ENV):
        env[store.FENCE_ENV] = os.environ[store.FENCE_ENV]
    if os.environ.get(ROLE_CACHES_ENV):
        env["RLHF_FLOWS_CACHE"] = str(Path(os.environ[ROLE_CACHES_ENV]) / role)
    return env


def storage_options() -> dict:
    """The run's storage options in an actor (the driver's own in the driver)."""
    return json.loads(os.environ[OPTIONS_ENV]) if os.environ.get(OPTIONS_ENV) else dict(_options)


def _where() -> str:
    import socket

    return f"{os.environ.get(ROLE_ENV, 'driver')} on {socket.gethostname()}"


def local_model(src: str) -> str:
    """A local folder holding the model `src` names (a local folder, or a committed artifact / plain HF folder
    URI), in this node's cache; a store this node cannot read is named with the role and the host."""
    from rlhf_core.inputs import model_inputs, models
    from rlhf_core import store

    if Path(str(src)).is_dir() and not (Path(src) / store.MANIFEST).exists():
        return str(src)  # a plain local folder: used in place (a committed one may need its adapter merged)

    so = storage_options()
    try:
        m = model_inputs.model_manifest(src, so)
        raw = model_inputs.fetch_model(src, so, manifest=m, merge=False)  # the artifact's own files, as committed
    except models.ModelInputError:
        raise
    except Exception as e:  # noqa: BLE001 - a node without a route to the store: say which node
        raise RuntimeError(f"{_where()} cannot fetch the model {src} from the store: {type(e).__name__}: {e}") from None
    for f in m.files:  # a cut download (or a cache entry edited by hand) is not loaded
        p = Path(raw) / f["path"]
        if f.get("size") is not None and (not p.is_file() or p.stat().st_size != f["size"]):
            raise models.ModelInputError(f"{_where()}: {p} does not match {src} ({f['path']}: expected "
                                         f"{f['size']} bytes): delete that cache entry")
    # an adapter-only artifact (LoRA RL's policy, a trainer's lora_merge=false) merged onto its lineage's base
    return str(model_inputs.fetch_model(src, so, manifest=m))


# ---------------------------------------------------------------------------------------------- checkpoints
def _rank_dir(learner, what: str, key: str) -> Path:
    """This rank's scratch folder in its node's cache (nothing of another rank or node is there)."""
    from rlhf_core import store

    h = hashlib.sha256(key.encode()).hexdigest()[:16]
    return store.cache_root() / "ppo-nodes" / h / f"{what}-{learner.kind}{learner.rank}"


def _group(learner) -> str:
    return "actor" if learner.kind == "policy" else "critic"


def save_checkpoint(learner, ckpt_uri: str, tag: str) -> list[dict]:
    """Save this rank's DeepSpeed files into its node's cache, upload them to `{ckpt_uri}/{tag}/{group}/{tag}/`;
    returns their marker entries (path, size, sha256) for the driver's commit. Every rank of the group calls it
    (DeepSpeed's save is collective)."""
    from rlhf_core.train import checkpoints

    local = _rank_dir(learner, "ckpt", ckpt_uri)
    shutil.rmtree(local, ignore_errors=True)
    lora = bool(learner.hp.get("lora_rank"))  # LoRA RL: the adapter and its optimizer, not the frozen weights
    learner.engine.save_checkpoint(str(local / _group(learner)), tag=tag, save_latest=False, exclude_frozen_parameters=lora)
    try:
        return checkpoints.upload_files(local, ckpt_uri, tag, storage_options())
    finally:
        shutil.rmtree(local, ignore_errors=True)


def load_checkpoint(learner, meta: dict, fetch: bool = False) -> str | None:
    """Two calls, each on every rank. fetch=True: download this rank's group's files of the checkpoint `meta`
    (checkpoints.latest's) into its node's cache and verify each sha256; returns None, or the CheckpointError
    message of a corrupt file (the driver then passes over that checkpoint: no rank loads anything until every
    rank's files verified). fetch=False: load what the fetch brought, then drop it."""
    from rlhf_core.train import checkpoints

    local = _rank_dir(learner, "resume", meta["uri"])
    if fetch:
        shutil.rmtree(local, ignore_errors=True)
        mine = checkpoints.rank_files(meta["files"], _group(learner) + "/", learner.rank)  # its own, not every rank's
        try:
            checkpoints.download({**meta, "files": mine}, local, storage_options())
        except checkpoints.CheckpointError as e:
            shutil.rmtree(local, ignore_errors=True)
            return str(e)
        return None
    learner.engine.load_checkpoint(str(local / meta["tag"] / _group(learner)), tag=meta["tag"],
                                   load_module_strict=not learner.hp.get("lora_rank"))  # LoRA: the adapter only
    shutil.rmtree(local, ignore_errors=True)
    drop_offload_buffers(learner.engine.optimizer)
    return None


def _save_adapter(learner, local: Path) -> list[str]:
    """LoRA RL's policy (rank 0; ZeRO <= 2: every rank holds the whole adapter): the adapter under adapter/ and the
    tokenizer at the root, the layout of the trainers' lora_merge=false (rlhf_core.inputs.models.adapter_only: a stage
    reading it merges it onto the lineage's policy); with lora_merge the merged model at the root too."""
    from transformers import AutoTokenizer

    from rlhf_core.inputs import models

    if learner.rank != 0:
        return []
    shutil.rmtree(local, ignore_errors=True)
    learner.peft.save_pretrained(str(local / models.ADAPTER_DIR), safe_serialization=True)  # the trained adapter
    tok = AutoTokenizer.from_pretrained(learner.model_dir)
    if learner.hp.get("tokenizer_chat_template"):
        tok.chat_template = learner.hp["tokenizer_chat_template"]
    tok.save_pretrained(str(local))
    if learner.hp.get("lora_merge"):
        models.merge_adapter(learner.model_dir, local, local, bf16=learner.hp["bf16"])
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())


def _save_merged_critic(learner, local: Path) -> list[str]:
    """LoRA RL's critic (rank 0; ZeRO <= 2: every rank holds the whole adapter and head): the adapter merged onto its
    base (lora.merged_critic), saved as the HF value model save_value_network commits without LoRA, tokenizer beside."""
    from transformers import AutoTokenizer

    from rlhf_core.ppo.lora import merged_critic

    if learner.rank != 0:
        return []
    shutil.rmtree(local, ignore_errors=True)
    merged_critic(learner.peft, learner.model_dir, learner.hp).save_pretrained(str(local), safe_serialization=True)
    AutoTokenizer.from_pretrained(learner.model_dir).save_pretrained(str(local))
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())


def drop_offload_buffers(optimizer) -> int:
    """Remove DeepSpeed's `*_offload_buffer` entries from the optimizer's state; how many. ZeRO-3's offload_states
    (deepspeed/runtime/zero/offload_states.py, offload_adam_states) keeps its host copies of Adam's moments in the
    optimizer state, so a checkpoint saved after a sleep carries them; torch's Optimizer.load_state_dict then casts
    them to the parameters' device, and the next offload, finding its buffers, copies the moments into those device
    copies and points the moments at them: they never leave the GPU again (issue 41). Without the entries the next
    offload makes new host buffers, as on the first sleep."""
    inner = getattr(optimizer, "optimizer", optimizer)
    dropped = 0
    for st in getattr(inner, "state", {}).values():
        for k in [k for k in st if isinstance(k, str) and k.endswith("_offload_buffer")]:
            del st[k]
            dropped += 1
    return dropped


# ---------------------------------------------------------------------------------------------- final model
def save_model(learner, out_uri: str, sub: str = "", upload: bool = False) -> list:
    """The trained model as an HF folder under `out_uri`/`sub`, in two calls (the driver notes the names in the
    artifact's journal between them, so a crash mid-upload leaves files the rerun knows as its own):
    upload=False: every rank gathers (ZeRO-3), rank 0 writes the folder into its node's cache and returns the
    relative file names; upload=True: rank 0 uploads that folder, returns [{"path", "size"}] and drops it."""
    from rlhf_core import store

    local = _rank_dir(learner, "model", f"{out_uri}/{sub}")
    if upload:
        if learner.rank != 0:
            return []
        fs, root = store.filesystem(out_uri, storage_options())
        files = []
        for p in sorted(local.rglob("*")):
            if p.is_file():
                rel = "/".join(x for x in (sub, p.relative_to(local).as_posix()) if x)
                store.check_fence()
                fs.makedirs(fs._parent(store.join(root, rel)), exist_ok=True)
                fs.put_file(str(p), store.join(root, rel))
                files.append({"path": rel, "size": p.stat().st_size})
        shutil.rmtree(local, ignore_errors=True)
        return files
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from rlhf_core.ppo import weight_sync

    module = learner.engine.module
    if learner.hp.get("lora_rank") and learner.kind == "policy":
        return _save_adapter(learner, local)
    if learner.hp.get("lora_rank"):  # the LoRA critic: saved merged, a plain value model (save_value_network)
        return _save_merged_critic(learner, local)
    shards = weight_sync.buckets(learner, learner.hp["weight_sync_bucket_mb"] * 2 ** 20)
    if learner.rank == 0:
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index, total = {}, 0
    for i, params in weight_sync._walk(learner, shards):  # every rank: its part of each gather; rank 0 writes it
        if learner.rank == 0:
            names = [n for n, _, _ in shards[i]]
            save_file({n: p.data.detach().to("cpu").contiguous() for n, p in zip(names, params)},
                      str(local / files[i]), metadata={"format": "pt"})
            index.update(dict.fromkeys(names, files[i]))
            total += sum(p.data.numel() * p.element_size() for p in params)
    if learner.rank != 0:
        return []
    persistent = module.state_dict(keep_vars=True)  # buffers the checkpoint keeps (none in the usual decoders)
    buffers = {n: b.detach().cpu().contiguous() for n, b in module.named_buffers() if n in persistent}
    if buffers:
        save_file(buffers, str(local / "buffers.safetensors"), metadata={"format": "pt"})
        index.update(dict.fromkeys(buffers, "buffers.safetensors"))
    if len(files) > 1 or buffers:
        (local / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                        "weight_map": index}, indent=1))
    module.config.save_pretrained(str(local))
    if getattr(module, "generation_config", None) is not None and module.can_generate():
        module.generation_config.save_pretrained(str(local))
    tok = AutoTokenizer.from_pretrained(learner.model_dir)
    if learner.hp.get("tokenizer_chat_template"):  # the run's template goes with the policy, as the trainers'
        tok.chat_template = learner.hp["tokenizer_chat_template"]
    tok.save_pretrained(str(local))
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
