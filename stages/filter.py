"""filter: scored samples -> training data, by one of OpenRLHF's post-processors (rlhf_core.rollout.postprocess).

  rs        best-of-n rejection sampling (RAFT): top_k highest-reward responses per prompt -> `sft` rows
  iter_dpo  per prompt max vs min reward -> `pairs` rows; ties and single-sample prompts dropped, counted
  csft      conditional SFT: "{input} <rm_score>: {reward} " (optionally normalised rewards, or with
            reward_buckets the reward's rank bucket in the batch, as its index or bucket_labels[i]) -> `sft` rows
Optionally first keeps only prompts whose mean reward lies inside (min_reward, max_reward) (dynamic filtering).

    rlhf-flows stage filter scored_uri=... method=iter_dpo output_uri=...
"""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rlhf_core.inputs import data
from rlhf_core import store
from rlhf_core.rollout import postprocess as pp
from stages.common import StageConfig

METHODS = ("rs", "iter_dpo", "csft")


class Config(StageConfig):
    scored_uri: str = Field(description="Committed `scored` artifact (from score).")
    method: str = Field(description="Post-processor: 'rs', 'iter_dpo' or 'csft'.")
    top_k: int = Field(1, ge=1, description="rs: responses kept per prompt, best first.")
    min_reward: float | None = Field(None, description="Keep prompts whose mean reward is > min_reward.")
    max_reward: float | None = Field(None, description="Keep prompts whose mean reward is < max_reward.")
    normalize_reward: bool = Field(False, description="csft: normalise rewards over all rows before the template.")
    csft_template: str = Field(pp.DEFAULT_CSFT_TEMPLATE, description="csft: template with {input} and {reward}.")
    reward_buckets: int = Field(0, ge=0, description="csft: >= 2: the condition is the reward's rank bucket in the batch "
                                "(0 = worst .. N-1 = best) instead of the reward at 2 decimals (normalize_reward then has no effect).")
    bucket_labels: list[str] | None = Field(None, description="csft with reward_buckets: each bucket's condition text, "
                                            "worst first (default the index: 0 .. N-1); e.g. [E, D, C, B, A], tokens "
                                            "that occur nowhere else in the prompts.")

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"unknown post-processor {v!r}; choose one of {list(METHODS)}")
        return v

    @model_validator(mode="after")
    def _buckets(self):
        if self.reward_buckets == 1:
            raise ValueError("reward_buckets must be 0 (off) or >= 2")
        if self.reward_buckets and self.normalize_reward:
            raise ValueError("reward_buckets ranks the rewards, so normalize_reward has no effect: set one of them")
        if self.bucket_labels is not None:
            labels = self.bucket_labels
            if len(labels) != self.reward_buckets:
                raise ValueError(f"bucket_labels has {len(labels)} labels for reward_buckets={self.reward_buckets}: "
                                 "give one per bucket (worst first)")
            if len(set(labels)) != len(labels) or not all(x.strip() for x in labels):
                raise ValueError(f"bucket_labels {labels} must be distinct and non-empty")
        return self


def run(cfg: Config) -> store.Manifest:
    # 1. the skip: same input and config as a committed output -> nothing to read
    scored_m = store.read_manifest(cfg.scored_uri, storage_options=cfg.storage_options)
    w = store.ArtifactWriter(cfg.output_uri, "filter", cfg.semantic(), {"scored": scored_m}, cfg.storage_options)
    if (done := w.existing()):
        return done

    # 2. inputs, checked before any work
    table = store.read_table(cfg.scored_uri, storage_options=cfg.storage_options)
    data.validate_table(table, "scored", cfg.scored_uri)
    rows = table.to_pylist()
    groups = pp.group_by_prompt(rows)
    if cfg.method == "iter_dpo" and max(len(g) for g in groups.values()) < 2:
        raise pp.FilterError(f"iter_dpo needs best_of_n >= 2: every prompt in {cfg.scored_uri} has one sample")
    if cfg.method == "csft" and ("{input}" not in cfg.csft_template or "{reward}" not in cfg.csft_template):
        raise pp.FilterError(f"csft_template {cfg.csft_template!r} must contain {{input}} and {{reward}}")
    w.begin()

    # 3. post-process
    stats = pp.FilterStats(rows_in=len(rows), prompts=len(groups))
    kept = pp.dynamic_filter(rows, cfg.min_reward, cfg.max_reward)
    stats.dropped_range = len(rows) - len(kept)
    kept = pp.drop_empty(kept, stats)
    if cfg.method == "rs":
        out, kind = pp.best_of_n(kept, cfg.top_k), "sft"
    elif cfg.method == "iter_dpo":
        out, kind = pp.dpo_pairs(kept, stats), "pairs"
    else:
        out = pp.conditional_sft(kept, cfg.normalize_reward, cfg.csft_template, cfg.reward_buckets, cfg.bucket_labels)
        kind = "sft"
    if not out:
        raise data.DataError(f"{cfg.scored_uri}: {cfg.method} kept no rows ({len(rows)} in, "
                             f"{stats.dropped_range} outside the reward range, {stats.dropped_empty} empty responses, "
                             f"{stats.dropped_ties} tied prompts, "
                             f"{stats.dropped_single} single-sample prompts)")

    # 4. write, commit
    w.write_table(f"{kind}.parquet", data.to_table(out, kind))
    metrics = {"method": cfg.method, "kind": kind, "rows_in": len(rows), "rows_out": len(out), "prompts": len(groups),
               "dropped_ties": stats.dropped_ties, "dropped_single": stats.dropped_single,
               "dropped_range": stats.dropped_range, "dropped_empty": stats.dropped_empty, "reward_mean_all": pp.mean([r["reward"] for r in rows])}
    if kind == "pairs":
        metrics |= {"reward_mean_chosen": pp.mean([p["chosen_reward"] for p in out]),
                    "reward_mean_rejected": pp.mean([p["rejected_reward"] for p in out]),
                    "margin_mean": pp.mean([p["margin"] for p in out])}
    else:
        metrics["reward_mean_kept"] = pp.mean([r["reward"] for r in out])
    return w.commit(metrics=metrics)
