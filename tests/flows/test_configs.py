"""Shipped configs cannot rot: every file in configs/ runs the flow it names (its keys validate as stage
configs here and in tests/test_packaging.py) with the same keys scaled down by overrides: the models are plain Hugging
Face folders (no manifest) on the moto S3 endpoint (`pretrain_uri`, `reward_uri`), sizes are tiny, one
iteration, one process per job, engines in-process."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from flows.cli import FLOWS, cmd_run
from rlhf_core.demo import demo_task
from rlhf_core import store
from tests.conftest import upload_folder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Which flow each shipped config is for (its header's `rlhf-flows run FLOW` / `rlhf-flows demo` line); a new
# file must be added here.
FLOW_OF = {"demo.yaml": "iterative-dpo", "demo_raft.yaml": "raft", "demo_csft.yaml": "conditional-sft",
           "iterative_dpo_llama3_8b.yaml": "iterative-dpo", "raft_llama3_8b.yaml": "raft",
           "ppo_llama3_8b.yaml": "ppo", "reinforce_baseline_llama3_8b_hybrid.yaml": "ppo"}
# The ppo demo runs whole in tests/flows/test_ppo_flow.py, not scaled down here. The ProRL v2 config is OpenRLHF's
# script key by key (tests/flows/test_import_openrlhf.py) and validates as a ppo flow config (tests/test_packaging.py);
# it is not run scaled down here: its reward is the user's copy of OpenRLHF's math_reward_func.py.
RUN_ELSEWHERE = {"demo_ppo.yaml": "ppo", "prorl_v2_math_hybrid.yaml": "ppo"}
SECTIONS = {"prepare": "prepare", "sft": "sft", "train_rm": "train_rm", "generate": "generate", "score": "score",
            "filter": "filter", "eval": "eval", "reference": "reference", "dpo": "dpo", "sft_loop": "sft", "ppo": "ppo"}
SMALL = {"max_len": 64, "prompt_max_len": 32, "max_new_tokens": 8, "train_batch_size": 2, "micro_train_batch_size": 2,
         "num_gpus": 1, "num_nodes": 1, "num_engines": 0, "tensor_parallel_size": 1, "rollout_batch_size": 8,
         "batch_size": 4, "best_of_n": 2, "backend": "hf", "max_epochs": 1, "samples_per_prompt": 2,
         "launcher": "python"}
SMALL_PPO = {"generate_max_len": 8, "max_samples": 8, "n_samples_per_prompt": 2, "actor_num_gpus_per_node": 1,
             "critic_num_gpus_per_node": 1, "vllm_num_engines": 1, "rollout_backend": "hf", "reward_max_len": 64,
             "save_steps": 0, "micro_rollout_batch_size": 2, "ref_num_gpus_per_node": 1, "reward_num_gpus_per_node": 1,
             # vLLM's and CUDA's own flags off: the engine is HF on this CPU host
             "vllm_tensor_parallel_size": 1, "vllm_gpu_memory_utilization": 0.95, "enforce_eager": False,
             "enable_prefix_caching": False, "vllm_enable_sleep": False, "deepspeed_enable_sleep": False,
             "ref_reward_offload": False, "attn_implementation": "sdpa"}  # one step of one rollout engine (HF on CPU), one rank per group


def scaled_down(raw: dict, params_cls) -> dict:
    """The same keys with tiny values: every size key a stage's Config knows is set small."""
    out = dict(raw)
    for section, stage in SECTIONS.items():
        if section not in params_cls.model_fields:
            continue
        fields = importlib.import_module(f"stages.{stage}").Config.model_fields
        small = {**SMALL, **SMALL_PPO} if section == "ppo" else SMALL
        out[section] = {**raw.get(section, {}), **{k: v for k, v in small.items() if k in fields}}
    return out


@pytest.fixture(scope="module")
def plain_inputs(zoo, moto_s3):
    """A Llama-3-shaped policy and reward model as plain folders on S3, and prompts carrying both a text
    `input` and OpenRLHF's `context_messages`."""
    root = f"s3://{moto_s3.bucket}/configs-inputs"
    rows = [{"input": p["input"], "context_messages": [{"role": "user", "content": p["input"]}]}
            for p in demo_task.prompts(8)]
    fs, path = store.filesystem(f"{root}/prompts.jsonl")
    fs.pipe_file(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return {"pretrain_uri": upload_folder(zoo["llama3"].policy, f"{root}/llama3-policy"),
            "reward_uri": upload_folder(zoo["llama3"].reward, f"{root}/llama3-rm"),
            "prompt_data": f"{root}/prompts.jsonl"}


# Configs of one stage, run through the CLI with their file by that stage's tests (tests/stages/test_ppo.py).
STAGE_OF = {"ppo_demo.yaml": "ppo", "ppo_agent_demo.yaml": "ppo"}


def test_every_config_file_has_a_flow_or_a_stage():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted({**FLOW_OF, **STAGE_OF, **RUN_ELSEWHERE})


@pytest.mark.slow
@pytest.mark.shared_ray  # the configs' Ray stages (generate, score, ppo) join the file's one Ray
@pytest.mark.parametrize("name", sorted(FLOW_OF))
def test_config_runs_its_flow_scaled_down_on_plain_folders(name, plain_inputs, moto_s3, prefect_harness):
    flow = FLOW_OF[name]
    mod = importlib.import_module(FLOWS[flow])
    raw = yaml.safe_load((CONFIGS / name).read_text())
    run_name = Path(name).stem.replace("_", "-")
    over = {**scaled_down(raw, mod.Params), **plain_inputs, "demo": False, "iterations": 1,
            "root": f"s3://{moto_s3.bucket}/configs", "run_name": run_name}
    for key, section in (("sft_data", "sft"), ("preference_data", "train_rm"), ("eval_prompt_data", None)):
        over.pop(key, None)  # warm-up, RM training, eval: other tests. Their sections would go unused (the
        if section:          # flow refuses them): a section the file sets is dropped as a user does, `section=null`
            over.pop(section, None)
            if section in raw:
                over[section] = None
    # as a user runs it: `rlhf-flows run FLOW --config configs/NAME key=value ...` (sections as section.key=value)
    args = [f"{k}={json.dumps(v)}" for k, v in over.items() if not isinstance(v, dict)]
    args += [f"{k}.{kk}={json.dumps(vv)}" for k, v in over.items() if isinstance(v, dict) for kk, vv in v.items()]
    assert cmd_run(flow, str(CONFIGS / name), args) == 0
    run = f"s3://{moto_s3.bucket}/configs/{run_name}"
    fs, path = store.filesystem(f"{run}/report.json")
    report = json.loads(fs.cat_file(path))
    assert report["stop_reason"] == "completed all iterations" and len(report["iterations"]) == 2
    last = {"iterative-dpo": "dpo", "raft": "sft", "conditional-sft": "sft", "ppo": "ppo"}[flow]
    trained = store.read_manifest(f"{run}/iter-1/{last}")
    assert trained.metrics["steps_done"] == trained.metrics["planned_steps"] >= 1
    gen = store.read_manifest(f"{run}/iter-1/{'ppo' if flow == 'ppo' else 'generate'}")
    assert {i["name"]: i["stage"] for i in gen.inputs}["policy"] == "source"  # the plain folder, by content hash
