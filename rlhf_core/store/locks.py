"""Lease locks on a store: one small object per lock, taken by create-if-absent, kept by compare-and-swap.

`LeaseObject` is the primitive (one object on a local folder or S3, create / swap / delete with a tag);
`lease(fs, path, ...)` holds one for the length of a `with` block: it takes over a stale lock (lease
expired, or left by a dead process of this very pid namespace), refreshes it every lease/4 from a thread,
and notices when it was lost. The run lock (flows/lock.py) is a lease on `{root}/{run}/_LOCK.json`; an
artifact's writer and `rlhf-flows gc` share a lease on `{artifact}/_LOCK.json` while they archive or prune
versions, so gc never deletes a version being written.

A holder is named by `identity()`: host, pid, and the pid namespace and boot the pid belongs to. A dead pid
means a dead holder only inside the same namespace and boot: a container that shares the host name but not
the pid namespace cannot steal a live lock; it waits out the lease.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger("rlhf_flows")


class LockHeld(RuntimeError):
    """Another live process holds the lock."""


class LockLost(RuntimeError):
    """This process no longer holds its lock (the fencing check before a write): it must stop."""


def identity() -> dict:
    """Who holds a lock: host, pid, and what makes the pid meaningful (pid namespace, boot)."""
    def read(path: str, how) -> str:
        try:
            return how(path)
        except OSError:
            return ""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "pidns": read("/proc/self/ns/pid", os.readlink),
            "boot": read("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip())}


def dead(holder: dict) -> bool:
    """Whether the holder's process is known to be gone: only for a holder of our host, pid namespace and boot
    (elsewhere a pid says nothing: wait out the lease)."""
    me = identity()
    if any(not holder.get(k) or holder.get(k) != me[k] for k in ("host", "pidns", "boot")):
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return True
    except PermissionError:
        return False
    return False


def _refused(e: BaseException) -> bool:
    """Whether an S3 error is a failed precondition (412, or 409 for a concurrent conditional write). s3fs turns
    the 412 of If-None-Match into a FileExistsError whose message omits the code; the cause keeps it."""
    text = " ".join(f"{type(x).__name__} {x}" for x in (e, e.__cause__, e.__context__) if x is not None)
    return any(c in text for c in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"))


def describe(holder: dict | None) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "nobody (deleted)"


class LeaseObject:
    """Create-if-absent and compare-and-swap on one small object.

    Local folders: create = hard-link a complete temp file into place (fails if the name exists: O_EXCL's
    guarantee, and readers never see a half-written lock); swap and delete run under a `.cas` mutex file
    created with O_EXCL (a mutex older than 30 s is a crashed holder's and is removed).
    S3: create = PUT with `If-None-Match: *`, swap = PUT with `If-Match: <ETag>`, delete = DELETE with
    `If-Match`. An endpoint that ignores these headers (probed once per lock) gets the fallback: write, wait,
    read back - best effort only; two starters within the same ~second may then both believe they won,
    and fencing (the token check before every write) is what stops the loser."""

    def __init__(self, fs, path: str, conditional: bool | None = None):
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.conditional = self.local or (conditional if conditional is not None else self._probe())

    # ----- S3 helpers
    def _s3(self, method: str, **kw) -> bool:
        bucket, key = self.path.split("/", 1)
        try:
            self.fs.call_s3(method, Bucket=bucket, Key=key, **kw)
            return True
        except Exception as e:  # noqa: BLE001  s3fs/botocore wrap the 412/409 differently by version
            if _refused(e):
                return False
            if method == "delete_object" and isinstance(e, FileNotFoundError):
                return False
            raise

    def _probe(self) -> bool:
        bucket, key = self.path.split("/", 1)
        probe = f"{self.path}.probe-{uuid.uuid4().hex[:8]}"
        pkey = probe.split("/", 1)[1]
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=pkey, Body=b"1", IfNoneMatch="*")
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=pkey, Body=b"2", IfNoneMatch="*")
                supported = False
            except Exception as e:  # noqa: BLE001
                supported = _refused(e)
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm(probe)
        if not supported:
            log.warning("object store ignores If-None-Match: lock %s falls back to write + read back "
                        "(best effort; fencing still checks the token before every write)", self.path)
        return supported

    # ----- operations
    def read(self) -> tuple[dict, str] | None:
        """(content, tag) or None; tag identifies this exact version for swap/delete."""
        try:
            if self.local:
                raw = Path(self.path).read_bytes()
                return json.loads(raw or b"{}"), hashlib.sha256(raw).hexdigest()
            etag = self.fs.info(self.path)["ETag"]  # before the body: a newer body with an older tag fails the swap
            return json.loads(self.fs.cat_file(self.path) or b"{}"), etag
        except FileNotFoundError:
            return None

    def create(self, data: dict) -> bool:
        raw = json.dumps(data).encode()
        if self.local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
            Path(tmp).write_bytes(raw)
            try:
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.conditional:
            return self._s3("put_object", Body=raw, IfNoneMatch="*")
        if self.fs.exists(self.path):
            return False
        self.fs.pipe_file(self.path, raw)
        time.sleep(1.0)  # fallback: let a racing writer land, then see whose write survived
        got = self.read()
        return bool(got and got[0].get("token") == data["token"])

    def swap(self, data: dict, tag: str) -> bool:
        raw = json.dumps(data).encode()
        if self.local:
            with self._mutex():
                got = self.read()
                if not got or got[1] != tag:
                    return False
                tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
                Path(tmp).write_bytes(raw)
                os.replace(tmp, self.path)
                return True
        if self.conditional:
            return self._s3("put_object", Body=raw, IfMatch=tag)
        got = self.read()
        if not got or got[1] != tag:
            return False
        self.fs.pipe_file(self.path, raw)
        return True

    def delete(self, tag: str) -> bool:
        if self.local:
            with self._mutex():
                got = self.read()
                if not got or got[1] != tag:
                    return False
                os.unlink(self.path)
                return True
        if self.conditional:
            return self._s3("delete_object", IfMatch=tag)
        got = self.read()
        if not got or got[1] != tag:
            return False
        self.fs.rm(self.path)
        return True

    @contextmanager
    def _mutex(self):
        m = self.path + ".cas"
        deadline = time.time() + 30
        while True:
            try:
                os.close(os.open(m, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - os.stat(m).st_mtime > 30:
                        os.unlink(m)  # its holder crashed inside the few lines above
                        continue
                if time.time() > deadline:
                    raise LockHeld(f"cannot get {m} for 30 s")
                time.sleep(0.01)
        try:
            yield
        finally:
            os.unlink(m)


_conditional: dict = {}  # (filesystem class, bucket) -> whether it honours conditional PUTs (probed once)


def _object(fs, path: str) -> LeaseObject:
    key = (type(fs).__name__, path.split("/", 1)[0])
    obj = LeaseObject(fs, path, _conditional.get(key))
    _conditional[key] = obj.conditional
    return obj


def _take(obj: LeaseObject, me: dict, uri: str, lease_s: float, what: str, hint: str) -> dict | None:
    """Create the lock, or take over a stale one: returns the stale holder taken over (None if it was free)."""
    for _ in range(5):
        if obj.create(me):
            return None
        got = obj.read()
        if got is None:
            continue  # released meanwhile: try again
        held, tag = got
        age = time.time() - held.get("refreshed_at", 0)
        if age < lease_s and not dead(held):
            raise LockHeld(f"{what} is in use by {describe(held)} (lock {uri} refreshed {age:.0f}s ago){hint}")
        me["refreshed_at"] = time.time()
        if obj.swap(me, tag):
            log.warning("took over the stale lock %s (%s, refreshed %.0fs ago)", uri, describe(held), age)
            return held
    raise LockHeld(f"{what} was just taken by another process (lock {uri}){hint}")


class Lease:
    """A held lease (what `lease()` yields). `check()` is the fencing check before a write: it reads the lock
    object (one small GET) and raises LockLost naming the new holder once the token is not ours. A process
    paused past its lease (SIGSTOP, a frozen VM) thus finds out before its next write, not after."""

    def __init__(self, obj: LeaseObject, me: dict, uri: str, lease_s: float, redact: Callable[[str], str]):
        self.obj, self.me, self.uri, self.lease_s, self.redact = obj, me, uri, lease_s, redact
        self.lost_why: str | None = None
        self.took_over: dict | None = None  # the stale holder this lease replaced (its refreshed_at: when it last lived)
        self.ok_at = time.time()
        self.stop = threading.Event()

    def lost(self, why: str) -> None:
        if not self.lost_why:
            self.lost_why = f"lock {self.uri} lost: {why}; this process stops writing"
            log.error("%s", self.lost_why)

    def check(self) -> None:
        if self.lost_why:
            raise LockLost(self.lost_why)
        got = self.obj.read()
        if not got or got[0].get("token") != self.me["token"]:
            self.lost(f"now held by {describe(got[0] if got else None)}")
            raise LockLost(self.lost_why)

    def _refresh(self) -> None:
        while not self.lost_why and not self.stop.wait(self.lease_s / 4):
            try:
                got = self.obj.read()
                if not got or got[0].get("token") != self.me["token"]:
                    return self.lost(f"now held by {describe(got[0] if got else None)}")
                now = time.time()
                if not self.obj.swap({**self.me, "refreshed_at": now}, got[1]):
                    return self.lost("changed by another process during refresh")
                self.ok_at = now
            except Exception as e:  # noqa: BLE001  transient store errors: retry until half the lease is gone
                why = self.redact(f"{type(e).__name__}: {e}")
                if time.time() - self.ok_at > self.lease_s / 2:
                    return self.lost(f"refresh failed for {time.time() - self.ok_at:.0f}s ({why})")
                log.warning("lock refresh failed, retrying: %s", why)


@contextmanager
def lease(fs, path: str, uri: str, lease_s: float, what: str, redact: Callable[[str], str] = str,
          wait_s: float = 0.0, hint: str = "") -> Iterator[Lease]:
    """Hold the lock object at `path` (`uri` names it in messages; `what` says what it guards) for the block.
    Taken by create-if-absent; a stale lock (lease expired, or its holder `dead()`) is taken over by
    compare-and-swap, so of two racing takers exactly one wins; LockHeld names a live holder (after waiting
    up to `wait_s` for it to go). Released only if it still holds our token."""
    obj = _object(fs, path)
    me = {"token": uuid.uuid4().hex, **identity(), "refreshed_at": time.time(), "acquired_at": time.time()}
    deadline = time.time() + wait_s
    while True:
        try:
            stale = _take(obj, me, uri, lease_s, what, hint)
            break
        except LockHeld:
            if time.time() >= deadline:
                raise
            time.sleep(0.1)
    held = Lease(obj, me, uri, lease_s, redact)
    held.took_over = stale
    t = threading.Thread(target=held._refresh, daemon=True, name=f"lease-{uri}")
    t.start()
    try:
        yield held
    finally:
        held.stop.set()
        t.join(5)
        try:
            got = obj.read()
            if got and got[0].get("token") == me["token"]:
                obj.delete(got[1])
            elif got:
                log.warning("not releasing %s: it is held by %s now", uri, describe(got[0]))
        except Exception as e:  # noqa: BLE001  the lease expires by itself
            log.warning("could not release %s (%s); it expires after %ss", uri, redact(f"{type(e).__name__}: {e}"),
                        lease_s)
