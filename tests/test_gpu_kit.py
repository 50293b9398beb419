"""benchmarks/gpu/gpu_kit.py: a wheel cut into parts (each in its own folder, to travel in separate runs to the lent
GPU machine) comes back byte for byte, installs, and a missing or altered part is named (issue 36 item 6)."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "benchmarks" / "gpu" / "gpu_kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def make_wheel(folder: Path, payload_mb: float) -> Path:
    """A real py3-none-any wheel of a module `kitprobe` carrying `payload_mb` MiB of incompressible data."""
    name, ver = "kitprobe", "1.0"
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{name}/blob.bin": os.urandom(int(payload_mb * 2 ** 20)),
             f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n".encode(),
             f"{name}-{ver}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
              for p, b in files.items()] + [f"{name}-{ver}.dist-info/RECORD,,"]
    path = folder / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{name}-{ver}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_a_split_wheel_joins_byte_for_byte_and_installs(tmp_path):
    wheel = make_wheel(tmp_path, 2.5)
    manifest = kit.split(wheel, tmp_path / "kit" / ".ray-part", max_mb=1)  # 3 parts, a folder each
    folders = sorted(p.name for p in (tmp_path / "kit").iterdir())
    assert folders == [".ray-part0", ".ray-part1", ".ray-part2"]
    assert all((tmp_path / "kit" / f / f"{wheel.name}.part{k}").stat().st_size <= 2 ** 20 for k, f in enumerate(folders))
    assert (tmp_path / "kit" / ".ray-part2" / manifest.name).read_text() == manifest.read_text()  # beside the last too
    out = kit.join(manifest, [tmp_path / "kit" / f for f in folders], tmp_path / "joined")
    assert out.read_bytes() == wheel.read_bytes()
    subprocess.run([sys.executable, "-m", "zipfile", "-t", str(out)], check=True, capture_output=True)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), str(out)], check=True, capture_output=True)
    probe = subprocess.run([sys.executable, "-c", "import kitprobe; print(kitprobe.VALUE)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.stdout.strip() == "42"


def test_a_missing_or_altered_part_is_named(tmp_path):
    wheel = make_wheel(tmp_path, 1.5)
    manifest = kit.split(wheel, tmp_path / ".ray-part", max_mb=1)
    with pytest.raises(SystemExit, match=r"\.part1 is in none of .*carry its folder \(\.ray-part1\)"):
        kit.join(manifest, [tmp_path / ".ray-part0"], tmp_path / "out")
    part = tmp_path / ".ray-part1" / f"{wheel.name}.part1"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"part1: sha256 differs"):
        kit.join(manifest, [tmp_path / ".ray-part0", tmp_path / ".ray-part1"], tmp_path / "out")
