#!/usr/bin/env bash
# Run one command on two commits of Eddy, one after the other in one invocation, with the same
# interpreter and packages: a before/after comparison of a change.
#
#   bench/compare_trees.sh BEFORE_REV OUT_DIR -- COMMAND [ARG ...]
#
# BEFORE_REV is checked out into a temporary worktree and put first on PYTHONPATH (the
# installed package is this checkout, in editable mode); the current tree runs the same
# command after it. Each side's output goes to OUT_DIR/{before,after}.log, headed by how it
# was run. The worktree is removed at the end.
set -euo pipefail
before_rev=$1; out=$2; shift 2
[ "$1" = "--" ] && shift
root=$(git rev-parse --show-toplevel)
tree=$(mktemp -d /tmp/eddy-before.XXXXXX)
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
git -C "$root" worktree add -q --detach "$tree" "$before_rev"
mkdir -p "$out"
for side in before after; do
  dir=$root; [ "$side" = before ] && dir=$tree
  log="$out/$side.log"
  {
    echo "# $side: $(git -C "$dir" rev-parse --short HEAD) $(date -u +%FT%TZ) on $(nproc) cores"
    echo "# command: $*"
  } >"$log"
  start=$(date +%s)
  (cd "$dir" && PYTHONPATH="$dir" "$@") >>"$log" 2>&1 || echo "# exit status $?" >>"$log"
  echo "# wall seconds: $(( $(date +%s) - start ))" >>"$log"
  echo "$side: $(tail -n 1 "$log")"
done
