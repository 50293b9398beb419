"""`rlhf-flows import-openrlhf FILE|-`: an OpenRLHF launch command or script -> the equivalent stage YAML.

Reads `deepspeed [launcher args] --module openrlhf.cli.MODULE ...`, `python -m openrlhf.cli.train_ppo_ray ...` and
`ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray ...`, alone or inside a shell script (line
continuations, comments, simple `VAR=value` assignments and OpenRLHF's `read -r -d '' VAR <<EOF` blocks are
substituted), in both of OpenRLHF's dialects: the flat flags of v0.9 (`--pretrain`, `--micro_train_batch_size`)
and the dotted flags of v0.10+ (`--model.model_name_or_path`, `--train.micro_batch_size`). A dotted flag is first
renamed to the flat flag it replaced (DOTTED, from OpenRLHF's commit ed62d0e2 "dotted config hierarchy"), so
both dialects go through one table per module (FLAGS) and give the same YAML; each key's comment names the
flag as written. A flag without a counterpart is listed at the top with the reason, never dropped; a hub id
(`meta-llama/Meta-Llama-3-8B`) becomes a local-folder placeholder with a "download it and pass the folder" note
(this project never downloads). The YAML is parsed back and validated with each stage's Config before it is
printed.

    rlhf-flows import-openrlhf tests/flows/openrlhf_commands/train_sft_v0.9.10.sh -o sft.yaml
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class CommandError(ValueError):
    """A command that cannot be imported; the message names the module, the flag or the line."""


class No(str):
    """A flag without a counterpart here: the string is the reason, printed in the YAML's header."""


# ---------------------------------------------------------------------------------------------- the dialects
CRITIC_OPTIM = ("lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm", "adam.betas", "adam.eps", "adam.weight_decay")
# v0.10+ dotted flag -> the v0.9 flat flag it replaced. Flags not listed drop their `ds.` / `data.` / `train.`
# namespace (`--ds.zero_stage` -> `--zero_stage`), `--vllm.X` becomes `--vllm_X`, `--E.num_X` `--E_num_X`.
DOTTED = {
    "model.model_name_or_path": "pretrain", "actor.model_name_or_path": "pretrain",
    "ref.model_name_or_path": "ref_pretrain", "reward.model_name_or_path": "reward_pretrain",
    "critic.model_name_or_path": "critic_pretrain", "reward.remote_url": "remote_rm_url",
    "ckpt.output_dir": "save_path", "ckpt.save_steps": "save_steps", "ckpt.save_hf": "save_hf_ckpt",
    "ckpt.disable_ds": "disable_ds_ckpt", "ckpt.path": "ckpt_path", "ckpt.max_num": "max_ckpt_num",
    "ckpt.max_mem": "max_ckpt_mem", "ckpt.load_enable": "load_checkpoint", "ckpt.best_metric_key": "best_metric_key",
    "ds.use_universal_ckpt": "use_ds_universal_ckpt", "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.ring_attn_head_stride": "ring_head_stride", "ds.lora.rank": "lora_rank", "ds.lora.alpha": "lora_alpha",
    "ds.lora.target_modules": "target_modules", "ds.lora.dropout": "lora_dropout", "ds.enable_sleep": "deepspeed_enable_sleep",
    "logger.logging_steps": "logging_steps", "logger.wandb.key": "use_wandb", "logger.wandb.org": "wandb_org",
    "logger.wandb.group": "wandb_group", "logger.wandb.project": "wandb_project",
    "logger.wandb.run_name": "wandb_run_name", "logger.tensorboard_dir": "use_tensorboard",
    "eval.steps": "eval_steps", "eval.dataset": "eval_dataset", "eval.split": "eval_split",
    "eval.temperature": "eval_temperature", "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
    "train.micro_batch_size": "micro_train_batch_size", "train.batch_size": "train_batch_size",
    "train.full_determinism_enable": "full_determinism", "train.colocate_all": "colocate_all_models",
    "train.async_enable": "async_train", "train.partial_rollout_enable": "partial_rollout",
    "train.dynamic_batch_enable": "use_dynamic_batch", "train.max_tokens_per_gpu": "train_max_tokens_per_gpu",
    "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.aux_loss_coef": "aux_loss_coef", "actor.aux_loss_coef": "aux_loss_coef",
    "model.pretrain_mode_enable": "pretrain_mode", "model.beta": "beta", "model.ipo_enable": "ipo",
    "model.label_smoothing": "label_smoothing", "model.nll_loss_coef": "nll_loss_coef",
    "model.compute_fp32_loss_enable": "compute_fp32_loss", "model.margin_loss_enable": "margin_loss",
    "model.loss_type": "loss",
    "adam.lr": "learning_rate", "adam.betas": "adam_betas", "adam.weight_decay": "l2", "adam.eps": "adam_eps",
    "actor.adam.lr": "actor_learning_rate", "critic.adam.lr": "critic_learning_rate",
    "actor.adam.betas": "adam_betas", "actor.adam.weight_decay": "l2", "actor.adam.eps": "adam_eps",
    "data.prompt_dataset": "prompt_data", "data.prompt_probs": "prompt_data_probs",
    "rollout.batch_size": "rollout_batch_size", "rollout.micro_batch_size": "micro_rollout_batch_size",
    "rollout.max_new_tokens": "max_new_tokens", "rollout.top_p": "top_p", "rollout.temperature": "temperature",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt", "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
    "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu",
    "vllm.enable_prefix_caching": "enable_prefix_caching", "vllm.enforce_eager": "enforce_eager",
    "ref.offload": "ref_offload", "reward.offload": "ref_reward_offload",
    "critic.freezing_steps": "freezing_actor_steps", "actor.entropy_coef": "entropy_loss_coef",
    "algo.advantage.is_correction_enable": "enable_vllm_is_correction",
    "algo.advantage.is_correction_threshold": "vllm_is_truncated_threshold",
    "algo.advantage.is_correction_type": "vllm_is_correction_type", "algo.advantage.estimator": "advantage_estimator",
    "algo.advantage.no_std_norm": "no_advantage_std_norm", "algo.advantage.lambd": "lambd", "algo.advantage.gamma": "gamma", "algo.kl.target": "kl_target", "algo.kl.horizon": "kl_horizon",
    "algo.kl.init_coef": "init_kl_coef", "algo.kl.estimator": "kl_estimator", "algo.kl.use_loss": "use_kl_loss",
    "algo.dynamic_filtering_enable": "dynamic_filtering", "algo.dynamic_filtering_range": "dynamic_filtering_reward_range",
    "reward.normalize_enable": "normalize_reward", "reward.clip_range": "reward_clip_range",
    "ds.value_head_prefix": "value_head_prefix",
    # train_ppo_ray's per-role optimizers: the actor's are the stage's; the critic's its own where it has one
    **{f"critic.{k}": f"critic_{k.replace('.', '_')}" for k in CRITIC_OPTIM},
    **{f"{role}.{k}": f"{k.replace('.', '_')}" for role in ("actor", "critic") for k in
       ("optim", "muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov", "muon.no_nesterov")},
}


def flat_name(flag: str) -> str:
    """The v0.9 name of a flag (a flat flag is its own)."""
    if "." not in flag:
        return flag
    if flag in DOTTED:
        return DOTTED[flag]
    head, rest = flag.split(".", 1)
    if "." in rest:
        return flag  # unknown: listed as such
    if head in ("ds", "data", "train") or (head in ("actor", "critic", "reward") and not rest.startswith("num_")):
        return rest  # --ds.zero_stage, --data.max_len, --actor.eps_clip, --critic.value_clip, --reward.overlong_buffer_len
    if head in ("vllm", "ref", "reward", "actor", "critic", "muon"):
        return f"{head}_{rest}"  # --vllm.num_engines -> --vllm_num_engines, --ref.num_nodes -> --ref_num_nodes
    return flag  # unknown: listed as such


# ---------------------------------------------------------------------------------------------- converters
def steps(v):  # OpenRLHF -1 = never; here 0
    return 0 if int(v) < 0 else int(v)


def param_dtype(v):
    if v not in ("bf16", "fp32"):
        raise ValueError(f"{v!r}: bf16 or fp32 here (fp16 has no counterpart)")
    return v == "bf16"


def sync_backend(v):
    return "collective" if v in ("nccl", "gloo") else v  # OpenRLHF's broadcast over a process group


# ---------------------------------------------------------------------------------------------- the tables
# flat flag -> stage key ("section.key" for another section), a list of keys, a callable value -> {key: value},
# or No(reason). A flag not listed whose name is a field of the module's main stage Config maps to it.
NOT_HERE = {
    "local_rank": No("set by the launcher"),
    "ckpt_path": No("checkpoints go to {output_uri}/checkpoints (save_steps sets how often)"),
    "save_hf_ckpt": No("checkpoints are DeepSpeed's; the committed artifact is the HF folder (ppo has save_hf_ckpt)"),
    "disable_ds_ckpt": No("checkpoints are DeepSpeed's (resume needs them)"),
    "max_ckpt_num": No("the store keeps the latest checkpoint of the job"),
    "max_ckpt_mem": No("the store keeps the latest checkpoint of the job"),
    "use_ds_universal_ckpt": No("a resumed job keeps its world size"),
    "logging_steps": "log_steps",
    "deepcompile": No("DeepSpeed's compiler is not wired here"),
    "zpg": No("ZeRO++ hierarchical partitioning is not wired here"),
    "grad_accum_dtype": No("gradients accumulate in the training dtype"),
    "overlap_comm": No("DeepSpeed's default communication overlap"),
    "gradient_checkpointing_use_reentrant": No("non-reentrant checkpointing (transformers' default)"),
    "disable_fast_tokenizer": No("the model's fast tokenizer is always used"),
    "dataloader_num_workers": No("records are tokenized before training: no loader workers"),
    "full_determinism": No("runs are seeded (seed); no deterministic-kernels switch"),
    "use_ms": No("ModelScope hub: nothing is downloaded here"),
    "wandb_org": No("W&B's entity comes from WANDB_ENTITY"),
    "wandb_group": No("not wired: one W&B run per stage"),
    "use_wandb": ("use_wandb", lambda v: True),  # the key comes from WANDB_API_KEY, not the command line
    "use_tensorboard": ("use_tensorboard", lambda v: True),  # event files go to the artifact's tensorboard/
    "param_dtype": ("bf16", param_dtype),
    "flash_attn": ("attn_implementation", lambda v: "flash_attention_2"),
    "save_steps": ("save_steps", steps),
    "load_checkpoint": "resume",
    "save_path": "output_uri",
    "dataset": "dataset_uri",
    "dataset_split": No("give the split per source as URI@SPLIT"),
    "train_split": No("give the split per source as URI@SPLIT"),
    "optim": No("AdamW only (Muon is not wired)"),
    **{f"muon_{k}": No("AdamW only (Muon is not wired)") for k in ("lr", "momentum", "ns_steps", "nesterov", "no_nesterov")},
    "adam_eps": No("AdamW's eps is DeepSpeed's default 1e-8"),
    "experts_implementation": No("transformers picks the MoE experts kernel"),
}
TRAIN = {**NOT_HERE, "pretrain": "policy_uri"}
# dpo trains from a `reference` artifact (pairs + the reference log-probs), made from the raw pairs by `prepare`.
DPO = {**TRAIN,
       "dataset": "prepare.data", "dataset_probs": "prepare.data_probs", "max_samples": "prepare.max_samples",
       "prompt_key": "prepare.prompt_key", "chosen_key": "prepare.chosen_key", "rejected_key": "prepare.rejected_key",
       "apply_chat_template": "prepare.apply_chat_template", "input_template": "prepare.input_template",
       "tokenizer_chat_template": ["tokenizer_chat_template", "prepare.tokenizer_chat_template"],
       "ref_pretrain": "reference.ref_uri", "ipo": ("loss_type", lambda v: "ipo"),
       # the reference pass must tokenize and compute as dpo trains (dpo checks it)
       "max_len": ["max_len", "reference.max_len"], "param_dtype": (["bf16", "reference.bf16"], param_dtype), "bf16": ["bf16", "reference.bf16"],
       "packing_samples": ["packing_samples", "reference.packing_samples"],
       "attn_implementation": ["attn_implementation", "reference.attn_implementation"],
       "ref_offload": No("the reference log-probs are computed once by the reference stage: no model to offload")}
FLAGS: dict[str, dict[str, Any]] = {
    "train_sft": TRAIN,
    "train_rm": {**TRAIN, "pretrain": "base_uri", "margin_loss": "use_margin",
                 "value_head_prefix": No("the head is saved as value_head (score / serve-rm read value_head_prefix)"),
                 "compute_fp32_loss": No("the loss is computed in fp32 always")},
    "train_dpo": DPO,
    "train_kto": {**TRAIN, "ref_pretrain": "ref_uri", "ref_offload": No("the reference runs beside the policy")},
    "train_kd": {**TRAIN, "teacher_model": "teacher_uri", "pretrain_mode": No("kd trains on responses")},
    "train_prm": {**TRAIN, "pretrain": "base_uri"},
    "generate": {**NOT_HERE, "pretrain": "policy_uri", "dataset": "prompts_uri", "dataset_probs": "prompt_data_probs",
                 "output_path": "output_uri", "tp_size": "tensor_parallel_size", "micro_batch_size": "batch_size",
                 "greedy_sampling": ("temperature", lambda v: 0.0), "param_dtype": ("dtype", str),
                 "eval_task": No("generate / generate_vllm: the backend key"),
                 "zero_stage": No("inference: no ZeRO"), "max_len": No("prompt_max_len and max_new_tokens cap each side"),
                 "attn_implementation": No("the backend's attention"),
                 "max_num_seqs": "max_num_seqs",
                 "post_processor": No("a separate stage: filter (method rs / iter_dpo / csft)"),
                 "enable_csft": No("the conditional-sft flow"), "csft_prompt": No("the conditional-sft flow")},
    "score": {**NOT_HERE, "pretrain": "reward_model_uri", "dataset": "samples_uri", "output_path": "output_uri",
              "micro_batch_size": "batch_size", "param_dtype": ("dtype", str), "eval_task": No("rm: the score stage"),
              "zero_stage": No("inference: no ZeRO"), "dataset_probs": No("one samples artifact"),
              "attn_implementation": No("the model's default attention (sdpa)"),
              "input_key": No("samples rows are (prompt, response)"), "output_key": No("samples rows are (prompt, response)"),
              "apply_chat_template": No("samples rows hold the formatted prompt"),
              "post_processor": No("a separate stage: filter (method rs / iter_dpo / csft)"),
              "reward_template": No("not wired"), "enable_csft": No("the conditional-sft flow")},
    "train_ppo_ray": {**NOT_HERE, "pretrain": "policy_uri", "prompt_data": "prompts_uri", "reward_pretrain": "reward_model_uri",
                      "critic_pretrain": "critic_uri",
                      "remote_rm_url": lambda v: {"reward_func_path" if v.endswith(".py") else "remote_rm_url": v},
                      "max_len": "reward_max_len", "max_new_tokens": "generate_max_len",
                      "vllm_sync_backend": ("weight_sync_backend", sync_backend),
                      "ref_offload": "ref_reward_offload",
                      **{f"critic_{k.replace('.', '_')}": No("one setting for both roles here: the actor's")
                         for k in CRITIC_OPTIM},
                      "reward_num_nodes": No("the reward model is one Ray actor (inference)"),
                      "reward_num_gpus_per_node": No("the reward model is one Ray actor (inference)"),
                      "vllm_sync_with_ray": No("weight_sync_backend: collective or object_store"),
                      "vllm_generate_batch_size": No("the engine takes a whole rollout batch"),
                      "vllm_is_correction_type": No("TIS token-level correction only"),
                      "partial_rollout": No("not wired"), "best_metric_key": No("no eval inside ppo"),
                      "enable_ema": No("not wired"), "ema_beta": No("not wired"),
                      "actor_init_on_gpu": No("each role loads on its own device"),
                      "attn_implementation": No("the model's default attention (sdpa)"),
                      "use_liger_kernel": No("not wired for ppo"), "ds_tensor_parallel_size": No("not wired for ppo"),
                      "ring_attn_size": No("not wired for ppo"), "ring_head_stride": No("not wired for ppo"),
                      "load_in_4bit": No("not wired for ppo"), "lora_rank": No("not wired for ppo"),
                      "lora_alpha": No("not wired for ppo"), "lora_dropout": No("not wired for ppo"),
                      "target_modules": No("not wired for ppo"), "aux_loss_coef": No("not wired for ppo"),
                      "policy_loss_type": No("PPO's clipped loss (eps_clip, dual_clip)"),
                      "ptx_coef": "ptx_coef", "pretrain_data": "pretrain_data", "value_head_prefix": "value_head_prefix",
                      "save_hf_ckpt": "save_hf_ckpt",
                      "overlong_buffer_len": No("not wired"), "overlong_penalty_factor": No("not wired"),
                      "stop_properly_penalty_coef": No("not wired"), "prompt_split": No("give the split as URI@SPLIT"),
                      "eval_steps": No("no eval inside ppo: the flow's eval stage"),
                      "eval_dataset": No("no eval inside ppo: the flow's eval stage"),
                      "eval_split": No("no eval inside ppo"), "eval_temperature": No("no eval inside ppo"),
                      "eval_n_samples_per_prompt": No("no eval inside ppo"), "perf": No("timings are in the log"),
                      "lr_scheduler": No("constant learning rate after warm-up"),
                      "use_wandb": No("set use_wandb on the ppo flow"), "use_tensorboard": No("set use_wandb on the ppo flow"),
                      "wandb_project": No("set on the ppo flow"), "wandb_run_name": No("set on the ppo flow"),
                      "image_key": No("vision-language models are not supported"),
                      "max_images_per_prompt": No("vision-language models are not supported"),
                      "freeze_visual_encoder": No("vision-language models are not supported")},
}
# Launcher arguments: deepspeed's before --module, `ray job submit`'s before `--`.
LAUNCHER = {"num_gpus": "num_gpus", "num_nodes": "num_nodes", "hostfile": "hostfile", "master_port": "master_port",
            "master_addr": "master_addr", "include": No("num_gpus / hostfile place the ranks"),
            "exclude": No("num_gpus / hostfile place the ranks"),
            "address": "ray_address",  # http://HEAD:8265: the stage is submitted there as a Ray Job (rlhf_core/runtime/ray_jobs.py)
            "runtime-env-json": No("the stage runs in this environment"), "working-dir": No("the stage runs in this environment"),
            "no-wait": No("the stage runs in the foreground")}
# Which stage runs each module, and the sections its YAML holds (the main one first: unprefixed keys go there).
STAGES = {"train_sft": ["sft"], "train_rm": ["train_rm"], "train_dpo": ["dpo", "prepare", "reference"],
          "train_kto": ["kto"], "train_kd": ["kd"], "train_prm": ["train_prm"], "train_ppo_ray": ["ppo"]}
# OpenRLHF's defaults (v0.9.10's parsers; v0.9.5's for the modules it removed after) where they differ from the
# stage's and change what trains: what the command runs with when it omits the flag. Left out: placement
# (GPUs per role), attn_implementation (flash_attention_2: the same math as sdpa), wandb_project.
TEMPLATE = "User: {}\nAssistant: "  # used unless --apply_chat_template
DEFAULTS: dict[str, dict[str, Any]] = {
    "train_sft": {"save_path": "./ckpt", "train_batch_size": 128, "max_epochs": 2, "max_len": 2048, "input_template": TEMPLATE},
    "train_rm": {"save_path": "./ckpt", "train_batch_size": 128, "micro_train_batch_size": 1, "learning_rate": 9e-6},
    "train_dpo": {"save_path": "./ckpt", "train_batch_size": 128, "learning_rate": 1e-5},
    "train_kto": {"save_path": "./ckpt", "train_batch_size": 128, "learning_rate": 1e-5, "beta": 0.01, "input_key": "input",
                  "max_len": 2048, "input_template": TEMPLATE},
    "train_kd": {"save_path": "./ckpt", "train_batch_size": 128, "max_len": 2048, "input_template": TEMPLATE},
    "train_prm": {"save_path": "./ckpt", "train_batch_size": 128, "micro_train_batch_size": 1, "learning_rate": 1e-6,
                  "label_key": "label", "max_len": 2048},
    "train_ppo_ray": {"save_path": "./ckpt", "train_batch_size": 128, "rollout_batch_size": 1024, "micro_rollout_batch_size": 8},
    "batch_inference": {"seed": 1234, "micro_batch_size": 16},
}


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class Command:
    module: str  # train_sft ...
    launcher: list[tuple[str, Any]]  # (flag, value) before the module
    flags: list[tuple[str, Any]]  # (flag as written, value: str, list of str, or True for a bare flag)
    line: int
    unresolved: list[str] = field(default_factory=list)  # $VARs the script does not set simply

    @property
    def dialect(self) -> str:
        return "v0.10+ dotted flags" if any("." in f for f, _ in self.flags) else "v0.9 flat flags"


def logical_lines(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, text, None) with continuations joined; a `read -r -d '' VAR <<EOF` block is (line, its
    body as one line, VAR)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        heredoc = re.match(r"\s*read\s+(?:-\w+\s+(?:''\s+)?)*(\w+)\s*<<\s*['\"]?(\w+)['\"]?\s*$", line)
        if heredoc:
            var, end = heredoc.groups()
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != end:
                body.append(lines[i])
                i += 1
            out.append((start, " ".join(b.rstrip().removesuffix("\\") for b in body), var))
        else:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            out.append((start, line, None))
        i += 1
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} of the script's simple assignments (others stay as written)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def words(line: str, env: dict[str, str]) -> list[str]:
    """Shell words of a line, comments dropped and $VAR / ${VAR} of simple assignments substituted."""
    try:
        return shlex.split(substitute(line, env), comments=True)
    except ValueError:  # unbalanced quotes: not a line we read
        return []


def find_commands(text: str) -> list[Command]:
    env: dict[str, str] = {}
    found = []
    for no, line, heredoc in logical_lines(text):
        if heredoc:  # substituted where it is used: `deepspeed --module $training_commands` splits it into words
            env[heredoc] = substitute(line, env)
            continue
        assign = re.match(r"\s*(?:export\s+)?(\w+)=(.*)$", line)
        if assign and "$(" not in line and "openrlhf.cli." not in line:  # not `VAR=x python -m openrlhf...`
            if line[0].isspace():  # set inside a loop or a branch: a value the command may or may not see
                continue
            env[assign.group(1)] = " ".join(words(assign.group(2), env))
            continue
        w = words(line, env)
        at = next((k for k, x in enumerate(w) if x.startswith("openrlhf.cli.")), None)
        if at is None:
            continue
        if at == 0 or w[at - 1] not in ("--module", "-m"):
            continue  # e.g. `echo openrlhf.cli.train_sft`
        unresolved = sorted({m for x in w for m in re.findall(r"\$\{?\w+\}?", x)})
        found.append(Command(w[at].removeprefix("openrlhf.cli."), launcher_flags(w[:at - 1]), flag_values(w[at + 1:]), no,
                             unresolved))
    return found


def flag_values(ws: list[str]) -> list[tuple[str, Any]]:
    """--flag v, --flag=v, --flag v1 v2 (nargs), --flag (a switch: True). Negative numbers are values."""
    out: list[tuple[str, Any]] = []
    for x in ws:
        if x.startswith("--"):
            name, eq, v = x[2:].partition("=")
            out.append((name, [v] if eq else []))
        elif out:
            out[-1][1].append(x)
        # a word before any flag (`;`, `&&`...) ends nothing: OpenRLHF commands are one per line
    return [(n, True if not v else v[0] if len(v) == 1 else v) for n, v in out]


def launcher_flags(ws: list[str]) -> list[tuple[str, Any]]:
    if "--" in ws:  # ray job submit [options] -- python3 -m ...
        ws = ws[:ws.index("--")]
    return [(n, v) for n, v in flag_values(ws) if n]


# ---------------------------------------------------------------------------------------------- conversion
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Converted:
    module: str
    dialect: str
    sections: dict[str, dict[str, Any]]
    comments: dict[tuple[str, str], str]  # (section, key) -> "--flag value" or a note
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def stage_of(cmd: Command) -> tuple[str, list[str]]:
    """(table name, sections) of a command; batch_inference's eval_task picks generate or score."""
    if cmd.module == "batch_inference":
        task = dict((flat_name(f), v) for f, v in cmd.flags).get("eval_task", "generate")
        if task in ("generate", "generate_vllm"):
            return "generate", ["generate"]
        if task == "rm":
            return "score", ["score"]
        raise CommandError(f"openrlhf.cli.batch_inference --eval_task {task}: no counterpart (generate, generate_vllm, rm)")
    if cmd.module not in STAGES:
        raise CommandError(f"openrlhf.cli.{cmd.module} (line {cmd.line}) is not an OpenRLHF module this imports; "
                           f"known: {', '.join(sorted([*STAGES, 'batch_inference']))}")
    return cmd.module, STAGES[cmd.module]


def config_class(stage: str):
    import importlib

    return importlib.import_module(f"stages.{stage}").Config


def convert(cmd: Command) -> Converted:
    table_name, sections = stage_of(cmd)
    main = sections[0]
    out = Converted(cmd.module, cmd.dialect, {s: {} for s in sections}, {})
    fields = {s: config_class(s).model_fields for s in sections}
    given: dict[str, Any] = {}
    written = {flat_name(f) for f, _ in cmd.flags}
    defaults = [(f, v) for f, v in DEFAULTS.get(cmd.module, {}).items() if f not in written
                and not (f == "input_template" and "apply_chat_template" in written)]
    for table, flags in ((LAUNCHER, cmd.launcher), (FLAGS[table_name], cmd.flags), (FLAGS[table_name], defaults)):
        for flag, value in flags:
            name = flag if table is LAUNCHER else flat_name(flag)
            rule = table.get(name, name if name in fields[main] else None)
            shown = f"--{flag}" + ("" if value is True else f" {' '.join(value) if isinstance(value, list) else value}")
            if (flag, value) in defaults:
                shown = f"(OpenRLHF's default {shown!r})"
            if rule is None:
                out.unsupported.append(f"{shown}: no counterpart" + ("" if name == flag else f" (--{name})"))
                continue
            if isinstance(rule, No):
                out.unsupported.append(f"{shown}: {rule}")
                continue
            given[name] = value
            for section, key, v in targets(rule, value, main, flag):
                if key not in fields[section]:
                    raise CommandError(f"table error: {section}.{key} (--{flag}) is not a field")
                out.sections[section][key] = check(fields[section][key].annotation, v, flag, f"{section}.{key}")
                out.comments[(section, key)] = shown
    wire(cmd, out, given)
    hub_ids(out)
    return out


def targets(rule, value, main: str, flag: str) -> list[tuple[str, str, Any]]:
    """(section, key, raw value) for each key a flag sets."""
    if callable(rule) and not isinstance(rule, (str, tuple)):
        return [(main, k, v) for k, v in rule(value).items()]
    keys, conv = rule if isinstance(rule, tuple) else (rule, None)
    if conv:
        try:
            value = conv(value)
        except (TypeError, ValueError) as e:
            raise CommandError(f"--{flag} {value}: {e}") from None
    return [(*k.split("."), value) if "." in k else (main, k, value) for k in (keys if isinstance(keys, list) else [keys])]


def check(annotation, value, flag: str, where: str):
    """The value as the field's type (a bare switch is True), or an error naming the flag."""
    from typing import get_args, get_origin

    from pydantic import TypeAdapter, ValidationError

    kinds = {get_origin(t) or t for t in (get_args(annotation) if get_origin(annotation) not in (list, tuple) else ())}
    kinds |= {get_origin(annotation) or annotation}
    if value is True and bool not in kinds:
        raise CommandError(f"--{flag} needs a value ({where})")
    if value == "" and type(None) in kinds:
        return None  # OpenRLHF reads an empty value (--input_template "") as unset
    if isinstance(value, str) and kinds & {list, tuple}:
        value = [value]  # nargs="*" given one value
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as e:
        try:  # a Literal of numbers (zero_stage 3) takes the YAML scalar, not the text
            return TypeAdapter(annotation).validate_python(yaml.safe_load(value) if isinstance(value, str) else value)
        except (ValidationError, yaml.YAMLError):
            raise CommandError(f"--{flag} {value!r}: {e.errors()[0]['msg']} ({where})") from None


def wire(cmd: Command, out: Converted, given: dict) -> None:
    """Keys no single flag gives: the URIs between dpo's three stages, OpenRLHF's defaults for required keys."""
    s, c = out.sections, out.comments
    main = next(iter(s))
    if main == "score":
        out.notes.append("score.samples_uri must be a committed samples artifact (the generate stage's output_uri), "
                         "not a jsonl file")
    out.notes += [f"{v} is not set by a top-level VAR=value line of the script: replace it" for v in cmd.unresolved]
    if cmd.module == "train_dpo":
        save = s["dpo"]["output_uri"]
        policy = s["dpo"].get("policy_uri")
        s["prepare"] = {"kind": "pairs", **s["prepare"], "output_uri": f"{save}-pairs"}
        c[("prepare", "kind")] = "(train_dpo reads preference pairs)"
        c[("prepare", "output_uri")] = "(the pairs the reference stage reads)"
        if s["prepare"].get("apply_chat_template") and policy:
            s["prepare"]["tokenizer_uri"], c[("prepare", "tokenizer_uri")] = policy, "(--pretrain: its chat template)"
        ref = s["reference"]
        ref.update(pairs_uri=s["prepare"]["output_uri"], output_uri=f"{save}-ref")
        c[("reference", "pairs_uri")], c[("reference", "output_uri")] = "(prepare's output)", "(pairs + reference log-probs)"
        if "ref_uri" not in ref and policy:
            ref["ref_uri"], c[("reference", "ref_uri")] = policy, "(--pretrain: OpenRLHF's default reference)"
        for k in ("zero_stage", "num_gpus", "num_nodes", "hostfile"):
            if k in s["dpo"]:
                ref[k], c[("reference", k)] = s["dpo"][k], c[("dpo", k)]
        s["dpo"]["dataset_uri"], c[("dpo", "dataset_uri")] = ref["output_uri"], "(the reference stage's output)"
        order = ["prepare", "reference", "dpo"]
        out.sections = {k: s[k] for k in order}
    if "eval_steps" in s[main] and "eval_dataset" not in s[main] and main != "generate":
        del s[main]["eval_steps"]  # OpenRLHF evaluates nothing without eval data; here that is a refused setting
        out.unsupported.append(f"{c.pop((main, 'eval_steps'))}: no --eval_dataset, so no evaluation (OpenRLHF ignores it)")
    if s[main].get("save_hf_ckpt") and not s[main].get("save_steps"):
        del s[main]["save_hf_ckpt"]  # OpenRLHF writes the HF folder with a checkpoint; there is none to go with
        out.unsupported.append(f"{c.pop((main, 'save_hf_ckpt'))}: no --save_steps, so no checkpoint and no HF folder "
                               f"beside one (OpenRLHF writes none either)")
    if cmd.module == "train_ppo_ray":  # OpenRLHF generates with vLLM engines when it has some, else on the actors
        vllm = s["ppo"].get("vllm_num_engines", 0) > 0
        s["ppo"]["rollout_backend"] = "vllm" if vllm else "hf"
        c[("ppo", "rollout_backend")] = "(--vllm_num_engines > 0: vLLM engines)" if vllm else "(no vLLM engines: generate on the actor)"
    if cmd.module == "train_ppo_ray" and s["ppo"].get("vllm_tensor_parallel_size", 1) > 1:
        # TP > 1 engines take their weights through the object store here (stages/ppo.py refuses the collective
        # group for them: it reaches the engine actor, not vLLM's TP workers)
        s["ppo"]["weight_sync_backend"] = "object_store"
        c[("ppo", "weight_sync_backend")] = " ".join(filter(None, [c.get(("ppo", "weight_sync_backend")),
                                                                 "(TP > 1 engines: object_store here)"]))
    if cmd.module == "train_ppo_ray" and "max_len" in given and "max_new_tokens" not in given:
        ppo = s["ppo"]
        ppo["generate_max_len"] = int(given["max_len"]) - ppo.get("prompt_max_len", 1024)
        c[("ppo", "generate_max_len")] = f"(--max_len {given['max_len']} minus prompt_max_len)"
    if cmd.module.startswith("train_") and cmd.module != "train_ppo_ray" and "num_gpus" not in dict(cmd.launcher):
        out.notes.append("deepspeed without --num_gpus uses every GPU of the node: set num_gpus (default 1 here)")


def hub_ids(out: Converted) -> None:
    """Model and dataset hub ids -> ./hub/<id>, a folder the user downloads to (nothing is downloaded here)."""
    seen = set()
    for section, keys in out.sections.items():
        for key, v in list(keys.items()):
            if not (key.endswith("_uri") or key in ("data", "eval_dataset")) or not isinstance(v, str):
                continue
            parts = [p.strip() for p in v.split(",")]
            hub = [p for p in parts if HUB_ID.match(p.split("@")[0]) and not Path(p.split("@")[0]).exists()]
            if not hub:
                continue
            keys[key] = ",".join(f"./hub/{p}" if p in hub else p for p in parts)
            out.comments[(section, key)] += "  (a hub id: see the notes)"
            for p in [p for p in hub if p not in seen]:
                seen.add(p)
                out.notes.append(f"{p} is a hub id; this project never downloads: download it to ./hub/{p.split('@')[0]} "
                                 f"(or any folder or URI) and pass that folder ({section}.{key})")


# ---------------------------------------------------------------------------------------------- output
def scalar(v) -> str:
    return yaml.safe_dump([v], default_flow_style=True, width=10**6, allow_unicode=True).strip()[1:-1]


def render(converted: list[Converted], source: str) -> str:
    lines = [f"# Imported from {source} by `rlhf-flows import-openrlhf` (each key's comment: the OpenRLHF flag)."]
    for c in converted:
        lines.append(f"# openrlhf.cli.{c.module} ({c.dialect}): run "
                     + " then ".join(f"`rlhf-flows stage {s} --config THIS_FILE`" for s in c.sections))
    notes = [n for c in converted for n in c.notes]
    if notes:
        lines += ["#", "# Notes:"] + [f"#   {n}" for n in notes]
    unsupported = [u for c in converted for u in c.unsupported]
    if unsupported:
        lines += ["#", "# Flags without a counterpart here (not in the YAML below):"] + [f"#   {u}" for u in unsupported]
    for c in converted:
        for section, keys in c.sections.items():
            lines.append(f"{section}:")
            for k, v in keys.items():
                text = f"  {k}: {scalar(v)}"
                note = c.comments.get((section, k))
                lines.append(f"{text:<43} # {note}" if note else text)
    return "\n".join(lines) + "\n"


def validate(text: str, converted: list[Converted]) -> list[str]:
    """Parse the printed YAML back and validate each section with its stage's Config: what is printed loads.
    A key the Config refuses only because this host has no CUDA device (ppo's sleep flags, vLLM TP) is taken
    out, named in the returned list, and the rest validated without it."""
    from pydantic import ValidationError

    data, host = yaml.safe_load(text), []
    for c in converted:
        for section in c.sections:
            keys = dict(data[section])
            while True:
                try:
                    config_class(section).model_validate(keys)
                    break
                except ValidationError as e:
                    msg = e.errors()[0]["msg"].removeprefix("Value error, ")
                    key = re.match(r"\w+", msg)
                    if "CUDA" in msg and key and key.group() in keys:
                        host.append(f"{section}.{key.group()}: {msg}")
                        del keys[key.group()]
                        continue
                    raise CommandError(f"openrlhf.cli.{c.module}: the imported {section} config does not validate: "
                                       + "; ".join(_named(err, section, c) for err in e.errors())) from None
    return host


def _named(err: dict, section: str, c: Converted) -> str:
    key = str(err["loc"][0]) if err["loc"] else ""
    src = c.comments.get((section, key), "").split("  ")[0]
    if err["type"] == "missing":  # name the flag the command lacks
        table = FLAGS["generate" if section == "generate" else "score" if section == "score" else c.module]
        src = " / ".join(f"--{f}" for f, r in table.items() if r in (key, f"{section}.{key}")) or f"--{key}"
        src = f"the command gives no {src}"
    return f"{section}{'.' + key if key else ''}: {err['msg']}" + (f" ({src})" if src else "")


def import_text(text: str, source: str = "<stdin>") -> str:
    commands = find_commands(text)
    if not commands:
        raise CommandError(f"{source}: no OpenRLHF command (deepspeed --module openrlhf.cli.X, python -m "
                           "openrlhf.cli.X, or ray job submit ... -- python3 -m openrlhf.cli.train_ppo_ray)")
    converted = []
    for cmd in commands:
        c = convert(cmd)
        clash = set(c.sections) & {s for done in converted for s in done.sections}
        if clash:
            raise CommandError(f"{source} line {cmd.line}: a second command for stage {', '.join(sorted(clash))}: "
                               "import each from its own file")
        converted.append(c)
    text = render(converted, source)
    host = validate(text, converted)
    if host:  # the rest validated; these are refused on this host only
        head, rest = text.split("\n", 1)
        text = "\n".join([head, "# On this host (no CUDA device) these keys are refused; the rest validates without them:",
                           *(f"#   {h}" for h in host), rest])
    return text


def main(path: str, output: str | None) -> int:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    out = import_text(text, "stdin" if path == "-" else path)
    if output:
        Path(output).write_text(out)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return 0
