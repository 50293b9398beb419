"""`rlhf-flows`: the command line.

    rlhf-flows demo [--root DIR] [--run-name NAME]       the iterative-DPO demo on CPU (configs/demo.yaml)
    rlhf-flows run FLOW --config FILE [key=value ...]      iterative-dpo | raft | conditional-sft | ppo
    rlhf-flows stage STAGE --config FILE [key=value ...]   one stage alone (prepare, generate, score, ...)
    rlhf-flows show URI                                    an artifact's manifest and lineage, or a run
    rlhf-flows gc URI --keep N                             delete all but the N newest versions of each artifact
    rlhf-flows gc --cache-max-gb N                         shrink this machine's model cache to N GB (LRU first)
    rlhf-flows serve-rm MODEL [--port 5000]                a reward model over HTTP (score's remote_rm_url)
    rlhf-flows import-openrlhf FILE|- [-o OUT.yaml] [-- ARG...]  an OpenRLHF launch script (ARGs: its $1...) -> stage YAML
    rlhf-flows watch URI [--once] [--interval S]           a Prefect event when data files land under URI
    rlhf-flows plan FILE [key=value ...] [--gpu-memory-gb 80]   the ppo memory plan per moment, GPU and role

`--config FILE` goes before or after the key=value overrides. An expected failure (config, data,
artifact, reward, generation, job) prints one line naming what failed and exits 2; `--debug` shows the
traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import contextlib
from contextlib import contextmanager
from pathlib import Path

from flows import table
from rlhf_core import store
from rlhf_core.store import versions

FLOWS = {name: spec.module for name, spec in table.FLOWS.items()}  # flows/table.py
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _flow_module(name: str):
    from stages.common import ConfigError

    if name not in FLOWS:
        raise ConfigError(f"unknown flow {name!r}; choose from {', '.join(FLOWS)}")
    return importlib.import_module(FLOWS[name])


def _stage_module(name: str):
    from stages.common import ConfigError

    if not (Path(__file__).resolve().parent.parent / "stages" / f"{name}.py").exists() or name == "common":
        raise ConfigError(f"unknown stage {name!r}; choose from {', '.join(STAGES)}")
    return importlib.import_module(f"stages.{name}")


STAGES = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "stages").glob("*.py")
                if p.stem not in ("__init__", "common"))


@contextmanager
def console_without_tracebacks():
    """Prefect's console log prints a failed task's traceback; the CLI prints the failure as one line
    instead (`--debug` keeps them). Only the console's formatter changes, for the command's duration: the
    run log in the API keeps the tracebacks."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    def without_traceback(base):
        def format(self, record):  # the record is shared with the API handler: restore it
            saved = record.exc_info, record.exc_text, record.stack_info
            record.exc_info = record.exc_text = record.stack_info = None
            try:
                return base.format(self, record)
            finally:
                record.exc_info, record.exc_text, record.stack_info = saved

        return type("NoTraceback", (base,), {"format": format})

    changed = []
    for logger in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        for h in getattr(logger, "handlers", []):
            if isinstance(h, PrefectConsoleHandler) and h.formatter and h.formatter not in [f for f, _ in changed]:
                changed.append((h.formatter, type(h.formatter)))
                h.formatter.__class__ = without_traceback(type(h.formatter))
    try:
        yield
    finally:
        for fmt, base in changed:
            fmt.__class__ = base


def cmd_run(flow: str, config: str | None, overrides: list[str], debug: bool = False) -> int:
    from stages.common import load_config

    mod = _flow_module(flow)
    params = load_config(mod.Params, config, overrides)
    with console_without_tracebacks() if not debug else contextlib.nullcontext():
        report = mod.FLOW(params)
    print(format_report(report))
    return 0


def format_report(rep: dict) -> str:
    """The per-iteration table the loop flows also publish as a Prefect table artifact."""
    rows = rep.get("iterations", [])
    from flows.report import columns

    cols = [c for c in columns(rows) if not c.endswith(("_steps", "_accuracy"))]
    fmt = lambda v: "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    width = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    lines = [f"{rep.get('flow')} run {rep.get('run')}: {rep.get('stop_reason')} ({rep.get('wall_s')} s)",
             "  ".join(c.rjust(width[c]) for c in cols)]
    lines += ["  ".join(fmt(r.get(c)).rjust(width[c]) for c in cols) for r in rows]
    lines += [f"report: {rep.get('run')}/report.json   plot: {rep.get('run')}/reward.png"]
    return "\n".join(lines)


def cmd_stage(name: str, config: str | None, overrides: list[str]) -> int:
    from stages.common import load_config

    mod = _stage_module(name)
    cfg = load_config(mod.Config, config, overrides, section=name)
    m = mod.run(cfg)
    print(f"{m.stage} committed at {m.uri}\nfingerprint {m.fingerprint}  rows {m.rows}\nmetrics {json.dumps(m.metrics, default=str)}")
    return 0


# ---------------------------------------------------------------------------------------------- plan
PLACEHOLDER = "s3://my-bucket"  # the shipped configs' store: a user's own replaces it


def cmd_plan(config: str, overrides: list[str], gpu_gb: float, legacy: bool = False,
             node_gb: float | None = None) -> int:
    """`rlhf-flows plan`: the memory plan (rlhf_core.ppo.plan) of a ppo flow config (pretrain_uri, reward_uri,
    its ppo: section) or a ppo stage config, for a GPU cluster (none is contacted: only each model's config.json
    is read: folders, store URIs or hub ids). Exit 2 when a moment is over what CUDA can use of gpu_gb GB, or the
    pinned host memory of a node over node_gb."""
    import yaml

    from rlhf_core.ppo import plan
    from stages import ppo
    from stages.common import ConfigError, load_config

    raw = yaml.safe_load(Path(config).read_text()) or {}
    gpu = {"accelerator": "gpu", "ray_address": "planned-cluster:6379"}  # planned for GPUs, not this host's
    if "run_name" in raw or "pretrain_uri" in raw:  # a flow config: its ppo section, the models it wires in
        from flows import ppo as flow
        from flows.calls import stage_config

        p = load_config(flow.Params, config, overrides)
        if not p.reward_uri and not (p.reward_func_file or p.reward_url):
            raise ConfigError(f"{config}: the plan needs reward_uri (a reward model the flow would train has no "
                              f"config.json yet)")
        source = {"reward_model_uri": p.reward_uri} if p.reward_uri else {"reward_func_path": "planned.py"}
        cfg = stage_config(ppo, {**p.ppo.model_dump(exclude_defaults=True), **gpu}, policy_uri=p.pretrain_uri,
                           prompts_uri="planned", output_uri="planned", storage_options=p.storage_options, **source)
        keys = {"pretrain_uri": p.pretrain_uri, "reward_uri": p.reward_uri, "ppo.critic_uri": cfg.critic_uri}
    else:
        cfg = load_config(ppo.Config, config, [*overrides, *(f"{k}={v}" for k, v in gpu.items())], section="ppo")
        keys = {"policy_uri": cfg.policy_uri, "reward_model_uri": cfg.reward_model_uri, "critic_uri": cfg.critic_uri}
    for key, uri in keys.items():
        if uri and PLACEHOLDER in uri:
            raise ConfigError(f"{config}: {key} is {uri}, the example's placeholder store: give the model's hub id or "
                              f"folder, e.g. `rlhf-flows plan {config} {key}=meta-llama/Meta-Llama-3-8B`")
    rms = [u.strip() for u in (cfg.reward_model_uri or "").split(",") if u.strip()]
    critic = cfg.critic_uri or (rms[0] if rms and cfg.advantage_estimator == "gae" else None)
    shapes = plan.shapes_of(cfg.policy_uri, rms, critic, cfg.storage_options)
    planned = plan.plan(cfg, shapes, gpu_gb, legacy, node_gb=node_gb)
    print(planned.table())
    if not planned.fits():
        raise plan.PlanError(planned.over())
    return 0


# ---------------------------------------------------------------------------------------------- show
def _lineage(uri: str, depth: int, seen: set, out: list[str], fp: str | None = None) -> None:
    try:
        m = versions.read_version(uri, fp) if fp else store.read_manifest(uri)
    except (store.ArtifactError, FileNotFoundError, OSError) as e:
        out.append("  " * depth + f"{uri}  [not readable: {e}]")
        return
    rows = f" rows={m.rows}" if m.rows is not None else ""
    out.append("  " * depth + f"{m.stage} {m.fingerprint} {uri}{rows} ({m.finished_at})")
    if m.fingerprint in seen:
        return
    seen.add(m.fingerprint)
    for i in m.inputs:
        if i.get("stage") == "source":
            out.append("  " * (depth + 1) + f"source {i['fingerprint']} {i['uri']}")
        else:
            _lineage(i["uri"], depth + 1, seen, out, i.get("fingerprint"))


def show(uri: str) -> str:
    """Text for `rlhf-flows show URI`: a manifest with its lineage tree, or a run folder's iterations."""
    uri = uri.rstrip("/")
    out: list[str] = []
    if store.committed_any(uri):
        m = store.read_manifest(uri)
        out += [f"artifact   {uri}", f"stage      {m.stage}", f"fingerprint {m.fingerprint}",
                f"created    {m.created_at}", f"finished   {m.finished_at}  on {m.host}",
                f"rows       {m.rows}", f"files      {len(m.files)} ({sum(f['size'] for f in m.files)} bytes)",
                f"metrics    {json.dumps(m.metrics, default=str)}"]
        out += [f"version    {v.fingerprint} {v.uri} ({v.finished_at})" for v in versions.versions(uri)]
        out.append("lineage:")
        _lineage(uri, 1, set(), out)
        return "\n".join(out)
    fs, path = store.filesystem(uri)
    if not fs.exists(path):
        raise FileNotFoundError(f"{uri} does not exist")
    report = store.join(path, "report.json")
    if fs.exists(report):
        with fs.open(report) as f:
            rep = json.load(f)
        done = max((it["iteration"] for it in rep.get("iterations", [])), default=0)  # row 0 = before the loop
        out.append(f"run {uri}: {rep.get('flow')} — {done} iterations, stop reason: {rep.get('stop_reason')}")
        for it in rep.get("iterations", []):
            out.append("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in it.items() if not isinstance(v, dict)))
    out.append("artifacts:")
    found = [p for p in sorted(fs.find(path)) if p.endswith(store.MANIFEST) and f"/{store.VERSIONS}/" not in p]
    if not found and not fs.exists(report):  # e.g. the partial output of an interrupted stage
        raise store.NotCommittedError(f"{uri} is not a committed artifact (no {store.MANIFEST}) and holds no run "
                                      "report or committed artifacts")
    for p in found:
        art = p[: -len(store.MANIFEST) - 1]
        full = uri + art[len(path):]
        m = store.read_manifest(full)
        out.append(f"  {full[len(uri) + 1:]:<32} {m.stage:<10} {m.fingerprint}  <- "
                   + ", ".join(i["uri"][len(uri) + 1:] if i["uri"].startswith(uri) else i["uri"] for i in m.inputs)
                   + "".join(f"\n  {'':<32} previous {v.fingerprint}" for v in versions.versions(full)))
    return "\n".join(out)


def gc(uri: str | None, keep: int | None, cache_max_gb: float | None = None) -> str:
    """The `gc` command: prune old versions of the artifact at `uri`, or of every artifact under it, and/or
    this machine's model cache down to `cache_max_gb` (least recently used entries first)."""
    if (uri is None) != (keep is None):
        raise ValueError("gc URI needs --keep N, and --keep N needs a URI")
    if uri is None and cache_max_gb is None:
        raise ValueError("gc needs URI --keep N (old versions), --cache-max-gb N (the model cache), or both")
    if cache_max_gb is not None and cache_max_gb < 0:
        raise ValueError(f"--cache-max-gb must be >= 0, got {cache_max_gb}")
    out = []
    if uri is not None:
        fs, path = store.filesystem(uri.rstrip("/"))
        arts = [uri.rstrip("/") + p[len(path):-len(store.MANIFEST) - 1] for p in sorted(fs.find(path))
                if p.endswith("/" + store.MANIFEST) and f"/{store.VERSIONS}/" not in p]
        removed = [r for a in arts for r in versions.prune_versions(a, keep)]
        out += [f"removed {r}" for r in removed] + [f"{len(removed)} versions removed, {len(arts)} artifacts kept "
                                                    f"their {keep} newest"]
    if cache_max_gb is not None:
        from datetime import datetime

        from rlhf_core.inputs import model_inputs

        limit = int(cache_max_gb * 1e9)
        entries, left = model_inputs.prune_cache(limit)
        out += [f"removed {p} ({_size(n)}, last used {datetime.fromtimestamp(t):%Y-%m-%d %H:%M})" for p, n, t in entries]
        still = " (still over it: the rest is in use, used or downloaded in the last hour)" if left > limit else ""
        out.append(f"model cache {store.cache_root() / 'models'}: {len(entries)} entries removed, "
                   f"{_size(sum(n for _, n, _ in entries))} freed, {_size(left)} left, limit {cache_max_gb:g} GB{still}")
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


@contextmanager
def show_progress(every_s: float, verbose: bool):
    """`stage` on a terminal: training step/total, loss, tokens/s and ETA, generate/score rows/total, and
    the job's notable lines. (`run` shows them through Prefect's console log.)"""
    import logging

    from rlhf_core.runtime import progress

    progress.install()
    display = progress.Display(every_s=every_s, verbose=verbose)
    progress.listeners.append(display)
    log, handler = logging.getLogger("rlhf_flows"), display.handler()
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False  # Prefect's root console handler would print every raw line again
    try:
        yield
    finally:
        progress.listeners.remove(display)
        log.removeHandler(handler)
        log.propagate = propagate


def expected_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause and fix (config, data, artifact, reward, generation, job): one line, exit 2.
    Anything else is a bug and keeps its traceback."""
    from rlhf_core.rollout.generation import GenerationError
    from rlhf_core.runtime.jobs import JobFailed
    from rlhf_core.rollout.rewards import RewardError
    from rlhf_core.train.checkpoints import CheckpointError
    from rlhf_core.train.launch import TrainingIncomplete
    from flows.pools import RunCancelled
    from flows.watch import EventNotSent
    from flows.tasks import StageFailed

    # ValueError covers ConfigError, DataError and FilterError, and the config checks inside run().
    return (ValueError, store.ArtifactError, FileNotFoundError, PermissionError, RewardError, GenerationError,
            JobFailed, TrainingIncomplete, CheckpointError, StageFailed, EventNotSent, RunCancelled)


def parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p = argparse.ArgumentParser(prog="rlhf-flows", description=__doc__, parents=[debug],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[debug], help="run the iterative-DPO demo (CPU, local folder, Prefect's local API)")
    d.add_argument("--root", default="runs", help="artifact root (a folder, or s3://bucket/prefix)")
    d.add_argument("--run-name", default="demo")
    d.add_argument("overrides", nargs="*", help="key=value overrides of configs/demo.yaml")
    for name, helptext in (("run", f"run a flow ({' | '.join(FLOWS)})"), ("stage", f"run one stage ({' | '.join(STAGES)})")):
        s = sub.add_parser(name, parents=[debug], help=helptext)
        s.add_argument("name")
        s.add_argument("--config", help="YAML config file")
        s.add_argument("overrides", nargs="*", help="key=value (dotted keys for nested fields)")
        s.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                       help="without a terminal: one progress line every SECONDS (a terminal gets a bar)")
    sh = sub.add_parser("show", parents=[debug], help="print an artifact's manifest and lineage, or a run's iterations")
    sh.add_argument("uri")
    g = sub.add_parser("gc", parents=[debug], help="delete all but the N newest versions of each artifact under URI, "
                                                   "and/or shrink this machine's model cache")
    g.add_argument("uri", nargs="?", help="artifact or run folder whose old versions to delete (with --keep)")
    g.add_argument("--keep", type=int, help="versions to keep per artifact, the current one included (>= 1)")
    g.add_argument("--cache-max-gb", type=float, metavar="X",
                   help="delete least recently used entries of the model cache (RLHF_FLOWS_CACHE, default "
                        "~/.cache/rlhf-flows, models/) until it holds at most X GB; entries used in the last "
                        "hour and downloads in progress are kept")
    rm = sub.add_parser("serve-rm", parents=[debug], help="serve a reward model over HTTP (the score stage's remote_rm_url)")
    rm.add_argument("model", help="committed reward-model artifact or plain HF folder (any fsspec URI)")
    rm.add_argument("--host", default="127.0.0.1")
    rm.add_argument("--port", type=int, default=5000)
    rm.add_argument("--batch-size", type=int, default=64, help="rows per forward pass")
    rm.add_argument("--max-len", type=int, default=2048, help="max tokens of prompt + response")
    rm.add_argument("--no-normalize-reward", dest="normalize_reward", action="store_false",
                    help="return raw scores (default: apply the model's reward_mean/reward_std)")
    rm.add_argument("--value-head-prefix", default="value_head")
    im = sub.add_parser("import-openrlhf", parents=[debug], help="turn an OpenRLHF launch command or script (v0.9 flat "
                        "or v0.10+ dotted flags) into the equivalent stage YAML, each key commented with its flag")
    im.add_argument("file", help="shell script or command line (- reads stdin)")
    im.add_argument("-o", "--output", help="write the YAML to this file (default: stdout)")
    im.add_argument("args", nargs="*", metavar="-- ARG", help="the script's own arguments ($1 $2 ...), after --")
    w = sub.add_parser("watch", parents=[debug], help="emit a Prefect event (rlhf.data.landed) when new prompt or "
                       "preference files appear under URI; a deployment trigger starts a loop on it (flows/watch.py)")
    w.add_argument("uri", help="prefix to watch: a folder or s3://bucket/prefix (any fsspec URI)")
    w.add_argument("--once", action="store_true", help="one pass, then exit (default: poll every --interval seconds)")
    w.add_argument("--interval", type=float, default=60.0, metavar="SECONDS", help="seconds between passes (default 60)")
    w.add_argument("--pattern", help="comma-separated globs of the files to announce, matched below URI "
                                     "(default: *.jsonl,*.json,*.parquet,*.csv)")
    w.add_argument("--kind", default="auto", help="auto (rows with chosen and rejected keys are preferences, "
                                                  "others prompts), prompts or preferences")
    w.add_argument("--state", help="JSON file (any fsspec URI) of the files already announced; default: under "
                                   "RLHF_FLOWS_CACHE (~/.cache/rlhf-flows)/watch/, keyed by URI")
    pl = sub.add_parser("plan", parents=[debug], help="the ppo memory plan: what each role holds on each GPU at each "
                        "moment (setup, generate, entering train, train, sync, resume), the peak and the pinned host "
                        "memory per node, from the models' config.json; exit 2 if over")
    pl.add_argument("config", help="a ppo flow config (configs/reinforce_baseline_llama3_8b_hybrid.yaml) or ppo stage config")
    pl.add_argument("overrides", nargs="*", help="key=value (e.g. pretrain_uri=DIR or a hub id: only config.json is "
                                                 "read)")
    pl.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of each GPU as sold (GB = 2**30 bytes; "
                    "the plan checks against 0.4 GB less, what CUDA shows)")
    pl.add_argument("--node-memory-gb", type=float, default=None, help="RAM of each node, for the pinned host memory")
    pl.add_argument("--legacy-order", action="store_true", help="plan the order before issues 35 and 41 (every phase "
                    "change in one wave, engines loading beside the other roles, learners and engines fully awake "
                    "for the weight sync, a resume beside awake engines)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, accepting key=value overrides before and after options (`run F --config C k=v` and
    `run F k=v --config C`): argparse stops filling a trailing nargs="*" positional once an option was seen."""
    p = parser()
    a, extra = p.parse_known_args(argv)
    if getattr(a, "cmd", None) == "import-openrlhf" and extra[:1] == ["--"]:  # `FILE -o OUT -- ARG...`
        a.args, extra = [*a.args, *extra[1:]], []
    if extra and (not hasattr(a, "overrides") or any(x.startswith("-") or "=" not in x for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        a.overrides = [*a.overrides, *extra]
    return a

def api_server_dies_with_us() -> None:
    """Prefect's ephemeral API server (uvicorn, ~200 MB) is a plain child of the process that started it: a
    SIGKILLed CLI (an OOM kill, a supervisor) left it alive holding its port. Start it with PR_SET_PDEATHSIG,
    as training jobs are (jobs.dies_with_parent), by giving Prefect's server module a Popen that wraps its command."""
    import subprocess
    import types

    from prefect.server.api import server

    from rlhf_core.runtime.jobs import dies_with_parent

    if getattr(server.subprocess, "dies_with_parent", False):
        return

    class Popen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            if isinstance(args, (list, tuple)) and not kwargs.get("shell"):
                args = dies_with_parent([str(a) for a in args])
            super().__init__(args, *rest, **kwargs)

    shim = types.ModuleType("subprocess")
    shim.__dict__.update(vars(subprocess), Popen=Popen, dies_with_parent=True)
    server.subprocess = shim


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry calls from a closed network
    # Prefect's local API migrates a fresh database on its first start: 20 s (its default limit) is too
    # tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    api_server_dies_with_us()  # kill -9 of this process alone must not leave Prefect's server behind
    try:
        if a.cmd == "demo":
            return cmd_run("iterative-dpo", str(DEMO_CONFIG), [f"root={a.root}", f"run_name={a.run_name}", *a.overrides],
                           getattr(a, "debug", False))
        if a.cmd == "run":
            return cmd_run(a.name, a.config, a.overrides, getattr(a, "debug", False))
        if a.cmd == "stage":
            with show_progress(a.progress_every, getattr(a, "debug", False)):
                return cmd_stage(a.name, a.config, a.overrides)
        if a.cmd == "import-openrlhf":
            from flows.openrlhf import importer

            return importer.main(a.file, a.output, a.args)
        if a.cmd == "watch":
            from flows import watch

            return watch.watch(a.uri, a.once, a.interval, watch.patterns_of(a.pattern), a.kind, a.state)
        if a.cmd == "plan":
            return cmd_plan(a.config, a.overrides, a.gpu_memory_gb, a.legacy_order, a.node_memory_gb)
        if a.cmd == "serve-rm":
            from rlhf_core.rollout.serve_rm import serve

            return serve(a.model, a.host, a.port, batch_size=a.batch_size, max_len=a.max_len,
                         normalize=a.normalize_reward, value_head_prefix=a.value_head_prefix)
        print(gc(a.uri, a.keep, a.cache_max_gb) if a.cmd == "gc" else show(a.uri))
        return 0
    except expected_errors() as e:
        if getattr(a, "debug", False):
            raise
        print(f"rlhf-flows: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
