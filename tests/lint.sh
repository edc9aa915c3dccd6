#!/usr/bin/env bash
# Style of what a change touches, in seconds (CI's first stage): the changed lines of C++ files
# through clang-format (.clang-format) and the changed Python files through ruff (ruff.toml). The
# tree as a whole is not held to it: older code keeps its layout until someone edits it.
#
# "Changed" is against a base commit: LCE_LINT_BASE where set; else, on a branch, its merge base
# with main; on main itself (CI's clean clone) the commit before HEAD (its first parent); with no
# parent (a root commit, a shallow clone), every tracked Python file and no C++ line. Uncommitted
# changes count too.
#   LCE_RUFF: the ruff to run (default .venv/bin/ruff, else ruff on PATH).
# A failure prints what to change; `git clang-format-14 BASE` and `ruff check --fix` apply it.
set -euo pipefail
cd "$(dirname "$0")/.."

base_commit() {
  if [ -n "${LCE_LINT_BASE:-}" ]; then
    git rev-parse --verify "$LCE_LINT_BASE^{commit}"
    return
  fi
  local mb=""
  if git rev-parse --verify -q main >/dev/null; then mb=$(git merge-base HEAD main || true); fi
  if [ -n "$mb" ] && [ "$mb" != "$(git rev-parse HEAD)" ]; then
    echo "$mb"
  else
    git rev-parse --verify -q HEAD~1 || true  # empty: a root commit
  fi
}

ruff_bin() {
  if [ -n "${LCE_RUFF:-}" ]; then echo "$LCE_RUFF"; elif [ -x .venv/bin/ruff ]; then echo .venv/bin/ruff;
  elif command -v ruff >/dev/null; then command -v ruff; fi
}

CLANG_FORMAT=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$CLANG_FORMAT" ] || [ -z "$(ruff_bin)" ]; then
  bash deploy/install-deps.sh --lint >/dev/null
  CLANG_FORMAT=$(command -v clang-format-14)
fi
RUFF=$(ruff_bin)

BASE=$(base_commit)
if [ -n "$BASE" ]; then
  mapfile -t changed < <(git diff --name-only --diff-filter=ACMR "$BASE" --)
else
  mapfile -t changed < <(git ls-files)
fi
cxx=() py=()
for f in "${changed[@]}"; do
  [ -f "$f" ] || continue
  case "$f" in
    *.cc | *.h | *.cu | *.cuh | *.cpp) cxx+=("$f") ;;
    *.py) py+=("$f") ;;
  esac
done
echo "lint: ${#cxx[@]} C++ and ${#py[@]} Python file(s) changed since ${BASE:-the first commit}"

status=0
if ((${#cxx[@]})); then
  if [ -n "$BASE" ]; then
    # Only the lines the change touched (git-clang-format: the diff of its formatting of them).
    out=$(git "clang-format-14" --binary "$CLANG_FORMAT" --diff --extensions cc,h,cu,cuh,cpp "$BASE" -- "${cxx[@]}")
    case "$out" in
      "" | "no modified files to format" | "clang-format did not modify any files") ;;
      *)
        echo "$out"
        echo "lint: clang-format would change the lines above (git clang-format-14 $BASE applies it)"
        status=1
        ;;
    esac
  else
    echo "lint: no base commit (a root commit, or a shallow clone): C++ lines not checked"
  fi
fi
if ((${#py[@]})); then
  "$RUFF" check --force-exclude "${py[@]}" || status=1
fi
[ "$status" = 0 ] && echo "lint: ok"
exit "$status"
