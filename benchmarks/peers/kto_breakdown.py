"""Where a KTO epoch's time goes, and so how far any saving could take benchmarks/peers/kto_vs_trl.py's ratio.

Same tiny model, data (the lengthened demo pairs unpaired into KTO rows), batch 8, max_len 160 and length
bucketing as kto_vs_trl.py. One epoch of rlhf_core.train.methods.kto.step in a bare PyTorch loop (forward,
backward, clip, fused AdamW: the DeepSpeed job minus the engine), in three forms, alternating:

    full           the kto step as trained: the mismatched KL pairs forwarded without gradient, then the examples
    kl_completion  the KL forward over the KL completions alone, prompt left out: a lower bound of what forwarding
                   them on the examples' (detached) prompt KV cache would cost, attention to the prompt not counted
    no_kl          no KL forward at all: not KTO any more, the bound of every possible KL saving

and the reference pass (rlhf_core.train.reference.pair_logps, one no-gradient forward per batch) over
(example, KL pair) rows sharing the prompt, as the kto stage runs it, against the examples alone.

    .venv/bin/python benchmarks/peers/kto_breakdown.py [--pairs 512] [--repeats 2]
"""
from __future__ import annotations

import random
import statistics
import time

import torch

import trl_peer


def main():
    a = trl_peer.parser("preference pairs, unpaired into 2x KTO rows").parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.inputs import data
    from rlhf_core.train import adamw
    from rlhf_core.train.batches import BatchPlan
    from rlhf_core.train.entry import forward
    from rlhf_core.train.methods import kto
    from rlhf_core.train.reference import pair_logps

    _, policy, _, pairs = trl_peer.setup("kto-breakdown-", a.pairs)
    rows = data.pairs_to_kto(pairs)
    random.Random(8).shuffle(rows)
    tok = AutoTokenizer.from_pretrained(str(policy))
    records, _ = kto.tokenize(rows, tok, a.max_len)
    spec = {"packing_samples": False, "beta": 0.1, "desirable_loss_weight": 1.0, "undesirable_loss_weight": 1.0}
    plan = BatchPlan([len(r["ids"]) for r in records], a.batch, a.batch, 1, 0, 1, True)

    def fresh():
        return AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)

    ref = fresh().eval()
    fwd = lambda seqs, starts: forward(ref, spec, seqs, starts, 0, pairs=True)[0]  # noqa: E731
    got = pair_logps(fwd, [{"chosen_ids": r["ids"], "chosen_start": r["start"], "rejected_ids": r["kl_ids"],
                            "rejected_start": r["kl_start"]} for r in records], a.batch)
    for i, r in enumerate(records):
        r["ref_logp"], r["ref_kl_logp"] = got[i]

    forms = {
        "full": lambda rs: rs,
        "kl_completion": lambda rs: [dict(r, kl_ids=r["kl_ids"][r["kl_start"] - 1:], kl_start=1) for r in rs],
        "no_kl": lambda rs: [dict(r, kl_ids=r["kl_ids"][:2], kl_start=1) for r in rs],  # one token: ~no work
    }

    def epoch(form) -> float:
        torch.manual_seed(0)
        model = fresh()
        opt = adamw(model.parameters(), 5e-4, (0.9, 0.95), 0.0)
        t = time.perf_counter()
        for s in range(plan.total_steps):
            for mb in plan.micro_batches(s, 0):
                loss, _, _ = kto.step(model, spec, forms[form]([records[i] for i in mb]), 0)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        return time.perf_counter() - t

    def reference(with_kl: bool) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for k in range(0, len(records), a.batch):
                rs = records[k:k + a.batch]
                if with_kl:
                    fwd([r["ids"] for r in rs] + [r["kl_ids"] for r in rs], [r["start"] for r in rs] + [r["kl_start"] for r in rs])
                else:
                    forward(ref, spec, [r["ids"] for r in rs], [r["start"] for r in rs], 0)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        for name in forms:
            times.setdefault(f"loop {name}", []).append(epoch(name))
        times.setdefault("reference examples + KL pairs", []).append(reference(True))
        times.setdefault("reference examples only", []).append(reference(False))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(records)} rows, {plan.total_steps} steps of {a.batch}, torch threads {torch.get_num_threads()}, "
          f"medians of {a.repeats} (seconds):")
    for k, v in med.items():
        print(f"  {k:32s} {v:6.2f}   runs {' '.join(f'{x:.2f}' for x in times[k])}")
    full = med["loop full"] + med["reference examples + KL pairs"]
    for name, loop, refs in (("kl_completion", med["loop kl_completion"], med["reference examples + KL pairs"]),
                             ("no_kl", med["loop no_kl"], med["reference examples only"])):
        print(f"  {name}: reference + loop {refs + loop:.2f} s against {full:.2f} s as trained: x{full / (refs + loop):.2f} faster")


if __name__ == "__main__":
    main()
