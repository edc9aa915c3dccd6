#!/usr/bin/env bash
# Starts a tensor-parallel group of K lce_server ranks on this host as one unit, and restarts the
# whole group whenever any rank exits abnormally (a dead or hung peer makes every rank exit with
# code 3). SIGTERM/SIGINT stop the group gracefully: rank 0 drains its streams, then stops its peers.
#
# Usage: lce_tp_launch.sh K [--restarts=N] -- LCE_SERVER_FLAGS...
#   e.g. lce_tp_launch.sh 2 -- --port=50051 --backend=cpu --seed-head=151936x4096
# Environment: LCE_SERVER (binary, default build/bin/lce_server next to this repo, else the
#   lce_server installed beside this script),
#   LCE_TP_RENDEZVOUS (a directory that holds each start's own fresh one, made here with mode
#   0700; default a fresh temporary one), CUDA_VISIBLE_DEVICES is set to
#   the rank (plus LCE_TP_GPU_OFFSET, default 0) for each rank when LCE_TP_BIND_GPUS=1.
# A rank that exits with code 4 (a data-parallel replica whose job formed without it: it cannot
# rejoin, see lce_dp_launch.sh) is not restarted: the launcher exits 4.
# Any failed step stops the launch; the launcher removes only directories it made.
set -euo pipefail
K=${1:?usage: lce_tp_launch.sh K [--restarts=N] -- FLAGS...}
shift
RESTARTS=1000000
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --restarts=*) RESTARTS=${1#--restarts=} ;;
    *) echo "lce_tp_launch: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "${1:-}" = "--" ] && shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
SERVER=${LCE_SERVER:-$HERE/build/bin/lce_server}
# Installed (cmake --install, the .deb): the lce_server beside this script.
[ -n "${LCE_SERVER:-}" ] || [ -x "$SERVER" ] || SERVER=$(cd "$(dirname "$0")" && pwd)/lce_server
if [ -n "${LCE_TP_RENDEZVOUS:-}" ]; then
  BASE=$LCE_TP_RENDEZVOUS
  mkdir -p -m 0700 -- "$BASE"   # may exist already (a mounted volume): only our own start directories go in it
else
  BASE=$(mktemp -d -t lce-tp-XXXXXX)   # 0700, kept so
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

pids=()
stopping=0
stop_group() {
  stopping=1
  if [ ${#pids[@]} -gt 0 ]; then kill -TERM "${pids[0]}" 2>/dev/null || true; fi   # the front stops its peers
}
trap stop_group TERM INT

attempt=0
RDV=
while :; do
  # Each start meets in a fresh directory of its own (mktemp: 0700); the last start's, which this
  # launcher made, goes.
  if [ -n "$RDV" ]; then rm -rf -- "$RDV"; fi
  RDV=$(mktemp -d -- "$BASE/start-XXXXXX")
  pids=()
  for ((r = 0; r < K; r++)); do
    if [ "${LCE_TP_BIND_GPUS:-0}" = 1 ]; then export CUDA_VISIBLE_DEVICES=$((${LCE_TP_GPU_OFFSET:-0} + r)); fi
    "$SERVER" "$@" --tp-size="$K" --tp-rank="$r" --tp-rendezvous="$RDV" &
    pids+=($!)
  done
  # Wait until any rank exits; then the group is over, one way or the other.
  code=0
  wait -n "${pids[@]}" || code=$?
  if [ $stopping = 1 ]; then
    wait "${pids[@]}" 2>/dev/null || true
    echo "lce_tp_launch: group stopped"
    exit 0
  fi
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  if [ "$code" = 4 ]; then
    echo "lce_tp_launch: the data-parallel job formed without this group; start the whole job again" >&2
    exit 4
  fi
  echo "lce_tp_launch: a rank exited with code $code; restarting the whole group" >&2
  attempt=$((attempt + 1))
  if [ "$attempt" -gt "$RESTARTS" ]; then
    echo "lce_tp_launch: giving up after $RESTARTS restarts" >&2
    exit 1
  fi
  sleep 1
done
