"""ZeRO-3 prefetches in every forward of the trainers and of the ppo roles (issue 35 item 6).

DeepSpeed records which layers a step fetches between two resets of its parameter coordinator, and replays that
trace to prefetch each layer's gather ahead of its use; only the top module's forward pre-hook resets it. A
forward that calls the backbone and the head apart never does, and the trace stays INVALID for ever (checked
on the code before this test: INVALID after 3 steps). Each forward here runs three ZeRO-3 training steps
(DeepSpeed on CPU, gloo, one rank) and asserts the trace is COMPLETE after step 2; step 1's outputs and every
full gradient equal those of the same model without DeepSpeed (fp32, atol 1e-5): routing through the top module
changes nothing in the values.
"""
from __future__ import annotations

import os

import pytest
import torch

from rlhf_core.demo import demo_task
from rlhf_core.inputs import models
from rlhf_core.train import batches

TOL = 1e-5


@pytest.fixture(scope="module")
def dist_env():
    """A one-rank gloo group (DeepSpeed keeps it; later engines in this process reuse it); env restored."""
    import deepspeed

    from rlhf_core.runtime.jobs import free_port

    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.ops.__dict__["__compatible_ops__"] = {}
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    os.environ.clear()
    os.environ.update(saved)


def _coordinator(engine):
    return engine.optimizer.parameter_offload.get_param_coordinator()


def _zero3(model_dir, kind: str):
    """(ZeRO-3 engine, the same model without DeepSpeed), fp32, loaded as the trainers load them."""
    import deepspeed

    from rlhf_core.train import adamw, entry
    from rlhf_core.train.methods import get

    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 9}
    spec = {"model_dir": str(model_dir), "bf16": False, "zero_stage": 3, "gradient_checkpointing": False, "lora_rank": 0}
    method = get("rm" if kind == "reward" else "sft")
    model = entry.load_model(spec, False, method, ds)
    engine = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(), 1e-3, (0.9, 0.95), 0.0), config=ds)[0]
    plain = entry.load_model({**spec, "zero_stage": 0}, False, method)
    return engine, plain


def _records(model_dir):
    tok = models.load_tokenizer(model_dir)
    recs, _ = batches.tokenize_pairs(demo_task.preference_rows(3, seed=5), tok, 48, model_dir=model_dir)
    seqs = [r["chosen_ids"] for r in recs] + [r["rejected_ids"] for r in recs]
    starts = [r["chosen_start"] for r in recs] + [r["rejected_start"] for r in recs]
    return seqs, starts, models.pad_id(tok, model_dir)


def _ppo_batch(seqs, starts, pad) -> dict:
    from rlhf_core.ppo.batches import collate

    return collate([s[:st] for s, st in zip(seqs, starts)], [s[st:] for s, st in zip(seqs, starts)], pad)


def _cases(seqs, starts, pad):
    """forward name -> (model kind, fn(model) -> outputs): each forward path of the trainers and the ppo roles."""
    from rlhf_core.ppo.forward import token_outputs
    from rlhf_core.train.entry import batch_of, forward, target_logits
    from rlhf_core.train.methods import prm, rm

    spec = {"packing_samples": False}
    ppo = _ppo_batch(seqs, starts, pad)
    ph = max(set(t for s in seqs for t in s[1:]), key=lambda t: sum(s.count(t) for s in seqs))  # a frequent token
    return {
        "sft/dpo/kto: entry.forward (pairs)": ("policy", lambda m: forward(m, spec, seqs, starts, pad, pairs=True)[0]),
        "sft packed: entry.forward": ("policy", lambda m: forward(m, {"packing_samples": True}, seqs, starts, pad)[0]),
        "kd: entry.target_logits": ("policy", lambda m: target_logits(m, batch_of(spec, seqs, starts, pad))[:, :7]),
        "rm: rm.rewards": ("reward", lambda m: rm.rewards(m, spec, seqs, starts, pad)[0]),
        "prm: prm.reward_logits": ("policy", lambda m: prm.reward_logits(m, seqs, pad, ph, [5, 6])[0]),
        "ppo policy: token_outputs": ("policy", lambda m: torch.cat(token_outputs(
            getattr(m, "module", m), ppo, "policy", 0.7, "loss")[:2])),
        "ppo policy packed: token_outputs": ("policy", lambda m: torch.cat(token_outputs(
            getattr(m, "module", m), ppo, "policy", 0.7, "loss", packing=True)[:2])),
        "ppo critic: token_outputs": ("reward", lambda m: token_outputs(getattr(m, "module", m), ppo, "critic")[0]),
    }


@pytest.mark.parametrize("case", list(_cases([[1, 2, 3]], [1], 0)))
def test_every_zero3_forward_completes_the_prefetch_trace_and_keeps_values_and_gradients(tiny, dist_env, case):
    import deepspeed

    seqs, starts, pad = _records(tiny.policy_dir)
    kind, fn = _cases(seqs, starts, pad)[case]
    engine, plain = _zero3(tiny.policy_dir if kind == "policy" else tiny.reward_dir, kind)
    engine.train()
    want = fn(plain)
    w = torch.linspace(-1.0, 1.5, want.numel())  # every output enters the gradient with its own weight
    (want.flatten() * w).sum().backward()
    coord, states = _coordinator(engine), []
    for step in range(3):
        got = fn(engine)
        engine.backward((got.flatten() * w).sum())
        if step == 0:
            assert torch.allclose(got.detach(), want.detach(), atol=TOL), (got - want).abs().max()
            n = 0
            for (name, p), q in zip(engine.module.named_parameters(), plain.parameters()):
                g = deepspeed.utils.safe_get_full_grad(p)
                if q.grad is not None:
                    assert g is not None and torch.allclose(g, q.grad, atol=TOL), (name, (g - q.grad).abs().max())
                    n += 1
            assert n > 4
        engine.step()
        states.append("complete" if coord.is_complete_trace() else "record" if coord.is_record_trace() else "invalid")
    assert states[1:] == ["complete", "complete"], states


def test_the_ppo_learner_trains_with_a_complete_trace(tiny, dist_env):
    """The policy Learner under ZeRO-3 (experience forward without grad, then training micro-batches): the trace
    is COMPLETE once the first step's training pass has been recorded, and stays so in the next step."""
    from rlhf_core.ppo import loop
    from rlhf_core.ppo.roles import Learner
    from rlhf_core.runtime.jobs import free_port
    from stages import ppo

    cfg = ppo.Config(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", rollout_batch_size=2,
                     n_samples_per_prompt=3, advantage_estimator="group_norm", train_batch_size=6,
                     micro_train_batch_size=2, zero_stage=3)
    learner = Learner("policy", 0, 1)
    learner.setup(str(tiny.policy_dir), loop.learner_settings(cfg), "127.0.0.1", free_port(), total_steps=4)
    seqs, starts, pad = _records(tiny.policy_dir)
    batch = _ppo_batch(seqs, starts, pad)
    T = batch["mask"].shape
    batch.update(adv=torch.linspace(-1, 1, T[0] * T[1]).view(T))
    coord = _coordinator(learner.engine)
    for _ in range(2):
        batch["old_logp"] = learner.forward(batch)
        learner.train(batch, 0.0)
    assert coord.is_complete_trace()
