"""GPU scripts that cannot rot (issue 41 item 5): every benchmarks/gpu/*.py with a `--small` mode runs it here, on the
CPU, as the script's header gives the command, and its JSON lines say what it measured. (gpu_weight_sync.py needs
CUDA IPC even at its small shape; gpu_kit.py is the wheel splitter, tested in test_gpu_kit.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
SMALL = {"gpu_learner.py": ["--device", "cpu", "--small"], "gpu_phases.py": ["--small"],
         "gpu_ray_stage.py": ["--device", "cpu", "--small"], "gpu_roles.py": ["--device", "cpu", "--small"],
         "gpu_rollout_after_learner.py": ["--device", "cpu", "--small"], "gpu_trainers.py": ["--device", "cpu", "--small"]}
# issue 44 item 5: GRPO beside TRL's GRPOTrainer, and the kit as one call (its parts at their small size; the driver
# fails the run when a part fails, is cut, or leaves its figure out of the JSON: tests/test_gpu_kit_run.py)
SMALL.update({"gpu_grpo_trl.py": ["--device", "cpu", "--small"], "gpu_kit_run.py": ["--small"]})
# The kit's small call runs gpu_phases.py and gpu_grpo_trl.py exactly as above and gpu_trainers.py's dpo: those are
# read from its parts (one run of each per pytest run), and gpu_trainers.py runs its other stages here.
IN_THE_KIT = {"gpu_phases.py", "gpu_grpo_trl.py"}
BESIDE_THE_KIT = {"gpu_trainers.py": ["--stages", "sft,kto,train_rm,kd,train_prm,sft_liger"]}


def test_every_gpu_script_with_a_small_mode_is_listed_here():
    with_small = {p.name for p in GPU.glob("*.py") if '"--small"' in p.read_text()}
    assert with_small == set(SMALL)


def run(name: str, tmp_path: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(GPU / name), *SMALL[name], *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, f"{name} --small: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records, f"{name} --small printed no figure"
    return records


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> dict:
    """gpu_kit_run.py --small, once: its summary line's records and its parts (each with its records)."""
    out = tmp_path_factory.mktemp("kit")
    summary = run("gpu_kit_run.py", out)
    return {"summary": summary, "parts": json.loads((out / "gpu_kit_call1.json").read_text())["parts"]}


def kit_records(kit: dict, name: str) -> list[dict]:
    """The records of the kit's part that ran `name` with SMALL's arguments, as run() returns them."""
    part = next(p for p in kit["parts"] if p.get("command") and Path(p["command"][1]).name == name)
    assert part["command"][2:] == SMALL[name], part["command"]
    assert part["rc"] == 0 and not part["timed_out"] and part["records"], part
    return part["records"]


@pytest.mark.parametrize("name", sorted(set(SMALL) - {"gpu_phases.py"}))
def test_a_gpu_scripts_small_mode_runs_on_the_cpu(name, tmp_path, kit):
    if name == "gpu_kit_run.py":
        records = kit["summary"]
    elif name in IN_THE_KIT:
        records = kit_records(kit, name)
    else:
        records = run(name, tmp_path, tuple(BESIDE_THE_KIT.get(name, ())))
    assert not [r for r in records if "error" in r], records


def test_gpu_phases_small_walks_every_moment_of_the_plan_and_the_resumed_learner_sleeps_empty(kit):
    """The moments the script measures on a GPU, each beside the plan's figure for it, a resume included; after the
    resume's sleep the learner holds its weights only (DeepSpeed's loaded offload buffers dropped)."""
    from rlhf_core.ppo import plan

    records = kit_records(kit, "gpu_phases.py")
    walked = [r["moment"] for r in records if r["what"] == "moment"]
    assert set(walked) == set(plan.MOMENTS) and walked.count("sync") == 3
    assert all(r["planned_gb"] > 0 for r in records if r["what"] == "moment")
    resumed = [r for r in records if r["what"] == "holdings"][-1]
    assert resumed["when"] == "resumed, asleep" and resumed["learner"]["optimizer"] == resumed["learner"]["grads"] == 0
