#!/usr/bin/env bash
# Starts a data-parallel training job of R replicas on this host, each a tensor-parallel group of K
# lce_server ranks (R x K processes), in a fresh rendezvous directory. Each replica runs under
# lce_tp_launch.sh with --restarts=0: a replica restarted alone could not rejoin the job (its links
# would meet stale addresses), so a replica that fails stays down -- the job's training calls answer
# UNAVAILABLE naming it, the other replicas keep scoring -- until the whole job is started again.
# SIGTERM/SIGINT stop every replica gracefully. The launcher exits when every replica has exited.
#
# Usage: lce_dp_launch.sh R K -- LCE_SERVER_FLAGS...
#   e.g. lce_dp_launch.sh 2 2 -- --port=50051 --metrics-port=9400 --backend=cpu --seed-head=151936x4096
# Replica d's front gets --port, --metrics-port and --data-port plus d (where they are not 0) and
# --port-file=FILE.d, so that R fronts on one host do not collide.
# Environment: LCE_SERVER (binary), LCE_DP_RENDEZVOUS (a directory that must not exist yet: the
#   launcher makes it, mode 0700; default a fresh temporary one), LCE_TP_BIND_GPUS=1 gives rank r
#   of replica d the GPU d*K + r.
# The rendezvous directory is trusted with the fronts' addresses: whoever can write it could draw
# the job's calls (with the clients' tokens) elsewhere. So it is always one this launcher made,
# only its user can write it, and any failed step stops the launch.
set -euo pipefail
R=${1:?usage: lce_dp_launch.sh R K -- FLAGS...}
K=${2:?usage: lce_dp_launch.sh R K -- FLAGS...}
shift 2
[ "${1:-}" = "--" ] && shift
HERE=$(cd "$(dirname "$0")" && pwd)
TP_LAUNCH=${LCE_TP_LAUNCH:-$HERE/lce_tp_launch.sh}
if [ -n "${LCE_DP_RENDEZVOUS:-}" ]; then
  RDV=$LCE_DP_RENDEZVOUS
  mkdir -p -- "$(dirname -- "$RDV")"
  # Never someone else's (or an old job's) directory: it is not emptied, the launch stops.
  mkdir -m 0700 -- "$RDV" || { echo "lce_dp_launch: cannot make $RDV (it must not exist yet)" >&2; exit 1; }
else
  RDV=$(mktemp -d -t lce-dp-XXXXXX)   # 0700, kept so
fi

# Replica d's server flags: the front's ports offset by d, its port file suffixed with .d.
replica_flags() {
  local d=$1; shift
  local a
  for a in "$@"; do
    case "$a" in
      --port=*|--metrics-port=*|--data-port=*)
        local name=${a%%=*} value=${a#*=}
        if [ "$value" -gt 0 ] 2>/dev/null; then a="$name=$((value + d))"; fi ;;
      --port-file=*) a="$a.$d" ;;
    esac
    printf '%s\0' "$a"
  done
}

pids=()
stopping=0
stop_job() {
  stopping=1
  if [ ${#pids[@]} -gt 0 ]; then kill -TERM "${pids[@]}" 2>/dev/null || true; fi
}
trap stop_job TERM INT

for ((d = 0; d < R; d++)); do
  mapfile -d '' flags < <(replica_flags "$d" "$@")
  LCE_TP_RENDEZVOUS="$RDV/group-$d" LCE_TP_GPU_OFFSET=$((d * K)) \
    "$TP_LAUNCH" "$K" --restarts=0 -- "${flags[@]}" \
    --dp-size="$R" --dp-rank="$d" --dp-rendezvous="$RDV/job" &
  pids+=($!)
done
while :; do
  code=0
  wait -n "${pids[@]}" || code=$?
  if [ $stopping = 1 ]; then
    wait "${pids[@]}" 2>/dev/null || true
    echo "lce_dp_launch: job stopped"
    exit 0
  fi
  if [ "$code" -ne 0 ]; then
    echo "lce_dp_launch: a replica exited with code $code; the job's training is down until the job is" \
         "started again, the other replicas keep scoring" >&2
  fi
  alive=0
  for p in "${pids[@]}"; do if kill -0 "$p" 2>/dev/null; then alive=$((alive + 1)); fi; done
  if [ "$alive" -eq 0 ]; then break; fi
done
echo "lce_dp_launch: every replica has exited"
