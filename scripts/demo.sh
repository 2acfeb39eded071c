#!/usr/bin/env bash
# AggBox end-to-end demo on a network-namespace testbed (run by `make demo`).
#
# Builds a star of 5 hosts (host 0 is the aggregator and broadcast root,
# hosts 1..4 are workers), attaches AggBox to the aggregator's interface and
# shows, with real datagrams through the bridge:
#   1. an aggregation: every worker sends its vector; the XDP program reduces
#      them in the kernel; the aggregator's application receives one RESULT
#      per fragment, and (in-kernel allreduce, `result_group`) the TC program
#      copies each RESULT to every worker; all printed beside the reference
#      reducer's result;
#   2. a broadcast: the root sends ONE datagram; the TC program delivers a
#      copy to every worker, each printed by its receiver;
#   3. the counters of both programs (aggbox status).
# Everything it creates is removed on exit, also on failure.
set -euo pipefail

BIN=${1:-target/release/aggbox}
BIN=$(readlink -f "$BIN")
HERE=$(cd "$(dirname "$0")" && pwd)
TESTBED="$HERE/testbed.sh"
PREFIX="demo$$"
PREFIX=${PREFIX:0:8}
SENDERS=4
JOB=7
PORT=7000
RESULT_PORT=7001
ROUND=1
ELEMENTS=1000   # three fragments at MTU 1500
WORK=$(mktemp -d /tmp/aggbox-demo.XXXXXX)
PIN_ROOT="$WORK/bpffs"
ATTACH_PID=""
LISTEN_PID=""
GROUP=3
MEMBER_PORT=7200
BG_PIDS=()

cleanup() {
    local rc=$?
    # Stop only what this script started, by pid.
    if [ -n "$ATTACH_PID" ] && kill -0 "$ATTACH_PID" 2>/dev/null; then
        kill -INT "$ATTACH_PID" 2>/dev/null || true
        wait "$ATTACH_PID" 2>/dev/null || true
    fi
    for pid in $LISTEN_PID "${BG_PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    "$TESTBED" down --prefix "$PREFIX" >/dev/null 2>&1 || true
    umount "$PIN_ROOT" 2>/dev/null || true
    rm -rf "$WORK"
    if [ $rc -ne 0 ]; then echo "demo: FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap cleanup EXIT INT TERM

step() { printf '\n== %s\n' "$*"; }

step "testbed: 1 aggregator + $SENDERS senders on a bridge (prefix $PREFIX)"
"$TESTBED" up --prefix "$PREFIX" --hosts $((SENDERS + 1))
AGG_NS="${PREFIX}h0"
AGG_ADDR=10.77.0.11

# A bpffs visible to every `ip netns exec` (each one gets a private mount
# namespace with a fresh /sys, which hides the host's /sys/fs/bpf).
mkdir -p "$PIN_ROOT"
mount -t bpf bpf "$PIN_ROOT"

workers=""
members=""
for i in $(seq 1 $SENDERS); do
    workers+="\"10.77.0.$((11 + i))\", "
    members+="\"10.77.0.$((11 + i)):$MEMBER_PORT\", "
done
cat >"$WORK/aggbox.toml" <<EOF
[node]
metrics = "off"

[[job]]
id = $JOB
port = $PORT
workers = [ ${workers%, } ]
result_port = $RESULT_PORT
result_group = $GROUP     # in-kernel allreduce: every RESULT also goes to the group
vector_len = $ELEMENTS

[[group]]
id = $GROUP
members = [ ${members%, } ]
EOF
echo "config ($WORK/aggbox.toml):"
sed 's/^/    /' "$WORK/aggbox.toml"

step "attach AggBox to eth0 of the aggregator"
: >"$WORK/attach.log"
ip netns exec "$AGG_NS" "$BIN" attach eth0 --config "$WORK/aggbox.toml" --pin-root "$PIN_ROOT" \
    >"$WORK/attach.log" 2>&1 &
ATTACH_PID=$!
for _ in $(seq 1 600); do   # up to 60 s: a loaded or emulated machine verifies slowly
    grep -q "aggbox: attached to eth0" "$WORK/attach.log" && break
    kill -0 "$ATTACH_PID" 2>/dev/null || { cat "$WORK/attach.log" >&2; exit 1; }
    sleep 0.1
done
sed 's/^/    /' "$WORK/attach.log"
grep -q "aggbox: attached to eth0" "$WORK/attach.log" || { echo "attach did not come up" >&2; exit 1; }

step "the aggregator's application listens on UDP $RESULT_PORT"
ip netns exec "$AGG_NS" "$BIN" listen --port "$RESULT_PORT" --job "$JOB" --timeout 10 --elements "$ELEMENTS" \
    --workers "$SENDERS" --op sum \
    >"$WORK/results.txt" 2>&1 &
LISTEN_PID=$!
sleep 0.3

step "every worker listens on UDP $MEMBER_PORT for the allreduce copies"
for i in $(seq 1 $SENDERS); do
    ip netns exec "${PREFIX}h$i" "$BIN" listen --port "$MEMBER_PORT" --job "$JOB" --timeout 10 \
        --elements "$ELEMENTS" --workers "$SENDERS" --op sum >"$WORK/worker$i.txt" 2>&1 &
    BG_PIDS+=($!)
done
sleep 0.3

step "every worker sends its vector of $ELEMENTS elements (SUM, round $ROUND)"
for i in $(seq 1 $SENDERS); do
    rank=$((i - 1))
    ip netns exec "${PREFIX}h$i" "$BIN" contribute --to "$AGG_ADDR:$PORT" --job "$JOB" --rank "$rank" \
        --round "$ROUND" --op sum --elements "$ELEMENTS"
done

wait "$LISTEN_PID" && LISTEN_PID="" || { LISTEN_PID=""; cat "$WORK/results.txt" >&2; exit 1; }
step "what the aggregator's application received, next to the reference reducer"
sed 's/^/    /' "$WORK/results.txt"
step "what each worker received from the TC program (in-kernel allreduce)"
for i in $(seq 1 $SENDERS); do
    wait "${BG_PIDS[$((i - 1))]}" || { cat "$WORK/worker$i.txt" >&2; exit 1; }
    echo "  worker $i (10.77.0.$((11 + i))):"
    sed 's/^/    /' "$WORK/worker$i.txt"
done
BG_PIDS=()

step "broadcast: the root sends ONE datagram; the TC program copies it to every member"
for i in $(seq 1 $SENDERS); do
    ip netns exec "${PREFIX}h$i" "$BIN" listen-broadcast --port "$MEMBER_PORT" --count 1 --timeout 10 \
        >"$WORK/bcast$i.txt" 2>&1 &
    BG_PIDS+=($!)
done
sleep 0.3
ip netns exec "$AGG_NS" "$BIN" send-broadcast --to "10.77.0.12:$MEMBER_PORT" --group "$GROUP" --mask 0xf \
    --seq 1 --text "hello from the root, one sendto, $SENDERS copies"
for i in $(seq 1 $SENDERS); do
    wait "${BG_PIDS[$((i - 1))]}" || { cat "$WORK/bcast$i.txt" >&2; exit 1; }
    echo "  worker $i (10.77.0.$((11 + i))) got:"
    sed 's/^/    /' "$WORK/bcast$i.txt"
done
BG_PIDS=()

step "counters on the aggregator (aggbox status)"
ip netns exec "$AGG_NS" "$BIN" status eth0 --pin-root "$PIN_ROOT"

step "detach (SIGINT to the attach process)"
kill -INT "$ATTACH_PID"
wait "$ATTACH_PID"
ATTACH_PID=""
tail -n 1 "$WORK/attach.log" | sed 's/^/    /'
echo
echo "demo: OK"
