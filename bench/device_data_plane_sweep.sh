#!/usr/bin/env bash
# The data plane's chunk plan on one GPU (issue 7): one lce_server (--data-port=0), then
# lce_transport_bench over the data plane for each "STREAMS:CHUNK:FIRST:LAST[:GROW]" of $CONFIGS
# (bytes; FIRST/LAST 0: full chunks; GROW 1: ClientOptions.grow_chunks), each followed by the server's account of its requests (request log)
# and the client's and server's steps lined up (bench/transport_trace_summary.py).
# .devbin/ and .rtpack/ carried. Usage: bench/device_data_plane_sweep.sh [ROWS] [HIDDEN] [VOCAB]
# env: CONFIGS, ITERS=5, WARMUP=1, MODES=tcp (add engine for the floor, wire for the sockets alone),
#      SOCKETS=4 (a direction), SERVER_FLAGS (extra
#      lce_server flags, e.g. --pipeline-chunks=false)
set -u
source "$(dirname "$0")/device_transport_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
rm -f /tmp/lce.port
./.devbin/lce_server --port=0 --port-file=/tmp/lce.port --backend=cuda --seed-head="${V}x${H}" --seed=0 \
  --head-dtype=bf16 --log-requests=true --data-port=0 ${SERVER_FLAGS:-} > /dev/null 2> "$OUT/server.log" &
SERVER=$!
for _ in $(seq 600); do [ -s /tmp/lce.port ] && break; sleep 0.2; done
for cfg in ${CONFIGS:-2:8388608:1048576:1048576}; do
  IFS=: read -r s chunk first last grow <<< "$cfg"
  echo "== streams $s, chunk $chunk, first $first, last $last, grow ${grow:-0}"
  from=$(($(wc -l < "$OUT/server.log") + 1))
  ./.devbin/lce_transport_bench --target=127.0.0.1:$(cat /tmp/lce.port) --rows="$N" --hidden="$H" --vocab="$V" \
    --seed=0 --tcp-streams="$s" --chunk-bytes="$chunk" --first-chunk-bytes="${first:-0}" \
    --last-chunk-bytes="${last:-0}" --grow-chunks="${grow:-0}" --tcp-sockets="${SOCKETS:-4}" --iterations="${ITERS:-5}" --warmup="${WARMUP:-1}" --modes="${MODES:-tcp}" \
    --trace-file=/tmp/trace.jsonl 2>&1 |
    tee -a "$OUT/transport.log" | grep -E "^\| [a-z0-9]" | grep -v "^| path"
  { python3 bench/transport_log_summary.py "$OUT/server.log" "$from"
    python3 bench/transport_trace_summary.py /tmp/trace.jsonl "$OUT/server.log" "$from"; } | tee -a "$OUT/transport.log"
done
kill $SERVER; wait $SERVER 2>/dev/null
