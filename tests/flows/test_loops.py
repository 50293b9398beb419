"""The three loop flows end to end on the toy-review task, every artifact on the moto S3 endpoint: gold
reward rises, reruns skip, changes rerun only what they affect."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.demo import demo_task
from rlhf_core import store
from tests.flows.flowkit import demo_params, manifests

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]  # its loops' generate stages share one Ray

DEMO_CSFT = Path(__file__).resolve().parents[2] / "configs" / "demo_csft.yaml"


def test_iterative_dpo_raises_gold_reward_on_s3(demo_run):
    rows = demo_run.report["iterations"]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    gold = [r["gold_reward"] for r in rows]
    assert gold[0] < gold[1] < gold[2], gold
    # `rlhf-flows demo` at 12c27fa (3 iterations): -0.001, 0.043, 0.307, 0.409; with dpo's default cosine (its 8-step
    # runs end at 0.13x the peak lr) it reached 0.171 at iteration 2
    assert gold[2] - gold[0] > 0.25, gold
    assert demo_run.report["stop_reason"] == "completed all iterations"
    m = demo_run.manifests
    for k in (1, 2):
        for stage in ("generate", "score", "pairs", "reference", "dpo", "eval"):
            assert m[f"iter-{k}/{stage}"].stage in (stage, "filter")
        assert rows[k]["kept"] > 0 and rows[k]["dpo_steps"] > 0
    # Lineage: iteration 2 generated with, and trained, the policy iteration 1 made; the reference stays
    # the initial (SFT) policy.
    assert {i["name"]: i["uri"] for i in m["iter-2/generate"].inputs}["policy"] == f"{demo_run.run}/iter-1/dpo"
    assert {i["name"]: i["uri"] for i in m["iter-2/reference"].inputs}["ref"] == demo_run.sft
    fs, path = store.filesystem(demo_run.run)
    saved = json.loads(fs.cat_file(f"{path}/report.json"))
    assert saved["iterations"][2]["gold_reward"] == pytest.approx(gold[2])
    assert fs.cat_file(f"{path}/reward.png")[:4] == b"\x89PNG"
    assert not fs.exists(f"{path}/_LOCK.json")
    from flows.cli import show

    text = show(demo_run.run)  # `rlhf-flows show RUN`: iterations, then every artifact with its inputs
    assert text.startswith(f"run {demo_run.run}: iterative-dpo — 2 iterations, stop reason: completed all iterations")
    assert "iter-2/dpo" in text and "iter-1/dpo" in text.split("iter-2/dpo", 1)[1].splitlines()[0]


def test_iterative_dpo_publishes_prefect_artifacts(demo_run):
    """The demo's artifacts and log lines as Prefect's API held them right after its flow run (tests/flows/conftest.py
    reads them there: the API is the building worker's)."""
    seen = demo_run.prefect["artifacts"]
    table, report, progress = seen["iterative-dpo-iterations"], seen["iterative-dpo-report"], seen["iterative-dpo-progress"]
    assert progress and float(max(progress, key=lambda a: a["created"])["data"]) == 100.0
    mine = [a for a in table if a["flow_run_id"] == demo_run.report["flow_run_id"]]
    latest = max(mine, key=lambda a: a["created"])  # one version per publish: the last holds every iteration
    rows = json.loads(latest["data"]) if isinstance(latest["data"], str) else latest["data"]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and all("gold_reward" in r for r in rows)
    assert f"{demo_run.run}/iter-2/dpo" in max((a for a in report if a["flow_run_id"] == demo_run.report["flow_run_id"]),
                                               key=lambda a: a["created"])["data"]
    # What a user watches first; timings last. The plot is inline (the UI cannot open a file:// or s3:// URL).
    assert list(rows[0])[:5] == ["iteration", "gold_reward", "rm_reward", "kl", "response_length"]
    assert all(c.endswith("_s") for c in list(rows[0])[-3:]) and rows[0]["kl"] == 0.0 and rows[2]["kl"] > 0
    md = max(seen["iterative-dpo-plot"], key=lambda a: a["created"])["data"]
    assert md.startswith("![reward, KL and length per iteration](data:image/png;base64,iVBORw0KGgo")
    import re

    logs = demo_run.prefect["logs"]
    steps = [m for m in logs if re.match(r"step \d+/\d+ loss=\S+ .*tokens/s=\d+ eta=", m)]
    assert len(steps) >= 4, logs[:40]  # sft, train_rm and both dpo jobs log their steps


def test_rerun_resumes_without_redoing_anything(demo_run):
    from flows.iterative_dpo import iterative_dpo

    report = iterative_dpo(demo_run.params)
    after = manifests(demo_run.run)
    assert {k: (m.fingerprint, m.created_at) for k, m in after.items()} == \
        {k: (m.fingerprint, m.created_at) for k, m in demo_run.manifests.items()}
    assert [r["gold_reward"] for r in report["iterations"]] == [r["gold_reward"] for r in demo_run.report["iterations"]]


def test_changing_beta_reruns_only_dpo_and_what_follows(demo_run):
    """It changes the demo run's iteration 1: it runs after the other tests of the demo run's own stages (one group,
    tests/conftest.py DEMO_ITSELF); the tests elsewhere read the run's inputs, SFT policy and reward model."""
    from flows.iterative_dpo import iterative_dpo

    params = demo_run.params.model_copy(update={"iterations": 1, "dpo": demo_run.params.dpo.model_copy(update={"beta": 0.2})})
    iterative_dpo(params)
    after, before = manifests(demo_run.run), demo_run.manifests
    for same in ("sft", "reward_model", "prompts", "iter-1/generate", "iter-1/score", "iter-1/pairs", "iter-1/reference"):
        assert after[same].created_at == before[same].created_at, same
    for changed in ("iter-1/dpo", "iter-1/eval"):
        assert after[changed].fingerprint != before[changed].fingerprint, changed
    assert after["iter-1/dpo"].config["beta"] == 0.2


def _loop_params(demo_run, root, **over) -> dict:
    params = demo_params(demo=False, root=root, pretrain_uri=demo_run.sft, reward_uri=demo_run.reward,
                         prompt_data=f"{demo_run.inputs}/prompts.jsonl", eval_prompt_data=f"{demo_run.inputs}/eval_prompts.jsonl",
                         gold_reward_file=demo_task.__file__, sft={}, train_rm={}, **over)
    for dpo_only in ("dpo", "reference"):
        params.pop(dpo_only)
    return params


def test_raft_raises_gold_reward_on_s3(demo_run, s3_root):
    from flows.raft import Params, raft

    sft_loop = {"learning_rate": 5.0e-4, "max_epochs": 2, "micro_train_batch_size": 16, "train_batch_size": 16, "max_len": 48}
    report = raft(Params(**_loop_params(demo_run, s3_root, run_name="raft", iterations=2, sft_loop=sft_loop)))
    gold = [r["gold_reward"] for r in report["iterations"]]
    assert gold[0] < gold[1] < gold[2], gold
    best = store.read_table(f"{s3_root}/raft/iter-1/best_of_n").to_pylist()
    prompts = [r["input"] for r in best]
    assert len(prompts) == len(set(prompts)) == 64  # rs keeps exactly one response per prompt


def test_raft_with_a_process_reward_model_raises_gold_reward(demo_run, prm, s3_root):
    """A process reward model (train_prm on the demo's step-labelled reviews) as the loop's reward_uri. The
    policy's samples hold no step placeholders: score.prm_step_separator=" " makes every word a step, and
    prm_aggregate=mean rates a review by the share of its words the PRM calls good. RAFT's best of 4 by that
    reward raises the held-out gold reward and the PRM's own eval reward; the scored samples carry one step
    reward per word and their mean as the reward, the samples' text unmarked."""
    from flows.raft import Params, raft

    sft_loop = {"learning_rate": 5.0e-4, "max_epochs": 2, "micro_train_batch_size": 16, "train_batch_size": 16, "max_len": 48}
    params = _loop_params(demo_run, s3_root, run_name="raft-prm", iterations=2, sft_loop=sft_loop,
                          score={"prm_step_separator": " ", "prm_aggregate": "mean"})
    report = raft(Params(**{**params, "reward_uri": prm.uri}))
    rows = report["iterations"]
    gold, prm_reward = [r["gold_reward"] for r in rows], [r["rm_reward"] for r in rows]
    # Measured (2026-11-24, the same loop from the CLI): gold -0.003, 0.044, 0.114; PRM mean 0.332, 0.393, 0.467
    assert gold[2] > gold[0] + 0.05 and prm_reward[2] > prm_reward[0] + 0.05, (gold, prm_reward)
    scored = store.read_table(f"{s3_root}/raft-prm/iter-1/score").to_pylist()
    assert all(len(r["step_rewards"]) == len(r["response"].split()) or not r["response"].strip() for r in scored)
    assert all(r["reward"] == pytest.approx(sum(r["step_rewards"]) / len(r["step_rewards"])) for r in scored)
    assert not any(demo_task.PLACEHOLDER in r["response"] for r in scored)
    assert store.read_manifest(f"{s3_root}/raft-prm/iter-1/eval").config["prm_step_separator"] == " "


def test_conditional_sft_learns_to_follow_its_condition_on_s3(demo_run, s3_root):
    """configs/demo_csft.yaml's loop, as the README runs it, from the demo's SFT policy and reward model,
    scored through `rlhf-flows serve-rm` (reward_url: the flows' remote reward path): every sample is trained
    on under its rank bucket in the batch, iterations 2.. sample under the best bucket (bootstrap), and the
    policy is evaluated under the best bucket (gold_reward) and the worst (gold_reward_low). Gold under the
    best bucket rises over 2 iterations (the README's 3rd adds 0.03: left to the CLI run, ~4 min of CI) and beats
    the worst bucket by a clear margin (README "Conditional SFT")."""
    import threading

    import yaml

    from flows.conditional_sft import Params, conditional_sft
    from rlhf_core.rollout.serve_rm import make_server
    from tests.flows.flowkit import DEMO

    csft = yaml.safe_load(DEMO_CSFT.read_text())
    server = make_server(demo_run.reward, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    over = {k: csft[k] for k in ("target_reward", "low_target_reward", "generate", "filter", "eval", "sft_loop")}
    assert csft["sft"] == DEMO["sft"] and csft["train_rm"] == DEMO["train_rm"]  # the demo run's policy and RM are csft's
    try:
        report = conditional_sft(Params(**{**_loop_params(demo_run, s3_root, run_name="csft", iterations=2, **over),
                                           "reward_uri": None, "reward_url": url}))
    finally:
        server.shutdown()
        server.server_close()
    rows = report["iterations"]
    assert report["stop_reason"] == "completed all iterations" and len(rows) == 3
    high, low = [r["gold_reward"] for r in rows], [r.get("gold_reward_low") for r in rows]
    # Measured (2026-11-23, `rlhf-flows run conditional-sft --config configs/demo_csft.yaml`): high -0.003,
    # 0.253, 0.443, 0.473; low -0.309, -0.084, 0.223 (iteration 0: the SFT policy, no condition). Trained with
    # one constant tag instead (a plain loop on iteration 1's rows, 192 steps), best and worst gave
    # 0.010 / 0.005: these margins fail when the condition is ignored.
    assert high[0] + 0.1 < high[1] and high[1] + 0.1 < high[2], high
    assert high[1] - low[1] > 0.4 and high[2] - low[2] > 0.4, (high, low)
    assert rows[2]["rm_reward"] > rows[2]["rm_reward_low"]
    assert store.read_manifest(f"{s3_root}/csft/iter-1/score").config["remote_rm_url"] == url
    trained = store.read_table(f"{s3_root}/csft/iter-1/csft").to_pylist()
    tags = [r["input"].rsplit(" <rm_score>: ", 1)[1] for r in trained]
    assert sorted(set(tags)) == ["A ", "B ", "C ", "D ", "E "]  # filter.bucket_labels, worst (E) to best (A)
    assert rows[1]["kept"] == len(trained) > 0.9 * rows[1]["samples"]  # every sample (but empty ones), not the best only
    by_tag = {t: [r["reward"] for r, tt in zip(trained, tags) if tt == t] for t in set(tags)}
    assert max(map(len, by_tag.values())) - min(map(len, by_tag.values())) <= 2  # equal-count buckets
    assert {t: set(v) for t, v in by_tag.items()} == {"E ": {0.0}, "D ": {1.0}, "C ": {2.0}, "B ": {3.0}, "A ": {4.0}}
    # bootstrap: iteration 2 samples under the best condition (iteration 1's SFT policy knows none), keeps the
    # plain prompts, and so trains on better samples (RM reward of the trained rows measured 0.001 -> 0.676)
    gen = [store.read_manifest(f"{s3_root}/csft/iter-{k}/generate").config["condition_template"] for k in (1, 2)]
    assert gen == [None, "{prompt} <rm_score>: A "], gen
    assert not any("<rm_score>" in r["prompt"] for r in store.read_table(f"{s3_root}/csft/iter-2/generate").to_pylist())
    assert rows[2]["train_rm_reward"] > rows[1]["train_rm_reward"] + 0.2, rows
    assert all(r["prompt"].endswith(" <rm_score>: A ") for r in store.read_table(f"{s3_root}/csft/iter-1/eval").to_pylist())
    assert all(r["prompt"].endswith(" <rm_score>: E ") for r in store.read_table(f"{s3_root}/csft/iter-1/eval_low").to_pylist())


def test_iterative_loop_with_kto_raises_gold_reward_on_s3(demo_run, s3_root):
    """trainer=kto: the pairs filter's output trains through the kto stage (no separate reference stage);
    one iteration from the demo's SFT policy raises the held-out gold reward. The dpo settings of a
    trainer=kto run would be ignored: refused before any work."""
    from flows.iterative_dpo import Params, checks, iterative_dpo
    from stages.common import ConfigError

    # lr 2.5e-4: at 5e-4 the policy drifted to KL 1.7 and 2.9-token responses (gold -0.013) from the demo's SFT
    # policy after issue 24's schedule change; measured here: gold -0.0008 -> 0.0138, KL 0.75
    kto_cfg = {"beta": 0.1, "learning_rate": 2.5e-4, "lr_warmup_ratio": 0.0, "max_epochs": 2, "micro_train_batch_size": 16,
               "train_batch_size": 16, "max_len": 48}
    params = _loop_params(demo_run, s3_root, run_name="kto", iterations=1, trainer="kto", kto=kto_cfg)
    with pytest.raises(ConfigError, match="trainer=kto does not read dpo settings"):
        checks(Params(**{**params, "dpo": {"beta": 0.2}}))
    report = iterative_dpo(Params(**params))
    gold = [r["gold_reward"] for r in report["iterations"]]
    assert report["stop_reason"] == "completed all iterations" and gold[0] < gold[1], gold
    m = store.read_manifest(f"{s3_root}/kto/iter-1/kto")
    assert m.stage == "kto" and m.metrics["final_reward_gap"] > 0 and report["iterations"][1]["kto_reward_gap"] > 0
    assert not store.committed_any(f"{s3_root}/kto/iter-1/reference")


def test_raft_with_trainer_kd_distills_from_the_teacher_each_iteration(demo_run, s3_root):
    """trainer=kd: RAFT's kept rows train through the kd stage, distilling from a frozen teacher (here the
    demo run's last DPO policy) mixed with the NLL by kd_coef; the iteration's policy is the kd output."""
    from flows.raft import Params, raft

    teacher = f"{demo_run.run}/iter-2/dpo"
    kd_cfg = {"teacher_uri": teacher, "kd_coef": 0.5, "learning_rate": 5.0e-4, "max_epochs": 2,
              "micro_train_batch_size": 16, "train_batch_size": 16, "max_len": 48}
    report = raft(Params(**_loop_params(demo_run, s3_root, run_name="raft-kd", iterations=1, trainer="kd", kd=kd_cfg)))
    assert report["stop_reason"] == "completed all iterations"
    run = f"{s3_root}/raft-kd"
    m = store.read_manifest(f"{run}/iter-1/kd")
    assert m.stage == "kd" and m.config["kd_coef"] == 0.5
    assert {i["name"]: i["uri"] for i in m.inputs} == {"policy": demo_run.sft, "teacher": teacher,
                                                       "dataset": f"{run}/iter-1/best_of_n"}
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] >= 1 and m.metrics["final_kl"] >= 0
    assert {i["name"]: i["uri"] for i in store.read_manifest(f"{run}/iter-1/eval").inputs}["policy"] == f"{run}/iter-1/kd"
    assert not store.committed_any(f"{run}/iter-1/sft")
