#!/usr/bin/env bash
# One device call: GPU tests, (optionally) compute-sanitizer over them, the engine benchmark and the
# peers, all in the same command so that ratios compare like with like. Logs under $OUT; a short
# table last. Usage (on the device, from the repo root): bench/device_run.sh [tests|sanitizer|bench|peers]...
set -u
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-8192x4096x128256,16384x2048x151936,4096x8192x152064,16384x4096x151936}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
for step in "$@"; do
  case $step in
    tests)
      timeout 300 ./build-cuda/bin/gpu_engine_test > "$OUT/gpu_test.log" 2>&1; echo "gpu tests rc=$?" ;;
    sanitizer)
      timeout 300 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
        ./build-cuda/bin/gpu_engine_test --gtest_filter=-*HundredThousand* > "$OUT/sanitizer.log" 2>&1
      echo "compute-sanitizer rc=$?" ;;
    bench)
      timeout 300 ./build-cuda/bin/lce_bench --shapes "$SHAPES" --json "$OUT/lce_bench.json" > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" ;;
    bench-*)  # bench-VAR=VALUE[,VAR=VALUE]: one variant on $VSHAPES
      v=${step#bench-}; echo "## variant $v" >> "$OUT/variants.log"; env ${v//,/ } timeout 200 ./build-cuda/bin/lce_bench --shapes "${VSHAPES:-$SHAPES}" --reps ${VREPS:-5} \
        >> "$OUT/variants.log" 2>&1; echo "variant $v rc=$?" ;;
    peers)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl \
        .whl/cut_cross_entropy-*.whl > "$OUT/pip.log" 2>&1
      PYTHONPATH=/tmp/site timeout 400 python3 .peers/peers.py --shapes "$SHAPES" --verl-wheel .whl/verl-*.whl \
        --json "$OUT/peers.json" > "$OUT/peers.log" 2>&1; echo "peers rc=$?" ;;
  esac
done
echo "== gpu"; cat "$OUT/gpu.txt"
[ -f "$OUT/gpu_test.log" ] && { echo "== tests"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|error|tests ran" "$OUT/gpu_test.log" | head -40; }
[ -f "$OUT/sanitizer.log" ] && { echo "== sanitizer"; tail -4 "$OUT/sanitizer.log"; }
[ -f "$OUT/variants.log" ] && { echo "== variants"; grep -E "^N=|^## |lce trace" "$OUT/variants.log" | cut -c1-200 | head -80; }
[ -f "$OUT/peers.log" ] && { echo "== peers"; cat "$OUT/peers.log"; }
[ -f "$OUT/bench.log" ] && { echo "== bench"; cat "$OUT/bench.log"; }
exit 0
