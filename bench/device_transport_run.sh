#!/usr/bin/env bash
# Transport baseline on one GPU: engine-only time (lce_bench, device memory) against end-to-end time
# of the same train/score request through lce_server over gRPC on loopback (lce_cli bench: one
# stream, host memory, bf16). Usage on the device, with .devbin/ and .rtpack/ carried:
#   bench/device_transport_run.sh [ROWS] [HIDDEN] [VOCAB]
set -u
[ -d .rt/lib ] || tar -xJf .rtpack/rt.tar.xz
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${1:-8192} H=${2:-4096} V=${3:-128256}
./.devbin/lce_bench --shapes "${N}x${H}x${V}" > "$OUT/engine.log" 2>&1
rm -f /tmp/lce.port
./.devbin/lce_server --port=0 --port-file=/tmp/lce.port --backend=cuda --seed-head="${V}x${H}" --head-dtype=bf16 \
  --log-requests=false --max-message-bytes=67108864 > "$OUT/server.log" 2>&1 &
for _ in $(seq 600); do [ -s /tmp/lce.port ] && break; sleep 0.2; done
T=127.0.0.1:$(cat /tmp/lce.port)
for chunk in ${CHUNKS:-4194304}; do
  for op in train score; do
    echo "chunk-bytes $chunk" >> "$OUT/e2e.log"
    ./.devbin/lce_cli bench --target="$T" --op=$op --rows="$N" --iterations=5 --warmup=1 --chunk-bytes=$chunk \
      >> "$OUT/e2e.log" 2>&1
  done
done
kill %1; wait
cat "$OUT/engine.log" | tail -4; cat "$OUT/e2e.log"
