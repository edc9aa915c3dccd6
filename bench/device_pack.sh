#!/usr/bin/env bash
# Packs what bench/device.sh needs on the GPU machine: stripped binaries in .devbin/ and the runtime
# libraries the machine lacks in .rtpack/rt.tar.xz (both git-ignored through .git/info/exclude).
# Usage: bench/device_pack.sh [BUILD_DIR]   (default build)
set -euo pipefail
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
