"""The reference pass: summed response log-probs of a frozen model over tokenized pairs, computed once per
dataset (TRL's precompute_ref_log_probs) so DPO trains one model instead of two.

It runs where training runs and in the training dtype, so that at DPO's step 0 policy and reference agree
(implied margin 0): as a job under the training stages' launcher (`python -m rlhf_core.train.reference
SPEC.json` under deepspeed / torchrun; with zero_stage 3 DeepSpeed shards the weights over the ranks, each
rank forwards every world-th batch and rank 0 gathers), or `inline` in this process on its one device (GPU
if there is one). The forward is the training forward (rlhf_core.train.entry.forward): same collation
(a pair's prompt forwarded once), same padding or packing, same log-prob code.

    python -m rlhf_core.train.reference SPEC.json     (started by `compute`, never by hand)
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from rlhf_core.runtime import forkserver, progress

from rlhf_core.train.batches import seq_len


@torch.inference_mode()
def pair_logps(forward, records: list[dict], batch_size: int, rank: int = 0, world: int = 1,
               report: Callable[[int, int], None] | None = None) -> dict[int, tuple]:
    """{record index: (chosen, rejected)} for this rank's batches (batches sorted by length; rank r takes
    batches r, r + world, ...). Every rank runs the same number of forwards (ZeRO-3 gathers weights
    collectively), the last ones repeating a batch whose results are dropped. `report(done, total)` is
    called about 20 times (pairs done over all ranks, as rank 0 sees them)."""
    order = sorted(range(len(records)), key=lambda i: seq_len(records[i]))
    batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    mine = batches[rank::world]
    out = {}
    rounds = math.ceil(len(batches) / world)
    for j in range(rounds):
        if report and (j % max(1, rounds // 20) == 0 or j == rounds - 1) and j:
            report(min(len(records), j * world * batch_size), len(records))
        idx = mine[j] if j < len(mine) else batches[0]
        recs = [records[i] for i in idx]
        lp = forward([r["chosen_ids"] for r in recs] + [r["rejected_ids"] for r in recs],
                     [r["chosen_start"] for r in recs] + [r["rejected_start"] for r in recs]).float().cpu()  # (2n,)
        if j < len(mine):
            out.update({i: (float(lp[k]), float(lp[len(idx) + k])) for k, i in enumerate(idx)})
    if report:
        report(len(records), len(records))
    return out


def _load(spec: dict, device: str):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if spec["bf16"] else torch.float32
    return AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, use_safetensors=True,
                                                attn_implementation=spec["attn_implementation"]).to(device).eval()


def _spec_forward(model, spec: dict):
    from rlhf_core.train.entry import forward

    return lambda seqs, starts: forward(model, spec, seqs, starts, spec["pad_id"], pairs=True)[0]


def compute(records: list[dict], model_dir: str | Path, pad_id: int, work_dir: Path, *, bf16: bool = False,
            zero_stage: int = 0, batch_size: int = 16, packing_samples: bool = False, launcher: str = "deepspeed",
            num_gpus: int | str = 1, num_nodes: int = 1, hostfile: str | None = None,
            attn_implementation: str = "sdpa", max_len: int | None = None) -> tuple[list[float], list[float], float]:
    """(chosen, rejected) summed response log-probs of every record in record order, and the seconds the
    forwards took (model loaded; a job's start and load are left out, as training's train_seconds does).
    `attn_implementation`: as the trainer's (its masks and, under flash attention, its pair layout); `max_len`:
    with packing_samples, the token budget of a packed row (entry.batch_of; None: one row per batch)."""
    spec = {"method": "reference", "model_dir": str(model_dir), "pad_id": pad_id, "bf16": bf16,
            "zero_stage": zero_stage, "batch_size": batch_size, "packing_samples": packing_samples,
            "work_dir": str(work_dir), "attn_implementation": attn_implementation, "max_len": max_len}
    if launcher == "inline":
        model = _load(spec, "cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        got = pair_logps(_spec_forward(model, spec), records, batch_size,
                         report=lambda d, n: progress.rows("reference", d, n))
        seconds = time.perf_counter() - t0
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from rlhf_core.runtime import jobs

        shutil.rmtree(work_dir, ignore_errors=True)
        work_dir.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(records), work_dir / "data.parquet")
        spec["data_path"] = str(work_dir / "data.parquet")
        (work_dir / "spec.json").write_text(json.dumps(spec))
        cmd = jobs.launcher_command("rlhf_core.train.reference", [str(work_dir / "spec.json")], launcher, num_gpus,
                                    num_nodes, hostfile)
        jobs.run_job(cmd, env=jobs.job_env(jobs.procs_per_node(num_gpus) * num_nodes))
        result = json.loads((work_dir / "result.json").read_text())
        shutil.rmtree(work_dir, ignore_errors=True)
        got, seconds = {int(k): v for k, v in result["logps"].items()}, result["seconds"]
    if len(got) != len(records):
        raise RuntimeError(f"reference pass returned {len(got)} of {len(records)} pairs")
    return [got[i][0] for i in range(len(records))], [got[i][1] for i in range(len(records))], seconds


def main(spec_path: str) -> None:
    """The job: every rank loads the model (ZeRO-3: sharded), forwards its batches; rank 0 writes result.json."""
    import pyarrow.parquet as pq
    import torch.distributed as dist

    from rlhf_core.train.entry import init_distributed

    spec = json.loads(Path(spec_path).read_text())
    deepspeed, rank, world, cuda = init_distributed()
    config = {"train_micro_batch_size_per_gpu": spec["batch_size"], "train_batch_size": spec["batch_size"] * world,
              "zero_optimization": {"stage": spec["zero_stage"]}, "bf16": {"enabled": spec["bf16"]},
              "steps_per_print": 10 ** 9}
    if spec["zero_stage"] == 3:  # load straight into shards: no rank ever holds the whole model
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(config)  # noqa: F841 (must stay alive while the model loads)
    model = _load(spec, "cpu")
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    records = pq.read_table(spec["data_path"]).to_pylist()
    dist.barrier()
    t0 = time.perf_counter()
    say = lambda d, n: print(f"progress reference {d}/{n} rows", flush=True)  # noqa: E731 (to the logger)
    mine = pair_logps(_spec_forward(engine, spec), records, spec["batch_size"], rank, world, say if rank == 0 else None)
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    seconds = time.perf_counter() - t0
    if rank == 0:
        merged = {k: v for p in parts for k, v in p.items()}
        (Path(spec["work_dir"]) / "result.json").write_text(json.dumps({"logps": merged, "seconds": seconds}))
        print(f"reference pass: {len(merged)} pairs on {world} rank(s) in {seconds:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    forkserver.leave(0)  # done: without the interpreter's teardown, where gloo's threads can abort a finished rank
