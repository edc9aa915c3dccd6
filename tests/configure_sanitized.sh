#!/usr/bin/env bash
# Configures a clang-14 build directory with sanitizers (CPU only, no GPU code):
#   tests/configure_sanitized.sh DIR address,undefined   the fuzzers (tests/fuzz) and the ASan+UBSan tests
#   tests/configure_sanitized.sh DIR thread              the TSan tests
# Used by tests/fuzz/run_fuzzers.sh and tests/sanitize.sh; the gcc build (build/) is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$1
SAN=$2
FUZZ=OFF
[ "$SAN" = address,undefined ] && FUZZ=ON  # one build for the fuzzers and the ASan+UBSan tests
LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
# -O2 without -g (CMakeLists.txt adds line tables for the reports' stacks).
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
  -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" "${LAUNCHER[@]}" \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DLCE_ENABLE_CUDA=OFF \
  -DLCE_SANITIZE="$SAN" -DLCE_BUILD_FUZZERS="$FUZZ" -DLCE_BUILD_TESTS=ON ${LCE_SANITIZE_CMAKE_ARGS:-} >/dev/null
