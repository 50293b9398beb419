"""Flow `ppo`: online RL (OpenRLHF's train_ppo_ray: PPO, REINFORCE++, GRPO, ...) as a resumable flow of
committed policies.

    optional: sft warm-up on sft_data; train_rm on preference_data when no reward source is given
    for k in 1..iterations:
        ppo(policy_k) on the prompts (one pass, num_episodes each, permutation seeded by k) -> policy_{k+1}
        evaluate policy_{k+1} on held-out prompts (gold reward, RM reward, KL to the initial policy, length)
    stop early on stop_when_gain_below / max_wall_time_s.

Each iteration is one run of the `ppo` stage (one Ray job: learners, reference, reward, rollout engines),
whose KL term is to that iteration's starting policy; the report's KL is to the initial one. Every stage
writes `{root}/{run_name}/iter-{k}/{stage}/`: a rerun with the same run_name skips committed stages and a
ppo stage killed mid-iteration resumes from its store checkpoint (ppo.save_steps).

    rlhf-flows run ppo --config configs/demo_ppo.yaml
    prefect deployment run 'ppo/demo'
"""
from __future__ import annotations

from prefect import flow
from pydantic import Field

from flows import common
from flows.calls import call, settings, stage_config
from flows.lock import run_lock
from rlhf_core import store
from stages import ppo as ppo_stage


PpoSettings = common.section("ppo")


class Params(common.LoopParams):
    ppo: PpoSettings = Field(default_factory=PpoSettings, description="ppo stage settings (advantage_estimator, "
                             "actor_learning_rate, n_samples_per_prompt, ...); the policy, prompts and reward source are "
                             "wired in.")


def checks(p: Params) -> dict:
    """The flow's own stages and their settings, validated before any work (the reward source the flow will
    wire in stands in)."""
    source = ("reward_func_path" if p.reward_func_file else "remote_rm_url" if p.reward_url
              else "reward_model_uri")  # given or trained by train_rm
    return {ppo_stage: {source: "placeholder://", **settings(p.ppo)}}


def iteration_settings(p: Params, k: int) -> dict:
    """Iteration k's ppo settings: the user's, with the prompt permutation seeded by k."""
    return {**settings(p.ppo), "seed": p.ppo.seed + k - 1}


@flow(name="ppo", flow_run_name=common.flow_run_name, log_prints=True, validate_parameters=False)
def ppo(params: Params) -> dict:
    p = common.run_params(params, Params)  # a deployment run's params over the deployment's
    so = p.storage_options
    run = common.setup(p, "ppo", checks(p))
    with run_lock(p.root, p.run_name, p.lock_lease_s, so):
        policy, reward, prompts, report = common.prepare_inputs(p, run)
        for k in common.iterations(p, report):
            trained = call(ppo_stage, stage_config(ppo_stage, iteration_settings(p, k), policy_uri=policy,
                                                        prompts_uri=prompts, **reward, storage_options=so,
                                                        output_uri=store.run_prefix(p.root, p.run_name, "ppo", k)))
            policy = trained["uri"]
            common.evaluate_and_report(p, report, k, policy, reward, [trained])
    return report.finish()


FLOW = ppo
