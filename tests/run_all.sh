#!/usr/bin/env bash
# The whole test suite, what CI runs (.ci/run): installs dependencies (idempotent), builds, runs the
# C++ tests (ctest: CPU tests, and GPU tests that skip with a message where no GPU is present), the
# Python tests, the packages (tests/package: install, wheel, .deb) and 2 minutes of the soak; then the
# hardening lanes (docs/OPERATING.md, "Fuzzing, sanitizers, soak"): the fuzzers for LCE_FUZZ_SECONDS
# each, the C++ tests under ASan + UBSan and the concurrency tests under TSan. Prints each stage's time
# at the end.
#   LCE_HARDENING=0 skips the hardening lanes (a quick local run); LCE_SOAK_SECONDS, LCE_FUZZ_SECONDS.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads that wait passively: ctest runs two tests at once on CI's two cores, each with CPU
# engines of two threads, and spinning waiters then starve the thread they wait for (an e2e test took
# 145 s instead of 5 under a little extra load).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
BUILD=${LCE_BUILD_DIR:-build}
JOBS=${LCE_JOBS:-$(nproc)}
TIMES=()

stage() {
  local name=$1 t0=$SECONDS
  shift
  echo "== $name"
  "$@"
  TIMES+=("$(printf '%-28s %5d s' "$name" $((SECONDS - t0)))")
  echo "== $name: $((SECONDS - t0)) s"
}

build() {
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$BUILD" -j "$JOBS"
}

pytests() {
  .venv/bin/python -m pip install -q ./client/python
  LCE_SERVER_BIN="$PWD/$BUILD/bin/lce_server" .venv/bin/python -m pytest -q tests/python
}

# The packages as a user installs them (docs/INSTALL.md), from the build above: the C++ package into a
# scratch prefix with a consumer built against it, the wheel into a fresh venv, the .deb installed,
# run and removed; each scores a batch against its installed server.
packages() {
  bash tests/package/check_install.sh "$BUILD"
  LCE_BUILD_PYTHON=.venv/bin/python bash tests/package/check_wheel.sh "$BUILD"
  bash tests/package/check_deb.sh "$BUILD"
}

stage "dependencies" bash deploy/install-deps.sh
stage "build (gcc, Release)" build
stage "C++ tests (ctest)" ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"
stage "Python tests (pytest)" pytests
stage "package (install, wheel, deb)" packages
stage "soak (${LCE_SOAK_SECONDS:-120} s)" .venv/bin/python bench/soak/soak.py --server-bin="$PWD/$BUILD/bin/lce_server" \
  --duration="${LCE_SOAK_SECONDS:-120}"
if [ "${LCE_HARDENING:-1}" != 0 ]; then
  # The fuzzers first: their build directory is the ASan + UBSan tests' too, which then build only
  # the test programs on top of the libraries the fuzzers compiled.
  stage "fuzzers (${LCE_FUZZ_SECONDS:-30} s each)" bash tests/fuzz/run_fuzzers.sh "${LCE_FUZZ_SECONDS:-30}"
  stage "ASan + UBSan tests" bash tests/sanitize.sh asan
  stage "TSan tests" bash tests/sanitize.sh tsan
fi
echo "== times (s)"
printf '%s\n' "${TIMES[@]}"
echo "run_all: passed in $SECONDS s"
