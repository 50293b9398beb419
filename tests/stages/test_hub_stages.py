"""Stages given hub ids as an OpenRLHF command names them (`--pretrain org/name --dataset org/name`), against the
hub stand-in: `rlhf-flows stage sft` end to end with a gated model and a hub dataset, a moved branch rerunning
what read it and a pinned sha not, and the token kept out of logs, manifests, errors and the Prefect database."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core import store
from rlhf_core.inputs import hub
from stages import prepare
from tests.hubstub import GATED_TOKEN, use_hub

WRONG_TOKEN = "hf_wrongTokenNotGranted42"


@pytest.fixture
def hf(hub_stub, monkeypatch, tmp_path):
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "_resolved", {})
    use_hub(hub_stub, monkeypatch, tmp_path / "hf", token=GATED_TOKEN)
    return hub_stub


def _files_text(*roots: Path) -> str:
    return "".join(p.read_bytes().decode(errors="replace") for r in roots for p in Path(r).rglob("*")
                   if p.is_file() and not p.is_symlink() and p.stat().st_size < 10_000_000)


@pytest.mark.slow
def test_sft_stage_runs_an_openrlhf_command_s_hub_ids_end_to_end(hf, tmp_path):
    """`--pretrain tiny-org/gated-policy --dataset tiny-org/sft-data --input_key question --output_key response
    --eval_dataset tiny-org/sft-data --eval_split test`, as the CLI runs it: trained, its lineage naming both
    commits, and the token nowhere in the output, the log or the caches' files."""
    out = tmp_path / "sft"
    argv = [str(Path(sys.executable).parent / "rlhf-flows"), "stage", "sft", "policy_uri=tiny-org/gated-policy",
            "dataset_uri=tiny-org/sft-data", "input_key=question", "output_key=response", "eval_dataset=tiny-org/sft-data",
            "eval_split=test", "max_samples=8", "train_batch_size=4", "micro_train_batch_size=4", "max_len=48",
            "learning_rate=1e-3", "lr_warmup_ratio=0", f"output_uri={out}"]
    r = subprocess.run(argv, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = store.read_manifest(str(out))
    policy = hub.resolve(hub.model_ref("tiny-org/gated-policy")).sha
    dataset = hub.resolve(hub.dataset_ref("tiny-org/sft-data")).sha
    lineage = {i["name"]: i["uri"] for i in m.inputs}
    assert lineage == {"policy": f"hf://tiny-org/gated-policy@{policy}", "dataset": f"hf://datasets/tiny-org/sft-data@{dataset}",
                       "eval_dataset": f"hf://datasets/tiny-org/sft-data@{dataset}"}
    assert m.metrics["samples_seen"] == 8 and m.metrics["steps_done"] == 2
    text = r.stdout + r.stderr + _files_text(out, tmp_path / "cache", tmp_path / "hf")
    assert GATED_TOKEN not in text


def test_moved_dataset_branch_reruns_prepare_and_a_pinned_sha_does_not(hf, tmp_path):
    rows = lambda tag, n: "".join(json.dumps({"input": f"{tag}{i}"}) + "\n" for i in range(n))  # noqa: E731
    first = hf.add("t-org/prompts", {"train.jsonl": rows("a", 3)}, kind="dataset")
    branch = prepare.Config(kind="prompts", data="t-org/prompts", output_uri=str(tmp_path / "branch"))
    pinned = prepare.Config(kind="prompts", data=f"hf://datasets/t-org/prompts@{first}", output_uri=str(tmp_path / "pinned"))
    b1, p1 = prepare.run(branch), prepare.run(pinned)
    assert b1.rows == p1.rows == 3 and b1.inputs[0]["fingerprint"] == p1.inputs[0]["fingerprint"]
    assert prepare.run(branch).created_at == b1.created_at  # main did not move: no work

    hf.add("t-org/prompts", {"train.jsonl": rows("b", 5)}, kind="dataset")  # main moves
    b2, p2 = prepare.run(branch), prepare.run(pinned)
    assert b2.fingerprint != b1.fingerprint and b2.rows == 5
    assert store.read_table(branch.output_uri).column("prompt").to_pylist()[0] == "b0"
    assert (p2.fingerprint, p2.created_at, p2.rows) == (p1.fingerprint, p1.created_at, 3)  # pinned: untouched


def test_the_token_never_reaches_the_prefect_database(hf, prefect_harness, monkeypatch, tmp_path):
    """A stage with a gated model and dataset as a Prefect task: once granted, once with a token not granted
    (a failed task whose message Prefect stores). The database's bytes, its results and logs hold neither token."""
    from prefect import flow
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_LOCAL_STORAGE_PATH

    from flows.tasks import StageFailed, run_stage, task_for

    hf.add("t-org/gated-prompts", {"train.jsonl": '{"input": "a"}\n{"input": "b"}\n'}, kind="dataset", gated=True)

    @flow
    def prep(out: str) -> dict:
        return run_stage(task_for("prepare"), prepare.Config(kind="prompts", data="t-org/gated-prompts", apply_chat_template=True,
                                                             tokenizer_uri="tiny-org/gated-policy", output_uri=out))

    assert prep(str(tmp_path / "ok"))["rows"] == 2
    monkeypatch.setenv("HF_TOKEN", WRONG_TOKEN)
    monkeypatch.setattr(hub, "_resolved", {})
    with pytest.raises(StageFailed) as e:
        prep(str(tmp_path / "refused"))
    assert str(e.value) == (f"stage 'prepare' failed writing {tmp_path / 'refused'}: HubError: dataset t-org/gated-prompts "
                            f"is gated at {hf.url} and HF_TOKEN's account has not been granted access: request it at "
                            f"{hf.url}/datasets/t-org/gated-prompts, then rerun")
    APILogHandler().flush()  # the run logs, sent in batches, are in the database before it is read
    db = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    stored = _files_text(db.parent, Path(PREFECT_LOCAL_STORAGE_PATH.value()), tmp_path / "ok")
    assert "t-org/gated-prompts" in stored and "has not been granted access" in stored  # the right database
    assert GATED_TOKEN not in stored and WRONG_TOKEN not in stored


def test_a_missing_hub_dataset_is_one_line_from_the_cli_and_commits_nothing(hf, tmp_path, capsys):
    from flows import cli

    out = tmp_path / "prompts"
    assert cli.main(["stage", "prepare", "kind=prompts", "data=t-org/no-such-data", f"output_uri={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlhf-flows: error: dataset t-org/no-such-data: no such dataset repo at {hf.url}, and no local path "
                   f"of that name"]  # HF_TOKEN is set here: no hint about private repos
    assert not out.exists()
