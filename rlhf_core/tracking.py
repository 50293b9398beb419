"""Experiment tracking as OpenRLHF users know it: `use_tensorboard` (TensorBoard event files) and `use_wandb`
(a Weights & Biases run: online when WANDB_API_KEY is set, else offline files that `wandb sync` uploads).

Both are written from rows of numbers keyed by a step: a training job's per-step history (training_log.json,
complete across checkpoint restarts; written when the job ends, into the model artifact's `tensorboard/`
and `wandb/`), and a loop flow's per-iteration report rows (into the run folder). Live progress while a job
runs is in the log and the Prefect progress artifact (rlhf_core.progress).
"""
from __future__ import annotations

import os
from pathlib import Path


def _scalars(row: dict, step_key: str) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != step_key and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def write(local_dir: str | Path, rows: list[dict], step_key: str, *, tensorboard: bool, wandb: bool, prefix: str,
          project: str = "rlhf-flows", run_name: str | None = None, config: dict | None = None) -> list[str]:
    """Write `rows` under local_dir/tensorboard and/or local_dir/wandb; returns the sub-folders written."""
    local_dir = Path(local_dir)
    written = []
    if tensorboard:
        from tensorboardX import SummaryWriter

        tb = SummaryWriter(str(local_dir / "tensorboard"))
        for r in rows:
            for k, v in _scalars(r, step_key).items():
                tb.add_scalar(f"{prefix}/{k}", v, int(r[step_key]))
        tb.close()
        written.append("tensorboard")
    if wandb:
        import wandb as wb

        (local_dir / "wandb").mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wb.init(project=project, name=run_name, dir=str(local_dir / "wandb"), mode=mode, config=config or {},
                      reinit="create_new", settings=wb.Settings(silent=True, console="off"))
        for r in rows:
            run.log({f"{prefix}/{k}": v for k, v in _scalars(r, step_key).items()}, step=int(r[step_key]))
        run.finish()
        written.append("wandb")
    return written
