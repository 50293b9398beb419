"""The run lock under races: create-if-absent, fencing before every commit, refresh failures, release."""
import json
import multiprocessing as mp
import os
import time

import pytest

from flows import lock
from flows.calls import call as call_stage
from rlhf_core.store import locks
from rlhf_core import store

ROUNDS = 20


def _racer(root, barrier, results, env):
    os.environ.update(env)
    for r in range(ROUNDS):
        barrier.wait(60)
        try:
            with lock.run_lock(root, f"run-{r}", lease_s=60):
                results.put((r, os.getpid()))
                barrier.wait(60)  # hold it until the other one has tried
        except lock.LockHeld:
            barrier.wait(60)
        barrier.wait(60)  # released before the next round


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_processes_released_together_exactly_one_wins_each_round(where, tmp_path, request):
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_root")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    procs = [ctx.Process(target=_racer, args=(root, barrier, results, env)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    wins = []
    while not results.empty():
        wins.append(results.get(timeout=5))
    assert sorted(r for r, _ in wins) == list(range(ROUNDS)), wins  # exactly one winner per round
    fs, path = store.filesystem(root)
    assert not fs.glob(f"{path}/run-*/{lock.LOCK}")  # every winner released its lock


def test_commit_after_the_lock_was_taken_over_is_refused(tmp_path):
    with lock.run_lock(str(tmp_path), "r", lease_s=60):
        w = store.ArtifactWriter(str(tmp_path / "r" / "a"), "x", {})
        w.begin()
        w.write_json("a.json", {})
        # another process decided we were stale and took the run
        (tmp_path / "r" / lock.LOCK).write_text(json.dumps({"token": "other", "host": "h2", "pid": 7,
                                                               "refreshed_at": time.time()}))
        with pytest.raises(lock.LockLost, match=r"_LOCK.json lost: now held by pid 7 on h2"):
            w.commit()
        assert not store.committed_any(str(tmp_path / "r" / "a"))
    # release left the other holder's lock alone
    assert json.loads((tmp_path / "r" / lock.LOCK).read_text())["token"] == "other"


def test_failed_refresh_stops_the_run_before_the_next_stage(s3_root, monkeypatch):
    calls = []
    with lock.run_lock(s3_root, "r", lease_s=0.4) as check:
        real = locks.LeaseObject.read

        def broken(self):  # the store starts failing every request after acquisition
            calls.append(1)
            raise ConnectionError("endpoint down")

        monkeypatch.setattr(locks.LeaseObject, "read", broken)
        time.sleep(0.8)
        with pytest.raises(lock.LockLost, match=r"lost: refresh failed for .*ConnectionError: endpoint down"):
            call_stage(None, None)  # stops before running the stage
        with pytest.raises(lock.LockLost):
            check()
        monkeypatch.setattr(locks.LeaseObject, "read", real)
    assert calls


def test_stale_lock_of_a_dead_pid_is_taken_over_once(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / lock.LOCK).write_text(json.dumps({"token": "t", **locks.identity(),
                                                        "pid": 2 ** 22 + 1, "refreshed_at": time.time()}))
    with lock.run_lock(str(tmp_path), "r", lease_s=60):
        with pytest.raises(lock.LockHeld):
            with lock.run_lock(str(tmp_path), "r", lease_s=60):
                pass
    assert not (tmp_path / "r" / lock.LOCK).exists()


def test_s3_lock_object_uses_conditional_writes(s3_root):
    """moto (like S3) honours If-None-Match / If-Match; s3fs reports the 412 as FileExistsError whose message
    omits the code, which once sent every S3 lock down the best-effort fallback (write, sleep 1 s, read back)."""
    fs, path = store.filesystem(s3_root)
    obj = locks.LeaseObject(fs, f"{path}/x/{lock.LOCK}")
    assert obj.conditional
    assert obj.create({"token": "a"}) and not obj.create({"token": "b"})
    _, tag = obj.read()
    assert obj.swap({"token": "c"}, tag) and not obj.swap({"token": "d"}, tag)
    assert not obj.delete(tag) and obj.delete(obj.read()[1]) and obj.read() is None
