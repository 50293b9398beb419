"""Credentials never stored: a flow gets its S3 key and secret from a Prefect Secret block named in its
parameters; afterwards the secret is nowhere in the Prefect database, its result storage, the training work
folders, Ray's session logs or the store. Secrets in storage_options are refused by name."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store

pytestmark = pytest.mark.slow


def _files_holding(secret: bytes, roots: list[Path], since: float = 0.0) -> list[str]:
    hits = []
    for root in roots:
        for f in [root] if root.is_file() else root.rglob("*"):
            try:
                if f.is_file() and not f.is_symlink() and f.stat().st_mtime >= since and secret in f.read_bytes():
                    hits.append(str(f))
            except OSError:
                pass
    return hits


def test_secret_from_a_block_leaves_no_trace(prefect_harness, moto_s3, s3_root, tiny, tmp_path, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect.settings import get_current_settings

    from flows.raft import Params, raft

    key, secret = f"AKID{uuid.uuid4().hex[:12].upper()}", f"blk-{uuid.uuid4().hex}"
    Secret(value={"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}).save("s3-creds", overwrite=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_task.prompts(16, 0)))
    t0 = time.time()
    report = raft(Params(root=s3_root, run_name="creds", credentials_block="s3-creds", iterations=1,
                         pretrain_uri=tiny.policy_uri, reward_uri=tiny.reward_uri, prompt_data=str(prompts),
                         generate={"num_engines": 1, "best_of_n": 2, "rollout_batch_size": 16, "max_new_tokens": 8},
                         score={"num_engines": 0},
                         sft_loop={"micro_train_batch_size": 4, "train_batch_size": 8, "max_len": 48}))
    assert report["stop_reason"] == "completed all iterations"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == secret  # the run used the block's credentials
    settings = get_current_settings()
    db = Path(settings.server.database.connection_url.get_secret_value().split("///", 1)[1])
    places = [db, *db.parent.glob(db.name + "-*"), Path(settings.results.local_storage_path), Path(settings.home),
              tmp_path / "cache"]
    places += [d for d in Path("/tmp/ray").glob("session_*") if d.is_dir() and not d.is_symlink()]
    assert db.exists() and any(Path("/tmp/ray").glob("session_*"))
    assert _files_holding(secret.encode(), places, since=t0 - 1) == []
    fs, path = store.filesystem(s3_root)
    objects = fs.find(path)
    assert objects and not [o for o in objects if secret.encode() in fs.cat_file(o)]


@pytest.mark.parametrize("opts", [{"key": "AKID", "secret": "s"}, {"client_kwargs": {"aws_secret_access_key": "s"}}])
def test_secrets_in_storage_options_are_refused_by_name(opts):
    from flows.raft import Params
    from stages import filter as filter_stage

    with pytest.raises(ValueError, match=r"storage_options\.(secret|client_kwargs\.aws_secret_access_key): credentials "
                                         r"are not accepted here"):
        Params(storage_options=opts)
    with pytest.raises(ValueError, match="credentials are not accepted here"):
        filter_stage.Config(scored_uri="a", output_uri="b", method="rs", storage_options=opts)
