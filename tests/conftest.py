"""Shared fixtures: a real S3 endpoint (moto_server on 127.0.0.1), tiny offline models, Prefect's harness, one
local Ray per test file that runs several Ray stages, and what a pytest run builds once for all its workers.

Servers started here listen on 127.0.0.1, are stopped by pid at teardown, and also die with the test
process (PR_SET_PDEATHSIG), so none outlives a killed pytest.

Built once per pytest run (docs/testing.md): under pytest-xdist the controller starts one moto_server and makes a
folder for the run (RUN_DIR_ENV); the first worker to ask for a run-wide artifact (`run_once`: the demo run, the
trained PRM) builds it under a file lock there while the others wait, and every worker reads the same S3 objects and
JSON record. Tests only read what they share, but for the two that rerun the demo run: they go last in the group of
the tests of its own stages, and the tests elsewhere read only its inputs, SFT policy, reward model and record.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from tests.hubstub import hub_stub  # noqa: F401  (the Hugging Face hub stand-in's session fixture)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # each xdist worker its own model cache (stages share it by fingerprint)
    os.environ["RLHF_FLOWS_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                  f"rlhf-flows-cache-{os.getpid()}-{os.environ['PYTEST_XDIST_WORKER']}")
    # The workers share the cores: each worker's processes (its stages, their jobs and actors) get its share of the
    # OpenMP threads. torch's default (a thread per core) in two workers at once spins two threads per core at every
    # op's barrier, for tiny models the larger part of an op (ENV-NOTES: OMP_NUM_THREADS=1 for 2 ranks on 2 cores).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dies_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when the process that started it dies (jobs.dies_with_parent: no
    preexec_fn, which would make Popen fork() the whole pytest worker)."""
    from rlhf_core.runtime.jobs import dies_with_parent as wrapped

    return wrapped(cmd)


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a server this session started, SIGKILL if it has not exited after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------------------------------ once per pytest run
RUN_DIR_ENV = "RLHF_TEST_RUN_DIR"  # the controller's folder for what its workers share
RUN_MOTO_ENV = "RLHF_TEST_RUN_MOTO"  # "port pid" of the controller's moto_server


def start_moto() -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(dies_with_parent([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc, "moto_server")
    return proc, port


def pytest_configure(config):
    """The xdist controller (not a worker, not a run without workers): a folder and a moto_server for the run, passed
    to the workers it starts next through the environment."""
    if hasattr(config, "workerinput") or not (getattr(config.option, "numprocesses", None) or 0) \
            or RUN_DIR_ENV in os.environ:
        return
    config._rlhf_run_dir = tempfile.mkdtemp(prefix="rlhf-tests-")
    config._rlhf_moto, port = start_moto()
    os.environ[RUN_DIR_ENV] = config._rlhf_run_dir
    os.environ[RUN_MOTO_ENV] = f"{port} {config._rlhf_moto.pid}"


def pytest_unconfigure(config):
    if getattr(config, "_rlhf_moto", None) is not None:
        stop(config._rlhf_moto, 10)
        shutil.rmtree(config._rlhf_run_dir, ignore_errors=True)
        for k in (RUN_DIR_ENV, RUN_MOTO_ENV):
            os.environ.pop(k, None)


def run_once(name: str, build: Callable[[], dict]) -> dict:
    """`build()`'s JSON-able result, built once per pytest run: the first worker to ask builds it holding a file lock in
    the run's folder and records it; the others wait on the lock and read the record. Without xdist (or when the
    builder failed) this process builds it."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return build()
    record = Path(run_dir) / f"{name}.json"
    with open(Path(run_dir) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if build() raises
        if record.exists():
            return json.loads(record.read_text())
        out = build()
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        tmp.rename(record)
        return out


@pytest.fixture(scope="session")
def moto_s3():
    """A real S3 HTTP endpoint with bucket `rlhf-test` (one per pytest run under xdist: the controller's); the AWS
    variables point at it for the session."""
    shared = os.environ.get(RUN_MOTO_ENV)
    proc = None
    if shared:
        port, pid = map(int, shared.split())
    else:
        proc, port = start_moto()
        pid = proc.pid
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing-key-id",
                          AWS_SECRET_ACCESS_KEY="testing-secret-key", AWS_DEFAULT_REGION="us-east-1")
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint})
        try:
            fs.mkdir("rlhf-test")
        except Exception:
            if not fs.exists("rlhf-test"):  # else another worker made it first
                raise
        yield SimpleNamespace(endpoint=endpoint, bucket="rlhf-test", port=port, pid=pid)
    finally:
        if proc is not None:
            stop(proc, 10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_root(moto_s3) -> str:
    """A fresh prefix on the moto endpoint for one test."""
    return f"s3://{moto_s3.bucket}/{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny tokenizer, policy and reward model (local folders) built offline from seed 0, plus the same
    committed as artifacts under a local store root (`policy_uri`, `reward_uri`)."""
    from rlhf_core.demo import demo_task, tiny as tiny_mod
    from rlhf_core import store

    root = tmp_path_factory.mktemp("tiny")
    policy, reward = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri, reward_uri = str(root / "store" / "policy"), str(root / "store" / "reward")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"kind": "policy", "seed": 0})
    store.commit_model_dir(reward, reward_uri, "tiny-model", {"kind": "reward", "seed": 1})
    return SimpleNamespace(root=root, policy_dir=policy, reward_dir=reward, tokenizer_dir=root / "local" / "tokenizer",
                           policy_uri=policy_uri, reward_uri=reward_uri)


@pytest.fixture(scope="session")
def prm(tmp_path_factory):
    """A process reward model, trained once per pytest run (run_once) and read by tests/stages/test_train_prm.py and
    the RAFT loop with a PRM: the demo's tiny tokenizer with the step placeholder and reward tokens added, a random
    tiny causal LM (`base`), and train_prm's 48 steps on 384 step-labelled demo rows (`dir` = `uri`, `manifest`)."""
    def build() -> dict:
        import dataclasses

        from rlhf_core.demo import demo_task, tiny as tiny_mod
        from stages import train_prm

        run_dir = os.environ.get(RUN_DIR_ENV)
        root = Path(run_dir) / "prm" if run_dir else tmp_path_factory.mktemp("prm")
        root.mkdir(parents=True, exist_ok=True)
        tok = tiny_mod.build_tokenizer(root / "tok", demo_task.corpus(0),
                                       added_tokens=(demo_task.PLACEHOLDER, *demo_task.REWARD_TOKENS))
        base = tiny_mod.build_model(root / "base", tok, "policy", seed=0)
        rows = root / "steps.jsonl"
        rows.write_text("\n".join(json.dumps(r) for r in demo_task.step_rows(384, seed=0)))
        m = train_prm.run(train_prm.Config(base_uri=str(base), dataset_uri=str(rows), output_uri=str(root / "prm"),
                                           max_len=64, learning_rate=3e-3, train_batch_size=16, micro_train_batch_size=16,
                                           max_epochs=2, lr_warmup_ratio=0.0, zero_stage=0, log_steps=16))
        return {"base": str(base), "dir": str(root / "prm"), "manifest": dataclasses.asdict(m)}

    from rlhf_core import store

    built = run_once("prm", build)
    return SimpleNamespace(base=Path(built["base"]), dir=Path(built["dir"]), uri=built["dir"],
                           manifest=store.Manifest(**built["manifest"]))


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's real local API (temporary database) for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` on 127.0.0.1 for the session (its own PREFECT_HOME and database), stopped by
    pid at teardown. `env`: the environment for prefect commands and workers against it; `prefect(*args)` runs
    the CLI and asserts it exited 0; `worker(pool, name, log)` starts a process worker (the test stops it)."""
    home = tmp_path_factory.mktemp("prefect-server")
    bindir, port = Path(sys.executable).parent, free_port()
    env = dict(os.environ, PREFECT_HOME=str(home / "home"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    root = Path(__file__).resolve().parents[1]

    def prefect(*args, timeout=300, check=True, **kw):
        out = subprocess.run([str(bindir / "prefect"), "--no-prompt", *args], env=kw.pop("env", env), cwd=kw.pop("cwd", root),
                             capture_output=True, text=True, timeout=timeout, **kw)
        if check:
            assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout if check else out

    def worker(pool: str, name: str, log: Path, cwd: Path | None = None, extra_env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(dies_with_parent([str(bindir / "prefect"), "worker", "start", "--pool", pool, "--name", name,
                                                 "--limit", "1"]),
                                env={**env, **(extra_env or {})}, cwd=cwd or log.parent, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    proc = subprocess.Popen(dies_with_parent([str(bindir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                             str(port)]),
                            env=env, stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc, "prefect server", timeout=180)
        yield SimpleNamespace(port=port, api=f"http://127.0.0.1:{port}/api", env=env, prefect=prefect, worker=worker,
                              bindir=bindir, log=home / "server.log", pid=proc.pid)
    finally:
        stop(proc, 30)


# ------------------------------------------------------------------------------------------ one Ray per test file
class SharedRay:
    """One local Ray for the tests of a file marked `shared_ray` (a test or the file's pytestmark): a stage that finds Ray
    initialized joins it and leaves it up, so the file starts Ray once (ray.init takes 5-15 s on these 2 cores) instead
    of once per stage. Other tests find none up unless a `shared_ray` test of their file started it; their stages start
    and stop their own, as a user's do. What a test's stages started must be gone when it ends: actors (the CPUs they
    hold) and placement groups left behind shut this Ray down, so the next test starts a clean one, and fail the test
    naming them."""

    def up(self) -> None:
        import ray

        if not ray.is_initialized():
            from rlhf_core.rollout.generation import _ray_up

            _ray_up(None, object_store_bytes=400 * 1024 ** 2)  # the stages' own local Ray, with room for weight syncs

    def down(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()

    def leftovers(self, wait_s: float = 20) -> list[str]:
        """What the last test left in this Ray (an actor's CPUs are handed back a moment after it was killed)."""
        import ray

        if not ray.is_initialized():
            return []
        deadline = time.time() + wait_s
        while True:
            total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
            groups = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
            if (free >= total and not groups) or time.time() > deadline:
                break
            time.sleep(0.5)
        left = [f"{total - free:g} of {total:g} CPUs held"] if free < total else []
        return left + [f"placement group {pg['placement_group_id']} ({pg['state']})" for pg in groups]


SHARED_RAY = SharedRay()


@pytest.fixture(scope="module", autouse=True)
def _ray_per_file():
    """Each file starts without a Ray in this process; the one its `shared_ray` tests shared is shut down at its end."""
    SHARED_RAY.down()
    yield
    SHARED_RAY.down()


@pytest.fixture(autouse=True)
def _ray_per_test(request):
    """A `shared_ray` test finds the file's Ray up (started by the first such test) and must leave it as it found it;
    an `own_ray` test starts with none (it starts or joins its own)."""
    if request.node.get_closest_marker("own_ray") is not None:
        SHARED_RAY.down()
        yield
        SHARED_RAY.down()
        return
    if request.node.get_closest_marker("shared_ray") is None:
        yield
        return
    request.getfixturevalue("moto_s3")  # first: Ray's workers take the environment they start with (the S3 variables)
    SHARED_RAY.up()
    yield
    if left := SHARED_RAY.leftovers():
        SHARED_RAY.down()
        pytest.fail(f"the test left in the file's Ray: {', '.join(left)} (a stage must release what it started)")


# ------------------------------------------------------------------------------------------------ the workers' work
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker more than the cores (3 on CI's 2; pyproject's --maxprocesses caps it). A worker waits about
    a fifth of its time (a kill waiting for a checkpoint, a server's start, a poll): one worker per core left that much
    of the cores idle (1.56 of 2 cores busy on average, 1,507 s; with 3 workers 1.82 and 1,382 s, 2026-11-29)."""
    return (os.cpu_count() or 1) + 1


# pytest-xdist (`--dist loadgroup --no-loadscope-reorder`) hands each worker one group at a time, in the order below:
# the longest first (LPT: the groups that are left are short, so the workers end together). A group is a file (its
# module fixtures are built once) except in the files of SPLIT, whose tests share only run-wide fixtures: each of their
# tests is a group of its own. The order comes from pytest's slowest-tests table (--durations, docs/testing.md): a
# file missing here runs after these, in collection order.
LONGEST_FIRST = [  # seconds per group in a 3-worker run on 2 cores, 2026-11-29 (`--durations=0`)
    "flows/test_loops.py::demo",  # 201: the first to ask for the demo run builds it
    "flows/test_deployment.py",  # 464
    "stages/test_ppo.py",  # 407
    "test_gpu_scripts.py",  # 238
    "flows/test_pools.py",  # 214
    "flows/test_resume.py",  # 163
    "flows/test_ppo_flow.py",  # 155
    "flows/test_watch.py",  # 133
    "flows/test_loops.py::test_conditional_sft_learns_to_follow_its_condition_on_s3",  # 132
    "stages/test_model_zoo.py",  # 127
    "flows/test_configs.py",  # 114
    "rlhf_core/ppo/test_hybrid_moments.py",  # 111
    "stages/test_lora_zero3.py",  # 108
    "flows/test_promotion.py",  # 106
    "rlhf_core/train/test_scale.py",  # 98
    "rlhf_core/ppo/test_fake_cluster.py",  # 92
    "stages/test_ppo_lora.py",  # 78
    "rlhf_core/runtime/test_niceness.py",  # 77
    "stages/test_ray_jobs.py",  # 62
    "stages/test_multinode.py",  # 58
    "rlhf_core/ppo/test_weight_sync.py",  # 58
    "flows/test_loops.py::test_raft_with_a_process_reward_model_raises_gold_reward",  # 53
    "stages/test_pipeline_generate_score_filter.py",  # 51
    "stages/test_kto.py",  # 51
    "test_packaging.py",  # 50
    "flows/test_import_openrlhf.py",  # 48
    "flows/test_credentials.py",  # 40
    "test_slurm.py",  # 40
    "stages/test_ppo_eval.py",  # 34
    "flows/test_loops.py::test_iterative_loop_with_kto_raises_gold_reward_on_s3",  # 32
    "stages/test_ppo_distill.py",  # 31
    "rlhf_core/ppo/test_learner_step.py",  # 31
    "stages/test_sft.py",  # 30
    "flows/test_loops.py::test_raft_raises_gold_reward_on_s3",  # 29
    "flows/test_loops.py::test_raft_with_trainer_kd_distills_from_the_teacher_each_iteration",  # 28
    "stages/test_dpo.py",  # 26
    "stages/test_hub_stages.py",  # 24
    "rlhf_core/runtime/test_forkserver.py",  # 22
    "rlhf_core/store/test_versions_kept.py",  # 21
    "flows/test_loops.py",
]
SPLIT = {"test_loops.py"}
# ... but the tests of the demo run's own stages stay one group, in their file's order: the last two rerun the run.
DEMO_ITSELF = {"test_iterative_dpo_raises_gold_reward_on_s3", "test_iterative_dpo_publishes_prefect_artifacts",
               "test_rerun_resumes_without_redoing_anything", "test_changing_beta_reruns_only_dpo_and_what_follows"}
# The fast tier (`-m "not slow"`, docs/testing.md) leaves out every test that needs the demo run or a `prefect server`,
# and these runs of whole stages in a file another change owns (30-130 s each in the slowest-tests table).
SLOW_FIXTURES = {"demo_run", "prefect_server"}
SLOW_ELSEWHERE = {"flows/test_import_openrlhf.py": {"test_imported_sft_command_runs_scaled_down",
                                                    "test_imported_dpo_command_runs_scaled_down",
                                                    "test_imported_ppo_command_runs_scaled_down"}}


def _group(item) -> str:
    rel = item.path.relative_to(Path(__file__).parent).as_posix()
    if item.path.name not in SPLIT:
        return rel
    return f"{rel}::demo" if item.name in DEMO_ITSELF else f"{rel}::{item.name}"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}

    def order(item) -> int:
        g = _group(item)
        return rank.get(g, rank.get(g.split("::")[0], len(rank)))

    items.sort(key=order)  # stable: a file's tests keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or \
                getattr(item, "originalname", item.name) in SLOW_ELSEWHERE.get(_group(item).split("::")[0], ()):
            item.add_marker(pytest.mark.slow)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """Tiny random models of every architecture in rlhf_core.demo.tiny.ZOO (Llama-3, Qwen2, Mistral, Phi-3), with
    tokenizers shaped like the real ones: {arch: SimpleNamespace(policy=dir, reward=dir)} as local plain
    folders (no manifest)."""
    from rlhf_core.demo import demo_task, tiny as tiny_mod

    root = tmp_path_factory.mktemp("zoo")
    lines = demo_task.corpus(0)
    return {arch: SimpleNamespace(policy=tiny_mod.build_zoo_model(root / arch / "policy", arch, lines, "policy", seed=0),
                                  reward=tiny_mod.build_zoo_model(root / arch / "reward", arch, lines, "reward", seed=1))
            for arch in tiny_mod.ZOO}


def kill_training_jobs() -> list[int]:
    """SIGKILL every trainer job this process launched (each launcher in its own session: its whole group, the
    ranks with it); the launchers' pids."""
    from rlhf_core.runtime import jobs

    killed = []
    for pid, cmd in jobs.running().items():  # launched or forked (rlhf_core.runtime.forkserver): each its own group
        if "rlhf_core.train.entry" in cmd:
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


@pytest.fixture
def ranks_abort_at_exit(tmp_path, monkeypatch) -> None:
    """Every rank that DeepSpeed's launcher starts from this test aborts in its C-level exit (a sitecustomize on
    PYTHONPATH registers abort() with __cxa_atexit in each process run as `-m ... --local_rank=N`): what a rank does
    when a gloo thread is still joinable as c10d's objects are freed at exit. A rank that ends through the
    interpreter's teardown then exits with SIGABRT and its job fails (exit 250 from the launcher); one that leaves
    with os._exit once its work is written (rlhf_core.runtime.forkserver.leave) does not."""
    site = tmp_path / "abort-at-exit"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import ctypes, sys\n"
        "if sys.argv[:1] == ['-m'] and any(a.startswith('--local_rank=') for a in sys.argv):\n"
        "    libc = ctypes.CDLL(None)\n"
        "    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))


def reward_failing_after_a_checkpoint(path: Path, out: Path, armed: Path) -> Path:
    """A ppo reward_func file at `path`: the demo's gold reward, raising "the node went away in step 3" once a checkpoint
    is committed under `out` while the file `armed` exists (a run that dies after its checkpoint, then resumes)."""
    path.write_text(
        "from pathlib import Path\n"
        "from rlhf_core.demo.demo_task import reward_func as gold\n"
        f"OUT, ARMED = Path({str(out)!r}), Path({str(armed)!r})\n"
        "def reward_func(queries, prompts, labels):\n"
        "    if ARMED.exists() and list(OUT.glob('checkpoints/*/*.json')):\n"
        "        raise RuntimeError('the node went away in step 3')\n"
        "    return gold(queries, prompts, labels)\n")
    return path


def upload_folder(local: Path, uri: str) -> str:
    """Copy a local folder to an fsspec URI as plain files (what `aws s3 sync` of a downloaded model gives)."""
    from rlhf_core import store

    fs, path = store.filesystem(uri)
    for p in sorted(Path(local).rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{path}/{p.relative_to(local).as_posix()}")
    return uri


def tb_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars of TensorBoard event files (TFRecord framing: length, crc, Event proto, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for f in sorted(folder.rglob("events.out.tfevents.*")):
        buf = f.read_bytes()
        i = 0
        while i + 12 <= len(buf):
            (n,) = struct.unpack("<Q", buf[i:i + 8])
            if i + 12 + n + 4 > len(buf):  # a record still being written
                break
            ev = event_pb2.Event.FromString(buf[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out
