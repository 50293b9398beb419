"""LoRA RL (the ppo stage's lora_rank): the adapters the policy learner trains and the hf rollout engines hold."""
from __future__ import annotations


def lora_wrapped(model, hp: dict, task: str = "CAUSAL_LM"):
    """`model` with LoRA adapters (peft, OpenRLHF's --lora_rank / --lora_alpha / --lora_dropout / --target_modules:
    all linear layers but the LM head by default), its own weights frozen: the PeftModel, whose get_base_model() is
    `model` with the adapters injected into its layers. The learner trains that model (its forwards are the plain
    causal LM's) and the hf rollout engine wraps its copy the same way, so the weight sync sends the adapter by the
    same names. `task` "SEQ_CLS": the critic (OpenRLHF's --lora_rank adapts actor and critic alike), whose new value
    head `score` trains whole beside the adapters (peft's modules_to_save for that task)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=hp["lora_rank"], lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"],
                                            target_modules=hp["target_modules"] or "all-linear", task_type=task))


def merged_critic(peft_model, model_dir: str, hp: dict):
    """The LoRA critic as a plain value model: a fresh copy of its base from `model_dir` on the CPU, wrapped alike,
    given the trained adapter and head (peft's state dict of `peft_model`), merged (W + scale BA) and unwrapped.
    The learner's own model is left as it is."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.bfloat16 if hp["bf16"] else torch.float32, use_safetensors=True)
    fresh = lora_wrapped(base, hp, "SEQ_CLS")
    trained = {k: v.detach().to("cpu") for k, v in get_peft_model_state_dict(peft_model).items()}
    set_peft_model_state_dict(fresh, trained)
    return fresh.merge_and_unload()


# vLLM's LoRA slots come in these ranks only (vllm/config/lora.py MaxLoRARanks, 0.32): the engine reserves the
# smallest that holds the adapter.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_rank(rank: int) -> int:
    """The max_lora_rank a vLLM engine needs for adapters of `rank` (refused above vLLM's largest)."""
    fit = [k for k in VLLM_RANKS if k >= rank]
    if not fit:
        raise ValueError(f"lora_rank {rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}")
    return fit[0]


ADAPTERS = "rlhf-flows-lora-"


def adapter_root() -> str:
    """A new folder for a vLLM engine's synced adapters, in the temp folder and named for this process
    (rlhf-flows-lora-<pid>-...). An engine killed mid-run (the stage kills its actors when it ends or fails) cannot
    remove its own: each new one first removes the folders of this name whose process is gone, so at most the
    folders of live engines remain. A folder whose process still runs (or runs under another user) is kept."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    for old in Path(tempfile.gettempdir()).glob(ADAPTERS + "*"):
        pid = old.name[len(ADAPTERS):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{ADAPTERS}{os.getpid()}-")


def _running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_adapter(pairs, folder, hp: dict) -> int:
    """The adapter a weight sync brought, as the PEFT folder vLLM's LoRA loader reads: (name, tensor) pairs named as
    in the learner's injected model (`model.layers.0.self_attn.q_proj.lora_A.default.weight`) saved as
    adapter_model.safetensors under PEFT's keys (`base_model.model.<module>.lora_A.weight`), and adapter_config.json
    with the run's rank, alpha and the modules the adapter really holds (lora_wrapped's "all-linear" resolved by
    peft on the learner). Returns the bytes received."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, modules, nbytes = {}, set(), 0
    for name, t in pairs:
        module, _, rest = name.rpartition(".lora_")  # rest: "A.default.weight"
        if not module:
            raise RuntimeError(f"the LoRA weight sync sent {name!r}, which is no adapter weight")
        side = rest.split(".")[0]
        tensors[f"base_model.model.{module}.lora_{side}.weight"] = t.detach().to("cpu").contiguous()
        modules.add(module.rsplit(".", 1)[-1])
        nbytes += t.numel() * t.element_size()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": hp["lora_rank"], "lora_alpha": hp["lora_alpha"],
        "lora_dropout": 0.0, "target_modules": sorted(modules), "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}))
    return nbytes
