#!/usr/bin/env bash
# The Debian package as a user gets it (issue 38): `cpack -G DEB` of a built tree makes
# lce-serve_<version>_<arch>.deb; `apt-get install ./...deb` installs it with its declared runtime
# dependencies; the service is started from its systemd unit's ExecStart line (systemd need not run:
# the line is read from the installed unit, with the installed config) and the installed lce_cli
# scores a batch against it; then `apt-get remove` (the edited-or-not conffile stays, as Debian
# keeps conffiles) and `dpkg --purge` leave the machine as it was.
# Needs root (apt-get, dpkg). Refuses to run where lce-serve is installed already (someone's own).
# Usage: bash tests/package/check_deb.sh [BUILD_DIR]   (default $LCE_BUILD_DIR or build; built already)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=$(cd "${1:-${LCE_BUILD_DIR:-build}}" && pwd)
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
if dpkg-query -W -f='${Status}' lce-serve 2>/dev/null | grep "install ok installed" >/dev/null; then
  echo "check_deb: lce-serve is installed on this machine already; remove it first (apt-get remove lce-serve)" >&2
  exit 1
fi
source tests/package/lib.sh
VERSION=$(project_version)
UNIT=/lib/systemd/system/lce-serve.service
CONF=/etc/lce-serve/lce-serve.conf
INSTALLED=0
pkg_extra_cleanup() {
  if [ "$INSTALLED" = 1 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get purge -y -qq lce-serve >/dev/null 2>&1 || true
  fi
}

echo "== cpack -G DEB"
cpack -G DEB --config "$BUILD/CPackConfig.cmake" -B "$WORK/deb" >"$WORK/cpack.log" 2>&1 || { cat "$WORK/cpack.log"; exit 1; }
DEB=$WORK/deb/lce-serve_${VERSION}_$(dpkg --print-architecture).deb
[ -f "$DEB" ] || { echo "FAIL: no $DEB; made: $(ls "$WORK/deb")" >&2; exit 1; }
depends=$(dpkg-deb -f "$DEB" Depends)
echo "Depends: $depends"
for lib in libgrpc++ libprotobuf libabsl libssl3; do
  grep "$lib" <<<"$depends" >/dev/null || { echo "FAIL: the package does not depend on $lib" >&2; exit 1; }
done

echo "== apt-get install ./$(basename "$DEB")"
INSTALLED=1
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$DEB" >"$WORK/apt.log" 2>&1 || { cat "$WORK/apt.log"; exit 1; }
[ "$(dpkg-query -W -f='${Version}' lce-serve)" = "$VERSION" ] || { echo "FAIL: installed version differs" >&2; exit 1; }
dpkg-query -W -f='${Conffiles}\n' lce-serve | grep "^ $CONF " >/dev/null \
  || { echo "FAIL: $CONF is not a conffile" >&2; exit 1; }
[ -f "$UNIT" ] || { echo "FAIL: no $UNIT" >&2; exit 1; }
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify "$UNIT" || { echo "FAIL: systemd-analyze verify $UNIT" >&2; exit 1; }
fi
expect_version "/usr/bin/lce_server --version" "$(/usr/bin/lce_server --version | awk '{print $2}')"
expect_version "/usr/bin/lce_cli --version" "$(/usr/bin/lce_cli --version | awk '{print $2}')"
expect_version "pkg-config --modversion lce-client" "$(pkg-config --modversion lce-client)"

echo "== the service's command line, from $UNIT"
exec_start=$(sed -n 's/^ExecStart=//p' "$UNIT")
read -r -a command <<<"$exec_start"
echo "${command[*]}"
# Its port and metrics port from the config are 50051 and 9400: free ones here (later flags win).
start_server "${command[@]}" --metrics-port=0
/usr/bin/lce_cli info --target="$TARGET" | tee "$WORK/info.txt"
grep "^server $VERSION, backend " "$WORK/info.txt" >/dev/null || { echo "FAIL: GetInfo's version" >&2; exit 1; }
/usr/bin/lce_cli score --target="$TARGET" --rows=64 --seed=1 | tee "$WORK/score.txt" | tail -n 2
grep "^rows 64 (valid 64), head 'default'" "$WORK/score.txt" >/dev/null || { echo "FAIL: lce_cli score" >&2; exit 1; }
stop_server

echo "== apt-get remove lce-serve"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get remove -y -qq lce-serve >"$WORK/apt.log" 2>&1 || { cat "$WORK/apt.log"; exit 1; }
[ ! -e /usr/bin/lce_server ] && [ ! -e "$UNIT" ] || { echo "FAIL: files left after remove" >&2; exit 1; }
[ -f "$CONF" ] || { echo "FAIL: remove dropped the conffile (only purge should)" >&2; exit 1; }
DEBIAN_FRONTEND=noninteractive $SUDO dpkg --purge lce-serve >/dev/null
[ ! -e "$CONF" ] || { echo "FAIL: $CONF left after purge" >&2; exit 1; }
INSTALLED=0
echo "check_deb: ok"
