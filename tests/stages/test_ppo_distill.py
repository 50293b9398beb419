"""On-policy distillation in the ppo stage (issue 45 item 2): teacher_uri's log-probs of the student's own samples,
teacher_coef x (log pi_T(y_t) - log pi(y_t)) per token, are its advantage (advantage_estimator distill: alone, no
reward source; another estimator: mixed with the reward's). The math against the objective TRL's DistillationTrainer
minimises (beta 1: the exact reverse KL over the vocabulary, per completion token), a teacher with another tokenizer
refused naming it, and a CPU run where the student's per-token KL to the teacher on held-out prompts falls."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from rlhf_core import store
from rlhf_core.demo import demo_task
from rlhf_core.inputs import data
from rlhf_core.rl import rl_math
from stages import ppo, sft
from stages.common import ConfigError


def test_distill_advantages_hand_values():
    """Student [-1.0, -2.0]; teachers [-0.5, -2.5] and [-1.5, -1.5]: mean [-1.0, -2.0] -> advantage [0, 0]; the
    first alone: [0.5, -0.5], x coef 2 -> [1, -1]; a padded column (mask 0) stays 0."""
    s = torch.tensor([[-1.0, -2.0, -3.0]])
    t1, t2, mask = torch.tensor([[-0.5, -2.5, 0.0]]), torch.tensor([[-1.5, -1.5, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.equal(rl_math.distill_advantages(s, [t1, t2], mask), torch.tensor([[0.0, 0.0, 0.0]]))
    assert torch.equal(rl_math.distill_advantages(s, [t1], mask, 2.0), torch.tensor([[1.0, -1.0, 0.0]]))
    adv, ret = rl_math.advantages_and_returns("distill", torch.tensor([3.0, -1.0]), torch.ones(2, 2), 2,
                                              torch.zeros(2, 2), 0.0)
    assert not adv.any() and not ret.any()  # no score enters the distill estimator's advantage


def test_the_expected_policy_gradient_is_the_gradient_of_trls_reverse_kl():
    """At 3 positions over a vocabulary of 6: TRL's DistillationTrainer with beta 1 minimises the mean over completion
    tokens of KL(student || teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v)) (trl/trainer/distillation_trainer.py,
    _chunked_divergence_loss). The policy gradient with the distill advantage A(v) = log p_t(v) - log p_s(v)
    (detached), in expectation over the student's tokens -sum_v p_s(v) A(v) grad log p_s(v), equals that loss's
    gradient; the mean of -A over 200,000 sampled tokens is the KL itself (within 1%)."""
    g = torch.Generator().manual_seed(0)
    student_logits = torch.randn(3, 6, generator=g, requires_grad=True)
    teacher_logp = torch.log_softmax(torch.randn(3, 6, generator=g) * 2, -1)
    student_logp = torch.log_softmax(student_logits, -1)
    kl = F.kl_div(teacher_logp, student_logp, log_target=True, reduction="none").sum(-1)  # (3,) KL(p_s || p_t)
    (kl_grad,) = torch.autograd.grad(kl.mean(), student_logits, retain_graph=True)
    adv = rl_math.distill_advantages(student_logp.detach(), [teacher_logp], torch.ones(3, 6))  # every v as a "sample"
    surrogate = -(student_logp.exp().detach() * adv * student_logp).sum(-1).mean()  # the PG loss, exact expectation
    (pg_grad,) = torch.autograd.grad(surrogate, student_logits)
    assert torch.allclose(pg_grad, kl_grad, atol=1e-6)
    ys = torch.multinomial(student_logp.exp().detach(), 200_000, replacement=True, generator=g)  # (3, S)
    est = -rl_math.distill_advantages(student_logp.detach().gather(1, ys), [teacher_logp.gather(1, ys)],
                                      torch.ones_like(ys, dtype=torch.float32))
    assert torch.allclose(est.mean(-1), kl.detach(), rtol=0.01)


def test_settings_and_a_teacher_with_another_tokenizer_are_refused(tiny, zoo, tmp_path):
    base = dict(policy_uri=tiny.policy_uri, prompts_uri="q", output_uri=str(tmp_path / "o"), n_samples_per_prompt=2,
                advantage_estimator="group_norm")
    with pytest.raises(ValueError, match="advantage_estimator distill \\(on-policy distillation\\) needs teacher_uri"):
        ppo.Config(**{**base, "advantage_estimator": "distill"})
    with pytest.raises(ValueError, match="set exactly one reward source"):
        ppo.Config(**base, teacher_uri=tiny.policy_uri)  # mixing needs a reward; distill alone does not
    ppo.Config(**{**base, "advantage_estimator": "distill"}, teacher_uri=tiny.policy_uri)
    with pytest.raises(ValueError, match="the evaluation scores its samples with the run's reward source or agent"):
        ppo.Config(**{**base, "advantage_estimator": "distill"}, teacher_uri=tiny.policy_uri,
                   eval_prompts_uri="held.jsonl", eval_steps=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(8, 0)))
    cfg = ppo.Config(**{**base, "prompts_uri": str(prompts), "advantage_estimator": "distill"},
                     input_template=demo_task.INPUT_TEMPLATE, teacher_uri=f"{tiny.policy_uri},{zoo['qwen2'].policy}",
                     rollout_batch_size=4, train_batch_size=8, micro_train_batch_size=8)
    with pytest.raises(ConfigError, match=f"teacher {zoo['qwen2'].policy} uses a different tokenizer than policy"):
        ppo.run(cfg)
    assert not (tmp_path / "o").exists()


def reverse_kl_per_token(student_dir, teacher_dir, prompts: list[str]) -> float:
    """The student's own samples (8 per held-out prompt, fixed seed, 8 new tokens, temperature 1, through the hf rollout
    engine, which returns each sampled token's log-prob): mean over the sampled tokens of log p_student - log
    p_teacher (the teacher's by teacher forcing), a k1 estimate of KL(student || teacher) per token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.ppo.batches import collate
    from rlhf_core.ppo.engines import HFRollout

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    outs = HFRollout(str(student_dir)).generate(ids, 8, 8, 1.0, 1.0, 0, seed=11)
    rows = [(p, o) for p, per in zip(ids, outs) for o in per if o["ids"]]
    b = collate([p for p, _ in rows], [o["ids"] for _, o in rows], 0, logprobs=[o["logprobs"] for _, o in rows])
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir)).eval()
    with torch.no_grad():
        logits = teacher(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1].float()
    t_lp = torch.log_softmax(logits, -1).gather(-1, b["ids"][:, 1:, None]).squeeze(-1)  # (B, L - 1)
    return float(((b["rollout_logp"] - t_lp) * b["mask"]).sum() / b["mask"].sum())


@pytest.mark.slow
def test_the_students_per_token_kl_to_the_teacher_falls_on_held_out_prompts(tiny, tmp_path):
    """Teacher: the tiny policy after a short SFT on the demo's reviews; student: the untrained tiny policy; 4 steps
    of advantage_estimator distill (no reward source) over 16 prompts: the student's per-token reverse KL to the
    teacher on 12 held-out prompts falls, the log has it per step (distill_kl) and the rewards are 0."""
    rows = store.ArtifactWriter(str(tmp_path / "sft-data"), "data", {"n": 256})
    rows.begin()
    rows.write_table("rows.parquet", data.to_table(demo_task.sft_rows(256, 0), "sft"))
    rows.commit()
    sft.run(sft.Config(policy_uri=tiny.policy_uri, dataset_uri=str(tmp_path / "sft-data"), output_uri=str(tmp_path / "teacher"),
                       input_template=demo_task.INPUT_TEMPLATE, learning_rate=1e-3, max_epochs=2, max_len=48,
                       micro_train_batch_size=32, train_batch_size=32, lr_warmup_ratio=0.0))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(16, 0)))
    held = [demo_task.INPUT_TEMPLATE.format(r["input"]) for r in demo_task.prompts(12, 0, held_out=True)]
    before = reverse_kl_per_token(tiny.policy_dir, tmp_path / "teacher", held)
    m = ppo.run(ppo.Config(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(tmp_path / "out"),
                           input_template=demo_task.INPUT_TEMPLATE, advantage_estimator="distill",
                           teacher_uri=str(tmp_path / "teacher"), n_samples_per_prompt=4, rollout_batch_size=4,
                           train_batch_size=16, micro_train_batch_size=8, generate_max_len=8, init_kl_coef=0.0,
                           actor_learning_rate=5e-3, lr_warmup_ratio=0.0, rollout_backend="hf"))
    after = reverse_kl_per_token(tmp_path / "out", tmp_path / "teacher", held)
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert [h["reward"] for h in log] == [0.0] * 4 and all(math.isfinite(h["distill_kl"]) for h in log)
    assert after < 0.8 * before, (before, after, [h["distill_kl"] for h in log])
