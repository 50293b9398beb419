"""score stage, in-process (the Ray path runs in test_pipeline_generate_score_filter.py)."""
import math

import pytest

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task
from rlhf_core import store
from rlhf_core.rollout.rewards import RewardError
from stages import score
from stages.common import ConfigError, load_config

RESPONSES = [" great good .", " bad awful", " the tea was nice", " broken ."]


@pytest.fixture
def samples_uri(s3_root):
    rows = [{"prompt": "Review of the tea:", "response": r, "sample_index": i, "prompt_tokens": 5,
             "response_tokens": 3, "finish_reason": "stop", "logprob": -1.0, "label": "L"}
            for i, r in enumerate(RESPONSES)]
    w = store.ArtifactWriter(f"{s3_root}/samples", "generate", {"t": 1})
    w.begin()
    w.write_table("samples.parquet", data.to_table(rows, "samples"))
    return w.commit().uri


def test_reward_model_scores_metrics_and_rerun(tiny, samples_uri, s3_root):
    cfg = score.Config(samples_uri=samples_uri, reward_model_uri=tiny.reward_uri, output_uri=f"{s3_root}/scored",
                       num_engines=0)
    m = score.run(cfg)
    rows = store.read_table(cfg.output_uri, "score").to_pylist()
    rw = [r["reward"] for r in rows]
    assert [r["response"] for r in rows] == RESPONSES and all(r["label"] == "L" for r in rows)
    mean = sum(rw) / 4
    assert m.metrics["reward_mean"] == pytest.approx(mean)
    assert m.metrics["reward_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in rw) / 4))
    assert (m.metrics["reward_min"], m.metrics["reward_max"]) == (min(rw), max(rw))
    assert [i["name"] for i in m.inputs] == ["samples", "reward_model"]
    again = score.run(cfg.model_copy(update={"batch_size": 1}))
    assert again.created_at == m.created_at


def test_reward_func_file_gold_rewards(samples_uri, s3_root, tmp_path):
    rf = tmp_path / "rf.py"
    rf.write_text("from rlhf_core.demo.demo_task import reward_func\n")
    m = score.run(score.Config(samples_uri=samples_uri, reward_func_path=str(rf), output_uri=f"{s3_root}/g"))
    rows = store.read_table(m.uri).to_pylist()
    assert [r["reward"] for r in rows] == pytest.approx([demo_task.gold_reward(r) for r in RESPONSES])
    assert m.inputs[1]["name"] == "reward_func"


def test_nan_rewards_name_rows_and_commit_nothing(samples_uri, s3_root, tmp_path):
    rf = tmp_path / "rf.py"
    rf.write_text("def reward_func(q, p, l):\n    return [0.0, float('nan'), 1.0, float('-inf')]\n")
    cfg = score.Config(samples_uri=samples_uri, reward_func_path=str(rf), output_uri=f"{s3_root}/nan")
    with pytest.raises(RewardError, match=r"2 non-finite reward\(s\) \(NaN/inf\) at rows \[1, 3\]"):
        score.run(cfg)
    assert not store.committed_any(cfg.output_uri)


def test_policy_is_not_a_reward_model(tiny, samples_uri, s3_root):
    cfg = score.Config(samples_uri=samples_uri, reward_model_uri=tiny.policy_uri, output_uri=f"{s3_root}/p")
    with pytest.raises(RewardError, match="is not a reward model"):
        score.run(cfg)
    assert not store.committed_any(cfg.output_uri)


def test_unreachable_reward_server_names_url(samples_uri, s3_root):
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}/get_reward"
    cfg = score.Config(samples_uri=samples_uri, remote_rm_url=url, retries=1, output_uri=f"{s3_root}/r")
    with pytest.raises(RewardError, match=f"remote reward server {url} unreachable after 1 attempts"):
        score.run(cfg)
    assert not store.committed_any(cfg.output_uri)


def test_exactly_one_reward_source():
    with pytest.raises(ConfigError, match="set exactly one of reward_model_uri, reward_func_path, remote_rm_url"):
        load_config(score.Config, overrides=["samples_uri=s", "output_uri=o", "reward_func_path=a.py",
                                             "remote_rm_url=http://x"])
