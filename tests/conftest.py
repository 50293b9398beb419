"""Shared fixtures: a real S3 endpoint (moto_server on 127.0.0.1), tiny offline models, Prefect's harness.

Servers started here listen on 127.0.0.1, are stopped by pid at teardown, and also die with the test
process (PR_SET_PDEATHSIG), so none outlives a killed pytest.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent():
    """preexec_fn: the child gets SIGTERM when the process that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


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


@pytest.fixture(scope="session")
def moto_s3():
    """A real S3 HTTP endpoint with bucket `rlhf-test`; the AWS variables point at it for the session."""
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    try:
        wait_for_port(port, proc, "moto_server")
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing-key-id",
                          AWS_SECRET_ACCESS_KEY="testing-secret-key", AWS_DEFAULT_REGION="us-east-1")
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint}).mkdir("rlhf-test")
        yield SimpleNamespace(endpoint=endpoint, bucket="rlhf-test", port=port, pid=proc.pid)
    finally:
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
        return subprocess.Popen([str(bindir / "prefect"), "worker", "start", "--pool", pool, "--name", name, "--limit", "1"],
                                env={**env, **(extra_env or {})}, cwd=cwd or log.parent, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent, start_new_session=True)

    proc = subprocess.Popen([str(bindir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=open(home / "server.log", "w"), stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)
    try:
        wait_for_port(port, proc, "prefect server", timeout=180)
        yield SimpleNamespace(port=port, api=f"http://127.0.0.1:{port}/api", env=env, prefect=prefect, worker=worker,
                              bindir=bindir, log=home / "server.log", pid=proc.pid)
    finally:
        stop(proc, 30)


LOOPS_GROUP = {"test_loops.py", "test_pools.py", "test_watch.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    # pytest-xdist (`--dist loadgroup`): a test file stays on one worker (its module fixtures are built once).
    # The files that use the session's demo run (or its prefect server) form two groups of about equal work, each
    # group's worker training the demo once: the loops with two of the server tests, and the rest.
    demo_files = {item.path for item in items if {"demo_run", "prefect_server"} & set(getattr(item, "fixturenames", ()))}
    for item in items:
        group = str(item.path)
        if item.path in demo_files:
            group = "demo-loops" if item.path.name in LOOPS_GROUP else "demo-other"
        item.add_marker(pytest.mark.xdist_group(group))
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
