#!/usr/bin/env bash
# Issue 36 items 2 and 3, for a lent GPU machine (written for it, not yet run: no GPU was lent to the session that
# wrote it), ordered by value: (1) the ppo learner's step vs the bare loop vs the GPU's peak at the Qwen2-0.5B shape,
# micro-batches 64 and 16, ZeRO-2 with and without DeepSpeed's overflow scan, with torch.profiler tables of the
# learner's and the bare loop's step (benchmarks/gpu/gpu_learner.py); (2) the in-process HF rollout alone vs after
# a micro-16 / micro-64 learner step, with the variants that tell allocator, GC and clock causes apart and the
# engine's cache release (benchmarks/gpu/gpu_rollout_after_learner.py); (3) the rest of the learner grid: the
# Qwen2-1.5B shape (bare and ZeRO-2 at both micro-batches), then ZeRO-3, bf16 bare and ZeRO-0 at 0.5B, ZeRO-3 at 1.5B.
# GPU time: about 6.5 minutes expected, capped at 8.3 minutes (120 s, 180 s, 180 s, ~20 s of installs), so a rerun of
# a part fits a 15-minute session. Same wheels as gpu_smoke.sh (.whl/, benchmarks/gpu/gpu_kit.py prepare):
#
#   run(command="bash benchmarks/gpu/gpu_issue36.sh", carry=[".whl"], timeout_s=600)
#
# Everything lands in $OUT (default /tmp/gpu-issue36), 7 files (8 come back at most): env.txt, run.log,
# gpu_learner_core.json, gpu_learner_rest.json, gpu_rollout.json, profile_0.5b_m64_{bare,learner_z2}.txt. A part cut
# by its cap keeps what it measured (one JSON record per measurement).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/gpu-issue36}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; python3 -c "import torch, deepspeed
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| deepspeed', deepspeed.__version__)"; } 2>&1 | tee "$OUT/env.txt"

timeout -k 10 120 python3 benchmarks/gpu/gpu_learner.py --profile \
  --plan "0.5b:64:bare,learner_z2,learner_z2_scan;0.5b:16:bare,learner_z2" 2>&1 | tee -a "$OUT/run.log"
core_rc=${PIPESTATUS[0]}
mv "$OUT/gpu_learner.json" "$OUT/gpu_learner_core.json" 2>/dev/null

timeout -k 10 180 python3 benchmarks/gpu/gpu_rollout_after_learner.py 2>&1 | tee -a "$OUT/run.log"
rollout_rc=${PIPESTATUS[0]}

timeout -k 10 180 python3 benchmarks/gpu/gpu_learner.py \
  --plan "1.5b:64:bare,learner_z2;1.5b:16:bare,learner_z2;0.5b:64:learner_z3,bare_bf16,learner_z0;0.5b:16:learner_z3;1.5b:64:learner_z3" \
  2>&1 | tee -a "$OUT/run.log"
rest_rc=${PIPESTATUS[0]}
mv "$OUT/gpu_learner.json" "$OUT/gpu_learner_rest.json" 2>/dev/null

echo "gpu_issue36: learner core exit $core_rc, rollout exit $rollout_rc, learner rest exit $rest_rc"
[ "$core_rc" -eq 0 ] && [ "$rollout_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
