"""generate stage, hf backend in-process (the vLLM + Ray path runs in test_pipeline_generate_score_filter.py)."""
import json

import pytest

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import generate
from stages.common import ConfigError, load_config


@pytest.fixture
def prompt_file(s3_root):
    """A raw OpenRLHF-format jsonl source on S3: 10 prompts with labels."""
    uri = f"{s3_root}/raw/prompts.jsonl"
    fs, path = store.filesystem(uri)
    rows = [{"input": demo_task.prompt_for(t), "gold": f"L{i}"} for i, t in enumerate(demo_task.THINGS[:10])]
    with fs.open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    return uri, rows


def cfg_for(tiny, prompts_uri, out, **kw):
    base = dict(policy_uri=tiny.policy_uri, prompts_uri=prompts_uri, output_uri=out, backend="hf", num_engines=0,
                best_of_n=3, max_new_tokens=8, input_template="User: {}\nAssistant: ", label_key="gold", seed=1)
    return generate.Config(**{**base, **kw})


def test_hf_generate_rows_iter_slice_and_rerun_skips(tiny, prompt_file, s3_root):
    uri, raw = prompt_file
    cfg = cfg_for(tiny, uri, f"{s3_root}/samples", iter=1, rollout_batch_size=4, batch_size=2)
    m = generate.run(cfg)
    rows = store.read_table(cfg.output_uri, "generate").to_pylist()
    # iter 1 with R = 4 -> raw prompts 4..7, each 3 samples, in prompt order
    assert [r["prompt"] for r in rows[::3]] == [f"User: {r['input']}\nAssistant: " for r in raw[4:8]]
    assert [r["label"] for r in rows[::3]] == ["L4", "L5", "L6", "L7"]
    assert [r["sample_index"] for r in rows] == [0, 1, 2] * 4
    assert all(1 <= r["response_tokens"] <= 8 and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(r["logprob"] < 0 and r["prompt_tokens"] > 0 for r in rows)
    assert m.rows == 12 and m.metrics["prompts"] == 4 and m.metrics["tokens_per_s"] > 0
    assert [i["name"] for i in m.inputs] == ["policy", "prompts"]
    # rerun, also with other runtime-only settings: same manifest, no work
    again = generate.run(cfg.model_copy(update={"batch_size": 4, "num_engines": 0}))
    assert (again.created_at, again.fingerprint) == (m.created_at, m.fingerprint)
    # a sampling change is new work
    other = generate.run(cfg.model_copy(update={"seed": 2}))
    assert other.fingerprint != m.fingerprint and other.created_at != m.created_at


def test_greedy_is_deterministic_and_batch_independent(tiny, prompt_file, s3_root):
    uri, _ = prompt_file
    a = generate.run(cfg_for(tiny, uri, f"{s3_root}/a", temperature=0, best_of_n=1, max_samples=5, batch_size=5))
    b = generate.run(cfg_for(tiny, uri, f"{s3_root}/b", temperature=0, best_of_n=1, max_samples=5, batch_size=1))
    ra, rb = (store.read_table(m.uri).to_pylist() for m in (a, b))
    assert [r["response"] for r in ra] == [r["response"] for r in rb]
    assert [r["logprob"] for r in ra] == pytest.approx([r["logprob"] for r in rb], abs=1e-3)


def test_prompt_max_len_truncates_and_counts(tiny, prompt_file, s3_root):
    uri, _ = prompt_file
    m = generate.run(cfg_for(tiny, uri, f"{s3_root}/t", prompt_max_len=4, max_samples=3, best_of_n=1))
    assert m.metrics["prompts_truncated"] == 3
    assert all(r["prompt_tokens"] == 4 for r in store.read_table(m.uri).to_pylist())


def test_committed_prompts_artifact_input(tiny, s3_root):
    w = store.ArtifactWriter(f"{s3_root}/prompts", "prepare", {"x": 1})
    w.begin()
    w.write_table("prompts.parquet", data.to_table([{"prompt": "Review of the tea:", "label": None}] * 2, "prompts"))
    pm = w.commit()
    m = generate.run(cfg_for(tiny, pm.uri, f"{s3_root}/s", label_key=None, input_template=None, best_of_n=2))
    assert m.rows == 4 and m.inputs[1]["fingerprint"] == pm.fingerprint


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_max_len=4, prompt_overflow="reject"), r"prompt 0: \d+ tokens > prompt_max_len 4"),
    (dict(iter=3, rollout_batch_size=4), r"iter 3 slice \[12, 16\) of 10 prompts is empty"),
])
def test_bad_prompts_commit_nothing(tiny, prompt_file, s3_root, kw, match):
    uri, _ = prompt_file
    cfg = cfg_for(tiny, uri, f"{s3_root}/bad", **kw)
    with pytest.raises(data.DataError, match=match):
        generate.run(cfg)
    assert not store.committed_any(cfg.output_uri)


def test_empty_prompt_file(tiny, s3_root):
    uri = f"{s3_root}/empty.jsonl"
    fs, path = store.filesystem(uri)
    with fs.open(path, "w") as f:
        f.write("\n")
    with pytest.raises(data.DataError, match="no rows"):
        generate.run(cfg_for(tiny, uri, f"{s3_root}/e", label_key=None))


def test_unknown_backend_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match=r"backend: Value error, unknown backend 'tgi'"):
        load_config(generate.Config, overrides=[f"policy_uri={tiny.policy_uri}", "prompts_uri=x", "output_uri=y",
                                                "backend=tgi"])


@pytest.mark.slow
def test_condition_template_samples_under_the_condition_and_keeps_the_plain_prompt(tiny, prompt_file, s3_root):
    """SteerLM's bootstrapping (conditional-sft's `bootstrap`): greedy samples under condition_template equal
    those of prompts that carry the condition, while the samples record the plain prompt; a prompt too long
    for prompt_max_len loses plain tokens, never the condition."""
    uri, raw = prompt_file
    cond = "{prompt} <rm_score>: A "
    greedy = dict(temperature=0, best_of_n=1, max_samples=4)
    m = generate.run(cfg_for(tiny, uri, f"{s3_root}/cond", condition_template=cond, **greedy))
    literal = generate.run(cfg_for(tiny, uri, f"{s3_root}/lit", input_template="User: {}\nAssistant:  <rm_score>: A ", **greedy))
    plain = generate.run(cfg_for(tiny, uri, f"{s3_root}/plain", **greedy))
    got, want, unconditioned = (store.read_table(x.uri).to_pylist() for x in (m, literal, plain))
    assert [r["prompt"] for r in got] == [f"User: {r['input']}\nAssistant: " for r in raw[:4]]
    assert [r["response"] for r in got] == [r["response"] for r in want]
    assert [r["response"] for r in got] != [r["response"] for r in unconditioned]  # the condition changed the samples
    assert m.config["condition_template"] == cond and m.fingerprint != plain.fingerprint
    # the condition is 14 tokens in the tiny tokenizer: 20 leaves 6 for the plain prompt, 14 none
    short = generate.run(cfg_for(tiny, uri, f"{s3_root}/short", condition_template=cond, prompt_max_len=20, **greedy))
    rows = store.read_table(short.uri).to_pylist()
    assert short.metrics["prompts_truncated"] == 4 and all(r["prompt_tokens"] <= 20 for r in rows)
    assert all(f"User: {r['input']}\nAssistant: ".endswith(s["prompt"]) for r, s in zip(raw, rows))
    with pytest.raises(data.DataError, match=r"prompt 0: condition_template .* leaves no room for the prompt"):
        generate.run(cfg_for(tiny, uri, f"{s3_root}/tiny-room", condition_template=cond, prompt_max_len=14, **greedy))
    assert not store.committed_any(f"{s3_root}/tiny-room")
    with pytest.raises(ConfigError, match="condition_template 'A' has no {prompt} placeholder"):
        load_config(generate.Config, overrides=[f"policy_uri={tiny.policy_uri}", "prompts_uri=x", "output_uri=y",
                                                "condition_template=A"])


def test_max_num_seqs_bounds_the_sequences_per_forward(tiny):
    """max_num_seqs (vLLM's --max_num_seqs): hf runs at most that many sequences (prompts x best_of_n) through each
    forward; vllm.LLM is given it. 5 prompts x n 2 with max_num_seqs 4: calls of 2, 2, 1 prompts -> rows 4, 4, 2
    per forward; without it (batch_size 64) one call of 10 rows."""
    from rlhf_core.rollout.generation import EngineSpec, HFEngine, SamplingSpec, vllm_kwargs

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    params = SamplingSpec(n=2, max_new_tokens=3, seed=0)
    seen = {}
    for bound in (4, None):
        eng = HFEngine(tiny.policy_dir, EngineSpec(dtype="float32", max_num_seqs=bound))
        rows = seen[bound] = []
        eng.model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
        out = eng.generate(prompts, params)
        assert [len(o) for o in out] == [2] * 5
    assert max(seen[4]) == 4 and sorted(set(seen[4])) == [2, 4] and set(seen[None]) == {10}
    assert vllm_kwargs(EngineSpec(max_num_seqs=4), "m", "float32", False)["max_num_seqs"] == 4
    assert "max_num_seqs" not in vllm_kwargs(EngineSpec(), "m", "float32", False)
    cfg = generate.Config(policy_uri="p", prompts_uri="q", output_uri="o", max_num_seqs=4)
    assert "max_num_seqs" not in cfg.semantic()  # how it runs, not what is sampled
