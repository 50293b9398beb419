# OpenRLHF examples/scripts/serve_remote_rm.sh at v0.9.10 (commit 6f58d4183dfa2ff2de396f856350ed4aca395645), verbatim below this header (OpenRLHF is Apache-2.0).
set -x

python -m openrlhf.cli.serve_rm \
    --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
    --port 5000 \
    --param_dtype bf16 \
    --attn_implementation flash_attention_2 \
    --normalize_reward \
    --max_len 8192 \
    --batch_size 16
