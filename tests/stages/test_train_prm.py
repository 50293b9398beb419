"""train_prm + PRM scoring: a process reward model learns the demo's step labels (held-out step accuracy
from ~0.5 untrained to > 0.9, measured through the score stage), the score stage recognises a PRM by its
config.json and writes per-step rewards with their aggregate, and bad PRM data, tokens and samples are
refused by name with nothing committed."""
import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task, tiny as tiny_mod
from rlhf_core import store
from rlhf_core.rollout.rewards import RewardError, RewardSpec, compute_rewards
from stages import score, train_prm
from stages.common import ConfigError

TOKENS = (demo_task.PLACEHOLDER, *demo_task.REWARD_TOKENS)


@pytest.fixture
def prm_base(prm):
    """The demo's tiny tokenizer with the placeholder and reward tokens added, and a random tiny causal LM."""
    return prm.base


@pytest.fixture(scope="module")
def fresh_base(tmp_path_factory):
    """prm_base built here (the same tokenizer and seed) for the tests that train nothing: no PRM is trained for them."""
    root = tmp_path_factory.mktemp("prm-base")
    tok = tiny_mod.build_tokenizer(root / "tok", demo_task.corpus(0), added_tokens=TOKENS)
    return tiny_mod.build_model(root / "base", tok, "policy", seed=0)


@pytest.fixture
def trained(prm):
    """train_prm on 384 step-labelled rows (2 epochs) from prm_base: tests/conftest.py's `prm`, trained once per run."""
    return prm.manifest, prm.dir


def held_out_samples(root) -> tuple[str, list[dict]]:
    """64 held-out step-labelled rows as a committed samples artifact (prompt, response = the steps)."""
    rows = demo_task.step_rows(64, seed=0, held_out=True)
    uri = str(root / "held-out-samples")
    w = store.ArtifactWriter(uri, "data", {"n": 64})
    if not w.existing():
        w.begin()
        w.write_table("rows.parquet", data.to_table(
            [{"prompt": r["input"].split(":")[0] + ":", "response": r["input"][len(r["input"].split(":")[0]) + 1:],
              "sample_index": 0} for r in rows], "samples"))
        w.commit()
    return uri, rows


def step_accuracy(scored: list[dict], rows: list[dict]) -> float:
    hits = [(p > 0.5) == (label == "+") for s, r in zip(scored, rows) for p, label in zip(s["step_rewards"], r["value"])]
    assert len(hits) == sum(len(r["value"]) for r in rows)  # every step rated
    return sum(hits) / len(hits)


@pytest.mark.slow
def test_prm_learns_held_out_step_labels_and_scores_per_step(trained, prm_base, tmp_path):
    """48 steps (384 rows x 2 epochs) of the PRM loss; then the score stage, given the PRM as any reward model
    (no flag), rates each held-out step: accuracy > 0.9, where the same scoring of the untrained model (a
    plain causal-LM folder, named a PRM by prm_tokens) is near chance. The reward is the min of the step rewards (the default), and
    `last` / `mean` are those reductions of the same step values."""
    m, prm_dir = trained
    assert m.stage == "train_prm" and m.metrics["steps_done"] == 48 and m.metrics["rows"] == 384
    assert m.metrics["final_step_accuracy"] > 0.9 and m.metrics["final_loss"] < m.metrics["first_loss"]
    cfg = json.loads((prm_dir / "config.json").read_text())
    assert (cfg["prm_placeholder_token"], cfg["prm_reward_tokens"]) == ("ки", ["+", "-"])
    before, after = load_file(str(prm_base / "model.safetensors")), load_file(str(prm_dir / "model.safetensors"))
    assert [k for k in before if torch.equal(before[k], after[k])] == []

    samples, rows = held_out_samples(tmp_path)
    accuracy = {}
    for name, model, tokens in (("before", prm_base, list(TOKENS)), ("after", prm_dir, None)):
        out = score.run(score.Config(samples_uri=samples, reward_model_uri=str(model), output_uri=str(tmp_path / name),
                                     prm_tokens=tokens, num_engines=0))
        scored = store.read_table(out.uri).to_pylist()
        accuracy[name] = step_accuracy(scored, rows)
        assert all(r["reward"] == min(r["step_rewards"]) for r in scored) and out.metrics["prm_aggregate"] == "min"
    assert accuracy["before"] < 0.7 and accuracy["after"] > 0.9, accuracy

    steps = [r["step_rewards"] for r in scored]
    for how, fn in (("last", lambda s: s[-1]), ("mean", lambda s: sum(s) / len(s))):
        r = compute_rewards(RewardSpec(model=str(prm_dir), prm_aggregate=how), [x["prompt"] for x in scored],
                            [x["response"] for x in scored])
        assert [len(x) for x in r.step_rewards] == [len(x) for x in steps]
        assert sum(r.step_rewards, []) == pytest.approx(sum(steps, []), abs=1e-5)
        assert r.rewards == pytest.approx([fn(s) for s in steps], abs=1e-6)


@pytest.mark.slow
def test_prm_step_separator_scores_a_policys_unmarked_steps(trained, tiny, tmp_path):
    """A policy's samples hold no placeholders: with prm_step_separator="\n" the score stage marks each step
    where the training data marked it, so the held-out responses stripped of their placeholders get the step
    rewards of the marked ones; the stored responses stay unmarked. A response that already holds a
    placeholder, or the setting without a PRM, is refused; nothing is committed."""
    from rlhf_core.rollout.reward_model import mark_steps

    assert mark_steps(" great tea\n\nbad lamp \n", "\n", "ки") == " great tea ки\n\nbad lamp ки\n"
    assert mark_steps("  ", "\n", "ки") == " ки"  # a blank response is one empty step
    _, prm_dir = trained
    marked_uri, _ = held_out_samples(tmp_path)
    marked = store.read_table(marked_uri).to_pylist()
    uri = str(tmp_path / "unmarked")
    w = store.ArtifactWriter(uri, "data", {})
    w.begin()
    w.write_table("rows.parquet", data.to_table([{**r, "response": r["response"].replace(" ки", "")} for r in marked], "samples"))
    w.commit()
    out = score.run(score.Config(samples_uri=uri, reward_model_uri=str(prm_dir), prm_step_separator="\n",
                                 output_uri=str(tmp_path / "scored"), num_engines=0))
    scored = store.read_table(out.uri).to_pylist()
    want = compute_rewards(RewardSpec(model=str(prm_dir)), [r["prompt"] for r in marked], [r["response"] for r in marked])
    assert [len(r["step_rewards"]) for r in scored] == [len(x) for x in want.step_rewards]
    assert sum((r["step_rewards"] for r in scored), []) == pytest.approx(sum(want.step_rewards, []), abs=1e-5)
    assert out.metrics["prm_steps"] == sum(map(len, want.step_rewards)) > len(scored)
    assert not any("ки" in r["response"] for r in scored)
    with pytest.raises(data.DataError, match=r"held-out-samples row 0: key 'response' already holds the step placeholder"):
        score.run(score.Config(samples_uri=marked_uri, reward_model_uri=str(prm_dir), prm_step_separator="\n",
                               output_uri=str(tmp_path / "s"), num_engines=0))
    with pytest.raises(ConfigError, match=r"prm_step_separator=.\\n. applies to a process reward model"):
        score.run(score.Config(samples_uri=uri, reward_model_uri=tiny.reward_uri, prm_step_separator="\n",
                               output_uri=str(tmp_path / "s"), num_engines=0))
    assert not store.committed_any(str(tmp_path / "s"))


@pytest.mark.slow
def test_score_refuses_samples_without_steps_and_aggregate_without_prm(trained, tiny, tmp_path):
    _, prm_dir = trained
    uri = str(tmp_path / "plain-samples")
    w = store.ArtifactWriter(uri, "data", {})
    w.begin()
    w.write_table("rows.parquet", data.to_table([{"prompt": "Review of the tea:", "response": " great ки", "sample_index": 0},
                                                 {"prompt": "Review of the tea:", "response": " great tea .", "sample_index": 1}],
                                                "samples"))
    w.commit()
    with pytest.raises(data.DataError, match=r"plain-samples row 1: key 'response' has no step placeholder 'ки'"):
        score.run(score.Config(samples_uri=uri, reward_model_uri=str(prm_dir), output_uri=str(tmp_path / "s"), num_engines=0))
    with pytest.raises(ConfigError, match=r"prm_aggregate='last' applies to a process reward model"):
        score.run(score.Config(samples_uri=uri, reward_model_uri=tiny.reward_uri, prm_aggregate="last",
                               output_uri=str(tmp_path / "s"), num_engines=0))
    with pytest.raises(RewardError, match=r"prm_tokens name a process reward model, a causal LM; .*ForSequenceClassification"):
        score.run(score.Config(samples_uri=uri, reward_model_uri=tiny.reward_uri, prm_tokens=list(TOKENS),
                               output_uri=str(tmp_path / "s"), num_engines=0))
    with pytest.raises(RewardError, match=r"process reward model with tokens \['ки', '\+', '-'\], not prm_tokens"):
        score.run(score.Config(samples_uri=uri, reward_model_uri=str(prm_dir), prm_tokens=["ки", "-", "+"],
                               output_uri=str(tmp_path / "s"), num_engines=0))
    assert not store.committed_any(str(tmp_path / "s"))


def test_bad_prm_data_and_tokens_refused_by_name(fresh_base, tiny, tmp_path, capsys):
    """A row without the placeholder (file, row, key), a label count that differs from the placeholders, a
    label outside the reward tokens; a reward token or a placeholder that is not one token of the tokenizer.
    Nothing is committed."""
    good = demo_task.step_rows(4, seed=1)
    cases = {
        "no_placeholder": ([good[0], {"input": "Review of the tea: great tea", "value": ["+"]}],
                           r"no_placeholder.jsonl row 1: key 'input' has no placeholder token 'ки'"),
        "count": ([{"input": "Review: great ки\nbad ки", "value": ["+"]}],
                  r"count.jsonl row 0: 1 step labels in 'value' but 2 placeholder tokens"),
        "label": ([{"input": "Review: great ки", "value": ["good"]}],
                  r"label.jsonl row 0: key 'value' step 0 is 'good': a step label is one of the reward_tokens"),
    }
    out = tmp_path / "out"
    cfg = dict(base_uri=str(fresh_base), output_uri=str(out), train_batch_size=2, micro_train_batch_size=2, max_len=64)
    for name, (rows, msg) in cases.items():
        f = tmp_path / f"{name}.jsonl"
        f.write_text("\n".join(json.dumps(r) for r in rows))
        with pytest.raises(data.DataError, match=msg):
            train_prm.run(train_prm.Config(**cfg, dataset_uri=str(f)))
    art = str(tmp_path / "steps-artifact")  # a committed artifact's rows are checked the same way
    w = store.ArtifactWriter(art, "data", {})
    w.begin()
    w.write_table("rows.parquet", data.to_table([{"input": r["input"]} for r in good], "sft"))
    w.commit()
    with pytest.raises(data.DataError, match=r"steps-artifact row 0: key 'value' must be a non-empty list of step labels"):
        train_prm.run(train_prm.Config(**cfg, dataset_uri=art))
    from flows import cli  # the same refusal from the command line: one error line, exit 2

    assert cli.main(["stage", "train_prm", f"base_uri={fresh_base}", f"dataset_uri={tmp_path / 'no_placeholder.jsonl'}",
                     f"output_uri={out}", "train_batch_size=2", "micro_train_batch_size=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhf-flows: error: ") and "no_placeholder.jsonl row 1: key 'input' has no placeholder" in err
    f = tmp_path / "good.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in good))
    with pytest.raises(ConfigError, match=r"reward token 'good step' is \d+ tokens in this tokenizer .* not one"):
        train_prm.run(train_prm.Config(**cfg, dataset_uri=str(f), reward_tokens=["good step", "-"]))
    with pytest.raises(ConfigError, match=r"placeholder_token 'ки' is \d+ tokens in this tokenizer"):  # the plain tiny model
        train_prm.run(train_prm.Config(**{**cfg, "base_uri": tiny.policy_uri}, dataset_uri=str(f)))
    assert not store.committed_any(str(out))


@pytest.mark.slow
def test_flow_config_with_a_prm_reward_validates(trained):
    """A loop whose reward_uri is a PRM takes score.prm_aggregate; the setting without a reward model is refused."""
    from flows import common, iterative_dpo
    from stages.common import load_config

    _, prm_dir = trained
    p = load_config(iterative_dpo.Params, None, {"root": "/tmp/x", "pretrain_uri": "p", "prompt_data": "d",
                                                 "reward_uri": str(prm_dir), "score": {"prm_aggregate": "last"}})
    common.validate(p, "iterative_dpo", iterative_dpo.checks(p))
    with pytest.raises(ConfigError, match=r"score.*prm_aggregate"):
        p = load_config(iterative_dpo.Params, None, {"root": "/tmp/x", "pretrain_uri": "p", "prompt_data": "d",
                                                     "reward_func_file": "r.py", "score": {"prm_aggregate": "last"}})
        common.validate(p, "iterative_dpo", iterative_dpo.checks(p))


@pytest.mark.slow
def test_eval_scores_with_a_prm_as_score_does(trained, prm_base, tiny, tmp_path):
    """eval with the PRM as reward model (prompts templated to end in one step, so every text has a
    placeholder): each sample's rm_reward is the `last` aggregate of its step rewards, as compute_rewards gives
    it; prm_aggregate with a reward model that is not a PRM is refused before sampling."""
    from stages import eval as eval_stage, prepare

    _, prm_dir = trained
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"input": f"Review of the {t}:"}) + "\n" for t in ("tea", "lamp")))
    prompts = prepare.run(prepare.Config(kind="prompts", data=str(src), output_uri=str(tmp_path / "prompts"))).uri
    cfg = dict(policy_uri=str(prm_base), prompts_uri=prompts, prompt_template="{prompt} great so ки\n",
               samples_per_prompt=2, max_new_tokens=6, prm_aggregate="last")
    m = eval_stage.run(eval_stage.Config(**cfg, reward_model_uri=str(prm_dir), output_uri=str(tmp_path / "eval")))
    rows = store.read_table(m.uri).to_pylist()
    again = compute_rewards(RewardSpec(model=str(prm_dir), prm_aggregate="last"), [r["prompt"] for r in rows],
                            [r["response"] for r in rows])
    assert [r["rm_reward"] for r in rows] == pytest.approx([s[-1] for s in again.step_rewards], abs=1e-6)
    assert m.metrics["rm_reward"] == pytest.approx(sum(again.rewards) / len(rows), abs=1e-6)
    with pytest.raises(ConfigError, match=r"eval: prm_aggregate / prm_tokens / prm_step_separator apply to a process reward"):
        eval_stage.run(eval_stage.Config(**cfg, reward_model_uri=tiny.reward_uri, output_uri=str(tmp_path / "e2")))
    assert not store.committed_any(str(tmp_path / "e2"))
