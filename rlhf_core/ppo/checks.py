"""The ppo stage's settings checked together before Ray starts: each rule raises ValueError naming the settings and why
(the stage's Config runs them as its validator, so a bad config is refused by pydantic naming the stage). The rules
follow OpenRLHF's train_ppo_ray assertions where it has them and say so; the others guard what would otherwise
hang, leak or silently do less (issue 35). `cfg` is the stage's Config (any object with its fields)."""
from __future__ import annotations

import torch

from rlhf_core.rl import rl_math


def check_all(cfg) -> None:
    """Every rule, in the order a user fixes them: the estimator and reward settings, the engines, the learners
    and their placement, then the devices the cluster has."""
    settings(cfg)
    engines(cfg)
    learners(cfg)
    devices(cfg)


def settings(cfg) -> None:
    if bool(getattr(cfg, "eval_prompts_uri", None)) != bool(getattr(cfg, "eval_steps", 0)):
        raise ValueError("eval_prompts_uri and eval_steps go together: held-out prompts are evaluated every eval_steps "
                         "steps (OpenRLHF --eval_dataset with --eval_steps); set both, or neither")
    if getattr(cfg, "eval_prompts_uri", None) and not any(getattr(cfg, k) for k in (
            "reward_model_uri", "reward_func_path", "remote_rm_url", "agent_func_path", "agent_executor_path")):
        raise ValueError("eval_prompts_uri: the evaluation scores its samples with the run's reward source or agent, "
                         "and this run has none (distillation alone): give one, or drop the evaluation")
    if getattr(cfg, "save_best_metric", "") not in ("", "none") and not getattr(cfg, "eval_steps", 0):
        raise ValueError(f"save_best_metric {cfg.save_best_metric}: the best policy is chosen among evaluations "
                         f"(eval_prompts_uri, eval_steps); set them, or drop save_best_metric")
    est, n = cfg.advantage_estimator, cfg.n_samples_per_prompt
    if est in rl_math.GROUPED and n < 2:
        raise ValueError(f"advantage_estimator {est} needs n_samples_per_prompt >= 2 (got {n}): its baseline "
                         f"compares samples of the same prompt, and with one sample every score advantage is 0 "
                         f"(OpenRLHF's train_ppo_ray asserts n_samples_per_prompt > 1 for it too"
                         f"{', since v0.11' if est == 'dr_grpo' else ''}); with one sample per prompt use "
                         f"reinforce (REINFORCE++) or gae")
    given = [k for k in ("reward_model_uri", "reward_func_path", "remote_rm_url") if getattr(cfg, k)]
    if cfg.agent_func_path and cfg.agent_executor_path:
        raise ValueError("agent_func_path (an AgentInstance for the built-in executor) and agent_executor_path "
                         "(an executor of its own) both run the episodes: set one")
    agent_file = cfg.agent_func_path or cfg.agent_executor_path
    if agent_file and given:
        raise ValueError(f"{'agent_func_path' if cfg.agent_func_path else 'agent_executor_path'} gives the "
                         f"rewards (the episode's 'rewards'): drop {given}")
    teachers = getattr(cfg, "teacher_uri", None)
    if est == "distill" and not teachers:
        raise ValueError("advantage_estimator distill (on-policy distillation) needs teacher_uri: the teacher's "
                         "log-probs of the student's samples are its advantage")
    if len(given) > 1 or not given and not agent_file and est != "distill":
        raise ValueError(f"set exactly one reward source of reward_model_uri, reward_func_path, remote_rm_url "
                         f"(got {given or 'none'}), or an agent_func_path / agent_executor_path"
                         f"{' (advantage_estimator distill needs none: the teacher gives the signal)' if teachers else ''}")
    if est == "gae" and not (cfg.critic_uri or cfg.reward_model_uri):
        raise ValueError("advantage_estimator gae needs a critic: set critic_uri (critic_pretrain) or a "
                         "reward_model_uri to initialise it from")
    samples = cfg.rollout_batch_size * n
    world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
    if samples % cfg.train_batch_size:
        raise ValueError(f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step is not divisible "
                         f"by train_batch_size {cfg.train_batch_size}")
    for what, w in (("actor", world), ("critic", cworld)):
        if cfg.train_batch_size % (cfg.micro_train_batch_size * w):
            raise ValueError(f"train_batch_size {cfg.train_batch_size} is not divisible by micro_train_batch_size "
                             f"x {what} ranks ({cfg.micro_train_batch_size} x {w})")
    if cfg.eps_clip_low_high and min(cfg.eps_clip_low_high) <= 0:
        raise ValueError(f"eps_clip_low_high must be > 0, got {cfg.eps_clip_low_high}")
    for key in ("dynamic_filtering_reward_range", "vllm_is_truncated_threshold"):
        low, high = getattr(cfg, key)
        if low >= high:
            raise ValueError(f"{key} low must be < high, got ({low}, {high})")
    if cfg.vllm_is_truncated_threshold[0] < 0:
        raise ValueError(f"vllm_is_truncated_threshold low must be >= 0, got {cfg.vllm_is_truncated_threshold}")
    if cfg.use_icepop and not cfg.enable_vllm_is_correction:
        raise ValueError("use_icepop needs enable_vllm_is_correction (it changes how the IS ratio is applied)")
    if cfg.use_kl_loss and cfg.init_kl_coef == 0:
        raise ValueError("use_kl_loss needs a reference: init_kl_coef is 0, so no reference policy is loaded "
                         "and there is no KL to add to the loss; set init_kl_coef > 0 or drop use_kl_loss")
    if est in rl_math.GROUPED and cfg.gamma != 1:
        raise ValueError(f"advantage_estimator {est} needs gamma 1 (got {cfg.gamma}): its group baseline is "
                         f"on the sequence score (OpenRLHF forces gamma to 1 for it)")
    if cfg.save_hf_ckpt and not cfg.save_steps:
        raise ValueError("save_hf_ckpt writes an HF folder with each checkpoint: save_steps is 0 (no checkpoint)")
    if cfg.normalize_reward and not cfg.reward_model_uri:
        raise ValueError("normalize_reward applies a reward model's stored mean/std: there is no "
                         "reward_model_uri; use running_reward_norm for a running normalisation")
    micro = cfg.micro_rollout_batch_size
    if micro:
        for what, w in (("actor", world), ("critic", cworld))[:2 if est == "gae" else 1]:
            if (samples // w) % micro:
                raise ValueError(f"micro_rollout_batch_size {micro} does not divide the {samples // w} samples "
                                 f"per {what} rank of a step (rollout_batch_size x n_samples_per_prompt / "
                                 f"{w} ranks)")
    if cfg.overlong_buffer_len is not None and cfg.overlong_buffer_len > cfg.generate_max_len:
        raise ValueError(f"overlong_buffer_len {cfg.overlong_buffer_len} is longer than generate_max_len "
                         f"{cfg.generate_max_len} (the penalty starts at generate_max_len minus it)")
    if cfg.reward_clip_range and cfg.reward_clip_range[0] >= cfg.reward_clip_range[1]:
        raise ValueError(f"reward_clip_range low must be < high, got {cfg.reward_clip_range}")
    if cfg.async_train and cfg.colocate_all_models:
        raise ValueError("async_train cannot be used with colocate_all_models (as in OpenRLHF): rollout and "
                         "training overlap, so they cannot share the same devices")


def engines(cfg) -> None:
    """Rollout engines and the weight path, checked before Ray starts."""
    if getattr(cfg, "lora_rank", 0):
        if cfg.rollout_backend == "vllm" and cfg.vllm_num_engines:  # vLLM serves the synced adapter (enable_lora)
            from rlhf_core.ppo.lora import VLLM_RANKS

            if cfg.vllm_tensor_parallel_size > 1:
                raise ValueError("lora_rank with vllm_tensor_parallel_size > 1: the adapter reaches an engine's own "
                                 "process only, not its tensor-parallel workers; use vllm_tensor_parallel_size 1")
            if cfg.lora_rank > VLLM_RANKS[-1]:
                raise ValueError(f"lora_rank {cfg.lora_rank} with rollout_backend vllm: vLLM serves adapters up to "
                                 f"rank {VLLM_RANKS[-1]}")
        if cfg.zero_stage == 3:
            raise ValueError("lora_rank with zero_stage 3: the ppo learner's adapters are not partitioned here; use "
                             "zero_stage 2 (the adapter and its optimizer are small)")
        if cfg.weight_sync_backend == "object_store":
            raise ValueError("lora_rank with weight_sync_backend object_store: the adapter travels over the "
                             "collective weight group; use collective")
    if cfg.async_train and cfg.vllm_enable_sleep:  # OpenRLHF: "Async RLHF is not supported with --vllm.enable_sleep"
        raise ValueError("async_train cannot be used with vllm_enable_sleep: under async_train the engines "
                         "generate the next batch while the learners train, so they have no time to sleep in, "
                         "and a sleeping vLLM queues the next generate while the wake_up behind it never runs "
                         "(a silent hang)")
    vllm_only = {"vllm_tensor_parallel_size": 1, "enable_prefix_caching": False, "enforce_eager": False,
                 "vllm_gpu_memory_utilization": 0.95}  # vllm_enable_sleep: the hf engine moves its weights too
    given = [k for k, default in vllm_only.items() if getattr(cfg, k) != default]
    if cfg.rollout_backend == "hf" and given:
        raise ValueError(f"{', '.join(given)}: settings of vLLM engines, and rollout_backend is hf (transformers "
                         f"generate has none of them); set rollout_backend vllm or drop them")
    tp, world = cfg.vllm_tensor_parallel_size, cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    if cfg.vllm_num_engines == 0:  # OpenRLHF without vLLM generates with the actor's own model
        why = [w for w, bad in (
            ("rollout_backend vllm (the learner generates with transformers)", cfg.rollout_backend != "hf"),
            ("async_train (a learner runs one call at a time: it cannot generate while it trains)", cfg.async_train),
            ("zero_stage 3 with several policy ranks (rank 0 alone generates; ZeRO-3's forwards gather "
             "parameters on every rank)", cfg.zero_stage == 3 and world > 1)) if bad]
        if why:
            raise ValueError(f"vllm_num_engines 0 (policy rank 0 generates the rollouts with its own model) "
                             f"cannot be used with {'; '.join(why)}")
    elif cfg.colocate_all_models and world != cfg.vllm_num_engines * tp:  # OpenRLHF's rule
        raise ValueError(f"colocate_all_models: vllm_num_engines {cfg.vllm_num_engines} x "
                         f"vllm_tensor_parallel_size {tp} must equal the {world} policy ranks (actor_num_nodes x "
                         f"actor_num_gpus_per_node), one engine TP rank on each policy rank's GPU: a rank without "
                         f"one has nobody to hand its weights to (a CUDA IPC handle nobody opens leaks its "
                         f"buffer) and one with two runs two engines on one GPU")
    if cfg.colocate_all_models and tp > 1 and cfg.actor_num_gpus_per_node % tp:
        raise ValueError(f"colocate_all_models: vllm_tensor_parallel_size {tp} does not divide "
                         f"actor_num_gpus_per_node {cfg.actor_num_gpus_per_node}: an engine's TP ranks sit on "
                         f"consecutive policy GPUs and must share a node")


def learners(cfg) -> None:
    """Learners, reference and placement, checked before Ray starts."""
    if cfg.deepspeed_enable_sleep and cfg.vllm_num_engines == 0:
        raise ValueError("deepspeed_enable_sleep cannot be used with vllm_num_engines 0: the learners sleep "
                         "(their DeepSpeed states offloaded) to give the GPU to the rollout engines while they "
                         "generate, and with no engine policy rank 0 generates with its own, offloaded, "
                         "parameters")
    if cfg.deepspeed_enable_sleep and cfg.adam_offload:  # OpenRLHF's offload_deepspeed_states skips it too
        raise ValueError("deepspeed_enable_sleep cannot be used with adam_offload: the optimizer states already "
                         "live in host memory (ZeRO-Offload), and DeepSpeed's reload_states after a sleep would "
                         "move those fp32 masters and moments onto the GPU. Drop deepspeed_enable_sleep")
    if cfg.deepspeed_enable_sleep and cfg.async_train:
        raise ValueError("deepspeed_enable_sleep cannot be used with async_train: the learners sleep while the "
                         "engines generate, and under async_train they train during the generation")
    for flag in ("deepspeed_enable_sleep", "adam_offload"):
        if getattr(cfg, flag) and cfg.zero_stage == 0:
            raise ValueError(f"{flag} moves ZeRO's optimizer states to the host: it needs zero_stage >= 1")
    has_ref, has_rm = cfg.init_kl_coef > 0, bool(cfg.reward_model_uri)
    if cfg.ref_reward_offload and not (has_ref or has_rm):
        raise ValueError("ref_reward_offload: this run has neither a reference (init_kl_coef is 0) nor a "
                         "reward model (reward_model_uri)")
    rworld = cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
    world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    samples = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if rworld > 1:
        if not has_ref:
            raise ValueError(f"ref_num_nodes x ref_num_gpus_per_node = {rworld} reference ranks, but init_kl_coef "
                             "is 0: no reference is loaded")
        micro = cfg.micro_rollout_batch_size or cfg.micro_train_batch_size
        if samples % rworld or (samples // rworld) % micro and not cfg.use_dynamic_batch:
            raise ValueError(f"{samples} samples per step do not split into {rworld} reference ranks of whole "
                             f"micro_rollout_batch_size {micro} micro-batches: ZeRO-3 ranks forward together, "
                             "the same number of micro-batches each")
        if (cfg.colocate_actor_ref or cfg.colocate_all_models) and rworld > world:
            raise ValueError(f"colocate_actor_ref / colocate_all_models: {rworld} reference ranks on {world} "
                             "policy ranks' devices (one reference rank per policy rank at most, as OpenRLHF)")
    rm_world = cfg.reward_num_nodes * cfg.reward_num_gpus_per_node
    if rm_world > 1:
        if not has_rm:
            raise ValueError(f"reward_num_nodes x reward_num_gpus_per_node = {rm_world} reward-model ranks, but "
                             f"there is no reward_model_uri (a reward function or server scores the samples)")
        cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
        if cfg.colocate_all_models and rm_world > world:
            raise ValueError(f"colocate_all_models: {rm_world} reward-model ranks on {world} policy ranks' devices "
                             f"(one reward rank per policy rank at most)")
        if cfg.colocate_critic_reward and not cfg.colocate_all_models and rm_world > cworld:
            raise ValueError(f"colocate_critic_reward: {rm_world} reward-model ranks on {cworld} critic ranks' "
                             f"devices (one reward rank per critic rank at most; OpenRLHF asks for equal counts)")
    if not cfg.use_dynamic_batch:
        given = sorted(k for k in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu")
                       if getattr(cfg, k) != type(cfg).model_fields[k].default)  # a saved config loads back
        if given:
            raise ValueError(f"{', '.join(given)} bound the micro-batches of use_dynamic_batch: set it")


def devices(cfg) -> None:
    """GPUs or CPUs, as the cluster says (rlhf_core.ppo.placement.roles_on_gpus), checked last: a cluster at
    ray_address is asked once the stage joins it, before any actor starts (loop.train)."""
    import os

    from rlhf_core.ppo.placement import bundle_plan, check_devices, check_resources, roles_on_gpus

    gpus = roles_on_gpus(cfg)
    if gpus is not None:
        check_devices(cfg, gpus, "accelerator cpu" if cfg.accelerator == "cpu" else
                      "this host has no GPU, and the stage starts its own Ray on it")
    if cfg.ray_address is None:  # the stage's local Ray gets this host's CPUs and GPUs
        world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
        cworld = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node if cfg.advantage_estimator == "gae" else 0
        teachers = len([u for u in (getattr(cfg, "teacher_uri", None) or "").split(",") if u.strip()])
        plan = bundle_plan(cfg, world, cworld, cfg.init_kl_coef > 0, bool(cfg.reward_model_uri), teachers)
        n, cpus = 1 + max(b for _, b in plan), os.cpu_count() or 1
        check_resources(plan, {"CPU": cpus, "GPU": torch.cuda.device_count()}, bool(gpus),
                        max(0.01, min(1.0, cpus / n)))
