#!/bin/bash
# DPO from a checkout of OpenRLHF: the trainer launched by its file, on the GPUs CUDA_VISIBLE_DEVICES lists.
export CUDA_VISIBLE_DEVICES=0,1
cd "$(dirname "$0")/.." || exit 1
deepspeed openrlhf/cli/train_dpo.py \
    --pretrain org/sft-1b \
    --dataset json@data/pairs,org/more-pairs \
    --apply_chat_template \
    --train_batch_size 16 \
    --micro_train_batch_size 2 \
    --max_len 2048 \
    --beta 0.1 \
    --flash_attn \
    --bf16 \
    --optim adam \
    --save_path ckpt/dpo-1b
