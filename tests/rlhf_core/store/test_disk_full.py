"""The local store's disk full: a size-limited folder (a 512 KiB tmpfs in a private mount namespace; where
mounting is not allowed, a 512 KiB file-size limit) gives a clear error and commits nothing; the previous
version stays readable."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, resource, signal, sys
    import pyarrow as pa
    from rlhf_core import store
    from rlhf_core.store import versions
    if sys.argv[2] == "rlimit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, 512 * 1024))
    uri = sys.argv[1] + "/ds"
    w = store.ArtifactWriter(uri, "prepare", {"v": 1})
    w.begin(); w.write_table("rows.parquet", pa.table({"x": ["small"] * 10})); v1 = w.commit()
    w = store.ArtifactWriter(uri, "prepare", {"v": 2})
    w.begin()
    try:
        w.write_table("rows.parquet", pa.table({"x": [os.urandom(512).hex() for _ in range(2000)]}))  # ~2 MB
        w.commit()
        print("NO ERROR")
    except store.ArtifactError as e:
        print("ERROR", e)
    try:
        store.read_manifest(uri)
        print("COMMITTED")
    except store.NotCommittedError:
        print("NOT COMMITTED")
    print("KEPT", [m.fingerprint for m in versions.versions(uri)] == [v1.fingerprint],
          store.read_table(f"{uri}/_versions/{v1.fingerprint}").num_rows)
""")


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    d = tmp_path / "disk"
    d.mkdir(exist_ok=True)
    if how == "tmpfs":
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        cmd = unshare + ["sh", "-c", f"mount -t tmpfs -o size=512k tmpfs {d} && exec \"$@\"", "sh",
                         sys.executable, "-c", SCRIPT, str(d), how]
    else:
        cmd = [sys.executable, "-c", SCRIPT, str(d), how]
    root = str(Path(__file__).resolve().parents[2])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))


def test_full_disk_is_a_clear_error_and_nothing_is_committed(tmp_path):
    r = _run(tmp_path, os.environ.get("RLHF_TEST_DISK_FULL", "tmpfs"))
    if "mount" in r.stderr or "unshare" in r.stderr:  # no mount namespace here: limit the file size instead
        r = _run(tmp_path, "rlimit")
    out = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERROR " in out and "/ds: no space left writing rows.parquet (" in out and "nothing was committed" in out, out
    assert "NOT COMMITTED" in out and "KEPT True 10" in out, out
