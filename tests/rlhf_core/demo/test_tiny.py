"""Tiny offline models: same seed, same bytes; vLLM-compatible head_dim; loadable by HF."""
import hashlib

from rlhf_core.demo import demo_task, tiny


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = tiny.build_tiny_pair(tmp_path / "a", demo_task.corpus(0), seed=0)
    b = tiny.build_tiny_pair(tmp_path / "b", demo_task.corpus(0), seed=0)
    c = tiny.build_tiny_pair(tmp_path / "c", demo_task.corpus(0), seed=7)
    assert _digest(a[0]) == _digest(b[0]) and _digest(a[1]) == _digest(b[1])
    assert _digest(a[0])["model.safetensors"] != _digest(c[0])["model.safetensors"]
    assert _digest(a[0])["tokenizer.json"] == _digest(c[0])["tokenizer.json"]


def test_models_load_and_have_head_dim_64(tiny):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny.reward_dir)
    assert policy.config.hidden_size // policy.config.num_attention_heads == 64
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tok.pad_token_id
    ids = tok(["Review of the tea: good ."], return_tensors="pt")
    with torch.no_grad():
        assert policy(**ids).logits.shape[-1] == len(tok)
        assert rm(**ids).logits.shape == (1, 1)
    # Every demo word is a whole token or a few: the tokenizer was trained on the task's vocabulary.
    assert len(tok("great")["input_ids"]) == 1 and tok.decode(tok("the movie was awful .")["input_ids"]) == "the movie was awful ."


def test_gold_reward_by_hand():
    # 2 positive, 1 negative in 5 words -> (2 - 1) / 5
    assert demo_task.gold_reward("great movie bad but good") == 0.2
    assert demo_task.gold_reward("") == -1.0
    rows = demo_task.preference_rows(50)
    assert all(demo_task.gold_reward(r["chosen"]) > demo_task.gold_reward(r["rejected"]) for r in rows)
    train, test = demo_task.split_things()
    assert not set(train) & set(test)
