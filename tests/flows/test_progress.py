"""Progress on long work: the training job's step lines (loss, tokens/s, ETA) and generate/score rows on
the CLI (a bar on a TTY, a line every N seconds otherwise), and in Prefect (the flow run's log, read back
from the API, and the progress artifact moving inside a stage)."""
from __future__ import annotations

import io
import json
import re

import pytest

from rlhf_core.inputs import data
from rlhf_core.runtime import progress
from rlhf_core import store
from tests.conftest import tb_scalars


def test_parse_both_kinds_of_progress_line():
    ev = progress.parse("step 3/40 loss=0.6931 reward_margin=0.0100 tokens/s=10250 eta=31s")
    assert (ev.what, ev.done, ev.total, ev.unit) == ("train", 3, 40, "steps")
    assert ev.metrics == {"loss": "0.6931", "reward_margin": "0.0100", "tokens/s": "10250", "eta": "31s"}
    ev = progress.parse("progress generate 96/256 rows")
    assert (ev.what, ev.done, ev.total, ev.unit) == ("generate", 96, 256, "rows")
    assert progress.parse("checkpoint s3://b/x") is None and progress.eta(3725) == "1h02m" and progress.eta(75) == "1m15s"


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_display_throttles_lines_on_a_pipe_and_draws_a_bar_on_a_tty():
    pipe = io.StringIO()
    d = progress.Display(pipe, every_s=3600)
    for k in range(1, 11):
        d(progress.Event("score", k * 10, 100, "rows"))
    d.line("done: 4/4 steps, 64 samples", 20)
    d.line("[INFO] some deepspeed chatter", 20)
    assert pipe.getvalue().splitlines() == ["score 10/100 rows", "score 100/100 rows", "done: 4/4 steps, 64 samples"]
    tty = _Tty()
    d = progress.Display(tty)
    d(progress.Event("train", 1, 4, "steps", {"loss": "0.69"}))
    d(progress.Event("train", 4, 4, "steps", {"loss": "0.61"}))
    out = tty.getvalue()
    assert out.startswith("\r[######..................] train 1/4 steps loss=0.69") and out.endswith("train 4/4 steps loss=0.61\x1b[K\n")


def _scored_input(root, n):
    w = store.ArtifactWriter(f"{root}/samples", "generate", {"n": n})
    w.begin()
    w.write_table("s.parquet", data.to_table([{"prompt": "Review:", "response": f" good {i}", "sample_index": i}
                                              for i in range(n)], "samples"))
    return w.commit().uri


@pytest.mark.slow
def test_flow_progress_artifact_moves_inside_a_stage_and_the_run_log_holds_the_lines(prefect_harness, tiny, tmp_path, capfd):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterId, LogFilter,
                                                LogFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    from flows import calls, report
    from stages import score

    cfg = score.Config(samples_uri=_scored_input(tmp_path, 512), reward_model_uri=tiny.reward_uri, num_engines=0,
                       output_uri=str(tmp_path / "scored"))
    seen = []

    def read_artifact(ev):  # runs before the flow's own listener: sees the value the previous line set
        with get_client(sync_client=True) as c:
            art = c.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[calls._progress["id"]])))
        seen.append((ev.done, float(art[0].data)))

    @flow(name="progress-check")
    def progress_check():
        from prefect.context import FlowRunContext

        rep = report.Report("progress-check", str(tmp_path), "run", stages=2)
        calls.call(score, cfg)
        rep.add({"iteration": 0, "gold_reward": -0.25, "rm_reward": 1.5, "kl": 0.0, "response_length": 12.0})
        rep.add({"iteration": 1, "gold_reward": 0.125, "kl": 0.03125})
        rep.finish()
        return str(FlowRunContext.get().flow_run.id)

    (tmp_path / "run").mkdir()  # the flow's run lock makes it
    progress.listeners.append(read_artifact)
    try:
        flow_run_id = progress_check()
    finally:
        progress.listeners.remove(read_artifact)
    assert seen == [(256, 0.0), (512, 25.0)]  # half of stage 1 of 2 done when the second chunk finished
    APILogHandler().flush()  # the API log worker sends in batches: drain it
    with get_client(sync_client=True) as c:
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        cards = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    messages = [entry.message for entry in logs]
    # the row counts are the progress card's: at debug level in the run log, which holds one line per iteration
    assert not [m for m in messages if m.startswith("progress score")], messages
    assert "progress score 512/512 rows\n" in capfd.readouterr().err  # still on the console, as they come
    assert [m for m in messages if m.startswith("iteration ")] == [
        m for m in messages if re.fullmatch(r"iteration 0: gold -0\.25, RM 1\.5, KL 0, length 12 tokens, \d+\.\d s|"
                                            r"iteration 1: gold 0\.125, KL 0\.03125, \d+\.\d s", m)] and len(
        [m for m in messages if m.startswith("iteration ")]) == 2, messages
    # one card per kind, updated in place: three publishes (two rows and the finish), one version each
    assert sorted(a.key for a in cards) == ["progress-check-iterations", "progress-check-plot", "progress-check-progress",
                                            "progress-check-report"], [(a.key, a.created) for a in cards]
    table = next(a for a in cards if a.key.endswith("-iterations"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [r["iteration"] for r in rows] == [0, 1] and "completed all iterations" in table.description
    assert float(next(a for a in cards if a.key.endswith("-progress")).data) == 100.0


@pytest.mark.slow
def test_stage_on_the_cli_shows_reference_rows_and_training_steps_with_loss_tokens_per_s_and_eta(tiny, tmp_path, capsys):
    from flows import cli
    from rlhf_core.demo import demo_task

    w = store.ArtifactWriter(str(tmp_path / "pairs"), "data", {"n": 16})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.preference_rows(16, 0), "pairs"))
    assert cli.main(["stage", "reference", f"pairs_uri={w.commit().uri}", f"ref_uri={tiny.policy_uri}", "max_len=48",
                     "batch_size=4", f"output_uri={tmp_path / 'ref'}", "--progress-every", "0"]) == 0
    assert re.findall(r"^reference (\d+)/16 rows", capsys.readouterr().err, re.M) == ["4", "8", "12", "16"]
    ref = store.read_manifest(str(tmp_path / "ref"))
    assert cli.main(["stage", "dpo", f"policy_uri={tiny.policy_uri}", f"dataset_uri={ref.uri}", "max_len=48",
                     "train_batch_size=4", "micro_train_batch_size=4", "log_steps=1", "launcher=python",
                     "use_tensorboard=true", "use_wandb=true", f"output_uri={tmp_path / 'dpo'}", "--progress-every", "0"]) == 0
    err = capsys.readouterr().err
    steps = re.findall(r"^train (\d)/4 steps loss=\S+ .*tokens/s=\d+ eta=\d+s$", err, re.M)
    assert steps == ["1", "2", "3", "4"], err
    assert "done: 4/4 steps" in err and not re.search(r"^step \d/4", err, re.M)  # raw job lines not repeated
    # tracking: every step's metrics as TensorBoard events and an offline W&B run, inside the artifact
    history = json.loads((tmp_path / "dpo" / "training_log.json").read_text())
    events = tb_scalars(tmp_path / "dpo" / "tensorboard")
    assert [(s, round(v, 5)) for s, v in events["dpo/loss"]] == [(h["step"], round(h["loss"], 5)) for h in history]
    assert list((tmp_path / "dpo" / "wandb").rglob("*.wandb")), "no offline W&B run file"
    manifest = store.read_manifest(str(tmp_path / "dpo"))
    assert any(f["path"].startswith("tensorboard/") for f in manifest.files)


@pytest.mark.slow
def test_flow_report_tracking_writes_iterations_to_tensorboard_and_wandb(tmp_path):
    from flows.report import Report

    (tmp_path / "run").mkdir()  # the flow's run lock makes it
    rep = Report("iterative-dpo", str(tmp_path), "run", tracking={"tensorboard": True, "wandb": True})
    rep.add({"iteration": 0, "gold_reward": -0.1, "kl": 0.0})
    # live: each iteration is in both as soon as it is reported, before the flow finishes
    assert tb_scalars(tmp_path / "run" / "tensorboard")["iterative-dpo/gold_reward"] == [(0, pytest.approx(-0.1))]
    assert list((tmp_path / "run" / "wandb").rglob("*.wandb"))
    rep.add({"iteration": 1, "gold_reward": 0.2, "kl": 0.05, "dpo_s": 3.0})
    rep.finish()
    ev = tb_scalars(tmp_path / "run" / "tensorboard")
    assert ev["iterative-dpo/gold_reward"] == [(0, pytest.approx(-0.1)), (1, pytest.approx(0.2))]
    assert ev["iterative-dpo/kl"] == [(0, 0.0), (1, pytest.approx(0.05))]
    assert list((tmp_path / "run" / "wandb").rglob("*.wandb"))
