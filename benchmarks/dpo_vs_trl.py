"""DPO training throughput: this project's dpo stage (reference pass once + DeepSpeed job, length
bucketing) vs TRL's DPOTrainer, same tiny model, data, batch size, max_length and one epoch, side by side.

    .venv/bin/python benchmarks/dpo_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160]

Real tokens = prompt + response tokens of chosen and rejected over the epoch (padding not counted).
Ours: reference-pass seconds + training-loop seconds (launcher start reported separately).
TRL: trainer.train() seconds (precompute_ref_log_probs counted in it when enabled).
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from rlhf_core import data, demo_task, store, tiny as tiny_mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=160)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    policy, _ = tiny_mod.build_tiny_pair(root / "local", demo_task.corpus(0), seed=0)
    policy_uri = str(root / "store" / "policy")
    store.commit_model_dir(policy, policy_uri, "tiny-model", {"seed": 0})
    # ENV-NOTES' reference figures used prompts of 20-43 tokens and responses of 9-82: lengthen the demo's
    # pairs the same way (neutral words on the prompt, several reviews per response) so ratios compare.
    # The labels then no longer follow the gold reward: this measures speed only.
    import random

    rng = random.Random(7)
    rows = demo_task.preference_rows(a.pairs, seed=7)
    for r in rows:
        r["prompt"] = r["prompt"] + " " + " ".join(rng.choice(demo_task.NEUTRAL) for _ in range(rng.randint(14, 36))) + " "
        for k in ("chosen", "rejected"):
            r[k] = " ".join([r[k]] + [demo_task.random_review(rng) for _ in range(rng.randint(0, 7))])
    pairs_uri = str(root / "store" / "pairs")
    w = store.ArtifactWriter(pairs_uri, "data", {"n": a.pairs})
    w.begin(); w.write_table("p.parquet", data.to_table(rows, "pairs")); w.commit()

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["prompt"] + r[k])["input_ids"]) + 1 for r in rows for k in ("chosen", "rejected"))

    from stages import dpo, reference
    ref = reference.run(reference.Config(pairs_uri=pairs_uri, ref_uri=policy_uri, output_uri=str(root / "ref"),
                                         max_len=a.max_len, batch_size=a.batch))
    ref_s = ref.metrics["seconds"]
    t1 = time.time()
    m = dpo.run(dpo.Config(policy_uri=policy_uri, dataset_uri=str(root / "ref"), output_uri=str(root / "dpo"),
                           max_len=a.max_len, train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0,
                           learning_rate=5e-4, beta=0.1, lr_warmup_ratio=0.0, log_steps=1000))
    stage_wall = time.time() - t1
    ours_train = m.metrics["train_seconds"]
    ours = {"reference_pass_s": ref_s, "train_loop_s": ours_train, "stage_wall_s": stage_wall,
            "tokens_per_s_ref_counted": real / (ref_s + ours_train), "train_loop_tokens_per_s": m.metrics["tokens_per_s"]}
    print("ours:", json.dumps(ours), flush=True)  # early, in case the slower TRL runs are cut off

    import datasets
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    results = {"ours": ours}
    for name, extra in (("trl_defaults", {}), ("trl_precompute_no_gc", {"precompute_ref_log_probs": True, "gradient_checkpointing": False})):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)
        args = DPOConfig(output_dir=str(root / name), per_device_train_batch_size=a.batch, max_length=a.max_len,
                         num_train_epochs=1, learning_rate=5e-4, beta=0.1, report_to=[], use_cpu=True, save_strategy="no",
                         logging_steps=1000, dataloader_num_workers=0, **extra)
        tr = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
        t = time.time()
        tr.train()
        s = time.time() - t
        results[name] = {"train_s": s, "tokens_per_s_ref_counted": real / s}
        print(f"{name}:", json.dumps(results[name]), flush=True)
    results["real_tokens"] = real
    results["speedup_vs_trl_defaults"] = ours["tokens_per_s_ref_counted"] / results["trl_defaults"]["tokens_per_s_ref_counted"]
    results["speedup_vs_trl_precompute"] = ours["tokens_per_s_ref_counted"] / results["trl_precompute_no_gc"]["tokens_per_s_ref_counted"]
    results["reference_pass_vs_epoch"] = ref_s / ours_train
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
