"""`python -m rlhf_core.runtime.forkexec --server SOCKET SCRIPT ARGS...`: run `python SCRIPT ARGS` forked from the
warm server listening at SOCKET (rlhf_core.runtime.forkserver.worker_executable: Ray's `py_executable` for the
workers of a local Ray), or, when no server answers there, exec it as a new interpreter.

This process stays as the worker's stand-in for whoever started it (Ray's raylet): the worker writes to this
process's stdout and stderr, SIGTERM / SIGINT / SIGHUP sent here go to the worker, this process exits with the
worker's status, and the worker ends when this process does, however it ends (its lifeline pipe closes).
Kept to the standard library: this is the start of every worker."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys


def _exec(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--server":
        sys.exit("usage: python -m rlhf_core.runtime.forkexec --server SOCKET SCRIPT [ARGS...]")
    path, script, args = argv[1], argv[2], argv[3:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no server (it stopped, or this is another machine): a worker of its own
        conn.close()
        _exec([script, *args])
    life_r, life_w = os.pipe()  # life_w stays here only: the worker's read end sees EOF when this process is gone
    request = json.dumps({"script": os.path.abspath(script), "args": args, "env": dict(os.environ), "cwd": os.getcwd()})
    try:
        socket.send_fds(conn, [request.encode()], [1, 2, life_r])
        os.close(life_r)
        replies = conn.makefile("rb")
        pid = _message(replies).get("pid")
    except OSError:
        pid = None
    if pid is None:  # the server went away before it forked: a worker of its own
        conn.close()
        os.close(life_w)
        _exec([script, *args])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: _forward(pid, s))
    rc = _message(replies).get("rc", -signal.SIGKILL)  # the server gone with the worker's status unsent: it went too
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        rc = 128 - rc
    sys.exit(rc)


def _forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _message(replies) -> dict:
    line = replies.readline()  # a signal forwarded meanwhile does not interrupt it (PEP 475)
    return json.loads(line) if line.endswith(b"\n") else {}


if __name__ == "__main__":
    main(sys.argv[1:])
