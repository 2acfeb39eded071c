#!/usr/bin/env bash
# Robustness soak (docs/ROBUSTNESS.md): mixed traffic until a deadline.
#
#   sudo scripts/soak.sh            # 30 minutes
#   SOAK_MINUTES=2 sudo scripts/soak.sh
#
# Each pass runs, with fresh seeds: the XDP + TC packet fuzzers (valid
# rounds of two jobs interleaved with mutated datagrams, every input checked
# against the model), the isolation/quota tests, the straggler/reclamation
# tests (reclaimer racing contributions on both CPUs), the decoder fuzz loop,
# a churn pass (attach/detach, kill -9, detach under a blasting sender), and
# the runtime under 0.01/1/5 % loss, a 10 % burst and duplication.
# Between passes it records the kernel's BPF object counts, memory and
# leftover test namespaces; at the end it fails if a test run failed and
# reports growth of programs, links or testbed namespaces across the run.
# Not in CI. Needs root. Uses CARGO_TARGET_DIR if set.
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=${SOAK_MINUTES:-30}
DEADLINE=$(( $(date +%s) + MINUTES * 60 ))
LOG=${SOAK_LOG:-/tmp/aggbox-soak-$$.log}
FUZZ_INPUTS=${SOAK_FUZZ_INPUTS:-400000}
CHURN_CYCLES=${SOAK_CHURN_CYCLES:-10}
TESTS=(fuzz_bpf isolation stragglers fuzz_decoders churn runtime_netns)

[ "$(id -u)" = 0 ] || { echo "soak: needs root" >&2; exit 1; }
echo "soak: ${MINUTES} min, log ${LOG}"
cargo test --no-run $(printf -- '--test %s ' "${TESTS[@]}") >>"$LOG" 2>&1

count_ids() { # prog|map|link
    bpftool -j "$1" show 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo "?"
}
snapshot() {
    local mem ns
    mem=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
    ns=$(ip netns list | grep -cE '^a[0-9]+[a-z0-9]{2}(h[0-9]+|sw)' || true)
    # programs and links only: listing maps by id is never done while an
    # attachment may be tearing down (a kernel race leaks a prog_array)
    echo "progs=$(count_ids prog) links=$(count_ids link) mem_avail_kib=${mem} test_netns=${ns}"
}

start_snap=$(snapshot)
echo "soak: start  ${start_snap}" | tee -a "$LOG"
pass=0 failed=0
while [ "$(date +%s)" -lt "$DEADLINE" ]; do
    pass=$((pass + 1))
    seed=$(( (pass * 2654435761) % 4294967296 ))
    for t in "${TESTS[@]}"; do
        [ "$(date +%s)" -lt "$DEADLINE" ] || break
        t0=$(date +%s.%N)
        if AGGBOX_FUZZ_SEED=$seed AGGBOX_FUZZ_INPUTS=$FUZZ_INPUTS AGGBOX_FUZZ_TC_INPUTS=$((FUZZ_INPUTS / 10)) \
           AGGBOX_CHURN_CYCLES=$CHURN_CYCLES \
           cargo test -q --test "$t" -- --nocapture >>"$LOG" 2>&1; then
            status=ok
        else
            status=FAILED; failed=$((failed + 1))
        fi
        printf 'soak: pass %d %-14s %-6s %6.1f s  %s\n' "$pass" "$t" "$status" \
            "$(echo "$(date +%s.%N) - $t0" | bc)" "$(snapshot)" | tee -a "$LOG"
    done
done
sleep 2 # the kernel frees objects asynchronously
end_snap=$(snapshot)
echo "soak: end    ${end_snap}" | tee -a "$LOG"
echo "soak: ${pass} pass(es), ${failed} failed test run(s)"

grow() { # key
    local a b
    a=$(sed -n "s/.*$1=\([0-9]*\).*/\1/p" <<<"$start_snap")
    b=$(sed -n "s/.*$1=\([0-9]*\).*/\1/p" <<<"$end_snap")
    [ -n "$a" ] && [ -n "$b" ] && [ "$b" -gt "$a" ] && echo "$1: $a -> $b"
    return 0
}
# Other users of the machine may load programs concurrently: growth is
# reported, and fails the soak only for our own test namespaces.
for k in progs links; do g=$(grow $k); [ -z "$g" ] || echo "soak: note: $g (other workloads may account for it)"; done
# Testbed namespaces are named a<pid><n>h<i>/sw: other users' concurrent
# testbeds match too, so growth is reported; check `ip netns` if it shows.
g=$(grow test_netns); [ -z "$g" ] || echo "soak: note: testbed namespaces: $g (leaked, or another run's)"

[ "$failed" = 0 ]
