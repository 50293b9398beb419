"""LoRA adapters without merged weights (`lora_merge=false`): every stage loads them (model_inputs.fetch_model merges
adapter + base), and the lora_combine stage commits the merged model. One tiny LoRA sft job (2 steps) and
one tiny LoRA reward model (2 steps) serve every test here."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.demo import demo_task
from rlhf_core.inputs import model_inputs, models
from rlhf_core import store
from stages import generate, lora_combine, sft, train_rm
from tests.stages.test_sft import FAST, sft_data, weights
from tests.stages.test_train_rm import pairs_data

LORA = dict(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_merge=False, zero_stage=0)


@pytest.fixture(scope="module")
def adapter_sft(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    m = sft.run(sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(root, 16), output_uri=str(root / "sft"),
                           **LORA, **{**FAST, "learning_rate": 1e-2}))
    return root, m


def test_adapter_only_artifact_loads_as_base_plus_scaled_BA(tiny, adapter_sft):
    root, m = adapter_sft
    files = {f["path"] for f in m.files}
    assert "adapter/adapter_model.safetensors" in files and "model.safetensors" not in files  # nothing merged at the root
    merged = model_inputs.fetch_model(m.uri)
    assert merged != model_inputs.fetch_model(m.uri, merge=False)
    base, got = weights(tiny.policy_dir), weights(merged)
    lora = load_file(str(root / "sft" / "adapter" / "adapter_model.safetensors"))
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    adapted = 0
    for k, w in base.items():
        a_key = "base_model.model." + k.replace(".weight", ".lora_A.weight")
        if a_key in lora:
            delta = scale * lora[a_key.replace("lora_A", "lora_B")] @ lora[a_key]  # (out, r) @ (r, in)
            assert delta.abs().max() > 0, k
            torch.testing.assert_close(got[k], w + delta, rtol=0, atol=1e-6)
            adapted += 1
        else:
            assert torch.equal(got[k], w), k
    assert adapted == 2 * 2  # q_proj and v_proj in each of the 2 layers
    assert model_inputs.fetch_model(m.uri) == merged  # merged once per machine


def test_lora_combine_commits_the_merged_model_and_a_later_stage_loads_either(tiny, adapter_sft):
    root, m = adapter_sft
    out = lora_combine.run(lora_combine.Config(model_uri=m.uri, output_uri=str(root / "merged")))
    assert out.stage == "lora_combine" and out.metrics["is_rm"] is False
    assert {i["name"]: i["uri"] for i in out.inputs} == {"adapter": m.uri, "base": tiny.policy_uri}
    assert not any(f["path"].startswith("adapter/") for f in out.files)
    for k, v in weights(model_inputs.fetch_model(m.uri)).items():
        assert torch.equal(weights(root / "merged")[k], v), k
    # generate from the unmerged artifact and from the combined one: same weights, same seed -> same text
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": demo_task.prompt_for(t)}) + "\n" for t in demo_task.THINGS[:4]))
    texts = []
    for name, uri in (("from-adapter", m.uri), ("from-merged", out.uri)):
        g = generate.run(generate.Config(policy_uri=uri, prompts_uri=str(prompts), output_uri=str(root / name),
                                         backend="hf", num_engines=0, best_of_n=2, max_new_tokens=8, seed=3))
        texts.append([r["response"] for r in store.read_table(g.uri).to_pylist()])
    assert texts[0] == texts[1] and len(texts[0]) == 8
    assert lora_combine.run(lora_combine.Config(model_uri=m.uri, output_uri=str(root / "merged"))).created_at == out.created_at


def test_lora_combine_refuses_a_model_without_adapter_and_a_wrong_is_rm(tiny, adapter_sft):
    root, m = adapter_sft
    with pytest.raises(models.ModelInputError, match="holds no LoRA adapter"):
        lora_combine.run(lora_combine.Config(model_uri=tiny.policy_uri, output_uri=str(root / "none")))
    with pytest.raises(models.ModelInputError, match="is_rm=True but the adapter .* task type 'CAUSAL_LM'"):
        lora_combine.run(lora_combine.Config(model_uri=m.uri, is_rm=True, output_uri=str(root / "wrong")))
    assert not (root / "none").exists() and not (root / "wrong" / store.MANIFEST).exists()


@pytest.mark.slow
def test_reward_model_adapter_merges_with_its_reward_stats(tiny, tmp_path):
    from rlhf_core.rollout.rewards import RewardSpec, compute_rewards

    m = train_rm.run(train_rm.Config(base_uri=tiny.reward_uri, dataset_uri=pairs_data(tmp_path, 16), output_uri=str(tmp_path / "rm"),
                                     learning_rate=1e-2, train_batch_size=8, micro_train_batch_size=8, max_len=48,
                                     lr_warmup_ratio=0.0, **LORA))
    out = lora_combine.run(lora_combine.Config(model_uri=m.uri, is_rm=True, output_uri=str(tmp_path / "rm-merged")))
    conf = json.loads((tmp_path / "rm-merged" / "config.json").read_text())
    assert out.metrics["is_rm"] and conf["reward_mean"] == pytest.approx(m.metrics["reward_mean"])
    assert "ForSequenceClassification" in conf["architectures"][0]
    texts = ["great excellent superb .", "awful bad terrible ."]
    scores = [compute_rewards(RewardSpec(model=str(d)), ["Review of the movie:"] * 2, texts, [None] * 2).rewards
              for d in (model_inputs.fetch_model(m.uri), tmp_path / "rm-merged")]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5) and scores[0][0] != scores[0][1]
    before = load_file(os.path.join(tiny.reward_dir, "model.safetensors"))
    assert any(not torch.equal(before[k], v) for k, v in weights(tmp_path / "rm-merged").items() if k in before)
