#!/usr/bin/env bash
# Issue 36 item 6, for a lent GPU machine (written for it, not yet run: no GPU was lent to the session that wrote it):
# the ppo stage on Ray on the one GPU (colocated roles, CUDA IPC, HF engine, ZeRO-2 and ZeRO-3, bf16, two steps each)
# beside the same roles in-process (benchmarks/gpu/gpu_ray_stage.py). Ray 2.60's wheel (79 MB) is over the 64 MiB
# one call takes, so it goes in two runs made in quick succession, the machine kept warm between them (it keeps the
# ignored files a run left). Prepare everything once, here, in the repo root:
#
#   .venv/bin/python benchmarks/gpu/gpu_kit.py prepare --ray     # .whl/ (deepspeed, pydantic...), .ray-part0/, .ray-part1/
#
# then, through the device tool, one right after the other (about 40 + 45 MiB with the working tree):
#
#   run(command="bash benchmarks/gpu/gpu_ray.sh stash", carry=[".whl", ".ray-part0"], timeout_s=120)
#   run(command="bash benchmarks/gpu/gpu_ray.sh", carry=[".whl", ".ray-part1"], timeout_s=480)
#
# GPU time: the first run a few seconds (plus the machine's start, 1-2 minutes); the second about 4-5 minutes (Ray's
# install ~30 s, two stage runs of two steps ~2 x 70 s, the in-process roles ~2 x 30 s), capped at 420 s. If the
# machine went back between the two runs (its part 0 gone), the second says so: run both again. The first run can
# carry another script's work too (e.g. `bash benchmarks/gpu/gpu_ray.sh stash && bash benchmarks/gpu/gpu_issue36.sh`)
# when the time left allows.
#
# Everything lands in $OUT (default /tmp/gpu-ray): env.txt, gpu_ray.log, gpu_ray.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gpu-ray}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled

if [ "${1:-run}" = stash ]; then  # run 1: keep part 0 where the next run's carry does not replace it
  mkdir -p .ray-kit && cp .ray-part0/* .ray-kit/ && ls -la .ray-kit | tee "$OUT/stash.txt"
  exit $?
fi

manifest=$(ls .ray-part1/ray-*.whl.json .ray-kit/ray-*.whl.json 2>/dev/null | head -1)
[ -n "$manifest" ] || { echo "no ray-*.whl.json in .ray-part1/ or .ray-kit/: carry .ray-part1 (gpu_kit.py prepare --ray)" >&2; exit 2; }
python3 benchmarks/gpu/gpu_kit.py join "$manifest" .ray-kit .ray-part0 .ray-part1 --out /tmp/ray-wheel \
  || { echo "part 0 missing: the machine went back after the stash run; run both again in quick succession" >&2; exit 2; }
python3 -m zipfile -t /tmp/ray-wheel/ray-*.whl >/dev/null || { echo "the joined Ray wheel is not a valid zip" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .ray-part1/*.whl /tmp/ray-wheel/ray-*.whl || { echo "installing the wheels failed" >&2; exit 1; }
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH  # Ray's own scripts (ray, raylet's helpers) where it starts them by name

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, ray, deepspeed
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| ray', ray.__version__, '| deepspeed', deepspeed.__version__)"
} 2>&1 | tee "$OUT/env.txt"

timeout -k 10 420 python3 benchmarks/gpu/gpu_ray_stage.py --device cuda 2>&1 | tee "$OUT/gpu_ray.log"
rc=${PIPESTATUS[0]}
echo "gpu_ray: exit $rc"
exit "$rc"
