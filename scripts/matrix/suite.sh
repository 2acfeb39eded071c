#!/usr/bin/env bash
# suite.sh: the checks of one row of the kernel-version matrix (scripts/matrix.sh).
#
# Runs on the kernel it finds itself on: directly on the host for the "host"
# row, as the last step of scripts/matrix/init inside a QEMU guest for the
# other rows. It reads a plan written by matrix.sh and writes one result per
# line, tab-separated, to RESULTS (a file on the host, /dev/ttyS1 in a guest);
# matrix.sh turns those lines into the summary. Everything else it prints is
# the human log (the guest's console).
#
# Usage: suite.sh PLAN RESULTS
#
# Plan lines (tab-separated; every path is absolute and the same on the host
# and in the guest):
#   manifest  DIR                 the crate root (cwd of the test binaries)
#   aggbox    PATH                target/release/aggbox
#   bpftool   PATH
#   proginfo  PATH                scripts/matrix/proginfo.c, built static
#   obj       NAME PATH PROGS     a BPF object, PROGS = its programs, comma-separated
#   test      NAME PATH           a cargo test binary (BPF_PROG_TEST_RUN suites)
#   netns     NAME PATH           a netns end-to-end script, run as `bash PATH AGGBOX`
#   timeout   SECONDS             per test binary / per netns script
#
# Result lines:
#   kernel    RELEASE
#   load      OBJ ok|fail SECONDS
#   prog      OBJ PROG XLATED_INSNS JITED_BYTES VERIFIED_INSNS
#   loadlog   OBJ LINE            (on failure: libbpf's error and the verifier's last lines)
#   test      NAME pass|fail|timeout PASSED FAILED IGNORED SECONDS
#   testfail  NAME TESTCASE
#   testlog   NAME LINE           (on failure: the last lines of its output)
#   netns     NAME pass|fail|timeout SECONDS
#   netnslog  NAME LINE           (on failure: the last lines of its output)
#   done
# Nothing here stops at a failure: every check runs and reports.

set -uo pipefail

PLAN=${1:?usage: suite.sh PLAN RESULTS}
RESULTS=${2:?usage: suite.sh PLAN RESULTS}
LOG_LINES=${MATRIX_LOG_LINES:-25}

manifest="" aggbox="" bpftool=bpftool proginfo="" timeout_s=600
objs=() tests=() netns=()
while IFS=$'\t' read -r kind a b c; do
    case $kind in
        manifest) manifest=$a ;;
        aggbox) aggbox=$a ;;
        bpftool) bpftool=$a ;;
        proginfo) proginfo=$a ;;
        timeout) timeout_s=$a ;;
        obj) objs+=("$a"$'\t'"$b"$'\t'"$c") ;;
        test) tests+=("$a"$'\t'"$b") ;;
        netns) netns+=("$a"$'\t'"$b") ;;
    esac
done <"$PLAN"

emit() { # fields... -> one tab-separated line on RESULTS
    local IFS=$'\t'
    printf '%s\n' "$*" >>"$RESULTS"
}

emit_tail() { # KIND NAME FILE N: the last N non-empty lines of FILE, one result line each
    local kind=$1 name=$2 file=$3 n=$4 line
    tail -n "$n" "$file" | tr -d '\r' | tr '\t' ' ' | while IFS= read -r line; do
        [ -n "$line" ] && emit "$kind" "$name" "$line"
    done
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

WORK=$(mktemp -d /tmp/aggbox-suite.XXXXXX)
PIN=$WORK/bpffs
cleanup() {
    umount "$PIN" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

emit kernel "$(uname -r)"
echo "== suite on $(uname -r): ${#objs[@]} object(s), ${#tests[@]} test binary(ies), ${#netns[@]} netns check(s)"

# ---------------------------------------------------------------- 1. load every program
# bpftool's libbpf loads every program of the object through the verifier;
# proginfo then reads each program's instruction counts from the kernel.
mkdir -p "$PIN"
mount -t bpf bpf "$PIN" || echo "suite: cannot mount bpffs on $PIN" >&2
for entry in "${objs[@]}"; do
    IFS=$'\t' read -r name path progs <<<"$entry"
    echo "== load $name ($path) with $bpftool"
    t0=$(now)
    log=$WORK/load-$name.log
    # Not `bpftool -d`: that asks for the verbose verifier log from the start,
    # and a program that hits the 1M-instruction limit then fails on a log
    # buffer the kernel refuses, with no log at all. Plain libbpf retries a
    # failed load with log level 1 and prints that log.
    if "$bpftool" prog loadall "$path" "$PIN/$name" >"$log" 2>&1; then
        emit load "$name" ok "$(elapsed "$t0")"
        # bpftool pins each program under its full name (the kernel keeps 15 characters).
        for p in "$PIN/$name"/*; do
            [ -e "$p" ] || continue
            IFS=$'\t' read -r _kname _type xl jit ver < <("$proginfo" "$p")
            pname=$(basename "$p")
            emit prog "$name" "$pname" "${xl:-0}" "${jit:-0}" "${ver:-0}"
            printf '   %-18s xlated %5s insns  jited %6s bytes  verified %7s insns\n' "$pname" "$xl" "$jit" "$ver"
        done
        rm -rf "${PIN:?}/$name"
    else
        emit load "$name" fail "$(elapsed "$t0")"
        # libbpf's own error lines first, then the verifier log's last lines.
        grep -E "^libbpf: prog '[^']*': (BPF program load failed|failed to load)|^libbpf: failed to load object|^Error:" "$log" \
            | head -n 4 >"$WORK/load-$name.err"
        awk '/-- BEGIN PROG LOAD LOG --/ { buf = ""; inlog = 1; next }
             /-- END PROG LOAD LOG --/ { inlog = 0; next }
             inlog { print }' "$log" >"$WORK/load-$name.vlog"
        emit_tail loadlog "$name" "$WORK/load-$name.err" 4
        if [ -s "$WORK/load-$name.vlog" ]; then
            emit_tail loadlog "$name" "$WORK/load-$name.vlog" "$LOG_LINES"
        else
            emit_tail loadlog "$name" "$log" "$LOG_LINES"
        fi
        echo "   FAILED; last lines of the load log:"
        tail -n 60 "$log" | sed 's/^/   | /'
    fi
done
umount "$PIN" 2>/dev/null

# ---------------------------------------------------------------- 2. BPF_PROG_TEST_RUN suites
for entry in "${tests[@]}"; do
    IFS=$'\t' read -r name path <<<"$entry"
    echo "== test $name"
    t0=$(now)
    log=$WORK/test-$name.log
    (cd "$manifest" && timeout --kill-after=10 "$timeout_s" "$path") >"$log" 2>&1
    rc=$?
    secs=$(elapsed "$t0")
    sed 's/^/   | /' "$log"
    # "test result: ok. 12 passed; 0 failed; 0 ignored; ..."
    passed=0 failed=0 ignored=0
    read -r passed failed ignored < <(awk '/^test result:/ {
            for (i = 1; i <= NF; i++) {
                if ($(i+1) ~ /^passed;?$/) p += $i
                if ($(i+1) ~ /^failed;?$/) f += $i
                if ($(i+1) ~ /^ignored;?$/) g += $i
            } }
        END { printf "%d %d %d\n", p, f, g }' "$log")
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status=timeout
    elif [ $rc -eq 0 ] && [ "$failed" -eq 0 ] && grep -q '^test result: ok' "$log"; then
        status=pass
    else
        status=fail
    fi
    emit test "$name" "$status" "$passed" "$failed" "$ignored" "$secs"
    if [ "$status" != pass ]; then
        sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | while IFS= read -r tc; do
            emit testfail "$name" "$tc"
        done
        # The first failure's message is the useful part: the panic lines.
        grep -A 3 "panicked at" "$log" | grep -v '^--$' | head -n 8 >"$WORK/test-$name.err"
        emit_tail testlog "$name" "$WORK/test-$name.err" 8
        [ "$status" = timeout ] && emit testlog "$name" "timed out after ${timeout_s}s"
        [ -s "$WORK/test-$name.err" ] || emit_tail testlog "$name" "$log" "$LOG_LINES"
    fi
done

# ---------------------------------------------------------------- 3. netns end to end
for entry in "${netns[@]}"; do
    IFS=$'\t' read -r name path <<<"$entry"
    echo "== netns $name: bash $path $aggbox"
    t0=$(now)
    log=$WORK/netns-$name.log
    (cd "$manifest" && timeout --kill-after=10 "$timeout_s" bash "$path" "$aggbox") >"$log" 2>&1
    rc=$?
    sed 's/^/   | /' "$log"
    if [ $rc -eq 0 ]; then
        status=pass
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status=timeout
    else
        status=fail
    fi
    emit netns "$name" "$status" "$(elapsed "$t0")"
    [ $status = pass ] || emit_tail netnslog "$name" "$log" "$LOG_LINES"
done

emit done
echo "== suite done"
