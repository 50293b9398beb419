#!/usr/bin/env bash
# One Ray node in the foreground (`ray start --block`: it exits, and stops the node's processes, on SIGTERM).
# rlhf_ray.sbatch runs it by srun once per node of the allocation:
#   ray_node.sh head HEAD_IP      GCS on $RAY_PORT (6379), the job API on $RAY_DASHBOARD_PORT (8265)
#   ray_node.sh worker HEAD_IP    joins HEAD_IP:$RAY_PORT
# More `ray start` flags (--num-gpus, --temp-dir, fixed ports) in $RAY_HEAD_ARGS / $RAY_WORKER_ARGS.
set -euo pipefail
role=${1:?head or worker}
head_ip=${2:?the head node\'s address}
port=${RAY_PORT:-6379}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
case "$role" in
  head)
    # shellcheck disable=SC2086  # the extra flags are words
    exec ray start --head --block --node-ip-address "$head_ip" --port "$port" \
      --dashboard-host "${RAY_DASHBOARD_HOST:-0.0.0.0}" --dashboard-port "${RAY_DASHBOARD_PORT:-8265}" ${RAY_HEAD_ARGS:-} ;;
  worker)
    # shellcheck disable=SC2086
    exec ray start --block --address "$head_ip:$port" ${RAY_WORKER_ARGS:-} ;;
  *)
    echo "ray_node.sh: role must be head or worker, got '$role'" >&2; exit 2 ;;
esac
