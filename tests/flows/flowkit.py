"""Helpers for the flow tests (plain functions; fixtures live in conftest.py)."""
from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import yaml

from rlhf_core import store

DEMO = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())


def demo_params(**over) -> dict:
    """configs/demo.yaml with `over` on top: a stage's settings are merged into the demo's, and an empty dict
    drops them (e.g. sft={} and train_rm={} where the loop starts from a trained policy and reward model)."""
    out = copy.deepcopy(DEMO)
    for k, v in over.items():
        out[k] = {**out[k], **v} if v and isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def manifests(root: str) -> dict[str, store.Manifest]:
    """Every committed artifact under a run folder, by path relative to it."""
    fs, path = store.filesystem(root)
    out = {}
    for p in fs.find(path):
        if p.endswith(store.MANIFEST) and f"/{store.VERSIONS}/" not in p:  # kept versions are not the run's
            rel = p[len(path.rstrip("/")) + 1: -len(store.MANIFEST) - 1]
            out[rel] = store.read_manifest(root.rstrip("/") + "/" + rel)
    return out


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every process whose environment carries `marker` (what a test started, and its children)."""
    killed = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
        except (OSError, PermissionError):
            pass
    return killed


def alive_marked(marker: str) -> list[str]:
    """Live (non-zombie) processes whose environment carries `marker`, as 'pid cmdline'."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes() and (d / "stat").read_text().split(") ")[1][0] != "Z":
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{d.name} {cmd[:120]}")
        except (OSError, PermissionError, IndexError):
            pass
    return out
