"""The CUDA IPC weight hand-over between two processes on one GPU (layer (a): no Ray, no vLLM; the path the
ppo stage takes with colocate_all_models on CUDA, rlhf_core.ppo.weight_sync.ipc_handles -> the engine's
receive_ipc). Skipped without CUDA (tests/conftest.py); run by benchmarks/gpu/gpu_smoke.sh on the lent machine.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _source(model_dir: str, handles, acks) -> None:
    """A policy rank's end: the model on the GPU, one update, then each bucket's IPC handle; the final
    weights go back as CPU tensors for the comparison."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.ppo import weight_sync

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # new weights the engine does not have
    learner = SimpleNamespace(engine=SimpleNamespace(module=model), hp={"zero_stage": 0}, rank=0)
    handles.put(weight_sync.layout(learner, 64 * 1024))  # small buckets: several hand-overs
    for i, handle, _ in weight_sync.ipc_handles(learner):
        handles.put((i, handle))
        acks.get()  # the engine copied it: the buffer may go
    handles.put(None)
    handles.put({k: v.detach().cpu() for k, v in model.named_parameters()})
    acks.get()  # CPU tensors cross a Queue as shared-memory fds: this process must live until they are received


def test_cuda_ipc_hand_over_between_two_processes(zoo):
    import multiprocessing as mp

    from rlhf_core.ppo.engines import HFRollout

    ctx = mp.get_context("spawn")
    handles, acks = ctx.Queue(), ctx.Queue()
    src = ctx.Process(target=_source, args=(str(zoo["qwen2"].policy), handles, acks))
    src.start()
    try:
        engine = HFRollout(str(zoo["qwen2"].policy), bf16=True)  # on this process's GPU, as a colocated engine
        before = engine.weights()
        engine.join_weights(None, None, 0, 0, handles.get(timeout=120))
        n = 0
        while (msg := handles.get(timeout=120)) is not None:
            engine.receive_ipc(*msg)
            acks.put(True)
            n += 1
        assert engine.receive_ipc(None) == 1
        expected, got = handles.get(timeout=120), engine.weights()
        acks.put(True)
        src.join(timeout=60)
        assert n > 1 and src.exitcode == 0
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
        assert not torch.equal(before["model.embed_tokens.weight"], got["model.embed_tokens.weight"])
    finally:
        if src.is_alive():
            src.kill()
