"""`rlhf-flows`: the command line.

    rlhf-flows demo [--root DIR] [--run-name NAME]       the iterative-DPO demo on CPU (configs/demo.yaml)
    rlhf-flows run FLOW --config FILE [key=value ...]      iterative-dpo | raft | conditional-sft
    rlhf-flows stage STAGE --config FILE [key=value ...]   one stage alone (prepare, generate, score, ...)
    rlhf-flows show URI                                    an artifact's manifest and lineage, or a run
    rlhf-flows gc URI --keep N                             delete all but the N newest versions of each artifact
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from rlhf_core import store

FLOWS = {"iterative-dpo": "flows.iterative_dpo", "raft": "flows.raft", "conditional-sft": "flows.conditional_sft"}
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _flow_module(name: str):
    if name not in FLOWS:
        raise SystemExit(f"unknown flow {name!r}; choose from {', '.join(FLOWS)}")
    return importlib.import_module(FLOWS[name])


def cmd_run(flow: str, config: str | None, overrides: list[str]) -> int:
    from stages.common import load_config

    mod = _flow_module(flow)
    params = load_config(mod.Params, config, overrides)
    report = mod.FLOW(params)
    print(format_report(report))
    return 0


def format_report(rep: dict) -> str:
    """The per-iteration table the loop flows also publish as a Prefect table artifact."""
    rows = rep.get("iterations", [])
    cols = [c for c in ("iteration", "samples", "kept", "ties_dropped", "train_rm_reward", "rm_reward", "gold_reward",
                        "dpo_loss", "dpo_reward_margin", "sft_loss") if any(c in r for r in rows)]
    cols += sorted({c for r in rows for c in r if c.endswith("_s")})
    fmt = lambda v: "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    width = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    lines = [f"{rep.get('flow')} run {rep.get('run')}: {rep.get('stop_reason')} ({rep.get('wall_s')} s)",
             "  ".join(c.rjust(width[c]) for c in cols)]
    lines += ["  ".join(fmt(r.get(c)).rjust(width[c]) for c in cols) for r in rows]
    lines += [f"report: {rep.get('run')}/report.json   plot: {rep.get('run')}/reward.png"]
    return "\n".join(lines)


def cmd_stage(name: str, config: str | None, overrides: list[str]) -> int:
    from stages.common import load_config

    try:
        mod = importlib.import_module(f"stages.{name}")
    except ModuleNotFoundError:
        raise SystemExit(f"unknown stage {name!r}") from None
    cfg = load_config(mod.Config, config, overrides, section=name)
    m = mod.run(cfg)
    print(f"{m.stage} committed at {m.uri}\nfingerprint {m.fingerprint}  rows {m.rows}\nmetrics {json.dumps(m.metrics, default=str)}")
    return 0


# ---------------------------------------------------------------------------------------------- show
def _lineage(uri: str, depth: int, seen: set, out: list[str], fp: str | None = None) -> None:
    try:
        m = store.read_version(uri, fp) if fp else store.read_manifest(uri)
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
    """Text for `rlhf-flows show`: a manifest with its lineage tree, or a run folder's iterations."""
    uri = uri.rstrip("/")
    out: list[str] = []
    if store.committed_any(uri):
        m = store.read_manifest(uri)
        out += [f"artifact   {uri}", f"stage      {m.stage}", f"fingerprint {m.fingerprint}",
                f"created    {m.created_at}", f"finished   {m.finished_at}  on {m.host}",
                f"rows       {m.rows}", f"files      {len(m.files)} ({sum(f['size'] for f in m.files)} bytes)",
                f"metrics    {json.dumps(m.metrics, default=str)}"]
        out += [f"version    {v.fingerprint} {v.uri} ({v.finished_at})" for v in store.versions(uri)]
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
    for p in sorted(fs.find(path)):
        if p.endswith(store.MANIFEST) and f"/{store.VERSIONS}/" not in p:
            art = p[: -len(store.MANIFEST) - 1]
            full = uri + art[len(path):]
            m = store.read_manifest(full)
            out.append(f"  {full[len(uri) + 1:]:<32} {m.stage:<10} {m.fingerprint}  <- "
                       + ", ".join(i["uri"][len(uri) + 1:] if i["uri"].startswith(uri) else i["uri"] for i in m.inputs)
                       + "".join(f"\n  {'':<32} previous {v.fingerprint}" for v in store.versions(full)))
    return "\n".join(out)


def gc(uri: str, keep: int) -> str:
    """`rlhf-flows gc`: prune old versions of the artifact at `uri`, or of every artifact under it."""
    fs, path = store.filesystem(uri.rstrip("/"))
    arts = [uri.rstrip("/") + p[len(path):-len(store.MANIFEST) - 1] for p in sorted(fs.find(path))
            if p.endswith("/" + store.MANIFEST) and f"/{store.VERSIONS}/" not in p]
    removed = [r for a in arts for r in store.prune_versions(a, keep)]
    return "\n".join([f"removed {r}" for r in removed] + [f"{len(removed)} versions removed, {len(arts)} artifacts kept "
                                                          f"their {keep} newest"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlhf-flows", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the iterative-DPO demo (CPU, local folder, Prefect's local API)")
    d.add_argument("--root", default="runs", help="artifact root (a folder, or s3://bucket/prefix)")
    d.add_argument("--run-name", default="demo")
    d.add_argument("overrides", nargs="*", help="key=value overrides of configs/demo.yaml")
    for name, helptext in (("run", "run a flow"), ("stage", "run one stage")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("name")
        s.add_argument("--config", help="YAML config file")
        s.add_argument("overrides", nargs="*", help="key=value (dotted keys for nested fields)")
    sh = sub.add_parser("show", help="print an artifact's manifest and lineage, or a run's iterations")
    sh.add_argument("uri")
    g = sub.add_parser("gc", help="delete all but the N newest versions of each artifact under URI")
    g.add_argument("uri")
    g.add_argument("--keep", type=int, required=True, help="versions to keep per artifact, the current one included (>= 1)")
    a = p.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry calls from a closed network
    # Prefect's local API migrates a fresh database on its first start: 20 s (its default limit) is too
    # tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.runtime import api_server_dies_with_us
    from stages.common import ConfigError

    api_server_dies_with_us()  # kill -9 of this process alone must not leave Prefect's server behind

    try:
        if a.cmd == "demo":
            return cmd_run("iterative-dpo", str(DEMO_CONFIG), [f"root={a.root}", f"run_name={a.run_name}", *a.overrides])
        if a.cmd == "run":
            return cmd_run(a.name, a.config, a.overrides)
        if a.cmd == "stage":
            return cmd_stage(a.name, a.config, a.overrides)
        print(gc(a.uri, a.keep) if a.cmd == "gc" else show(a.uri))
        return 0
    except (ConfigError, store.ArtifactError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
