# Shared by the package checks (check_install.sh, check_wheel.sh, check_deb.sh): a scratch directory
# removed on exit, an lce_server started on a free port and stopped (SIGTERM) on exit, and the
# project's version. Sourced, from the repository root; a script may define pkg_extra_cleanup, which
# runs on exit after the server has stopped.
WORK=$(mktemp -d -t lce-pkg-XXXXXX)
SERVER_PID=
TARGET=
_pkg_cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if declare -F pkg_extra_cleanup >/dev/null; then pkg_extra_cleanup; fi  # a script's own, after the server
  rm -rf "$WORK"
}
trap _pkg_cleanup EXIT

# The version in CMakeLists.txt's project(); every installed piece must report it.
project_version() {
  sed -n 's/^project(lce_serve VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt
}

# start_server COMMAND...: runs the server command line with --port=0 and a port file appended (later
# flags win), waits until it serves (at most 30 s) and sets TARGET=127.0.0.1:PORT.
start_server() {
  local port_file=$WORK/port log=$WORK/server.log
  rm -f "$port_file"
  TMPDIR=$WORK "$@" --port=0 --port-file="$port_file" >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 300); do
    [ -s "$port_file" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited:" >&2; cat "$log" >&2; return 1; }
    sleep 0.1
  done
  [ -s "$port_file" ] || { echo "server did not serve in 30 s:" >&2; cat "$log" >&2; return 1; }
  TARGET=127.0.0.1:$(cat "$port_file")
}

# stop_server: SIGTERM to the server started last; fails unless it exits 0 (drained and stopped).
stop_server() {
  kill -TERM "$SERVER_PID"
  local rc=0
  wait "$SERVER_PID" || rc=$?
  SERVER_PID=
  [ "$rc" = 0 ] || { echo "FAIL: the server exited $rc on SIGTERM:" >&2; tail -n 5 "$WORK/server.log" >&2; return 1; }
}

# expect_version WHAT ACTUAL: fails unless ACTUAL is the project's version.
expect_version() {
  if [ "$2" != "$(project_version)" ]; then
    echo "FAIL: $1 reports version '$2', the project is $(project_version)" >&2
    return 1
  fi
  echo "ok: $1 reports $2"
}
