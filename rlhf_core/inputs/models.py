"""Tokenizer conventions of real checkpoints, in one place for training, generation and scoring.

Real tokenizers differ from a toy's: Llama-3 and Mistral ship no pad token, Llama-3, Qwen2 and Phi-3 stop
on a list of EOS ids (generation_config.json `eos_token_id: [...]`), chat templates live in
`chat_template.jinja` and may already write the BOS token that the tokenizer would add again. The rules:
  pad   the tokenizer's pad id, else its EOS id: padding is masked out of attention and never a loss target,
        so any id is safe there; the EOS id is one the embeddings surely hold.
  eos   every id in the tokenizer's eos_token_id and generation_config's eos_token_id (a list or one id);
        generation stops on any of them; training appends the tokenizer's EOS to finished responses only.
  bos   a prompt gets exactly one BOS: the tokenizer's own (when it adds one by default) unless the text
        already starts with it (a chat template that writes `{{ bos_token }}`).
  chat  `tokenizer_chat_template` (OpenRLHF's flag) replaces the tokenizer's template when given.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from rlhf_core.store import ArtifactError

WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelInputError(ArtifactError):
    """A model input that cannot be used (a hub id, a folder lacking config, weights or tokenizer)."""


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None, where: str | None = None):
    """The folder's tokenizer (chat template overridden when given), checked against the model's embeddings."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template:
        tok.chat_template = chat_template
    check_vocab(tok, model_dir, where or str(model_dir))
    return tok


def _config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "config.json"
    return json.loads(p.read_text()) if p.exists() else {}


def check_vocab(tok, model_dir: str | Path, where: str) -> None:
    """A tokenizer that can emit ids past the embedding table is refused (it would crash mid-training)."""
    cfg = _config(model_dir)
    rows = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if rows and len(tok) > int(rows):
        raise ModelInputError(f"model {where}: its tokenizer has {len(tok)} tokens but the model's embeddings have "
                              f"{rows} rows (config.json vocab_size): token ids >= {rows} have no embedding")


def eos_ids(tok, model_dir: str | Path | None = None) -> list[int]:
    """Every EOS id: the tokenizer's first, then generation_config.json's (an id or a list)."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    gen = Path(model_dir) / "generation_config.json" if model_dir else None
    if gen is not None and gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids += e if isinstance(e, list) else [e] if e is not None else []
    out = list(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise ModelInputError(f"model {model_dir}: no EOS token (the tokenizer has no eos_token and "
                              f"generation_config.json names none)")
    return out


def eos_id(tok, model_dir: str | Path | None = None) -> int:
    """The EOS appended to finished responses in training."""
    return eos_ids(tok, model_dir)[0]


def pad_id(tok, model_dir: str | Path | None = None) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else eos_id(tok, model_dir)


def adds_bos(tok) -> bool:
    """Whether the tokenizer puts a BOS in front by default (Llama, Mistral, Phi-3 do; Qwen2 does not)."""
    if tok.bos_token_id is None:
        return False
    ids = tok("a").input_ids
    return bool(ids) and ids[0] == tok.bos_token_id


def prompt_ids(tok, text: str, bos: bool | None = None) -> list[int]:
    """Token ids of a prompt with exactly one BOS where the tokenizer uses one (see module docstring).
    `bos`: the result of adds_bos(tok), passed by callers that tokenize many prompts."""
    ids = tok(text, add_special_tokens=False).input_ids
    if (adds_bos(tok) if bos is None else bos) and (not ids or ids[0] != tok.bos_token_id):
        ids = [tok.bos_token_id] + ids
    return ids


def keep_last(ids: list[int], max_len: int, bos_id: int | None = None) -> list[int]:
    """A prompt cut to its last max_len tokens, keeping a leading BOS (bos_id) in front: a model trained with
    a BOS at position 0 never sees a prompt without one. e.g. [BOS, 1, 2, 3, 4], 3 -> [BOS, 3, 4]."""
    if len(ids) <= max_len:
        return ids
    if bos_id is not None and ids and ids[0] == bos_id and max_len > 1:
        return [bos_id] + ids[len(ids) - (max_len - 1):]
    return ids[len(ids) - max_len:]


# ---------------------------------------------------------------------------------------------- LoRA adapters
ADAPTER_DIR = "adapter"  # where training saves a LoRA adapter inside a model artifact


def adapter_only(files: list[str]) -> bool:
    """An artifact trained with LoRA and `lora_merge=false`: adapter/ holds the adapter, the root no weights."""
    root_weights = any("/" not in f and any(fnmatch.fnmatch(f, pat) for pat in WEIGHTS) for f in files)
    return f"{ADAPTER_DIR}/adapter_config.json" in files and not root_weights


def merge_adapter(base_dir: str | Path, artifact_dir: str | Path, out_dir: str | Path, bf16: bool = False,
                  rm_stats: dict | None = None) -> bool:
    """Write base + LoRA adapter (`artifact_dir/adapter`) as a plain HF folder in `out_dir`: every adapted
    weight becomes W + (alpha / r) * B @ A (LoRA, arXiv:2106.09685; peft's merge_and_unload). A reward
    model's adapter (peft task SEQ_CLS, OpenRLHF lora_combiner --is_rm) merges into a one-label
    sequence-classification base, with train_rm's reward_mean / reward_std (from `rm_stats`, the artifact's
    metrics: the adapter alone does not carry the config training would have written) in its config. Tokenizer files come from the artifact's root (training saved them there), else the base's.
    Returns whether the model is a reward model."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    task = json.loads((artifact_dir / ADAPTER_DIR / "adapter_config.json").read_text()).get("task_type")
    is_rm = task == "SEQ_CLS"
    auto = AutoModelForSequenceClassification if is_rm else AutoModelForCausalLM
    base = auto.from_pretrained(str(base_dir), dtype=torch.float32, **({"num_labels": 1} if is_rm else {}))
    model = PeftModel.from_pretrained(base, str(artifact_dir / ADAPTER_DIR)).merge_and_unload()
    if is_rm and rm_stats and rm_stats.get("reward_mean") is not None and rm_stats.get("reward_std") is not None:
        model.config.reward_mean, model.config.reward_std = rm_stats["reward_mean"], rm_stats["reward_std"]
    model.to(torch.bfloat16 if bf16 else torch.float32).save_pretrained(str(out_dir), safe_serialization=True)
    own = [p for p in artifact_dir.iterdir() if p.is_file() and p.name in TOKENIZER_FILES + TOKENIZER_EXTRA]
    if any(p.name in TOKENIZER_FILES for p in own):
        for p in own:
            shutil.copy(p, out_dir / p.name)
    else:
        AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out_dir))
    return is_rm


TOKENIZER_EXTRA = ("special_tokens_map.json", "chat_template.jinja", "merges.txt", "added_tokens.json")
