"""Reward sources behind one interface:

    r = compute_rewards(RewardSpec(model=rm_uri), prompts, responses, labels, num_engines=2)
    r.rewards  # one float per (prompt, response), in input order; r.scores / r.extra_logs when given

Sources (exactly one per RewardSpec):
  model       a reward-model folder or committed artifact: AutoModelForSequenceClassification with one label,
              or an OpenRLHF-style backbone + linear value head (`{value_head_prefix}.weight`). The text
              prompt, response (+ EOS, as OpenRLHF's reward datasets append it) is tokenized exactly as train_rm
              tokenized its pairs (rlhf_core.train.batches.Encoder) and scored at its last token:
              left padding puts every last real token at position -1, and position ids follow the attention
              mask so padding never changes a score. Normalisation: (r - reward_mean) / reward_std when the
              model's config.json holds `reward_mean`/`reward_std` (written by train_rm), or OpenRLHF's
              `normalize_reward` + `mean`/`std`. Sorted by length, batched, on Ray actors like generation.
              Or a process reward model (train_prm; its config.json names `prm_placeholder_token` and
              `prm_reward_tokens`): the text prompt + response is tokenized whole (as train_prm did), each
              step's reward is the softmax probability of the positive (first) reward token over the reward
              tokens at that step's placeholder, and the reward is `prm_aggregate` of the steps: min (the
              default: a solution is as good as its weakest step, Math-Shepherd's verifier, arXiv:2312.08935),
              last, or mean; `step_rewards` holds the per-step values. A causal-LM PRM trained elsewhere
              (e.g. Math-Shepherd's) is named by `prm_tokens`: its placeholder, then its reward tokens.
              A policy's samples hold no placeholders: `prm_step_separator` (e.g. "\n") splits each response
              into steps there and ends every non-blank step with " " + placeholder (Math-Shepherd's layout,
              mark_steps) before scoring; the stored response is left as it was.
  func_path   a Python file defining OpenRLHF's `reward_func(queries, prompts, labels)` (queries are
              prompt + response) returning a tensor/list or a dict with `rewards` (+ `scores`, `extra_logs`).
  remote_url  an HTTP reward server in OpenRLHF's serve_rm shape: POST {"query", "prompts", "labels"} ->
              {"rewards": [...]} (+ optional "scores"); timeout and retries with backoff.
Every reward must be finite: NaN/inf raise RewardError naming the rows.
"""
from __future__ import annotations

import logging
import time
import types

from rlhf_core import store
from rlhf_core.rollout.generation import run_engines
from rlhf_core.rollout.reward_model import RMEngine
from rlhf_core.rollout.reward_spec import (RewardError, RewardSpec, Rewards, check_finite,  # noqa: F401  (the interface)
                                           combine_rewards)

log = logging.getLogger("rlhf_flows")


# ---------------------------------------------------------------------------------------------- reward_func file
def load_reward_func(path: str, storage_options: dict | None = None):
    """The `reward_func` defined in a Python file (any fsspec URI)."""
    fs, p = store.filesystem(path, storage_options)
    if not fs.exists(p):
        raise RewardError(f"reward_func file {path} does not exist")
    with fs.open(p, "r") as f:
        code = f.read()
    module = types.ModuleType("rlhf_flows_reward_func")
    module.__file__ = str(path)
    try:
        exec(compile(code, str(path), "exec"), module.__dict__)
    except Exception as e:
        raise RewardError(f"reward_func file {path} failed to import: {type(e).__name__}: {e}") from e
    fn = module.__dict__.get("reward_func")
    if not callable(fn):
        raise RewardError(f"reward_func file {path} defines no reward_func(queries, prompts, labels)")
    return fn


def _floats(value, what: str) -> list[float]:
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().reshape(-1).tolist()
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError):
        raise RewardError(f"{what} returned rewards of type {type(value).__name__}, not numbers") from None


def _parse(result, n: int, what: str) -> Rewards:
    """OpenRLHF's reward_func result: a tensor/list, or a dict with rewards (+ scores, extra_logs)."""
    if isinstance(result, dict):
        if "rewards" not in result:
            raise RewardError(f"{what} returned a dict without 'rewards' (keys {sorted(result)})")
        rewards = _floats(result["rewards"], what)
        scores = _floats(result["scores"], what) if result.get("scores") is not None else None
        logs = {k: sum(_floats(v, what)) / max(1, len(_floats(v, what))) if not isinstance(v, (int, float)) else float(v)
                for k, v in (result.get("extra_logs") or {}).items()}
    else:
        rewards, scores, logs = _floats(result, what), None, {}
    if len(rewards) != n or (scores is not None and len(scores) != n):
        raise RewardError(f"{what} returned {len(rewards)} rewards for {n} queries")
    return Rewards(rewards, scores, logs)


def _remote(url: str, queries, prompts, labels, timeout_s: float, retries: int) -> dict:
    import requests

    last = None
    for attempt in range(max(1, retries)):
        try:
            resp = requests.post(url, json={"query": queries, "prompts": prompts, "labels": labels}, timeout=timeout_s)
            resp.raise_for_status()
            return resp.json()
        except (requests.RequestException, ValueError) as e:
            last = e
            log.warning("reward server %s attempt %d/%d failed: %s", url, attempt + 1, retries, e)
            if attempt + 1 < retries:
                time.sleep(min(8.0, 0.5 * 2 ** attempt))
    raise RewardError(f"remote reward server {url} unreachable after {max(1, retries)} attempts: "
                      f"{type(last).__name__}: {last}")


# ---------------------------------------------------------------------------------------------- the interface
def compute_rewards(spec: RewardSpec, prompts: list[str], responses: list[str], labels: list | None = None,
                    num_engines: int = 0, ray_address: str | None = None) -> Rewards:
    """Rewards for (prompt, response) pairs from the one source `spec` names; finite, in input order."""
    labels = list(labels) if labels is not None else [None] * len(prompts)
    kind = spec.kind
    if kind == "model":
        rated = run_engines(RMEngine, (spec.model, spec), "rate", list(zip(prompts, responses)), {}, num_engines,
                            ray_address, num_gpus_per_engine=1, label="score")  # one GPU each on a GPU cluster
        steps = [s for _, s in rated]
        out = Rewards([r for r, _ in rated], step_rewards=steps if steps and steps[0] is not None else None)
        what = f"reward model {spec.model}"
    else:
        fn = load_reward_func(spec.func_path, spec.storage_options) if kind == "func_path" else None
        what = f"reward_func in {spec.func_path}" if fn else f"remote reward server {spec.remote_url}"
        out = Rewards([], None, {})
        logs: dict[str, list[tuple[float, int]]] = {}
        for s in range(0, len(prompts), spec.batch_size):
            q = [p + r for p, r in zip(prompts[s:s + spec.batch_size], responses[s:s + spec.batch_size])]
            ps, ls = prompts[s:s + spec.batch_size], labels[s:s + spec.batch_size]
            if fn:
                try:
                    raw = fn(q, ps, ls)
                except Exception as e:
                    raise RewardError(f"{what} raised {type(e).__name__}: {e}") from e
            else:
                raw = _remote(spec.remote_url, q, ps, ls, spec.timeout_s, spec.retries)
            part = _parse(raw, len(q), what)
            out.rewards += part.rewards
            if part.scores is not None:
                out.scores = (out.scores or []) + part.scores
            for k, v in part.extra_logs.items():
                logs.setdefault(k, []).append((v * len(q), len(q)))
        out.extra_logs = {k: sum(a for a, _ in v) / sum(n for _, n in v) for k, v in logs.items()}  # per-row mean
    check_finite(out.rewards, what)
    return out
