#!/bin/bash
# Long-context SFT: sequences split over 4 ranks with ring attention, on every GPU of the node.
mkdir -p logs
deepspeed --module openrlhf.cli.train_sft \
    --pretrain org/base-7b \
    --dataset json@/data/longctx \
    --input_key question --output_key answer \
    --max_len 65536 \
    --packing_samples \
    --ring_attn_size 4 \
    --ring_head_stride 2 \
    --train_batch_size 32 \
    --micro_train_batch_size 1 \
    --zero_stage 3 \
    --bf16 \
    --flash_attn \
    --save_path ckpt/sft-longctx > >(tee -a logs/sft.log) 2> >(tee -a logs/sft.err >&2)
