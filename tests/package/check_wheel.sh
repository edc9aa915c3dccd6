#!/usr/bin/env bash
# The Python package as a user gets it (issue 38): `python -m build` makes the sdist and, from it, the
# wheel (the gRPC stubs generated inside the build: client/python/setup.py); the wheel is installed
# into a fresh venv (its grpcio, protobuf, numpy from PyPI; pip's cache keeps that quick) and, from a
# scratch directory with no source tree on sys.path, makes real calls against lce_server: GetInfo's
# version must be lce_client.__version__ and the project's, Score's answers within 1e-4 of float64.
# Usage: bash tests/package/check_wheel.sh [BUILD_DIR]   (the lce_server of BUILD_DIR/bin; default build)
# LCE_BUILD_PYTHON: the Python that builds (default .venv/bin/python: `build`, setuptools, grpcio-tools
# from client/python/requirements-dev.txt); LCE_FRESH_PYTHON: the base of the fresh venv (python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-${LCE_BUILD_DIR:-build}}
PY=${LCE_BUILD_PYTHON:-.venv/bin/python}
source tests/package/lib.sh

echo "== python -m build client/python (sdist, then the wheel from it)"
# --no-isolation: the build requirements are the dev venv's already (no download of setuptools and
# grpcio-tools into a throwaway environment each run).
"$PY" -m build --no-isolation --outdir "$WORK/dist" client/python >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
VERSION=$(project_version)
WHEEL=$WORK/dist/lce_client-$VERSION-py3-none-any.whl
SDIST=$WORK/dist/lce_client-$VERSION.tar.gz
[ -f "$WHEEL" ] && [ -f "$SDIST" ] || { echo "FAIL: want $WHEEL and $SDIST; built: $(ls "$WORK/dist")" >&2; exit 1; }
for f in lce_client/_proto/lce_pb2.py lce_client/_proto/lce_pb2_grpc.py lce_client/_version.py; do
  "$PY" -m zipfile -l "$WHEEL" | grep "^$f " >/dev/null || { echo "FAIL: $f not in the wheel" >&2; exit 1; }
done
tar tzf "$SDIST" | grep "/proto/lce/v1/lce.proto$" >/dev/null || { echo "FAIL: the sdist lacks lce.proto" >&2; exit 1; }

echo "== a fresh venv, the wheel installed"
"${LCE_FRESH_PYTHON:-python3}" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$WHEEL"
cp tests/package/wheel_smoke.py "$WORK/"
cd "$WORK"   # nothing of the source tree on sys.path: the script's folder is the scratch one
"$WORK/venv/bin/python" wheel_smoke.py write "$WORK/head.safetensors"
cd - >/dev/null
start_server "$BUILD/bin/lce_server" --backend=cpu --cpu-threads=1 --head-file="$WORK/head.safetensors"
cd "$WORK"
# tee -a: /dev/stderr opened without O_APPEND truncates a log file that stderr is (CI run into a file).
reported=$("$WORK/venv/bin/python" wheel_smoke.py score "$TARGET" | tee -a /dev/stderr | tail -n 1)
cd - >/dev/null
expect_version "the wheel's lce_client.__version__" "$reported"
echo "check_wheel: ok"
