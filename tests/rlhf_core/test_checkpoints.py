"""Checkpoints with flipped bytes are found by their sha256: the previous one is used, or a fresh start."""
import logging

import pytest

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
