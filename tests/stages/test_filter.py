"""filter stage over hand-made scored rows on the moto S3 endpoint."""
import pytest

from rlhf_core.inputs import data
from rlhf_core.rollout import postprocess
from rlhf_core import store
from stages import filter as filter_stage
from stages.common import ConfigError, load_config

REWARDS = {"p1": [0.1, 0.8, 0.3], "p2": [0.5, 0.5, 0.5], "p3": [-1.0, 2.0, 0.0]}


def commit_scored(root, rows, name="scored"):
    w = store.ArtifactWriter(f"{root}/{name}", "score", {"t": name, "rows": rows})
    w.begin()
    w.write_table("scored.parquet", data.to_table(rows, "scored"))
    return w.commit().uri


def scored(s3_root, spec=REWARDS, name="scored"):
    return commit_scored(s3_root, [{"prompt": p, "response": f"{p}-r{i}", "sample_index": i, "reward": r}
                                   for p, rs in spec.items() for i, r in enumerate(rs)], name)


def one_prompt(responses_rewards):
    return [{"prompt": "p", "response": r, "sample_index": i, "reward": rw} for i, (r, rw) in enumerate(responses_rewards)]


def test_iter_dpo_pairs_drop_ties_and_rerun(s3_root):
    cfg = filter_stage.Config(scored_uri=scored(s3_root), method="iter_dpo", output_uri=f"{s3_root}/pairs")
    m = filter_stage.run(cfg)
    pairs = store.read_table(m.uri, "filter").to_pylist()
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [("p1", "p1-r1", "p1-r0"), ("p3", "p3-r1", "p3-r0")]
    assert [p["margin"] for p in pairs] == pytest.approx([0.7, 3.0])
    assert {k: m.metrics[k] for k in ("rows_in", "rows_out", "dropped_ties", "dropped_single", "kind")} == {
        "rows_in": 9, "rows_out": 2, "dropped_ties": 1, "dropped_single": 0, "kind": "pairs"}
    assert m.metrics["reward_mean_chosen"] == pytest.approx(1.4)
    assert filter_stage.run(cfg).created_at == m.created_at


def test_rs_one_row_per_prompt_with_max_and_reward_range(s3_root):
    uri = scored(s3_root)
    m = filter_stage.run(filter_stage.Config(scored_uri=uri, method="rs", output_uri=f"{s3_root}/rs"))
    rows = store.read_table(m.uri).to_pylist()
    assert [(r["input"], r["output"], r["reward"]) for r in rows] == [("p1", "p1-r1", 0.8), ("p2", "p2-r0", 0.5),
                                                                     ("p3", "p3-r1", 2.0)]
    assert m.metrics["reward_mean_kept"] == pytest.approx((0.8 + 0.5 + 2.0) / 3)
    # dynamic filtering: means p1 0.4, p2 0.5, p3 0.333 -> range (0.35, 0.5) keeps only p1
    m2 = filter_stage.run(filter_stage.Config(scored_uri=uri, method="rs", top_k=2, min_reward=0.35, max_reward=0.5,
                                              output_uri=f"{s3_root}/rs2"))
    assert [r["output"] for r in store.read_table(m2.uri).to_pylist()] == ["p1-r1", "p1-r2"]
    assert m2.metrics["dropped_range"] == 6


def test_csft_template_and_normalisation(s3_root):
    uri = scored(s3_root, {"Q": [1.0, 2.0, 3.0]})
    m = filter_stage.run(filter_stage.Config(scored_uri=uri, method="csft", normalize_reward=True,
                                             output_uri=f"{s3_root}/csft"))
    assert [r["input"] for r in store.read_table(m.uri).to_pylist()] == [
        "Q <rm_score>: -1.00 ", "Q <rm_score>: 0.00 ", "Q <rm_score>: 1.00 "]


def test_iter_dpo_needs_best_of_n_2(s3_root):
    cfg = filter_stage.Config(scored_uri=scored(s3_root, {"a": [1.0], "b": [2.0]}), method="iter_dpo",
                              output_uri=f"{s3_root}/bad")
    with pytest.raises(postprocess.FilterError, match="iter_dpo needs best_of_n >= 2"):
        filter_stage.run(cfg)
    assert not store.committed_any(cfg.output_uri)


def test_unknown_post_processor():
    with pytest.raises(ConfigError, match="unknown post-processor 'raft'"):
        load_config(filter_stage.Config, overrides=["scored_uri=s", "output_uri=o", "method=raft"])


def test_uncommitted_input_is_refused(s3_root):
    with pytest.raises(store.NotCommittedError, match="not a committed artifact"):
        filter_stage.run(filter_stage.Config(scored_uri=f"{s3_root}/nothing", method="rs", output_uri=f"{s3_root}/o"))


def test_empty_responses_never_become_training_targets(tmp_path):
    uri = commit_scored(tmp_path, one_prompt([("good .", 1.0), ("", -2.0), ("bad .", -1.0)]))
    m = filter_stage.run(filter_stage.Config(scored_uri=uri, method="iter_dpo", output_uri=str(tmp_path / "pairs")))
    assert m.metrics["dropped_empty"] == 1 and m.rows == 1
    assert store.read_table(m.uri).to_pylist()[0]["rejected"] == "bad ."


def test_a_rerun_reads_no_input_data(tmp_path):
    """The skip is decided from manifests alone: resuming on a new machine downloads nothing it won't use."""
    uri = commit_scored(tmp_path, one_prompt([("good .", 1.0), ("bad .", -1.0)]))
    cfg = filter_stage.Config(scored_uri=uri, method="iter_dpo", output_uri=str(tmp_path / "pairs"))
    first = filter_stage.run(cfg)
    (tmp_path / "scored" / "scored.parquet").unlink()
    assert filter_stage.run(cfg).created_at == first.created_at


def test_csft_reward_buckets_refuse_an_ignored_normalisation_and_one_bucket():
    with pytest.raises(ValueError, match="normalize_reward has no effect"):
        filter_stage.Config(scored_uri="x", method="csft", reward_buckets=5, normalize_reward=True, output_uri="y")
    with pytest.raises(ValueError, match="reward_buckets must be 0"):
        filter_stage.Config(scored_uri="x", method="csft", reward_buckets=1, output_uri="y")
    with pytest.raises(ValueError, match="bucket_labels has 4 labels for reward_buckets=5"):
        filter_stage.Config(scored_uri="x", method="csft", reward_buckets=5, bucket_labels=list("DCBA"), output_uri="y")
    with pytest.raises(ValueError, match="bucket_labels has 5 labels for reward_buckets=0"):
        filter_stage.Config(scored_uri="x", method="csft", bucket_labels=list("EDCBA"), output_uri="y")
    with pytest.raises(ValueError, match="must be distinct"):
        filter_stage.Config(scored_uri="x", method="csft", reward_buckets=3, bucket_labels=["A", "A", "B"], output_uri="y")
