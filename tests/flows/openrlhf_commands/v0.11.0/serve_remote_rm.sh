# OpenRLHF examples/scripts/serve_remote_rm.sh at v0.11.0 (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7), verbatim below this header (OpenRLHF is Apache-2.0).
set -x

python -m openrlhf.cli.serve_rm \
    --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
    --port 5000 \
    --ds.param_dtype bf16 \
    --ds.attn_implementation flash_attention_2 \
    --reward.normalize_enable \
    --data.max_len 8192 \
    --batch_size 16
