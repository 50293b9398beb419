#!/bin/bash
# REINFORCE++ with this repository's own verifier server (not OpenRLHF's) started in the background.
nohup python -m verifier.remote_rm --host 0.0.0.0 --port 6000 --workers 16 > verifier.log 2>&1 &
sleep 20

python3 -m openrlhf.cli.train_ppo_ray \
    --pretrain org/policy-3b \
    --prompt_data org/puzzles \
    --remote_rm_url http://127.0.0.1:6000/get_reward,http://127.0.0.1:6001/get_reward \
    --advantage_estimator reinforce \
    --init_kl_coef 0 \
    --ref_num_nodes 1 --ref_num_gpus_per_node 2 \
    --actor_num_gpus_per_node 2 \
    --vllm_num_engines 2 \
    --train_batch_size 32 --rollout_batch_size 32 --micro_train_batch_size 2 --micro_rollout_batch_size 2 \
    --save_path ckpt/reinforce-3b
