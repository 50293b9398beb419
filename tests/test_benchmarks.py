"""benchmarks/ is grouped by what the scripts compare, and benchmarks/run.py lists and runs a group."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_benchmark_is_in_a_group_and_listed():
    out = subprocess.run([sys.executable, "benchmarks/run.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) == ["run.py"]
    groups = [ln.rstrip("/") for ln in out.splitlines() if ln.endswith("/")]
    assert groups == ["peers", "parts", "gpu", "store", "orchestration"]
    for g in groups:
        for p in (ROOT / "benchmarks" / g).glob("*.py"):
            assert p.stem in ("trl_peer", "records") or f"  {p.name} " in out, (g, p.name)
            assert p.stem not in ("trl_peer", "records") or f"  {p.name} " not in out, (g, p.name)  # not run as one
    bad = subprocess.run([sys.executable, "benchmarks/run.py", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "no benchmark group or script 'nope'" in bad.stderr
