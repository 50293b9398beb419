#!/usr/bin/env bash
# GPU layer (a), for the lent GPU machine: the ppo roles in-process on CUDA in bf16 (no Ray, no vLLM:
# tests/rlhf_core/ppo/test_gpu_roles.py), then the figures of benchmarks/gpu/gpu_roles.py (Qwen2-0.5B / 1.5B shapes,
# random weights built there) and the CUDA-IPC weight hand-over (benchmarks/gpu/gpu_weight_sync.py). Under 13
# minutes: tests capped at 330 s, the benchmarks at 230 s and 200 s.
#
# That machine's image has Python 3.12, torch + CUDA, transformers, peft, pyarrow, fsspec, pytest, and no
# deepspeed, ray, vllm, prefect, datasets or s3fs; nothing can be installed there from a registry. DeepSpeed
# and what it needs beyond the image travel as wheels in .whl/ (git-ignored; 4.9 MB in all). Prepare them
# once, here, in the repo root:
#
#   mkdir -p .whl
#   .venv/bin/python -m pip wheel --no-deps -w .whl deepspeed==0.19.8    # an sdist only: builds py3-none-any, 2.1 MB
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
#       typing-extensions==4.16.0
#
# pydantic pins its pydantic-core exactly and needs typing-extensions >= 4.16 (carried, in case the image's is
# older); keep one version of each in .whl/. DeepSpeed's other needs (einops, msgpack, ninja, numpy,
# packaging, psutil, py-cpuinfo, tqdm) are in the image. Then, through the device tool:
#
#   run(command="bash benchmarks/gpu/gpu_smoke.sh", carry=[".whl"], timeout_s=600)
#
# Everything lands in $OUT (default /tmp/gpu-smoke): env.txt, pytest.log, gpu_roles.log, gpu_roles.json.
#
# Layer (b), the whole ppo stage with Ray placement and vLLM's CUDA engine, cannot run there (ray's and vLLM's
# wheels are far over the 64 MiB that travels with a call). On a full GPU image (pip install ".[gpu]" with
# requirements/gpu-constraints.txt):  python -m pytest -m "gpu" tests/test_gpu.py
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-smoke}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/*.whl here: deepspeed must already be importable (see this script's header)" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # rlhf_core from this checkout

{
  nvidia-smi
  python3 -c "import sys, torch, transformers, peft, deepspeed, pydantic
print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| peft', peft.__version__, '| deepspeed', deepspeed.__version__,
      '| pydantic', pydantic.__version__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
} 2>&1 | tee "$OUT/env.txt"

# addopts emptied: the project's (-n auto --maxprocesses 2 --dist loadgroup) need pytest-xdist
timeout -k 10 330 python3 -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -raP -m gpu \
  tests/rlhf_core/ppo/test_gpu_roles.py tests/rlhf_core/ppo/test_gpu_weight_sync.py -q 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

timeout -k 10 230 python3 benchmarks/gpu/gpu_roles.py --device cuda 2>&1 | tee "$OUT/gpu_roles.log"
bench_rc=${PIPESTATUS[0]}

timeout -k 10 200 python3 benchmarks/gpu/gpu_weight_sync.py 2>&1 | tee "$OUT/gpu_weight_sync.log"
sync_rc=${PIPESTATUS[0]}

echo "gpu_smoke: tests exit $tests_rc, benchmark exit $bench_rc, weight sync exit $sync_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$sync_rc" -eq 0 ]
