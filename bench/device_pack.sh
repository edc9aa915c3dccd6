#!/usr/bin/env bash
# Packs what bench/device.sh needs on the GPU machine: stripped binaries in .devbin/ and the runtime
# libraries the machine lacks in .rtpack/rt.tar.xz (both git-ignored).
# Usage: bench/device_pack.sh [BUILD_DIR]   (default build)
#        bench/device_pack.sh py   the Python client's wheels for the GPU machine's python3.12 in .whl/py
#                                  (~60 MB: carry them in a call of their own, `bench/device.sh py-wheels`)
set -euo pipefail
if [ "${1:-}" = py ]; then
  mkdir -p .whl/py
  .venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 -d .whl/py \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    "grpcio>=1.62" "protobuf>=4.25" "transformers>=4.48" matplotlib tqdm
  rm -f .whl/py/numpy-*.whl   # the GPU machine has its own, matched to its torch
  du -sh .whl/py; exit 0
fi
build=${1:-build}
rm -rf .devbin .rt .rtpack && mkdir -p .devbin .rtpack
for b in "$build"/bin/*; do strip -o ".devbin/$(basename "$b")" "$b"; done
# The GPU timeline recorder and CUPTI, for `bench/device.sh timeline` (when built).
if [ -f "$build/bench/liblce_gpu_timeline.so" ]; then
  strip -o .devbin/liblce_gpu_timeline.so "$build/bench/liblce_gpu_timeline.so"
  cp -L /usr/local/cuda/lib/libcupti.so.13 .devbin/ 2>/dev/null || true
fi
bash ../shared/device/pack-runtime.sh .rt/lib "$build"/bin/* >/dev/null
tar -cJf .rtpack/rt.tar.xz .rt && rm -rf .rt
du -sh .devbin .rtpack
