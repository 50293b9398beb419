"""benchmarks/gpu/gpu_kit_run.py, the GPU kit as one prepared call (issue 44 item 5): a part past its cap is stopped
with its whole process group and keeps the records it printed; a part the budget cannot hold is skipped and named in
the JSON; the parts of both calls name scripts, plans, stages and tests that exist, their caps fit the call's budget
and the budget the device tool's 600 s; the docs give the call as the driver does. The whole call at its small size
runs in tests/test_gpu_scripts.py (every part, its figures checked by the driver: a part without them fails it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import gpu_kit_run as kit  # noqa: E402


def test_a_part_past_its_cap_is_stopped_with_its_children_and_keeps_what_it_printed(tmp_path):
    code = ("import json, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print(json.dumps({'what': 'figure', 'child': child.pid}), flush=True)\n"
            "print('{\"what\": \"cut', flush=True)\n"  # a line the cap cut: not a record
            "time.sleep(300)\n")
    part = kit.Part("sleeper", "a part that outlives its cap", [], 3)
    t0 = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        rec = kit.run_part(part, ["-c", code], 3, dict(os.environ), log)
    assert time.monotonic() - t0 < 30
    assert rec["timed_out"] and rec["rc"] is not None and rec["rc"] < 0
    assert [r["what"] for r in rec["records"]] == ["figure"]
    child = rec["records"][0]["child"]
    for _ in range(50):  # the child was in the part's process group: gone with it
        if subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True).stdout.strip() in ("", "Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's child {child} outlived the cap")
    assert "[sleeper" in (tmp_path / "log").read_text() and "tail" in rec


def test_a_part_the_budget_cannot_hold_is_skipped_and_named(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_kit_run.py"), "--small", "--only",
                           "phases", "--budget-s", "10"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_kit_call1.json").read_text())
    assert [p["name"] for p in result["parts"]] == ["phases"]
    assert result["parts"][0]["skipped"].startswith("budget: ") and "under its minimum 40 s" in result["parts"][0]["skipped"]
    assert result["env"]["device"] == "cpu" and result["small"] and result["figures"] == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_kit_call1.json", "gpu_kit_call1.log"]  # 8 come back
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_kit_run.py"), "--only", "ray"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode and "['ray'] not parts of call 1 (learner, grpo_vs_trl, trainers_vs_trl, phases)" in bad.stderr


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_every_part_names_what_exists_and_the_calls_fit_the_device_tool():
    import gpu_learner
    import gpu_trainers

    assert [p.name for p in kit.CALLS[1]] == ["learner", "grpo_vs_trl", "trainers_vs_trl", "phases"]  # by value
    assert kit.BUDGET_S + 40 <= 600  # the device tool's longest command; the install and the JSON in the margin
    for call, parts in kit.CALLS.items():
        assert sum(p.cap_s for p in parts) <= kit.BUDGET_S, call
        for p in parts:
            for args in filter(None, (p.args, p.small)):
                files = [a for a in args if a.endswith(".py")]
                assert files and all((ROOT / f).exists() for f in files), (p.name, files)
                if plan := _flag(args, "--plan"):
                    gpu_learner.parse_plan(plan)  # SystemExit naming the part of the plan that is wrong
                if stages := _flag(args, "--stages"):
                    assert set(stages.split(",")) <= set(gpu_trainers.STAGES), p.name
                if shapes := _flag(args, "--shapes"):
                    assert set(shapes.split(",")) <= {"qwen2-0.5b", "qwen2-1.5b"}, p.name
            assert p.figure and p.min_s <= p.cap_s
    doc = (ROOT / "docs" / "how-to" / "gpu.md").read_text()
    assert kit.command(1) in doc and kit.command(2) in doc
