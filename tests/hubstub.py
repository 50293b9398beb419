"""A Hugging Face hub stand-in for tests: a small HTTP server on 127.0.0.1 that answers what huggingface_hub
2.4 calls (ENV-NOTES "A Hugging Face hub stand-in for tests") for repos kept as folders on disk:

    GET  /api/{models|datasets}/{repo}[/revision/{rev}]      repo info: sha, siblings (with sizes: ?blobs=true)
    GET  /api/.../{repo}/tree/{rev}[/{path}]?recursive=     the file list snapshot_download reads
    POST /api/.../{repo}/paths-info/{rev}                   HfFileSystem.info
    HEAD/GET /{repo}/resolve/{rev}/{file}, /datasets/{repo}/resolve/...   X-Repo-Commit, ETag, Range -> 206

Errors carry the hub's X-Error-Code: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo (401 without a
token, 403 with another one). No X-Xet-* header is sent, so the client stays on plain HTTP.

State lives on disk and is re-read on every request, so a test changes the hub by calling `HubStub.add`
(a new commit, a moved branch) while the server runs:
    {root}/{kind}s/{org}/{name}/commits/{sha}/...   one folder per commit
    {root}/{kind}s/{org}/{name}/refs/{branch}       the branch's commit sha
    {root}/{kind}s/{org}/{name}/gated               the one token granted access
    {root}/requests.jsonl                           every request: method, path, status, whether a token came

`hub_stub` (session) starts it for the session's tiny models (tests/conftest.py imports the fixture); the
server dies with the test process (PR_SET_PDEATHSIG) and is stopped by pid at teardown. `use_hub(...)`
points this process's huggingface_hub (which reads its environment once, at import) and the environment of
child processes at the stand-in, with a fresh HF_HOME.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

GATED_TOKEN = "hf_stubGrantedToken0123456789"


# ---------------------------------------------------------------------------------------------- the server
def _resolve(repo_dir: Path, rev: str) -> str | None:
    ref = repo_dir / "refs" / rev
    if ref.is_file():
        return ref.read_text().strip()
    return rev if (repo_dir / "commits" / rev).is_dir() else None


def _files(commit: Path) -> list[str]:
    return sorted(p.relative_to(commit).as_posix() for p in commit.rglob("*") if p.is_file())


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _entry(commit: Path, rel: str) -> dict:
    p = commit / rel
    if p.is_dir():
        return {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()}
    return {"type": "file", "path": rel, "size": p.stat().st_size, "oid": _sha256(p)[:40]}


class Handler(BaseHTTPRequestHandler):
    root: Path

    def log_message(self, *args):  # the request log below replaces stderr lines
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, error_code: str | None = None):
        with open(self.root / "requests.jsonl", "a") as f:  # logged before answering: a test reads it right after
            f.write(json.dumps({"method": self.command, "path": self.path, "status": status,
                                "token": bool(self.headers.get("Authorization"))}) + "\n")
        self.send_response(status)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if error_code:
            hdrs["X-Error-Code"] = error_code
            hdrs["X-Error-Message"] = error_code
        hdrs.setdefault("Content-Length", str(len(body)))
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data, status: int = 200):
        self._send(status, json.dumps(data).encode())

    def _fail(self, status: int, code: str):
        self._send(status, json.dumps({"error": code}).encode(), error_code=code)

    def _repo(self, kind: str, repo: str) -> Path | None:
        """The repo's folder, or None after answering 404 / the gated refusal."""
        d = self.root / kind / repo
        if not (d / "refs").is_dir():
            self._fail(404, "RepoNotFound")
            return None
        gated = d / "gated"
        if gated.exists():
            auth = self.headers.get("Authorization", "")
            if not auth:
                self._fail(401, "GatedRepo")
                return None
            if auth != f"Bearer {gated.read_text().strip()}":
                self._fail(403, "GatedRepo")
                return None
        return d

    def do_HEAD(self):
        self.do_GET()

    def do_POST(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        query = urllib.parse.parse_qs(url.query)
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            return self._api(parts[1], "/".join(parts[2:4]), parts[4:], query)
        kind = "datasets" if parts[0] == "datasets" else "models"
        parts = parts[1:] if kind == "datasets" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._download("/".join(parts[:2]), kind, parts[3], "/".join(parts[4:]))
        self._fail(404, "EntryNotFound")

    def _api(self, kind: str, repo: str, rest: list[str], query: dict):
        d = self._repo(kind, repo)
        if d is None:
            return
        rev = rest[1] if len(rest) >= 2 else "main"
        sha = _resolve(d, rev)
        if sha is None:
            return self._fail(404, "RevisionNotFound")
        commit = d / "commits" / sha
        if not rest or rest[0] == "revision":
            siblings = []
            for rel in _files(commit):
                size = (commit / rel).stat().st_size
                siblings.append({"rfilename": rel, "size": size, "blobId": _sha256(commit / rel)[:40],
                                 "lfs": {"size": size, "sha256": _sha256(commit / rel), "pointerSize": 134}})
            return self._json({"id": repo, "sha": sha, "private": False, "gated": "auto" if (d / "gated").exists() else False,
                               "disabled": False, "siblings": siblings})
        if rest[0] == "tree":
            sub = "/".join(rest[2:])
            base = commit / sub
            if not base.is_dir():
                return self._fail(404, "EntryNotFound")
            recursive = query.get("recursive", ["False"])[0].lower() == "true"
            found = sorted(base.rglob("*") if recursive else base.iterdir())
            return self._json([_entry(commit, p.relative_to(commit).as_posix()) for p in found])
        if rest[0] == "paths-info":
            length = int(self.headers.get("Content-Length") or 0)
            form = urllib.parse.parse_qs(self.rfile.read(length).decode()) if length else {}
            paths = form.get("paths", [])
            return self._json([_entry(commit, p) for p in paths if (commit / p).exists()])
        self._fail(404, "EntryNotFound")

    def _download(self, repo: str, kind: str, rev: str, rel: str):
        d = self._repo(kind, repo)
        if d is None:
            return
        sha = _resolve(d, rev)
        if sha is None:
            return self._fail(404, "RevisionNotFound")
        p = d / "commits" / sha / rel
        if not p.is_file():
            return self._fail(404, "EntryNotFound")
        data = p.read_bytes()
        headers = {"X-Repo-Commit": sha, "ETag": f'"{_sha256(p)}"', "Content-Type": "application/octet-stream",
                   "Accept-Ranges": "bytes"}
        status, rng = 200, self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start, _, end = rng[6:].partition("-")
            start, end = int(start or 0), int(end) if end else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        self._send(status, data, headers)


def serve(root: str, port: int) -> None:
    Handler.root = Path(root)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


# ---------------------------------------------------------------------------------------------- the test side
class HubStub:
    """The running stand-in: `url`, `add` a commit, read the `requests` it answered."""

    def __init__(self, root: Path, url: str, pid: int):
        self.root, self.url, self.pid = root, url, pid

    def add(self, repo: str, src: Path | dict[str, bytes | str], kind: str = "model", branch: str = "main",
            gated: bool = False) -> str:
        """Commit `src` (a folder, or {path: content}) as the new head of `branch` of `repo`: its sha."""
        files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(Path(src).rglob("*")) if p.is_file()} \
            if isinstance(src, Path) else {k: v.encode() if isinstance(v, str) else v for k, v in src.items()}
        d = self.root / f"{kind}s" / repo
        parent = _resolve(d, branch) if (d / "refs").is_dir() else None
        h = hashlib.sha1(f"{repo}|{parent}".encode())
        for rel in sorted(files):
            h.update(rel.encode() + hashlib.sha256(files[rel]).digest())
        sha = h.hexdigest()
        tmp = d / "commits" / f".{sha}"
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        if not (d / "commits" / sha).exists():
            tmp.rename(d / "commits" / sha)
        shutil.rmtree(tmp, ignore_errors=True)
        (d / "refs").mkdir(parents=True, exist_ok=True)
        (d / "refs" / branch).write_text(sha)
        if gated:
            (d / "gated").write_text(GATED_TOKEN)
        return sha

    def requests(self) -> list[dict]:
        log = self.root / "requests.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def use_hub(hub: HubStub | None, monkeypatch, home: Path, offline: bool = False, token: str | None = None) -> dict:
    """Point the environment at the stand-in (or, with `hub` None, at a closed port) with HF_HOME `home`, as a
    user's shell would: for child processes, and for this process's code, which reads it when a stage runs.
    huggingface_hub read HF_HUB_OFFLINE and its token file's place once, at import (the conftest sets
    HF_HUB_OFFLINE=1 for every other test): those two are set on it too. Returns the variables."""
    from huggingface_hub import constants

    env = {"HF_ENDPOINT": hub.url if hub else "http://127.0.0.1:9", "HF_HOME": str(home),
           "HF_HUB_OFFLINE": "1" if offline else "0", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           # stray requests (a datasets-server probe) go to a closed local port, never out
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # never a developer's own login
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    return env


@pytest.fixture(scope="session")
def hub_stub(tmp_path_factory, tiny):
    """The hub stand-in, serving the session's tiny models as `tiny-org/policy` (and gated: `tiny-org/gated-policy`,
    token GATED_TOKEN) and a small dataset `tiny-org/sft-data` (parquet train / test splits, HF's data/ layout)."""
    from tests.conftest import dies_with_parent, free_port, stop, wait_for_port

    root = tmp_path_factory.mktemp("hubstub")
    port = free_port()
    proc = subprocess.Popen(dies_with_parent([sys.executable, __file__, str(root), str(port)]), stdout=subprocess.DEVNULL,
                            stderr=open(root / "server.err", "w"))
    try:
        wait_for_port(port, proc, "hub stand-in")
        hub = HubStub(root, f"http://127.0.0.1:{port}", proc.pid)
        hub.add("tiny-org/policy", Path(tiny.policy_dir))
        hub.add("tiny-org/gated-policy", Path(tiny.policy_dir), gated=True)
        hub.add("tiny-org/sft-data", sft_dataset(), kind="dataset")
        yield hub
    finally:
        stop(proc, 10)


def sft_dataset(n_train: int = 16, n_test: int = 4) -> dict[str, bytes]:
    """A small dataset repo in the hub's layout: data/{train,test}-00000-of-00001.parquet, OpenOrca's keys."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.demo import demo_task

    out = {"README.md": "---\nlicense: mit\n---\n# tiny sft data\n"}
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        rows = [{"question": r["input"], "response": r["output"]} for r in demo_task.sft_rows(n, seed)]
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        out[f"data/{split}-00000-of-00001.parquet"] = buf.getvalue()
    return out


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
