"""CUDA-only paths (marker `gpu`; skipped on hosts without CUDA by tests/conftest.py). On a GPU machine:

    .venv/bin/python -m pytest -m gpu tests/test_gpu.py -q       (the GPU image: pip install ".[gpu]" with
                                                                  requirements/gpu-constraints.txt)

bf16 sft and dpo through DeepSpeed, the reference pass as a bf16 job on the GPU (implied margin 0 at step 0),
vLLM's CUDA engine generating from a plain folder and stopping on an EOS list, QLoRA (NF4 base + LoRA), and
the whole ppo stage on one GPU (issue 22's layer b: Ray, DeepSpeed learner, reference, reward model and a vLLM
CUDA engine colocated, bf16, tempered log-probs). The ppo roles without Ray or vLLM (layer a):
tests/rlhf_core/ppo/test_gpu_roles.py.
Models are the zoo's tiny Llama-3 / Qwen2 folders, so each test takes seconds on one GPU.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.inputs import data
from rlhf_core.demo import demo_task
from rlhf_core import store
from stages import dpo, generate, ppo, reference, sft

pytestmark = pytest.mark.gpu
FAST = dict(learning_rate=1e-3, train_batch_size=16, micro_train_batch_size=16, max_len=64, lr_warmup_ratio=0.0,
            input_template=demo_task.INPUT_TEMPLATE)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _changed(before_dir, after_dir) -> list[str]:
    before, after = load_file(str(before_dir / "model.safetensors")), load_file(str(after_dir / "model.safetensors"))
    return [k for k in before if k in after and not torch.equal(before[k].float(), after[k].float())]


def test_bf16_sft_through_deepspeed_on_gpu(zoo, tmp_path):
    data = _jsonl(tmp_path / "sft.jsonl", demo_task.sft_rows(32))
    m = sft.run(sft.Config(policy_uri=str(zoo["llama3"].policy), dataset_uri=data, output_uri=str(tmp_path / "sft"),
                           bf16=True, zero_stage=2, **FAST))
    assert m.metrics["steps_done"] == 2 and _changed(zoo["llama3"].policy, tmp_path / "sft")
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_reference_job_and_dpo_agree_at_step_zero_on_gpu(zoo, tmp_path):
    pairs = tmp_path / "pairs"
    w = store.ArtifactWriter(str(pairs), "data", {"n": 16})
    w.begin()
    w.write_table("p.parquet", data.to_table(demo_task.preference_rows(16), "pairs"))
    w.commit()
    policy = str(zoo["qwen2"].policy)
    ref = reference.run(reference.Config(pairs_uri=str(pairs), ref_uri=policy, max_len=64, bf16=True, batch_size=16,
                                         output_uri=str(tmp_path / "ref")))
    assert ref.metrics["bf16"] is True
    m = dpo.run(dpo.Config(policy_uri=policy, dataset_uri=ref.uri, output_uri=str(tmp_path / "dpo"), bf16=True,
                           zero_stage=2, **{k: v for k, v in FAST.items() if k != "input_template"}))
    assert m.metrics["steps_done"] == 1
    assert abs(m.metrics["first_reward_margin"]) < 1e-3  # same dtype, device and forward: policy == reference


@pytest.mark.vllm
def test_vllm_cuda_generates_from_a_plain_folder_and_stops_on_eos_lists(zoo, tmp_path):
    prompts = _jsonl(tmp_path / "prompts.jsonl", demo_task.prompts(8))
    m = generate.run(generate.Config(policy_uri=str(zoo["qwen2"].policy), prompts_uri=prompts, backend="vllm",
                                     num_engines=1, best_of_n=4, max_new_tokens=16, gpu_memory_utilization=0.3,
                                     output_uri=str(tmp_path / "samples")))
    rows = store.read_table(m.uri).to_pylist()
    assert len(rows) == 32 and all(0 < r["response_tokens"] <= 16 for r in rows)
    assert m.metrics["backend"] == "vllm" and m.metrics["tokens_per_s"] > 0


def test_qlora_trains_adapters_on_a_4bit_base(zoo, tmp_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (the gpu extra)")
    data = _jsonl(tmp_path / "sft.jsonl", demo_task.sft_rows(32))
    out = tmp_path / "qlora"
    m = sft.run(sft.Config(policy_uri=str(zoo["llama3"].policy), dataset_uri=data, output_uri=str(out), bf16=True,
                           load_in_4bit=True, lora_rank=8, zero_stage=2, **FAST))
    assert m.metrics["steps_done"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert _changed(zoo["llama3"].policy, out)  # the merged, unquantized model differs from the base
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("4bit" in type(p).__name__.lower() for p in merged.parameters())


@pytest.mark.vllm
def test_ppo_stage_on_one_gpu_with_vllm_in_bf16(zoo, tmp_path):
    """GRPO with a k3 KL loss against the reference and the zoo's reward model, every role colocated on the one
    GPU (colocate_all_models, vLLM at 30% of it), bf16, sampling at T 0.6: two steps commit; the learners ran on
    the GPU (their peak memory is the CUDA allocator's) and the engine's tempered log-probs match the trainer's
    to bf16 precision."""
    prompts = _jsonl(tmp_path / "prompts.jsonl", demo_task.prompts(16))
    policy = str(zoo["qwen2"].policy)
    cfg = ppo.Config(policy_uri=policy, prompts_uri=prompts, output_uri=str(tmp_path / "ppo"),
                     reward_model_uri=str(zoo["qwen2"].reward), input_template=demo_task.INPUT_TEMPLATE,
                     advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8,
                     train_batch_size=32, micro_train_batch_size=8, generate_max_len=16, temperature=0.6,
                     actor_learning_rate=1e-4, init_kl_coef=0.01, use_kl_loss=True, bf16=True, zero_stage=2,
                     rollout_backend="vllm", colocate_all_models=True, vllm_gpu_memory_utilization=0.3)
    m = ppo.run(cfg)
    log = json.loads((tmp_path / "ppo" / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 2 and len(log) == 2
    assert all(h["policy_peak_mem_gb"] > 0 and h["rollout_tokens_per_s"] > 0 and h["entropy"] > 0 for h in log)
    assert log[0]["rollout_logprob_gap"] < 0.05  # vLLM bf16 kernels vs the trainer's bf16 forward, same weights
    assert _changed(zoo["qwen2"].policy, tmp_path / "ppo")


@pytest.mark.vllm
@pytest.mark.parametrize("colocate, sleep, tp", [(True, True, 1), (True, False, 1), (False, False, 1), (False, False, 2)])
def test_ppo_weight_sync_sleep_and_tp_on_gpu(zoo, tmp_path, colocate, sleep, tp):
    """Issue 23 layer (b): the weight path on CUDA (colocated: CUDA IPC; not: the NCCL group; TP 2: vLLM's own
    NCCL transfer engine into each TP worker, issue 35), vLLM sleep on and off, TP 1 and 2. Two steps commit and
    step 2's rollout log-probs (generated after the first sync) match the trainer's to bf16 precision. At lr
    1e-4 one update moved them 0.059 (issue 35), too close to the 0.05 bound to tell a stale engine: at 2e-3 an
    engine left with the old weights is off by about 20 times that."""
    gpus = (1 if colocate else 1 + tp)
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    prompts = _jsonl(tmp_path / "prompts.jsonl", demo_task.prompts(16))
    cfg = ppo.Config(policy_uri=str(zoo["qwen2"].policy), prompts_uri=prompts, output_uri=str(tmp_path / "ppo"),
                     reward_model_uri=str(zoo["qwen2"].reward), input_template=demo_task.INPUT_TEMPLATE,
                     advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8,
                     train_batch_size=32, micro_train_batch_size=8, generate_max_len=16, temperature=0.6,
                     actor_learning_rate=2e-3, init_kl_coef=0.0, bf16=True, zero_stage=2, rollout_backend="vllm",
                     colocate_all_models=colocate, vllm_enable_sleep=sleep, vllm_tensor_parallel_size=tp,
                     vllm_gpu_memory_utilization=0.3 if colocate else 0.6, weight_sync_bucket_mb=1)
    m = ppo.run(cfg)
    log = json.loads((tmp_path / "ppo" / "training_log.json").read_text())
    assert m.metrics["steps_done"] == 2 and log[0]["weight_sync_s"] > 0
    assert log[1]["rollout_logprob_gap"] < 0.05
