"""Stages as Ray Jobs (rlhf_core/runtime/ray_jobs.py) against a real local Ray head started here with its own ports and
temp dir (`ray start --head --block`, stopped by pid): ppo submitted from a Prefect flow with
ray_address=http://HEAD:PORT commits on the moto store, its job is SUCCEEDED in the job list, its lines reach the
task's run log, and the store credentials reach the job through its env_vars only (the head runs without them);
a generate stage interrupted mid-job stops its job; an address where no job API answers (refused, or silent) is
named before anything is written; the job's command line reads back as the submitter's config."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core.runtime import ray_jobs
from rlhf_core import store
from stages import generate, ppo
from tests.conftest import dies_with_parent, free_port, upload_folder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)
STORE_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


def node_env(cache: Path) -> dict:
    """A Ray node's environment: this venv first on PATH (the job runs `rlhf-flows`), its own model cache,
    and none of the store's variables: a job must get them from the submitter."""
    env = {k: v for k, v in os.environ.items() if k not in STORE_VARS}
    return {**env, "PATH": VENV_BIN + os.pathsep + env.get("PATH", ""), "RLHF_FLOWS_CACHE": str(cache),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def fixed_ports() -> list[str]:
    """Every port a node opens, free ones: no clash with other Ray instances of the test session. The workers'
    range lies below the kernel's ephemeral ports (where free_port() draws the others) and is free now."""
    lo = next(lo for lo in (random.randrange(20000, 32000 - 50) for _ in range(100))
              if all(bindable(p) for p in range(lo, lo + 51)))
    return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
            "--min-worker-port", str(lo), "--max-worker-port", str(lo + 50)]


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def stop_session(proc: subprocess.Popen, timeout: float = 90) -> None:
    """Stop what `proc` (started with start_new_session) started: SIGTERM to it (`ray start --block` stops its
    node's processes), then SIGKILL to any process still in its session, each by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_pids(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid and (d / "status").read_text().find("State:\tZ") < 0:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
    return out


def wait_job_api(address: str, proc: subprocess.Popen, log: Path, timeout: float = 180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the Ray head exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            return ray_jobs.client(address)
        except ray_jobs.RayJobError:
            time.sleep(1)
    raise AssertionError(f"no job API at {address} after {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster (2 CPUs, and 4 GPUs it advertises but does not have: this host has none) with its
    job API on 127.0.0.1, in a temp dir of its own (short: Ray's socket paths must fit 107 bytes)."""
    tmp = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))
    dash = free_port()
    cmd = [os.path.join(VENV_BIN, "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(free_port()), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--ray-client-server-port", str(free_port()), "--num-cpus", "2", "--num-gpus", "4", "--temp-dir", str(tmp / "ray"),
           "--object-store-memory", str(200 * 1024 ** 2), *fixed_ports()]
    log = tmp / "head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(dies_with_parent(cmd), env=node_env(tmp / "cache"), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        yield type("Head", (), {"address": address, "jobs": wait_job_api(address, proc, log), "pid": proc.pid})
    finally:
        stop_session(proc)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def inputs(tiny, s3_root):
    """The tiny policy and 8 raw prompts on the moto store (the cluster reads them from there)."""
    prompts = f"{s3_root}/raw/prompts.jsonl"
    fs, path = store.filesystem(prompts)
    fs.pipe_file(path, "\n".join(json.dumps(r) for r in demo_task.prompts(8, 0)).encode())
    return upload_folder(tiny.policy_dir, f"{s3_root}/policy"), prompts


def gen_config(policy, prompts, out, address, **kw):
    return generate.Config(**{**dict(policy_uri=policy, prompts_uri=prompts, output_uri=out, backend="hf",
                                     num_engines=1, best_of_n=2, max_new_tokens=6, input_template=demo_task.INPUT_TEMPLATE,
                                     ray_address=address), **kw})


def jobs_for(head, out: str) -> list:
    return [j for j in head.jobs.list_jobs() if (j.metadata or {}).get("output_uri") == out]


def test_ppo_as_a_ray_job_from_a_flow_commits_and_streams_its_log(ray_head, inputs, s3_root, prefect_harness, capfd):
    """One ppo step (GRPO on the demo's gold reward, 8 prompts x 2 samples) submitted from a Prefect flow:
    committed on the store by the job, SUCCEEDED in the job list; its roles placed on GPU bundles as the cluster
    advertises them (a driver without a GPU decides nothing on its own account); the job's lines reach the task's run log at
    the levels a local stage's lines get (the launch line at INFO; the step line and the job CLI's report at
    debug: on the console as they come); no credential in the log, the console or the entrypoint."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.context import FlowRunContext
    from prefect.logging.handlers import APILogHandler

    policy, prompts = inputs
    out = f"{s3_root}/ppo"
    cfg = ppo.Config(policy_uri=policy, prompts_uri=prompts, output_uri=out, reward_func_path=demo_task.__file__,
                     input_template=demo_task.INPUT_TEMPLATE, generate_max_len=8, lr_warmup_ratio=0.0,
                     rollout_batch_size=8, train_batch_size=16, micro_train_batch_size=8, n_samples_per_prompt=2,
                     advantage_estimator="group_norm", init_kl_coef=0.0, ray_address=ray_head.address)

    @flow(name="ray-job-ppo")
    def one_stage():
        from flows.tasks import task_for

        return task_for("ppo")(cfg), str(FlowRunContext.get().flow_run.id)

    m, flow_run_id = one_stage()
    held = store.read_manifest(out)
    assert held.fingerprint == m["fingerprint"] and held.metrics["steps_done"] == held.metrics["planned_steps"] == 1
    [job] = jobs_for(ray_head, out)
    assert str(job.status.value) == "SUCCEEDED" and job.submission_id.startswith("rlhf-ppo-")
    assert job.entrypoint.startswith("rlhf-flows stage ppo --debug ") and "ray_address=\"auto\"" in job.entrypoint.replace("'", "")
    # issue 35 item 5: the CPU-only driver plans GPU bundles from the cluster's resources (not its own torch): each
    # role on its own bundle with a GPU of its own (the job's driver reserves one CPU, ray_jobs.ENTRYPOINT_CPUS, which
    # the roles' CPU shares leave out: with 2 CPUs, a placement sized on the total would never be ready)
    assert held.metrics["placement"] == {"policy0": 0, "rollout0": 1}
    gpus = held.metrics["role_gpus"]
    assert set(gpus) == {"policy0", "rollout0"} and all(len(g) == 1 for g in gpus.values())
    assert gpus["policy0"] != gpus["rollout0"]
    APILogHandler().flush()
    with get_client(sync_client=True) as c:
        messages = [e.message for e in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]
    console = capfd.readouterr().err
    assert f"launching Ray job {job.submission_id} (ppo) on {ray_head.address}" in messages
    # the job's lines, through the task's run log handler: the step line and the job CLI's report are debug
    # lines there (as a local ppo stage's), so they reach the console as they come
    assert re.search(r"^ppo step 1/1 reward [\d.-]+ kl ", console, re.M) and f"ppo committed at {out}" in console
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    assert secret not in console and not any(secret in x for x in messages) and secret not in job.entrypoint
    # a rerun finds the committed artifact: no second job
    assert ppo.run(cfg).created_at == m["created_at"] and len(jobs_for(ray_head, out)) == 1


def test_a_stage_interrupted_mid_job_stops_its_job(ray_head, inputs, s3_root):
    out = f"{s3_root}/stopped"
    policy, prompts = inputs
    args = [f"{k}={v}" for k, v in dict(policy_uri=policy, prompts_uri=prompts, output_uri=out, backend="hf",
                                        num_engines=1, best_of_n=64, max_new_tokens=64, batch_size=1,
                                        ray_address=ray_head.address).items()]
    proc = subprocess.Popen(dies_with_parent([os.path.join(VENV_BIN, "rlhf-flows"), "stage", "generate", *args]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not [j for j in jobs_for(ray_head, out) if str(j.status.value) == "RUNNING"]:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() is not None else "no RUNNING job"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # what a cancelled Prefect run or a batch system's kill sends
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        stop_session(proc, timeout=5)
    [job] = jobs_for(ray_head, out)
    deadline = time.time() + 60
    while str(ray_head.jobs.get_job_status(job.submission_id).value) not in ("STOPPED", "SUCCEEDED", "FAILED"):
        assert time.time() < deadline
        time.sleep(0.5)
    assert str(ray_head.jobs.get_job_status(job.submission_id).value) == "STOPPED"
    assert not store.committed_any(out)


@pytest.mark.parametrize("listener", ["none", "silent"])
def test_an_address_with_no_job_api_is_named_before_anything_is_written(inputs, s3_root, listener, monkeypatch):
    """Nothing listening (refused), or a socket that accepts and never answers (a dropped route would hang
    Ray's own check, which has no timeout)."""
    monkeypatch.setattr(ray_jobs, "ANSWER_TIMEOUT_S", 1.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if listener == "silent":
            sock.listen(1)
        out, address = f"{s3_root}/nowhere", f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(ray_jobs.RayJobError, match=f"ray_address {address}: no Ray job API answers there"):
            generate.run(gen_config(*inputs, out, address))
    fs, path = store.filesystem(out)
    assert not fs.exists(path)


def test_the_job_entrypoint_reads_back_as_the_same_config():
    """The job's command line (values as JSON, read back by the CLI as YAML scalars) gives the stage the very
    config the submitter validated, with ray_address=auto: floats in exponent form, quotes, newlines, tuples,
    dicts and None included."""
    import shlex

    from flows.cli import parse
    from stages import ppo
    from stages.common import load_config

    cfg = ppo.Config(policy_uri="s3://b/p", prompts_uri="s3://b/q.jsonl", output_uri="s3://b/o",
                     reward_func_path="s3://b/rf.py", actor_learning_rate=5e-7, init_kl_coef=1e-05,
                     input_template="User: {}\nAssistant's \"turn\": ", storage_options={"endpoint_url": "http://h:9000"},
                     dynamic_filtering=True, dynamic_filtering_reward_range=(-0.5, 1e-3), n_samples_per_prompt=2,
                     advantage_estimator="group_norm", ray_address="http://head:8265")
    argv = shlex.split(ray_jobs.entrypoint("ppo", cfg.model_dump(mode="json", exclude_defaults=True)))
    assert argv[:4] == ["rlhf-flows", "stage", "ppo", "--debug"]
    a = parse(argv[1:])
    back = load_config(ppo.Config, a.config, a.overrides)
    assert back == cfg.model_copy(update={"ray_address": "auto"})


def test_the_job_gets_the_store_credentials_the_hub_token_and_the_run_lock_fence_and_nothing_else(monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/keys/sa.json")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "azkey")
    monkeypatch.setenv(store.FENCE_ENV, '{"uri": "s3://b/run/_LOCK", "token": "t"}')
    monkeypatch.setenv("HF_TOKEN", "hub-token")  # the job fetches hub models with it (issue 37)
    monkeypatch.setenv("SOME_OTHER_TOKEN", "not-for-the-job")
    env = ray_jobs.job_env()
    assert {"GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_KEY", store.FENCE_ENV, "HF_TOKEN"} <= set(env)
    assert env[store.FENCE_ENV] == '{"uri": "s3://b/run/_LOCK", "token": "t"}' and env["HF_TOKEN"] == "hub-token"
    assert "SOME_OTHER_TOKEN" not in env
    assert {k for k in env if k.startswith("AWS_")} == {k for k in os.environ if k.startswith("AWS_")}
    assert all(k.startswith(("AWS_", "GOOGLE_", "AZURE_STORAGE_")) or k in (store.FENCE_ENV, *store.SECRET_ENV)
               for k in env)
