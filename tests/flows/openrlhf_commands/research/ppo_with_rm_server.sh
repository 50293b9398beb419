#!/bin/bash
# PPO whose reward comes over HTTP: the reward model is served first, then the trainer points at it.
RM=org/rm-8b
PORT=5000

python -m openrlhf.cli.serve_rm \
    --reward_pretrain $RM \
    --port $PORT \
    --bf16 \
    --flash_attn \
    --normalize_reward \
    --max_len 4096 \
    --batch_size 8 > logs/rm_server.log 2>&1 &
RM_PID=$!
sleep 60

ray job submit --address="http://127.0.0.1:8265" -- python3 -m openrlhf.cli.train_ppo_ray \
    --pretrain org/sft-8b \
    --critic_pretrain org/sft-8b \
    --remote_rm_url http://localhost:$PORT/get_reward \
    --prompt_data org/prompts \
    --reward_num_nodes 0 \
    --actor_num_gpus_per_node 2 --critic_num_gpus_per_node 2 --ref_num_gpus_per_node 2 \
    --vllm_num_engines 1 \
    --train_batch_size 64 --rollout_batch_size 64 --micro_rollout_batch_size 4 --micro_train_batch_size 4 \
    --save_path ckpt/ppo-8b 2>&1 | tee logs/ppo.log

kill $RM_PID
