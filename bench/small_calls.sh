#!/usr/bin/env bash
# Small calls end to end (issue 21): for each server configuration, an lce_server on a seeded head on
# loopback, then the C++ client (lce_small_calls_bench) and the Python client (bench/small_calls.py):
# a Score of each of $ROWS rows end to end against the server's engine time of the same call, and
# the rate of 1-row Scores from $CONCURRENCY callers at once (C++ threads; Python asyncio).
# Usage: bench/small_calls.sh   (from the repository root), with in the environment
#   CONFIGS   "NAME:FLAG:FLAG ..." one server each (default: batching off, and on with 256 rows)
#   BACKEND   cpu | cuda (default cpu); VOCAB, HIDDEN, DTYPE (default 32000, 1024, fp32)
#   SERVER_FLAGS  more server flags for every configuration (e.g. --batch-invariant=true on CUDA)
#   ROWS, ITERS, WARMUP, CONCURRENCY, DURATION (seconds of the rate; default 1,16,64; 200; 20; 64; 5)
#   SERVER_BIN, BENCH_BIN (default build/bin/...), PYTHON (default .venv/bin/python, else python3;
#   the Python part is skipped where it cannot import lce_client)
#   BENCH_FLAGS  more flags for lce_small_calls_bench (e.g. --channel-args=grpc.http2.max_frame_size=1048576)
#   PY_FLAGS  more flags for bench/small_calls.py (e.g. --no-coalesce: the asyncio client sends one RPC
#   a call instead of merging concurrent calls)
# Prints markdown tables; the servers' logs go to $OUT (default /tmp/small_calls).
set -u
OUT=${OUT:-/tmp/small_calls}; mkdir -p "$OUT"
SERVER_BIN=${SERVER_BIN:-build/bin/lce_server}
BENCH_BIN=${BENCH_BIN:-build/bin/lce_small_calls_bench}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CONFIGS=${CONFIGS:-off:--batch-max-rows=0 on:--batch-max-rows=256}
common=(--rows="${ROWS:-1,16,64}" --iterations="${ITERS:-200}" --warmup="${WARMUP:-20}"
        --concurrency="${CONCURRENCY:-64}" --seconds="${DURATION:-5}")
python_ok=0
"$PYTHON" -c "import lce_client" 2>/dev/null && python_ok=1
n=0
for cfg in $CONFIGS; do
  name=${cfg%%:*}; flags=${cfg#*:}; [ "$flags" = "$cfg" ] && flags=""
  n=$((n + 1)); log="$OUT/server_$n.log"; rm -f "$OUT/port"
  # shellcheck disable=SC2086
  "$SERVER_BIN" --host=127.0.0.1 --port=0 --port-file="$OUT/port" --metrics-port=0 --metrics-host=127.0.0.1 \
    --backend="${BACKEND:-cpu}" --seed-head="${VOCAB:-32000}x${HIDDEN:-1024}" --head-dtype="${DTYPE:-fp32}" \
    --log-requests=false ${SERVER_FLAGS:-} ${flags//:/ } > "$log" 2>&1 &
  server=$!
  for _ in $(seq 600); do [ -s "$OUT/port" ] && grep -q "metrics on" "$log" && break; sleep 0.2; done
  port=$(cat "$OUT/port")
  mport=$(sed -n 's|.*metrics on http://[^:]*:\([0-9]*\)/metrics.*|\1|p' "$log" | head -1)
  echo "## $name (server flags: ${SERVER_FLAGS:-} ${flags//:/ })"
  echo
  "$BENCH_BIN" --target=127.0.0.1:"$port" --metrics=127.0.0.1:"$mport" --label="$name" --server-pid="$server" "${common[@]}" ${BENCH_FLAGS:-}
  echo
  if [ $python_ok = 1 ]; then
    # shellcheck disable=SC2086
    "$PYTHON" bench/small_calls.py --target 127.0.0.1:"$port" --metrics 127.0.0.1:"$mport" --label "$name" \
      "${common[@]}" ${PY_FLAGS:-}
  else
    echo "(Python client: $PYTHON cannot import lce_client; skipped)"
  fi
  echo
  kill "$server"; wait "$server" 2>/dev/null
done
