#!/usr/bin/env bash
# The whole test suite: installs dependencies (idempotent), builds, runs the C++ tests (ctest: CPU
# tests, and GPU tests that skip with a message where no GPU is present) and the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
BUILD=${LCE_BUILD_DIR:-build}
JOBS=${LCE_JOBS:-$(nproc)}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$BUILD" -j "$JOBS"
echo "== C++ tests (ctest)"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"
if [ -d tests/python ]; then
  echo "== Python tests (pytest)"
  .venv/bin/python -m pip install -q ./client/python
  LCE_SERVER_BIN="$PWD/$BUILD/bin/lce_server" .venv/bin/python -m pytest -q tests/python
fi
echo "== Soak (bench/soak, 2 minutes)" && .venv/bin/python bench/soak/soak.py --server-bin="$PWD/$BUILD/bin/lce_server" --duration="${LCE_SOAK_SECONDS:-120}"
