"""Flow `raft`: rejection-sampling fine-tuning (RAFT, Dong et al. 2023, https://arxiv.org/abs/2304.06767;
the loop of OpenRLHF's former examples/scripts/train_rejection_sampling_llama.sh, as a resumable flow).

    for k in 1..iterations:
        generate best_of_n responses from policy_k on prompt slice k
        score them with the reward model
        rs: keep the best response per prompt (top_k)                     -> SFT rows
        sft(policy_k) on those rows -> policy_{k+1}; evaluate on held-out prompts
    trainer=kd: the kept rows train through the kd stage instead (distillation from the frozen teacher
    `kd.teacher_uri`, mixed with the NLL by kd.kd_coef), with the `kd` settings instead of sft_loop's.

    rlhf-flows run raft --config configs/demo_raft.yaml
"""
from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import Field

from flows import common
from flows.calls import call, settings, stage_config
from flows.lock import run_lock
from rlhf_core import store
from stages import filter as filter_stage, kd, sft
from stages.common import ConfigError


KdSettings = common.section("kd")


class Params(common.LoopParams):
    sft_loop: common.SftSettings = Field(default_factory=common.SftSettings, description="SFT settings of the per-iteration fine-tune.")
    trainer: Literal["sft", "kd"] = Field("sft", description="Per-iteration trainer on the kept rows: sft, or kd "
                                          "(distillation from kd.teacher_uri mixed with the NLL).")
    kd: KdSettings = Field(default_factory=KdSettings, description="KD settings with trainer=kd: teacher_uri (required), kd_coef, ...")


def checks(p: Params) -> dict:
    """The flow's own stages and their settings, validated before any work; the other trainer's settings
    would be ignored, so they are refused."""
    unused = "sft_loop" if p.trainer == "kd" else "kd"
    if settings(getattr(p, unused)):
        raise ConfigError(f"raft: trainer={p.trainer} does not read {unused} settings: remove them")
    if p.trainer == "kd" and not p.kd.teacher_uri:
        raise ConfigError("raft: trainer=kd needs kd.teacher_uri (the frozen teacher: a committed artifact or a plain HF folder)")
    return {kd: p.kd} if p.trainer == "kd" else {sft: p.sft_loop}


@flow(name="raft", flow_run_name=common.flow_run_name, log_prints=True, validate_parameters=False)
def raft(params: Params) -> dict:
    p = common.run_params(params, Params)  # a deployment run's params over the deployment's
    so = p.storage_options
    run = common.setup(p, "raft", checks(p))
    with run_lock(p.root, p.run_name, p.lock_lease_s, so):
        policy, reward, prompts, report = common.prepare_inputs(p, run)
        for k in common.iterations(p, report):
            at = lambda stage: store.run_prefix(p.root, p.run_name, stage, k)  # noqa: E731
            samples, scored = common.rollout(p, k, policy, prompts, reward)
            best = call(filter_stage, stage_config(filter_stage, {**settings(p.filter), "method": "rs"}, scored_uri=scored["uri"],
                                                        output_uri=at("best_of_n"), storage_options=so))
            if p.trainer == "kd":
                trained = call(kd, stage_config(kd, p.kd, policy_uri=policy, dataset_uri=best["uri"],
                                                     output_uri=at("kd"), storage_options=so))
            else:
                trained = call(sft, stage_config(sft, p.sft_loop, policy_uri=policy, dataset_uri=best["uri"],
                                                      output_uri=at("sft"), storage_options=so))
            policy = trained["uri"]
            common.evaluate_and_report(p, report, k, policy, reward, [samples, scored, best, trained])
    return report.finish()


FLOW = raft
