#!/usr/bin/env bash
# The one entry point for runs on the GPU machine (the device tool), from the repo root, with .devbin/
# (stripped binaries and liblce_gpu_timeline.so: bench/device_pack.sh) and .rtpack/rt.tar.xz (runtime
# libraries) carried; .whl/ and .peers/peers.py too for the peers. Every log lands under $OUT; a
# summary is printed last.
# Usage: bench/device.sh STEP...   STEP is one of
#   gpu-tests[=FILTER]        gpu_engine_test (gtest filter)
#   sanitizer                 compute-sanitizer memcheck over gpu_engine_test
#   e2e-cuda[=FILTER]         e2e_test against lce_server --backend=cuda
#   bench[=VAR=V:VAR=V]       lce_bench on $SHAPES (default: the five issue shapes), with env vars set, and
#                             $LCE_BENCH_ARGS (e.g. --epi-ab: score and train with LCE_CUDA_EPILOGUE_STATS=0 and =1)
#   gemm-picks                $PROCS (8) lce_bench processes on $SHAPES, each with LCE_CUDA_GEMM_LOG=1: its times and the
#                             pick of each tuned product (a pick that differs between processes splits a shape's
#                             speed: bench/NOTES.md e28); every candidate's slice time in $OUT/picks_N.err
#   swizzle-ab                lce_bench's score at row counts the server's merged calls take ($SWIZZLE_SHAPES: 2560, 3072,
#                             1536 and 16384 rows of 4096 x 151936) with LCE_CUDA_EPI_SWIZZLE=0 (width 8) and -1 (fitted
#                             to each call: bench/NOTES.md e31), alternated, $ROUNDS (2) rounds; for a TP group the same
#                             variable before tp-server reaches its ranks
#   stash=DIR                 copy a carried DIR to /tmp/stash (kept while the machine is warm: carry a large set over
#                             calls made back to back, e.g. the peers' .whl/part1 and .whl/part2)
#   peers                     ../shared/bench/peers.py (as .peers/peers.py) on $SHAPES; every peer from the stashed
#                             .whl/part1 + part2 (bench/device_pack.sh peers), else Liger and CCE from .whl/
#   tp                        TP process tests on every GPU, lce_tp_bench at k = 1 and all GPUs, verl's
#                             kernel at the same k ($TP_SHAPES)
#   tp-server                 one GPU, then a TP group of every GPU ($TP_K), each a seeded VOCAB x HIDDEN bf16 head
#                             (151936 x 4096 by default): lce_cli bench --rows=$ROWS (16384) training requests that
#                             accumulate dW over the data plane for each of $DP_STREAMS (default 1) and over gRPC (the
#                             clients' defaults), then scores over the data plane, $ROUNDS (2) rounds; each server's
#                             request log summarised (bench/transport_log_summary.py); BACKEND=cpu for a dry run
#   dp                        one data-parallel replica a GPU (NCCL links): $DP_STEPS AdamW steps from
#                             lce_cli, then each replica's SaveHead compared byte for byte
#   transport                 the IPC test, then lce_transport_bench over every path (ROWS, HIDDEN,
#                             VOCAB, STREAMS, TCP_STREAMS, CHUNK, ITERS, MODES, SERVER_FLAGS, BENCH_FLAGS)
#   grpc-sweep                the gRPC path for each of $CONFIGS "STREAMS:CHUNK:WINDOW[:CQS[:ARGS[:FIRST[:POLL]]]]"
#   data-plane-sweep          the data plane for each of $CONFIGS "STREAMS:CHUNK:FIRST:LAST[:GROW]"
#   timeline                  `transport` with the CUPTI recorder injected, and its GPU timeline summary
#   py-wheels                 install .whl/py/*.whl (grpcio, protobuf, transformers, matplotlib; carried alone,
#                             it is large: bench/device_pack.sh py) into /tmp/site, kept while the machine is warm
#   py-gpu                    the Python client against a CUDA server: examples/grpo_hf.py, and test_hf, test_rl,
#                             test_aio with LCE_TEST_BACKEND=cuda (carry client/python/lce_client/_proto)
#   small-calls               bench/small_calls.sh on CUDA servers (VOCAB x HIDDEN bf16, default 151936 x 4096):
#                             a Score of $CALL_ROWS (1,16,64) rows end to end vs the server's engine time, and
#                             1-row Scores a second from 64 callers, batching off and the defaults ($CALLS_CONFIGS); the
#                             Python client too where .whl/ holds lce_client's wheel and its dependencies'
#                             for the machine's python3 (`pip wheel -w .whl ./client/python`)
#   tls-wire                  the data plane's sockets alone (lce_cli bench --op=wire, 64 MiB each way in 16 MiB
#                             transfers), a plain server and a --data-plane-tls one on loopback, 1/2/4/8 sockets
#   bin=NAME[:ARGS]           any .devbin binary with ARGS (':' for spaces), output to $OUT/NAME.log
set -u
[ -d .rt/lib ] || tar -xJf .rtpack/rt.tar.xz
[ -f .devbin/bin.tar.xz ] && [ ! -e .devbin/.unpacked ] && (cd .devbin && tar -xJf bin.tar.xz && touch .unpacked)
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export LCE_SERVER_BIN=$PWD/.devbin/lce_server LCE_CLI_BIN=$PWD/.devbin/lce_cli
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-8192x4096x128256,16384x2048x151936,4096x8192x152064,16384x4096x151936,4096x2880x201088}
N=${ROWS:-8192} H=${HIDDEN:-4096} V=${VOCAB:-128256}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1

# The peers: every one from the stashed wheel parts (the DSL's files from several wheels merge in one --target
# install; its .pth is not read there, so dsl_packages goes on PYTHONPATH), else Liger and CCE from .whl/.
step_peers() {
  local verl=.whl/verl-*.whl path=/tmp/site
  if [ -d /tmp/stash/part1 ] && [ -d /tmp/stash/part2 ]; then
    if [ ! -d /tmp/site/quack ]; then
      cat /tmp/stash/part1/cu13.part.* /tmp/stash/part2/cu13.part.* > "/tmp/$(cat /tmp/stash/part2/cu13.name)"
      python3 -m pip install -q --no-index --no-deps --target /tmp/site "/tmp/$(cat /tmp/stash/part2/cu13.name)" \
        $(ls /tmp/stash/part2/*.whl | grep -v /verl-) > "$OUT/pip.log" 2>&1  # verl: two files, by peers.py
    fi
    verl=$(ls /tmp/stash/part2/verl-*.whl) path=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  else
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl \
      .whl/cut_cross_entropy-*.whl > "$OUT/pip.log" 2>&1
  fi
  PYTHONPATH=$path timeout 400 python3 .peers/peers.py --shapes "$SHAPES" --verl-wheel $verl \
    --json "$OUT/peers.json" > "$OUT/peers.log" 2>&1
  echo "peers rc=$?"
}

# Waits until every port FILE is written, at most TRIES × 0.2 s.
wait_ports() {
  local tries=$1 f
  shift
  for ((; tries > 0; tries--)); do
    for f in "$@"; do [ -s "$f" ] || { sleep 0.2; continue 2; }; done
    return 0
  done
}

# A server ($BACKEND, default cuda) on a seeded V×H head, its port in $PORT, its pid in $SERVER; extra flags as
# arguments.
start_server() {
  rm -f /tmp/lce.port
  ./.devbin/lce_server --port=0 --port-file=/tmp/lce.port --backend="${BACKEND:-cuda}" --seed-head="${V}x${H}" \
    --seed=0 --head-dtype=bf16 "$@" &
  SERVER=$!
  wait_ports 600 /tmp/lce.port
  PORT=$(cat /tmp/lce.port)
}
stop_server() { kill $SERVER; wait $SERVER 2>/dev/null; }

step_tp() {
  local ngpu rdv k r shapes=${TP_SHAPES:-16384x4096x151936,32768x8192x262144}
  ngpu=$(nvidia-smi -L | wc -l)
  LCE_TEST_TP_BACKEND=cuda LCE_TEST_TP_SIZES=1,$ngpu LCE_TEST_TP_FAULT_SIZE=$ngpu timeout 400 \
    ./.devbin/e2e_test --gtest_filter='TensorParallel.*' > "$OUT/tp_test.log" 2>&1
  echo "tp tests (cuda, k=1,$ngpu) rc=$?"
  : > "$OUT/tp_bench.log"
  for k in 1 $ngpu; do
    rdv=$(mktemp -d)
    for ((r = 1; r < k; r++)); do
      ./.devbin/lce_tp_bench --rank=$r --world=$k --rendezvous=$rdv --shapes=$shapes > "$OUT/tp_bench_rank$r.log" 2>&1 &
    done
    timeout 300 ./.devbin/lce_tp_bench --rank=0 --world=$k --rendezvous=$rdv --shapes=$shapes >> "$OUT/tp_bench.log" 2>&1
    echo "tp bench k=$k rc=$?"
    wait
  done
  if [ -d .whl ] && [ -f .peers/peers.py ]; then  # verl's kernel with its process group, same shapes
    for k in 1 $ngpu; do
      timeout 300 python3 -m torch.distributed.run --nproc_per_node=$k bench/verl_tp_peer.py \
        --verl-wheel .whl/verl-*.whl --peers .peers/peers.py --shapes "$shapes" >> "$OUT/verl_tp.log" 2>&1
      echo "verl k=$k rc=$?"
    done
  fi
}

step_tp_server() {
  local k g r st P rows=${ROWS:-16384} V=${VOCAB:-151936} backend=${BACKEND:-cuda}  # V: start_server's head too
  k=${TP_K:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  for g in 1 $k; do
    if [ "$g" = 1 ]; then
      CUDA_VISIBLE_DEVICES=0 start_server --data-port=0 --log-requests=true > "$OUT/tp_server_k$g.log" 2>&1
    else
      rm -f /tmp/tps.port
      LCE_SERVER=$PWD/.devbin/lce_server LCE_TP_BIND_GPUS=$([ "$backend" = cpu ] && echo 0 || echo 1) \
        bash deploy/lce_tp_launch.sh "$g" -- --port=0 --port-file=/tmp/tps.port --backend="$backend" \
        --seed-head="${V}x${H}" --seed=0 --head-dtype=bf16 --data-port=0 --log-requests=true \
        > "$OUT/tp_server_k$g.log" 2>&1 &
      SERVER=$!
      wait_ports 900 /tmp/tps.port
      PORT=$(cat /tmp/tps.port)
    fi
    P=127.0.0.1:$PORT
    for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
      for st in ${DP_STREAMS:-1}; do
        echo -n "k=$g data plane, $st stream(s), train r$r: "
        timeout 120 ./.devbin/lce_cli bench --target=$P --op=train --accumulate-weight-grad --rows="$rows" --iterations=5 \
          --warmup=2 --data-plane=true --data-plane-streams="$st" --streams="$st" 2>&1 | tail -1
      done
      echo -n "k=$g gRPC (client defaults), train r$r: "
      timeout 120 ./.devbin/lce_cli bench --target=$P --op=train --accumulate-weight-grad --rows="$rows" --iterations=5 \
        --warmup=2 2>&1 | tail -1
      echo -n "k=$g data plane, score r$r: "
      timeout 120 ./.devbin/lce_cli bench --target=$P --op=score --rows="$rows" --iterations=5 --warmup=2 \
        --data-plane=true 2>&1 | tail -1
    done
    kill -TERM $SERVER; wait $SERVER 2>/dev/null
    echo "== k=$g request log"; python3 bench/transport_log_summary.py "$OUT/tp_server_k$g.log"
  done
}

step_gemm_picks() {
  local i
  for ((i = 1; i <= ${PROCS:-8}; i++)); do
    LCE_CUDA_GEMM_LOG=1 timeout 300 ./.devbin/lce_bench --shapes "$SHAPES" --reps ${REPS:-5} > "$OUT/picks_$i.out" \
      2> "$OUT/picks_$i.err"
    echo "## process $i"
    grep "^N=" "$OUT/picks_$i.out" | sed 's/ | extra.*//'
    grep "picked" "$OUT/picks_$i.err" | sed 's/^lce gemm: //'
  done
}

step_swizzle_ab() {
  local r v shapes=${SWIZZLE_SHAPES:-2560x4096x151936,3072x4096x151936,1536x4096x151936,16384x4096x151936}
  for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
    for v in 0 -1; do
      echo "## round $r LCE_CUDA_EPI_SWIZZLE=$v"
      LCE_CUDA_EPI_SWIZZLE=$v timeout 300 ./.devbin/lce_bench --shapes "$shapes" --reps "${REPS:-5}" 2>&1 | grep "^N=" |
        sed 's/ | extra.*//'
    done
  done
}

step_dp() {
  local ngpu port=52100 d s steps=${DP_STEPS:-5}
  ngpu=$(nvidia-smi -L | wc -l)
  rm -f /tmp/dp.port.* && rm -rf /tmp/dp_save_*
  LCE_SERVER=$PWD/.devbin/lce_server LCE_TP_BIND_GPUS=1 bash deploy/lce_dp_launch.sh "$ngpu" 1 -- --port=$port \
    --port-file=/tmp/dp.port --backend=cuda --seed-head="${V}x${H}" --seed=0 --head-dtype=bf16 > "$OUT/dp_job.log" 2>&1 &
  local job=$!
  wait_ports 600 /tmp/dp.port.$((ngpu - 1)) /tmp/dp.port.0
  local cli=./.devbin/lce_cli
  {
    for ((s = 1; s <= steps; s++)); do
      for ((d = 0; d < ngpu; d++)); do  # each replica accumulates its own batch
        $cli forward-backward --target=127.0.0.1:$((port + d)) --rows=2048 --seed=$((100 * s + d)) \
          --accumulate-weight-grad=1 --show=0 || echo "forward-backward failed (step $s, replica $d)"
      done
      $cli step --target=127.0.0.1:$((port + s % ngpu)) --lr=1e-3 --max-grad-norm=1 || echo "step $s failed"
    done
    for ((d = 0; d < ngpu; d++)); do
      $cli save-head --target=127.0.0.1:$((port + d)) --directory=/tmp/dp_save_$d || echo "save-head $d failed"
    done
    for ((d = 1; d < ngpu; d++)); do
      for f in /tmp/dp_save_0/*.safetensors; do
        cmp "$f" "/tmp/dp_save_$d/$(basename "$f")" && echo "replica $d: $(basename "$f") the same bytes as replica 0's"
      done
    done
  } > "$OUT/dp.log" 2>&1
  kill -TERM $job; wait $job 2>/dev/null
  echo "dp done ($ngpu replicas, $steps steps)"
}

step_transport() {
  if [ -x .devbin/gpu_ipc_test ]; then
    ./.devbin/gpu_ipc_test > "$OUT/gpu_ipc_test.log" 2>&1; echo "gpu_ipc_test rc=$?"
  fi
  start_server --log-requests=${LOG_REQUESTS:-false} --max-message-bytes=67108864 --data-port=0 ${SERVER_FLAGS:-} \
    > "$OUT/server.log" 2>&1
  ./.devbin/lce_transport_bench --target=127.0.0.1:$PORT --rows="$N" --hidden="$H" --vocab="$V" --seed=0 \
    --streams="${STREAMS:-1,2,4,8}" --tcp-streams="${TCP_STREAMS:-1,2,4}" --chunk-bytes="${CHUNK:-4194304}" \
    --iterations="${ITERS:-5}" --warmup=1 ${MODES:+--modes=$MODES} ${BENCH_FLAGS:-} > "$OUT/transport.log" 2>&1
  echo "transport rc=$?"
  stop_server
}

step_grpc_sweep() {
  local cfg s chunk w cqs args first poll n=0
  for cfg in ${CONFIGS:-1:4194304:0 4:4194304:0}; do
    IFS=: read -r s chunk w cqs args first poll <<< "$cfg"
    if [ -n "${poll:-}" ]; then export GRPC_POLL_STRATEGY=$poll; else unset GRPC_POLL_STRATEGY; fi
    n=$((n + 1))
    start_server --log-requests=true --max-message-bytes=134217728 --http2-window-bytes="$w" --grpc-cqs="${cqs:-0}" \
      ${args:+--grpc-channel-args=$args} 2> "$OUT/server_$n.log" > /dev/null
    { echo "== streams $s, chunk $chunk (first ${first:-0}), window $w, cqs ${cqs:-0}, args ${args:-none}, poll ${poll:-default}"
      ./.devbin/lce_transport_bench --target=127.0.0.1:$PORT --rows="$N" --hidden="$H" --vocab="$V" --seed=0 \
        --modes=grpc --streams="$s" --chunk-bytes="$chunk" --http2-window-bytes="$w" ${args:+--grpc-channel-args=$args} \
        --first-chunk-bytes="${first:-0}" --iterations=4 --warmup=1 2>&1 | grep -E "^\| grpc|[A-Z_]+: "
      python3 bench/transport_log_summary.py "$OUT/server_$n.log"; } >> "$OUT/grpc_sweep.log"
    stop_server
  done
  echo "grpc sweep done"
}

step_data_plane_sweep() {
  local cfg s chunk first last grow from
  start_server --log-requests=true --data-port=0 ${SERVER_FLAGS:-} > /dev/null 2> "$OUT/server.log"
  for cfg in ${CONFIGS:-2:8388608:1048576:1048576}; do
    IFS=: read -r s chunk first last grow <<< "$cfg"
    from=$(($(wc -l < "$OUT/server.log") + 1))
    { echo "== streams $s, chunk $chunk, first $first, last $last, grow ${grow:-0}"
      ./.devbin/lce_transport_bench --target=127.0.0.1:$PORT --rows="$N" --hidden="$H" --vocab="$V" --seed=0 \
        --tcp-streams="$s" --chunk-bytes="$chunk" --first-chunk-bytes="${first:-0}" --last-chunk-bytes="${last:-0}" \
        --grow-chunks="${grow:-0}" --tcp-sockets="${SOCKETS:-4}" --iterations="${ITERS:-5}" --warmup="${WARMUP:-1}" \
        --modes="${MODES:-tcp}" --trace-file=/tmp/trace.jsonl 2>&1 | grep -E "^\| [a-z0-9]" | grep -v "^| path"
      python3 bench/transport_log_summary.py "$OUT/server.log" "$from"
      python3 bench/transport_trace_summary.py /tmp/trace.jsonl "$OUT/server.log" "$from"; } >> "$OUT/data_plane_sweep.log"
  done
  stop_server
  echo "data plane sweep done"
}

step_py_gpu() {
  export PYTHONPATH=/tmp/site:$PWD/client/python
  V=32768 H=1024 start_server
  timeout 300 python3 examples/grpo_hf.py --target "127.0.0.1:$PORT" --steps 40 --png "$OUT/grpo_hf_cuda.png" \
    --json "$OUT/grpo_hf_cuda.json" > "$OUT/py_gpu.log" 2>&1
  echo "grpo_hf (cuda server) rc=$?"; stop_server
  LCE_TEST_BACKEND=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider tests/python/test_hf.py \
    tests/python/test_rl.py tests/python/test_aio.py >> "$OUT/py_gpu.log" 2>&1
  echo "pytest hf/rl/aio (cuda server) rc=$?"
}

step_timeline() {
  local tag=${TAG:-timeline} f
  mkdir -p /tmp/$tag
  (export LD_LIBRARY_PATH=$PWD/.devbin:$LD_LIBRARY_PATH CUDA_INJECTION64_PATH=$PWD/.devbin/liblce_gpu_timeline.so \
     LCE_GPU_TIMELINE_DIR=/tmp/$tag; step_transport)
  for f in /tmp/$tag/timeline.*.csv; do
    [ -s "$f" ] && python3 bench/gpu_timeline_summary.py "$f" --rows "$N" | grep -v "no engine calls"
  done > "$OUT/$tag.summary.md"
  echo "timeline done"
}

step_small_calls() {
  local py=/tmp/lce_py
  if ls .whl/lce_client-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .whl --target $py lce_client > "$OUT/pip_small_calls.log" 2>&1
  fi
  # The defaults (batching on, 256 rows, no window; Scores batch where the engine's forward is batch
  # invariant, as the epilogue GEMM is), batching off, and --batch-invariant (d_hidden too).
  PYTHONPATH=$py${PYTHONPATH:+:$PYTHONPATH} PYTHON=python3 SERVER_BIN=.devbin/lce_server \
    BENCH_BIN=.devbin/lce_small_calls_bench BACKEND=cuda VOCAB=${VOCAB:-151936} HIDDEN=$H DTYPE=bf16 \
    ROWS=${CALL_ROWS:-1,16,64} OUT=$OUT/small_calls CONFIGS="${CALLS_CONFIGS:-off:--batch-max-rows=0 default \
invariant:--batch-invariant=true window100:--batch-max-delay-us=100}" \
    bash bench/small_calls.sh > "$OUT/small_calls.log" 2>&1
  echo "small calls rc=$?"
}

# What --data-plane-tls costs the data plane's sockets on this host (no engine: a CPU server on a
# small seeded head, 8192×4096 bf16 rows of its hidden size).
step_tls_wire() {
  local d=/tmp/lce_tls k mode log=$OUT/tls_wire.log
  mkdir -p $d
  openssl req -x509 -newkey rsa:2048 -nodes -keyout $d/key.pem -out $d/cert.pem -days 1 -subj /CN=localhost \
    -addext subjectAltName=IP:127.0.0.1,DNS:localhost > $d/openssl.log 2>&1
  openssl speed -evp aes-256-gcm -seconds 1 2>/dev/null | tail -1 > "$log"
  for mode in plain tls; do
    local tls=() ca=()
    [ $mode = tls ] && tls=(--tls-cert=$d/cert.pem --tls-key=$d/key.pem --data-plane-tls=true) && ca=(--tls-ca=$d/cert.pem)
    rm -f $d/port
    ./.devbin/lce_server --host=127.0.0.1 --port=0 --port-file=$d/port --data-port=0 --backend=cpu \
      --seed-head=1024x4096 --head-dtype=bf16 --log-requests=false "${tls[@]}" > $d/server_$mode.log 2>&1 &
    local server=$!
    for _ in $(seq 300); do [ -s $d/port ] && break; sleep 0.1; done
    for k in 1 2 4 8; do
      echo "\$ lce_cli bench ($mode) --data-plane-sockets=$k" >> "$log"
      ./.devbin/lce_cli bench --target=127.0.0.1:"$(cat $d/port)" "${ca[@]}" --op=wire --data-plane=1 \
        --data-plane-sockets=$k --rows=8192 --chunk-bytes=16777216 --iterations=5 --warmup=1 >> "$log" 2>&1
    done
    kill $server; wait $server 2>/dev/null
  done
  echo "tls-wire done"
}

for step in "$@"; do
  arg=${step#*=}; [ "$arg" = "$step" ] && arg=""
  case ${step%%=*} in
    gpu-tests)
      timeout 400 ./.devbin/gpu_engine_test ${arg:+--gtest_filter=$arg} > "$OUT/gpu_test.log" 2>&1
      echo "gpu tests rc=$?" ;;
    sanitizer)
      timeout 400 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
        ./.devbin/gpu_engine_test --gtest_filter=-*HundredThousand* > "$OUT/sanitizer.log" 2>&1
      echo "compute-sanitizer rc=$?" ;;
    e2e-cuda)
      LCE_TEST_BACKEND=cuda timeout 400 ./.devbin/e2e_test ${arg:+--gtest_filter=$arg} > "$OUT/e2e_cuda.log" 2>&1
      echo "e2e (cuda) rc=$?" ;;
    bench)
      echo "## bench ${arg:-default}" >> "$OUT/bench.log"
      env ${arg//:/ } timeout 300 ./.devbin/lce_bench --shapes "$SHAPES" --reps ${REPS:-7} ${LCE_BENCH_ARGS:-} \
        >> "$OUT/bench.log" 2>&1
      echo "bench ${arg:-default} rc=$?" ;;
    stash)
      mkdir -p /tmp/stash && rm -rf "/tmp/stash/$(basename "$arg")" && cp -r "$arg" /tmp/stash/
      echo "stashed $arg: $(du -sh "/tmp/stash/$(basename "$arg")" | cut -f1)" ;;
    peers) step_peers ;;
    tp) step_tp ;;
    tp-server) step_tp_server >> "$OUT/tp_server.log" 2>&1; echo "tp-server done" ;;
    gemm-picks) step_gemm_picks >> "$OUT/gemm_picks.log" 2>&1; echo "gemm-picks done" ;;
    swizzle-ab) step_swizzle_ab >> "$OUT/swizzle_ab.log" 2>&1; echo "swizzle-ab done" ;;
    dp) step_dp ;;
    transport) step_transport ;;
    grpc-sweep) step_grpc_sweep ;;
    data-plane-sweep) step_data_plane_sweep ;;
    timeline) step_timeline ;;
    py-wheels)
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/py/*.whl > "$OUT/pip_py.log" 2>&1
      echo "py-wheels rc=$?" ;;
    py-gpu) step_py_gpu ;;
    small-calls) step_small_calls ;;
    tls-wire) step_tls_wire ;;
    bin)
      name=${arg%%:*}; args=${arg#*:}; [ "$args" = "$arg" ] && args=""
      timeout 400 ./.devbin/$name ${args//:/ } > "$OUT/$name.log" 2>&1; echo "$name rc=$?" ;;
    *) echo "unknown step: $step" ;;
  esac
done
echo "== gpu"; cat "$OUT/gpu.txt"
for f in gpu_test e2e_cuda tp_test; do
  [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|rror|tests ran|^\[  FAILED" "$OUT/$f.log" | head -40; }
done
[ -f "$OUT/sanitizer.log" ] && { echo "== sanitizer"; tail -4 "$OUT/sanitizer.log"; }
for f in bench tp_bench tp_server gemm_picks peers transport dp py_gpu small_calls; do [ -f "$OUT/$f.log" ] && { echo "== $f"; cat "$OUT/$f.log"; }; done
exit 0
