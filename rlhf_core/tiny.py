"""Tiny models built offline from a seed: a byte-level BPE tokenizer with a chat template, a Llama-style
causal LM and a Llama sequence-classification reward model, saved as HF `save_pretrained` folders.

Sizes default to hidden 128 with 2 heads, so head_dim is 64 (vLLM's CPU attention rejects 16). Same seed,
same bytes: the tokenizer is trained on a fixed corpus and weights are drawn from a seeded generator.
"""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def build_tokenizer(out_dir: str | Path, lines: list[str], vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, padding_side="left",
                                   model_max_length=512, **SPECIAL)
    fast.save_pretrained(str(out_dir))
    return fast


def llama_config(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 2, intermediate: int = 256,
                 max_positions: int = 256, num_labels: int | None = None):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    if num_labels is not None:
        cfg.num_labels = num_labels
    return cfg


def build_model(out_dir: str | Path, tokenizer, kind: str = "policy", seed: int = 0, **sizes) -> Path:
    """Save a randomly initialised tiny model (kind: "policy" causal LM, or "reward" scalar head)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    if kind == "policy":
        model = LlamaForCausalLM(llama_config(tokenizer, **sizes))
    elif kind == "reward":
        model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1, **sizes))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (policy or reward)")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def build_tiny_pair(out_dir: str | Path, lines: list[str], seed: int = 0, **sizes) -> tuple[Path, Path]:
    """Build `{out_dir}/policy` and `{out_dir}/reward` sharing one tokenizer."""
    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir / "tokenizer", lines)
    return (build_model(out_dir / "policy", tok, "policy", seed, **sizes),
            build_model(out_dir / "reward", tok, "reward", seed + 1, **sizes))
