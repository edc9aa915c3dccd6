# Sourced by the transport scripts on the device (.devbin/ and .rtpack/ carried): unpacks the
# runtime libraries, points the loader at them and at CUDA, makes $OUT, and reads the shape
# arguments [ROWS] [HIDDEN] [VOCAB] into N, H, V.
[ -d .rt/lib ] || tar -xJf .rtpack/rt.tar.xz
export LD_LIBRARY_PATH=$PWD/.rt/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${1:-8192} H=${2:-4096} V=${3:-128256}
