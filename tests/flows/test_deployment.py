"""Deployments for real, as the how-to pages write them. Against the session's `prefect server`
(tests/conftest.py), from a fresh project folder (the checkout's files linked into a new folder, so the
demo's `runs/` lands there), every `prefect ...` command of docs/how-to/*.md runs as written, in page order
(tests/flows/test_cli.py's prefect_documented collects them). What the test puts in for the page:
`prefect server start` is the session's server (its port for the page's 4200, in PREFECT_API_URL); a
background command (`&`, and a worker that `sbatch` would run) runs until the module ends; SCHEDULE_ID is
the id that `prefect deployment schedule ls` printed; the worker polls every 2 s
(PREFECT_WORKER_QUERY_SECONDS) instead of 10.

Beside the pages, on deployments of small loops (the shipped entries with small models and data, as a user
adapts them): a run whose schedule sets only `run_name`, a run whose `--params` set only `run_name`, killed
with -9 mid-DPO and retried with the API call of the UI's Retry button, and a small ppo deployment run.
Servers and workers listen on 127.0.0.1, die with this process, and are stopped by pid."""
from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import httpx
import pytest
import yaml

from rlhf_core import store
from rlhf_core.runtime import faults
from rlhf_core.demo import demo_task
from rlhf_core.store import versions
from tests.conftest import dies_with_parent
from tests.flows.flowkit import alive_marked, kill_marked, manifests
from tests.flows.test_cli import PREFECT_PAGES, prefect_documented

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "how-to"
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
HTTP = httpx.Client(timeout=60)  # the server answers slowly on a loaded machine


class Pages:
    """Runs the how-to pages' `prefect` commands from `project` and keeps what they printed."""

    def __init__(self, project: Path, env: dict, logs: Path):
        self.project, self.env, self.logs = project, env, logs
        self.values: dict[str, str] = {}  # placeholder -> what the test puts in
        self.out: dict[str, str] = {}     # command as written -> its output
        self.background: dict[str, subprocess.Popen] = {}
        self.done: dict[str, dict[str, str]] = {}
        self.after: dict[str, Callable[[], None]] = {}  # command as written -> what to look at right after it ran
        self.seen: dict[str, object] = {}      # ... and what was seen then

    def run(self, cmd: str, timeout: float = 300) -> str:
        line = cmd
        for k, v in self.values.items():
            line = line.replace(k, v)
        if line.startswith("prefect server start"):
            self.out[cmd] = "the session's server"
        elif line.endswith("&") or " worker start " in line:
            line = line.rstrip("& ")
            if line not in self.background:
                log = self.logs / f"bg-{len(self.background)}.log"
                self.background[line] = subprocess.Popen(dies_with_parent(["bash", "-c", f"exec {line}"]), cwd=self.project,
                                                         env=self.env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                                         start_new_session=True)
                self.background[line].log = log
            self.out[cmd] = f"started in the background: {line}"
        else:
            done = subprocess.run(["bash", "-c", line], cwd=self.project, env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
            said = done.stdout + done.stderr
            assert done.returncode == 0, f"{line}\n{said[-4000:]}"
            self.out[cmd] = said
        return self.out[cmd]

    def page(self, name: str) -> dict[str, str]:
        """Every command of docs/how-to/<name> in order, once; `self.after[command]()` runs right after that command."""
        if name not in self.done:
            for cmd in prefect_documented(DOCS / name):
                said = self.run(cmd, timeout=1500 if "--watch" in cmd else 300)
                if "schedule ls" in cmd:
                    self.values["SCHEDULE_ID"] = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", said)[0]
                if cmd in self.after:
                    self.after[cmd]()
            self.done[name] = {c: self.out[c] for c in prefect_documented(DOCS / name)}
        return self.done[name]

    def stop(self) -> None:
        """SIGTERM every background command's group at once; a group still there 20 s later gets SIGKILL (a worker under
        load can take longer to shut down: stopped one by one, two workers took a minute)."""
        procs = list(reversed(list(self.background.values())))
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 20
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


@pytest.fixture(scope="module")
def pages(prefect_server, moto_s3, tmp_path_factory):
    project = tmp_path_factory.mktemp("project")
    for entry in ROOT.iterdir():  # the checkout as a user has it, without its own runs/ or virtualenv
        if entry.name not in (".git", ".venv", "runs", ".pytest_cache") and not entry.name.startswith("__"):
            (project / entry.name).symlink_to(entry)
    marker = uuid.uuid4().hex
    env = dict(prefect_server.env, PATH=f"{prefect_server.bindir}:{os.environ['PATH']}", RLHF_TEST_MARKER=marker,
               PREFECT_WORKER_QUERY_SECONDS="2", **{k: os.environ[k] for k in os.environ if k.startswith("AWS_")})
    p = Pages(project, env, tmp_path_factory.mktemp("pages"))
    p.marker, p.api = marker, prefect_server.api
    automation = "iterative-dpo/on-new-data on rlhf.data.landed"
    p.after = {  # the demo's first report, before the page's next run evaluates again; the automation once resumed
        "prefect deployment run 'iterative-dpo/demo' --watch": lambda: p.seen.update(
            demo_report=json.loads((project / "runs" / "demo" / "report.json").read_text())),
        f"prefect automation resume '{automation}'": lambda: p.seen.update(automation_resumed=[
            a["enabled"] for a in HTTP.post(f"{p.api}/automations/filter", json={}).json() if a["name"] == automation])}
    try:
        yield p
    finally:
        p.stop()
        kill_marked(marker)


def _flow_runs(api: str, deployment: str) -> list[dict]:
    dep_id = HTTP.get(f"{api}/deployments/name/{deployment}").json()["id"]
    return HTTP.post(f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [dep_id]}},
                                                       "sort": "EXPECTED_START_TIME_ASC"}).json()


def _wait(api: str, run_id: str, states=FINAL, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while (run := HTTP.get(f"{api}/flow_runs/{run_id}").json())["state_type"] not in states:
        assert time.time() < deadline, f"flow run {run['name']} still {run['state_name']} after {timeout} s"
        time.sleep(1)
    return run


def test_the_deployments_page_runs_as_written(pages, prefect_server, request):
    run = pages.project / "runs" / "demo"
    said = pages.page("deployments.md")
    for name in ("iterative-dpo/demo", "iterative-dpo/nightly", "raft/demo", "conditional-sft/demo",
                 "ppo/demo", "ppo/nightly", "iterative-dpo/on-new-data"):
        assert f"Deployment '{name}' successfully created" in said[
            "prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml"], name
    assert "Deployment 'iterative-dpo/gpu' successfully created" in said[
        "prefect --no-prompt deploy --all --prefect-file deployments/gpu.yaml"]

    # the demo, as shipped: 3 iterations
    assert "Flow run finished successfully in 'Completed'" in said["prefect deployment run 'iterative-dpo/demo' --watch"]
    # the second run set one eval field: its params (written back to the flow run) are the deployment's with
    # eval.samples_per_prompt 16; only the evaluations ran again, every other stage was found done
    second = said["prefect deployment run 'iterative-dpo/demo' --param params='{\"eval\": {\"samples_per_prompt\": 16}}' --watch"]
    assert "Flow run finished successfully in 'Completed'" in second, second[-3000:]
    api = pages.api
    first_run, eval_run = _flow_runs(api, "iterative-dpo/demo")
    shipped = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    demo = next(d for d in shipped["deployments"] if d["name"] == "demo" and "iterative_dpo" in d["entrypoint"])
    assert eval_run["parameters"]["params"] == {**demo["parameters"]["params"], "eval": {"samples_per_prompt": 16, "max_new_tokens": 16}}
    assert eval_run["name"] == first_run["name"] == "demo" and eval_run["state_type"] == "COMPLETED"
    made = manifests(str(run))
    report = json.loads((run / "report.json").read_text())
    assert report["stop_reason"] == "completed all iterations" and [r["iteration"] for r in report["iterations"]] == [0, 1, 2, 3]
    for k in range(4):
        cfg = made[f"iter-{k}/eval"].config
        assert (cfg["samples_per_prompt"], cfg["max_new_tokens"]) == (16, 16), cfg
        assert len(versions.versions(str(run / f"iter-{k}" / "eval"))) == 1  # the 8-sample evaluation, kept
    dpo = made["iter-3/dpo"].config
    assert {k: dpo[k] for k in ("beta", "learning_rate", "max_epochs", "micro_train_batch_size", "max_len")} == {
        "beta": 0.1, "learning_rate": 5.0e-4, "max_epochs": 2, "micro_train_batch_size": 16, "max_len": 48}
    trained = [m.finished_at for k, m in made.items() if k.endswith("/dpo")]
    assert len(trained) == 3 and max(trained) < min(made[f"iter-{k}/eval"].created_at for k in range(4))
    # the deployment's demo learnt what the session's in-process demo (configs/demo.yaml: the same parameters,
    # 2 iterations) learnt, iteration by iteration (the rows before the evaluations ran again)
    first = pages.seen["demo_report"]
    demo_run = request.getfixturevalue("demo_run")  # asked for here: another worker may be building it meanwhile
    assert [r["gold_reward"] for r in first["iterations"][:3]] == [r["gold_reward"] for r in demo_run.report["iterations"]]

    # schedules: resumed then paused again by the page's lines, by the id `ls` printed
    sid = pages.values["SCHEDULE_ID"]
    assert sid in said["prefect deployment schedule ls 'iterative-dpo/nightly'"]
    nightly = HTTP.get(f"{api}/deployments/name/iterative-dpo/nightly").json()
    assert [s["active"] for s in nightly["schedules"] if s["id"] == sid] == [False]
    assert "0 3 * * *" in json.dumps(nightly["schedules"])
    assert not [r for r in _flow_runs(api, "iterative-dpo/nightly") if r["state_type"] == "SCHEDULED"]

    # The run form is typed per stage: the server holds each stage section's fields with defaults and
    # descriptions, refuses a typo or a wrong type in a section, and a key the flow wires in is not offered
    dep = HTTP.get(f"{api}/deployments/name/iterative-dpo/demo").json()
    defs = dep["parameter_openapi_schema"]["definitions"]
    beta = defs["DpoSettings"]["properties"]["beta"]
    assert beta["default"] == 0.1 and beta["type"] == "number" and "beta" in beta["description"], beta
    assert defs["DpoSettings"]["additionalProperties"] is False
    assert "policy_uri" not in defs["DpoSettings"]["properties"] and "output_uri" not in defs["GenerateSettings"]["properties"]
    for bad, named in (({"dpo": {"betta": 0.1}}, "betta"), ({"dpo": {"learning_rate": "abc"}}, "abc"),
                       ({"train_rm": None}, "None is not of type 'object'")):
        out = prefect_server.prefect("deployment", "run", "iterative-dpo/demo", "--params", json.dumps({"params": bad}),
                                     check=False, timeout=120)
        assert out.returncode != 0 and named in out.stdout + out.stderr and "Created flow run" not in out.stdout, out.stdout[-2000:]


def _small(demo_run, root: str, **dpo) -> dict:
    return {"demo": False, "root": root, "run_name": "small", "iterations": 1, "pretrain_uri": demo_run.sft,
            "reward_uri": demo_run.reward, "prompt_data": f"{demo_run.inputs}/prompts.jsonl",
            "eval_prompt_data": f"{demo_run.inputs}/eval_prompts.jsonl", "gold_reward_file": demo_task.__file__,
            "generate": {"num_engines": 0, "best_of_n": 2, "rollout_batch_size": 16, "max_new_tokens": 12},
            "score": {"num_engines": 0},  # in the flow's process, as the demo scores: no Ray to start
            "eval": {"samples_per_prompt": 2, "max_new_tokens": 12}, "reference": {"max_len": 48},
            "dpo": {"max_len": 48, "micro_train_batch_size": 8, "train_batch_size": 8, **dpo}}


def _deploy(pages, tmp_path, entries: list[dict]) -> None:
    """The shipped prefect.yaml's build and pull steps with `entries` as its deployments, deployed from the project."""
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    f = tmp_path / "small.yaml"
    f.write_text(yaml.safe_dump({**{k: v for k, v in spec.items() if k != "definitions"}, "deployments": entries}, sort_keys=False))
    for e in entries:
        flow = e["entrypoint"].split(":")[1].replace("_", "-")
        pages.run(f"prefect --no-prompt deploy --prefect-file {f} --name {flow}/{e['name']}")


def _flow_process(run_id: str) -> int | None:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"PREFECT__FLOW_RUN_ID={run_id}".encode() in (d / "environ").read_bytes() \
                    and b"prefect.engine" in (d / "cmdline").read_bytes():
                return int(d.name)
        except OSError:
            pass
    return None


def _left(marker: str, pid: int, run_name: str) -> list[str]:
    """Live processes of a killed flow run: the flow process `pid`, and its training job (its spec is in the run's folder)."""
    left = []
    for line in alive_marked(marker):
        p = line.split()[0]
        try:
            if int(p) == pid or f"/{run_name}/".encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                left.append(line)
        except OSError:
            pass
    return left


def test_runs_that_set_only_run_name_keep_the_rest_and_a_run_killed_mid_training_resumes_with_the_ui_s_retry(
        pages, demo_run, tmp_path):
    """`iterative-dpo/small` (the shipped demo entry with small models, 1 iteration, DPO checkpointing every step
    and sleeping 1.5 s per step: the deployment's env job variable sets rlhf_core.runtime.faults' variable) on the
    page's pool and worker. Its schedule sets only run_name (`scheduled`), and so
    does a `prefect deployment run --params` (`ui-2`): both use every other setting of the deployment. `ui-2` is
    killed with -9 (the flow process alone) once DPO has checkpointed step 1; the worker reports it Crashed; the
    UI's Retry (its API call) reruns the same flow run, which resumes DPO from the checkpoint and completes with
    the gold reward, and the very weights, of the uninterrupted `scheduled` run."""
    pages.page("deployments.md")  # the pool and its worker (no --limit: it runs both runs at once)
    api, root = pages.api, str(tmp_path / "runs")
    small = _small(demo_run, root, micro_train_batch_size=4, train_batch_size=4, learning_rate=5.0e-4, lr_warmup_ratio=0.0,
                   save_steps=1)  # 4 steps, a checkpoint after each
    start = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=45)).isoformat()  # after the deploy and the
    _deploy(pages, tmp_path, [{"name": "small", "entrypoint": "flows/iterative_dpo.py:iterative_dpo",  # scheduler's 5 s loop
                               "parameters": {"params": small}, "work_pool": {"name": "rlhf-cpu",
                                                                              "job_variables": {"env": {faults.STEP_SLEEP: "1.5"}}},
                               "schedules": [{"interval": 86400, "anchor_date": start,
                                              "parameters": {"params": {"run_name": "scheduled"}}}]}])
    out = pages.run(f"prefect deployment run 'iterative-dpo/small' --params '{json.dumps({'params': {'run_name': 'ui-2'}})}'")
    run_id = re.search(r"UUID: (\S+)", out)[1]
    ckpt = Path(root) / "ui-2" / "iter-1" / "dpo" / "checkpoints"
    deadline = time.time() + 600
    while not list(ckpt.glob("*/_CHECKPOINT.json")):
        assert time.time() < deadline and HTTP.get(f"{api}/flow_runs/{run_id}").json()["state_type"] not in FINAL
        time.sleep(0.2)
    assert (pid := _flow_process(run_id)), f"no flow process of {run_id}"
    os.kill(pid, signal.SIGKILL)  # the flow process alone: what the OOM killer does
    crashed = _wait(api, run_id, timeout=120)
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    # Prefect 3.7.7's process worker reports the crash twice: its runner ("Flow run process exited ..."), then the worker
    # itself ("Flow run infrastructure exited ...", ~0.5 s later). A retry set between the two is overwritten by the
    # second: wait for it (a worker that reports once is waited for 30 s, then retried all the same)
    deadline = time.time() + 30
    while "infrastructure" not in (crashed["state"]["message"] or "") and time.time() < deadline:
        time.sleep(0.5)
        crashed = HTTP.get(f"{api}/flow_runs/{run_id}").json()
    assert not store.committed_any(str(ckpt.parent))  # killed mid-training: DPO never committed
    deadline = time.time() + 120
    while (left := _left(pages.marker, pid, "ui-2")) and time.time() < deadline:
        time.sleep(1)
    assert not left, left  # the training job died with the flow process

    # the UI's Retry button and its confirmation (Prefect 3.7.7's UI: FlowRunRetryModal -> retryFlowRun)
    said = HTTP.post(f"{api}/flow_runs/{run_id}/set_state", json={
        "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": False}).json()
    assert said["status"] == "ACCEPT", said
    retried = _wait(api, run_id)
    assert retried["state_type"] == "COMPLETED" and retried["run_count"] == 2, (retried["state"], retried["run_count"])
    assert retried["name"] == "ui-2" and retried["parameters"]["params"] == {**small, "run_name": "ui-2"}
    scheduled = next(r for r in _flow_runs(api, "iterative-dpo/small") if r["auto_scheduled"])
    scheduled = _wait(api, scheduled["id"])  # the schedule's run: only run_name set by the schedule
    assert scheduled["state_type"] == "COMPLETED", scheduled["state"]
    assert scheduled["name"] == "scheduled" and scheduled["parameters"]["params"] == {**small, "run_name": "scheduled"}
    deadline = time.time() + 120  # a flow run is Completed a moment before its process has exited
    while (left := [p for p in alive_marked(pages.marker) if " worker start " not in p]) and time.time() < deadline:
        time.sleep(1)
    assert not left, left

    of_run = {"flow_runs": {"id": {"any_": [run_id]}}}
    tasks = HTTP.post(f"{api}/task_runs/filter", json=of_run).json()
    assert not [t["name"] for t in tasks if t["state_type"] in ("RUNNING", "PENDING")]
    dead = [t for t in tasks if t["name"] == "iter-1/dpo" and t["state_type"] == "CRASHED"]
    assert len(dead) == 1 and "its attempt died" in dead[0]["state"]["message"], [(t["name"], t["state_type"]) for t in tasks]
    assert {t["name"] for t in tasks if t["state_type"] == "COMPLETED"} >= {"prompts", "iter-1/generate", "iter-1/dpo", "iter-1/eval"}
    cards = HTTP.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
    assert sorted(a["key"] for a in cards) == ["iterative-dpo-iterations", "iterative-dpo-plot", "iterative-dpo-progress",
                                              "iterative-dpo-report"], [(a["key"], a["created"]) for a in cards]
    report = json.loads((Path(root) / "ui-2" / "report.json").read_text())
    attempts = list(report["attempts_wall_s"].values())
    assert len(attempts) == 2 and report["wall_s"] == pytest.approx(sum(attempts), abs=0.02), report["attempts_wall_s"]
    resumed, uninterrupted = manifests(f"{root}/ui-2"), manifests(f"{root}/scheduled")
    assert resumed["iter-1/dpo"].metrics["resumed_from_step"] >= 1
    assert resumed["iter-1/dpo"].metrics["steps_done"] == uninterrupted["iter-1/dpo"].metrics["steps_done"]
    own = lambda m: {k: v for k, v in m.config.items() if not k.endswith(("_uri", "_path"))}  # noqa: E731  (not the wired URIs)
    for stage in ("iter-1/generate", "iter-1/dpo"):  # the deployment's settings, not the flow's defaults
        assert own(resumed[stage]) == own(uninterrupted[stage]), stage
    assert resumed["iter-1/generate"].config["rollout_batch_size"] == 16 and resumed["iter-1/dpo"].config["max_len"] == 48
    gold = lambda run: [r["gold_reward"] for r in json.loads((Path(root) / run / "report.json").read_text())["iterations"]]  # noqa: E731
    assert gold("ui-2") == gold("scheduled") and len(gold("ui-2")) == 2, (gold("ui-2"), gold("scheduled"))
    weights = lambda uri: hashlib.sha256(store.filesystem(uri)[0].cat_file(f"{uri}/model.safetensors")).hexdigest()  # noqa: E731
    assert weights(f"{root}/ui-2/iter-1/dpo") == weights(f"{root}/scheduled/iter-1/dpo") != weights(demo_run.sft)

    # what the UI shows of the uninterrupted run: task runs named and tagged by iteration, one card per kind,
    # one summary line per iteration and no launcher / row-count / empty lines at INFO in the run log
    tasks = {t["name"]: t for t in HTTP.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [scheduled["id"]]}}}).json()}
    assert {"prompts", "iter-0/eval", "iter-1/generate", "iter-1/dpo", "iter-1/eval"} <= set(tasks), sorted(tasks)
    assert sorted(tasks["iter-1/dpo"]["tags"]) == ["iter:1", "run:scheduled", "stage:dpo"]
    logs = [(e["level"], e["message"]) for e in HTTP.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {
        "any_": [scheduled["id"]]}}, "limit": 200}).json()]
    lines = [m for _, m in logs if m.startswith("iteration ")]
    assert len(lines) == 2 and all(re.fullmatch(r"iteration \d: gold \S+, RM \S+, KL \S+, length \S+ tokens, \d+\.\d s", m)
                                   for m in lines), lines
    noise = [m for level, m in logs if level >= 20 and (not m.strip() or "[launch.py" in m or m.startswith("progress "))]
    assert not noise and any(m.startswith("step ") for _, m in logs), noise[:10]


def test_a_small_ppo_deployment_runs_through_the_same_worker(pages, demo_run, tmp_path):
    """Online RL through the page's worker: one small iteration of the shipped ppo entry (its Ray job inside the flow run)."""
    pages.page("deployments.md")
    root = str(tmp_path / "runs")
    params = {k: v for k, v in _small(demo_run, root).items() if k not in ("generate", "score", "dpo", "reference")}
    params.update(run_name="deployed-ppo", ppo={"advantage_estimator": "group_norm", "n_samples_per_prompt": 2, "max_samples": 16,
                                                "rollout_batch_size": 8, "train_batch_size": 16, "micro_train_batch_size": 8,
                                                "generate_max_len": 8, "reward_max_len": 48, "actor_learning_rate": 5.0e-4})
    _deploy(pages, tmp_path, [{"name": "small", "entrypoint": "flows/ppo.py:ppo", "parameters": {"params": params},
                               "work_pool": {"name": "rlhf-cpu"}}])
    out = pages.run("prefect deployment run 'ppo/small' --watch --watch-timeout 900", timeout=960)
    assert "Completed" in out, out[-2000:]
    report = json.loads((tmp_path / "runs" / "deployed-ppo" / "report.json").read_text())
    assert report["stop_reason"] == "completed all iterations" and len(report["iterations"]) == 2
    assert store.read_manifest(f"{root}/deployed-ppo/iter-1/ppo").metrics["steps_done"] == 2


def test_the_triggers_and_slurm_pages_run_as_written(pages):
    """triggers.md: deploy, resume the shipped automation, its worker (the one already running), pause it again;
    slurm.md: its two process pools and the worker its batch script runs (here without sbatch: it starts and polls)."""
    pages.page("deployments.md")
    name = "iterative-dpo/on-new-data on rlhf.data.landed"
    pages.page("triggers.md")
    enabled = [a["enabled"] for a in HTTP.post(f"{pages.api}/automations/filter", json={}).json() if a["name"] == name]
    assert pages.seen["automation_resumed"] == [True] and enabled == [False]  # resumed, then paused by the page's last line
    assert len([c for c in pages.background if "--pool rlhf-cpu" in c]) == 1  # the worker is not started twice
    pages.page("slurm.md")
    pools = {p["name"]: p["type"] for p in HTTP.post(f"{pages.api}/work_pools/filter", json={}).json()}
    assert pools["slurm-gpu"] == pools["slurm-steps"] == "process"
    worker = pages.background["prefect worker start --pool slurm-gpu --limit 1"]
    deadline = time.time() + 120
    while "started" not in worker.log.read_text():
        assert worker.poll() is None and time.time() < deadline, worker.log.read_text()[-2000:]
        time.sleep(1)
    ran = {c for page in PREFECT_PAGES for c in pages.page(page)}
    assert ran == {c for p in DOCS.glob("*.md") for c in prefect_documented(p)}
