"""Rollouts in step order for the ppo driver, generated now (sync) or ahead in a thread (async_train)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

from rlhf_core.ppo.placement import RoleError


class RolloutFeed:
    """Rollouts in step order. Sync (async_train off): `get(step)` generates step's batch now, with the weights
    of every update so far. Async (OpenRLHF's --async_train): a thread generates ahead while the driver trains,
    so the rollout of step k+1 overlaps training on step k.

    Which weights generate rollout j is fixed, not a race: with q = async_queue_size, rollout j is generated
    with version max(start, j - q) of the weights (version v: the weights after v updates; `start` the version
    the run began or resumed at). Rollout j starts only once version j - q is in the engines (`synced`), and the
    driver syncs version v only once the rollout that needs version v - 1 is done (`before_sync`). So a batch
    is always exactly q updates old (OpenRLHF's "at most q" is a race between the two threads), and a run,
    resumed or not, trains on the same batches. Seeds depend on the step only.

    Every wait is bounded by role_timeout_s: a rollout not done by then (an engine that never answers, a
    reward server that hangs) raises RoleError naming the phase and the step instead of hanging the driver.

    Resume: at a checkpoint after step s (weights version s), rollouts s .. s+q-1 are generated and not yet
    trained on, from versions older than the checkpoint's: `pending(s)` gives them to save with the checkpoint,
    and a resumed feed takes them back (`restored`) instead of regenerating them. Rollout s+q (version s, maybe
    in flight at the checkpoint) is regenerated from the checkpoint's weights: the same batch."""

    def __init__(self, cfg, produce, steps: list[tuple[int, list[int]]], start: int = 0,
                 restored: dict[int, dict] | None = None):
        """`produce(step, idx)`: the experience of one step (`rollout`); `steps`: (step, prompt indices) in order,
        from the step the run begins at, `start`; `restored`: {step: experience} saved with the checkpoint."""
        self.cfg, self.produce, self.steps = cfg, produce, steps
        self.timeout = cfg.role_timeout_s
        self.q, self.version = cfg.async_queue_size, start
        self.done = dict(restored or {})  # step -> experience, generated and not yet taken
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = None
        if cfg.async_train and steps:
            self.thread = threading.Thread(target=self._produce, name="ppo-rollout", daemon=True)
            self.thread.start()

    def _produce(self) -> None:
        try:
            for step, idx in self.steps:
                if step in self.done:  # restored from the checkpoint
                    continue
                with self.cond:  # rollout `step` needs version step - q in the engines
                    while self.version < step - self.q and not self.stop.is_set():
                        self.cond.wait(0.2)
                if self.stop.is_set():
                    return
                out = self.produce(step, idx)
                with self.cond:
                    self.done[step] = out
                    self.cond.notify_all()
        except BaseException as e:  # the driver re-raises it where it waits next
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait(self, step: int) -> None:
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while step not in self.done and self.error is None:
                if time.monotonic() > deadline:
                    raise self._late(step)
                self.cond.wait(0.2)
            if self.error is not None and step not in self.done:
                raise self.error

    def _late(self, step: int) -> RoleError:
        return RoleError(f"the rollout engines did not finish the rollout of step {step + 1} within "
                         f"{self.timeout:g} s while generate (role_timeout_s): a hung engine or reward source")

    def get(self, step: int, idx: list[int]) -> tuple[dict, float]:
        """Step's experience and the seconds the driver waited for them (async: only what training did not hide)."""
        t0 = time.perf_counter()
        if self.thread is None:
            if step in self.done:
                return self.done.pop(step), time.perf_counter() - t0
            pool = ThreadPoolExecutor(1, thread_name_prefix="ppo-rollout")  # bounded: the driver never hangs on it
            try:
                out = pool.submit(self.produce, step, idx).result(timeout=self.timeout)
            except FutureTimeout:
                raise self._late(step) from None
            finally:
                pool.shutdown(wait=False)
            return out, time.perf_counter() - t0
        self._wait(step)
        with self.cond:
            return self.done.pop(step), time.perf_counter() - t0

    def before_sync(self, step: int) -> None:
        """Update `step` is about to be synced (version step + 1): first the rollout that needs version step must
        be done, rollout step + q (when the run has it)."""
        if self.thread is not None and any(s == step + self.q for s, _ in self.steps):
            self._wait(step + self.q)

    def synced(self, step: int) -> None:
        """Update `step` reached the engines (version step + 1): the rollout that needs it may start."""
        with self.cond:
            self.version = step + 1
            self.cond.notify_all()

    def pending(self, step: int) -> dict[int, dict]:
        """The rollouts generated and not trained on that a checkpoint after `step` steps must keep: steps
        step .. step+q-1 (all done by then: `before_sync`)."""
        if self.thread is None:
            return {}
        with self.cond:
            return {s: self.done[s] for s in range(step, step + self.q) if s in self.done}

    def halt(self) -> None:
        """No new rollout starts (call before the engines go away)."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        self.halt()
        if self.thread is not None:
            self.thread.join(timeout=60)
