"""One step's rollout: n episodes per prompt through the agent executor (rlhf_core.rollout.episodes) over the
rollout engines, token ids + per-token log-probs + action masks; their rewards from the reward source or the
agent; dynamic sampling (groups whose mean score is outside the range are dropped and more prompts drawn); the
collated experience the training step takes (loop.py drives the steps)."""
from __future__ import annotations

import logging
import time

import torch

from rlhf_core.ppo.batches import collate
from rlhf_core.ppo.placement import Roles

log = logging.getLogger("rlhf_flows")


class RolloutError(RuntimeError):
    """A step could not build its experience (reward source failure, bad rewards); names step and batch."""


def rewards_for(cfg, reward_spec, roles: Roles, prompts: list[str], responses: list[str], labels: list, where: str,
                finished: list[bool] | None = None):
    """(rewards, scores, extra_logs) per sample from the run's reward source; errors name the source and batch.
    `finished` False: the response was cut by generate_max_len (the reward model then scores it without EOS)."""
    from rlhf_core.rollout.rewards import RewardError, check_finite, combine_rewards, compute_rewards

    try:
        if roles.reward is not None:  # every reward model scores; several combine as reward_models_agg says
            from rlhf_core.rollout.reward_model import shard_pairs

            pairs, done = list(zip(prompts, responses)), finished or [True] * len(prompts)
            shards = shard_pairs(len(pairs), len(roles.rewards))  # each reward rank scores its shard
            parts = roles.wait([a.score_each.remote([pairs[i] for i in idx], [done[i] for i in idx])
                                for a, idx in zip(roles.rewards, shards)], roles.rewards, f"generate (scoring {where})")
            got: list[dict] = [{} for _ in parts[0]]  # per model: pair index -> score (a repeated index: its first)
            for idx, part in zip(shards, parts):
                for m, scores in enumerate(part):
                    for i, v in zip(idx, scores):
                        got[m].setdefault(i, v)
            each = [[g[i] for i in range(len(pairs))] for g in got]
            out = combine_rewards(each, cfg.reward_models_agg)
            check_finite(out, f"reward model {reward_spec.model}")
            per_rm = {f"rm{i}": sum(e) / len(e) for i, e in enumerate(each)} if len(each) > 1 else {}
            return out, out, per_rm
        r = compute_rewards(reward_spec, prompts, responses, labels)
        return r.rewards, r.scores or r.rewards, r.extra_logs
    except RewardError as e:
        raise RolloutError(f"{where}: {e}") from None


def executor(cfg, roles: Roles, tok, agent_cls, step: int):
    """The agent executor of one step over the run's rollout engines (rlhf_core.rollout.agent)."""
    from rlhf_core.inputs import models
    from rlhf_core.rollout.agent import SamplingParams
    from rlhf_core.rollout.episodes import CustomExecutor, EngineClient, Executor

    bos = models.adds_bos(tok)

    def decode(ids, skip_special_tokens=True):  # an agent's sampling_params may keep the special tokens
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    if getattr(agent_cls, "__is_executor__", False):  # the file's AgentExecutor.execute runs each episode
        return CustomExecutor(EngineClient(roles.rollouts, cfg.seed * 101 + step), tok, decode,
                              SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k), cfg.generate_max_len, agent_cls)
    return Executor(EngineClient(roles.rollouts, cfg.seed * 101 + step),
                    encode=lambda text: tok(text, add_special_tokens=False).input_ids,
                    encode_prompt=lambda text: models.keep_last(models.prompt_ids(tok, text, bos), cfg.prompt_max_len,
                                                                tok.bos_token_id if bos else None),
                    decode=decode, sampling=SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k),
                    max_new_tokens=cfg.generate_max_len,
                    max_turns=cfg.max_turns if agent_cls else 1, agent_cls=agent_cls)


def _episodes(cfg, roles: Roles, prompts, prompt_ids, idx, step, tok, reward_spec, agent_cls, where, rnd: int):
    """n episodes per prompt of `idx` -> (episodes, rewards, scores, extra metrics)."""
    from rlhf_core.rollout.agent import AgentError
    from rlhf_core.rollout.episodes import run_episodes

    n = cfg.n_samples_per_prompt
    items = [(k, prompts[i]["prompt"], prompt_ids[i], prompts[i].get("label")) for k, i in
             enumerate(i for i in idx for _ in range(n))]
    try:
        eps = run_episodes(executor(cfg, roles, tok, agent_cls, step * 1009 + rnd), items,
                           lambda k: f" (prompt {idx[k // n]}, sample {k % n + 1}) of {where}")
    except AgentError as e:
        raise RolloutError(str(e)) from None
    if agent_cls is not None:
        return eps, [e.reward for e in eps], [e.score for e in eps], {}
    if reward_spec is None and roles.reward is None:  # on-policy distillation alone: the teacher is the signal
        return eps, [0.0] * len(eps), [0.0] * len(eps), {}
    t0 = time.perf_counter()
    raw, scores, extra = rewards_for(cfg, reward_spec, roles, [it[1] for it in items], [e.text for e in eps],
                                     [it[3] for it in items], where, [e.finish_reason != "length" for e in eps])
    return eps, list(raw), list(scores), {**{f"reward_{k}": v for k, v in extra.items()},
                                          "reward_s": time.perf_counter() - t0}


def rollout(cfg, roles: Roles, prompts: list[dict], prompt_ids: list[list[int]], idx: list[int], step: int, tok,
            pad_id: int, reward_spec, agent_cls=None, where: str = "") -> dict:
    """Token in, token out: n episodes per prompt of `idx` through the agent executor (one turn and the run's
    reward source without an agent file; the agent's own turns and rewards with one), grouped by prompt
    (n consecutive rows). Returns the experience the training step needs: the collated batch (with the action
    mask and the rollout log-probs), raw rewards, scores, the kept prompts' indices and metrics (rollout_s
    includes the reward source's reward_s).

    dynamic_filtering (DAPO's dynamic sampling, arXiv:2503.14476 sec. 3.2; OpenRLHF --dynamic_filtering): a
    group whose mean score is not strictly inside dynamic_filtering_reward_range (all right or all wrong: no
    learning signal for a group baseline) is dropped, and more prompts (not in this step's batch, in a
    permutation seeded by step) are sampled for the shortfall, at most dynamic_filtering_max_rounds extra
    rounds; a batch still short is filled with dropped groups (counted), so every step trains on
    rollout_batch_size groups."""
    n, R = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    t0 = time.perf_counter()
    eps, raw, scores, extra = _episodes(cfg, roles, prompts, prompt_ids, idx, step, tok, reward_spec, agent_cls, where, 0)
    groups = [(i, eps[k * n:(k + 1) * n], raw[k * n:(k + 1) * n], scores[k * n:(k + 1) * n]) for k, i in enumerate(idx)]
    if cfg.dynamic_filtering:
        low, high = cfg.dynamic_filtering_reward_range
        used = set(idx)
        pool = [i for i in torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed * 7 + step)).tolist()
                if i not in used]
        kept, dropped, rounds, sampled = [], [], 0, len(groups)
        while True:
            for g in groups:
                (kept if low < sum(g[3]) / n < high else dropped).append(g)
            if len(kept) >= R or rounds >= cfg.dynamic_filtering_max_rounds or not pool:
                break
            rounds += 1
            more, pool = pool[:R - len(kept)], pool[R - len(kept):]
            e2, r2, s2, x2 = _episodes(cfg, roles, prompts, prompt_ids, more, step, tok, reward_spec, agent_cls,
                                      f"{where}, dynamic sampling round {rounds}", rounds)
            groups = [(i, e2[k * n:(k + 1) * n], r2[k * n:(k + 1) * n], s2[k * n:(k + 1) * n]) for k, i in enumerate(more)]
            sampled += len(groups)
            extra["reward_s"] = extra.get("reward_s", 0.0) + x2.get("reward_s", 0.0)
        filled = max(0, R - len(kept))
        extra.update(dynamic_filtering_kept=min(len(kept), R), dynamic_filtering_dropped=len(dropped),
                     dynamic_filtering_rounds=rounds, dynamic_filtering_filled=filled,
                     dynamic_filtering_sampled=sampled)
        groups = kept[:R] + dropped[:filled]
    eps = [e for g in groups for e in g[1]]
    raw, scores = [r for g in groups for r in g[2]], [s for g in groups for s in g[3]]
    t_gen = time.perf_counter() - t0
    if agent_cls is not None:
        for key in sorted({k for e in eps for k in e.extra_logs}):
            vals = [e.extra_logs[key] for e in eps if key in e.extra_logs]
            extra[f"agent_{key}"] = sum(vals) / len(vals)
        extra["agent_turns"] = sum(e.turns for e in eps) / len(eps)
    batch = collate([e.prompt_ids for e in eps], [e.ids for e in eps], pad_id, [e.action_mask for e in eps],
                    [e.logprobs for e in eps])
    return {"batch": batch, "raw": raw, "scores": scores, "prompt_indices": [g[0] for g in groups],
            "truncated": [e.finish_reason == "length" for e in eps], "metrics": extra, "rollout_s": t_gen}


def rollout_logprob_gap(batch: dict, policy_logp: torch.Tensor) -> float:
    """Mean |rollout log-prob - policy log-prob| over the sampled tokens: ~0 when the engine holds the policy's
    weights (a stale engine is off by nats), the signal the off-policy corrections act on."""
    mask = batch["mask"]
    return float(((batch["rollout_logp"] - policy_logp).abs() * mask).sum() / mask.sum().clamp(min=1))


def evaluate(cfg, roles: Roles, rows: list[dict], prompt_ids: list[list[int]], step: int, tok, reward_spec,
             agent_cls=None) -> dict:
    """The held-out evaluation inside a run (OpenRLHF's --eval_dataset / --eval_steps): eval_n_samples_per_prompt
    samples of every held-out prompt at eval_temperature through the rollout engines, rewarded as the training samples
    are (the run's reward source, or the agent); the figures of `eval_figures`, and eval_s."""
    n = cfg.eval_n_samples_per_prompt
    ecfg = cfg.model_copy(update={"n_samples_per_prompt": n, "temperature": cfg.eval_temperature,
                                  "generate_max_len": cfg.eval_generate_max_len or cfg.generate_max_len})
    t0 = time.perf_counter()
    eps, raw, _, _ = _episodes(ecfg, roles, rows, prompt_ids, list(range(len(rows))), step, tok, reward_spec,
                               agent_cls, f"the evaluation at step {step}", 7919)
    out = {**eval_figures(raw, n, [r.get("source") for r in rows], [len(e.ids) for e in eps],
                          [e.finish_reason == "length" for e in eps]), "eval_s": time.perf_counter() - t0}
    log.info("ppo step %d: evaluation on %d held-out prompts x %d: pass1 %.4f pass%d %.4f (%.1fs)", step, len(rows), n,
             out["eval_pass1"], n, out[f"eval_pass{n}"], out["eval_s"])
    return out


def eval_figures(rewards: list[float], n: int, sources: list[str | None], lengths: list[int],
                 truncated: list[bool]) -> dict:
    """OpenRLHF's eval figures (ppo_trainer.py compute_eval_metrics) of n samples per prompt (`rewards`, `lengths`,
    `truncated`: per sample, a prompt's n consecutive; `sources`: per prompt), over prompts: eval_pass{n} the mean of
    the best sample's reward (pass@n with 0/1 rewards), eval_pass1 the mean of the mean reward; eval_response_length
    the mean sampled tokens, eval_truncated_rate the share of samples cut by the length limit; per data source too
    (eval_{source}_pass1, ...: the source's last path part) when the prompts come from several."""
    srcs = [s or "" for s in sources]
    out = {}
    for src in [None] + (sorted(set(srcs)) if len(set(srcs)) > 1 else []):
        keep = [i for i, s in enumerate(srcs) if src is None or s == src]
        groups = [rewards[i * n:(i + 1) * n] for i in keep]
        samples = [j for i in keep for j in range(i * n, (i + 1) * n)]
        name = "eval" if src is None else f"eval_{src.rstrip('/').rsplit('/', 1)[-1]}"
        out[f"{name}_pass{n}"] = sum(max(g) for g in groups) / len(groups)
        out[f"{name}_pass1"] = sum(sum(g) / n for g in groups) / len(groups)
        out[f"{name}_response_length"] = sum(lengths[j] for j in samples) / len(samples)
        out[f"{name}_truncated_rate"] = sum(truncated[j] for j in samples) / len(samples)
    return out
