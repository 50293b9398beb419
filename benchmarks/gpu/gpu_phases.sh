#!/usr/bin/env bash
# Issues 35 and 41, for a lent GPU machine (written for it, not yet run): the CUDA IPC leak repro and every moment of
# the memory plan in-process at the Qwen2-0.5B and 1.5B shapes (setup, entering and in generate / train / sync, a
# resume), each moment's allocator peak beside the plan's prediction (benchmarks/gpu/gpu_phases.py), then the learner's
# sleep / wake at ZeRO-2 and ZeRO-3 (FusedAdam: tests/rlhf_core/ppo/test_gpu_roles.py -k sleeps). Under 5 minutes: the
# figures capped at 200 s, the tests at 80 s.
# Same image and wheels as gpu_smoke.sh (its header says how to prepare .whl/):
#
#   run(command="bash benchmarks/gpu/gpu_phases.sh", carry=[".whl"], timeout_s=330)
#
# Everything lands in $OUT (default /tmp/gpu-phases): env.txt, gpu_phases.log, gpu_phases.json, pytest.log. Put the
# phase peaks into benchmarks/gpu/measured_peaks.json (with this command) so the CPU test checks the plan on them.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gpu-phases}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, deepspeed
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| deepspeed', deepspeed.__version__)"; } 2>&1 | tee "$OUT/env.txt"

timeout -k 10 200 python3 benchmarks/gpu/gpu_phases.py 2>&1 | tee "$OUT/gpu_phases.log"
phases_rc=${PIPESTATUS[0]}

timeout -k 10 80 python3 -m pytest -p no:cacheprovider -o addopts="" --import-mode=importlib -raP -m gpu \
  tests/rlhf_core/ppo/test_gpu_roles.py -k sleeps -q 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

echo "gpu_phases: figures exit $phases_rc, sleep tests exit $tests_rc"
[ "$phases_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
