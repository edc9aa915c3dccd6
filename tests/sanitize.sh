#!/usr/bin/env bash
# The C++ tests under clang-14's sanitizers (CPU only; build directories of their own, the gcc build
# is untouched):
#   asan  ASan + UBSan over the CPU suite: kernels_test, server_test, metrics_test, client_test and
#         e2e_test, with the lce_server and lce_cli processes they start (the fuzzers' build directory,
#         tests/fuzz/run_fuzzers.sh, so its libraries are compiled once for both)
#   tsan  TSan over the tests of our own threads: the engine-call pipeline, the answer writer, the
#         stream watchdog, the dynamic batcher, the data plane's server (sockets, sessions' regions),
#         the metrics registry and HTTP server, the client's worker pool (in a TSan build the test
#         programs hold only those: the files after TSAN in tests/*/CMakeLists.txt, which says why
#         the tests through gRPC are not among them)
#
#   tests/sanitize.sh [asan] [tsan]        (default: both)
#   LCE_ASAN_BUILD_DIR (build-asan), LCE_TSAN_BUILD_DIR (build-tsan), LCE_JOBS (nproc)
#
# Fails on any sanitizer report, also one in a process a test started and whose exit status the test
# does not look at: every report goes to a file under <build>/sanitizer-logs (log_path), and any such
# file fails the run and is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
# llvm-symbolizer (llvm-14) for the reports' stacks; the sanitizers look for it on PATH.
[ -x /usr/lib/llvm-14/bin/llvm-symbolizer ] && export PATH=$PATH:/usr/lib/llvm-14/bin
JOBS=${LCE_JOBS:-$(nproc)}
SUPP=$PWD/tests/sanitizer-suppressions
LANES=("$@")
[ ${#LANES[@]} -gt 0 ] || LANES=(asan tsan)

# The C++ test programs and the binaries they start; tests/deploy (not C++) and tests/gpu (no CUDA
# here) are left out.
ASAN_TARGETS=(kernels_test server_test metrics_test client_test e2e_test lce_server lce_cli)
ASAN_EXCLUDE='^deploy_assets$'
TSAN_TARGETS=(server_test metrics_test client_test)

# Runs ctest in $1 (more ctest arguments after it); fails when a test fails or any process wrote a
# sanitizer report.
run_ctest() {
  local dir=$1 logs=$1/sanitizer-logs
  shift
  rm -rf "$logs"
  mkdir -p "$logs"
  local rc=0
  ctest --test-dir "$dir" --output-on-failure -j "$JOBS" -LE gpu "$@" || rc=$?
  local reports
  reports=$(find "$logs" -type f -size +0 | sort)
  if [ -n "$reports" ]; then
    echo "== sanitizer reports ($(echo "$reports" | wc -l) processes):"
    for f in $reports; do
      echo "--- $f"
      head -n 80 "$f"
    done
    return 1
  fi
  return $rc
}

asan() {
  local dir=${LCE_ASAN_BUILD_DIR:-build-asan}
  bash tests/configure_sanitized.sh "$dir" address,undefined
  ninja -C "$dir" -j "$JOBS" "${ASAN_TARGETS[@]}"
  echo "== ASan + UBSan: the CPU C++ tests ($dir)"
  # log_path: the reports of every process, tests and the servers and CLIs they start, land in files.
  # handle_sigbus=0: SIGBUS is the server's own to handle (shm_fault_guard.h: a client that shrinks
  # its shm object under the server's mapping); one outside its mappings must kill the process by
  # that signal (ShmFaultGuardDeathTest checks it), which ASan's handler would turn into exit 1.
  ASAN_OPTIONS=log_path=$PWD/$dir/sanitizer-logs/asan:detect_leaks=1:check_initialization_order=1:handle_sigbus=0:${ASAN_OPTIONS:-} \
  LSAN_OPTIONS=suppressions=$SUPP/lsan.supp:print_suppressions=0:${LSAN_OPTIONS:-} \
  UBSAN_OPTIONS=log_path=$PWD/$dir/sanitizer-logs/ubsan:print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-} \
    run_ctest "$dir" -E "$ASAN_EXCLUDE"
}

tsan() {
  local dir=${LCE_TSAN_BUILD_DIR:-build-tsan}
  bash tests/configure_sanitized.sh "$dir" thread
  ninja -C "$dir" -j "$JOBS" "${TSAN_TARGETS[@]}"
  echo "== TSan: the concurrency tests ($dir)"
  # OMP_NUM_THREADS=1: libomp is not built with TSan, so the engine's OpenMP workers' barriers are
  # invisible to it and every row they hand back would read as a race; the engine's own threads are
  # not what this lane tests (kernels_test checks the engines' results).
  OMP_NUM_THREADS=1 \
  TSAN_OPTIONS=log_path=$PWD/$dir/sanitizer-logs/tsan:halt_on_error=0:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp:${TSAN_OPTIONS:-} \
    run_ctest "$dir" --repeat until-fail:5  # five runs a test: more interleavings for TSan to see
}

for lane in "${LANES[@]}"; do
  case $lane in
    asan) asan ;;
    tsan) tsan ;;
    *) echo "tests/sanitize.sh: unknown lane $lane (asan, tsan)" >&2; exit 2 ;;
  esac
done
echo "sanitize: ${LANES[*]}: no test failed, no sanitizer report"
