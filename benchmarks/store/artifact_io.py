"""Write + read 100k `scored` sample rows as parquet (this project's format, through rlhf_core.store) vs
JSONL (OpenRLHF's format), on local disk and on a real S3 endpoint (moto_server on 127.0.0.1), in one run.

    .venv/bin/python benchmarks/store/artifact_io.py [--rows 100000] [--repeats 3]

Prints a markdown table (median of the repeats) with times, bytes and parquet/JSONL ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlhf_core.inputs import data  # noqa: E402
from rlhf_core.demo import demo_task
from rlhf_core import store


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = demo_task.prompt_for(rng.choice(demo_task.THINGS)) + " " + " ".join(
            rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(5, 30)))
        response = " ".join(demo_task.random_review(rng) for _ in range(rng.randint(1, 6)))
        rows.append({"prompt": prompt, "response": response, "sample_index": i % 4, "prompt_tokens": len(prompt) // 4,
                     "response_tokens": len(response) // 4, "finish_reason": "stop", "logprob": -rng.random() * 40,
                     "reward": rng.gauss(0, 1)})
    return rows


def parquet_roundtrip(rows: list[dict], uri: str) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    w = store.ArtifactWriter(uri, "bench", {"rows": len(rows)})
    w.begin()
    w.write_table("scored.parquet", data.to_table(rows, "scored"))
    m = w.commit()
    t1 = time.perf_counter()
    back = store.read_table(uri).to_pylist()
    t2 = time.perf_counter()
    assert len(back) == len(rows) and back[-1]["response"] == rows[-1]["response"]
    return t1 - t0, t2 - t1, sum(f["size"] for f in m.files)


def jsonl_roundtrip(rows: list[dict], uri: str) -> tuple[float, float, int]:
    fs, path = store.filesystem(uri)
    t0 = time.perf_counter()
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/data.jsonl", "w") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    t1 = time.perf_counter()
    with fs.open(f"{path}/data.jsonl", "r") as f:
        back = [json.loads(line) for line in f.read().splitlines()]
    t2 = time.perf_counter()
    assert len(back) == len(rows) and back[-1]["response"] == rows[-1]["response"]
    return t1 - t0, t2 - t1, fs.size(f"{path}/data.jsonl")


def start_moto() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.2)
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint}).mkdir("bench-bucket")
    return proc, endpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = make_rows(a.rows)
    proc, endpoint = start_moto()
    try:
        results = []
        with tempfile.TemporaryDirectory() as tmp:
            for where, root in (("local disk", tmp), ("S3 (moto_server)", "s3://bench-bucket")):
                for fmt, fn in (("parquet (zstd)", parquet_roundtrip), ("JSONL", jsonl_roundtrip)):
                    runs = [fn(rows, f"{root}/{uuid.uuid4().hex[:8]}") for _ in range(a.repeats)]
                    results.append((where, fmt, statistics.median(r[0] for r in runs),
                                    statistics.median(r[1] for r in runs), runs[0][2]))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"{a.rows:,} scored rows, median of {a.repeats}\n")
    print("| where | format | write s | read s | write+read s | bytes |")
    print("|---|---|---|---|---|---|")
    for where, fmt, w, r, b in results:
        print(f"| {where} | {fmt} | {w:.2f} | {r:.2f} | {w + r:.2f} | {b:,} |")
    print("\n| where | parquet speed-up (write+read) | JSONL bytes / parquet bytes |")
    print("|---|---|---|")
    for i in range(0, len(results), 2):
        pq_, js = results[i], results[i + 1]
        print(f"| {pq_[0]} | {(js[2] + js[3]) / (pq_[2] + pq_[3]):.1f}x | {js[4] / pq_[4]:.1f}x |")


if __name__ == "__main__":
    main()
