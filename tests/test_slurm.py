"""deployments/slurm/rlhf_ray.sbatch without SLURM: the script itself starts a Ray head and one worker node as
local processes (its srun steps become plain commands), waits until both are alive in the job API, and runs a
score stage command against them (the script appends ray_address=http://HEAD:PORT, so the stage runs as a Ray
Job); the job's entrypoint holds one of the head's two CPUs (entrypoint_num_cpus=1) and its two engines need a CPU
each, so the worker node (one CPU) must have joined. When the
script exits, no process it started is left."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import generate
from tests.conftest import dies_with_parent, free_port, upload_folder
from tests.stages.test_ray_jobs import VENV_BIN, fixed_ports, session_pids, stop_session

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "deployments" / "slurm" / "rlhf_ray.sbatch"


def test_the_sbatch_script_runs_a_stage_on_its_ray_nodes_without_slurm(tiny, s3_root):
    # a samples artifact to score (generated here, in-process) and the reward model, on the moto store
    samples = f"{s3_root}/samples"
    prompts = f"{s3_root}/prompts.jsonl"
    fs, path = store.filesystem(prompts)
    fs.pipe_file(path, "\n".join('{"input": "%s"}' % demo_task.prompt_for(t) for t in demo_task.THINGS[:4]).encode())
    generate.run(generate.Config(policy_uri=tiny.policy_uri, prompts_uri=prompts, output_uri=samples, backend="hf",
                                 num_engines=0, best_of_n=2, max_new_tokens=6))
    reward = upload_folder(tiny.reward_dir, f"{s3_root}/reward")
    out = f"{s3_root}/scored"

    tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    dash = free_port()
    head_ports = fixed_ports()  # each node its own ports; the two worker-port ranges apart
    worker_ports = next(w for w in iter(fixed_ports, None) if abs(int(w[-3]) - int(head_ports[-3])) > 51)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=VENV_BIN + os.pathsep + env.get("PATH", ""), RLHF_NODES="127.0.0.1 127.0.0.1",
               RAY_PORT=str(free_port()), RAY_DASHBOARD_PORT=str(dash), RAY_DASHBOARD_HOST="127.0.0.1",
               RAY_HEAD_ARGS=" ".join(["--num-cpus", "2", "--temp-dir", str(tmp / "ray"), "--ray-client-server-port",
                                       str(free_port()), "--object-store-memory", str(100 * 1024 ** 2), *head_ports]),
               RAY_WORKER_ARGS=" ".join(["--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                                         "--object-store-memory", str(100 * 1024 ** 2), *worker_ports]),
               RLHF_WORKER_DELAY_S="2", RLHF_CLUSTER_TIMEOUT_S="180", RLHF_FLOWS_CACHE=str(tmp / "cache"),
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")
    cmd = ["bash", str(SCRIPT), "rlhf-flows", "stage", "score", f"samples_uri={samples}", f"reward_model_uri={reward}",
           f"output_uri={out}", "num_engines=2"]
    proc = subprocess.Popen(dies_with_parent(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, log[-4000:]
        assert f"2 Ray nodes alive at http://127.0.0.1:{dash}" in log
        assert f"ray_address=http://127.0.0.1:{dash}" in log  # the command it ran
        assert f"score committed at {out}" in log
        m = store.read_manifest(out)
        assert m.stage == "score" and m.rows == 8
        deadline = time.time() + 60  # the script stopped its nodes (by pid) on exit: nothing of it is left
        while (left := session_pids(proc.pid)) and time.time() < deadline:
            time.sleep(1)
        assert not left, subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(map(str, left))],
                                        capture_output=True, text=True).stdout
    finally:
        stop_session(proc, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_node_refuses_an_unknown_role():
    r = subprocess.run(["bash", str(SCRIPT.parent / "ray_node.sh"), "driver", "127.0.0.1"], capture_output=True, text=True)
    assert r.returncode == 2 and "role must be head or worker, got 'driver'" in r.stderr
