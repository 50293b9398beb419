"""Flow `raft`: rejection-sampling fine-tuning (RAFT, Dong et al. 2023, https://arxiv.org/abs/2304.06767;
the loop of OpenRLHF's former examples/scripts/train_rejection_sampling_llama.sh, as a resumable flow).

    for k in 1..iterations:
        generate best_of_n responses from policy_k on prompt slice k
        score them with the reward model
        rs: keep the best response per prompt (top_k)                     -> SFT rows
        sft(policy_k) on those rows -> policy_{k+1}; evaluate on held-out prompts

    rlhf-flows run raft --config configs/demo_raft.yaml
"""
from __future__ import annotations

from prefect import flow
from pydantic import Field

from flows import common
from flows.common import call, stage_config
from rlhf_core import store
from stages import filter as filter_stage, generate, score, sft


class Params(common.LoopParams):
    sft_loop: dict = Field(default_factory=dict, description="SFT settings of the per-iteration fine-tune.")


def checks(p: Params) -> dict:
    """The flow's own stages and their settings, validated before any work."""
    return {sft: p.sft_loop}


@flow(name="raft", log_prints=True)
def raft(params: Params) -> dict:
    p = params
    run = common.setup(p, "raft", checks(p))
    with common.run_lock(p.root, p.run_name, p.lock_lease_s, p.storage_options):
        policy, reward, prompts, report = common.prepare_inputs(p, run)
        for k in range(1, p.iterations + 1):
            if (why := common.out_of_time(p, report)):
                report.stop_reason = why
                break
            at = lambda stage: store.run_prefix(p.root, p.run_name, stage, k)  # noqa: E731
            samples = call(generate.task, stage_config(generate, p.generate, policy_uri=policy, prompts_uri=prompts,
                                                       iter=k - 1, output_uri=at("generate"), storage_options=p.storage_options))
            scored = call(score.task, stage_config(score, p.score, samples_uri=samples["uri"], **reward,
                                                   output_uri=at("score"), storage_options=p.storage_options))
            best = call(filter_stage.task, stage_config(filter_stage, {**p.filter, "method": "rs"}, scored_uri=scored["uri"],
                                                        output_uri=at("best_of_n"), storage_options=p.storage_options))
            trained = call(sft.task, stage_config(sft, p.sft_loop, policy_uri=policy, dataset_uri=best["uri"],
                                                  output_uri=at("sft"), storage_options=p.storage_options))
            policy = trained["uri"]
            common.evaluate_and_report(p, report, k, policy, reward, [samples, scored, best, trained])
            if (why := common.converged(p, report)):
                report.stop_reason = why
                break
    return report.finish()


FLOW = raft
