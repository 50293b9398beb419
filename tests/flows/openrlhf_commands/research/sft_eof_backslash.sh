#!/bin/bash
# SFT on a local chat set: the last continuation line keeps its backslash (no newline after it).

deepspeed --num_gpus 2 --module openrlhf.cli.train_sft \
    --pretrain meta-llama/Llama-3.2-1B \
    --dataset data/chat_sft.jsonl \
    --input_key prompt --output_key completion \
    --train_batch_size 32 --micro_train_batch_size 4 \
    --save_path ckpt/llama-1b-sft \