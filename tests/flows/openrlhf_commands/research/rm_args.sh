#!/bin/bash
# Reward model for one of two sizes: bash train_rm.sh SIZE [GPUS]
SIZE=${1:?usage: $0 SIZE [GPUS]}
GPUS=${2:-4}
case "$SIZE" in
    1b) BASE=org/base-1b; MICRO=4 ;;
    8b) BASE=org/base-8b; MICRO=1 ;;
    *) echo "unknown size $SIZE" >&2; exit 1 ;;
esac
TEMPLATE=$'Human: {}\nAssistant: '

deepspeed --num_gpus "$GPUS" --module openrlhf.cli.train_rm \
    --pretrain "$BASE" \
    --dataset org/preferences \
    --input_template "$TEMPLATE" \
    --train_batch_size 64 \
    --micro_train_batch_size "$MICRO" \
    --save_path "ckpt/rm-$SIZE" \
    --max_epoch 1 \
    --use_wandb "$WANDB_KEY" \
    --use_tensorboard logs/rm-$SIZE
