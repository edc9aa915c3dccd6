#!/usr/bin/env bash
# Transport on one GPU (issue 7), in one device call with .devbin/ and .rtpack/ carried:
#   1. the CUDA IPC test (this process's GPU memory used by lce_server in a second process);
#   2. lce_transport_bench: the same score and train requests as engine only (in process, device
#      memory), over gRPC on loopback with 1..S streams, over the data plane (TCP) with 1..S
#      streams, over shared memory, and over CUDA IPC.
# Usage: bench/device_transport_run.sh [ROWS] [HIDDEN] [VOCAB]
# env: STREAMS="1,2,4,8", TCP_STREAMS="1,2,4", LOG_REQUESTS=false, CHUNK=4194304, ITERS=5, MODES, SERVER_FLAGS (extra lce_server flags),
#      BENCH_FLAGS (extra lce_transport_bench flags), GRPC_POLL_STRATEGY (both ends)
set -u
source "$(dirname "$0")/device_transport_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
if [ -x .devbin/gpu_ipc_test ]; then
  LCE_SERVER_BIN=$PWD/.devbin/lce_server ./.devbin/gpu_ipc_test > "$OUT/gpu_ipc_test.log" 2>&1
  echo "gpu_ipc_test exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|Failure|error" "$OUT/gpu_ipc_test.log" | head -20
fi
rm -f /tmp/lce.port
./.devbin/lce_server --port=0 --port-file=/tmp/lce.port --backend=cuda --seed-head="${V}x${H}" --seed=0 \
  --head-dtype=bf16 --log-requests=${LOG_REQUESTS:-false} --max-message-bytes=67108864 --data-port=0 ${SERVER_FLAGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do [ -s /tmp/lce.port ] && break; sleep 0.2; done
./.devbin/lce_transport_bench --target=127.0.0.1:$(cat /tmp/lce.port) --rows="$N" --hidden="$H" --vocab="$V" --seed=0 \
  --streams="${STREAMS:-1,2,4,8}" --tcp-streams="${TCP_STREAMS:-1,2,4}" --chunk-bytes="${CHUNK:-4194304}" --iterations="${ITERS:-5}" --warmup=1 \
  ${MODES:+--modes=$MODES} ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/transport.log"
kill $SERVER; wait $SERVER 2>/dev/null
tail -5 "$OUT/server.log"
