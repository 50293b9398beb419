"""The promotion gate and scheduled retraining (issue 26 item 3), on the moto S3 endpoint with Prefect's local
API: three nights of the `iterative-dpo/nightly` deployment's parameters run in-process (each from the demo's
SFT policy and reward model, one iteration), the second made worse by a reversed reward; and the bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows import promotion
from rlhf_core.demo import demo_task
from rlhf_core import store
from stages.common import ConfigError
from tests.flows.flowkit import manifests

ROOT = Path(__file__).resolve().parents[2]


def nightly(**over) -> dict:
    """The iterative-dpo/nightly deployment's parameters (deployments/prefect.yaml), with `over` on top."""
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    d = next(d for d in spec["deployments"] if d["name"] == "nightly" and d["entrypoint"].endswith(":iterative_dpo"))
    return {**d["parameters"]["params"], **over}


def _read(uri: str) -> dict:
    fs, path = store.filesystem(uri)
    return json.loads(fs.cat_file(path))


def _inputs(m: store.Manifest) -> dict[str, str]:
    return {i["name"]: i["uri"] for i in m.inputs}


def _card(key: str, flow_run_id: str) -> str:
    """The markdown of flow run `flow_run_id`'s artifact `key`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                                                     flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert len(found) == 1, found  # one card per run, updated in place
    return found[0].data


@pytest.mark.shared_ray  # four nights, each with a generate stage on Ray: one Ray for them
def test_a_worse_night_is_not_promoted_and_the_next_night_starts_from_the_promoted_policy(demo_run, s3_root, tmp_path):
    """Night 1 (the demo's reward model) promotes its iteration; night 2 starts from it, trains on a reversed reward,
    loses gold reward and is not promoted: its pointer still names night 1's policy and says why. Night 3 starts
    from night 1's policy too. A rerun of night 2, after another run moved the lineage on, redoes nothing, reaches
    the same decisions, leaves the lineage's pointer where it is, and with stop_when_not_promoted (and one more
    iteration asked for) stops after iteration 1."""
    from flows.iterative_dpo import Params, iterative_dpo

    data = dict(demo=False, root=s3_root, pretrain_uri=demo_run.sft, prompt_data=f"{demo_run.inputs}/prompts.jsonl",
                eval_prompt_data=f"{demo_run.inputs}/eval_prompts.jsonl", gold_reward_file=demo_task.__file__,
                sft={}, train_rm={}, iterations=1)
    lineage = promotion.lineage_uri(s3_root, nightly()["lineage"])

    first = iterative_dpo(Params(**nightly(**data, run_name="night-1", reward_uri=demo_run.reward)))
    promoted = f"{s3_root}/night-1/iter-1/dpo"
    gold1 = [r["gold_reward"] for r in first["iterations"]]
    assert [d["promoted"] for d in first["promotion"]["decisions"]] == [True, True], (gold1, first["promotion"])
    assert _read(lineage)["promoted"]["policy_uri"] == promoted == first["promotion"]["promoted"]["policy_uri"]

    reversed_reward = tmp_path / "reversed.py"
    reversed_reward.write_text("from rlhf_core.demo.demo_task import reward_func as gold\n\n\n"
                               "def reward_func(queries, prompts, labels):\n"
                               "    return {'rewards': -gold(queries, prompts, labels)['rewards']}\n")
    worse = Params(**nightly(**data, run_name="night-2", reward_func_file=str(reversed_reward)))
    second = iterative_dpo(worse)
    m2 = manifests(f"{s3_root}/night-2")
    assert _inputs(m2["iter-1/generate"])["policy"] == promoted and _inputs(m2["iter-1/reference"])["ref"] == promoted
    assert "sft" not in m2  # the lineage's first night did the warm-up
    gold2 = [r["gold_reward"] for r in second["iterations"]]
    assert gold2[1] < gold2[0], gold2  # the reversed reward made the iteration worse
    current = _read(f"{s3_root}/night-2/current.json")
    assert current == second["promotion"]
    assert current["promoted"]["policy_uri"] == promoted and current["promoted"]["iteration"] == 0
    assert [r["promoted"] for r in second["iterations"]] == [True, False]
    assert f"gains {gold2[1] - gold2[0]:+.4f} over iteration 0's" in current["decisions"][1]["reason"]
    assert "below promote_min_gain=0" in current["decisions"][1]["reason"]
    assert _read(lineage)["promoted"]["policy_uri"] == promoted
    card = _card("promoted-iterative-dpo-nightly", second["flow_run_id"])  # the lineage's card, this run's version
    assert f"# Promoted: `{promoted}`" in card and "| 1 | no | gold_reward" in card

    third = iterative_dpo(Params(**nightly(**data, reward_uri=demo_run.reward, max_wall_time_s=1e-3)))  # run_name nightly-{scheduled}
    run3 = third["run"]
    assert run3.rsplit("/", 1)[-1].startswith("nightly-20") and "{" not in run3
    assert _read(f"{run3}/start.json") == {"lineage": "iterative-dpo-nightly", "policy_uri": promoted,
                                            "from": f"run {s3_root}/night-2 iteration 0"}
    assert third["stop_reason"].startswith("max_wall_time_s") and _inputs(manifests(run3)["iter-0/eval"])["policy"] == promoted

    # Another run moved the lineage on; rerunning night 2 resumes from its own start and leaves the pointer there.
    moved = {**_read(lineage), "run": f"{s3_root}/night-9", "promoted": {**_read(lineage)["promoted"], "policy_uri": demo_run.sft}}
    fs, path = store.filesystem(lineage)
    fs.pipe_file(path, json.dumps(moved).encode())
    again = iterative_dpo(worse.model_copy(update={"iterations": 2, "stop_when_not_promoted": True}))
    assert again["stop_reason"] == f"iteration 1 not promoted ({current['decisions'][1]['reason']}): stop_when_not_promoted"
    assert {k: (m.fingerprint, m.created_at) for k, m in manifests(f"{s3_root}/night-2").items()} == \
        {k: (m.fingerprint, m.created_at) for k, m in m2.items()}
    assert again["promotion"]["decisions"] == second["promotion"]["decisions"]
    assert _read(lineage) == moved and "moved on to" in again["promotion"]["lineage_note"]


@pytest.mark.parametrize("over, error", [
    ({"promote_min_gain": 0.0, "eval_prompt_data": None}, "promote_min_gain compares evals on held-out prompts, but eval_prompt_data is not set"),
    ({"promote_min_gain": 0.0, "gold_reward_file": None, "promote_metric": "gold_reward"},
     "promote_metric=gold_reward, but the loop computes no gold reward"),
    ({"promote_min_gain": 0.0, "reward_uri": None, "reward_func_file": demo_task.__file__, "promote_metric": "rm_reward"},
     "promote_metric=rm_reward, but the loop computes no RM reward"),
    ({"promote_max_kl": 1.0, "lineage": "nightly"}, "promote_max_kl, lineage apply to the promotion gate, which is off"),
])
def test_a_gate_the_loop_cannot_decide_is_refused_before_any_work(tmp_path, over, error):
    from flows.iterative_dpo import Params, iterative_dpo

    params = dict(root=str(tmp_path), run_name="refused", pretrain_uri=str(tmp_path / "policy"), reward_uri=str(tmp_path / "rm"),
                  prompt_data=str(tmp_path / "p.jsonl"), eval_prompt_data=str(tmp_path / "e.jsonl"),
                  gold_reward_file=demo_task.__file__)
    with pytest.raises(ConfigError, match=error):
        iterative_dpo.fn(Params(**{**params, **over}))
    assert not (tmp_path / "refused").exists()  # nothing written, not even the run lock


def test_an_unknown_promotion_metric_is_refused_naming_the_field():
    from pydantic import ValidationError

    from flows.ppo import Params

    with pytest.raises(ValidationError, match="promote_metric"):
        Params(promote_min_gain=0.0, promote_metric="win_rate")


def test_scheduled_run_name_is_the_flow_runs_scheduled_start(prefect_harness):
    """`{scheduled}` becomes the flow run's scheduled start (UTC, to the minute): the name Prefect gives the flow
    run and the folder it writes are the same."""
    import datetime as dt

    from prefect import flow
    from prefect.runtime import flow_run

    from flows.calls import scheduled_name

    @flow(flow_run_name=lambda: scheduled_name("nightly-{scheduled}"))
    def named() -> tuple[str, str, dt.datetime]:
        return flow_run.name, scheduled_name("nightly-{scheduled}"), flow_run.scheduled_start_time

    name, folder, when = named()
    assert name == folder == "nightly-" + when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H%MZ")


def test_a_lineage_pointer_naming_a_changed_policy_is_refused_before_any_work(demo_run, s3_root):
    """The policy a lineage promoted was since re-committed with other settings (its fingerprint differs): the
    next run of the lineage is refused naming both fingerprints; it records no start and commits nothing."""
    from flows.iterative_dpo import Params, iterative_dpo

    fs, path = store.filesystem(promotion.lineage_uri(s3_root, "moved"))
    fs.pipe_file(path, json.dumps({"run": f"{s3_root}/night-1", "promoted": {
        "iteration": 1, "policy_uri": demo_run.sft, "policy_fingerprint": "0" * 20}}).encode())
    params = nightly(demo=False, root=s3_root, run_name="night-2", lineage="moved", pretrain_uri=demo_run.sft,
                     reward_uri=demo_run.reward, prompt_data=f"{demo_run.inputs}/prompts.jsonl",
                     eval_prompt_data=f"{demo_run.inputs}/eval_prompts.jsonl", gold_reward_file=demo_task.__file__,
                     sft={}, train_rm={})
    fingerprint = store.read_manifest(demo_run.sft).fingerprint
    with pytest.raises(ConfigError, match=f"promoted {demo_run.sft} with fingerprint 0{{20}}, but it now holds {fingerprint}"):
        iterative_dpo(Params(**params))
    assert manifests(f"{s3_root}/night-2") == {} and not fs.exists(f"{s3_root}/night-2/start.json")
