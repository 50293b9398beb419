"""List the benchmarks by group, or run a group (or one script) with each script's own defaults.

    .venv/bin/python benchmarks/run.py                   # the groups, their scripts and what each compares
    .venv/bin/python benchmarks/run.py peers             # every script of a group, one after another
    .venv/bin/python benchmarks/run.py parts/generate    # one script
    .venv/bin/python benchmarks/run.py store -- --rows 20000   # arguments after -- go to every script run

Groups (a folder each), by what they compare side by side in one run:
  peers          this project's trainers vs TRL's on the same CPU, same precision (TRL from its own venv)
  parts          one part of the project (learner step, rollout, scoring, weight sync...) vs a bare loop doing
                 the same work
  gpu            the GPU roles in-process at real shapes (for the lent GPU machine: gpu/gpu_smoke.sh)
  store          the artifact store (parquet, commits on a real S3 endpoint) vs plain files and s3fs
  orchestration  Prefect's overhead around the stages, and a diagnostic of the demo
Every figure goes into benchmarks/RESULTS.md with the command that made it. A script that needs what a group
does not have here (TRL's venv, a GPU) says so and exits non-zero; the run goes on and the summary names it.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ("peers", "parts", "gpu", "store", "orchestration")
SHARED = {"trl_peer", "records"}  # modules the scripts of their group import, not benchmarks


def scripts(group: str) -> list[Path]:
    return sorted(p for p in (HERE / group).iterdir()
                  if p.suffix in (".py", ".sh") and p.stem not in SHARED and not p.stem.startswith("_"))


def summary(path: Path) -> str:
    """The first sentence of a script's docstring (or of its header comment)."""
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
    else:
        doc = " ".join(ln.lstrip("# ") for ln in text.splitlines()[1:4] if ln.startswith("#"))
    first = " ".join(doc.split())
    return first.split(". ")[0][:150]


def listing() -> str:
    lines = []
    for g in GROUPS:
        lines.append(f"{g}/")
        lines += [f"  {p.name:<22} {summary(p)}" for p in scripts(g)]
    return "\n".join(lines)


def resolve(target: str) -> list[Path]:
    if target in GROUPS:
        return scripts(target)
    group, _, name = target.partition("/")
    found = [p for p in scripts(group) if p.stem == name] if group in GROUPS else []
    if not found:
        raise SystemExit(f"no benchmark group or script {target!r}; groups: {', '.join(GROUPS)} "
                         f"(or GROUP/SCRIPT, e.g. parts/generate)")
    return found


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    results = []
    for target in argv:
        for path in resolve(target):
            cmd = (["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]) + extra
            print(f"\n=== {path.relative_to(HERE.parent)} ({' '.join(cmd[2:]) or 'defaults'})", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd, cwd=HERE.parent)
            results.append((path.relative_to(HERE.parent), rc, time.time() - t0))
    print("\n=== summary")
    for path, rc, s in results:
        print(f"  {'ok    ' if rc == 0 else f'exit {rc}':<7} {s:7.1f} s  {path}")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
