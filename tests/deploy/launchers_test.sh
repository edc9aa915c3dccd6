#!/usr/bin/env bash
# The launchers and their rendezvous directories (issue 35, item 7): a directory that exists already
# is never emptied (the data-parallel launch stops; the tensor-parallel one only adds its own start
# directories), every directory a server meets in is mode 0700, and a failed step stops the launch.
# Stub servers stand in for lce_server, so this runs anywhere.
# Usage: launchers_test.sh [REPO_ROOT]      (ctest: deploy_launchers)
set -uo pipefail
ROOT=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
WORK=$(mktemp -d -t lce-launchers-XXXXXX)
trap 'rm -rf -- "$WORK"' EXIT
failed=0
check() {  # check WHAT COMMAND...
  local what=$1; shift
  if "$@"; then echo "PASS $what"; else echo "FAIL $what"; failed=1; fi
}
mode_of() { stat -c %a "$1"; }

# A stub lce_server: records its rendezvous directory's mode, and exits at once.
cat > "$WORK/server.sh" <<'STUB'
#!/usr/bin/env bash
for a in "$@"; do
  case "$a" in --tp-rendezvous=*) d=${a#*=}; echo "$(stat -c %a "$d") $d" >> "$STUB_LOG" ;; esac
done
exit 0
STUB
# A stub lce_tp_launch.sh for the data-parallel launcher: records the mode of the job's directory.
cat > "$WORK/tp.sh" <<'STUB'
#!/usr/bin/env bash
for a in "$@"; do
  case "$a" in --dp-rendezvous=*) d=$(dirname "${a#*=}"); echo "$(stat -c %a "$d") $d" >> "$STUB_LOG" ;; esac
done
exit 0
STUB
chmod +x "$WORK/server.sh" "$WORK/tp.sh"

dp() { LCE_TP_LAUNCH="$WORK/tp.sh" STUB_LOG="$WORK/dp.log" timeout 30 bash "$ROOT/deploy/lce_dp_launch.sh" "$@" >/dev/null 2>&1; }
tp() { LCE_SERVER="$WORK/server.sh" STUB_LOG="$WORK/tp.log" timeout 30 bash "$ROOT/deploy/lce_tp_launch.sh" "$@" >/dev/null 2>&1; }

# Data-parallel: an existing directory is refused whole; a fresh one (given or temporary) is 0700.
mkdir -p "$WORK/taken" && echo precious > "$WORK/taken/keep"
: > "$WORK/dp.log"
LCE_DP_RENDEZVOUS="$WORK/taken" dp 2 1 -- --port=0
check "dp: the launch stops on a directory that exists" test "$?" -ne 0
check "dp: nothing in it is removed" test -f "$WORK/taken/keep"
check "dp: no replica started there" test ! -s "$WORK/dp.log"
LCE_DP_RENDEZVOUS="$WORK/fresh/job" dp 2 1 -- --port=0
check "dp: a fresh directory given is made 0700" grep -q "^700 $WORK/fresh/job$" "$WORK/dp.log"
: > "$WORK/dp.log"
(unset LCE_DP_RENDEZVOUS; export TMPDIR="$WORK"; dp 2 1 -- --port=0)
check "dp: the temporary directory keeps mktemp's 0700" grep -q "^700 " "$WORK/dp.log"
: > "$WORK/dp.log"
LCE_DP_RENDEZVOUS=/proc/self/lce-cannot-be-made dp 2 1 -- --port=0
check "dp: a directory that cannot be made stops the launch" test "$?" -ne 0
check "dp: ... before any replica starts" test ! -s "$WORK/dp.log"

# Tensor-parallel: a given directory (a mounted volume, say) keeps what it held; each start meets in
# a fresh 0700 directory of its own inside it.
mkdir -p "$WORK/vol" && echo precious > "$WORK/vol/keep"
: > "$WORK/tp.log"
LCE_TP_RENDEZVOUS="$WORK/vol" tp 2 --restarts=1 -- --port=0
check "tp: what the directory held is kept" test -f "$WORK/vol/keep"
# Two starts (the stub ranks exit at once, so the group restarts once), each in its own directory.
check "tp: each start's directory is 0700 and inside it" \
  bash -c "[ \$(grep '^700 $WORK/vol/start-' '$WORK/tp.log' | sort -u | wc -l) -eq 2 ] && ! grep -qv '^700 ' '$WORK/tp.log'"
check "tp: the last start's directory is removed only at the next start" \
  bash -c "[ \$(ls -d '$WORK'/vol/start-* | wc -l) -eq 1 ]"

exit $failed
