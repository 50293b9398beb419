"""Scale (issue 24, part C): ring attention, ZeRO-3 loading a shard per rank, DeepSpeed AutoTP, the MoE
auxiliary loss, Liger kernels. Multi-rank checks run as real 2-process jobs (gloo on 127.0.0.1): the ring
forward and backward in two spawned processes against one, and the sft stage through the launcher."""
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core import store
from rlhf_core.train import launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sft_data(root, n):
    uri = f"{root}/sft-data-{n}"
    w = store.ArtifactWriter(uri, "data", {"n": n})
    w.begin()
    w.write_table("rows.parquet", data.to_table(demo_task.sft_rows(n, 0), "sft"))
    w.commit()
    return uri


@pytest.mark.slow
# ---------------------------------------------------------------------------------------------- ZeRO-3 + ring, launched
def test_ring_zero3_sft_job_equals_one_rank_and_each_rank_loads_a_shard(tmp_path, monkeypatch):
    """One sft job on 2 CPU ranks with ring_attn_size 2 (data-parallel size 1) under ZeRO-3, beside the
    same job on 1 rank without ring attention, on a 21M-parameter Llama (84 MB fp32: far above the load's noise).
    - every step's loss equals the 1-rank run's (atol 1e-5 at step 1, before any update; 1e-4 after; measured
      1e-6). (The 1-rank run is ZeRO-3 too: ZeRO-2 and ZeRO-3 runs differ by ~0.01 at step 2 without ring
      attention, on one rank, measured here);
    - each ZeRO-3 rank holds half the parameters, and its anonymous memory grew during the load by less than
      its shard's bytes + 0.25 x the model's (measured: shard 42.8 MB, growth about 55 MB; a whole copy would
      be >= shard + 0.5 x model), while the 1-rank load (its partition is the whole model) grew by at least
      0.9 x the model's bytes: the probe sees a whole copy where there is one.
    glibc keeps freed heap pages resident, so RSS would also count the full-size tensors zero.Init creates and
    partitions one at a time (measured: 81 MB for the 85 MB model); with every block over 64 KiB its own
    mapping (MALLOC_MMAP_THRESHOLD_), freed memory leaves RSS and the growth follows live memory."""
    from stages import sft

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the job's ranks inherit it

    tok = tiny_mod.build_tokenizer(tmp_path / "tok", demo_task.corpus(0))
    policy = tiny_mod.build_model(tmp_path / "policy", tok, "policy", seed=0, hidden=512, layers=8, heads=8,
                                  intermediate=1024)
    uri = sft_data(tmp_path, 8)
    common = dict(policy_uri=str(policy), dataset_uri=uri, input_template=demo_task.INPUT_TEMPLATE, learning_rate=1e-4,
                  train_batch_size=4, micro_train_batch_size=2, max_len=48, lr_warmup_ratio=0.0, packing_samples=True)
    one = sft.run(sft.Config(output_uri=str(tmp_path / "one"), zero_stage=3, **common))
    two = sft.run(sft.Config(output_uri=str(tmp_path / "two"), num_gpus=2, ring_attn_size=2, zero_stage=3, **common))
    h1 = json.loads((tmp_path / "one" / "training_log.json").read_text())
    h2 = json.loads((tmp_path / "two" / "training_log.json").read_text())
    assert [h["samples"] for h in h1] == [h["samples"] for h in h2] and len(h1) == 2
    assert h2[0]["loss"] == pytest.approx(h1[0]["loss"], abs=1e-5)
    assert [h["loss"] for h in h2] == pytest.approx([h["loss"] for h in h1], abs=1e-4)

    full = one.metrics["load_memory"][0]
    assert full["param_numel_local"] == full["param_numel"] > 20e6
    assert full["load_anon_growth_bytes"] >= 0.9 * full["param_bytes"]
    ranks = two.metrics["load_memory"]
    assert len(ranks) == 2 and sum(r["param_numel_local"] for r in ranks) >= full["param_numel"]
    for r in ranks:
        assert r["param_numel"] == full["param_numel"] and r["param_numel_local"] <= 0.51 * r["param_numel"]
        assert r["load_anon_growth_bytes"] < (r["param_numel_local"] * 4 + 0.25 * r["param_bytes"]), r


# ---------------------------------------------------------------------------------------------- ring attention, in-process
def _ring_losses(rank: int, world: int, model_dirs: dict, port: int, out: str, stride: int) -> None:
    """One rank: each case's loss through the methods' own step (entry.forward: this rank's slice, K/V
    gathered, sums added over the group), then backward; gradients averaged over the ranks as DeepSpeed does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf_core.train import ring
    from rlhf_core.train.methods import dpo, sft

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ring.setup(rank, world, world, stride, "sft")
    spec = {"packing_samples": True, "beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0, "nll_loss_coef": 0.0}
    seqs = [[5 + (i * 7 + j * 3) % 300 for j in range(n)] for i, n in enumerate([13, 20, 8, 11])]  # 52 tokens
    sft_recs = [{"ids": s, "start": st} for s, st in zip(seqs[:3], [4, 6, 2])]  # 41 tokens: the last slice padded
    dpo_recs = [{"chosen_ids": seqs[0], "chosen_start": 4, "rejected_ids": seqs[0][:4] + seqs[1][4:], "rejected_start": 4,
                 "ref_chosen_logp": -50.0, "ref_rejected_logp": -80.0},
                {"chosen_ids": seqs[2], "chosen_start": 3, "rejected_ids": seqs[3], "rejected_start": 3,
                 "ref_chosen_logp": -40.0, "ref_rejected_logp": -45.0}]
    results = {}
    for name, path in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if world > 1:
            ring.use_ring_attention(model)
        for method, recs in (("sft", sft_recs), ("dpo", dpo_recs)):
            model.zero_grad()
            loss, _, _ = (sft if method == "sft" else dpo).step(model, spec, recs, 0)
            loss.backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            for g in grads.values():
                if world > 1:
                    dist.all_reduce(g)
                    g /= world
            results[f"{name}/{method}"] = (loss.detach(), grads)
    if rank == 0:
        torch.save(results, out)
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ring_attention_two_ranks_give_one_ranks_loss_and_gradients(tiny, zoo, tmp_path, stride=1):
    """2 spawned processes (gloo, ring_attn_size 2, ring_head_stride 1: one KV head gathered at a time) against
    the same step in this process without ring attention: sft (3 packed samples, 41 tokens: the second slice
    holds padding) and dpo (2 packed pairs) on the tiny Llama (2 heads) and the Qwen2 of the zoo (GQA: 2 query
    heads on 1 KV head, tied embeddings). Loss and every parameter's gradient (averaged over the ranks, as
    DeepSpeed reduces them) equal the 1-rank values: atol 1e-5 (measured about 1e-7)."""
    dirs = {"llama": str(tiny.policy_dir), "qwen2": str(zoo["qwen2"].policy)}
    _ring_losses(0, 1, dirs, 0, str(tmp_path / "one.pt"), stride)
    mp.spawn(_ring_losses, args=(2, dirs, _free_port(), str(tmp_path / "two.pt"), stride), nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys() and len(one) == 4
    for case, (loss, grads) in one.items():
        assert two[case][0].item() == pytest.approx(loss.item(), abs=1e-5), case
        for k, g in grads.items():
            assert torch.allclose(two[case][1][k], g, atol=1e-5), (case, k, (two[case][1][k] - g).abs().max())
        assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # gradients that could differ


@pytest.mark.slow
# ---------------------------------------------------------------------------------------------- AutoTP, launched
def test_autotp_two_ranks_train_as_one_and_save_whole_weights(tiny, tmp_path):
    """DeepSpeed AutoTP training runs on CPU over gloo (deepspeed 0.19.8: "tensor_parallel": {"autotp_size"}):
    an sft job on 2 ranks with ds_tensor_parallel_size 2 (data-parallel size 1; each rank holds half of each
    linear layer) gives the 1-rank job's loss at every step (atol 1e-4) and saves whole weights (the shapes of
    the input model, gathered from the ranks' slices), equal to the 1-rank job's (atol 1e-4)."""
    from safetensors.torch import load_file

    from stages import sft

    common = dict(policy_uri=tiny.policy_uri, dataset_uri=sft_data(tmp_path, 8), input_template=demo_task.INPUT_TEMPLATE,
                  learning_rate=1e-3, train_batch_size=4, micro_train_batch_size=2, max_len=48, lr_warmup_ratio=0.0,
                  zero_stage=0)
    sft.run(sft.Config(output_uri=str(tmp_path / "one"), **common))
    sft.run(sft.Config(output_uri=str(tmp_path / "tp"), num_gpus=2, ds_tensor_parallel_size=2, **common))
    h1, h2 = (json.loads((tmp_path / d / "training_log.json").read_text()) for d in ("one", "tp"))
    assert len(h1) == 2 and [h["samples"] for h in h1] == [h["samples"] for h in h2]
    assert [h["loss"] for h in h2] == pytest.approx([h["loss"] for h in h1], abs=1e-4)
    w1, w2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "tp"))
    before = load_file(str(tiny.policy_dir / "model.safetensors"))
    assert {k: v.shape for k, v in w2.items()} == {k: v.shape for k, v in before.items()}
    for k in w1:
        assert torch.allclose(w2[k], w1[k], atol=1e-4), k


# ---------------------------------------------------------------------------------------------- MoE auxiliary loss
def test_moe_aux_loss_is_added_and_reaches_the_router(zoo, tiny):
    """aux_loss_coef 0.5 on the zoo's Mixtral (4 experts, top 2), padded sft batch (rows of 9, 14, 6 tokens):
    the step's loss = sft loss + 0.5 x transformers' aux_loss of the same batch (MixtralForCausalLM's
    load_balancing_loss_func over the real tokens; atol 1e-6), the metric aux_loss is that value, and the
    router's gradient changes by exactly 0.5 x d(aux)/d(router) (atol 1e-6): the router logits reach the loss
    although entry.target_logits runs the backbone and the LM head apart. On a dense model (Llama) a coef > 0 is
    refused by name; coef 0 (the default) wraps nothing: the method's loss alone, on any model."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.train import moe
    from rlhf_core.train.methods import sft

    model = AutoModelForCausalLM.from_pretrained(str(zoo["mixtral"].policy), dtype=torch.float32)
    seqs = [[5 + (i * 7 + j * 3) % 300 for j in range(n)] for i, n in enumerate([9, 14, 6])]
    recs = [{"ids": s, "start": 3} for s in seqs]
    spec = {"packing_samples": False}
    router = model.model.layers[0].mlp.gate.weight

    base, _, _ = sft.step(model, spec, recs, 0)
    base.backward()
    g_base = router.grad.clone()
    model.zero_grad()
    with_aux = moe.with_aux_loss(sft, model, 0.5)
    loss, met, _ = with_aux.step(model, spec, recs, 0)
    loss.backward()
    g_aux = router.grad.clone()
    model.zero_grad()

    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    hf_aux = model(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss  # transformers' own value
    assert loss.item() == pytest.approx(base.item() + 0.5 * hf_aux.item(), abs=1e-6)
    assert met["aux_loss"].shape == (3,) and met["aux_loss"][0].item() == pytest.approx(hf_aux.item(), abs=1e-6)
    hf_aux.backward()
    assert (g_aux - g_base).abs().max() > 1e-4
    assert torch.allclose(g_aux - g_base, 0.5 * router.grad, atol=1e-6)

    dense = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir))
    with pytest.raises(SystemExit, match="aux_loss_coef 0.5 > 0 needs a mixture-of-experts model; llama"):
        moe.with_aux_loss(sft, dense, 0.5)


# ---------------------------------------------------------------------------------------------- bad input
def test_scale_settings_refused_before_work(tiny, tmp_path):
    """Each refusal names the setting: ring without packing, a ring or TP size not dividing the world, ring with
    TP, TP under ZeRO-3, ring on a method that reads last hidden states (in the job, before the model loads),
    Liger on a host without CUDA (the stage, before any work: nothing committed)."""
    from pydantic import ValidationError

    from rlhf_core.train import ring
    from stages import sft

    uri = sft_data(tmp_path, 8)
    base = dict(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=str(tmp_path / "o"), train_batch_size=4,
                micro_train_batch_size=1, input_template=demo_task.INPUT_TEMPLATE, max_len=48)
    for bad, msg in [(dict(num_gpus=2, ring_attn_size=2), "ring_attn_size > 1 splits a packed row over ranks: set packing_samples=true"),
                     (dict(num_gpus=4, ring_attn_size=3, packing_samples=True), "ring_attn_size 3 does not divide the world size 4"),
                     (dict(num_gpus=2, ds_tensor_parallel_size=3), "ds_tensor_parallel_size 3 does not divide the world size 2"),
                     (dict(num_gpus=4, ring_attn_size=2, ds_tensor_parallel_size=2, packing_samples=True),
                      "ring_attn_size and ds_tensor_parallel_size together are not supported"),
                     (dict(num_gpus=2, ds_tensor_parallel_size=2, zero_stage=3), "ds_tensor_parallel_size > 1 is supported with zero_stage 0-2"),
                     (dict(num_gpus=2, ring_attn_size=2, packing_samples=True, aux_loss_coef=0.1),
                      "aux_loss_coef with ring_attn_size > 1 is not supported")]:
        with pytest.raises(ValidationError, match=msg):
            sft.Config(**base, **bad)
    with pytest.raises(SystemExit, match="ring_attn_size > 1 supports the methods sft, dpo, kto; 'rm'"):
        ring.setup(0, 2, 2, 1, "rm")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_liger_kernel needs a CUDA GPU"):
            sft.run(sft.Config(**base, use_liger_kernel=True))
        assert not store.committed_any(str(tmp_path / "o"))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_liger_kernel_patches_the_model_and_keeps_its_logits(tiny):
    """On CUDA (liger-kernel from the gpu extra): load_model with use_liger_kernel swaps in Liger's modules
    (RMSNorm) and the logits stay those of the unpatched model (atol 1e-3 in fp32: Triton's reductions differ)."""
    from rlhf_core.train import entry
    from rlhf_core.train.methods import sft

    spec = {"model_dir": str(tiny.policy_dir), "bf16": False, "zero_stage": 2, "gradient_checkpointing": False,
            "lora_rank": 0, "attn_implementation": "sdpa"}
    plain = entry.load_model(spec, True, sft).cuda()
    liger = entry.load_model({**spec, "use_liger_kernel": True}, True, sft).cuda()
    assert any("Liger" in type(m).__name__ for m in liger.modules())
    assert not any("Liger" in type(m).__name__ for m in plain.modules())
    ids = torch.randint(5, 300, (2, 24), device="cuda")
    with torch.no_grad():
        assert torch.allclose(liger(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-3)
