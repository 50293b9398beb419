#!/bin/bash
# A PPO run whose long command lost one backslash while being edited.
python3 -m openrlhf.cli.train_ppo_ray \
    --pretrain org/sft-1b \
    --reward_pretrain org/rm-1b \
    --prompt_data org/prompts \
    --save_path ckpt/ppo-1b
    --vllm_sync_backend nccl \
    --vllm_enable_sleep \
    --deepspeed_enable_sleep
