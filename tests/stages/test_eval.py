"""eval: reward of a policy on held-out prompts, KL(policy || reference) per token and response length."""
import json

import pytest

from rlhf_core.demo import demo_task
from rlhf_core.inputs import model_inputs
from rlhf_core import store
from stages import eval as eval_stage, prepare


@pytest.fixture
def eval_prompts(tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"input": f"Review of the {t}:"}) + "\n" for t in ("tea", "lamp", "book")))
    return prepare.run(prepare.Config(kind="prompts", data=str(src), output_uri=str(tmp_path / "prompts"))).uri


def _eval(tiny, prompts, out, reference):
    return eval_stage.run(eval_stage.Config(policy_uri=tiny.policy_uri, prompts_uri=prompts, reference_uri=reference,
                                            gold_reward_file=demo_task.__file__, samples_per_prompt=4, max_new_tokens=8,
                                            output_uri=str(out)))


def test_kl_is_zero_against_itself_and_positive_against_another_model(tiny, eval_prompts, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    same = _eval(tiny, eval_prompts, tmp_path / "same", tiny.policy_uri)
    assert same.metrics["kl"] == 0.0
    rows = store.read_table(same.uri).to_pylist()
    assert len(rows) == 12 and all(r["kl"] == 0.0 for r in rows)
    assert same.metrics["response_tokens_mean"] == pytest.approx(sum(r["response_tokens"] for r in rows) / 12)

    policy_dir = model_inputs.fetch_model(tiny.policy_uri)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight), alpha=0.5)
    model.save_pretrained(tmp_path / "other")  # a plain HF folder (model + tokenizer) as the reference
    AutoTokenizer.from_pretrained(str(policy_dir)).save_pretrained(tmp_path / "other")
    other = _eval(tiny, eval_prompts, tmp_path / "other-eval", str(tmp_path / "other"))
    assert other.metrics["kl"] > 0.05
    assert {i["name"] for i in other.inputs} >= {"policy", "prompts", "reference"}
