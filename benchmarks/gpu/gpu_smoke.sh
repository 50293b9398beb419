#!/usr/bin/env bash
# GPU layer (a), for the lent GPU machine: the ppo roles in-process on CUDA in bf16 (no Ray, no vLLM:
# tests/rlhf_core/ppo/test_gpu_roles.py), the CUDA weight-sync, log-prob backends (fused / chunked, Liger where carried:
# tests/rlhf_core/rl/test_logprobs.py), shared-prompt and packed layouts under flex / flash attention
# (tests/rlhf_core/ppo/test_ppo_layouts.py) and the rollout's cache release (tests/rlhf_core/ppo/test_rollout_memory.py),
# all `-m gpu`; then the figures of benchmarks/gpu/gpu_roles.py (Qwen2-0.5B / 1.5B shapes, random weights built
# there) and the CUDA-IPC weight hand-over (benchmarks/gpu/gpu_weight_sync.py). GPU time: about 5 minutes expected
# (the tests took 41.5 s on an H200 before the log-prob and layout tests joined; flex attention compiles there);
# capped at 8.7 minutes: tests 270 s, the benchmarks 150 s and 100 s.
#
# That machine's image has Python 3.12, torch + CUDA, transformers, peft, pyarrow, fsspec, pytest, and no
# deepspeed, ray, vllm, prefect, datasets or s3fs; nothing can be installed there from a registry. DeepSpeed
# and what it needs beyond the image travel as wheels in .whl/ (git-ignored; about 5 MB, 7.4 MB with Liger and TRL's).
# Prepare them once, here, in the repo root (benchmarks/gpu/gpu_kit.py; --liger adds liger-kernel for the log-prob
# test, --trl TRL's side of gpu_trainers.py):
#
#   .venv/bin/python benchmarks/gpu/gpu_kit.py prepare --liger --trl
#
# Then, through the device tool:
#
#   run(command="bash benchmarks/gpu/gpu_smoke.sh", carry=[".whl"], timeout_s=600)
#
# Everything lands in $OUT (default /tmp/gpu-smoke): env.txt, pytest.log, gpu_roles.log, gpu_roles.json.
#
# Layer (b), the whole ppo stage with Ray placement and vLLM's CUDA engine, cannot run there in full: Ray travels in
# two runs (benchmarks/gpu/gpu_ray.sh, with the HF engine), vLLM's CUDA wheel not at all. On a full GPU image
# (pip install ".[gpu]" with requirements/gpu-constraints.txt):  python -m pytest -m "gpu" tests/test_gpu.py
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repo root (this script moved into benchmarks/gpu/ with issue 34)
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
timeout -k 10 270 python3 -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -raP -m gpu \
  tests/rlhf_core/ppo/test_gpu_roles.py tests/rlhf_core/ppo/test_gpu_weight_sync.py tests/rlhf_core/rl/test_logprobs.py \
  tests/rlhf_core/ppo/test_ppo_layouts.py tests/rlhf_core/ppo/test_rollout_memory.py -q 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

timeout -k 10 150 python3 benchmarks/gpu/gpu_roles.py --device cuda 2>&1 | tee "$OUT/gpu_roles.log"
bench_rc=${PIPESTATUS[0]}

timeout -k 10 100 python3 benchmarks/gpu/gpu_weight_sync.py 2>&1 | tee "$OUT/gpu_weight_sync.log"
sync_rc=${PIPESTATUS[0]}

echo "gpu_smoke: tests exit $tests_rc, benchmark exit $bench_rc, weight sync exit $sync_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$sync_rc" -eq 0 ]
