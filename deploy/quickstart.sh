#!/usr/bin/env bash
# The main job on its embedded default: install dependencies, build, start lce_server with the CPU
# engine and a seeded head (V=32000, H=512, bf16), score a sample batch and run one
# forward-backward with the CLI client, then stop the server (SIGTERM, graceful).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD=${LCE_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$BUILD" -j "$(nproc)" lce_server lce_cli

PORT_FILE=$(mktemp)
rm -f "$PORT_FILE"
SERVER_LOG="$BUILD/quickstart-server.log"   # its JSON request logs, one line per RPC
"$BUILD/bin/lce_server" --port=0 --port-file="$PORT_FILE" --backend=cpu --seed-head=32000x512 --seed=0 \
  > "$SERVER_LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; rm -f "$PORT_FILE"' EXIT
for _ in $(seq 100); do [ -s "$PORT_FILE" ] && break; sleep 0.1; done
TARGET=127.0.0.1:$(cat "$PORT_FILE")
CLI="$BUILD/bin/lce_cli"
echo "== health";            "$CLI" health --target="$TARGET"
echo "== info";              "$CLI" info --target="$TARGET"
echo "== score (16 rows)";   "$CLI" score --target="$TARGET" --rows=16 --seed=1
echo "== forward-backward";  "$CLI" forward-backward --target="$TARGET" --rows=256 --seed=2 --reduction=mean
echo "== server log ($SERVER_LOG)"; tail -n 3 "$SERVER_LOG"
