"""The promotion gate (issue 26): which of a loop's policies ships. Retraining on a schedule must never ship a
worse model, so a loop with `promote_min_gain` set promotes iteration k's policy only when its held-out eval
beats the promoted one by at least that much on `promote_metric` (gold reward, or the RM reward where there is
no gold) with KL to the run's starting policy at most `promote_max_kl`; otherwise it keeps the promoted one,
says why in the run log and the report, and (stop_when_not_promoted) stops. Iteration 0, the policy the run
starts from, is the first promoted one. The decisions read only committed evals, so a rerun of the run reaches
the same ones.

Where the promoted policy is said:
    {root}/{run_name}/current.json    this run's promoted policy and every decision (replaced atomically)
    {root}/_lineages/{lineage}.json   the lineage's promoted policy (below)
    a `promoted-{lineage or run}` markdown artifact, and the flow's return value (`promotion`)

Scheduled runs. A nightly deployment names each night's run folder `nightly-{scheduled}` (the flow run's
scheduled start, so a retry of that flow run resumes its own folder) and sets `lineage`: a run of a lineage
starts from the policy the lineage last promoted (its SFT warm-up skipped: the lineage's first run did it) and
moves the lineage's pointer when it promotes. A pointer rather than "the newest run folder": it survives a
night that promoted nothing, and what a run starts from is recorded once in {run}/start.json, so a rerun of an
older night starts where it did even after later nights moved the lineage on. A run moves the pointer only if
it still names this run's start or one of its own promotions (a rerun of an older night, or a night that ran
beside another, never moves it back).
"""
from __future__ import annotations

import json
import re

from flows.calls import run_logger
from rlhf_core import store
from stages.common import ConfigError

POINTER, START, LINEAGES = "current.json", "start.json", "_lineages"
GATE_FIELDS = ("promote_max_kl", "promote_metric", "stop_when_not_promoted", "lineage")


def metric(p, flow_name: str) -> str:
    """The metric the gate compares, refused (naming it) where the loop does not compute it."""
    gold = bool(p.demo or p.gold_reward_file)
    rm = bool(p.reward_uri or p.reward_url or not p.reward_func_file)  # reward_func_file: eval has no RM to score with
    if not (p.demo or p.eval_prompt_data):
        raise ConfigError(f"{flow_name}: promote_min_gain compares evals on held-out prompts, but eval_prompt_data is not set")
    chosen = p.promote_metric or ("gold_reward" if gold else "rm_reward")
    if chosen == "gold_reward" and not gold:
        raise ConfigError(f"{flow_name}: promote_metric=gold_reward, but the loop computes no gold reward "
                          "(gold_reward_file is not set)")
    if chosen == "rm_reward" and not rm:
        raise ConfigError(f"{flow_name}: promote_metric=rm_reward, but the loop computes no RM reward (its reward is "
                          "reward_func_file; set gold_reward_file and promote_metric=gold_reward, or give reward_uri)")
    return chosen


def check(p, flow_name: str) -> None:
    """Before any work: gate settings without the gate, or a metric the loop does not compute, are refused."""
    if p.promote_min_gain is None:
        if given := [f for f in GATE_FIELDS if getattr(p, f) not in (None, False)]:
            raise ConfigError(f"{flow_name}: {', '.join(given)} apply to the promotion gate, which is off: set "
                              "promote_min_gain (e.g. 0.0: promote any iteration that does not lose)")
        return
    metric(p, flow_name)


def _read(uri: str, storage_options: dict | None) -> dict | None:
    fs, path = store.filesystem(uri, storage_options)
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def _write(uri: str, obj: dict, storage_options: dict | None) -> None:
    store.check_fence()  # only the run lock's holder writes
    fs, path = store.filesystem(uri, storage_options)
    store.write_atomic(fs, path, json.dumps(obj, indent=2, default=str))


def lineage_uri(root: str, lineage: str) -> str:
    return store.join(root, LINEAGES, f"{lineage}.json")


def start_policy(p) -> str | None:
    """The promoted policy of p.lineage this run continues from, as recorded when the run first started (None:
    no lineage, or its first run: start from pretrain_uri). The pointer's policy must still be the artifact it
    promoted (same fingerprint): a rerun that re-committed it with other settings is refused, naming both."""
    if not p.lineage:
        return None
    so, start_uri = p.storage_options, store.join(p.root, p.run_name, START)
    if (started := _read(start_uri, so)) is not None:
        return started["policy_uri"]
    pointer = _read(lineage_uri(p.root, p.lineage), so)
    policy = pointer["promoted"]["policy_uri"] if pointer else None
    if pointer:
        want, now = pointer["promoted"]["policy_fingerprint"], store.source_manifest(policy, so).fingerprint
        if now != want:
            raise ConfigError(f"lineage {p.lineage} ({lineage_uri(p.root, p.lineage)}) promoted {policy} with fingerprint "
                              f"{want}, but it now holds {now} (rerun with other settings?): point the lineage elsewhere")
    _write(start_uri, {"lineage": p.lineage, "policy_uri": policy,
                       "from": f"run {pointer['run']} iteration {pointer['promoted']['iteration']}" if pointer else "pretrain_uri"}, so)
    return policy


class Gate:
    """One run's promotion decisions; `decide` after each iteration's eval (iteration 0 first)."""

    def __init__(self, p, flow_name: str):
        self.p, self.flow, self.metric = p, flow_name, metric(p, flow_name)
        self.run_uri = store.join(p.root, p.run_name)
        self.promoted: dict | None = None
        self.decisions: list[dict] = []
        self.lineage_note = ""
        self.mine: set[str] = set()  # every policy this run promoted (its start first)

    def decide(self, k: int, row: dict, policy: str, evaluation: dict) -> bool:
        """Promote iteration k's policy or keep the promoted one; the reason goes to the run log and the row."""
        value, kl = row.get(self.metric), row.get("kl")
        if value is None:
            raise ConfigError(f"{self.flow}: promote_metric {self.metric} is missing from iteration {k}'s eval {evaluation['uri']}")
        fp = next(i["fingerprint"] for i in evaluation["inputs"] if i["name"] == "policy")
        p, before = self.p, self.promoted
        if before is None:
            ok, why = True, "the run's starting policy"
        elif (gain := value - before[self.metric]) < p.promote_min_gain:
            ok, why = False, (f"{self.metric} {value:.4f} gains {gain:+.4f} over iteration {before['iteration']}'s "
                              f"{before[self.metric]:.4f}, below promote_min_gain={p.promote_min_gain:g}")
        elif p.promote_max_kl is not None and (kl is None or kl > p.promote_max_kl):
            ok, why = False, f"KL {kl if kl is None else round(kl, 4)} to the starting policy is above promote_max_kl={p.promote_max_kl:g}"
        else:
            ok, why = True, (f"{self.metric} {value:.4f} gains {gain:+.4f} over iteration {before['iteration']}"
                             + (f", KL {kl:.4f} <= {p.promote_max_kl:g}" if p.promote_max_kl is not None else ""))
        self.decisions.append({"iteration": k, "promoted": ok, "reason": why})
        row["promoted"] = ok
        if ok:
            self.mine.add(policy)
            self.promoted = {"iteration": k, "policy_uri": policy, "policy_fingerprint": fp, self.metric: value, "kl": kl,
                             "eval_uri": evaluation["uri"]}
        kept = self.promoted
        run_logger().log(20 if ok else 30, "iteration %s %s: %s%s", k, "promoted" if ok else "not promoted", why,
                         "" if ok else f"; keeping iteration {kept['iteration']}'s policy {kept['policy_uri']}")
        self._publish()
        return ok

    def summary(self) -> dict:
        return {"run": self.run_uri, "flow": self.flow, "metric": self.metric, "promote_min_gain": self.p.promote_min_gain,
                "promote_max_kl": self.p.promote_max_kl, "lineage": self.p.lineage, "promoted": self.promoted,
                "decisions": self.decisions, **({"lineage_note": self.lineage_note} if self.lineage_note else {})}

    def _publish(self) -> None:
        """current.json of the run, then the lineage's pointer if it still names one of this run's policies."""
        so, uri = self.p.storage_options, self.p.lineage and lineage_uri(self.p.root, self.p.lineage)
        pointer = _read(uri, so) if uri else None
        moved = pointer is not None and pointer["promoted"]["policy_uri"] not in self.mine
        self.lineage_note = (f"lineage {self.p.lineage} moved on to {pointer['promoted']['policy_uri']} (run {pointer['run']}) "
                             "since this run started: its pointer stays there") if moved else ""
        _write(store.join(self.run_uri, POINTER), self.summary(), so)
        if uri and not moved:
            _write(uri, self.summary(), so)
        if moved:
            run_logger().warning(self.lineage_note)


def slug(name: str) -> str:
    """An artifact key from a lineage or run name (Prefect keys: lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
