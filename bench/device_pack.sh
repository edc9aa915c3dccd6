#!/usr/bin/env bash
# Packs what bench/device.sh needs on the GPU machine: stripped binaries in .devbin/ and the runtime
# libraries the machine lacks in .rtpack/rt.tar.xz (both git-ignored).
# Usage: bench/device_pack.sh [BUILD_DIR]   (default build)
#        bench/device_pack.sh py   the Python client's wheels for the GPU machine's python3.12 in .whl/py
#                                  (~60 MB: carry them in a call of their own, `bench/device.sh py-wheels`)
#        bench/device_pack.sh peers   every peer's wheels (Liger, CCE, verl, QuACK 0.6.4 on CUTLASS DSL 4.6.2, whose
#                                  libs-core and libs-cu13 wheels both are needed) in .whl/part1 and .whl/part2 (~45 and
#                                  ~55 MB: the 88 MB cu13 wheel split across them), and peers.py in .peers/. On the GPU
#                                  machine, one call a part, back to back: `bench/device.sh stash=.whl/part1` carrying
#                                  .whl/part1, then `bench/device.sh stash=.whl/part2 peers` carrying .whl/part2 (and
#                                  .peers, .devbin, .rtpack as the carry limit allows: the stash lives while the
#                                  machine is warm)
set -euo pipefail
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
if [ "${1:-}" = peers ]; then
  rm -rf .whl/part1 .whl/part2 .whl/dl && mkdir -p .whl/part1 .whl/part2 .whl/dl .peers
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${PLATFORMS[@]}" -d .whl/dl \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 verl==0.9.1 quack-kernels==0.6.4 nvidia-cutlass-dsl==4.6.2 \
    nvidia-cutlass-dsl-libs-base==4.6.2 nvidia-cutlass-dsl-libs-core==4.6.2 nvidia-cutlass-dsl-libs-cu13==4.6.2 \
    "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext einops cuda-pathfinder "protobuf<7"
  split -b 46000000 .whl/dl/nvidia_cutlass_dsl_libs_cu13-*.whl .whl/part1/cu13.part.
  mv .whl/part1/cu13.part.a[b-z] .whl/part2/
  find .whl/dl -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .whl/part2/ \;
  basename .whl/dl/nvidia_cutlass_dsl_libs_cu13-*.whl > .whl/part2/cu13.name
  rm -rf .whl/dl
  cp ../shared/bench/peers.py .peers/
  du -sh .whl/part1 .whl/part2; exit 0
fi
if [ "${1:-}" = py ]; then
  mkdir -p .whl/py
  .venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 -d .whl/py "${PLATFORMS[@]}" \
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
# Over the device tool's 64 MiB carry (four CUTLASS builds' binaries are ~90 MB), one xz archive (~22 MB for three);
# bench/device.sh unpacks it.
if [ "$(du -sm .devbin | cut -f1)" -gt 60 ]; then
  (cd .devbin && tar -cf - ./* | xz -9 -T0 > ../devbin.tar.xz && rm -f ./* && mv ../devbin.tar.xz bin.tar.xz)
fi
bash ../shared/device/pack-runtime.sh .rt/lib "$build"/bin/* >/dev/null
tar -cJf .rtpack/rt.tar.xz .rt && rm -rf .rt
du -sh .devbin .rtpack
