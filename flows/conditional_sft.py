"""Flow `conditional-sft`: reward-conditioned SFT (SteerLM, https://arxiv.org/abs/2310.05344; OpenRLHF's
former examples/scripts/train_conditional_llama.sh, as a resumable flow).

    for k in 1..iterations:
        generate responses from policy_k on prompt slice k and score them with the reward model
            (k > 1, bootstrap: sampled under the high-reward condition, SteerLM's bootstrapping step)
        csft: "{input} <rm_score>: {reward} " -> SFT rows (rewards optionally normalised globally, or
              bucketed by rank in the batch: filter.reward_buckets, written as filter.bucket_labels)
        sft(policy_k) on those rows -> policy_{k+1}
        evaluate with the high-reward condition appended to the held-out prompts (and the low one, if set)

    rlhf-flows run conditional-sft --config configs/demo_csft.yaml
"""
from __future__ import annotations

from prefect import flow
from pydantic import Field, model_validator

from flows import common
from flows.calls import call, settings, stage_config
from flows.lock import run_lock
from rlhf_core.rollout import postprocess
from rlhf_core import store
from stages import filter as filter_stage, sft


class Params(common.LoopParams):
    target_reward: float = Field(1.0, description="Condition written into the held-out prompts at evaluation: a reward, "
                                 "or with filter.reward_buckets = N a bucket index (N-1 = the best).")
    low_target_reward: float | None = Field(None, description="Also evaluate every iteration under this low condition "
                                            "(report columns gold_reward_low, rm_reward_low): the policy follows its "
                                            "condition when the high target beats it.")
    bootstrap: bool = Field(True, description="From iteration 2 on, sample the rollouts under the target_reward "
                            "condition (SteerLM's bootstrapping: the policy asked for the best), so each iteration "
                            "trains on better samples than the last; false: sample without a condition.")
    sft_loop: common.SftSettings = Field(default_factory=common.SftSettings, description="SFT settings of the conditional fine-tune.")

    @model_validator(mode="after")
    def _targets_are_buckets(self):
        n = self.filter.reward_buckets
        for name in ("target_reward", "low_target_reward"):
            t = getattr(self, name)
            if n and t is not None and not (t == int(t) and 0 <= t < n):
                raise ValueError(f"{name}={t:g}: with filter.reward_buckets={n} the condition is a bucket index 0..{n - 1}")
        return self


def checks(p: Params) -> dict:
    """The flow's own stages and their settings, validated before any work."""
    return {sft: p.sft_loop}


@flow(name="conditional-sft", flow_run_name=common.flow_run_name, log_prints=True, validate_parameters=False)
def conditional_sft(params: Params) -> dict:
    p = common.run_params(params, Params)  # a deployment run's params over the deployment's
    so = p.storage_options
    run = common.setup(p, "conditional-sft", checks(p))
    with run_lock(p.root, p.run_name, p.lock_lease_s, so):
        policy, reward, prompts, report = common.prepare_inputs(p, run)
        # Evaluate under the condition the policy learnt to follow: the high target reward.
        template = p.filter.csft_template
        condition = lambda t: template.replace("{input}", "{prompt}").replace(  # noqa: E731
            "{reward}", postprocess.csft_condition(t, p.filter.reward_buckets, p.filter.bucket_labels))
        report.eval_cfg["prompt_template"] = condition(p.target_reward)
        if p.low_target_reward is not None:
            report.eval_variants["low"] = {"prompt_template": condition(p.low_target_reward), "reference_uri": None}
        for k in common.iterations(p, report):
            at = lambda stage: store.run_prefix(p.root, p.run_name, stage, k)  # noqa: E731
            ask_best = {"condition_template": condition(p.target_reward)} if p.bootstrap and k > 1 else {}
            samples, scored = common.rollout(p, k, policy, prompts, reward, **ask_best)
            rows = call(filter_stage, stage_config(filter_stage, {**settings(p.filter), "method": "csft"}, scored_uri=scored["uri"],
                                                        output_uri=at("csft"), storage_options=so))
            trained = call(sft, stage_config(sft, p.sft_loop, policy_uri=policy, dataset_uri=rows["uri"],
                                                  output_uri=at("sft"), storage_options=so))
            policy = trained["uri"]
            common.evaluate_and_report(p, report, k, policy, reward, [samples, scored, rows, trained])
    return report.finish()


FLOW = conditional_sft
