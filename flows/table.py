"""The loop flows and their stages, as data. The CLI lists and loads flows from FLOWS, `common.validate`
checks every stage a flow names before any work, and the progress artifact counts the stage calls a run
plans from it. A new flow is one module (Params, checks, FLOW) and one entry here.

SHARED: the stages every loop flow may call, each set by the LoopParams field of the same name (prompts,
the SFT warm-up, the reward model, the rollout, the filter, eval). A flow's other stages are set by the
settings its `checks(params)` returns (e.g. dpo, reference, or the loop's own sft settings).
"""
from __future__ import annotations

from dataclasses import dataclass

SHARED = ("prepare", "sft", "train_rm", "generate", "score", "filter", "eval")
FIXED = {"prepare": {"kind": "prompts"}, "filter": {"method": "rs"}}  # set by the flow, not the user
WIRED = {"score": ("reward_model_uri",)}  # optional inputs the flow wires in (validation puts placeholders there)


@dataclass(frozen=True)
class FlowSpec:
    module: str  # holds Params, checks(params) and FLOW
    iteration: tuple[str, ...]  # stage calls of one iteration, in order (stages/<name>.py), eval included
    optional: tuple[tuple[str, str], ...] = ()  # (stage, Params field): one more call per iteration when it is set
    variants: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (Params field, value, the iteration instead)


FLOWS = {
    "iterative-dpo": FlowSpec("flows.iterative_dpo", ("generate", "score", "filter", "reference", "dpo", "eval"),
                              variants=(("trainer", "kto", ("generate", "score", "filter", "kto", "eval")),)),
    "raft": FlowSpec("flows.raft", ("generate", "score", "filter", "sft", "eval"),
                     variants=(("trainer", "kd", ("generate", "score", "filter", "kd", "eval")),)),
    "conditional-sft": FlowSpec("flows.conditional_sft", ("generate", "score", "filter", "sft", "eval"),
                                optional=(("eval", "low_target_reward"),)),
    "ppo": FlowSpec("flows.ppo", ("ppo", "eval")),
}


def iteration(flow: str, params) -> tuple[str, ...]:
    """The stage calls of one iteration of `flow` run with `params` (eval included, optional calls not)."""
    spec = FLOWS[flow]
    return next((stages for field, value, stages in spec.variants if getattr(params, field, None) == value), spec.iteration)


def calls_per_iteration(flow: str, params) -> int:
    spec = FLOWS[flow]
    return len(iteration(flow, params)) + sum(getattr(params, field, None) is not None for _, field in spec.optional)
