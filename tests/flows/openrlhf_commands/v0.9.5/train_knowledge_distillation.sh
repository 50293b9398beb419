# OpenRLHF examples/scripts/train_knowledge_distillation.sh at v0.9.5 (commit c0e2ee2473cd115863630599cc3d51917d4b7c3e), verbatim below this header (OpenRLHF is Apache-2.0).
set -x

read -r -d '' training_commands <<EOF
openrlhf.cli.train_kd \
   --max_len 2048 \
   --dataset Open-Orca/OpenOrca \
   --input_key question \
   --output_key response \
   --train_batch_size 256 \
   --micro_train_batch_size 2 \
   --max_samples 500000 \
   --pretrain meta-llama/Meta-Llama-3-8B-Instruct \
   --teacher_model meta-llama/Meta-Llama-3-70B-Instruct \
   --save_path ./checkpoint/llama3-8b-kd \
   --save_steps -1 \
   --logging_steps 1 \
   --eval_steps -1 \
   --zero_stage 3 \
   --max_epochs 1 \
   --param_dtype bf16 \
   --attn_implementation flash_attention_2 \
   --kd_coef 0.4 \
   --learning_rate 5e-6 \
   --teacher_offload \
   --gradient_checkpointing
EOF
    # --use_wandb [WANDB_TOKENS] or True (use wandb login command)


if [[ ${1} != "slurm" ]]; then
    deepspeed --module $training_commands
fi
