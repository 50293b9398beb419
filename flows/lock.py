"""The run lock: one writer per run folder, held in `{root}/{run_name}/_LOCK.json` for the whole flow run.

A lease (rlhf_core/locks.py): a second live starter gets LockHeld naming the holder; a stale lock (its lease
expired, or its process dead in this pid namespace) is taken over. While held, it is the store's fence: every
write of this process, and of the training jobs and local Ray workers it starts (RLHF_FLOWS_FENCE), first
checks that the lock still holds this run's token, so a run that lost its lock (paused past its lease, cut off
from the store) writes nothing more and stops with LockLost naming the new holder.
"""
from __future__ import annotations

from contextlib import contextmanager

from rlhf_core import locks, store
from rlhf_core.locks import LockHeld, LockLost  # noqa: F401  (what a flow run may raise)

LOCK = "_LOCK.json"


@contextmanager
def run_lock(root: str, run_name: str, lease_s: float = 120.0, storage_options: dict | None = None):
    """Hold the run `{root}/{run_name}` for the block; yields the fencing check."""
    run_uri = store.join(root, run_name)
    fs, path = store.filesystem(run_uri, storage_options)
    fs.makedirs(path, exist_ok=True)
    with locks.lease(fs, store.join(path, LOCK), store.join(run_uri, LOCK), lease_s, what=f"run {run_uri}",
                     redact=lambda t: store.redact(t, storage_options),
                     hint="; wait for it, or pick another run_name") as lease:
        with store.fence(lease.check, store.join(run_uri, LOCK), lease.me["token"], storage_options):
            yield lease.check
