"""Tiny models built offline from a seed: a byte-level BPE tokenizer with a chat template, a Llama-style
causal LM and a Llama sequence-classification reward model, saved as HF `save_pretrained` folders.

`build_zoo_model` builds the same for other architectures with tokenizers that mimic their real checkpoints'
special-token setups (ZOO): Llama-3 (no pad token, BOS added by the tokenizer and written by the template,
EOS list <|end_of_text|> + <|eot_id|>, header template), Qwen2 (tied embeddings, qkv bias, GQA, no BOS,
<|im_start|> template, EOS list), Mistral (no pad, [INST] template), Phi-3 (fused qkv / gate_up
projections, <|user|> template, pad != eos, EOS list), and for attention variety Gemma-2 (alternating sliding-window
and full layers, attention and final-logit soft-capping, <start_of_turn> template) and Mistral v0.1 with a sliding
window on every layer; Mixtral (MoE: 4 experts, top-2 routing) for the MoE auxiliary loss.

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


def build_tokenizer(out_dir: str | Path, lines: list[str], vocab_size: int = 400, added_tokens: tuple[str, ...] = ()):
    """`added_tokens`: whole tokens split out before BPE (a PRM's step placeholder and reward tokens), so each
    is one id wherever it stands, as in the real PRM tokenizers that carry them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    tok.add_tokens(list(added_tokens))
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


# ---------------------------------------------------------------------------------------------- the zoo
ZOO: dict[str, dict] = {
    "llama3": dict(model_type="llama", special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                "<|end_header_id|>", "<|eot_id|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None, add_bos=True,
                   generation_eos=["<|end_of_text|>", "<|eot_id|>"],
                   template="{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                            "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": dict(model_type="qwen2", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
                  generation_eos=["<|im_end|>", "<|endoftext|>"], tie=True, kv_heads=1,
                  template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "mistral": dict(model_type="mistral", special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                    bos="<s>", eos="</s>", pad=None, unk="<unk>", add_bos=True, generation_eos=["</s>"],
                    template="{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                             " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "phi3": dict(model_type="phi3", special=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>",
                                             "<|end|>"],
                 bos="<s>", eos="<|end|>", pad="<|endoftext|>", unk="<unk>", add_bos=True,
                 generation_eos=["<|endoftext|>", "<|end|>"],
                 template="{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    # MoE (issue 24, part C): Mixtral-shaped, 4 experts of which 2 per token, Mistral's tokenizer setup
    "mixtral": dict(model_type="mixtral", special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                    bos="<s>", eos="</s>", pad=None, unk="<unk>", add_bos=True, generation_eos=["</s>"],
                    config=dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                    template="{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                             " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    # attention variety (issue 24, part A): windows shorter than the test sequences, so packed and shared-prompt
    # layouts must honour them; soft-caps low enough that tiny random weights reach them (Gemma-2: 50 / 30; at 5 the
    # attention cap moved log-probs by 2e-5 only, at 0.3 by 5e-3 per token)
    "gemma2": dict(model_type="gemma2", special=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                   bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, generation_eos=["<eos>", "<end_of_turn>"],
                   tie=True, config=dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=8,  # layers: sliding, full
                                         attn_logit_softcapping=0.3, final_logit_softcapping=3.0),
                   template="{{ bos_token }}{% for m in messages %}<start_of_turn>"
                            "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "mistral-sw": dict(model_type="mistral", special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],  # Mistral v0.1: every layer slides
                       bos="<s>", eos="</s>", pad=None, unk="<unk>", add_bos=True, generation_eos=["</s>"],
                       config=dict(sliding_window=8),
                       template="{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                                " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
}


def build_zoo_tokenizer(out_dir: str | Path, arch: str, lines: list[str], vocab_size: int = 400):
    """A BPE tokenizer with `arch`'s special tokens, BOS behaviour and chat template (chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    z = ZOO[arch]
    tok = Tokenizer(models.BPE(unk_token=z["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=z["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    if z["add_bos"]:  # the tokenizer adds BOS by default, as Llama / Mistral / Phi-3 tokenizers do
        bos = z["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    named = {k: z[k] for k in ("bos", "eos", "pad", "unk") if z[k]}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=z["template"], padding_side="left",
                                   model_max_length=512, **{f"{k}_token": v for k, v in named.items()})
    fast.save_pretrained(str(out_dir))
    return fast


def build_zoo_model(out_dir: str | Path, arch: str, lines: list[str], kind: str = "policy", seed: int = 0,
                    hidden: int = 128, layers: int = 2, heads: int = 2, intermediate: int = 256) -> Path:
    """A random tiny `arch` model (kind "policy": causal LM, "reward": scalar head) + its tokenizer, with a
    generation_config.json listing the architecture's EOS ids."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    z = ZOO[arch]
    tok = build_zoo_tokenizer(out_dir, arch, lines)
    ids = lambda t: tok.convert_tokens_to_ids(t) if t else None  # noqa: E731
    cfg = AutoConfig.for_model(z["model_type"], vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                               num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=z.get("kv_heads", heads), max_position_embeddings=256,
                               tie_word_embeddings=z.get("tie", False), pad_token_id=ids(z["pad"]),
                               bos_token_id=ids(z["bos"]), eos_token_id=[ids(t) for t in z["generation_eos"]],
                               **z.get("config", {}))
    torch.manual_seed(seed)
    if kind == "policy":
        model = AutoModelForCausalLM.from_config(cfg)
        model.generation_config = GenerationConfig(bos_token_id=ids(z["bos"]), pad_token_id=ids(z["pad"]),
                                                   eos_token_id=[ids(t) for t in z["generation_eos"]])
    elif kind == "reward":
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (policy or reward)")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)
