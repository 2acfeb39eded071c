#!/usr/bin/env bash
# AggBox end-to-end demo on a network-namespace testbed (run by `make demo`).
#
# Builds a star of 5 hosts (host 0 is the aggregator, hosts 1..4 send),
# attaches AggBox to the aggregator's interface, sends one contribution
# vector from every sender, prints what the aggregator's application
# received next to what the reference reducer expects, and the per-reason
# counters of the XDP program. Everything it creates is removed on exit,
# also on failure.
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

cleanup() {
    local rc=$?
    # Stop only what this script started, by pid.
    if [ -n "$ATTACH_PID" ] && kill -0 "$ATTACH_PID" 2>/dev/null; then
        kill -INT "$ATTACH_PID" 2>/dev/null || true
        wait "$ATTACH_PID" 2>/dev/null || true
    fi
    if [ -n "$LISTEN_PID" ] && kill -0 "$LISTEN_PID" 2>/dev/null; then
        kill "$LISTEN_PID" 2>/dev/null || true
        wait "$LISTEN_PID" 2>/dev/null || true
    fi
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
for i in $(seq 1 $SENDERS); do
    workers+="\"10.77.0.$((11 + i))\", "
done
cat >"$WORK/aggbox.toml" <<EOF
[node]
metrics = "off"

[[job]]
id = $JOB
port = $PORT
workers = [ ${workers%, } ]
result_port = $RESULT_PORT
vector_len = $ELEMENTS
EOF
echo "config ($WORK/aggbox.toml):"
sed 's/^/    /' "$WORK/aggbox.toml"

step "attach AggBox to eth0 of the aggregator"
: >"$WORK/attach.log"
ip netns exec "$AGG_NS" "$BIN" attach eth0 --config "$WORK/aggbox.toml" --pin-root "$PIN_ROOT" \
    >"$WORK/attach.log" 2>&1 &
ATTACH_PID=$!
for _ in $(seq 1 100); do
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

step "every sender sends its vector of $ELEMENTS elements (SUM, round $ROUND)"
for i in $(seq 1 $SENDERS); do
    rank=$((i - 1))
    ip netns exec "${PREFIX}h$i" "$BIN" contribute --to "$AGG_ADDR:$PORT" --job "$JOB" --rank "$rank" \
        --round "$ROUND" --op sum --elements "$ELEMENTS"
done

wait "$LISTEN_PID" && LISTEN_PID="" || { LISTEN_PID=""; cat "$WORK/results.txt" >&2; exit 1; }
step "what the application received, next to the reference reducer"
sed 's/^/    /' "$WORK/results.txt"

step "XDP counters on the aggregator (aggbox status)"
ip netns exec "$AGG_NS" "$BIN" status eth0 --pin-root "$PIN_ROOT"

step "detach (SIGINT to the attach process)"
kill -INT "$ATTACH_PID"
wait "$ATTACH_PID"
ATTACH_PID=""
tail -n 1 "$WORK/attach.log" | sed 's/^/    /'
echo
echo "demo: OK"
