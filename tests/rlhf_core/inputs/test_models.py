"""Tokenizer conventions of real checkpoints (rlhf_core.inputs.models), on the zoo's Llama-3 / Qwen2 / Mistral / Phi-3
shaped tokenizers: one BOS, EOS lists in both places they live, a pad id for tokenizers without one, EOS only
after finished responses, and reward-model scoring tokenized exactly as reward-model training."""
import json

import pytest
import torch

from rlhf_core.inputs import model_inputs, models
from rlhf_core.rollout.generation import HFEngine, EngineSpec, SamplingSpec
from rlhf_core.rollout.rewards import RewardSpec
from rlhf_core.rollout.reward_model import RMEngine
from rlhf_core.train import batches


def _tok(d):
    return models.load_tokenizer(d)


def test_one_bos_with_and_without_a_chat_template(zoo):
    chat = [{"role": "user", "content": "Review of the tea:"}]
    for arch, expect_bos in (("llama3", True), ("mistral", True), ("phi3", True), ("qwen2", False)):
        tok = _tok(zoo[arch].policy)
        assert models.adds_bos(tok) is expect_bos
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        for ids in (models.prompt_ids(tok, text), models.prompt_ids(tok, "Review of the tea:")):
            if expect_bos:  # the template wrote it once; the tokenizer must not add a second
                assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, arch
            else:
                assert tok.bos_token_id is None or tok.bos_token_id not in ids
    # The template's BOS would be doubled by the tokenizer's default special tokens: what prompt_ids avoids.
    tok = _tok(zoo["llama3"].policy)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok(text).input_ids[:2] == [tok.bos_token_id, tok.bos_token_id]


def test_eos_lists_and_pad_for_tokenizers_without_one(zoo):
    tok = _tok(zoo["llama3"].policy)
    eot, end = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    assert tok.pad_token_id is None
    assert models.eos_ids(tok, zoo["llama3"].policy) == [eot, end]  # tokenizer's first, then generation_config's
    assert models.pad_id(tok, zoo["llama3"].policy) == eot
    qtok = _tok(zoo["qwen2"].policy)
    assert models.pad_id(qtok) == qtok.convert_tokens_to_ids("<|endoftext|>") != qtok.eos_token_id


def test_eos_only_after_finished_responses_and_padding_is_never_a_target(zoo):
    tok = _tok(zoo["llama3"].policy)
    eos = tok.eos_token_id
    rows = [{"input": "Review of the tea:", "output": " good .", "finished": True},
            {"input": "Review of the tea:", "output": " good .", "finished": False},
            {"input": "Review of the tea:", "output": " good ."}]  # data files: finished
    recs, _ = batches.tokenize_sft(rows, tok, 64, model_dir=zoo["llama3"].policy)
    assert recs[0]["ids"][-1] == eos and recs[2]["ids"] == recs[0]["ids"]
    assert recs[1]["ids"] == recs[0]["ids"][:-1]
    pad = models.pad_id(tok, zoo["llama3"].policy)
    b = batches.collate([r["ids"] for r in recs], [r["start"] for r in recs], pad)
    assert b.input_ids[1, -1] == pad and b.target_mask[1, -1] == 0 and b.attention_mask[1, -1] == 0
    pairs, _ = batches.tokenize_pairs([{"prompt": "p", "chosen": " good .", "rejected": " bad .",
                                        "chosen_finished": True, "rejected_finished": False}], tok, 64)
    assert pairs[0]["chosen_ids"][-1] == eos and pairs[0]["rejected_ids"][-1] != eos


def test_a_prompt_cut_from_the_left_keeps_its_bos(zoo):
    """OpenRLHF keeps the prompt's end when it is too long; a Llama-style model also always saw a BOS first. The
    trainers' batches (sft, rm, dpo, reference pass) and the ppo stage's prompts cut alike; no BOS for Qwen2."""
    long_prompt = "Review of the tea: " + "very " * 40
    for arch in ("llama3", "qwen2"):
        tok = _tok(zoo[arch].policy)
        full = models.prompt_ids(tok, long_prompt)
        recs, cut = batches.tokenize_sft([{"input": long_prompt, "output": " good ."}], tok, 16,
                                         model_dir=zoo[arch].policy)
        ids = recs[0]["ids"]
        assert cut and len(ids) == 16 and recs[0]["start"] == 15  # 15 prompt tokens, one response token
        ppo_ids = models.keep_last(full, 12, tok.bos_token_id if models.adds_bos(tok) else None)
        if arch == "llama3":
            assert ids[0] == tok.bos_token_id and ids[1:15] == full[-14:], arch  # BOS + the prompt's last 14 tokens
            assert ppo_ids == [tok.bos_token_id] + full[-11:]
        else:
            assert ids[:15] == full[-15:] and ppo_ids == full[-12:]
            assert tok.bos_token_id is None or tok.bos_token_id not in ids


@pytest.mark.parametrize("max_len", [64, 9])
def test_reward_model_scores_the_tokens_it_was_trained_on(zoo, max_len):
    d = zoo["llama3"].reward
    tok = _tok(d)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Review of the tea:"}], tokenize=False,
                                     add_generation_prompt=True)
    row = {"prompt": prompt, "chosen": " great tea , good .", "rejected": " bad tea , awful ."}
    trained, cut = batches.tokenize_pairs([row], tok, max_len, model_dir=d)
    assert bool(cut) is (max_len == 9)
    engine = RMEngine(str(d), RewardSpec(model=str(d), max_len=max_len))
    assert engine.encode(prompt, row["chosen"]) == trained[0]["chosen_ids"]
    assert engine.encode(prompt, row["rejected"]) == trained[0]["rejected_ids"]


def _always_emits(model_dir, token_id, out_dir):
    """A copy of a Llama model whose greedy next token is always `token_id`: every block's output projections
    are zero (the residual stream is the embedding), every embedding is the same positive vector, and only
    lm_head row `token_id` is non-zero."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.model.embed_tokens.weight.fill_(1.0)
        m.lm_head.weight.zero_()
        m.lm_head.weight[token_id] = 1.0
    m.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(out_dir))
    return out_dir


def test_hf_backend_stops_on_every_eos_of_the_list(zoo, tmp_path):
    tok = _tok(zoo["llama3"].policy)
    end = tok.convert_tokens_to_ids("<|end_of_text|>")  # in generation_config's list, not the tokenizer's eos
    d = _always_emits(zoo["llama3"].policy, end, tmp_path / "m")
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [end, tok.eos_token_id]
    out = HFEngine(str(d), EngineSpec()).generate([models.prompt_ids(tok, "Review of the tea:")],
                                                  SamplingSpec(n=1, temperature=0, max_new_tokens=8))
    assert out[0][0]["finish_reason"] == "stop" and out[0][0]["response_tokens"] == 1


def test_bad_model_folders_are_refused_by_name(zoo, tmp_path):
    import shutil

    for drop, what in (("config.json", "lacks config.json"), ("model.safetensors", r"lacks weights \(\*.safetensors"),
                       ("tokenizer.json", r"lacks a tokenizer \(tokenizer.json")):
        d = tmp_path / drop
        shutil.copytree(zoo["qwen2"].policy, d)
        for f in [drop] + (["tokenizer_config.json"] if drop == "tokenizer.json" else []):
            (d / f).unlink()
        with pytest.raises(models.ModelInputError, match=f"model folder {d} {what}"):
            model_inputs.model_manifest(str(d))
    big = tmp_path / "big"
    shutil.copytree(zoo["qwen2"].policy, big)
    tok = _tok(big)
    tok.add_tokens([f"extra{i}" for i in range(8)])
    tok.save_pretrained(str(big))
    with pytest.raises(models.ModelInputError, match=r"tokenizer has \d+ tokens but the model's embeddings have \d+ rows"):
        models.load_tokenizer(big)


def test_filters_carry_whether_a_response_finished():
    from rlhf_core.rollout import postprocess

    rows = [{"prompt": "p", "response": " good .", "reward": 0.9, "finish_reason": "stop"},
            {"prompt": "p", "response": " bad bad bad", "reward": 0.1, "finish_reason": "length"}]
    pair = postprocess.dpo_pairs(rows)[0]
    assert (pair["chosen_finished"], pair["rejected_finished"]) == (True, False)
    assert [r["finished"] for r in postprocess.conditional_sft(rows)] == [True, False]
    assert postprocess.best_of_n(rows)[0]["finished"] is True
    assert "chosen_finished" not in postprocess.dpo_pairs([{k: v for k, v in r.items() if k != "finish_reason"}
                                                          for r in rows])[0]  # data without finish_reason: finished
