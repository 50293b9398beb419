"""LoRA RL (the ppo stage's lora_rank): the adapters the policy learner trains and the hf rollout engines hold."""
from __future__ import annotations


def lora_wrapped(model, hp: dict):
    """`model` with LoRA adapters (peft, OpenRLHF's --lora_rank / --lora_alpha / --lora_dropout / --target_modules:
    all linear layers but the LM head by default), its own weights frozen: the PeftModel, whose get_base_model() is
    `model` with the adapters injected into its layers. The learner trains that model (its forwards are the plain
    causal LM's) and the hf rollout engine wraps its copy the same way, so the weight sync sends the adapter by the
    same names."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=hp["lora_rank"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
                                            target_modules=hp["target_modules"] or "all-linear", task_type="CAUSAL_LM"))
