"""Rollouts in step order for the ppo driver, generated now (sync) or ahead in a thread (async_train)."""
from __future__ import annotations

import time


class RolloutFeed:
    """Rollouts in step order. Sync (async_train off): `get(step)` generates step's batch now, with the weights
    of every update so far. Async (OpenRLHF's --async_train): a thread generates ahead into a queue while the
    driver trains, so the rollout of step k+1 overlaps training on step k; rollout j starts only once update
    j - 1 - async_queue_size has been synced to the engines (`synced(step)`), so a batch is generated with
    weights at most async_queue_size updates old (per engine: an engine takes new weights between generate
    calls). Seeds depend on the step only, so a resumed run draws what the uninterrupted run would have."""

    def __init__(self, cfg, produce, steps: list[tuple[int, list[int]]]):
        """`produce(step, idx)`: the experience of one step (`rollout`); `steps`: (step, prompt indices) in order."""
        import queue
        import threading

        self.cfg, self.produce, self.steps = cfg, produce, steps
        self.thread = None
        if cfg.async_train and steps:
            self.queue = queue.Queue()
            self.permits = threading.Semaphore(cfg.async_queue_size + 1)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._produce, name="ppo-rollout", daemon=True)
            self.thread.start()

    def _produce(self) -> None:
        try:
            for step, idx in self.steps:
                while not self.permits.acquire(timeout=0.2):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                t0 = time.perf_counter()
                out = self.produce(step, idx)
                self.queue.put((step, out, time.perf_counter() - t0))
        except BaseException as e:  # the driver re-raises it at its next get
            self.queue.put((None, e, 0.0))

    def get(self, step: int, idx: list[int]) -> tuple[dict, float]:
        """Step's experience and the seconds the driver waited for them (async: only what training did not hide)."""
        t0 = time.perf_counter()
        if self.thread is None:
            return self.produce(step, idx), time.perf_counter() - t0
        got, out, _ = self.queue.get()
        if got is None:
            raise out
        assert got == step, f"rollout queue out of order: step {got} for {step}"
        return out, time.perf_counter() - t0

    def synced(self, step: int) -> None:
        """Update `step` reached the engines: one more rollout may start."""
        if self.thread is not None:
            self.permits.release()

    def halt(self) -> None:
        """No new rollout starts (call before the engines go away)."""
        if self.thread is not None:
            self.stop.set()

    def close(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=60)
