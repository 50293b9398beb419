"""The ppo Learner's step as a GPU runs it, checked on the CPU (issue 36 item 2): the host synchronisations a step
would make on a GPU (benchmarks/parts/learner_step.py's HostSyncAudit: a device value read on the host) do not
grow with the micro-batches, and the step still computes what a bare torch loop computes."""
from __future__ import annotations

import pytest
import torch

from benchmarks.parts.learner_step import audit
from rlhf_core.rl import rl_math
from rlhf_core.ppo.forward import policy_logprobs
from tests.rlhf_core.ppo.test_ppo_roles import experience, learner_env, make_learner, settings  # noqa: F401


def grpo_batch(groups: int = 4, n: int = 4) -> dict:
    """`groups` prompts x `n` responses of different lengths (shared_prompt's groups), CPU tensors as Ray sends."""
    from rlhf_core.ppo import batches, loop

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (6 + k,), generator=g).tolist() for k in range(groups)]
    resp = [torch.randint(3, 300, (3 + (i % 5),), generator=g).tolist() for i in range(groups * n)]
    b = batches.collate([prompts[i // n] for i in range(groups * n)], resp, pad_id=0, logprobs=[[-1.0] * len(r) for r in resp])
    b["adv"] = torch.randn(b["mask"].shape, generator=g)
    return b


def rlhf_syncs(report: dict) -> dict:
    return {k: v for k, v in report["host_syncs_by_source"].items() if k.startswith("rlhf_core")}


def others(report: dict) -> dict:
    """Host reads outside rlhf_core and transformers' padding check (sdpa's `padding_mask.all()` in each padded
    forward, which the roles cannot skip: transformers decides there whether the mask is needed)."""
    return {k: v for k, v in report["host_syncs_by_source"].items()
            if not k.startswith(("rlhf_core", "transformers/masking_utils.py:_ignore_causal_mask_sdpa"))}


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("layout", [{}, {"shared_prompt": True}, {"packing_samples": True}])
def test_a_step_reads_the_device_once_whatever_its_micro_batches(tiny, learner_env, zero_stage, layout):
    """bf16 DeepSpeed (ZeRO-2 / ZeRO-3, as on a GPU), 16 rows in 8 or 2 micro-batches: the learner's own code reads
    the device once per train call (its metrics, kept on the device until then), the layout of shared prompts and
    packing is worked out from the CPU batch, and DeepSpeed reads it once more (its grad-norm check) now that its
    per-gradient overflow scan is off. Before issue 36 the same step read the device about 5 times per row."""
    batch = grpo_batch()
    for micro in (2, 8):
        hp = settings(bf16=True, zero_stage=zero_stage, n_samples_per_prompt=4, rollout_batch_size=4,
                      train_batch_size=16, micro_train_batch_size=micro, **{"shared_prompt": False, **layout})
        learner = make_learner("policy", tiny.policy_dir, hp)
        report = audit(lambda: learner.train(batch, 0.0), batch)
        assert learner.engine.global_steps == 1
        assert rlhf_syncs(report) == {"rlhf_core/ppo/roles.py:train (cpu)": 1}, report["host_syncs_by_source"]
        if zero_stage == 2:  # (ZeRO-3 also checks its first step's parameter trace against rank 0's on the host)
            assert others(report) == {"deepspeed/runtime/utils.py:is_invalid_grad_norm (_local_scalar_dense)": 1}
            assert report["host_syncs"] - 1 - 1 <= 2 * (16 // micro)  # transformers' padding check: 2 per forward
        fwd = audit(lambda: learner.forward(batch), batch)  # experience: one result copy per micro-batch
        assert rlhf_syncs(fwd) == {"rlhf_core/runtime/devices.py:to_host (cpu)": 16 // micro}, fwd["host_syncs_by_source"]
        assert zero_stage == 3 or others(fwd) == {}


def test_zero2_bf16_skips_deepspeeds_overflow_scan_and_steps_as_with_it(tiny, learner_env):
    """check_grad_overflow off (DeepSpeed 0.19.8 turns it on for bf16: a scan of every gradient and a host read per
    step, then a skipped step on inf / NaN, which neither torch's clip_grad_norm_ nor the bare loop does): on finite
    gradients the step leaves the same weights as with the scan."""
    batch = grpo_batch()
    hp = settings(bf16=True, zero_stage=2, n_samples_per_prompt=4, rollout_batch_size=4, train_batch_size=16,
                  micro_train_batch_size=8, actor_learning_rate=1e-3)
    ours = make_learner("policy", tiny.policy_dir, hp)
    assert ours.engine.optimizer.check_grad_overflow is False
    scanned = make_learner("policy", tiny.policy_dir, hp)
    scanned.engine.optimizer.check_grad_overflow = True
    a, b = ours.train(batch, 0.0), scanned.train(batch, 0.0)
    same = [k for k in a if not k.endswith(("_tokens_per_s", "_peak_mem_gb"))]
    assert len(same) > 4 and all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9) for k in same)
    sa, sb = ours._full_state_dict(), scanned._full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    start = make_learner("policy", tiny.policy_dir, hp)._full_state_dict()
    assert any(not torch.equal(sa[k], start[k]) for k in sa)


def test_the_learner_step_is_the_bare_loops_step(tiny, learner_env):
    """fp32, one rank: Learner.train over 2 micro-batches leaves the weights a bare torch loop leaves (AdamW with the
    same settings, the loss of each micro-batch halved, clip_grad_norm_ 1.0), and its metrics are the means of the
    micro-batches' metrics."""
    from transformers import AutoModelForCausalLM

    batch = experience(tiny.policy_dir, B=4)
    del batch["old_logp"]  # one update per rollout: the learner's own forward is the old policy
    hp = settings(actor_learning_rate=1e-3, max_norm=1.0, shared_prompt=False)
    learner = make_learner("policy", tiny.policy_dir, hp)
    g = torch.Generator().manual_seed(hp["seed"])  # the learner's row order (seed + optimizer step 0)
    order = torch.randperm(4, generator=g)
    metrics = learner.train(batch, 0.0)

    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=tuple(hp["adam_betas"]), weight_decay=hp["l2"])
    model.train()
    losses = []
    for s in (0, 2):
        mb = {k: v[order[s:s + 2]] for k, v in batch.items()}
        lp = policy_logprobs(model, mb, hp["temperature"])[0]
        loss, _ = rl_math.policy_loss(lp, lp.detach(), mb["adv"], mb["mask"], hp["eps_clip_low"], hp["eps_clip_high"])
        (loss / 2).backward()
        losses.append(float(loss))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ours, bare = learner._full_state_dict(), model.state_dict()
    assert max(float((ours[k] - bare[k]).abs().max()) for k in ours) < 1e-6
    assert metrics["policy_loss"] == pytest.approx(sum(losses) / 2, abs=1e-6)
