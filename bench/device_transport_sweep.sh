#!/usr/bin/env bash
# Where the gRPC path's time goes (issue 7): lce_bench at several row counts (the engine's cost of
# one chunk), then lce_transport_bench over gRPC for each "STREAMS:CHUNK_BYTES:WINDOW_BYTES" of
# $CONFIGS ("STREAMS:CHUNK_BYTES:WINDOW_BYTES[:GRPC_CQS[:CHANNEL_ARGS[:FIRST_CHUNK_BYTES[:POLL]]]]",
# CHANNEL_ARGS as K=V,K=V and POLL a GRPC_POLL_STRATEGY, for both ends), each followed by the server's own account of the requests (request log: duration,
# engine time, engine calls, queue time). .devbin/ and .rtpack/ carried.
# Usage: bench/device_transport_sweep.sh [ROWS] [HIDDEN] [VOCAB]
set -u
source "$(dirname "$0")/device_transport_env.sh"
if [ -n "${ENGINE_ROWS:-}" ]; then
  shapes=$(for r in $ENGINE_ROWS; do printf "%sx%sx%s," "$r" "$H" "$V"; done)
  ./.devbin/lce_bench --shapes "${shapes%,}" --reps 5 --warmup 2 > "$OUT/engine_rows.log" 2>&1
  grep -E "^\||rows|train|score" "$OUT/engine_rows.log" | tail -20
fi
start_server() {  # $1: window bytes, $2: completion queues, $3: log file, $4: channel args
  rm -f /tmp/lce.port
  ./.devbin/lce_server --port=0 --port-file=/tmp/lce.port --backend=cuda --seed-head="${V}x${H}" --seed=0 \
    --head-dtype=bf16 --log-requests=true --max-message-bytes=134217728 --http2-window-bytes="$1" \
    --grpc-cqs="$2" ${4:+--grpc-channel-args=$4} 2> "$3" > /dev/null &
  SERVER=$!
  for _ in $(seq 600); do [ -s /tmp/lce.port ] && break; sleep 0.2; done
}
for cfg in ${CONFIGS:-1:4194304:0 4:4194304:0}; do
  IFS=: read -r s chunk w cqs args first poll <<< "$cfg"
  first=${first:-0}
  if [ -n "${poll:-}" ]; then export GRPC_POLL_STRATEGY=$poll; else unset GRPC_POLL_STRATEGY; fi
  cqs=${cqs:-0}
  n=$((${n:-0} + 1))
  log="$OUT/server_$n.log"
  start_server "$w" "$cqs" "$log" "$args"
  echo "== streams $s, chunk $chunk bytes (first $first), http2 window $w, grpc cqs $cqs, channel args ${args:-none}, poll ${poll:-default}"
  ./.devbin/lce_transport_bench --target=127.0.0.1:$(cat /tmp/lce.port) --rows="$N" --hidden="$H" --vocab="$V" \
    --seed=0 --modes=grpc --streams="$s" --chunk-bytes="$chunk" --http2-window-bytes="$w" ${args:+--grpc-channel-args=$args} --first-chunk-bytes="$first" --iterations=4 --warmup=1 \
    2>&1 | grep -E "^\| grpc|[A-Z_]+: "
  python3 bench/transport_log_summary.py "$log"
  kill $SERVER; wait $SERVER 2>/dev/null
done
