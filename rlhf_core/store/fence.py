"""The run lock's fence: while a flow holds its run lock, every write under the store first checks the lock is
still ours (child processes check the lock named in RLHF_FLOWS_FENCE), and an artifact's own lease."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

from rlhf_core.store import locks
from rlhf_core.store.locks import LockLost
from rlhf_core.store.manifest import LOCK, LOCK_LEASE_S
from rlhf_core.store.uris import filesystem, join, redact


FENCE_ENV = "RLHF_FLOWS_FENCE"  # the run lock as child processes (training jobs, local Ray workers) check it
_fences: list = []  # callables raising LockLost when this process no longer holds its run lock (flows/lock.py)


@contextlib.contextmanager
def fence(check, lock_uri: str, token: str, storage_options: dict | None = None) -> Iterator[None]:
    """While inside, every write under the store first calls `check()` (the run lock's token check); processes
    started meanwhile inherit the lock's URI and token in RLHF_FLOWS_FENCE and check it themselves."""
    _fences.append(check)
    before = os.environ.get(FENCE_ENV)
    os.environ[FENCE_ENV] = json.dumps({"uri": lock_uri, "token": token, "storage_options": storage_options or {}})
    try:
        yield
    finally:
        _fences.remove(check)
        if before is None:
            os.environ.pop(FENCE_ENV, None)
        else:
            os.environ[FENCE_ENV] = before


def check_fence() -> None:
    """Called before every write: raises LockLost (naming the holder) in a process whose run lock was lost."""
    if _fences:
        for check in list(_fences):
            check()
    elif (spec := os.environ.get(FENCE_ENV)):
        spec = json.loads(spec)
        fs, path = filesystem(spec["uri"], spec.get("storage_options"))
        try:
            held = json.loads(fs.cat_file(path) or b"{}")
        except FileNotFoundError:
            held = None
        if not held or held.get("token") != spec["token"]:
            raise LockLost(f"lock {spec['uri']} lost: now held by {locks.describe(held)}; this process "
                           f"(pid {os.getpid()}) stops writing")


def artifact_lease(fs, path: str, uri: str, storage_options: dict | None = None):
    """The lease an artifact's writer (archiving in `begin`) and `prune_versions` take, waiting up to a lease."""
    return locks.lease(fs, join(path, LOCK), join(uri, LOCK), LOCK_LEASE_S, what=f"artifact {uri}",
                       redact=lambda t: redact(t, storage_options), wait_s=LOCK_LEASE_S)
