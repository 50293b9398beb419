"""Flow `iterative-dpo`: online iterative DPO (Xiong et al. 2024, https://arxiv.org/abs/2312.11456; the
loop of OpenRLHF's former examples/scripts/train_iterative_dpo_llama.sh, as a resumable Prefect flow).

    optional: sft warm-up on sft_data; train_rm on preference_data when no reward model is given
    for k in 1..iterations:
        generate best_of_n responses from policy_k on prompt slice k      (Ray engines, vLLM or HF)
        score them with the reward model
        pairs: chosen = max reward, rejected = min reward per prompt      (ties dropped)
        reference log-probs of the pairs under the reference model        (once per dataset)
        dpo(policy_k) -> policy_{k+1}; evaluate on held-out prompts
    reference = the initial policy (Online-RLHF), or the previous policy with ref_policy=previous.
    trainer=kto: the pairs become KTO rows (chosen desirable, rejected undesirable) and the kto stage trains
    on them (arXiv:2402.01306; its own reference pass inside), with the `kto` settings instead of dpo's.

Every stage writes `{root}/{run_name}/iter-{k}/{stage}/`; rerunning with the same run_name resumes.

    rlhf-flows run iterative-dpo --config configs/demo.yaml [key=value ...]
    prefect deployment run 'iterative-dpo/demo'
"""
from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import Field

from flows import common
from flows.calls import call, settings, stage_config
from flows.lock import run_lock
from rlhf_core import store
from stages import dpo, filter as filter_stage, kto, reference
from stages.common import ConfigError


ReferenceSettings, DpoSettings, KtoSettings = common.section("reference"), common.section("dpo"), common.section("kto")


class Params(common.LoopParams):
    ref_policy: Literal["initial", "previous"] = Field("initial", description="Reference model for DPO.")
    reference: ReferenceSettings = Field(default_factory=ReferenceSettings, description="Settings of the reference log-prob pass.")
    dpo: DpoSettings = Field(default_factory=DpoSettings, description="DPO settings (beta, learning_rate, ...).")
    trainer: Literal["dpo", "kto"] = Field("dpo", description="Preference trainer of each iteration: dpo on the pairs, "
                                           "or kto on the pairs as desirable / undesirable rows.")
    kto: KtoSettings = Field(default_factory=KtoSettings, description="KTO settings (beta, desirable_loss_weight, ...) with trainer=kto.")


# The reference pass runs as dpo trains (same tokens, dtype and hardware) unless `reference` says otherwise.
REF_FROM_DPO = ("max_len", "overlong", "bf16", "packing_samples", "attn_implementation", "zero_stage", "launcher",
                "num_gpus", "num_nodes", "hostfile")


def reference_settings(p: Params) -> dict:
    dpo_given = settings(p.dpo)
    return {**{k: dpo_given[k] for k in REF_FROM_DPO if k in dpo_given}, **settings(p.reference)}


def checks(p: Params) -> dict:
    """The flow's own stages and their settings, validated before any work; the other trainer's settings
    would be ignored, so they are refused."""
    unused = ("dpo", "reference") if p.trainer == "kto" else ("kto",)
    if given := [k for k in unused if settings(getattr(p, k))]:
        raise ConfigError(f"iterative-dpo: trainer={p.trainer} does not read {' and '.join(given)} settings: remove them")
    return {kto: p.kto} if p.trainer == "kto" else {reference: reference_settings(p), dpo: p.dpo}


@flow(name="iterative-dpo", flow_run_name=common.flow_run_name, log_prints=True, validate_parameters=False)
def iterative_dpo(params: Params) -> dict:
    p = common.run_params(params, Params)  # a deployment run's params over the deployment's
    so = p.storage_options
    run = common.setup(p, "iterative-dpo", checks(p))
    with run_lock(p.root, p.run_name, p.lock_lease_s, so):
        policy, reward, prompts, report = common.prepare_inputs(p, run)
        ref = policy
        for k in common.iterations(p, report):
            at = lambda stage: store.run_prefix(p.root, p.run_name, stage, k)  # noqa: E731
            samples, scored = common.rollout(p, k, policy, prompts, reward)
            pairs = call(filter_stage, stage_config(filter_stage, {**settings(p.filter), "method": "iter_dpo"},
                                                         scored_uri=scored["uri"], output_uri=at("pairs"), storage_options=so))
            if p.trainer == "kto":
                trained = call(kto, stage_config(kto, p.kto, dataset_uri=pairs["uri"], policy_uri=policy, ref_uri=ref,
                                                      output_uri=at("kto"), storage_options=so))
                made = [samples, scored, pairs, trained]
            else:
                with_ref = call(reference, stage_config(reference, reference_settings(p), pairs_uri=pairs["uri"],
                                                             ref_uri=ref, output_uri=at("reference"), storage_options=so))
                trained = call(dpo, stage_config(dpo, p.dpo, dataset_uri=with_ref["uri"], policy_uri=policy,
                                                      output_uri=at("dpo"), storage_options=so))
                made = [samples, scored, pairs, with_ref, trained]
            policy = trained["uri"]
            if p.ref_policy == "previous":
                ref = policy
            common.evaluate_and_report(p, report, k, policy, reward, made)
    return report.finish()


FLOW = iterative_dpo
