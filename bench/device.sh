#!/usr/bin/env bash
# One entry point for runs on the GPU machine (the device tool), from the repo root, with .devbin/
# (stripped binaries: bench/device_pack.sh) and .rtpack/rt.tar.xz (runtime libraries) carried.
# Every log lands under $OUT; a summary is printed last.
# Usage: bench/device.sh STEP...   STEP is one of
#   gpu-tests[=FILTER]        gpu_engine_test (gtest filter)
#   e2e-cuda[=FILTER]         e2e_test against lce_server --backend=cuda
#   bench[=VAR=V:VAR=V]       lce_bench on $SHAPES (default: the five issue shapes), with env vars set
#   bin=NAME[:ARGS]           any .devbin binary with ARGS (':' for spaces), output to $OUT/NAME.log
set -u
[ -d .rt/lib ] || tar -xJf .rtpack/rt.tar.xz
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export LCE_SERVER_BIN=$PWD/.devbin/lce_server LCE_CLI_BIN=$PWD/.devbin/lce_cli NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-8192x4096x128256,16384x2048x151936,4096x8192x152064,16384x4096x151936,4096x2880x201088}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
for step in "$@"; do
  arg=${step#*=}; [ "$arg" = "$step" ] && arg=""
  case ${step%%=*} in
    gpu-tests)
      timeout 400 ./.devbin/gpu_engine_test ${arg:+--gtest_filter=$arg} > "$OUT/gpu_test.log" 2>&1
      echo "gpu tests rc=$?" ;;
    e2e-cuda)
      LCE_TEST_BACKEND=cuda timeout 400 ./.devbin/e2e_test ${arg:+--gtest_filter=$arg} > "$OUT/e2e_cuda.log" 2>&1
      echo "e2e (cuda) rc=$?" ;;
    bench)
      echo "## bench ${arg:-default}" >> "$OUT/bench.log"
      env ${arg//:/ } timeout 300 ./.devbin/lce_bench --shapes "$SHAPES" --reps ${REPS:-7} >> "$OUT/bench.log" 2>&1
      echo "bench ${arg:-default} rc=$?" ;;
    bin)
      name=${arg%%:*}; args=${arg#*:}; [ "$args" = "$arg" ] && args=""
      timeout 400 ./.devbin/$name ${args//:/ } > "$OUT/$name.log" 2>&1; echo "$name rc=$?" ;;
  esac
done
echo "== gpu"; cat "$OUT/gpu.txt"
for f in gpu_test e2e_cuda; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|rror|tests ran|^\[  FAILED" "$OUT/$f.log" | head -40; }
done
[ -f "$OUT/bench.log" ] && { echo "== bench"; cat "$OUT/bench.log"; }
exit 0
