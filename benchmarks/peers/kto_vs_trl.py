"""KTO training throughput: this project's kto stage (reference pass once over the examples and their
mismatched KL pairs + DeepSpeed job, length bucketing) vs TRL's KTOTrainer, same tiny model, data, batch
size, max_length and one epoch, side by side, both in fp32. Structure and recipe of benchmarks/peers/dpo_vs_trl.py.

    .venv/bin/python benchmarks/peers/kto_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                              [--trl-python /tmp/trl-venv/bin/python]

TRL runs in its own process from its own clean virtualenv (`--trl-python`; see benchmarks/peers/dpo_vs_trl.py for
how to make one). Each peer at its best: TRL 1.16's KTOConfig defaults to bf16=True (about 6x slower autocast
matmuls on CPUs without bf16 instructions) and gradient_checkpointing=True; bf16 is set False for every TRL
variant, and a dtype check refuses to report a ratio unless both sides trained in float32 (TRL: a forward
hook on the decoder sees float32 hidden states with CPU autocast off; ours: the job's config has bf16 off
and the trained weights are float32). TRL's best configuration is precompute_ref_log_probs=True (reference
log-probs of the completions and the KL completions once, counted) with gradient checkpointing off; its
defaults are reported too. Both sides estimate the KL reference point from mismatched pairs, which each
forwards without gradient (TRL: completions cycled within a batch; ours: a seeded derangement).

Data: the demo's gold-labelled pairs lengthened as in dpo_vs_trl.py, unpaired into KTO rows (chosen
desirable, rejected undesirable: 2 x pairs rows). Real tokens = prompt + completion (+ EOS) tokens of the
examples over the epoch (the KL pairs' forwards and padding not counted, on both sides).
Ours: reference-pass seconds + training-loop seconds (launcher start reported separately).
TRL: trainer.train() seconds + with precompute_ref_log_probs its reference precompute, which TRL 1.16 runs in
KTOTrainer.__init__ (timed apart by trl_peer.trl_train; figures before 2026-11-26 23:30 UTC left it out).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import trl_peer


def main():
    a = trl_peer.parser("preference pairs, unpaired into 2x KTO rows").parse_args()
    if a.trl_peer:
        print("RESULT " + json.dumps(trl_peer.trl_train(json.loads(a.trl_peer), "KTOConfig", "KTOTrainer")), flush=True)
        return
    from transformers import AutoTokenizer

    from rlhf_core.inputs import data
    from stages import kto

    root, policy, policy_uri, pairs = trl_peer.setup("kto-bench-", a.pairs, a.model)
    rows = data.pairs_to_kto(pairs)
    random.Random(8).shuffle(rows)  # TRL samples sequentially: do not hand it alternating labels
    kto_uri = trl_peer.commit_rows(root, rows, "kto", "kto-rows")
    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows)

    def config(i):
        return kto.Config(policy_uri=policy_uri, dataset_uri=kto_uri, output_uri=str(root / f"kto{i}"), max_len=a.max_len,
                          train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0, learning_rate=5e-4,
                          beta=0.1, lr_warmup_ratio=0.0, log_steps=1000, bf16=False)

    def ours(i: int) -> dict:
        t1 = time.time()  # the stage's wall: its reference pass included
        m = kto.run(config(i))
        return {"reference_pass_s": m.metrics["reference_seconds"], "train_loop_s": m.metrics["train_seconds"],
                "stage_wall_s": time.time() - t1, "dtype": trl_peer.float32_trained(m, root / f"kto{i}")}

    def bare(i: int) -> dict:  # the training loop of ours(i) without its engine, on the records the stage builds
        from rlhf_core.inputs import models
        from rlhf_core.train.methods import kto as kto_method
        from rlhf_core.train.reference import compute

        cfg, pad = config(i), models.pad_id(tok, policy)
        records, _ = kto_method.tokenize(rows, tok, a.max_len, seed=cfg.seed, model_dir=policy)
        pairs = [{"chosen_ids": r["ids"], "chosen_start": r["start"], "rejected_ids": r["kl_ids"], "rejected_start": r["kl_start"]}
                 for r in records]
        ref_lp, ref_kl, _ = compute(pairs, policy, pad, root / f"bare-ref{i}", batch_size=a.batch, launcher="inline")
        for r, x, y in zip(records, ref_lp, ref_kl):
            r["ref_logp"], r["ref_kl_logp"] = x, y
        spec = {k: getattr(cfg, k) for k in ("beta", "desirable_loss_weight", "undesirable_loss_weight")}
        return trl_peer.bare_loop(cfg, "kto", records, policy, pad, spec)

    trl_peer.compare(a, str(Path(__file__).resolve()), root, policy, ours, real, {"rows": len(rows)}, bare=bare)


if __name__ == "__main__":
    main()
