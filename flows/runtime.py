"""A flow run's bookkeeping: the run lock, the per-iteration report (Prefect table / markdown / link /
progress artifacts, report.json, the reward plot) and the stage call that advances the progress bar."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from rlhf_core import store
from stages.common import call as run_stage

LOCK = "_LOCK.json"
_progress: dict = {}  # the running flow's Prefect progress artifact: {"id", "done", "total"}


def call(stage_task_obj, cfg) -> dict:
    """Run one stage (stages.common.call) and advance the flow's progress artifact: per stage, and inside a
    stage per training step line / finished generate or score chunk (at most once a second)."""
    from rlhf_core import progress

    if not _progress.get("id"):
        return run_stage(stage_task_obj, cfg)
    from prefect.artifacts import update_progress_artifact

    last = [0.0]

    def within(ev: progress.Event) -> None:
        if time.time() - last[0] >= 1.0 or ev.done >= ev.total:
            last[0] = time.time()
            frac = min(1.0, ev.done / max(1, ev.total))
            update_progress_artifact(_progress["id"], progress=min(100.0, 100.0 * (_progress["done"] + frac) / _progress["total"]))

    progress.listeners.append(within)
    try:
        out = run_stage(stage_task_obj, cfg)
    finally:
        progress.listeners.remove(within)
    _progress["done"] += 1
    update_progress_artifact(_progress["id"], progress=min(100.0, 100.0 * _progress["done"] / _progress["total"]))
    return out



# ---------------------------------------------------------------------------------------------- lock
@contextmanager
def run_lock(root: str, run_name: str, lease_s: float = 120.0, storage_options: dict | None = None):
    """One writer per run folder. The lock object names its holder and is refreshed every lease/4 seconds.
    It is stale (taken over) when its lease expired, or when it was held on this host by a pid that is gone
    (a SIGKILLed flow); otherwise a second run with the same run_name is refused with a clear message."""
    fs, path = store.filesystem(store.join(root, run_name), storage_options)
    lock_path = store.join(path, LOCK)
    me = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}

    def write():
        with fs.open(lock_path, "w") as f:
            f.write(json.dumps({**me, "refreshed_at": time.time()}))

    if fs.exists(lock_path):
        with fs.open(lock_path) as f:
            held = json.loads(f.read() or "{}")
        alive = time.time() - held.get("refreshed_at", 0) < lease_s
        if alive and held.get("host") == me["host"]:
            alive = _pid_alive(held.get("pid"))
        if alive:
            raise RuntimeError(f"run {store.join(root, run_name)} is in use by pid {held.get('pid')} on "
                               f"{held.get('host')} (lock {LOCK} refreshed {time.time() - held['refreshed_at']:.0f}s ago); "
                               f"wait for it, or pick another run_name")
    fs.makedirs(path, exist_ok=True)
    write()
    time.sleep(0.05)
    with fs.open(lock_path) as f:  # lost a race with another starter?
        if json.loads(f.read()).get("token") != me["token"]:
            raise RuntimeError(f"run {store.join(root, run_name)} was just taken by another process")
    stop = threading.Event()

    def refresh():
        while not stop.wait(lease_s / 4):
            write()

    t = threading.Thread(target=refresh, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)
        fs.rm(lock_path)


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- report
class Report:
    """Per-iteration numbers: a Prefect table + markdown artifact, a PNG plot and report.json in the run."""

    def __init__(self, flow: str, root: str, run_name: str, storage_options: dict | None = None, stages: int = 0,
                 tracking: dict | None = None):
        self.flow, self.run_uri, self.storage_options = flow, store.join(root, run_name), storage_options
        self.tracking = tracking or {}
        _progress.clear()
        if stages:  # a progress bar in the UI: stage calls done / planned
            from prefect.artifacts import create_progress_artifact
            from prefect.context import FlowRunContext

            if FlowRunContext.get() is not None:
                _progress.update(id=create_progress_artifact(0.0, key=f"{flow}-progress", description=
                                                             f"{flow}: stages done of {stages} planned"),
                                 done=0, total=stages)
        self.rows: list[dict] = []
        self.links: dict[str, str] = {}
        self.stop_reason = "running"
        self.started = time.time()
        self.eval_cfg: dict = {}
        self.png = b""

    def add(self, row: dict, links: dict[str, str] | None = None) -> None:
        self.rows.append(row)
        self.links.update(links or {})
        self.publish()

    def finish(self) -> dict:
        if self.stop_reason == "running":
            self.stop_reason = "completed all iterations"
        if _progress.get("id"):  # an early stop skips planned stages
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(_progress["id"], progress=100.0)
        rep = self.publish()
        if self.tracking.get("wandb"):  # one W&B run per flow run, all iterations
            self._track(wandb=True)
        return rep

    def _track(self, wandb: bool = False) -> None:
        """The iterations as TensorBoard events / a W&B run, rewritten into {run}/tensorboard or {run}/wandb."""
        import shutil
        import tempfile

        from rlhf_core import tracking

        fs, path = store.filesystem(self.run_uri, self.storage_options)
        with tempfile.TemporaryDirectory() as tmp:
            for sub in tracking.write(tmp, self.rows, "iteration", tensorboard=not wandb, wandb=wandb, prefix=self.flow,
                                      project=self.tracking.get("project", "rlhf-flows"),
                                      run_name=self.run_uri.rsplit("/", 1)[-1]):
                if fs.exists(store.join(path, sub)):
                    fs.rm(store.join(path, sub), recursive=True)
                fs.put(str(Path(tmp) / sub), store.join(path, sub), recursive=True)
            shutil.rmtree(tmp, ignore_errors=True)

    def publish(self) -> dict:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        rep = {"flow": self.flow, "run": self.run_uri, "stop_reason": self.stop_reason, "iterations": self.rows,
               "flow_run_id": str(ctx.flow_run.id) if ctx and ctx.flow_run else None,
               "artifacts": self.links, "wall_s": round(time.time() - self.started, 2)}
        fs, path = store.filesystem(self.run_uri, self.storage_options)
        with fs.open(store.join(path, "report.json"), "w") as f:
            f.write(json.dumps(rep, indent=2, default=str))
        self._plot(fs, path)
        if self.tracking.get("tensorboard"):
            self._track()
        self._prefect_artifacts()
        return rep

    def _plot(self, fs, path) -> None:
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
        for key, label in (("gold_reward", "gold reward (held-out)"), ("rm_reward", "RM reward (held-out)")):
            pts = [(r["iteration"], r[key]) for r in self.rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_ylabel("mean reward")
        kl = [(r["iteration"], r["kl"]) for r in self.rows if r.get("kl") is not None]
        if kl:
            ax2.plot(*zip(*kl), marker="o", color="tab:red", label="KL(policy || ref) per token")
        ax2.set_ylabel("KL per token", color="tab:red")
        length = [(r["iteration"], r["response_length"]) for r in self.rows if r.get("response_length") is not None]
        if length:
            twin = ax2.twinx()
            twin.plot(*zip(*length), marker="s", linestyle="--", color="tab:gray", label="response length")
            twin.set_ylabel("mean response tokens", color="tab:gray")
        for a in (ax, ax2):
            a.set_xticks([r["iteration"] for r in self.rows])
            a.set_xlabel("iteration (0 = before RLHF)")
            a.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.suptitle(f"{self.flow}: {self.run_uri.rsplit('/', 1)[-1]}")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        self.png = buf.getvalue()
        with fs.open(store.join(path, "reward.png"), "wb") as f:
            f.write(self.png)

    def _prefect_artifacts(self) -> None:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return
        import base64

        key = self.flow.replace("_", "-")
        cols = columns(self.rows)
        table = [{c: (round(r[c], 4) if isinstance(r.get(c), float) else r.get(c)) for c in cols} for r in self.rows]
        create_table_artifact(table, key=f"{key}-iterations", description=f"{self.flow}: per-iteration metrics")
        md = [f"# {self.flow} — `{self.run_uri}`", f"Stop reason: **{self.stop_reason}**", "",
              f"Report: `{self.run_uri}/report.json` · Plot: `{self.run_uri}/reward.png`", "", "| artifact | URI |", "|---|---|"]
        md += [f"| {k} | `{v}` |" for k, v in self.links.items()]
        create_markdown_artifact("\n".join(md), key=f"{key}-report", description="every artifact of the run")
        # The image inline (a data: URI): the UI cannot open the store's file:// or s3:// URL of reward.png.
        create_markdown_artifact(f"![reward, KL and length per iteration](data:image/png;base64,"
                                 f"{base64.b64encode(self.png).decode()})\n\nFile: `{self.run_uri}/reward.png`",
                                 key=f"{key}-plot", description="reward, KL and response length per iteration")


# What a user watches first (gold / RM reward, KL, length), then the loop's own numbers; stage timings last.
FIRST = ("iteration", "gold_reward", "rm_reward", "kl", "response_length", "samples", "kept", "ties_dropped",
         "train_rm_reward")


def columns(rows: list[dict]) -> list[str]:
    """Report columns in reading order: FIRST, then the rest alphabetically, then `*_s` timings."""
    present = {k for r in rows for k, v in r.items() if not isinstance(v, dict)}
    rest = sorted(present - set(FIRST), key=lambda c: (c.endswith("_s"), c))
    return [c for c in FIRST if c in present] + rest
