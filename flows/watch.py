"""`rlhf-flows watch URI`: retraining when data lands (issue 26 item 4).

One pass lists the data files under a prefix (any fsspec URI), keeps those it has not announced yet, and
emits one Prefect event for them:

    event     rlhf.data.landed
    resource  rlhf.data-prefix.<URI>  (name: URI)
    payload   prefix, files [{uri, kind, size}], prompt_data / preference_data (the new files of that kind,
              comma-separated as the loops' prompt_data / preference_data read them, or null)

A deployment trigger (deployments/prefect.yaml, `iterative-dpo/on-new-data`) starts the loop with them. Without
`--once` the pass repeats every `--interval` seconds.

What was announced is kept in a JSON state file (any fsspec URI; default under the model cache, keyed by a hash
of the prefix), written only after the event went out, so a failed emit is retried by the next pass. Not a
Prefect Variable: its value is capped at 5000 characters (prefect.types.MAX_VARIABLE_VALUE_LENGTH), a few dozen
file URIs. Not a last-modified high-water mark: S3 dates a multipart upload by its start, and `mv` keeps a
file's mtime, so a file could land "in the past" and be missed. A file whose size or ETag / mtime changes is
announced again.
"""
from __future__ import annotations

import asyncio
import csv
import fnmatch
import hashlib
import io
import json
import time

from rlhf_core import store

EVENT = "rlhf.data.landed"
RESOURCE = "rlhf.data-prefix."
PATTERNS = ("*.jsonl", "*.json", "*.parquet", "*.csv")
KINDS = ("auto", "prompts", "preferences")


def resource_id(prefix: str) -> str:
    return RESOURCE + prefix.rstrip("/")


def default_state(prefix: str) -> str:
    return str(store.cache_root() / "watch" / f"{hashlib.sha256(prefix.rstrip('/').encode()).hexdigest()[:16]}.json")


# ---------------------------------------------------------------------------------------------- listing
def list_files(prefix: str, patterns: tuple[str, ...] = PATTERNS) -> dict[str, dict]:
    """{uri: fsspec info} of the data files under `prefix` (recursive) whose path below it matches a pattern.
    Hidden and `_` names (`.tmp`, `_SUCCESS`, `_versions/`) are skipped, as Hadoop/Spark writers use them for
    files still being written. A prefix that cannot be read is an error naming it."""
    prefix = prefix.rstrip("/")
    try:
        store.check_reachable(prefix)  # a missing bucket or a dead endpoint: said in seconds
        fs, path = store.filesystem(prefix)
        if not fs.exists(path):
            raise FileNotFoundError(f"watch prefix {prefix} does not exist (create it, or fix the URI)")
        found = fs.find(path, detail=True)
    except store.ArtifactError:
        raise
    except FileNotFoundError as e:
        raise FileNotFoundError(str(e) if prefix in str(e) else f"watch prefix {prefix} is not readable: {e}") from None
    except Exception as e:  # no credentials, access denied, ...
        raise PermissionError(f"watch prefix {prefix} is not readable: {type(e).__name__}: {e}") from None
    proto = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    out = {}
    for p, info in sorted(found.items()):
        rel = p[len(path.rstrip("/")) + 1:]
        if info.get("type") == "file" and not any(part.startswith((".", "_")) for part in rel.split("/")) \
                and any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pat) for pat in patterns):
            out[proto + p if proto else p] = info
    return out


def signature(info: dict) -> str:
    """What makes a file new again: its size and its ETag (object stores) or mtime (folders)."""
    tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or info.get("created")
    return f"{info.get('size')}:{tag}"


def kind_of(uri: str) -> str:
    """`preferences` for rows with OpenRLHF's chosen / rejected keys, else `prompts` (read from the first row)."""
    fs, path = store.filesystem(uri)
    with fs.open(path, "rb") as f:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            cols = pq.ParquetFile(f).schema_arrow.names
        elif path.endswith(".csv"):
            cols = next(csv.reader(io.TextIOWrapper(f, encoding="utf-8")), [])
        else:
            first = f.readline().decode("utf-8").strip()
            if path.endswith(".json") and not first.startswith("{"):  # a list of rows (or {"train": [...]})
                data = json.loads(first + f.read().decode("utf-8"))
                data = next((v for v in data.values() if isinstance(v, list)), []) if isinstance(data, dict) else data
                cols = list(data[0]) if data and isinstance(data[0], dict) else []
            else:
                cols = list(json.loads(first)) if first else []
    return "preferences" if {"chosen", "rejected"} <= set(cols) else "prompts"


# ---------------------------------------------------------------------------------------------- state
def read_state(state: str, prefix: str) -> dict[str, str]:
    fs, path = store.filesystem(state)
    if not fs.exists(path):
        return {}
    with fs.open(path) as f:
        data = json.load(f)
    if data.get("prefix") != prefix.rstrip("/"):
        raise ValueError(f"watch state {state} belongs to prefix {data.get('prefix')}, not {prefix}: give another --state")
    return data["files"]


def write_state(state: str, prefix: str, files: dict[str, str]) -> None:
    """Atomically (temporary file, then rename): a killed watcher leaves the previous state, never half of one."""
    fs, path = store.filesystem(state)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path + ".tmp", "w") as f:
        json.dump({"prefix": prefix.rstrip("/"), "files": files}, f, indent=1, sort_keys=True)
    fs.mv(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------- events
def payload(prefix: str, new: dict[str, dict], kinds: dict[str, str]) -> dict:
    files = [{"uri": u, "kind": kinds[u], "size": info.get("size")} for u, info in new.items()]
    of = lambda kind: ",".join(f["uri"] for f in files if f["kind"] == kind) or None  # noqa: E731
    return {"prefix": prefix.rstrip("/"), "files": files, "prompt_data": of("prompts"), "preference_data": of("preferences")}


class EventNotSent(RuntimeError):
    """The Prefect server did not take the event: the files stay unannounced for the next pass."""


def emit(prefix: str, data: dict) -> str:
    """Send the event and wait until the server has it (a websocket closed cleanly after the send); any
    failure raises EventNotSent, so the files stay unannounced. Returns the event id."""
    from prefect.events import Event
    from prefect.events.clients import get_events_client
    from prefect.settings import PREFECT_API_URL

    event = Event(event=EVENT, resource={"prefect.resource.id": resource_id(prefix), "prefect.resource.name": prefix.rstrip("/")},
                  payload=data)

    async def send():
        async with get_events_client(reconnection_attempts=2) as client:
            await client.emit(event)

    try:
        asyncio.run(send())
    except Exception as e:
        raise EventNotSent(f"{EVENT} for {prefix} not sent to {PREFECT_API_URL.value()}: {type(e).__name__}: {e}") from None
    return str(event.id)


def check_api() -> None:
    """Before any pass: a Prefect server is configured and answers (its health check)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ValueError("rlhf-flows watch sends its events to a Prefect server: set PREFECT_API_URL "
                         "(e.g. http://127.0.0.1:4200/api), the server that holds the triggered deployment")
    with get_client(sync_client=True) as client:
        if (error := client.api_healthcheck()) is not None:
            raise EventNotSent(f"the Prefect server at {PREFECT_API_URL.value()} does not answer: {type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------- the command
def one_pass(prefix: str, state: str, patterns: tuple[str, ...] = PATTERNS, kind: str = "auto") -> dict | None:
    """List, diff against the state, emit one event for the new files, then record them. Returns the payload
    sent (None when nothing is new)."""
    listed = list_files(prefix, patterns)
    seen = read_state(state, prefix)
    new = {u: info for u, info in listed.items() if seen.get(u) != signature(info)}
    if not new:
        return None
    data = payload(prefix, new, {u: kind if kind != "auto" else kind_of(u) for u in new})
    data["event_id"] = emit(prefix, data)
    write_state(state, prefix, {**seen, **{u: signature(info) for u, info in new.items()}})
    return data


def watch(prefix: str, once: bool = False, interval: float = 60.0, patterns: tuple[str, ...] = PATTERNS,
          kind: str = "auto", state: str | None = None, say=lambda line: print(line, flush=True)) -> int:
    """The `watch` command. Bad input (no API, unreadable prefix, bad interval or kind) fails at the first
    pass, before any event; when polling, a later pass that fails (a network error, a prefix moved away) is
    said and retried at the next interval, so one outage does not end the watch."""
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {interval:g}")
    check_api()
    state = state or default_state(prefix)
    passes = 0
    while True:
        try:
            sent = one_pass(prefix, state, patterns, kind)
        except (OSError, store.ArtifactError, EventNotSent) as e:
            if once or not passes:
                raise
            say(f"pass failed (retrying in {interval:g} s): {e}")
        else:
            if sent:
                say(f"{EVENT} {sent['event_id']}: {len(sent['files'])} new file(s) under {prefix}: "
                    + ", ".join(f"{f['uri']} ({f['kind']})" for f in sent["files"]))
            else:
                say(f"no new files under {prefix}")
        passes += 1
        if once:
            return 0
        try:
            time.sleep(interval)
        except KeyboardInterrupt:  # Ctrl-C between passes: a clean stop (the state is already written)
            return 0


def patterns_of(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip()) if text else PATTERNS

