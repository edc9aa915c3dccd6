#!/usr/bin/env bash
# Installs what lce-serve needs to build and test on Debian 12 (bookworm): the C++ toolchain and
# libraries from Debian's packages, and a Python virtual environment (.venv) with the Python
# client's dependencies from PyPI. Idempotent: a second run installs nothing and takes seconds.
#   --lint: only what tests/lint.sh needs (clang-format-14, and ruff in .venv), so that CI's first
#   stage runs before the rest is installed.
# The CUDA toolkit is not installed here; the CUDA backend is built when /usr/local/cuda/bin/nvcc
# (or nvcc on PATH) exists.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang-14 libfuzzer-14-dev llvm-14 libomp-14-dev  # the fuzzers and sanitizer builds (tests/sanitize.sh); llvm-14: the symbolizer
  clang-format-14  # tests/lint.sh (.clang-format)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libopenblas-dev libgtest-dev libgmock-dev
  libgloo-dev nlohmann-json3-dev libcpp-httplib-dev
  libssl-dev prometheus openssl python3 python3-venv python3-pip
)

LINT_ONLY=0
if [ "${1:-}" = --lint ]; then
  LINT_ONLY=1
  APT_PACKAGES=(clang-format-14 python3 python3-venv python3-pip git)
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "install-deps: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python: a venv beside the sources, so that a distribution's externally-managed Python is left alone.
PY=${LCE_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
REQ=client/python/requirements-dev.txt
if [ "$LINT_ONLY" = 1 ]; then
  # ruff at the version requirements-dev.txt pins.
  [ -x .venv/bin/ruff ] || .venv/bin/python -m pip install -q "$(grep -E '^ruff[=<>~ ]' "$REQ")"
  echo "install-deps: lint tools ok"
  exit 0
fi
STAMP=.venv/.lce-deps-$(cat "$REQ" 2>/dev/null | sha1sum | cut -c1-12)
if [ -f "$REQ" ] && [ ! -f "$STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r "$REQ"
  touch "$STAMP"
fi
# megatron-core (lce_client.megatron): without its dependencies (torch stays the one above) and past its
# Python >= 3.12 marker (its cp311 wheel runs here); see the file.
MREQ=client/python/requirements-megatron.txt
MSTAMP=.venv/.lce-megatron-$(cat "$MREQ" 2>/dev/null | sha1sum | cut -c1-12)
if [ -f "$MREQ" ] && [ ! -f "$MSTAMP" ]; then
  .venv/bin/python -m pip install -q --no-deps --ignore-requires-python -r "$MREQ"
  touch "$MSTAMP"
fi
echo "install-deps: ok"
