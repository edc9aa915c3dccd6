#!/usr/bin/env bash
# GPU timeline of the transport bench (bench/gpu_timeline.cc) in one device call, .devbin/ (with
# liblce_gpu_timeline.so and libcupti.so.13) and .rtpack/ carried: the server and the bench run
# with the CUPTI recorder injected, then bench/gpu_timeline_summary.py prints, for each process,
# its engine calls, their GEMMs and the GPU's idle time between the calls of a request.
# env: as bench/device_transport_run.sh (CHUNK, ITERS, MODES, BENCH_FLAGS, SERVER_FLAGS, ...);
#      TAG names the run (default: timeline): the timelines go to /tmp/$TAG (large), the run's log,
#      server log and summary to $OUT/$TAG.*.
set -u
source "$(dirname "$0")/device_transport_env.sh"
export LD_LIBRARY_PATH=$PWD/.devbin:$LD_LIBRARY_PATH
TAG=${TAG:-timeline}
DIR=/tmp/$TAG
mkdir -p "$DIR"
CUDA_INJECTION64_PATH=$PWD/.devbin/liblce_gpu_timeline.so LCE_GPU_TIMELINE_DIR=$DIR \
  bash "$(dirname "$0")/device_transport_run.sh" "$@" > "$DIR/run.log" 2>&1
cp "$OUT/server.log" "$OUT/$TAG.server.log"
cp "$DIR/run.log" "$OUT/$TAG.run.log"
grep -E "^\| (engine|data plane)" "$DIR/run.log"
for f in "$DIR"/timeline.*.csv; do
  [ -s "$f" ] && python3 "$(dirname "$0")/gpu_timeline_summary.py" "$f" --rows "${N}" | grep -v "no engine calls"
done | tee "$OUT/$TAG.summary.md"
