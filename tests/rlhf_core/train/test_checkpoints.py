"""Checkpoints with flipped bytes are found by their sha256: the previous one is used, or a fresh start. The
marker is written in one atomic step, and a process that lost its run lock writes nothing."""
import json
import logging
import os

import pytest

from rlhf_core import store
from rlhf_core.train import checkpoints


def _ckpt(tmp_path, root, step, fp="job"):
    d = tmp_path / f"local-{step}"
    d.mkdir()
    (d / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 4 * step)
    return checkpoints.upload(d, root, f"step-{step}", fp, {"step": step}, keep_last=2)


def test_flipped_bytes_fall_back_to_the_previous_checkpoint_then_to_scratch(tmp_path, caplog):
    root = str(tmp_path / "ckpts")
    _ckpt(tmp_path, root, 2)
    _ckpt(tmp_path, root, 4)
    f = tmp_path / "ckpts" / "step-4" / "mp_rank_00_model_states.pt"
    raw = bytearray(f.read_bytes())
    raw[100] ^= 0xFF  # same size, different bytes: only the hash can tell
    f.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="rlhf_flows"):
        meta, local = checkpoints.resume_point(root, "job", tmp_path / "resume")
    assert meta["step"] == 2 and (local / "mp_rank_00_model_states.pt").read_bytes() == bytes(range(256)) * 8
    assert "corrupt checkpoint" in caplog.text and "step-4: file mp_rank_00_model_states.pt does not match its sha256" \
        in caplog.text and "passing over it for the previous checkpoint" in caplog.text
    (tmp_path / "ckpts" / "step-2" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 2048)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_flows"):
        assert checkpoints.resume_point(root, "job", tmp_path / "resume2") == (None, None)
    assert "no intact checkpoint left" in caplog.text and "training from scratch" in caplog.text
    with pytest.raises(checkpoints.CheckpointError, match="foreign checkpoint"):  # another job's: still refused
        checkpoints.resume_point(root, "other-job", tmp_path / "resume3")


def _files(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def test_a_crash_while_writing_the_marker_leaves_no_marker(tmp_path, monkeypatch):
    """The marker's bytes go to a temp file that is renamed into place: mid-write the marker's name does not
    exist, and a write that fails there leaves neither marker nor temp file, so the folder reads as an
    interrupted upload and the previous checkpoint is the newest."""
    root = str(tmp_path / "ckpts")
    _ckpt(tmp_path, root, 2)
    d = tmp_path / "local-4"
    d.mkdir()
    (d / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    seen = []

    def crash(fd):
        seen.append((tmp_path / "ckpts" / "step-4" / checkpoints.MARKER).exists())
        raise OSError("crash mid-write")
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="crash mid-write"):
        checkpoints.upload(d, root, "step-4", "job", {"step": 4}, keep_last=2)
    assert seen == [False]  # mid-write, no partial marker is visible
    assert _files(tmp_path / "ckpts" / "step-4") == ["mp_rank_00_model_states.pt"]  # no marker, no temp file
    assert checkpoints.latest(root, "job")["step"] == 2
    monkeypatch.undo()
    checkpoints.upload(d, root, "step-4", "job", {"step": 4}, keep_last=2)
    assert checkpoints.latest(root, "job")["step"] == 4


def test_a_process_that_lost_its_run_lock_writes_no_checkpoint(tmp_path, monkeypatch):
    """Inside a run's fence a lost lock stops the first file upload, the marker and the prune; a child process
    (a training job) checks the lock file named in RLHF_FLOWS_FENCE itself and names the holder."""
    root = tmp_path / "ckpts"
    _ckpt(tmp_path, str(root), 1)
    before = _files(root)
    d = tmp_path / "local-2"
    d.mkdir()
    (d / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    files = [{"path": "mp_rank_00_model_states.pt", "size": 7, "sha256": "0" * 64}]

    def lost():
        raise store.LockLost("lost")
    with store.fence(lost, str(tmp_path / "lock.json"), "mine"):
        with pytest.raises(store.LockLost, match="lost"):
            checkpoints.upload(d, str(root), "step-2", "job", {"step": 2}, keep_last=1)
        with pytest.raises(store.LockLost, match="lost"):  # the marker
            checkpoints.commit(str(root), "step-2", "job", files, {"step": 2}, keep_last=1)
    assert _files(root) == before
    calls = []

    def lost_after_the_marker():
        calls.append(1)
        if len(calls) > 1:
            raise store.LockLost("lost")
    (root / "step-2").mkdir()
    with store.fence(lost_after_the_marker, str(tmp_path / "lock.json"), "mine"):
        with pytest.raises(store.LockLost, match="lost"):  # the prune of step-1
            checkpoints.commit(str(root), "step-2", "job", files, {"step": 2}, keep_last=1)
    assert (root / "step-2" / checkpoints.MARKER).exists() and (root / "step-1" / checkpoints.MARKER).exists()

    # the child-process path: no fence in this process, the lock file named by the environment
    lock = tmp_path / "run-lock.json"
    lock.write_text(json.dumps({"token": "other", "pid": 7, "host": "h2"}))
    monkeypatch.setenv(store.FENCE_ENV, json.dumps({"uri": str(lock), "token": "mine"}))
    out = tmp_path / "child"
    with pytest.raises(store.LockLost, match="now held by pid 7 on h2"):
        checkpoints.upload(d, str(out), "step-2", "job", {"step": 2})
    assert _files(out) == []
    lock.write_text(json.dumps({"token": "mine"}))
    checkpoints.upload(d, str(out), "step-2", "job", {"step": 2})
    assert _files(out) == ["step-2", f"step-2/{checkpoints.MARKER}", "step-2/mp_rank_00_model_states.pt"]
