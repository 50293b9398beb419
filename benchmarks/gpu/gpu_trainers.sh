#!/usr/bin/env bash
# Issue 36 items 5 and 7, for a lent GPU machine (written for it, not yet run: no GPU was lent to the session that
# wrote it): (1) Liger against the liger-kernel release that travelled (0.8.5, pinned in gpu-constraints.txt; the
# fused log-probs need >= 0.8.2, whose reduction="none" weight gradients are right): the `gpu`
# tests that patch use_liger_kernel into a model (tests/rlhf_core/train/test_scale.py) and compare Liger's log-probs
# and gradients with the plain computation in fp32 and bf16 (tests/rlhf_core/rl/test_logprobs.py); (2) the training
# stages' jobs in bf16 at the Qwen2-0.5B shape, DPO / SFT / KTO each followed by TRL 1.16's trainer at its best on
# the same rows, then train_rm, kd, train_prm and sft with use_liger_kernel (benchmarks/gpu/gpu_trainers.py). GPU
# time: about 6.5 minutes expected (a process per side: imports, the model's load and DeepSpeed's start dominate),
# capped at 8.3 minutes (tests 60 s, the figures 420 s). Prepare the wheels once, here, in the repo root (TRL,
# datasets, dill and multiprocess, about 1.5 MB, and liger-kernel beside DeepSpeed's):
#
#   .venv/bin/python benchmarks/gpu/gpu_kit.py prepare --trl --liger
#
#   run(command="bash benchmarks/gpu/gpu_trainers.sh", carry=[".whl"], timeout_s=560)
#
# Everything lands in $OUT (default /tmp/gpu-trainers): env.txt, pytest.log, gpu_trainers.log, gpu_trainers.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gpu-trainers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl/*.whl failed (gpu_kit.py prepare --trl --liger)" >&2; exit 1; }
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, deepspeed, trl, datasets
import importlib.metadata as m
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| deepspeed', deepspeed.__version__, '| trl', trl.__version__,
      '| datasets', datasets.__version__, '| liger-kernel', m.version('liger-kernel'))"; } 2>&1 | tee "$OUT/env.txt"

timeout -k 10 60 python3 -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -raP -m gpu -k liger \
  tests/rlhf_core/train/test_scale.py tests/rlhf_core/rl/test_logprobs.py -q 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

timeout -k 10 420 python3 benchmarks/gpu/gpu_trainers.py --device cuda 2>&1 | tee "$OUT/gpu_trainers.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_trainers: liger tests exit $tests_rc, figures exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
