"""Reward-model training throughput: this project's train_rm stage (a DeepSpeed job; each pair's prompt forwarded
once, [prompt | chosen | rejected] in one row) vs TRL's RewardTrainer (prompt prepended to chosen and to rejected,
2 x batch padded rows), same model, data, batch size, max_length and one epoch, side by side, both in fp32, plus
a plain PyTorch loop over our batches (what the engine costs).

    .venv/bin/python benchmarks/peers/rm_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                             [--model tiny|57m] [--trl-python /tmp/trl-venv/bin/python]

Both sides start from the same causal LM (the lengthened demo pairs' tiny policy, or its 57M shape) with a new
scalar head (AutoModelForSequenceClassification, num_labels 1), Bradley-Terry loss -log sigmoid(r_c - r_r), lr 5e-4.
TRL runs in its own process from its own virtualenv (benchmarks/peers/dpo_vs_trl.py says how to make one), with
bf16=False (RewardConfig defaults to bf16=True: CPU autocast, ~6x slower here) and a dtype check on both sides.
TRL variants: its defaults (gradient checkpointing on) and its best on CPU (gradient checkpointing off). TRL drops
pairs longer than max_length where we truncate them; at --max-len 160 no pair of this data is that long (checked:
the script refuses to compare otherwise).

Our figure is the training loop (train_seconds); the stage's final pass over the training set for the reward mean
and std (the score stage's normalisation) is after it and not counted; TRL computes no such statistics.
Real tokens = prompt + response (+ EOS) of chosen and rejected over the epoch, padding and sharing not counted.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import trl_peer

VARIANTS = {"trl_defaults": {}, "trl_best": {"gradient_checkpointing": False}}


def main():
    a = trl_peer.parser().parse_args()
    if a.trl_peer:
        print("RESULT " + json.dumps(trl_peer.trl_train(json.loads(a.trl_peer), "RewardConfig", "RewardTrainer")), flush=True)
        return
    from transformers import AutoTokenizer

    from rlhf_core.inputs import models
    from rlhf_core.train import batches
    from stages import train_rm

    root, policy, policy_uri, rows = trl_peer.setup("rm-bench-", a.pairs, a.model)
    pairs_uri = trl_peer.commit_rows(root, rows, "pairs", "pairs")
    tok = AutoTokenizer.from_pretrained(str(policy))
    lens = [len(tok(r["prompt"] + r[k])["input_ids"]) + 1 for r in rows for k in ("chosen", "rejected")]
    if max(lens) > a.max_len:  # TRL would drop these pairs, we would truncate them: not the same work
        sys.exit(f"--max-len {a.max_len}: the longest sequence has {max(lens)} tokens; raise --max-len")
    real = sum(lens)

    def config(i):
        return train_rm.Config(base_uri=policy_uri, dataset_uri=pairs_uri, output_uri=str(root / f"rm{i}"),
                               max_len=a.max_len, train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0,
                               learning_rate=5e-4, lr_warmup_ratio=0.0, log_steps=1000, bf16=False)

    def ours(i: int) -> dict:
        t0 = time.time()
        m = train_rm.run(config(i))
        return {"reference_pass_s": 0.0, "train_loop_s": m.metrics["train_seconds"], "stage_wall_s": time.time() - t0,
                "dtype": trl_peer.float32_trained(m, root / f"rm{i}")}

    def bare(i: int) -> dict:
        records, _ = batches.tokenize_pairs(rows, tok, a.max_len, model_dir=policy)
        return trl_peer.bare_loop(config(i), "rm", records, policy, models.pad_id(tok, policy),
                                  {"loss": "sigmoid", "use_margin": False})

    trl_peer.compare(a, str(Path(__file__).resolve()), root, policy, ours, real, {"pairs": len(rows)}, VARIANTS, bare)


if __name__ == "__main__":
    main()
