"""DPO training throughput: this project's dpo stage (reference pass once + DeepSpeed job, length bucketing)
vs TRL's DPOTrainer, same tiny model, data, batch size, max_length and one epoch, side by side, both in fp32.

    .venv/bin/python benchmarks/peers/dpo_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                              [--trl-python /tmp/trl-venv/bin/python]

TRL runs in its own process, by default from its own clean virtualenv (`--trl-python`; make one with
`python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install -c requirements/cpu-constraints.txt
torch==2.13.0+cpu transformers==5.19.0 datasets==5.2.0 accelerate==1.15.0 trl==1.16.0`), or from this
venv with `--trl-python .venv/bin/python` after `pip install -e ".[bench]"`.
Each peer at its best: TRL 1.16's DPOConfig defaults to bf16=True, which on CPUs without bf16 instructions
runs autocast matmuls ~6x slower; it is set False here, and a dtype check refuses to report a ratio unless
both sides trained in float32 (TRL: a forward hook on the decoder sees float32 hidden states with CPU autocast off; ours: the
job's config has bf16 off and the trained weights are float32). TRL's best configuration is
precompute_ref_log_probs=True with gradient checkpointing off (its precompute counted); its defaults are
reported too.

Real tokens = prompt + response tokens of chosen and rejected over the epoch (padding not counted).
Ours: reference-pass seconds + training-loop seconds (launcher start reported separately).
TRL: trainer.train() seconds + with precompute_ref_log_probs its reference precompute, which TRL 1.16 runs in
DPOTrainer.__init__ (timed apart by trl_peer.trl_train; figures before 2026-11-26 23:30 UTC left it out).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import trl_peer


def main():
    a = trl_peer.parser().parse_args()
    if a.trl_peer:
        print("RESULT " + json.dumps(trl_peer.trl_train(json.loads(a.trl_peer), "DPOConfig", "DPOTrainer")), flush=True)
        return
    from transformers import AutoTokenizer

    from rlhf_core import store
    from stages import dpo, reference

    root, policy, policy_uri, rows = trl_peer.setup("dpo-bench-", a.pairs, a.model)
    pairs_uri = trl_peer.commit_rows(root, rows, "pairs", "pairs")
    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["prompt"] + r[k])["input_ids"]) + 1 for r in rows for k in ("chosen", "rejected"))

    def config(i, dataset_uri):
        return dpo.Config(policy_uri=policy_uri, dataset_uri=dataset_uri, output_uri=str(root / f"dpo{i}"),
                          max_len=a.max_len, train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0,
                          learning_rate=5e-4, beta=0.1, lr_warmup_ratio=0.0, log_steps=1000, bf16=False)

    def ours(i: int) -> dict:
        t0 = time.time()
        ref = reference.run(reference.Config(pairs_uri=pairs_uri, ref_uri=policy_uri, output_uri=str(root / f"ref{i}"),
                                             max_len=a.max_len, batch_size=a.batch))
        m = dpo.run(config(i, ref.uri))
        return {"reference_pass_s": ref.metrics["seconds"], "train_loop_s": m.metrics["train_seconds"],
                "stage_wall_s": time.time() - t0, "dtype": trl_peer.float32_trained(m, root / f"dpo{i}")}

    def bare(i: int) -> dict:  # the training loop of ours(i) without its engine (the reference pass is shared)
        from rlhf_core.inputs import models
        from rlhf_core.train import batches

        ref_uri = str(root / "ref0")
        records, _ = batches.tokenize_pairs(store.read_table(ref_uri).to_pylist(), tok, a.max_len, extra=dpo.REF_COLUMNS,
                                              model_dir=policy)
        cfg = config(i, ref_uri)
        spec = {k: getattr(cfg, k) for k in ("beta", "loss_type", "label_smoothing", "nll_loss_coef")}
        return trl_peer.bare_loop(cfg, "dpo", records, policy, models.pad_id(tok, policy), spec)

    trl_peer.compare(a, str(Path(__file__).resolve()), root, policy, ours, real, bare=bare)


if __name__ == "__main__":
    main()
