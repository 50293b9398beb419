"""A stage as a Ray Job: `ray_address=http://HEAD:8265` submits the stage's own command to the cluster's job API.

Why not join the cluster from here: Prefect's Ray docs warn that a `ray://` client connection held for a long
job dies after ~30 s of network loss, and recommend Ray Jobs. A Ray Job's driver runs on the head node
whatever happens to this process's connection; here we only poll its status and logs over HTTP
(ray.job_submission.JobSubmissionClient, the API behind `ray job submit`).

What the job runs: `rlhf-flows stage NAME --debug key=value ...` with the stage's config (values as JSON, which the
CLI reads back as YAML scalars) and `ray_address=auto`, so the stage inside the job joins the cluster as its
driver, exactly as `ray_address=HEAD:6379` does from outside. So every node must have this project installed
with the same code (the fingerprint holds the code version): the image or venv the nodes run, `rlhf-flows` on
the PATH of `ray start`. No runtime_env working_dir / pip: a copy of the code per job would hide a version skew
that the fingerprint then records wrongly.

Credentials: the store's variables of this environment (AWS_*, GOOGLE_*, AZURE_STORAGE_*) go to the job as
runtime_env env_vars, never into the entrypoint or a log line; they are as visible as any `ray job submit
--runtime-env-json` to whoever can read the cluster's job API. RLHF_FLOWS_FENCE goes too, so the job's writes
are fenced by the run lock of the flow that submitted it (rlhf_core.store.check_fence).

Resources: the entrypoint reserves ENTRYPOINT_CPUS CPUs and nothing else; the stage inside asks the cluster
(ray.cluster_resources()) whether its roles run on GPUs, never its own host's torch.

Cancellation: any exception or signal here (Prefect cancels a flow run with SIGTERM, which its engine turns
into an exception; the CLI gets SystemExit from the handler set while waiting) stops the job before re-raising.
The result is read back from the store: the committed manifest with the fingerprint the submitter computed.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import threading
import time
import uuid

from rlhf_core import store

log = logging.getLogger("rlhf_flows")

STORE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_STORAGE_")
ANSWER_TIMEOUT_S = 10.0  # the job API's first answer (GET /api/version)
# The job's driver (the stage's own process) reserves one CPU and no GPU: the roles it starts reserve their GPUs in
# their placement groups, from the cluster (rlhf_core.ppo.placement.roles_on_gpus); a driver holding a GPU would
# take one from them, and one with no reservation may be placed anywhere, its CPU counted by nobody.
ENTRYPOINT_CPUS = 1


class RayJobError(RuntimeError):
    """The job API did not answer, or the job did not succeed; the message names the address and the job."""


def is_job_address(address: str | None) -> bool:
    """`http(s)://HEAD:8265` submits Ray Jobs; `HEAD:6379` / `auto` join the cluster as a driver."""
    return bool(address) and address.startswith(("http://", "https://"))


def client(address: str):
    """A job client for `address`, or a RayJobError naming it (before any work: nothing is written)."""
    import requests
    from ray.job_submission import JobSubmissionClient

    try:  # Ray's own check has no timeout: a host that drops packets would hang the stage for minutes
        requests.get(f"{address.rstrip('/')}/api/version", timeout=ANSWER_TIMEOUT_S).raise_for_status()
        return JobSubmissionClient(address)
    except Exception as e:  # refused, silent, a non-Ray HTTP server, a version mismatch
        raise RayJobError(f"ray_address {address}: no Ray job API answers there ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); start the head with its dashboard (ray start --head "
                          f"--dashboard-host 0.0.0.0, port 8265) or give HEAD:6379 to join as a driver") from None


def job_env() -> dict[str, str]:
    """The store's credentials and the run lock's fence, from this environment, for the job's env_vars."""
    names = [k for k in os.environ if k.startswith(STORE_ENV_PREFIXES)] + list(store.SECRET_ENV) + [store.FENCE_ENV]
    return {k: os.environ[k] for k in dict.fromkeys(names) if k in os.environ}


def entrypoint(stage: str, config: dict) -> str:
    """The command the job runs: the stage CLI with every set value as key=<json> (JSON is YAML). --debug: it
    prints every line (and a failure's traceback); the submitting side filters them as it does a local job's."""
    args = [f"{k}={json.dumps(v)}" for k, v in {**config, "ray_address": "auto"}.items()]
    return " ".join(["rlhf-flows", "stage", stage, "--debug", *map(shlex.quote, args)])


def run_stage(stage: str, config: dict, address: str, writer: store.ArtifactWriter, poll_s: float = 1.0) -> store.Manifest:
    """Submit `stage` with `config` (its JSON dump, defaults left out) as a Ray Job on `address`, forward its
    log lines to the `rlhf_flows` logger as they come, and return the manifest it committed where `writer`
    (the submitter's, never begun: the job writes) points, with the writer's fingerprint."""
    jobs = client(address)
    output_uri, fingerprint, storage_options = writer.uri, writer.fingerprint, writer.storage_options
    job_id = f"rlhf-{stage}-{fingerprint[:12]}-{uuid.uuid4().hex[:6]}"
    with _sigterm_exits():
        jobs.submit_job(entrypoint=entrypoint(stage, config), submission_id=job_id, runtime_env={"env_vars": job_env()},
                        metadata={"rlhf_flows_stage": stage, "output_uri": output_uri},
                        entrypoint_num_cpus=ENTRYPOINT_CPUS)
        log.info("launching Ray job %s (%s) on %s", job_id, stage, address)
        try:
            status, tail = _follow(jobs, job_id, poll_s)
        except BaseException:
            log.warning("stopping Ray job %s: the stage was interrupted", job_id)
            jobs.stop_job(job_id)
            raise
    if status != "SUCCEEDED":
        raise RayJobError(store.redact(f"Ray job {job_id} ({stage}) on {address} ended {status}: "
                                       + (jobs.get_job_info(job_id).message or "") + "; last lines:\n"
                                       + "\n".join(tail), storage_options))
    m = store.read_manifest(output_uri, storage_options=storage_options)
    if m.fingerprint != fingerprint:
        raise RayJobError(f"Ray job {job_id} succeeded but {output_uri} holds fingerprint {m.fingerprint}, not "
                          f"{fingerprint}: the cluster runs other code or settings than this host")
    return m


def _follow(jobs, job_id: str, poll_s: float) -> tuple[str, list[str]]:
    """Poll until the job ends, logging each complete new line; returns its final status and last lines."""
    done = 0
    while True:
        status = jobs.get_job_status(job_id)  # before the logs: a final status means the logs are complete
        lines = jobs.get_job_logs(job_id).split("\n")
        if not status.is_terminal():
            lines = lines[:-1]  # the last piece may be a line still being written
        for line in lines[done:]:
            if line:
                log.info("%s", line)
        done = max(done, len(lines))
        if status.is_terminal():
            return str(status.value), lines[-40:]
        time.sleep(poll_s)


class _sigterm_exits:
    """While waiting in the main thread of a process that does not handle SIGTERM itself (the CLI), SIGTERM
    raises SystemExit so the job is stopped first; Prefect's engine has its own handler and keeps it."""

    def __enter__(self):
        self.saved = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self.saved = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            signal.signal(signal.SIGTERM, self.saved)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
