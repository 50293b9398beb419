"""The wheels a lent GPU machine needs, prepared here, and Ray's wheel split to travel over two runs (issue 36 item 6).

That machine (benchmarks/gpu/*.sh; ../shared/ENV-NOTES.md) has Python 3.12, torch + CUDA, transformers, peft,
accelerate, pandas, pyarrow, click, protobuf, grpcio, aiohttp, msgpack, pyyaml, requests, and no registry: wheels
travel with the working tree, at most 64 MiB in all per call. `prepare` fills git-ignored folders here:

  .whl/       deepspeed 0.19.8 (an sdist only: built here with `pip wheel --no-deps`, py3-none-any, ~2.1 MB), what it
              needs beyond the image (hjson, pydantic, pydantic-core, annotated-types, typing-inspection,
              typing-extensions); with --trl: trl 1.16, datasets 5.2, dill, multiprocess (~1.5 MB, TRL's side of
              benchmarks/gpu/gpu_trainers.py); with --liger: liger-kernel (issue 36 item 7)
  .ray-part0/, .ray-part1/
              with --ray: ray 2.60's manylinux wheel for Python 3.12 (79.3 MB, over the 64 MiB one call takes) cut
              into two parts under 64 MiB, and beside part 1 the wheels Ray needs that the image lacks (jsonschema,
              jsonschema-specifications, referencing, rpds-py) and `ray-wheel.json`: the wheel's name, size and
              sha256, and each part's

The parts go over in two runs in quick succession (the machine keeps the ignored files a run left while it stays
warm): the first carries .ray-part0 and stashes it (`bash benchmarks/gpu/gpu_ray.sh stash`), the second carries
.ray-part1, and `join` puts the wheel back together there, checking every part's and the whole's sha256. vLLM's CUDA
wheel (several hundred MB, and it pins its own torch) cannot travel this way: the ppo stage runs there with the HF
engine.

    .venv/bin/python benchmarks/gpu/gpu_kit.py prepare [--trl] [--liger] [--ray]     (here, in the repo root)
    python3 benchmarks/gpu/gpu_kit.py join MANIFEST DIR... --out DIR                   (there: gpu_ray.sh does it)
    python3 benchmarks/gpu/gpu_kit.py split FILE --out DIR [--max-mb 60]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PART_MB = 40  # two parts of Ray's 79 MB wheel, each with room for .whl/ and the working tree in one call
PY = ("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:")
PLATFORMS = [x for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                         "manylinux2014_x86_64", "manylinux1_x86_64") for x in ("--platform", p)]
DEEPSPEED = "deepspeed==0.19.8"
BASE = ["hjson==3.1.0", "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "typing-extensions==4.16.0"]
TRL = ["trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"]
# the release requirements/gpu-constraints.txt pins (>= 0.8.2, the roles check it): gpu_trainers.py checks
# use_liger_kernel and the log-probs against it
LIGER = [next(ln.strip() for ln in (ROOT / "requirements" / "gpu-constraints.txt").read_text().splitlines()
              if ln.startswith("liger-kernel=="))]
RAY = "ray==2.60.0"
RAY_DEPS = ["jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out: Path, max_mb: float = PART_MB) -> Path:
    """`path` cut into parts of at most `max_mb` MiB, out/<name>.part<k> each in its own folder out/../<out>-part<k>
    when out ends in -part (the kit's layout), else all in `out`; returns the manifest written beside part 0."""
    size, limit = path.stat().st_size, int(max_mb * 2 ** 20)
    parts = []
    with open(path, "rb") as f:
        k = 0
        while chunk := f.read(limit):
            folder = out.with_name(f"{out.name}{k}") if out.name.endswith("-part") else out
            folder.mkdir(parents=True, exist_ok=True)
            p = folder / f"{path.name}.part{k}"
            p.write_bytes(chunk)
            parts.append({"file": p.name, "folder": folder.name, "size": len(chunk),
                          "sha256": hashlib.sha256(chunk).hexdigest()})
            k += 1
    manifest = {"name": path.name, "size": size, "sha256": sha256(path), "parts": parts}
    first = out.with_name(f"{out.name}0") if out.name.endswith("-part") else out
    dest = first / f"{path.name}.json"
    dest.write_text(json.dumps(manifest, indent=1))
    last = out.with_name(f"{out.name}{len(parts) - 1}") if out.name.endswith("-part") else out
    if last != first:
        (last / dest.name).write_text(dest.read_text())
    return dest


def join(manifest: Path, search: list[Path], out: Path) -> Path:
    """The file the manifest describes, rebuilt in `out` from its parts (each looked for in `search`), every part's
    sha256 and the whole's checked; a missing or altered part is named."""
    m = json.loads(manifest.read_text())
    out.mkdir(parents=True, exist_ok=True)
    dest = out / m["name"]
    with open(dest, "wb") as w:
        for part in m["parts"]:
            found = next((d / part["file"] for d in search if (d / part["file"]).is_file()), None)
            if found is None:
                raise SystemExit(f"{part['file']} is in none of {[str(d) for d in search]}: carry its folder "
                                 f"({part['folder']}) in one of the two runs (benchmarks/gpu/gpu_kit.py)")
            data = found.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(f"{found}: sha256 differs from {manifest.name}'s: a stale or broken part")
            w.write(data)
    if dest.stat().st_size != m["size"] or sha256(dest) != m["sha256"]:
        raise SystemExit(f"{dest}: the joined file's size or sha256 differs from {manifest.name}'s")
    return dest


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(dest: Path, names: list[str]) -> None:
    pip("download", "--no-deps", *PY, *PLATFORMS, "-d", str(dest), *names)


def prepare(trl: bool, liger: bool, ray: bool) -> None:
    whl = ROOT / ".whl"
    whl.mkdir(exist_ok=True)
    if not list(whl.glob("deepspeed-*.whl")):
        pip("wheel", "--no-deps", "-w", str(whl), DEEPSPEED)  # an sdist: a py3-none-any wheel, ops built there (JIT)
    download(whl, BASE + (TRL if trl else []) + (LIGER if liger else []))
    if ray:
        with tempfile.TemporaryDirectory() as tmp:
            download(Path(tmp), [RAY])
            wheel = next(Path(tmp).glob("ray-*.whl"))
            for old in ROOT.glob(".ray-part*"):
                shutil.rmtree(old)
            manifest = split(wheel, ROOT / ".ray-part")
        deps = ROOT / f".ray-part{len(json.loads(manifest.read_text())['parts']) - 1}"
        download(deps, RAY_DEPS)
    ignored = subprocess.run(["git", "check-ignore", ".whl", ".ray-part0"], cwd=ROOT, capture_output=True, text=True).stdout
    if ".ray-part0" not in ignored:
        print("note: add /.ray-part*/ to .git/info/exclude (or .gitignore): the parts must be git-ignored to be carried",
              file=sys.stderr)
    for d in sorted({whl, *ROOT.glob(".ray-part*")}):
        mb = sum(f.stat().st_size for f in d.iterdir()) / 2 ** 20
        print(f"{d.name}: {mb:.1f} MiB, {len(list(d.iterdir()))} files")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fill .whl/ (and .ray-part*/) here")
    p.add_argument("--trl", action="store_true")
    p.add_argument("--liger", action="store_true")
    p.add_argument("--ray", action="store_true")
    s = sub.add_parser("split", help="cut a file into parts with a manifest")
    s.add_argument("file", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--max-mb", type=float, default=PART_MB)
    j = sub.add_parser("join", help="rebuild a file from its parts, checking sha256")
    j.add_argument("manifest", type=Path)
    j.add_argument("dirs", type=Path, nargs="+")
    j.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.trl, a.liger, a.ray)
    elif a.cmd == "split":
        print(split(a.file, a.out, a.max_mb))
    else:
        print(join(a.manifest, a.dirs, a.out))


if __name__ == "__main__":
    main()
