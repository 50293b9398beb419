"""The ppo roles called in-process (no Ray): every tensor reaches its model's device, and every log-prob is of
the tempered policy.

Device discipline without a GPU: each role's model is moved to the `meta` device after it is built, and a
forward pre-hook on every module asserts that each tensor input sits on that module's device. An embedding
lookup of CPU ids into a meta weight does not raise by itself (../shared/ENV-NOTES.md), so the hooks are what
catch a batch left on the CPU (the roles before this test passed Ray's CPU tensors straight to the model).
The same roles run on CUDA in tests/test_gpu.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from rlhf_core.rl import losses
from rlhf_core.ppo import batches, loop
from rlhf_core.ppo.engines import HFRollout
from rlhf_core.ppo.forward import policy_logprobs
from rlhf_core.ppo.roles import Learner, Reference
from rlhf_core.runtime.devices import to_device
from rlhf_core.rollout.rewards import RewardSpec
from rlhf_core.rollout.reward_model import RMEngine
from stages import ppo

META = torch.device("meta")


class StopForward(Exception):
    """Raised by a guard once the first forward's inputs were checked (for code that needs values after it)."""


def on_meta(model: torch.nn.Module) -> torch.nn.Module:
    """The model moved to `meta`, with eager attention (sdpa's mask shortcut reads a value, which meta lacks)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    return model.to(META)


def device_guard(model: torch.nn.Module, stop_after_first: bool = False) -> list:
    """Forward pre-hooks on every module that owns parameters: each tensor input must be on that module's
    device. Returns the list of checked module names (grows as forwards run)."""
    seen: list[str] = []

    def hook(name):
        def check(mod, args, kwargs):
            dev = next(mod.parameters()).device
            for t in [*args, *kwargs.values()]:
                if torch.is_tensor(t):
                    assert t.device == dev, f"{name}: input on {t.device}, module on {dev}"
            seen.append(name)
            if stop_after_first and name == "":
                raise StopForward
        return check

    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)) or name == "":
            mod.register_forward_pre_hook(hook(name), with_kwargs=True)
    return seen


def settings(**over) -> dict:
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", rollout_batch_size=2,
                n_samples_per_prompt=2, advantage_estimator="group_norm", train_batch_size=4,
                micro_train_batch_size=2, zero_stage=0, lr_warmup_ratio=0.0)  # a warm-up's first step runs at lr 0
    cfg = ppo.Config(**{**base, **over})
    return loop.learner_settings(cfg)


def experience(policy_dir, B: int = 4, P: int = 5, R: int = 6) -> dict:
    """A CPU batch as the driver sends it: B rows of a P-token prompt and an R-token response."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (P,), generator=g).tolist() for _ in range(B)]
    resp = [torch.randint(3, 300, (R - (i % 2),), generator=g).tolist() for i in range(B)]
    b = batches.collate(prompts, resp, pad_id=0, logprobs=[[-1.0] * len(r) for r in resp])
    T = b["mask"].shape
    b.update(old_logp=torch.full(T, -1.0), adv=torch.randn(T, generator=g), ref_logp=torch.full(T, -1.1),
             old_values=torch.zeros(T), returns=torch.ones(T))
    return b


@pytest.fixture
def learner_env():
    """Learner.setup sets the torch.distributed variables (restored afterwards) and makes a 1-rank gloo group
    (kept: DeepSpeed caches it, later learners in this process reuse it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def make_learner(kind: str, model_dir, hp) -> Learner:
    from rlhf_core.runtime.jobs import free_port

    learner = Learner(kind, 0, 1)
    learner.setup(str(model_dir), hp, "127.0.0.1", free_port(), total_steps=4)
    return learner


@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_learner_moves_every_input_to_its_models_device(tiny, learner_env, kind):
    hp = settings(advantage_estimator="gae", reward_model_uri="rm", reward_func_path=None, n_samples_per_prompt=1,
                  rollout_batch_size=4, use_kl_loss=True, temperature=0.7)
    learner = make_learner(kind, tiny.policy_dir if kind == "policy" else tiny.reward_dir, hp)
    batch = experience(tiny.policy_dir)
    on_meta(learner.module)
    learner.device = META
    seen = device_guard(learner.module)
    out = learner.forward(batch)  # experience: old log-probs / values
    assert out.shape == batch["mask"].shape and out.device.type == "cpu"
    loss, met = learner.loss({k: v[:2] for k, v in batch.items()}, kl_loss_coef=0.1)  # a training micro-batch
    assert loss.device == META and loss.dim() == 0
    # the policy's LM head runs as rlhf_core.rl.logprobs' fused function on its weight (no module call; a CPU
    # tensor against the meta weight would raise there): the last module before it is the final norm
    head = "model.norm" if kind == "policy" else "score"
    assert "model.embed_tokens" in seen and head in seen and len(seen) > 6  # the whole model ran under the guard


def test_kl_loss_is_the_token_mean_as_openrlhf_unless_kl_loss_agg_says_otherwise(tiny, learner_env):
    """issue 37: dr_grpo with use_kl_loss: the policy loss takes loss_agg (token by default, as OpenRLHF's dr_grpo),
    the KL term the token mean of the k3 estimate whatever loss_agg is (OpenRLHF's masked_mean(kl, action_mask));
    kl_loss_agg None makes it follow loss_agg (seq-sum-norm: sum / generate_max_len per row, the row mean)."""
    from rlhf_core.rl import rl_math

    batch = experience(tiny.policy_dir)  # 4 rows, responses of 6 and 5 tokens
    over = dict(advantage_estimator="dr_grpo", use_kl_loss=True, kl_estimator="k3", generate_max_len=16)
    learner = make_learner("policy", tiny.policy_dir, settings(**over, loss_agg="seq-sum-norm"))
    lp, mask = learner.forward(batch), batch["mask"]
    token = rl_math.kl_loss(lp, batch["ref_logp"], mask, "k3")
    ssn = rl_math.kl_loss(lp, batch["ref_logp"], mask, "k3", "seq-sum-norm", max_len=16)
    assert abs(float(token) - float(ssn)) > 1e-3  # the two reductions differ on this batch
    assert float(learner.loss(batch, 0.1)[1]["kl_loss"]) == pytest.approx(float(token), rel=1e-5)
    assert settings(**over)["loss_agg"] == "token" and settings(**over)["kl_loss_agg"] == "token"
    learner.hp = settings(**over, loss_agg="seq-sum-norm", kl_loss_agg=None)
    assert float(learner.loss(batch, 0.1)[1]["kl_loss"]) == pytest.approx(float(ssn), rel=1e-5)


@pytest.mark.parametrize("name, lrs", [("linear", [0.5, 1.0, 0.5]), ("constant", [1.0, 1.0, 1.0]),
                                       ("cosine_with_min_lr", [0.5, 1.0, 0.55]),
                                       ("cosine_warmup_with_min_lr", [1.0, 0.55, 0.1])])
def test_lr_scheduler_is_transformers_schedule_of_that_name(tiny, learner_env, tmp_path, name, lrs):
    """issue 37: ppo's lr_scheduler is OpenRLHF's --lr_scheduler (transformers' get_scheduler) over the run's optimizer
    steps: 4 steps, lr_warmup_ratio 0.5 -> 2 warm-up steps from lr 0. Factors of steps 1..3 (after each update):
    linear 0.5, 1, then (1 - (3 - 2) / 2) = 0.5; constant 1 (no warm-up); cosine_with_min_lr 0.5, 1, then
    0.1 + 0.9 x (1 + cos(pi / 2)) / 2 = 0.55; cosine_warmup_with_min_lr warms up from 1/2 (steps 0..3: 0.5, 1, 0.55,
    0.1). The first update runs at lr 0 under a warm-up (not the last one's): the weights stay.
    tokenizer_chat_template is saved with the model (node_store.save_model), as the trainers'."""
    hp = settings(lr_scheduler=name, lr_warmup_ratio=0.5, actor_learning_rate=1e-3,
                  tokenizer_chat_template="{{ 'T:' }}{{ messages[0]['content'] }}")
    learner = make_learner("policy", tiny.policy_dir, hp)
    before = learner._full_state_dict()
    got = [learner.train(experience(tiny.policy_dir), 0.0)["policy_lr"] / 1e-3 for _ in range(3)]
    assert got == pytest.approx(lrs)
    if name in ("linear", "cosine_with_min_lr"):  # step 1 at lr 0 (AdamW with weight decay 0 moves nothing)
        learner2 = make_learner("policy", tiny.policy_dir, hp)
        learner2.train(experience(tiny.policy_dir), 0.0)
        assert all(torch.equal(before[k], v) for k, v in learner2._full_state_dict().items())
    learner.save_model(str(tmp_path / "out"), "")
    learner.save_model(str(tmp_path / "out"), "", upload=True)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template == hp["tokenizer_chat_template"]


def test_overlap_comm_reaches_deepspeed_and_deepcompile_is_passed_as_openrlhf_writes_it(tiny, learner_env):
    """issue 37: OpenRLHF's --overlap_comm sets zero_optimization overlap_comm + contiguous_gradients (its
    get_train_ds_config), here for the learners and the trainers alike (rlhf_core.train.deepspeed_options): a ZeRO-2
    learner's DeepSpeed engine overlaps and trains a step; --deepcompile writes compile.deepcompile (CUDA only in
    DeepSpeed 0.19.8: the stage refuses it by name on CPU, test_bad_config_is_refused_by_name)."""
    from rlhf_core.train import deepspeed_options

    base = {"zero_optimization": {"stage": 2}}
    assert deepspeed_options({}, {"zero_optimization": {"stage": 2}}) == base  # unset: DeepSpeed's default
    assert deepspeed_options({"overlap_comm": True, "deepcompile": True}, {"zero_optimization": {"stage": 2}}) == {
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "compile": {"deepcompile": True}}
    learner = make_learner("policy", tiny.policy_dir, settings(zero_stage=2, overlap_comm=True))
    assert learner.engine.zero_overlap_comm() is True and learner.engine.zero_contiguous_gradients() is True
    before = learner._full_state_dict()
    learner.train(experience(tiny.policy_dir), 0.0)  # a step with the overlapped reduction
    assert any(not torch.equal(before[k], v) for k, v in learner._full_state_dict().items())
    plain = make_learner("policy", tiny.policy_dir, settings(zero_stage=2))
    assert plain.engine.zero_overlap_comm() is False  # DeepSpeed's own default for ZeRO-2


def test_reference_and_hf_rollout_move_their_inputs(tiny):
    hp = settings(temperature=0.7, bf16=False)
    ref = Reference(str(tiny.policy_dir), hp)
    on_meta(ref.model)
    ref.device = META
    seen = device_guard(ref.model)
    batch = experience(tiny.policy_dir)
    assert ref.forward(batch).shape == batch["mask"].shape and seen

    eng = HFRollout(str(tiny.policy_dir))
    on_meta(eng.model)
    eng.device = META
    device_guard(eng.model, stop_after_first=True)
    # n > 1: the prompts' shared prefill is the first forward (the guard checks its inputs, then stops it)
    with pytest.raises(StopForward):
        eng.generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=0)
    # generate's own path reads a value of its inputs' special-token check before the first forward: on meta inputs
    # that fails there (they reached the model's device); CPU inputs would pass it and hit the guard's AssertionError
    eng.share_prefill = False
    with pytest.raises(RuntimeError, match="meta tensors"):
        eng.generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=0)


def test_reward_model_moves_its_inputs(tiny):
    rm = RMEngine(str(tiny.reward_dir), RewardSpec(model=str(tiny.reward_dir), dtype="float32"))
    on_meta(rm.body)
    rm.head.to(META)
    rm.device = META
    device_guard(rm.body)
    device_guard(rm.head, stop_after_first=True)
    with pytest.raises(StopForward):
        rm.score([("a review:", "great"), ("another:", "bad")])


@pytest.mark.parametrize("T", [0.3, 0.6, 1.3])
def test_rollout_and_trainer_logprobs_are_the_tempered_policys(tiny, learner_env, T):
    """HF rollout engine and the policy learner at temperature T: the sampled tokens' log-probs agree (< 1e-3
    mean abs, fp32) and both equal log_softmax(logits / T) computed here by hand; the learner's logged
    entropy is the tempered policy's."""
    from transformers import AutoModelForCausalLM

    eng = HFRollout(str(tiny.policy_dir))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = eng.generate(prompts, n=3, max_new_tokens=8, temperature=T, top_p=1.0, top_k=0, seed=1)
    eps = [(p, o) for p, per in zip(prompts, outs) for o in per]
    batch = batches.collate([p for p, _ in eps], [o["ids"] for _, o in eps], eng.pad_id,
                         logprobs=[o["logprobs"] for _, o in eps])
    mask = batch["mask"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1].float() / T
    by_hand = torch.log_softmax(logits, -1).gather(-1, batch["ids"][:, 1:, None]).squeeze(-1) * mask
    hp = settings(temperature=T, n_samples_per_prompt=3, rollout_batch_size=2, train_batch_size=6,
                  micro_train_batch_size=6)
    learner = make_learner("policy", tiny.policy_dir, hp)
    trainer = learner.forward(batch)
    n = mask.sum()
    assert float(((batch["rollout_logp"] - trainer).abs() * mask).sum() / n) < 1e-3
    assert float(((trainer - by_hand).abs() * mask).sum() / n) < 1e-5
    untempered = torch.log_softmax(logits * T, -1).gather(-1, batch["ids"][:, 1:, None]).squeeze(-1) * mask
    assert float(((trainer - untempered).abs() * mask).sum() / n) > 1e-2  # T really changes them
    b = {**batch, "old_logp": trainer, "adv": torch.ones_like(mask)}
    _, met = learner.loss(b, 0.0)
    p = torch.softmax(logits, -1)
    entropy = losses.reduce_tokens(-(p * torch.log_softmax(logits, -1)).sum(-1), mask)
    assert abs(float(met["entropy"]) - float(entropy)) < 1e-4


def test_policy_logprobs_default_temperature_is_the_raw_policy(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir), dtype=torch.float32).eval()
    batch = to_device(experience(tiny.policy_dir), "cpu")
    with torch.no_grad():
        lp, ent = policy_logprobs(model, batch)
        full = losses.token_logprobs(model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits, batch["ids"])
    assert ent is None
    assert torch.allclose(lp, full * batch["mask"], atol=1e-5)


@pytest.mark.parametrize("who", ["ppo learner", "training stage"])
def test_zero3_loads_the_model_into_partitions(tiny, learner_env, who):
    """Under ZeRO-3 the model is built inside zero.Init: every parameter is partitioned as from_pretrained
    creates it (an empty placeholder plus this rank's ds_tensor), never a full tensor first; afterwards the
    switch is off again (a second model, e.g. a frozen teacher, loads whole)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from rlhf_core.runtime.jobs import free_port
    from rlhf_core.train import entry
    from rlhf_core.train.methods import get as get_method

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.ops.__dict__["__compatible_ops__"] = {}
    deepspeed.init_distributed(dist_backend="gloo")
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    if who == "ppo learner":
        model = Learner("policy", 0, 1).load_model(str(tiny.policy_dir), settings(zero_stage=3), ds)
    else:
        spec = {"model_dir": str(tiny.policy_dir), "bf16": False, "zero_stage": 3, "gradient_checkpointing": False,
                "lora_rank": 0}
        model = entry.load_model(spec, False, get_method("sft"), ds)
    params = list(model.parameters())
    assert params and all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
    assert sum(p.ds_numel for p in params) == sum(p.ds_tensor.numel() for p in params) > 0  # world 1: one shard
    whole = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir))
    assert not any(hasattr(p, "ds_id") for p in whole.parameters()) and whole.num_parameters() > 0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_travel_as_numpy_and_load_bit_exact(tiny, dtype):
    """The weight sync's wire format (numpy arrays: zero-copy out of Ray's object store; bf16 as int16) goes
    through Ray's own serializer and loads into an HF rollout engine bit for bit."""
    import pickle

    import numpy as np
    from ray import cloudpickle

    from rlhf_core.ppo.weight_sync import from_wire, to_wire

    src = HFRollout(str(tiny.policy_dir), bf16=dtype == torch.bfloat16)
    with torch.no_grad():
        for p in src.model.parameters():
            p.add_(torch.randn_like(p))
    sd = src.model.state_dict()
    wire = to_wire(sd)
    assert all(isinstance(v if dtype == torch.float32 else v[0], np.ndarray) for v in wire.values())
    back = cloudpickle.loads(cloudpickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
    assert all(torch.equal(from_wire(back)[k], sd[k]) and from_wire(back)[k].dtype == dtype for k in sd)
    dst = HFRollout(str(tiny.policy_dir), bf16=dtype == torch.bfloat16)
    assert dst.load_weights([back]) == 1
    assert all(torch.equal(dst.model.state_dict()[k], sd[k]) for k in sd)


def test_one_rank_without_zero_skips_the_gradient_allreduce_and_still_trains(tiny, learner_env):
    """DeepSpeed would flatten every gradient into a new buffer to all-reduce it with itself at each step; the
    learner (and the training stages' engine) turn that off for one rank without ZeRO, and the step still
    updates every weight matrix."""
    learner = make_learner("policy", tiny.policy_dir, settings())
    assert learner.engine.enable_backward_allreduce is False
    before = learner._full_state_dict()
    metrics = learner.train(experience(tiny.policy_dir), 0.0)
    after = learner._full_state_dict()
    assert learner.engine.global_steps == 1 and metrics["policy_loss"] == metrics["policy_loss"]
    matrices = [k for k in before if before[k].dim() == 2]
    assert all(not torch.equal(before[k], after[k]) for k in matrices)


# ---------------------------------------------------------------------------------------------- throughput flags
def ragged(B: int = 6) -> dict:
    """A batch whose rows differ in length (prompts 3-7, responses 2-9 tokens): padding to pack away."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (3 + i % 5,), generator=g).tolist() for i in range(B)]
    resp = [torch.randint(3, 300, (2 + (3 * i) % 8,), generator=g).tolist() for i in range(B)]
    b = batches.collate(prompts, resp, pad_id=0, logprobs=[[-1.0] * len(r) for r in resp])
    T = b["mask"].shape
    b.update(old_logp=torch.full(T, -1.0), adv=torch.randn(T, generator=g), ref_logp=torch.full(T, -1.1),
             old_values=torch.zeros(T), returns=torch.ones(T))
    return b


def grads(learner) -> dict:
    return {n: p.grad.clone() for n, p in learner.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_packing_samples_gives_the_padded_outputs_loss_and_gradients_without_padding(tiny, learner_env, kind):
    """packing_samples: the rows go through the model as one packed row (per-sample position ids, the dense
    document mask on CPU) and come back in the (B, L - 1) layout: log-probs / values equal the padded forward's
    (atol 1e-5, fp32), and so do the loss and every gradient (atol 1e-5); the padded forward sends B x L tokens
    through the model, the packed one only the real tokens (its padding count is 0)."""
    model_dir = tiny.policy_dir if kind == "policy" else tiny.reward_dir
    over = dict(advantage_estimator="gae", reward_model_uri="rm", reward_func_path=None, n_samples_per_prompt=1,
                rollout_batch_size=6, train_batch_size=6, micro_train_batch_size=6, use_kl_loss=True)
    plain, packed = (make_learner(kind, model_dir, settings(**over, packing_samples=p)) for p in (False, True))
    batch = ragged()
    mask, real = batch["mask"], int(batch["attn"].sum())
    out_plain, out_packed = plain.forward(batch), packed.forward(batch)
    assert packed.forwarded_tokens == real < plain.forwarded_tokens == batch["ids"].numel()
    rel = mask if kind == "policy" else batch["attn"][:, 1:].float()  # values of every real state count
    assert torch.allclose(out_plain * rel, out_packed * rel, atol=1e-5) and float((out_plain * rel).abs().sum()) > 0
    losses_ = []
    for learner in (plain, packed):
        learner.engine.train()
        loss, _ = learner.loss(batch, kl_loss_coef=0.1)
        learner.engine.backward(loss)
        losses_.append(float(loss))
    assert abs(losses_[0] - losses_[1]) < 1e-5
    g0, g1 = grads(plain), grads(packed)
    assert g0.keys() == g1.keys() and len(g0) > 4
    assert all(torch.allclose(g0[k], g1[k], atol=1e-5) for k in g0)
    metrics = packed.train(batch, 0.1)
    assert metrics[f"{kind}_padding_tokens"] == 0 < plain.train(batch, 0.1)[f"{kind}_padding_tokens"]


def test_dynamic_batch_bounds_tokens_per_micro_batch_and_steps_as_the_fixed_micro_batches(tiny, learner_env):
    """use_dynamic_batch: every micro-batch forwards at most train_max_tokens_per_gpu tokens (rows x their
    longest, padded; the sum, packed) and a bound below a row alone leaves it alone; one optimizer step over
    token-bounded micro-batches (each loss scaled by its share of the step's rows, OpenRLHF's
    dynamic_sample_loss_scale) leaves the same weights as fixed 2-row micro-batches (loss_agg sequence: a
    per-sample mean, so the grouping does not change the loss; atol 1e-6 after one Adam step of lr 1e-3)."""
    from rlhf_core.ppo.forward import micro_batches, token_cost

    batch = ragged()
    lengths = batch["attn"].sum(-1).tolist()
    for packing in (False, True):
        for bound in (12, 25, 40):
            hp = settings(use_dynamic_batch=True, train_max_tokens_per_gpu=bound, packing_samples=packing)
            mbs = micro_batches(batch, hp, rollout=False)
            assert sorted(i for m in mbs for i in m) == list(range(6))
            assert all(token_cost([lengths[i] for i in m], packing) <= bound or len(m) == 1 for m in mbs)
            assert len(mbs) > 1
    over = dict(n_samples_per_prompt=3, train_batch_size=6, micro_train_batch_size=2, loss_agg="sequence",
                actor_learning_rate=1e-3, lr_warmup_ratio=0.0)
    fixed = make_learner("policy", tiny.policy_dir, settings(**over))
    dyn = make_learner("policy", tiny.policy_dir, settings(**over, use_dynamic_batch=True, train_max_tokens_per_gpu=60))
    sizes = [len(m) for m in micro_batches(batch, dyn.hp, rollout=False)]
    assert sorted(sizes) == [2, 4]  # the token bound groups the rows otherwise than 3 x 2
    fixed.train(batch, 0.0)
    dyn.train(batch, 0.0)
    assert fixed.engine.global_steps == dyn.engine.global_steps == 1
    a, b = fixed._full_state_dict(), dyn._full_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    start = make_learner("policy", tiny.policy_dir, settings(**over))._full_state_dict()
    assert any(not torch.allclose(a[k], start[k], atol=1e-4) for k in a)  # the step moved the weights


def test_adam_offload_runs_zero_offload_and_steps_as_without_it(tiny, learner_env):
    """adam_offload: ZeRO's offload_optimizer (device cpu) is active in the engine (DeepSpeed's ZeRO-Offload path:
    fp32 master weights and Adam's moments in separate host buffers, which on this CPU-only host is where the
    GPU run keeps them too), and one step leaves the weights of the step without it (atol 1e-6)."""
    over = dict(zero_stage=2, actor_learning_rate=1e-3, lr_warmup_ratio=0.0)
    plain = make_learner("policy", tiny.policy_dir, settings(**over))
    off = make_learner("policy", tiny.policy_dir, settings(**over, adam_offload=True))
    assert off.engine.zero_cpu_offload() and off.engine.optimizer.cpu_offload
    assert not plain.engine.zero_cpu_offload()
    batch = experience(tiny.policy_dir)
    plain.train(batch, 0.0)
    off.train(batch, 0.0)
    a, b = plain._full_state_dict(), off._full_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def _reference_rank(rank: int, world: int, port: int, model_dir: str, hp: dict, batch: dict, out: str) -> None:
    """One ZeRO-3 reference rank in a spawned process: its shard of the batch and its partition size."""
    torch.set_num_threads(1)
    ref = Reference(model_dir, hp, rank, world)
    ref.setup("127.0.0.1", port)
    n = batch["ids"].shape[0] // world
    lp = ref.forward({k: v[rank * n:(rank + 1) * n] for k, v in batch.items()})
    torch.save({"logp": lp, "elements": ref.param_elements()}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_two_zero3_reference_ranks_give_the_one_rank_logprobs_each_holding_half(tiny, tmp_path):
    """ref_num_gpus_per_node 2: two Reference ranks (spawned processes, a gloo group, ZeRO-3 without an
    optimizer) each forward half the batch in token-bounded micro-batches of different counts per rank
    (use_dynamic_batch: the count is synced, the fuller rank's bins are split), gathering each layer from the
    other: the concatenated log-probs equal the single unsharded reference's (atol 1e-5, fp32), and each rank
    holds about half the parameter elements (ZeRO-3 pads each partition: within 1% of half)."""
    import torch.multiprocessing as mp

    from rlhf_core.runtime.jobs import free_port

    hp = settings(temperature=0.7, use_dynamic_batch=True, rollout_max_tokens_per_gpu=20)  # rank 0: 3 micro-batches, rank 1: 4
    batch = ragged(8)
    whole = Reference(str(tiny.policy_dir), hp)
    expected, total = whole.forward(batch), whole.param_elements()
    mp.spawn(_reference_rank, args=(2, free_port(), str(tiny.policy_dir), hp, batch, str(tmp_path)), nprocs=2)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    got = torch.cat([p["logp"] for p in parts])
    mask = batch["mask"]
    assert torch.allclose(got * mask, expected * mask, atol=1e-5) and float((expected * mask).abs().sum()) > 0
    assert all(abs(p["elements"] - total / 2) < 0.01 * total for p in parts), ([p["elements"] for p in parts], total)


# ---------------------------------------------------------------------------------------------- issue 27 flags
def test_ptx_adds_the_pretrain_nll_to_the_actor_loss_and_0_is_off(tiny, learner_env):
    """PTX (OpenRLHF --pretrain_data / --ptx_coef): the policy's loss adds ptx_coef x the NLL of a pretrain
    micro-batch. One pretrain row, so every draw is it: ptx_loss is the HF model's own causal-LM loss on that
    row (by hand: model(ids, labels=ids).loss, the mean NLL of tokens 1..n-1). The update differs from the
    same step without it; ptx_coef 0 gives exactly the step without it."""
    from transformers import AutoModelForCausalLM

    row = list(range(5, 17))
    hand = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir)).eval()
    with torch.no_grad():
        nll = float(hand(torch.tensor([row]), labels=torch.tensor([row])).loss)
    after, metrics = {}, {}
    for name, coef in (("off", None), ("ptx", 0.5), ("zero", 0.0)):
        hp = settings(**({} if coef is None else dict(pretrain_data="sft", ptx_coef=coef)))
        learner = make_learner("policy", tiny.policy_dir, hp)
        if coef is not None:
            learner.set_pretrain([row])
        metrics[name] = learner.train(experience(tiny.policy_dir), 0.0)
        after[name] = learner._full_state_dict()
    assert metrics["ptx"]["ptx_loss"] == pytest.approx(nll, rel=1e-5)
    assert "ptx_loss" not in metrics["off"] and "ptx_loss" not in metrics["zero"]
    assert metrics["ptx"]["policy_loss"] == pytest.approx(metrics["off"]["policy_loss"], abs=1e-6)  # same first step
    assert any(not torch.equal(after["ptx"][k], after["off"][k]) for k in after["off"])
    assert all(torch.equal(after["zero"][k], after["off"][k]) for k in after["off"])


def openrlhf_rm(src, dst, prefix: str = "value_head", scale: float = 1.0):
    """An OpenRLHF-format reward model from a seq-cls folder: backbone `model.*` + a bias-free `{prefix}.weight`
    head (times `scale`), config.json naming value_head_prefix as OpenRLHF's train_rm saves it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd[f"{prefix}.weight"] = sd.pop("score.weight") * scale
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["LlamaModel"], value_head_prefix=prefix)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_value_head_format_critic_loads_and_values_are_the_head_by_hand(tiny, learner_env, tmp_path):
    """A critic from an OpenRLHF value_head-format RM: its values are the head applied by hand to the backbone's
    hidden states (AutoModel + value_head.weight), column t the state before token t + 1."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    vh = openrlhf_rm(tiny.reward_dir, tmp_path / "vh")
    critic = make_learner("critic", vh, settings(advantage_estimator="gae", reward_model_uri="rm", reward_func_path=None,
                                                 n_samples_per_prompt=1, rollout_batch_size=4))
    b = experience(tiny.policy_dir)
    got = critic.forward(b)
    body, w = AutoModel.from_pretrained(str(vh)).eval(), load_file(str(vh / "model.safetensors"))["value_head.weight"]
    with torch.no_grad():
        h = body(input_ids=b["ids"], attention_mask=b["attn"]).last_hidden_state  # (B, L, H)
    assert torch.allclose(got, (h @ w.T).squeeze(-1)[:, :-1], atol=1e-5)


def test_cuda_ipc_send_on_a_rank_without_engines_makes_no_handle(tiny, learner_env):
    """issue 35 item 4: a policy rank with no engine on its GPU took part in the sync by making a CUDA IPC handle of
    every bucket, which nobody opened (torch keeps such a block until a consumer releases it: one model leaked per
    sync). Now it only walks the gathers: on this CPU host it returns 0 bytes without touching CUDA (making a handle
    needs torch.cuda, which raises here)."""
    from rlhf_core.ppo import weight_sync

    learner = make_learner("policy", tiny.policy_dir, settings())
    assert len(weight_sync.layout(learner, 2 ** 16)) > 1
    assert weight_sync.send_ipc(learner, []) == 0
    with pytest.raises((AssertionError, RuntimeError)):  # a handle is CUDA's: this host cannot make one
        next(weight_sync.ipc_handles(learner))
