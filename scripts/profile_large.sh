#!/bin/bash
# A whole-machine profile (perf record -a -g) of one `aggbox-bench large`
# backend at one point, taken while its timed calls run: the "where the
# time goes" tables of docs/BENCHMARKS.md compare two such profiles with
# scripts/perf_modes.py.
#
#   sudo AGGBOX_LARGE_MTUS=9000 AGGBOX_LARGE_SIZES=1048576 AGGBOX_LARGE_WORKERS=8 \
#       scripts/profile_large.sh OUT BACKEND [SECONDS] [PATTERN]
#
# Runs `aggbox-bench large` with AGGBOX_LARGE_BACKENDS=BACKEND and enough
# calls (--reps, default 200: set AGGBOX_PROFILE_REPS) to outlast the
# recording; once a progress line matches PATTERN (default: the backend's
# "warm-up + N calls" line) it waits a second (the warm-up) and records
# SECONDS (default 4) of the whole machine at 999 Hz into
# OUT/<backend without '-'>-<k>.data (k = the next free number), then
# lets the run finish. OUT/<backend>-<k>.log holds the run's output, with
# its s/call median, so that samples per run become machine time per call.
set -euo pipefail
out=${1:?usage: profile_large.sh OUT BACKEND [SECONDS] [PATTERN]}
backend=${2:?usage: profile_large.sh OUT BACKEND [SECONDS] [PATTERN]}
seconds=${3:-4}
pattern=${4:-"$backend: warm-up"}
here=$(cd "$(dirname "$0")/.." && pwd)
bench="$here/target/release/aggbox-bench"
[ -x "$bench" ] || { echo "profile_large.sh: build $bench first (cargo build --release --features bench)" >&2; exit 1; }
command -v perf >/dev/null || { echo "profile_large.sh: perf is not installed" >&2; exit 1; }
mkdir -p "$out"
mode=${backend//-/}
k=0
while [ -e "$out/$mode-$k.data" ]; do k=$((k + 1)); done
log="$out/$backend-$k.log"
AGGBOX_LARGE_BACKENDS="$backend" "$bench" large --reps "${AGGBOX_PROFILE_REPS:-200}" --no-plot --out "$out/run-$backend-$k" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
until grep -q -- "$pattern" "$log"; do
    kill -0 "$pid" 2>/dev/null || { echo "profile_large.sh: the run ended before \"$pattern\"; see $log" >&2; exit 1; }
    sleep 0.2
done
sleep 1
perf record -a -g -F 999 -o "$out/$mode-$k.data" -- sleep "$seconds" 2>>"$log"
wait "$pid"
trap - EXIT
grep -E "s/call" "$log" | tail -n 3
echo "profile: $out/$mode-$k.data"
