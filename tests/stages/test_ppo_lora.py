"""LoRA RL in the ppo stage (issue 45 item 3): lora_rank trains adapters of the policy, its weights frozen; the weight
sync sends the adapter alone to the hf engines (which hold the same adapters) or to vLLM engines (which serve it through
enable_lora), checkpoints hold the adapter and its
optimizer, the committed policy is the adapter (adapter/, merged onto the base by whatever reads the artifact), and a
run interrupted after an adapter checkpoint resumes from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core import store
from rlhf_core.demo import demo_task
from rlhf_core.inputs import model_inputs, models
from stages import ppo
from tests.conftest import reward_failing_after_a_checkpoint

pytestmark = pytest.mark.slow


def test_settings_lora_rl_refuses_what_it_cannot_run():
    base = dict(policy_uri="p", prompts_uri="q", output_uri="o", reward_func_path="r.py", n_samples_per_prompt=2,
                advantage_estimator="group_norm", lora_rank=8)
    with pytest.raises(ValueError, match="lora_rank with vllm_tensor_parallel_size > 1: the adapter reaches an engine"):
        ppo.Config(**base, rollout_backend="vllm", vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora_rank 1024 with rollout_backend vllm: vLLM serves adapters up to rank 512"):
        ppo.Config(**{**base, "lora_rank": 1024}, rollout_backend="vllm")
    ppo.Config(**base, rollout_backend="vllm")  # served through vLLM's LoRA support
    with pytest.raises(ValueError, match="lora_rank with zero_stage 3"):
        ppo.Config(**base, rollout_backend="hf", zero_stage=3)
    ppo.Config(**base, rollout_backend="hf")
    ppo.Config(**base, rollout_backend="hf", vllm_num_engines=0)  # the policy rank generates with its own adapters


def test_a_lora_run_syncs_and_saves_the_adapter_alone_and_resumes_from_an_adapter_checkpoint(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(16, 0)))
    out = tmp_path / "out"
    fail = reward_failing_after_a_checkpoint(tmp_path / "fail_in_step_3.py", out, tmp_path / "armed")
    cfg = ppo.Config(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(out), reward_func_path=str(fail),
                     input_template=demo_task.INPUT_TEMPLATE, generate_max_len=6, advantage_estimator="gae",
                     critic_uri=tiny.reward_uri, save_value_network=True, critic_learning_rate=1e-2,
                     n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8, micro_train_batch_size=8,
                     lr_warmup_ratio=0.0, init_kl_coef=0.01, rollout_backend="hf", lora_rank=4, lora_alpha=8,
                     actor_learning_rate=1e-2, save_steps=2)
    (tmp_path / "armed").write_text("")
    with pytest.raises(Exception, match="the node went away in step 3"):
        ppo.run(cfg)
    from rlhf_core.train import checkpoints

    (marker,) = out.glob(f"checkpoints/*/{checkpoints.MARKER}")
    meta = json.loads(marker.read_text())
    model_bytes = sum(f.stat().st_size for f in Path(tiny.policy_dir).glob("*.safetensors"))
    actor = sum(f["size"] for f in meta["files"] if f["path"].startswith("actor/"))
    assert marker.parent.name == "step-2" and actor < 0.5 * model_bytes, (actor, model_bytes)  # no frozen weights
    critic_bytes = sum(f.stat().st_size for f in Path(tiny.reward_dir).glob("*.safetensors"))
    critic = sum(f["size"] for f in meta["files"] if f["path"].startswith("critic/"))
    assert 0 < critic < 0.5 * critic_bytes, (critic, critic_bytes)  # the LoRA critic: its adapter and head only
    (tmp_path / "armed").unlink()
    m = ppo.run(cfg)
    assert m.metrics["resumed_from_step"] == 2 and m.metrics["steps_done"] == 4

    log = json.loads((out / "training_log.json").read_text())
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())
    assert {h["weight_sync_bytes"] for h in log} == {adapter_bytes} and adapter_bytes < 0.1 * model_bytes
    files = [f["path"] for f in m.files]
    assert models.adapter_only(files) and ("tokenizer.json" in files or "tokenizer_config.json" in files)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # B moved off zero

    merged_dir = model_inputs.fetch_model(str(out))  # a stage reading the artifact: base + adapter, merged
    from rlhf_core.ppo import node_store  # and a ppo role reading it (the ppo flow's next iteration): the same merge,
    assert Path(node_store.local_model(str(out))) == Path(merged_dir)  # the artifact's own files checked first
    base = load_file(str(Path(tiny.policy_dir) / "model.safetensors"))
    merged = {}
    for f in Path(merged_dir).glob("*.safetensors"):
        merged |= load_file(str(f))
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    store.read_manifest(str(out))

    # the LoRA critic (OpenRLHF's --lora_rank adapts the critic too), resumed from its adapter checkpoint and saved
    # merged as a plain value model: its frozen embedding as the reward model's, its adapted layers and head moved
    critic_base = load_file(str(Path(tiny.reward_dir) / "model.safetensors"))
    value = load_file(str(out / "critic" / "model.safetensors"))
    assert sorted(value) == sorted(critic_base)  # no adapter tensors: merged
    assert torch.equal(value["model.embed_tokens.weight"], critic_base["model.embed_tokens.weight"])
    assert not torch.equal(value["model.layers.0.self_attn.q_proj.weight"], critic_base["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(value["score.weight"], critic_base["score.weight"])


@pytest.mark.vllm
def test_vllm_engines_serve_the_synced_adapter(tiny, tmp_path):
    """rollout_backend vllm with lora_rank: each sync sends the adapter alone (the adapter's bytes in the log), the
    engine serves it as a vLLM LoRA, and what it samples has the trained policy's log-probs at every step (an engine
    generating with the base weights, or with the last step's adapter, differs once the adapter has moved: lr 1e-2)."""
    from rlhf_core.ppo.lora import write_adapter

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in demo_task.prompts(12, 0)))
    out = tmp_path / "out"
    cfg = ppo.Config(policy_uri=tiny.policy_uri, prompts_uri=str(prompts), output_uri=str(out),
                     reward_func_path=demo_task.__file__, input_template=demo_task.INPUT_TEMPLATE, generate_max_len=6,
                     advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                     micro_train_batch_size=8, lr_warmup_ratio=0.0, init_kl_coef=0.0, rollout_backend="vllm",
                     enforce_eager=True, lora_rank=4, lora_alpha=8, actor_learning_rate=1e-2)
    m = ppo.run(cfg)
    log = json.loads((out / "training_log.json").read_text())
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert m.metrics["steps_done"] == 3 and any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())
    assert {h["weight_sync_bytes"] for h in log} == {sum(t.numel() * 4 for t in adapter.values())}
    assert all(h["rollout_logprob_gap"] < 1e-3 for h in log), [h["rollout_logprob_gap"] for h in log]

    # the folder an engine serves: PEFT's keys and the modules the adapter holds, read back as sent
    sent = [("model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.ones(4, 8)),
            ("model.layers.0.mlp.down_proj.lora_B.default.weight", torch.full((8, 4), 2.0))]
    assert write_adapter(sent, tmp_path / "served", {"lora_rank": 4, "lora_alpha": 8}) == 4 * 8 * 4 * 2
    served = load_file(str(tmp_path / "served" / "adapter_model.safetensors"))
    assert sorted(served) == ["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
                              "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    config = json.loads((tmp_path / "served" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj"] and (config["r"], config["lora_alpha"]) == (4, 8)


def test_a_new_vllm_engines_adapter_folder_removes_those_of_killed_engines_only(tmp_path, monkeypatch):
    """An engine killed mid-run leaves its adapter folder behind; the next one removes every folder of that name
    whose process is gone, and keeps a live process's and any other folder."""
    import os
    import subprocess
    import sys
    import tempfile

    from rlhf_core.ppo import lora

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{lora.ADAPTERS}{int(gone.stdout)}-abcd"
    live = tmp_path / f"{lora.ADAPTERS}{os.getppid()}-efgh"  # pytest's parent: running
    other = tmp_path / "rlhf-flows-lora-notes"  # no pid: not an engine's
    for d in (dead, live, other):
        (d / "sync-3").mkdir(parents=True)
    new = lora.adapter_root()
    assert not dead.exists() and live.exists() and other.exists()
    assert os.path.basename(new).startswith(f"{lora.ADAPTERS}{os.getpid()}-") and os.path.dirname(new) == str(tmp_path)
