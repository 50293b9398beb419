"""A flow run's bookkeeping: the run lock, the per-iteration report (Prefect table / markdown / link /
progress artifacts, report.json, the reward plot) and the stage call that advances the progress bar."""
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

from fsspec.implementations.local import LocalFileSystem

from rlhf_core import store
from stages.common import call as run_stage

LOCK = "_LOCK.json"
log = logging.getLogger("rlhf_flows")
_progress: dict = {}  # the running flow's Prefect progress artifact: {"id", "done", "total"}


def call(stage_task_obj, cfg) -> dict:
    """Run one stage (stages.common.call) and advance the flow's progress artifact: per stage, and inside a
    stage per training step line / finished generate or score chunk (at most once a second). A run whose
    lock was lost stops here, before the next stage starts."""
    from rlhf_core import progress

    store.check_fence()

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



def api_server_dies_with_us() -> None:
    """Prefect's ephemeral API server (uvicorn, ~200 MB) is a plain child of the process that started it: a
    SIGKILLed CLI (an OOM kill, a supervisor) left it alive holding its port. Start it with PR_SET_PDEATHSIG,
    as training jobs are, by giving Prefect's server module a Popen that sets it."""
    import subprocess
    import types

    from prefect.server.api import server

    from rlhf_core.jobs import _die_with_parent

    if getattr(server.subprocess, "dies_with_parent", False):
        return

    class Popen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("preexec_fn", _die_with_parent)
            super().__init__(*args, **kwargs)

    shim = types.ModuleType("subprocess")
    shim.__dict__.update(vars(subprocess), Popen=Popen, dies_with_parent=True)
    server.subprocess = shim


def use_credentials(block_name: str) -> list[str]:
    """Load the Prefect Secret block `block_name` (a JSON object of environment variables) into this process's
    environment, which training jobs and the local Ray cluster inherit; the values are redacted from every
    error from here on. Returns the variable names (never the values)."""
    from prefect.blocks.system import Secret

    try:
        values = Secret.load(block_name).get()
    except ValueError as e:
        raise ValueError(f"credentials_block {block_name!r}: no such Prefect Secret block ({e})") from None
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise ValueError(f"credentials_block {block_name!r} must hold a JSON object of environment variables, e.g. "
                         '{"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."}')
    for k, v in values.items():
        os.environ[k] = v
        if k not in store.SECRET_ENV:
            store.SECRET_ENV.append(k)
    return sorted(values)


# ---------------------------------------------------------------------------------------------- lock
class LockHeld(RuntimeError):
    """Another live process holds the run."""


LockLost = store.LockLost  # this process no longer holds its run lock: it must stop without committing


class _LockObject:
    """Create-if-absent and compare-and-swap on one small object.

    Local folders: create = hard-link a complete temp file into place (fails if the name exists: O_EXCL's
    guarantee, and readers never see a half-written lock); swap and delete run under a `.cas` mutex file
    created with O_EXCL (a mutex older than 30 s is a crashed holder's and is removed).
    S3: create = PUT with `If-None-Match: *`, swap = PUT with `If-Match: <ETag>`, delete = DELETE with
    `If-Match`. An endpoint that ignores these headers (probed once per lock) gets the fallback: write, wait,
    read back - best effort only; two starters within the same ~second may then both believe they won,
    and fencing (the token check before every commit) is what stops the loser from committing."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.conditional = self.local or self._probe()

    # ----- S3 helpers
    def _s3(self, method: str, **kw) -> bool:
        bucket, key = self.path.split("/", 1)
        try:
            self.fs.call_s3(method, Bucket=bucket, Key=key, **kw)
            return True
        except Exception as e:  # noqa: BLE001  s3fs/botocore wrap the 412/409 differently by version
            text = f"{type(e).__name__} {e}"
            if any(c in text for c in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")):
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
                supported = any(c in f"{type(e).__name__} {e}" for c in ("PreconditionFailed", "412", "409"))
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm(probe)
        if not supported:
            log.warning("object store ignores If-None-Match: run lock %s falls back to write + read back "
                        "(best effort; fencing still checks the token before every commit)", self.path)
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


@contextmanager
def run_lock(root: str, run_name: str, lease_s: float = 120.0, storage_options: dict | None = None):
    """One writer per run folder, held in `{root}/{run_name}/_LOCK.json` (holder, token, refreshed_at).

    Taken by create-if-absent; a lock whose lease expired, or held on this host by a pid that is gone (a
    SIGKILLed flow), is taken over by compare-and-swap, so of two racing starters exactly one wins. Refreshed
    every lease/4 by compare-and-swap; a refresh that fails (taken over, or the store unreachable for half
    a lease) marks the lock lost. Fencing: every commit inside the run first checks that the lock still holds
    this process's token (and was not lost), so a process that lost its lock stops before committing.
    Released only if it still holds our token."""
    run_uri = store.join(root, run_name)
    fs, path = store.filesystem(run_uri, storage_options)
    fs.makedirs(path, exist_ok=True)
    obj = _LockObject(fs, store.join(path, LOCK))
    me = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "refreshed_at": time.time()}
    for _ in range(5):
        if obj.create(me):
            break
        got = obj.read()
        if got is None:
            continue  # released meanwhile: try again
        held, tag = got
        age = time.time() - held.get("refreshed_at", 0)
        alive = age < lease_s and (held.get("host") != me["host"] or _pid_alive(held.get("pid")))
        if alive:
            raise LockHeld(f"run {run_uri} is in use by pid {held.get('pid')} on {held.get('host')} (lock {LOCK} "
                           f"refreshed {age:.0f}s ago); wait for it, or pick another run_name")
        me["refreshed_at"] = time.time()
        if obj.swap(me, tag):
            log.warning("took over the stale lock of %s (pid %s on %s, refreshed %.0fs ago)", run_uri,
                        held.get("pid"), held.get("host"), age)
            break
    else:
        raise LockHeld(f"run {run_uri} was just taken by another process")
    state = {"lost": None, "ok_at": time.time()}
    stop = threading.Event()

    def lost(why: str) -> None:
        state["lost"] = f"run lock {run_uri}/{LOCK} lost: {why}; this run stops without committing"
        log.error("%s", state["lost"])

    def refresh():
        while not state["lost"] and not stop.wait(lease_s / 4):
            try:
                got = obj.read()
                if not got or got[0].get("token") != me["token"]:
                    return lost(f"now held by pid {got[0].get('pid')} on {got[0].get('host')}" if got else "deleted")
                if not obj.swap({**me, "refreshed_at": time.time()}, got[1]):
                    return lost("changed by another process during refresh")
                state["ok_at"] = time.time()
            except Exception as e:  # noqa: BLE001  transient store errors: retry until half the lease is gone
                why = store.redact(f"{type(e).__name__}: {e}", storage_options)
                if time.time() - state["ok_at"] > lease_s / 2:
                    return lost(f"refresh failed for {time.time() - state['ok_at']:.0f}s ({why})")
                log.warning("run lock refresh failed, retrying: %s", why)

    def check() -> None:  # the fencing-token check, before every commit
        if state["lost"]:
            raise LockLost(state["lost"])
        got = obj.read()
        if not got or got[0].get("token") != me["token"]:
            lost(f"now held by pid {got[0].get('pid')} on {got[0].get('host')}" if got else "deleted")
            raise LockLost(state["lost"])

    t = threading.Thread(target=refresh, daemon=True, name=f"run-lock-{run_name}")
    t.start()
    try:
        with store.fence(check):
            yield check
    finally:
        stop.set()
        t.join(5)
        try:
            got = obj.read()
            if got and got[0].get("token") == me["token"]:
                obj.delete(got[1])
            elif got:
                log.warning("not releasing %s/%s: it is held by pid %s on %s now", run_uri, LOCK,
                            got[0].get("pid"), got[0].get("host"))
        except Exception as e:  # noqa: BLE001  the lease expires by itself
            log.warning("could not release %s/%s (%s); it expires after %ss", run_uri, LOCK,
                        store.redact(f"{type(e).__name__}: {e}", storage_options), lease_s)


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
        self.eval_variants: dict[str, dict] = {}  # name -> eval settings of a second evaluation (columns *_{name})
        self.png = b""
        self.steps: list[dict] = []  # online RL: one row per training step over all iterations

    def add_steps(self, k: int, log: list[dict]) -> None:
        """Iteration k's online-RL steps (the ppo stage's training_log.json): reward, KL, entropy per step."""
        for h in log:
            self.steps.append({"iteration": k, "step": len(self.steps) + 1, "reward": h.get("reward"),
                               "kl": h.get("kl"), "entropy": h.get("entropy")})

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
        return self.publish()

    def _track(self) -> None:
        """The iterations so far as TensorBoard events and/or a W&B run (its id fixed by the run's URI: a rerun or
        the next iteration continues the same run), rewritten into {run}/tensorboard and {run}/wandb."""
        import hashlib
        import shutil
        import tempfile

        from rlhf_core import tracking

        fs, path = store.filesystem(self.run_uri, self.storage_options)
        with tempfile.TemporaryDirectory() as tmp:
            t = tracking.Tracker(tmp, tensorboard=bool(self.tracking.get("tensorboard")), wandb=bool(self.tracking.get("wandb")),
                                 prefix=self.flow, step_key="iteration", project=self.tracking.get("project", "rlhf-flows"),
                                 run_name=self.run_uri.rsplit("/", 1)[-1],
                                 run_id=hashlib.sha256(self.run_uri.encode()).hexdigest()[:16])
            for r in self.rows:
                t.log(r)
            for sub in t.close():
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
        if self.steps:
            rep["steps"] = self.steps
        fs, path = store.filesystem(self.run_uri, self.storage_options)
        with fs.open(store.join(path, "report.json"), "w") as f:
            f.write(json.dumps(rep, indent=2, default=str))
        self._plot(fs, path)
        if self.tracking.get("tensorboard") or self.tracking.get("wandb"):
            self._track()
        self._prefect_artifacts()
        return rep

    def _plot(self, fs, path) -> None:
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3 if self.steps else 2, figsize=(12 if self.steps else 8, 3.2))
        ax, ax2 = axes[:2]
        if self.steps:  # online RL: the training reward and KL of every step
            ax3 = axes[2]
            xs = [s["step"] for s in self.steps]
            ax3.plot(xs, [s["reward"] for s in self.steps], color="tab:blue", label="training reward")
            ax3.set_xlabel("ppo step (all iterations)")
            ax3.set_ylabel("mean reward", color="tab:blue")
            ax3.grid(alpha=0.3)
            k3 = ax3.twinx()
            k3.plot(xs, [s["kl"] for s in self.steps], color="tab:red", label="KL per token")
            k3.set_ylabel("KL to the iteration's reference", color="tab:red")
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
FIRST = ("iteration", "gold_reward", "gold_reward_low", "rm_reward", "rm_reward_low", "kl", "response_length", "samples", "kept", "ties_dropped",
         "train_rm_reward")


def columns(rows: list[dict]) -> list[str]:
    """Report columns in reading order: FIRST, then the rest alphabetically, then `*_s` timings."""
    present = {k for r in rows for k, v in r.items() if not isinstance(v, dict)}
    rest = sorted(present - set(FIRST), key=lambda c: (c.endswith("_s"), c))
    return [c for c in FIRST if c in present] + rest
