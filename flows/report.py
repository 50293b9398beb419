"""A flow run's report: per-iteration rows as report.json, the reward plot and TensorBoard / W&B in the run
folder, and as Prefect table / markdown artifacts (one card per kind per flow run, updated in place), plus one
summary line per iteration in the run log. Every file it writes goes through the store's fence. wall_s is the
run's time over all its attempts: a rerun or a retry adds its seconds to those of the attempts before it."""
from __future__ import annotations

import json
import time
from pathlib import Path

from flows import calls, lock
from rlhf_core import store


class Report:
    """Per-iteration numbers: a Prefect table + markdown artifact, a PNG plot and report.json in the run."""

    def __init__(self, flow: str, root: str, run_name: str, storage_options: dict | None = None, stages: int = 0,
                 tracking: dict | None = None):
        self.flow, self.run_uri, self.storage_options = flow, store.join(root, run_name), storage_options
        self.tracking = tracking or {}
        calls.start_progress(flow, stages)
        self.rows: list[dict] = []
        self.links: dict[str, str] = {}
        self.stop_reason = "running"
        lease = lock.held.get(self.run_uri)  # the run lock: when this attempt took the run, whom it took it from
        self.attempt, self.started = (lease.me["token"], lease.me["acquired_at"]) if lease else ("unlocked", time.time())
        self.earlier = self._earlier_attempts(lease.took_over if lease else None)
        self.last_row_at = self.started
        self.eval_cfg: dict = {}
        self.eval_variants: dict[str, dict] = {}  # name -> eval settings of a second evaluation (columns *_{name})
        self.png = b""
        self.steps: list[dict] = []  # online RL: one row per training step over all iterations
        self.rollouts: list[dict] = []  # online RL: the last logged step's sample of rollouts
        self.gate = None  # flows.promotion.Gate when the run has a promotion gate

    def add_steps(self, k: int, log: list[dict]) -> None:
        """Iteration k's online-RL steps (the ppo stage's training_log.json): reward, KL, entropy per step, and the
        held-out evaluation's figures (eval_*) at the steps that evaluated."""
        for h in log:
            self.steps.append({"iteration": k, "step": len(self.steps) + 1, "reward": h.get("reward"),
                               "kl": h.get("kl"), "entropy": h.get("entropy"),
                               **{key: v for key, v in h.items() if key.startswith("eval_") and key != "eval_s"}})

    def _earlier_attempts(self, dead: dict | None) -> dict[str, float]:
        """Seconds of this run's earlier attempts, by lock token: as their last report.json said, and for an
        attempt that died holding the lock (taken over now), until its last lock refresh, its last sign of life
        (its report.json is from its last iteration)."""
        fs, path = store.filesystem(self.run_uri, self.storage_options)
        try:
            with fs.open(store.join(path, "report.json")) as f:
                before = json.load(f)
        except FileNotFoundError:
            before = {}
        seconds = dict(before.get("attempts_wall_s") or ({"before": before["wall_s"]} if "wall_s" in before else {}))
        if dead and dead.get("acquired_at") and dead.get("token"):
            lived = dead.get("refreshed_at", 0) - dead["acquired_at"]
            seconds[dead["token"]] = round(max(seconds.get(dead["token"], 0.0), lived), 2)
        return seconds

    def add(self, row: dict, links: dict[str, str] | None = None) -> None:
        self.rows.append(row)
        self.links.update(links or {})
        now = time.time()
        self._say(row, now - self.last_row_at)
        self.last_row_at = now
        self.publish()

    def _say(self, row: dict, seconds: float) -> None:
        """The iteration's line in the run log: `iteration 2: gold 0.412, RM 1.20, KL 0.0312, length 11.4 tokens, 35.2 s`."""
        said = [f"{label} {row[key]:.4g}" for key, label in (("gold_reward", "gold"), ("rm_reward", "RM"), ("kl", "KL"))
                if isinstance(row.get(key), (int, float))]
        if isinstance(row.get("response_length"), (int, float)):
            said.append(f"length {row['response_length']:.3g} tokens")
        calls.run_logger().info("iteration %s: %s", row.get("iteration"), ", ".join(said + [f"{seconds:.1f} s"]))

    def finish(self) -> dict:
        if self.stop_reason == "running":
            self.stop_reason = "completed all iterations"
        calls.finish_progress()
        return self.publish()

    def _track(self) -> None:
        """The iterations so far as TensorBoard events and/or a W&B run (its id fixed by the run's URI: a rerun or
        the next iteration continues the same run), rewritten into {run}/tensorboard and {run}/wandb."""
        import hashlib
        import shutil
        import tempfile

        from rlhf_core.runtime import tracking

        fs, path = store.filesystem(self.run_uri, self.storage_options)
        with tempfile.TemporaryDirectory() as tmp:
            t = tracking.Tracker(tmp, tensorboard=bool(self.tracking.get("tensorboard")), wandb=bool(self.tracking.get("wandb")),
                                 prefix=self.flow, step_key="iteration", project=self.tracking.get("project", "rlhf-flows"),
                                 run_name=self.run_uri.rsplit("/", 1)[-1],
                                 run_id=hashlib.sha256(self.run_uri.encode()).hexdigest()[:16])
            for r in self.rows:
                t.log(r)
            for sub in t.close():
                store.check_fence()
                if fs.exists(store.join(path, sub)):
                    fs.rm(store.join(path, sub), recursive=True)
                fs.put(str(Path(tmp) / sub), store.join(path, sub), recursive=True)
            shutil.rmtree(tmp, ignore_errors=True)

    def publish(self) -> dict:
        from prefect.context import FlowRunContext

        store.check_fence()  # a run that lost its lock leaves the report to the new holder

        ctx = FlowRunContext.get()
        rep = {"flow": self.flow, "run": self.run_uri, "stop_reason": self.stop_reason, "iterations": self.rows,
               "flow_run_id": str(ctx.flow_run.id) if ctx and ctx.flow_run else None,
               "artifacts": self.links}
        attempts = {**self.earlier, self.attempt: round(time.time() - self.started, 2)}
        rep |= {"wall_s": round(sum(attempts.values()), 2), "attempts_wall_s": attempts}
        if self.steps:
            rep["steps"] = self.steps
        if self.gate:
            rep["promotion"] = self.gate.summary()
        fs, path = store.filesystem(self.run_uri, self.storage_options)
        store.check_fence()
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
        store.check_fence()
        with fs.open(store.join(path, "reward.png"), "wb") as f:
            f.write(self.png)

    def _prefect_artifacts(self) -> None:
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is None:
            return
        import base64

        key = self.flow.replace("_", "-")
        cols = columns(self.rows)
        table = [{c: (round(r[c], 4) if isinstance(r.get(c), float) else r.get(c)) for c in cols} for r in self.rows]
        done = f"{len(self.rows) - 1} iteration(s)" + ("" if self.stop_reason == "running" else f", {self.stop_reason}")
        calls.card(f"{key}-iterations", f"{self.flow}: per-iteration metrics ({done})", table=table)
        md = [f"# {self.flow} — `{self.run_uri}`", f"Stop reason: **{self.stop_reason}**", "",
              f"Report: `{self.run_uri}/report.json` · Plot: `{self.run_uri}/reward.png`", "", "| artifact | URI |", "|---|---|"]
        md += [f"| {k} | `{v}` |" for k, v in self.links.items()]
        calls.card(f"{key}-report", f"every artifact of the run ({done})", markdown="\n".join(md))
        if self.rollouts:
            calls.card(f"{key}-rollouts", f"rollouts of step {self.rollouts[0]['step']} of the last iteration ({done})",
                       table=[{c: round(v, 4) if isinstance(v, float) else v for c, v in r.items()} for r in self.rollouts])
        evals = [r for r in self.steps if any(c.startswith("eval_") for c in r)]
        if evals:  # online RL's held-out evaluations inside the runs (the ppo stage's eval_steps)
            ecols = ["iteration", "step", *sorted({c for r in evals for c in r if c.startswith("eval_")})]
            calls.card(f"{key}-evaluations", f"held-out evaluations during training ({done})",
                       table=[{c: round(r[c], 4) if isinstance(r.get(c), float) else r.get(c) for c in ecols} for r in evals])
        if self.gate and self.gate.promoted:
            self._promotion_card(done)
        # The image inline (a data: URI): the UI cannot open the store's file:// or s3:// URL of reward.png.
        calls.card(f"{key}-plot", f"reward, KL and response length per iteration ({done})",
                   markdown=f"![reward, KL and length per iteration](data:image/png;base64,"
                            f"{base64.b64encode(self.png).decode()})\n\nFile: `{self.run_uri}/reward.png`")

    def _promotion_card(self, done: str) -> None:
        """The promoted policy and each decision; one key per lineage (else per run), so Prefect's Artifacts page
        shows the latest promotion of a nightly deployment across its runs."""
        from flows.promotion import slug

        g, cur = self.gate, self.gate.promoted
        head = [f"# Promoted: `{cur['policy_uri']}`", f"Iteration {cur['iteration']} of `{self.run_uri}`: {g.metric} "
                f"{cur[g.metric]:.4f}" + (f", KL {cur['kl']:.4f}" if cur.get("kl") is not None else ""),
                f"Gate: promote_min_gain={g.p.promote_min_gain:g}" + (f", promote_max_kl={g.p.promote_max_kl:g}"
                                                                     if g.p.promote_max_kl is not None else "")]
        if g.p.lineage:
            head.append(f"Lineage `{g.p.lineage}`: " + (g.lineage_note or "its pointer names this policy"))
        rows = ["| iteration | promoted | why |", "|---|---|---|"]
        rows += [f"| {d['iteration']} | {'yes' if d['promoted'] else 'no'} | {d['reason']} |" for d in g.decisions]
        calls.card(f"promoted-{slug(g.p.lineage or self.run_uri.rsplit('/', 1)[-1])}",
                   f"{self.flow}: the promoted policy ({done})", markdown="\n\n".join(head) + "\n\n" + "\n".join(rows))


def training_columns(name: str, metrics: dict) -> dict:
    """A training stage's columns of an iteration's row, from its manifest's metrics: the final figures over
    its training data ({name}_loss, _reward_margin, ...), every held-out figure when it evaluated on eval data
    ({name}_eval_loss, {name}_eval_reward_accuracy, ...: eval_dataset / eval_holdout) and its step count."""
    row = {f"{name}_{key}": metrics[f"final_{key}"] for key in ("loss", "reward_margin", "reward_accuracy", "reward_gap", "kl")
           if f"final_{key}" in metrics}
    row |= {f"{name}_{k}": v for k, v in metrics.items() if k.startswith("eval_") and k != "eval_rows"}
    return row | {f"{name}_steps": metrics.get("steps_done")}


# What a user watches first (gold / RM reward, KL, length), then the loop's own numbers; stage timings last.
FIRST = ("iteration", "promoted", "gold_reward", "gold_reward_low", "rm_reward", "rm_reward_low", "kl", "response_length", "samples", "kept", "ties_dropped",
         "train_rm_reward")


def columns(rows: list[dict]) -> list[str]:
    """Report columns in reading order: FIRST, then the rest alphabetically, then `*_s` timings."""
    present = {k for r in rows for k, v in r.items() if not isinstance(v, dict)}
    rest = sorted(present - set(FIRST), key=lambda c: (c.endswith("_s"), c))
    return [c for c in FIRST if c in present] + rest
