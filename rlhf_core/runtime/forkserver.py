"""One-process jobs forked from a warm process, on hosts without a GPU.

A one-process trainer job (`python -u -m rlhf_core.train.entry SPEC`, rlhf_core.runtime.jobs) spends most of a short
run importing torch, transformers and DeepSpeed: about 4.5 of the ~6 CPU-seconds of a tiny sft job on these CPUs
(docs/testing.md). A pipeline of many small stages, and the test suite, pay that for every job. Here a server process
imports them once (`PRELOAD`) and forks each job from itself, as Python's multiprocessing "forkserver" does:

    run_job -> Server.spawn(argv, env, cwd) --(AF_UNIX, the job's output pipe passed along)--> server: fork()
    the forked job: own session (its pid is its process group, as a launched job's is), the job's environment, cwd,
    argv and output pipe; `runpy` runs the module as `python -m` would; its exit status goes back to run_job.

What a forked job shares with a launched one: the same module run in a process of its own, its output line by line,
a non-zero exit or a signal as the exit status, its process group killed on any exception in the caller, SIGTERM
when the server goes (the server exits when the process that started it does). What differs: `ps` shows the
server's command line for it (`python -m rlhf_core.runtime.forkserver`), and the preloads' own import warnings are in
the server's output, not the job's.

Used only where it is safe to fork after these imports: no GPU visible (CUDA cannot be used in a forked child of a
process that touched it, and a GPU job's start is small beside its run), the job's environment the one the server
was started with (libgomp, huggingface_hub and DeepSpeed read theirs at import: a job with another environment
gets a server of its own, and the idle servers of other environments stop, the variables that differ named in the log;
`VOLATILE` lists the variables nothing here reads at import). RLHF_FLOWS_FORKSERVER=0
launches every job as a new process instead.

The Ray actors of a stage that starts its own local Ray are forked the same way (`worker_executable`): Ray starts
each worker as `<runtime_env py_executable> default_worker.py ARGS`, and with py_executable
`python -m rlhf_core.runtime.forkexec --server SOCKET` that launcher hands the command, its environment and its
stdout / stderr to a server listening on SOCKET (`WORKER_PRELOAD` imported: the roles' and engines' modules) and
mirrors the forked worker's exit; the worker ends when its launcher does. A ppo role's start took ~3 of its 4.5-6
CPU-seconds on these CPUs importing torch, transformers and DeepSpeed (docs/testing.md).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("rlhf_flows")

SWITCH = "RLHF_FLOWS_FORKSERVER"
# imported once by the server (what a trainer or reference job imports before its first step)
PRELOAD = ("torch", "deepspeed", "deepspeed.ops", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "safetensors.torch", "s3fs", "pyarrow.parquet",
           "rlhf_core.train.entry", "rlhf_core.train.reference", "rlhf_core.train.methods")
# variables read while a job runs, never at import: a job whose environment differs from the server's only in these
# is forked from it (each run's lock, rlhf_core/store/fence.py; pytest names the running test in PYTEST_CURRENT_TEST;
# breakpoint() reads PYTHONBREAKPOINT at each call, and ray.init sets it in the process that starts Ray)
VOLATILE = ("RLHF_FLOWS_FENCE", "PYTEST_CURRENT_TEST", "PYTHONBREAKPOINT")
# ... and the variables of libraries the server does not import (a stage that starts Ray sets RAY_AUTH_MODE in its
# process: its later jobs are forked from the same server)
VOLATILE_PREFIXES = ("RAY_", "VLLM_")
# imported once by a Ray workers' server: what the stages' actors import before their first call. Not ray: its C++
# core reads RAY_* variables when it loads, so a worker forked after it crashes at start ("Check failed:
# !job_id_env.empty()", the server's environment having no job id)
WORKER_PRELOAD = ("torch", "deepspeed", "transformers", "transformers.models.llama.modeling_llama",
                  "transformers.models.qwen2.modeling_qwen2", "safetensors.torch", "s3fs", "pyarrow.parquet",
                  "rlhf_core.ppo.roles", "rlhf_core.ppo.engines", "rlhf_core.rollout.generation",
                  "rlhf_core.rollout.reward_model")


def wanted(cmd: list[str], env: dict) -> bool:
    """Fork this job? `python -u -m MODULE ...` with this interpreter, no GPU visible, the switch not 0."""
    if env.get(SWITCH, os.environ.get(SWITCH, "1")) == "0":
        return False
    if len(cmd) < 4 or cmd[:3] != [sys.executable, "-u", "-m"]:
        return False
    return not _gpu_visible(env)


def _gpu_visible(env: dict) -> bool:
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(name.startswith("nvidia") and name[6:].isdigit() for name in _listdir("/dev")) or \
        any(name.startswith("renderD") for name in _listdir("/dev/dri")) or os.path.exists("/dev/kfd")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE and not k.startswith(VOLATILE_PREFIXES)))


_servers: dict[tuple, "Server"] = {}
_lock = threading.Lock()


def spawn(cmd: list[str], env: dict, cwd: str | None) -> "Forked":
    """Fork `cmd` (`python -u -m MODULE ARGS`) from the server for `env` (started on first use)."""
    key = _key(env)
    with _lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            for k in [k for k, s in _servers.items() if not s.jobs]:  # idle servers (of other environments) go
                if k != key:
                    log.info("job fork server %d stopped: the next job's environment differs from its own in %s",
                             _servers[k].proc.pid, ", ".join(_changed(dict(k), dict(key))))
                _servers.pop(k).close()
            server = _servers[key] = Server(env)
    return server.spawn(cmd[3], cmd[4:], env, cwd or os.getcwd())


_worker_servers: dict[tuple, "Server"] = {}


def worker_executable(env: dict) -> str | None:
    """runtime_env `py_executable` for the Ray workers of a local Ray this process starts with `env` (its workers'
    environment but for what Ray and the actors' runtime_env add): their processes forked from a warm server for that
    environment (started here; it stops with this process). None where a job would not be forked (a GPU visible,
    RLHF_FLOWS_FORKSERVER=0)."""
    if env.get(SWITCH, os.environ.get(SWITCH, "1")) == "0" or _gpu_visible(env):
        return None
    key = _key(env)
    with _lock:
        server = _worker_servers.get(key)
        if server is None or not server.alive():
            for k in [k for k in _worker_servers if k != key]:  # one environment's workers at a time
                _worker_servers.pop(k).close()
            server = _worker_servers[key] = Server(env, listen=True)
    return f"{sys.executable} -m rlhf_core.runtime.forkexec --server {server.path}"


def _changed(a: dict, b: dict) -> list[str]:
    """The names (not the values: they may be secrets) of the variables that differ between two environments."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


class Forked:
    """A forked job as run_job sees it: pid (its process group), stdout (its output, text), wait() -> exit status
    (negative: the signal that ended it)."""

    def __init__(self, sock: socket.socket, stdout, server: "Server"):
        self._sock, self.stdout, self.returncode, self._server = sock, stdout, None, server
        self._buf = b""
        reply = self._message(None)
        if "pid" not in reply:
            raise OSError(f"the job fork server could not start the job: {reply.get('error', 'no reply')}")
        self.pid = reply["pid"]

    def _message(self, timeout: float | None) -> dict:
        self._sock.settimeout(timeout)
        while b"\n" not in self._buf:
            chunk = self._sock.recv(4096)
            if not chunk:  # the server went away with the job's status unsent: the job went with it (SIGTERM)
                return {"rc": -signal.SIGTERM}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._message(timeout)["rc"]
            except (socket.timeout, BlockingIOError):  # BlockingIOError: poll()'s timeout 0 (a non-blocking socket)
                raise subprocess.TimeoutExpired(f"forked job {self.pid}", timeout) from None
            self._sock.close()
            self._server.jobs.discard(self.pid)
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


class Server:
    """The caller's handle on one server process (started with `env`, the preloads imported there)."""

    def __init__(self, env: dict, listen: bool = False):
        """`listen`: a Ray workers' server (WORKER_PRELOAD), its launchers connecting at `self.path`."""
        import tempfile

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ctrl, self._lock, self.jobs = mine, threading.Lock(), set()  # jobs: pids of its jobs not yet reaped
        base = tempfile.gettempdir()  # an AF_UNIX path holds at most 107 bytes: a long TMPDIR gives way to /tmp
        base = base if len(base) < 64 or not os.path.isdir("/tmp") else "/tmp"
        self.path = os.path.join(tempfile.mkdtemp(prefix="rlhf-flows-workers-", dir=base), "s") if listen else ""
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.runtime.forkserver", str(theirs.fileno()),
                                      *([self.path] if listen else [])],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                     stdout=2, start_new_session=True)  # its own output (imports' warnings): stderr
        theirs.close()
        while listen and not os.path.exists(self.path) and self.proc.poll() is None:  # bound before its imports
            time.sleep(0.01)
        if listen and not os.path.exists(self.path):  # its launchers find no server and start their own interpreter
            log.warning("Ray workers' fork server %d exited before listening at %s: workers start as Ray starts them",
                        self.proc.pid, self.path)
        log.info("%s fork server %d started (preloading %s)", "Ray workers'" if listen else "job", self.proc.pid,
                 ", ".join(WORKER_PRELOAD if listen else PRELOAD))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, module: str, args: list[str], env: dict, cwd: str) -> Forked:
        r, w = os.pipe()
        mine, theirs = socket.socketpair()
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd}).encode()
        try:
            with self._lock:
                socket.send_fds(self._ctrl, [request], [w, theirs.fileno()])
        finally:
            os.close(w)
            theirs.close()
        job = Forked(mine, os.fdopen(r, "r", buffering=1), self)
        self.jobs.add(job.pid)
        return job

    def close(self) -> None:
        """Stop the server: it exits when its socket closes (jobs it forked get SIGTERM, as a launched job does
        when its launcher goes)."""
        self._ctrl.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.path:
            import shutil

            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


@atexit.register
def _close_all() -> None:
    for servers in (_servers, _worker_servers):
        for server in list(servers.values()):
            server.close()
        servers.clear()


# ---- the server process -------------------------------------------------------------------------------------------

def serve(fd: int, listen: str = "") -> None:
    """Import PRELOAD, then fork a job for each request on socket `fd` until it closes; each job's pid, then its
    exit status, go back on the job's own socket. `listen`: a Ray workers' server (WORKER_PRELOAD) that also forks
    a worker for each launcher connecting at that path (its request on the connection, then its pid and status)."""
    import importlib

    ctrl = socket.socket(fileno=fd)
    lsock = None
    if listen:  # listening before the imports: a launcher that connects meanwhile waits in the backlog
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(listen)
        lsock.listen(64)
    # the jobs start from a fresh interpreter's signal handlers plus what the preloads install, as a launched job
    # does (a no-op in the server's own process; serve() run in another program's process sets that one's aside)
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals() if callable(signal.getsignal(sig))}
    for sig in handlers:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for name in WORKER_PRELOAD if listen else PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional dependency missing here: the job imports (and fails on) it itself
            print(f"rlhf-flows fork server: not preloaded {name}: {e!r}", file=sys.stderr, flush=True)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    old_handler = signal.signal(signal.SIGCHLD, lambda *_: None)
    old_wakeup = signal.set_wakeup_fd(wake_w)
    running: dict[int, socket.socket] = {}
    try:
        while True:
            ready = _select([ctrl, wake_r, *([lsock] if lsock else [])])
            if wake_r in ready:
                os.read(wake_r, 4096)
            _reap(running)
            jobs = []  # (request, its descriptors, the socket its pid and status go back on)
            if ctrl in ready:
                msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 22, 2)
                if not msg:  # the caller closed its end or exited
                    break
                jobs.append((json.loads(msg), fds[:1], socket.socket(fileno=fds[1])))
            if lsock is not None and lsock in ready:
                conn, fds, msg = None, [], b""
                try:  # a launcher that went away mid-request costs its worker only, never the server
                    conn, _ = lsock.accept()
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)  # the worker's stdout, stderr and lifeline
                except OSError:
                    pass
                if msg and len(fds) == 3:
                    jobs.append((json.loads(msg), fds, conn))
                else:
                    for f in fds:
                        os.close(f)
                    if conn is not None:
                        conn.close()
            for req, fds, sock in jobs:
                keep = (ctrl.fileno(), wake_r, wake_w, *([lsock.fileno()] if lsock else []))
                pid = os.fork()
                if pid == 0:
                    _run_child(req, fds, closing=(*keep, sock.fileno(), *(s.fileno() for s in running.values())))
                for f in fds:
                    os.close(f)
                running[pid] = sock
                try:
                    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                except OSError:  # its caller is gone: so is the job (the child may not have its own group yet)
                    os.kill(pid, signal.SIGTERM)
    finally:
        for pid, sock in running.items():  # the caller is gone: so are its jobs (a launched job's guard does the same)
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            sock.close()
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGCHLD, old_handler)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)
        ctrl.close()
        if lsock is not None:
            lsock.close()


def _select(fds: list) -> list:
    while True:
        try:
            return select.select(fds, [], [])[0]
        except InterruptedError:
            continue


def _reap(running: dict) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = running.pop(pid, None)
        if sock is not None:
            try:
                sock.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            sock.close()


def _run_child(req: dict, fds: list[int], closing: tuple) -> None:
    """In the forked child: become the job (session, death signal, output, cwd, environment, argv), run its module as
    `python -u -m` does (a Ray worker: its script as `python SCRIPT` does) and exit with its status. `fds`: the job's
    output, or a worker's stdout, stderr and lifeline (the worker ends when its launcher does). Never returns."""
    import ctypes
    import io
    import random
    import runpy
    import traceback
    import warnings

    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        server = os.getppid()
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the server's death ends it
        except (OSError, AttributeError):
            pass
        if os.getppid() != server:
            os._exit(1)
        for fd in closing:
            os.close(fd)
        os.dup2(fds[0], 1)
        os.dup2(fds[-2] if len(fds) == 3 else fds[0], 2)
        for fd in fds[:2]:
            os.close(fd)
        if len(fds) == 3:
            threading.Thread(target=_lifeline, args=(fds[2],), daemon=True).start()
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        random.seed()
        try:
            if "script" in req:  # a Ray worker: `python SCRIPT ARGS` puts the script's folder first
                if os.environ.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:  # Ray sets it per
                    # worker; OpenMP read the server's at its start (the server ran no parallel region: safe here)
                    sys.modules["torch"].set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
                sys.path[0] = os.path.dirname(req["script"])
                sys.argv = [req["script"], *req["args"]]
                runpy.run_path(req["script"], run_name="__main__")
            else:
                sys.path[0] = req["cwd"]  # `python -m` puts the working directory first
                sys.argv = [req["module"], *req["args"]]
                # the server imported the module already (PRELOAD); running it as __main__ is what `python -m` does
                warnings.filterwarnings("ignore", message=".* found in sys.modules after import of package",
                                        category=RuntimeWarning)
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
    except BaseException:
        traceback.print_exc()
    finally:
        leave(code)


def _lifeline(fd: int) -> None:
    """A forked Ray worker's watch on its launcher: the pipe's end closes when the launcher exits, however it ends
    (Ray may SIGKILL the process it started), and the worker goes with it."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def leave(code: int = 0) -> None:
    """End this process as the interpreter's exit would, without its teardown: wait for the non-daemon threads, run
    the atexit functions (weakref finalizers, temporary folders), flush stdout and stderr, then `os._exit(code)`.
    A forked job must not run the server's teardown; a training rank that is done (its results written, every rank
    past the last barrier) is spared the freeing of c10d's C++ objects at exit, where a gloo thread still joinable
    aborts a finished rank ("terminate called without an active exception", exit 250 from DeepSpeed's launcher: seen
    in a 2-rank AutoTP sft job and a 2-rank reference pass on these CPUs). Never returns."""
    try:
        try:
            threading._shutdown()
            atexit._run_exitfuncs()  # prints a failing function's error and goes on, as the interpreter's exit does
        except BaseException:
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
