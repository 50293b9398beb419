"""Per-rank memory of the model load: the peak growth of this process's anonymous resident memory while the
model loads (sampled from /proc/self/status every millisecond; anonymous pages only, so the safetensors files
mapped and read do not count), and the parameter elements this rank holds (its ZeRO-3 partition) beside the
model's. A ZeRO-3 rank that holds a shard shows a growth near the shard's bytes, not the model's
(tests/rlhf_core/train/test_scale.py)."""
from __future__ import annotations

import threading
import time


def _anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """`with AnonPeak() as p: ...`, then p.growth: the peak anonymous RSS during the block minus the start (bytes)."""

    def __enter__(self):
        self.start = self.peak = _anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_bytes())
        self.growth = self.peak - self.start
        return False


def load_report(model, growth: int) -> dict:
    """This rank's parameter elements (a ZeRO-3 partition: ds_tensor) and the model's (ds_numel), bytes each,
    and the anonymous memory growth of the load."""
    params = list(model.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    return {"param_numel_local": local, "param_numel": full, "param_bytes": full * params[0].element_size(),
            "load_anon_growth_bytes": growth}
