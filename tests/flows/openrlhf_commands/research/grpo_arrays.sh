#!/usr/bin/env bash
# GRPO on math prompts with a rule-based reward: flags grouped in arrays, extended further down.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-Math-1.5B}
DATA=${DATA-data/math_train.jsonl}   # no colon: only an unset DATA takes the default
OUT=${OUT_ROOT:-./runs}/grpo_math

MODEL_ARGS=(
    --pretrain "$MODEL"
    --save_path "$OUT"
)
DATA_ARGS=(--prompt_data "$DATA" --input_key problem --label_key answer)
DATA_ARGS+=(--apply_chat_template)   # the instruct model's template

ROLLOUT_ARGS=(
    --rollout_batch_size 64
    --n_samples_per_prompt 8
)
if [[ "${LONG:-0}" == "1" ]]; then
    ROLLOUT_ARGS+=(--max_new_tokens 8192)
else
    ROLLOUT_ARGS+=(
        --max_new_tokens 1024   # short answers while debugging
        --temperature 1.0
    )
fi

EXTRA="--seed 7"
EXTRA+=" --logging_steps 5"

ray job submit --address=http://127.0.0.1:8265 \
    -- python3 -m openrlhf.cli.train_ppo_ray \
    "${MODEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${ROLLOUT_ARGS[@]}" \
    --advantage_estimator group_norm \
    --remote_rm_url ./reward/math_verify.py \
    --init_kl_coef 0.001 \
    --train_batch_size 128 \
    --micro_train_batch_size 4 \
    --actor_num_gpus_per_node 4 \
    --ref_num_gpus_per_node 4 \
    --vllm_num_engines 2 \
    $EXTRA
