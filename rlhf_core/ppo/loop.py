"""The online-RL driver: place the roles on Ray, then per step
    rollout (`rollout`: n episodes per prompt through the agent executor, rlhf_core.rollout.agent, token ids + per-token
    log-probs + action mask; the reward source or the agent's rewards; dynamic sampling) -> reference log-probs (when a
    KL term is used) -> critic values (gae) -> old log-probs -> advantages (rl_math) -> critic and policy
    updates (max_epochs passes, DeepSpeed) -> weight sync into the rollout engines (rlhf_core.ppo.weight_sync)
and every `save_steps` a checkpoint to the store (actor, critic, optimizers, schedulers, KL controller,
reward statistics, prompt position, and with async_train the rollouts generated ahead and not yet trained on).
Every random draw is seeded from (seed, step) and async rollouts use a fixed weights version (RolloutFeed), so
a resumed run trains on exactly the batches the uninterrupted run would have.

No shared disk (rlhf_core.ppo.node_store): the roles read their models from the store into their own node's
cache, each learner rank uploads its own checkpoint files and the driver commits the checkpoint once all
returned; policy rank 0 uploads the final model under the output prefix and the stage commits from the store.

Prompts are visited in a per-episode permutation, rollout_batch_size at a time (a remainder smaller than a
batch is left out of that episode, like a drop_last data loader). `cfg` is the ppo stage's config (read by
attribute); nothing here imports Prefect.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_core.rl import rl_math
from rlhf_core.inputs import model_inputs
from rlhf_core.ppo import node_store, placement, plan
from rlhf_core.ppo.feed import RolloutFeed
from rlhf_core.ppo.placement import Roles

from rlhf_core.ppo.rollout import evaluate, rollout, rollout_logprob_gap
from rlhf_core.ppo.step_metrics import model_sizes, rollout_sample, throughput
from rlhf_core.runtime import faults
from rlhf_core.runtime.devices import peak_memory_gb
from rlhf_core.train import checkpoints

log = logging.getLogger("rlhf_flows")


@dataclass
class State:
    step: int = 0
    kl_coef: float = 0.0
    moments: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    hf_files: list = field(default_factory=list)  # save_hf_ckpt: the HF folders uploaded so far, for the commit
    best: dict | None = None  # the best evaluation so far: metric, value, step (its policy under best/)


def _split(batch: dict, parts: int) -> list[dict]:
    n = batch["ids"].shape[0] // parts
    return [{k: v[i * n:(i + 1) * n] for k, v in batch.items()} for i in range(parts)]


def _forward(roles: Roles, group: list, batch: dict, what: str) -> torch.Tensor:
    return torch.cat(roles.wait([a.forward.remote(s) for a, s in zip(group, _split(batch, len(group)))], group,
                                f"train ({what})"))


def _train(roles: Roles, group: list, batch: dict, coef: float) -> dict:
    parts = roles.wait([a.train.remote(s, coef) for a, s in zip(group, _split(batch, len(group)))], group,
                       "train (updates)")
    out = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}  # every rank's metrics, averaged
    for k in out:
        if k.endswith("_tokens_per_s"):
            out[k] = sum(p[k] for p in parts)  # the group's throughput
        elif k.endswith("_peak_mem_gb"):
            out[k] = max(p[k] for p in parts)  # the fullest rank
    return out


def learner_settings(cfg) -> dict:
    """What the Learner actors read, as a plain dict (they never see the stage's config class)."""
    low, high = cfg.eps_clip_low_high or (cfg.eps_clip, cfg.eps_clip)
    keys = ("seed", "bf16", "gradient_checkpointing", "actor_learning_rate", "critic_learning_rate", "adam_betas", "l2",
            "lr_warmup_ratio", "min_lr_ratio", "train_batch_size", "micro_train_batch_size", "max_norm", "zero_stage",
            "max_epochs", "generate_max_len", "dual_clip", "use_kl_loss", "kl_estimator", "entropy_loss_coef",
            "value_clip", "reward_max_len", "enable_vllm_is_correction", "vllm_is_truncated_threshold", "use_icepop",
            "temperature", "deepspeed_enable_sleep", "ref_num_nodes", "ref_num_gpus_per_node", "ref_reward_offload",
            "packing_samples", "use_dynamic_batch", "train_max_tokens_per_gpu", "adam_offload", "value_head_prefix",
            "weight_sync_bucket_mb", "attn_implementation", "shared_prompt", "lr_scheduler", "tokenizer_chat_template",
            "overlap_comm", "deepcompile")
    lora = {"lora_rank": 0, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": None, "lora_merge": False}
    return {**{k: getattr(cfg, k) for k in keys}, **{k: getattr(cfg, k, v) for k, v in lora.items()},
            "eps_clip_low": low, "eps_clip_high": high,
            "ptx_coef": cfg.ptx_coef if cfg.pretrain_data else 0.0,
            "micro_rollout_batch_size": cfg.micro_rollout_batch_size or cfg.micro_train_batch_size,
            "rollout_max_tokens_per_gpu": cfg.rollout_max_tokens_per_gpu or cfg.train_max_tokens_per_gpu,
            "loss_agg": cfg.loss_agg or "token", "kl_loss_agg": cfg.kl_loss_agg or cfg.loss_agg or "token",
            "loss_agg_empty_rows": cfg.loss_agg_empty_rows}


def train(cfg, prompts: list[dict], prompt_ids: list[list[int]], pad_id: int, tok, dirs: dict, reward_spec,
          work: Path, ckpt_uri: str, fingerprint: str, storage_options: dict | None = None, agent_cls=None,
          writer=None, pretrain: list[list[int]] | None = None, shapes: dict | None = None,
          held_out: tuple[list[dict], list[list[int]]] | None = None) -> dict:
    """Run the whole online-RL job; returns {"history", "steps_done", "planned_steps", ...}. `dirs` names the
    models (a local folder, or a committed artifact / plain HF folder URI each role fetches into its own node's
    cache): policy, critic (gae) or None, reference (KL term) or None, reward_model or None. `tok` is the
    policy's tokenizer; `agent_cls` the agent file's AgentInstance (None: single turn). `shapes`: the models' sizes
    (rlhf_core.ppo.plan.shapes_of) when the memory plan is still to check, against the cluster's GPUs, once joined
    (the stage checks it itself when their size is known before). `work`: the driver's own
    scratch folder. The trained model goes to `writer` (the stage's store.ArtifactWriter): uploaded by policy
    rank 0, its files recorded in the writer; the caller commits. `pretrain`: the PTX rows' token ids (every
    policy rank draws its own micro-batches from them). `held_out`: the evaluation's prompt rows and token ids
    (eval_prompts_uri), evaluated every eval_steps steps and after the last (rollout.evaluate), the best policy by
    save_best_metric kept under the artifact's best/."""
    from rlhf_core.rollout.generation import _ray_up

    R, n = cfg.rollout_batch_size, cfg.n_samples_per_prompt
    per_episode = len(prompts) // R
    total = cfg.num_episodes * per_episode
    opt_steps = total * (R * n // cfg.train_batch_size) * cfg.max_epochs
    hp = learner_settings(cfg)
    state = State(kl_coef=cfg.init_kl_coef)
    work.mkdir(parents=True, exist_ok=True)
    weights = sum(f["size"] for f in model_inputs.model_manifest(dirs["policy"], storage_options).files
                  if f["path"].endswith(".safetensors"))
    node_store.use_store(storage_options)  # every actor gets the store's options (node_store.actor_env)
    # the object-store weight path puts the state dict in Ray's object store each step: room for it
    started = _ray_up(cfg.ray_address, object_store_bytes=3 * weights if cfg.weight_sync_backend == "object_store" else 0)
    roles = feed = tracker = None
    try:
        import ray

        # GPUs or CPUs as the cluster joined says (not this driver's devices), checked before any actor starts
        gpus = placement.roles_on_gpus(cfg, ray.cluster_resources())
        placement.check_devices(cfg, gpus, f"the Ray cluster {'at ' + cfg.ray_address if cfg.ray_address else 'of this stage'}"
                                           f" advertises no GPU")
        if gpus and shapes:
            gpu_gb = cfg.gpu_memory_gb or placement.cluster_gpu_gb(cfg.ray_timeout_s)
            if gpu_gb:
                plan.check(cfg, shapes, gpu_gb, reported=cfg.gpu_memory_gb is None)
            else:
                log.warning("ppo: no GPU of the cluster told its memory: the memory plan is not checked (set "
                            "gpu_memory_gb)")
        longest = max(len(p) for p in prompt_ids) + cfg.generate_max_len
        if held_out:
            longest = max(longest, max(len(p) for p in held_out[1]) + (cfg.eval_generate_max_len or cfg.generate_max_len))
        roles = Roles(cfg, dirs["policy"], dirs["critic"], dirs["reference"], dirs["reward_model"], opt_steps, hp,
                      longest, reward_spec, gpus, dirs.get("teachers") or [])
        if pretrain:
            roles.wait([a.set_pretrain.remote(pretrain) for a in roles.policy], roles.policy, "setting up (PTX rows)")
        # the newest checkpoint whose every sha256 verifies, each rank checking the files it downloads into its
        # own node's cache; a corrupt one is logged and passed over before any rank loads
        meta, local = checkpoints.resume_point(ckpt_uri, fingerprint, work / "resume", storage_options,
                                               lambda m: _fetch_checkpoint(roles, m, work / "resume", storage_options))
        restored = {}
        if meta:  # resume: the learners (awake, the engines still asleep since setup), then the driver's state; then
            # the learners sleep before the engines wake for the restored weights (Roles.phase: releases first)
            roles.wait([a.load_checkpoint.remote(meta) for a in roles.policy + roles.critic], roles.policy + roles.critic,
                       "resuming (loading the checkpoint)")
            state = State(**json.loads((local / "state.json").read_text()))
            if writer is not None and state.hf_files:  # the HF checkpoints uploaded before the interruption
                writer.add_files(state.hf_files)
            if (local / "rollouts.pt").exists():
                restored = torch.load(local / "rollouts.pt", weights_only=True)
            roles.phase("sync")
            roles.weights.sync()
            log.info("ppo: resumed from %s at step %d of %d%s", meta["uri"], state.step, total,
                     f"; the rollouts of steps {[s + 1 for s in sorted(restored)]} generated before the checkpoint "
                     f"and not yet trained on are restored, not regenerated" if restored else "")
        resumed_from = state.step
        sizes = model_sizes(roles, cfg)  # parameters per model, and the devices of the run, for the step's FLOPs
        tracker = _tracker(cfg, work, writer, fingerprint, state.history)  # replays a resumed run's steps first
        kl_ctl = rl_math.KLController(state.kl_coef, cfg.kl_target, cfg.kl_horizon)
        moments = rl_math.RunningMoments(**state.moments) if state.moments else rl_math.RunningMoments()
        use_ref = roles.reference is not None

        def prompts_of(step: int) -> list[int]:
            episode, k = divmod(step, per_episode)
            order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed + episode)).tolist()
            return order[k * R:(k + 1) * R]

        def where_of(step: int) -> str:
            episode, k = divmod(step, per_episode)
            return f"step {step + 1} (episode {episode + 1}, prompts {k * R}..{(k + 1) * R - 1} of the permutation)"

        feed = RolloutFeed(cfg, lambda s, i: rollout(cfg, roles, prompts, prompt_ids, i, s, tok, pad_id, reward_spec,
                                                     agent_cls, where_of(s)),
                           [(s, prompts_of(s)) for s in range(state.step, total)], state.step, restored)
        for step in range(state.step, total):
            t_step = time.perf_counter()
            episode, k = divmod(step, per_episode)
            idx = prompts_of(step)
            # 1. rollout through the agent executor: token ids in, token ids + per-token log-probs out, rewards
            #    (async_train: generated ahead while the previous step trained; t_rollout is the wait)
            roles.phase("generate")
            with roles.moment("generating"):
                exp0, t_rollout = feed.get(step, idx)
            batch, raw, extra, idx = exp0["batch"], exp0["raw"], exp0["metrics"], exp0["prompt_indices"]
            # 2. length penalties (OpenRLHF's, before any baseline), normalisation
            scores = torch.tensor(raw, dtype=torch.float32)
            if cfg.overlong_buffer_len is not None or cfg.stop_properly_penalty_coef is not None:
                truncated = torch.tensor(exp0.get("truncated", [False] * len(raw)))
                scores, n_over, n_stop = rl_math.length_penalties(
                    scores, batch["mask"].sum(-1), truncated, cfg.generate_max_len, cfg.overlong_buffer_len,
                    cfg.overlong_penalty_factor, cfg.stop_properly_penalty_coef)
                extra = {**extra, "overlong_penalized": n_over, "truncated_penalized": n_stop}
            if cfg.running_reward_norm:
                moments.update(scores)
                scores = moments.normalize(scores)
            # 3. reference, critic and policy forward passes on the same tokens
            t0 = time.perf_counter()
            roles.phase("train")
            ref_logp = _forward(roles, roles.reference, batch, "reference log-probs") if use_ref else None  # its ranks (placement.Roles)
            t_ref = time.perf_counter() - t0
            # On-policy, one optimizer step per rollout and no KL term: the learners' own first forward runs on
            # the old weights (no update has happened yet), so they take old_logp = logp.detach() there and the
            # separate experience pass is skipped (TRL does the same with one step per generation).
            actor_trained = step >= cfg.freezing_actor_steps
            reuse_old = actor_trained and not use_ref and cfg.max_epochs == 1 and cfg.train_batch_size == R * n
            t0 = time.perf_counter()
            old_logp = None if reuse_old else _forward(roles, roles.policy, batch, "old log-probs")
            t_old = time.perf_counter() - t0
            values = _forward(roles, roles.critic, batch, "values") if roles.critic else None
            mask = batch["mask"]
            kl = rl_math.kl_estimate(old_logp, ref_logp, cfg.kl_estimator) * mask if use_ref else torch.zeros_like(mask)  # (B, T)
            reward_kl = 0.0 if cfg.use_kl_loss else kl_ctl.value
            clip = tuple(cfg.reward_clip_range) if cfg.reward_clip_range else None
            adv, ret = rl_math.advantages_and_returns(cfg.advantage_estimator, scores, mask, n, kl, reward_kl,
                                                      cfg.gamma, cfg.lambd, values, clip,
                                                      std_norm=not cfg.no_advantage_std_norm)
            if roles.teachers:  # on-policy distillation: each sampled token's teacher term (rl_math.distill_advantages)
                t0 = time.perf_counter()
                student = old_logp if old_logp is not None else batch["rollout_logp"]  # the sampling policy's
                teacher = [_forward(roles, [t], batch, f"teacher{j} log-probs") for j, t in enumerate(roles.teachers)]
                term = rl_math.distill_advantages(student, teacher, mask, cfg.teacher_coef)
                adv, ret = adv + term, ret + term
                extra = {**extra, "distill_kl": float(-(term * mask).sum() / mask.sum().clamp(min=1) / cfg.teacher_coef),
                         "teacher_s": time.perf_counter() - t0}
            exp = {**batch, "adv": adv, "returns": ret}
            if old_logp is not None:
                exp["old_logp"] = old_logp
            if use_ref:
                exp["ref_logp"] = ref_logp
            if values is not None:
                exp["old_values"] = values
            # 4. updates: the critic every step, the policy after freezing_actor_steps
            t0 = time.perf_counter()
            metrics = {}
            if roles.critic:
                metrics.update(_train(roles, roles.critic, exp, 0.0))
            if actor_trained:
                metrics.update(_train(roles, roles.policy, exp, kl_ctl.value))
            t_train = time.perf_counter() - t0
            roles.phase("sync")
            feed.before_sync(step)  # async: the rollout that needs the weights before this update is done
            t_sync = roles.weights.sync() if actor_trained else 0.0
            feed.synced(step)
            evaluated = {}
            if held_out and ((step + 1) % cfg.eval_steps == 0 or step + 1 == total):
                roles.phase("generate")  # the engines hold the new weights: wake their KV cache
                evaluated = evaluate(cfg, roles, *held_out, step + 1, tok, reward_spec, agent_cls)
                state.best = _keep_best(cfg, roles, writer, state.best, evaluated, step + 1)
            seq_kl = ((kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            kl_ctl.update(seq_kl, R * n)
            rec = {"step": step + 1, "episode": episode + 1, "prompt_indices": idx, "reward": float(torch.tensor(raw).mean()),
                   "reward_std": float(torch.tensor(raw).std()), "kl": seq_kl, "kl_coef": kl_ctl.value,
                   "response_length": float(mask.sum(-1).mean()), "advantage_abs": float((adv.abs() * mask).sum() / mask.sum()),
                   "rollout_logprob_gap": metrics.pop("rollout_logprob_gap", float("nan")) if old_logp is None
                   else rollout_logprob_gap(batch, old_logp), "old_logp_reused": old_logp is None,
                   "actor_trained": actor_trained, **metrics, **extra, **evaluated,
                   "rollout_s": t_rollout, "reference_s": t_ref, "old_logp_s": t_old, "train_s": t_train,
                   "weight_sync_s": t_sync, "weight_sync_method": roles.weights.method,
                   "weight_sync_bytes": roles.weights.bytes if actor_trained else 0, "rollout_tokens_per_s": float(mask.sum()) / max(1e-9, exp0["rollout_s"]),
                   "driver_peak_mem_gb": peak_memory_gb(), **roles.peak_memory()}
            faults.pause_step()  # tests slow a run to kill it mid-stage (runtime.faults)
            rec["step_s"] = time.perf_counter() - t_step
            rec.update(throughput(cfg, sizes, batch, rec["step_s"] - rec.get("eval_s", 0.0), old_logp is None, use_ref,
                                   bool(roles.critic), actor_trained))  # the evaluation's time is not the step's work
            state.history.append(rec)
            state.step = step + 1
            logged = state.step % cfg.log_steps == 0 or state.step == total  # --logging_steps
            if logged and writer is not None and getattr(cfg, "rollout_samples_per_step", 0):
                writer.write_table(f"rollouts/step-{state.step:06d}.parquet",
                                   rollout_sample(cfg, tok, prompts, idx, batch, raw, adv, exp0.get("truncated"),
                                                  state.step), counted=False)
            if logged:
                if tracker is not None:
                    tracker.log(rec)
                log.info("ppo step %d/%d reward %.3f kl %.4f entropy %.3f logprob_gap %.2g length %.1f policy_loss %s "
                         "weight sync %s %.2fs (%.2fs)", state.step, total, rec["reward"], seq_kl,
                         metrics.get("entropy", float("nan")), rec["rollout_logprob_gap"], rec["response_length"],
                         f"{metrics.get('policy_loss', float('nan')):.4f}", roles.weights.method, t_sync, rec["step_s"])
            if cfg.save_steps and state.step % cfg.save_steps == 0 and state.step < total:
                state.kl_coef = kl_ctl.value
                state.moments = {"mean": moments.mean, "m2": moments.m2, "count": moments.count}
                if cfg.save_hf_ckpt:  # OpenRLHF's {ckpt_path}/{tag}_hf (ppo_actor.py save_checkpoint), kept in the artifact
                    state.hf_files += _save_hf(roles, writer, f"hf_checkpoints/step-{state.step}")
                _checkpoint(roles, state, work, ckpt_uri, fingerprint, cfg.max_ckpt_num, storage_options,
                            feed.pending(state.step))
        _save_model(roles, writer, cfg.save_value_network)
        tracked, tracker = tracker.close() if tracker is not None else [], None
        return {"history": state.history, "steps_done": state.step, "planned_steps": total, "tracked": tracked,
                "best_eval": state.best,
                "resumed_from_step": resumed_from, "final_kl_coef": kl_ctl.value, "placement": dict(roles.plan),
                "param_elements_per_rank": {kind: roles.wait([a.param_elements.remote() for a in group], group,
                                                             "reporting the parameters each rank holds")
                                            for kind, group in (("policy", roles.policy), ("critic", roles.critic),
                                                                ("reward", roles.rewards))
                                            if group},
                "role_gpus": roles.gpu_ids(), "ray_address": ray.get_runtime_context().gcs_address, "weight_sync_method": roles.weights.method,
                "weight_sync_bytes": roles.weights.bytes}
    finally:
        if tracker is not None:  # a failed run's steps so far stay readable in `work`
            tracker.close()
        if roles is not None and roles.timeline is not None:  # trace_memory: the moments so far, a failed run's too
            try:
                (work / "memory_timeline.json").write_text(json.dumps(roles.memory_timeline(), indent=1))
            except Exception as e:  # noqa: BLE001 - a role already gone: the run's own error is the one to raise
                log.warning("ppo: the memory timeline could not be collected (%s)", e)
        if feed is not None:
            feed.halt()
        if roles is not None:
            roles.close()  # a rollout in flight fails fast once its engine is gone
        if feed is not None:
            feed.close()
        if started:
            import ray

            ray.shutdown()


def _tracker(cfg, work: Path, writer, fingerprint: str, history: list):
    """The driver's TensorBoard / W&B writer into work/tracking (the stage uploads it into the artifact), or None.
    A resumed run first replays the steps its checkpoint restored, so the files hold every logged step once and the
    W&B run (keyed by the run's fingerprint) continues."""
    if not (cfg.use_tensorboard or cfg.use_wandb):
        return None
    from rlhf_core.runtime.tracking import Tracker

    shutil.rmtree(work / "tracking", ignore_errors=True)
    name = cfg.wandb_run_name or ("/".join(writer.uri.rstrip("/").split("/")[-3:]) if writer is not None else None)
    tracker = Tracker(work / "tracking", tensorboard=cfg.use_tensorboard, wandb=cfg.use_wandb, prefix="ppo",
                      project=cfg.wandb_project, run_name=name, run_id=fingerprint[:32],
                      config=cfg.semantic() if hasattr(cfg, "semantic") else None)
    for rec in history:
        if rec["step"] % cfg.log_steps == 0:
            tracker.log(rec)
    return tracker


def _checkpoint(roles: Roles, state: State, work: Path, ckpt_uri: str, fingerprint: str, keep: int,
                storage_options: dict | None, pending: dict | None = None) -> None:
    """Every learner rank uploads its own files (actor/, critic/); the driver its own (state.json, and the
    rollouts generated ahead and not yet trained on: rollouts.pt), then commits the marker naming them all."""
    tag = f"step-{state.step}"
    group = roles.policy + roles.critic
    files = [f for part in roles.wait([a.save_checkpoint.remote(ckpt_uri, tag) for a in group], group,
                                      f"saving checkpoint {tag}") for f in part]
    local = work / "ckpt"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    (local / "state.json").write_text(json.dumps(state.__dict__))
    if pending:
        torch.save(pending, local / "rollouts.pt")
    files += checkpoints.upload_files(local, ckpt_uri, tag, storage_options)
    checkpoints.commit(ckpt_uri, tag, fingerprint, files, {"step": state.step}, storage_options, keep)
    shutil.rmtree(local, ignore_errors=True)
    log.info("ppo: checkpoint %s committed%s", tag, f" with the rollouts of steps {[s + 1 for s in sorted(pending)]}"
             if pending else "")


def _fetch_checkpoint(roles: Roles, meta: dict, local: Path, storage_options: dict | None) -> Path:
    """The driver's files of checkpoint `meta` into `local`; every learner rank's own into its node's cache. Each
    file's sha256 is checked where it lands; a corrupt one raises CheckpointError (naming it) before any loads."""
    mine = [f for f in meta["files"] if f["path"].split("/", 1)[0] not in ("actor", "critic")]
    dest = checkpoints.download({**meta, "files": mine}, local, storage_options)
    group = roles.policy + roles.critic
    errors = [e for e in roles.wait([a.load_checkpoint.remote(meta, fetch=True) for a in group], group,
                                    f"fetching checkpoint {meta['tag']}") if e]
    if errors:
        raise checkpoints.CheckpointError(errors[0], meta["tag"])
    return dest


def _keep_best(cfg, roles: Roles, writer, best: dict | None, evaluated: dict, step: int) -> dict | None:
    """save_best_metric (OpenRLHF's --ckpt.best_metric_key, auto: its pass1): when this evaluation beats the best so
    far, the policy goes to the artifact's best/ (an HF folder, and best/best.json naming metric, value and step)."""
    key = cfg.save_best_metric or "eval_pass1"
    if key == "none" or writer is None:
        return best
    if key not in evaluated:
        raise ValueError(f"save_best_metric {key} is not a figure of the evaluation (it has {', '.join(sorted(evaluated))})")
    if best is not None and evaluated[key] <= best["value"]:
        return best
    best = {"metric": key, "value": evaluated[key], "step": step}
    _save_hf(roles, writer, "best")
    writer.write_json("best/best.json", best)
    log.info("ppo: new best %s %.4f at step %d: the policy is kept under best/", key, evaluated[key], step)
    return best


def _save_hf(roles: Roles, writer, sub: str) -> list[dict]:
    """save_hf_ckpt: the policy now, as an HF folder under the artifact's `sub` (the final model's path:
    node_store.save_model); its files, recorded in the writer."""
    roles.wait([a.save_model.remote(writer.uri, sub) for a in roles.policy], roles.policy, f"saving {sub}")
    writer.note({sub.split("/", 1)[0]})
    files = roles.wait([roles.policy[0].save_model.remote(writer.uri, sub, upload=True)], roles.policy[:1],
                       f"uploading {sub}")[0]
    writer.add_files(files)
    return files


def _save_model(roles: Roles, writer, save_critic: bool) -> None:
    """The trained policy (and critic under critic/) uploaded by rank 0 of its group under the writer's prefix,
    names noted in the artifact's journal before the upload; the files recorded in the writer for its commit."""
    groups = [("", roles.policy)] + ([("critic", roles.critic)] if roles.critic and save_critic else [])
    names = set()
    for sub, group in groups:
        rel = roles.wait([a.save_model.remote(writer.uri, sub) for a in group], group, "saving the model")[0]
        names |= {sub} if sub else {n.split("/", 1)[0] for n in rel}
    writer.note(names)
    for sub, group in groups:
        writer.add_files(roles.wait([group[0].save_model.remote(writer.uri, sub, upload=True)], group[:1],
                                    "uploading the model")[0])

