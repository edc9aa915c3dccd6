#!/usr/bin/env bash
# One device call on a multi-GPU machine (nvidia-h200-x2): the tensor-parallel process tests on GPUs
# (NCCL; the served CUDA engine at k=1 and k=2 against the CPU engine, a killed and a hung peer), then
# the TP benchmark at k=1 and k=2. Logs under $OUT; a short table last.
# Usage (on the device, from the repo root, with build-gpu/ and .rt/ carried): bench/device_tp_run.sh
set -u
# .rtpack/rt.tar.xz: the runtime libraries (pack-runtime.sh), compressed to fit the carry limit.
[ -d .rt/lib ] || tar -xJf .rtpack/rt.tar.xz
export LCE_SERVER_BIN=$PWD/.devbin/lce_server
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-16384x4096x151936,32768x8192x262144}
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
LCE_TEST_TP_BACKEND=cuda LCE_TEST_TP_SIZES=1,$NGPU LCE_TEST_TP_FAULT_SIZE=$NGPU timeout 400 \
  ./.devbin/e2e_test --gtest_filter='TensorParallel.*' > "$OUT/tp_test.log" 2>&1
echo "tp tests (cuda, k=1,$NGPU) rc=$?"
: > "$OUT/tp_bench.log"
for k in 1 $NGPU; do
  rdv=$(mktemp -d)
  for ((r = 1; r < k; r++)); do
    ./.devbin/lce_tp_bench --rank=$r --world=$k --rendezvous=$rdv --shapes=$SHAPES > "$OUT/tp_bench_rank$r.log" 2>&1 &
  done
  timeout 300 ./.devbin/lce_tp_bench --rank=0 --world=$k --rendezvous=$rdv --shapes=$SHAPES >> "$OUT/tp_bench.log" 2>&1
  echo "tp bench k=$k rc=$?"
  wait
done
# verl's kernel with its process group, same shapes, same machine.
: > "$OUT/verl_tp.log"
if [ -d .whl ] && [ -f .peers/peers.py ]; then
  for k in 1 $NGPU; do
    timeout 300 python3 -m torch.distributed.run --nproc_per_node=$k bench/verl_tp_peer.py \
      --verl-wheel .whl/verl-*.whl --peers .peers/peers.py --shapes "$SHAPES" >> "$OUT/verl_tp.log" 2>&1
    echo "verl k=$k rc=$?"
  done
fi
grep -E "OK|FAILED|PASSED" "$OUT/tp_test.log" | tail -8
cat "$OUT/tp_bench.log"
grep -E "^verl" "$OUT/verl_tp.log"
