#!/usr/bin/env bash
# The default test suite on fresh clones, one after another, with CPU hogs running beside it:
# the check that no test depends on a quiet machine.
#
#   bench/under_load.sh [RUNS=5] [HOGS=2] [OUT=/tmp/eddy-under-load]
#
# Each run clones this repository's HEAD into a new directory and runs `python -m pytest -q`
# there (the README's test command, with this checkout's installed packages; the clone is put
# first on PYTHONPATH; `--durations=40` only reports the slowest tests). HOGS busy loops run the
# whole time; they are ended by their PIDs.
set -uo pipefail
runs=${1:-5}; hogs=${2:-2}; out=${3:-/tmp/eddy-under-load}
root=$(git rev-parse --show-toplevel)
python=${PYTHON:-$(command -v python)}
mkdir -p "$out"
pids=()
for _ in $(seq "$hogs"); do
  ( while :; do :; done ) &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
echo "# $(date -u +%FT%TZ) $(git -C "$root" rev-parse --short HEAD) on $(nproc) cores," \
     "$hogs busy loops beside it" | tee "$out/summary.txt"
for i in $(seq "$runs"); do
  clone=$(mktemp -d /tmp/eddy-clone.XXXXXX)
  git clone -q "$root" "$clone"
  start=$(date +%s)
  (cd "$clone" && PYTHONPATH="$clone" "$python" -m pytest -q -p no:cacheprovider --durations=40) \
    >"$out/run$i.log" 2>&1
  status=$?
  echo "run $i: exit $status, $(( $(date +%s) - start )) s: $(tail -n 1 "$out/run$i.log")" \
    | tee -a "$out/summary.txt"
  rm -rf "$clone"
done
