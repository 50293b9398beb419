"""SFT training throughput with packing: this project's sft stage (packing_samples: each micro-batch one row,
per-sample positions, no padding) vs TRL's SFTTrainer with packing=True (its default "bfd" strategy: best-fit
bins of max_length tokens, padding-free, per-sample position ids), same model, data, max_length and one
epoch, side by side, both in fp32, plus a plain PyTorch loop over our batches (what the engine costs).

    .venv/bin/python benchmarks/peers/sft_vs_trl.py [--pairs 512] [--batch 8] [--max-len 160] [--repeats 2]
                                              [--model tiny|57m] [--trl-python /tmp/trl-venv/bin/python]

TRL runs in its own process from its own virtualenv (benchmarks/peers/dpo_vs_trl.py says how to make one), with
bf16=False (TRL 1.16's default bf16=True runs CPU autocast, ~6x slower here) and a dtype check on both sides.
TRL variants: packing with its other defaults (gradient checkpointing on), and packing with gradient
checkpointing off (its best on CPU, where memory is not the limit).

Data: the prompt and chosen response of the lengthened demo pairs (dpo_vs_trl.py), as prompt-completion rows:
loss on the completion only on both sides (TRL: completion_only_loss, its default for this format). Real tokens
= prompt + completion + EOS over the epoch. The step counts differ: ours trains `--batch` samples per step, TRL
`--batch` packed bins of up to max_length tokens (several samples each), so it takes fewer, larger steps; the
same tokens go through the model once on both sides.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import trl_peer

VARIANTS = {"trl_packed": {"packing": True}, "trl_packed_best": {"packing": True, "gradient_checkpointing": False}}


def main():
    a = trl_peer.parser("prompt + chosen response rows (from the lengthened demo pairs)").parse_args()
    if a.trl_peer:
        spec = json.loads(a.trl_peer)
        rows = [json.loads(x) for x in Path(spec["rows"]).read_text().splitlines()]
        Path(spec["rows"] + ".trl").write_text("".join(json.dumps({"prompt": r["input"], "completion": r["output"]}) + "\n"
                                                       for r in rows))
        print("RESULT " + json.dumps(trl_peer.trl_train({**spec, "rows": spec["rows"] + ".trl"}, "SFTConfig", "SFTTrainer")),
              flush=True)
        return
    from transformers import AutoTokenizer

    from rlhf_core.inputs import models
    from rlhf_core.train import batches
    from stages import sft

    root, policy, policy_uri, pairs = trl_peer.setup("sft-bench-", a.pairs, a.model)
    rows = [{"input": r["prompt"], "output": r["chosen"]} for r in pairs]
    sft_uri = trl_peer.commit_rows(root, rows, "sft", "sft-rows")
    tok = AutoTokenizer.from_pretrained(str(policy))
    real = sum(len(tok(r["input"] + r["output"])["input_ids"]) + 1 for r in rows)

    def config(i):
        return sft.Config(policy_uri=policy_uri, dataset_uri=sft_uri, output_uri=str(root / f"sft{i}"), max_len=a.max_len,
                          train_batch_size=a.batch, micro_train_batch_size=a.batch, zero_stage=0, learning_rate=5e-4,
                          lr_warmup_ratio=0.0, log_steps=1000, bf16=False, packing_samples=True)

    def ours(i: int) -> dict:
        t0 = time.time()
        m = sft.run(config(i))
        return {"reference_pass_s": 0.0, "train_loop_s": m.metrics["train_seconds"], "stage_wall_s": time.time() - t0,
                "dtype": trl_peer.float32_trained(m, root / f"sft{i}")}

    def bare(i: int) -> dict:
        records, _ = batches.tokenize_sft(rows, tok, a.max_len, model_dir=policy)
        return trl_peer.bare_loop(config(i), "sft", records, policy, models.pad_id(tok, policy), {})

    trl_peer.compare(a, str(Path(__file__).resolve()), root, policy, ours, real, {"rows": len(rows)}, VARIANTS, bare)


if __name__ == "__main__":
    main()
