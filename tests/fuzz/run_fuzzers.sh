#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-14, ASan + UBSan + libFuzzer; a build directory of its own,
# so the gcc build is untouched) and runs each for SECONDS (default 60) from its seed corpus
# (tests/fuzz/corpus/<target>, read only: what the run finds goes to a scratch corpus). Fails on any
# crash, leak, timeout, out-of-memory or sanitizer report; the input that caused it is kept under
# $LCE_FUZZ_ARTIFACTS (default <build>/fuzz-artifacts) and its log printed.
#
#   tests/fuzz/run_fuzzers.sh [SECONDS] [TARGET...]
#   LCE_ASAN_BUILD_DIR (default build-asan), LCE_JOBS (default nproc), LCE_FUZZ_KEEP_CORPUS=DIR (keep
#   the grown corpora there), LCE_FUZZ_RSS_MB (default 2048), LCE_FUZZ_PARALLEL (targets at once,
#   default nproc).
set -euo pipefail
# Symbolized reports (llvm-14 installs it; the unversioned name may be missing).
[ -x /usr/bin/llvm-symbolizer-14 ] && export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-/usr/bin/llvm-symbolizer-14}
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-60}
shift || true
BUILD=${LCE_ASAN_BUILD_DIR:-build-asan}
JOBS=${LCE_JOBS:-$(nproc)}
ALL=(fuzz_stream_request fuzz_safetensors fuzz_head_index fuzz_data_plane_wire fuzz_region_registry fuzz_metrics_http)
TARGETS=("${ALL[@]}")
[ $# -eq 0 ] || TARGETS=("$@")

# One configuration for the fuzzers and the ASan+UBSan tests (tests/sanitize.sh): the libraries are
# built once for both.
bash tests/configure_sanitized.sh "$BUILD" address,undefined
ninja -C "$BUILD" -j "$JOBS" "${TARGETS[@]}"

ART=${LCE_FUZZ_ARTIFACTS:-$BUILD/fuzz-artifacts}
mkdir -p "$ART"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lce-fuzz-run-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# The targets' scratch files (fuzz_common.h, ScratchDir) go there too, even when a crash skips
# their own clean-up.
mkdir -p "$WORK/tmp"
export TMPDIR="$WORK/tmp"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# One target's run: its log, and a line "rc execs rate corpus" for the summary below.
run_one() {
  local t=$1 corpus="$WORK/$1" log="$WORK/$1.log" rc=0
  mkdir -p "$corpus"
  "$BUILD/bin/$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb="${LCE_FUZZ_RSS_MB:-2048}" \
    -print_final_stats=1 -artifact_prefix="$ART/$t-" "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  echo "$rc $(sed -n 's/^stat::number_of_executed_units: *//p' "$log") $(sed -n 's/^stat::average_exec_per_sec: *//p' "$log") $(ls "$corpus" | wc -l)" >"$WORK/$t.result"
}
# Each target is single-threaded: up to LCE_FUZZ_PARALLEL of them at once (default nproc), each its
# full SECONDS on a core of its own.
PARALLEL=${LCE_FUZZ_PARALLEL:-$(nproc)}
running=0
for t in "${TARGETS[@]}"; do
  if ((running >= PARALLEL)); then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$t" &
  running=$((running + 1))
done
wait
failed=()
printf '%-24s %8s %12s %10s %8s\n' target seconds executions exec/s corpus
for t in "${TARGETS[@]}"; do
  corpus="$WORK/$t"
  log="$WORK/$t.log"
  read -r rc execs rate n <"$WORK/$t.result" || rc=1
  printf '%-24s %8s %12s %10s %8s\n' "$t" "$SECONDS_EACH" "${execs:-?}" "${rate:-?}" "${n:-?}"
  # libFuzzer exits non-zero on a crash, leak, timeout or OOM; UBSan halts on its first report.
  if [ "$rc" != 0 ] || grep -qE 'runtime error:|ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|invariant failed' "$log"; then
    failed+=("$t")
    echo "== $t failed (exit $rc); its log's end:"
    tail -n 60 "$log"
    ls -1 "$ART" | sed -n "/^$t-/s|^|   artifact: $ART/|p"
  fi
  if [ -n "${LCE_FUZZ_KEEP_CORPUS:-}" ]; then
    mkdir -p "$LCE_FUZZ_KEEP_CORPUS/$t"
    cp -n "$corpus"/* "$LCE_FUZZ_KEEP_CORPUS/$t/" 2>/dev/null || true
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: ${#TARGETS[@]} targets, ${SECONDS_EACH} s each: no crash, leak or sanitizer report"
