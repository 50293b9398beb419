"""URIs, credentials kept out of options and messages (`check_no_secrets`, `redact`), fsspec filesystems with
short S3 timeouts, and a reachability check that fails in seconds."""
from __future__ import annotations

import os

import fsspec

from rlhf_core.store.errors import StoreUnreachableError


def join(uri: str, *parts: str) -> str:
    out = str(uri).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def run_prefix(root: str, run_name: str, stage: str, iteration: int | None = None) -> str:
    """`{root}/{run_name}/iter-{k}/{stage}` inside a loop, `{root}/{run_name}/{stage}` outside."""
    if iteration is None:
        return join(root, run_name, stage)
    return join(root, run_name, f"iter-{iteration}", stage)


SECRET_KEYS = {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
               "aws_session_token", "session_token", "access_key", "secret_key", "account_key", "sas_token",
               "connection_string", "credentials", "token_file"}
# + names a credentials block set; the hub token (rlhf_core/inputs/hub.py) too: redacted from every message, and
# passed to a Ray Job's environment (runtime.ray_jobs.job_env) so the job fetches the hub models its config names
SECRET_ENV = ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]


def check_no_secrets(options: dict | None, where: str = "storage_options") -> dict:
    """Refuse credentials in `options` (nested dicts too), naming the keys: they belong in the environment."""
    found = []

    def walk(d, prefix):
        for k, v in (d or {}).items():
            if str(k).lower() in SECRET_KEYS:
                found.append(prefix + str(k))
            elif isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
    walk(options, f"{where}.")
    if found:
        raise ValueError(f"{', '.join(found)}: credentials are not accepted here (parameters are stored by Prefect "
                         f"and shown in its UI); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment of "
                         f"the process or worker, or name a Prefect Secret block in credentials_block")
    return options or {}


def _secrets(storage_options: dict | None) -> list[str]:
    vals = [os.environ.get(k, "") for k in SECRET_ENV]
    for k in ("secret", "key", "token"):
        vals.append(str((storage_options or {}).get(k, "")))
    return [v for v in vals if len(v) >= 4]


def redact(text: str, storage_options: dict | None = None) -> str:
    for s in _secrets(storage_options):
        text = text.replace(s, "***")
    return text


def redact_error(e: BaseException, storage_options: dict | None = None) -> BaseException:
    """`e` itself when no message in its chain holds a secret, else a RuntimeError carrying the redacted
    type and message of each link (raise it `from None`: the originals must not travel on)."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = " <- ".join(f"{type(x).__name__}: {x}" for x in chain)
    if redact(text, storage_options) == text:
        return e
    return RuntimeError(redact(text, storage_options))


def storage_options_for(uri: str, storage_options: dict | None = None) -> dict:
    """Options for fsspec. For s3 we add short timeouts so an unreachable endpoint fails in seconds."""
    opts = dict(storage_options or {})
    if str(uri).startswith(("s3://", "s3a://")):
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
        client_kwargs = dict(opts.pop("client_kwargs", {}) or {})
        if endpoint:
            client_kwargs.setdefault("endpoint_url", endpoint)
        opts["client_kwargs"] = client_kwargs
        config_kwargs = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}
        config_kwargs.update(opts.pop("config_kwargs", {}) or {})
        opts["config_kwargs"] = config_kwargs
        # fsspec reuses one filesystem per settings (one S3 client, not one per call), but its listing cache
        # never expires and other processes (training jobs, Ray actors, a rerun elsewhere) write here too.
        opts.setdefault("use_listings_cache", False)
    return opts


def endpoint_of(uri: str, storage_options: dict | None = None) -> str:
    opts = storage_options_for(uri, storage_options)
    return opts.get("client_kwargs", {}).get("endpoint_url") or "default AWS endpoint"


def filesystem(uri: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(uri), **storage_options_for(uri, storage_options))
    return fs, path


def check_reachable(uri: str, storage_options: dict | None = None) -> None:
    """Fail fast (seconds, not minutes) when an object store or its bucket cannot be reached."""
    if not str(uri).startswith(("s3://", "s3a://", "gs://", "gcs://")):
        return
    fs, path = filesystem(uri, storage_options)
    bucket = path.split("/", 1)[0]
    try:
        fs.info(bucket)  # unlike exists(), info() lets connection errors through
        ok = True
    except FileNotFoundError:
        ok = False
    except Exception as e:  # botocore raises many types for a dead endpoint
        raise StoreUnreachableError(
            f"object store endpoint {endpoint_of(uri, storage_options)} is unreachable for {uri}: "
            + redact(f"{type(e).__name__}: {e}", storage_options)
        ) from None
    if not ok:
        raise FileNotFoundError(f"bucket {bucket!r} does not exist at {endpoint_of(uri, storage_options)} (for {uri})")
