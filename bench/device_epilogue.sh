#!/usr/bin/env bash
# The epilogue-statistics GEMM's runs on the GPU machine (issue 19), from a folder carried as is:
# gpu_engine_test and lce_bench (stripped) and rt.tar.xz (runtime libraries, bench/device_pack.sh's
# kind) beside this script. Logs land under $OUT; the summary is printed last.
# Usage: bash device_epilogue.sh STEP...   STEP is one of
#   epi-tests            gpu_engine_test's EpilogueStats* tests
#   tests-on / tests-off CudaTest.* (VocabParallelStatisticsBitForBit left out: training only, 37 s)
#                        with LCE_CUDA_EPILOGUE_STATS=1 / unset
#   bench=K[:VAR=V...]   lce_bench --score-ab on $SHAPES, LCE_CUDA_EPI_KERNEL=K and the given variables
#   memcheck / racecheck compute-sanitizer over two of the EpilogueStats tests
set -u
cd "$(dirname "$0")"
[ -d rt ] || tar -xJf rt.tar.xz
export LD_LIBRARY_PATH=$PWD/rt:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-8192x4096x128256,16384x2048x151936,4096x8192x152064,16384x4096x151936,4096x2880x201088,64x4096x151936,16x4096x151936,1x4096x151936}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
small='EpilogueStatsTest.AgreesWithTheLogitTilePath:EpilogueStatsTest.ExtremeLogits'
for step in "$@"; do
  arg=${step#*=}; [ "$arg" = "$step" ] && arg=""
  case ${step%%=*} in
    epi-tests) timeout 300 ./gpu_engine_test --gtest_filter='EpilogueStats*' > "$OUT/epi_tests.log" 2>&1
               echo "epi tests rc=$?" ;;
    tests-on) LCE_CUDA_EPILOGUE_STATS=1 timeout 300 ./gpu_engine_test --gtest_filter='CudaTest.*:-*VocabParallelStatisticsBitForBit*' \
                > "$OUT/tests_on.log" 2>&1; echo "tests (switch on) rc=$?" ;;
    tests-off) timeout 300 ./gpu_engine_test --gtest_filter='CudaTest.*:-*VocabParallelStatisticsBitForBit*' \
                 > "$OUT/tests_off.log" 2>&1; echo "tests (switch off) rc=$?" ;;
    bench) k=${arg%%:*}; vars=${arg#*:}; [ "$vars" = "$arg" ] && vars=""
           echo "## bench LCE_CUDA_EPI_KERNEL=$k ${vars//:/ }" >> "$OUT/bench.log"
           env LCE_CUDA_EPI_KERNEL="$k" ${vars//:/ } timeout 300 ./lce_bench --shapes "$SHAPES" --reps ${REPS:-5} --score-ab \
             >> "$OUT/bench.log" 2>&1; echo "bench $arg rc=$?" ;;
    memcheck|racecheck) timeout 300 compute-sanitizer --tool "$step" --error-exitcode 9 ./gpu_engine_test \
                          --gtest_filter="$small" > "$OUT/$step.log" 2>&1; echo "$step rc=$?" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== gpu"; cat "$OUT/gpu.txt"
for f in epi_tests tests_on tests_off; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|tests ran" "$OUT/$f.log" | head -30; }
done
for f in memcheck racecheck; do [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -3 "$OUT/$f.log"; }; done
[ -f "$OUT/bench.log" ] && { echo "== bench"; grep -E "^##|^\| [0-9]|score switch" "$OUT/bench.log"; }
exit 0
