#!/usr/bin/env bash
# The C++ package as a user gets it (issue 38): `cmake --install` of a built tree into a fresh prefix,
# then tests/package/consumer built outside the source tree against that prefix, once with
# find_package(lce_serve CONFIG) and once with `pkg-config --cflags --libs lce-client`; the installed
# lce_server started on a free port (CPU engine, a seeded head) and both consumers run against it;
# then the installed lce_tp_launch.sh starts a group of two installed servers that lce_cli scores on.
# Usage: bash tests/package/check_install.sh [BUILD_DIR]   (default $LCE_BUILD_DIR or build; built already)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-${LCE_BUILD_DIR:-build}}
source tests/package/lib.sh
VERSION=$(project_version)
PREFIX=$WORK/prefix

echo "== cmake --install $BUILD --prefix $PREFIX"
cmake --install "$BUILD" --prefix "$PREFIX" >"$WORK/install.log"
outside=$(sed -n 's/^-- \(Installing\|Up-to-date\): //p' "$WORK/install.log" | grep -v "^$PREFIX/" || true)
if [ -n "$outside" ]; then
  echo "FAIL: installed outside the prefix: $outside" >&2
  exit 1
fi
LIBDIR=$(dirname "$(find "$PREFIX" -name liblce_client.a -print -quit)")
for f in bin/lce_server bin/lce_cli bin/lce_tp_launch.sh bin/lce_dp_launch.sh include/lce/client/lce_client.h \
         include/lce/v1/lce.pb.h include/lce/v1/lce.grpc.pb.h; do
  [ -e "$PREFIX/$f" ] || { echo "FAIL: $f not installed" >&2; exit 1; }
done
for f in liblce_client.a liblce_proto.a cmake/lce_serve/lce_serveConfig.cmake \
         cmake/lce_serve/lce_serveConfigVersion.cmake pkgconfig/lce-client.pc; do
  [ -e "$LIBDIR/$f" ] || { echo "FAIL: $LIBDIR/$f not installed" >&2; exit 1; }
done
expect_version "installed lce_server --version" "$("$PREFIX/bin/lce_server" --version | awk '{print $2}')"
expect_version "installed lce_cli --version" "$("$PREFIX/bin/lce_cli" --version | awk '{print $2}')"

# The consumer, copied out of the source tree, so that nothing but the prefix can be found.
cp -r tests/package/consumer "$WORK/consumer"
echo "== consumer: find_package(lce_serve CONFIG)"
cmake -S "$WORK/consumer" -B "$WORK/consumer/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$PREFIX" >"$WORK/consumer-cmake.log" || { cat "$WORK/consumer-cmake.log"; exit 1; }
ninja -C "$WORK/consumer/build" >/dev/null
echo "== consumer: pkg-config lce-client"
PC_FLAGS=$(PKG_CONFIG_PATH="$LIBDIR/pkgconfig" pkg-config --cflags --libs lce-client)
c++ -O1 "$WORK/consumer/main.cc" -o "$WORK/consumer/lce_consumer_pc" $PC_FLAGS

echo "== the installed lce_server and both consumers"
start_server "$PREFIX/bin/lce_server" --backend=cpu --cpu-threads=1 --seed-head=1000x64 --seed=0 --head-dtype=bf16
for consumer in "$WORK/consumer/build/lce_consumer" "$WORK/consumer/lce_consumer_pc"; do
  out=$("$consumer" "$TARGET" 4)
  echo "$out"
  grep -q "^client $VERSION, server $VERSION, head 'default' 1000x64$" <<<"$out" \
    || { echo "FAIL: $consumer did not report client and server $VERSION" >&2; exit 1; }
  [ "$(grep -c '^row .* logprob -[0-9.]* entropy [0-9.]*$' <<<"$out")" = 4 ] \
    || { echo "FAIL: $consumer did not score 4 rows" >&2; exit 1; }
done
stop_server

echo "== the installed launcher: a tensor-parallel group of 2 of the installed lce_server"
start_server env -u LCE_SERVER "$PREFIX/bin/lce_tp_launch.sh" 2 -- --backend=cpu --cpu-threads=1 --seed-head=1000x64
"$PREFIX/bin/lce_cli" info --target="$TARGET" | grep "^server $VERSION, backend cpu, tp_size 2," \
  || { echo "FAIL: the launcher's group is not the installed server's TP-2 group" >&2; exit 1; }
"$PREFIX/bin/lce_cli" score --target="$TARGET" --rows=8 | grep "^rows 8 (valid 8)" \
  || { echo "FAIL: lce_cli score against the group" >&2; exit 1; }
stop_server
echo "check_install: ok"
