"""Experiment tracking as OpenRLHF users know it: `use_tensorboard` (TensorBoard event files) and `use_wandb`
(a Weights & Biases run: online when WANDB_API_KEY is set, else offline files that `wandb sync` uploads).

A Tracker logs rows of numbers keyed by a step as they happen: a training job's rank 0 logs every step live
(rlhf_core.train.entry; after a restart from a checkpoint it first replays the restored history, so the
files hold every step once, and the W&B run, keyed by the job's fingerprint, resumes), and the files go
into the model artifact's `tensorboard/` and `wandb/`; a loop flow logs one row per iteration into the run
folder (flows.report.Report).
"""
from __future__ import annotations

import os
from pathlib import Path


def _scalars(row: dict, step_key: str) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != step_key and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


class Tracker:
    """TensorBoard events under local_dir/tensorboard and/or a W&B run under local_dir/wandb, written per row."""

    def __init__(self, local_dir: str | Path, *, tensorboard: bool, wandb: bool, prefix: str, step_key: str = "step",
                 project: str = "rlhf-flows", run_name: str | None = None, run_id: str | None = None,
                 config: dict | None = None):
        self.dir, self.prefix, self.step_key = Path(local_dir), prefix, step_key
        self.tb = self.wb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"), flush_secs=2)  # a watcher sees a step within ~2 s
        if wandb:
            import wandb as wb

            (self.dir / "wandb").mkdir(parents=True, exist_ok=True)
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wb = wb.init(project=project, name=run_name, id=run_id, resume="allow" if run_id else None,
                              dir=str(self.dir / "wandb"), mode=mode, config=config or {}, reinit="create_new",
                              settings=wb.Settings(silent=True, console="off"))

    def log(self, row: dict) -> None:
        step, values = int(row[self.step_key]), _scalars(row, self.step_key)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{self.prefix}/{k}", v, step)
        if self.wb is not None:
            self.wb.log({f"{self.prefix}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> list[str]:
        """Flush and close; returns the sub-folders written ("tensorboard", "wandb")."""
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
        return [sub for sub, on in (("tensorboard", self.tb), ("wandb", self.wb)) if on is not None]

