#!/usr/bin/env bash
# Packs what bench/device.sh needs on the GPU machine: stripped binaries in .devbin/ and the runtime
# libraries the machine lacks in .rtpack/rt.tar.xz (both git-ignored through .git/info/exclude).
# Usage: bench/device_pack.sh [BUILD_DIR]   (default build)
set -euo pipefail
build=${1:-build}
rm -rf .devbin .rt .rtpack && mkdir -p .devbin .rtpack
for b in "$build"/bin/*; do strip -o ".devbin/$(basename "$b")" "$b"; done
bash ../shared/device/pack-runtime.sh .rt/lib "$build"/bin/* >/dev/null
tar -cJf .rtpack/rt.tar.xz .rt && rm -rf .rt
du -sh .devbin .rtpack
