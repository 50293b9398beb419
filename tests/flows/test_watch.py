"""Retraining when data lands (issue 26 item 4): `rlhf-flows watch URI --once` against the session's real
`prefect server` and moto S3 endpoint emits rlhf.data.landed for a new prompt file, the shipped trigger of
`iterative-dpo/on-new-data` (deployments/prefect.yaml) starts the loop with that file on a process worker, and
the loop reads it; a second pass emits nothing; an unreadable prefix is one error line naming it."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from flows import watch
from rlhf_core import store
from tests.conftest import dies_with_parent

ROOT = Path(__file__).resolve().parents[2]
HTTP = httpx.Client(timeout=60)  # the server answers slowly on a loaded machine
AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def test_list_files_skips_partial_and_foreign_files_and_tells_prompts_from_preferences(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    land = tmp_path / "land"
    (land / "day2").mkdir(parents=True)
    (land / "p.jsonl").write_text(json.dumps({"input": "the food was"}) + "\n")
    (land / "day2" / "pairs.json").write_text(json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    (land / "day2" / "pairs.csv").write_text("prompt,chosen,rejected\na,b,c\n")
    pq.write_table(pa.table({"prompt": ["a"], "label": ["x"]}), land / "day2" / "p.parquet")
    for skipped in ("_SUCCESS", ".p2.jsonl.tmp", "notes.txt", "_versions/old.jsonl"):
        (land / skipped).parent.mkdir(exist_ok=True)
        (land / skipped).write_text("{}\n")
    found = watch.list_files(str(land))
    assert sorted(Path(u).relative_to(land).as_posix() for u in found) == [
        "day2/p.parquet", "day2/pairs.csv", "day2/pairs.json", "p.jsonl"]
    assert {Path(u).name: watch.kind_of(u) for u in found} == {
        "p.parquet": "prompts", "pairs.csv": "preferences", "pairs.json": "preferences", "p.jsonl": "prompts"}
    assert list(watch.list_files(str(land), watch.patterns_of("day2/*.csv"))) == [str(land / "day2" / "pairs.csv")]
    sent = watch.payload(str(land), found, {u: watch.kind_of(u) for u in found})
    assert sent["prompt_data"] == f"{land}/day2/p.parquet,{land}/p.jsonl"
    assert sent["preference_data"] == f"{land}/day2/pairs.csv,{land}/day2/pairs.json"
    before = watch.signature(found[str(land / "p.jsonl")])
    (land / "p.jsonl").write_text(json.dumps({"input": "the food was"}) + "\n" + json.dumps({"input": "the room"}) + "\n")
    assert watch.signature(watch.list_files(str(land))[str(land / "p.jsonl")]) != before  # a rewritten file is new again
    state = str(tmp_path / "state.json")
    watch.write_state(state, str(land), {"x": "1:2"})
    with pytest.raises(ValueError, match=f"belongs to prefix {land}"):
        watch.read_state(state, str(tmp_path / "elsewhere"))


@pytest.mark.slow
def test_a_landed_prompt_file_starts_the_triggered_loop_which_reads_it(demo_run, moto_s3, prefect_server, tmp_path):
    tag = uuid.uuid4().hex[:8]
    pool, name = f"watch-{tag}", f"on-new-data-{tag}"
    prefix, root = f"s3://{moto_s3.bucket}/landing-{tag}", f"s3://{moto_s3.bucket}/watch-{tag}"
    env = {**prefect_server.env, **{k: os.environ[k] for k in AWS}, "RLHF_FLOWS_CACHE": str(tmp_path / "cache")}
    api, worker = prefect_server.api, None

    # The shipped deployment and trigger, as a user would adapt it: their pool, models and a small loop in the
    # deployment's parameters. The trigger is kept as shipped: its parameters are the three templates the event
    # fills in (run_name, prompt_data, preference_data), merged over the deployment's by the flow.
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    dep = next(d for d in spec["deployments"] if d["name"] == "on-new-data")
    trigger = dep["triggers"][0]
    assert trigger["enabled"] is False and trigger["expect"] == [watch.EVENT]  # safe until resumed
    templated = {k: v for k, v in trigger["parameters"]["params"].items() if "{{" in str(v)}
    assert set(templated) == {"run_name", "prompt_data", "preference_data"} == set(trigger["parameters"]["params"]), templated
    small = {"demo": False, "root": root, "iterations": 1, "pretrain_uri": demo_run.sft, "reward_uri": demo_run.reward,
             "generate": {"num_engines": 0, "best_of_n": 2, "rollout_batch_size": 8, "max_new_tokens": 8},
             "score": {"num_engines": 0},
             "dpo": {"max_len": 48, "micro_train_batch_size": 8, "train_batch_size": 8, "max_epochs": 1},
             "reference": {"max_len": 48}}
    dep.update(name=name, parameters={"params": {**small, "run_name": "manual"}})
    trigger.update(name=f"{name} trigger", match={"prefect.resource.id": watch.resource_id(prefix)})
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump({**{k: v for k, v in spec.items() if k != "definitions"}, "deployments": [dep]}, sort_keys=False))
    try:
        prefect_server.prefect("work-pool", "create", pool, "--type", "process", env=env)
        prefect_server.prefect("deploy", "--prefect-file", str(prefect_file), "--name", f"iterative-dpo/{name}",
                               "--pool", pool, env=env)
        prefect_server.prefect("automation", "resume", f"{name} trigger", env=env)
        worker = prefect_server.worker(pool, f"{pool}-worker", tmp_path / "worker.log",
                                       extra_env={**env, "PREFECT_WORKER_QUERY_SECONDS": "2"})

        landed = f"{prefix}/2026-11-26/prompts.jsonl"
        fs, _ = store.filesystem(prefix)
        with fs.open(f"{demo_run.inputs}/prompts.jsonl") as f:
            rows = f.read().decode().splitlines()[:8]
        with fs.open(landed, "w") as f:
            f.write("\n".join(rows) + "\n")

        def cli(*args):
            return subprocess.run([str(prefect_server.bindir / "rlhf-flows"), "watch", *args], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120)

        first, second = cli(prefix, "--once"), cli(prefix, "--once")
        assert first.returncode == 0 and f"{landed} (prompts)" in first.stdout, first.stdout + first.stderr
        assert second.returncode == 0 and second.stdout.strip() == f"no new files under {prefix}", second.stdout + second.stderr

        dep_id = HTTP.get(f"{api}/deployments/name/iterative-dpo/{name}").json()["id"]
        runs = []
        for _ in range(300):  # the run appears within seconds, then the worker runs it (about a minute)
            runs = HTTP.post(f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [dep_id]}}}).json()
            if runs and all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs):
                break
            time.sleep(1)
        assert len(runs) == 1, [(r["name"], r["state_type"]) for r in runs]  # one event, one run: the second pass sent none
        run = runs[0]
        assert run["state_type"] == "COMPLETED", (run["state_name"], (tmp_path / "worker.log").read_text()[-3000:])
        auto = HTTP.post(f"{api}/automations/filter", json={}).json()
        assert run["created_by"]["type"] == "AUTOMATION" and run["created_by"]["id"] == next(
            a["id"] for a in auto if a["name"] == f"{name} trigger")
        params = run["parameters"]["params"]  # what ran: the event's three over the deployment's (written back by the flow)
        assert params["prompt_data"] == landed and params["preference_data"] is None, params
        assert params["run_name"].startswith("data-2"), params["run_name"]
        assert {k: v for k, v in params.items() if k not in templated} == small, params

        events = HTTP.post(f"{api}/events/filter", json={"filter": {"event": {"name": [watch.EVENT]}, "resource": {
            "id": [watch.resource_id(prefix)]}}}).json()["events"]
        assert len(events) == 1 and events[0]["payload"]["files"] == [{"uri": landed, "kind": "prompts", "size": fs.size(landed)}]

        # the loop read the landed file: its prompts stage names it in the lineage, with its 8 rows
        prompts = store.read_manifest(f"{root}/{params['run_name']}/prompts")
        assert [i["uri"] for i in prompts.inputs] == [landed] and prompts.rows == 8
        assert store.committed_any(f"{root}/{params['run_name']}/iter-1/dpo")

        # bad input: one line naming the prefix, exit 2, nothing recorded
        states = sorted((tmp_path / "cache" / "watch").iterdir())
        for bad, said in ((f"s3://no-such-bucket-{tag}/landing", f"no-such-bucket-{tag}"),
                          (f"{prefix}-missing", f"{prefix}-missing does not exist"),
                          (str(tmp_path / "no-such-folder"), str(tmp_path / "no-such-folder"))):
            out = cli(bad, "--once")
            assert out.returncode == 2 and out.stderr.startswith("rlhf-flows: error:") and said in out.stderr, out.stderr
            assert len(out.stderr.strip().splitlines()) == 1
        out = subprocess.run([str(prefect_server.bindir / "rlhf-flows"), "watch", prefix, "--once"], cwd=tmp_path, text=True,
                             capture_output=True, timeout=120,
                             env={k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
        assert out.returncode == 2 and prefix in out.stderr and "credentials" in out.stderr.lower(), out.stderr
        out = subprocess.run([str(prefect_server.bindir / "rlhf-flows"), "watch", prefix, "--once"], cwd=tmp_path, text=True,
                             capture_output=True, timeout=120, env={**env, "PREFECT_API_URL": "http://127.0.0.1:1/api"})
        assert out.returncode == 2 and "http://127.0.0.1:1/api does not answer" in out.stderr, out.stderr
        assert sorted((tmp_path / "cache" / "watch").iterdir()) == states

        # polling: a file landing between passes is announced at the next pass; a pass that fails (the folder
        # moved away) is said and retried, and the watch goes on without announcing a file twice
        land, away = tmp_path / "land", tmp_path / "away"
        land.mkdir()
        poll = subprocess.Popen(dies_with_parent([str(prefect_server.bindir / "rlhf-flows"), "watch", str(land), "--interval", "0.5"]),
                                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        guard = threading.Timer(120, poll.kill)  # a watch that stops talking ends the read below with EOF
        guard.start()

        def next_line(start: str) -> str:
            for line in iter(poll.stdout.readline, ""):
                if line.startswith(start):
                    return line
            raise AssertionError(f"watch ended (rc {poll.wait()}) before a line starting {start!r}")

        try:
            next_line("no new files")
            (land / "a.jsonl.tmp").write_text(rows[0] + "\n")
            (land / "a.jsonl.tmp").rename(land / "a.jsonl")
            assert f"{land}/a.jsonl (prompts)" in next_line(watch.EVENT)
            land.rename(away)
            assert f"watch prefix {land} does not exist" in next_line("pass failed (retrying in 0.5 s)")
            (away / "b.jsonl").write_text(rows[1] + "\n")
            away.rename(land)
            line = next_line(watch.EVENT)
            assert f"1 new file(s) under {land}: {land}/b.jsonl (prompts)" in line and "a.jsonl" not in line, line
        finally:
            guard.cancel()
            poll.terminate()
            poll.wait(30)
    finally:
        if worker:
            os.killpg(worker.pid, 15)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:  # a worker under load can take longer to shut down: stop it
                os.killpg(worker.pid, 9)
                worker.wait(30)
