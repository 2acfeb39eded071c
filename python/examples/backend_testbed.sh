#!/usr/bin/env bash
# The torch.distributed backend "aggbox" on a network-namespace testbed
# (docs/PYTHON.md): host 0 is the node and runs only `aggbox attach` with a
# control endpoint (jobs on demand, a key file of one tenant); hosts 1..W run
# a script, one rank each, that knows only AGGBOX_NODE, AGGBOX_TENANT and
# AGGBOX_KEY: by default python/examples/bench_backend.py, the allreduce
# sweep against Gloo.
#
#   python/examples/backend_testbed.sh [--workers 4] [--mtu 1500] [--script FILE] [script options...]
#
# Needs root, `make build python` first (AGGBOX_BIN and AGGBOX_PYTHONPATH
# override where the binary and the package are). Everything it creates is
# removed on exit, also on failure; it stops only the processes it started,
# by pid.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$(readlink -f "${AGGBOX_BIN:-$REPO/target/release/aggbox}")
SITE=$(readlink -f "${AGGBOX_PYTHONPATH:-$REPO/target/python/site}")
PYTHON=/usr/bin/python3
WORKERS=4
MTU=1500
SCRIPT="$REPO/python/examples/bench_backend.py"
while [ $# -gt 0 ]; do
    case "$1" in
        --workers) WORKERS=$2; shift 2 ;;
        --mtu) MTU=$2; shift 2 ;;
        --script) SCRIPT=$(readlink -f "$2"); shift 2 ;;
        *) break ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "backend_testbed.sh: needs root (network namespaces, XDP)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "backend_testbed.sh: $BIN missing: run make build" >&2; exit 1; }
[ -f "$SITE/aggbox/torch/backend.py" ] || { echo "backend_testbed.sh: no aggbox package in $SITE: run make python" >&2; exit 1; }

TESTBED="$REPO/scripts/testbed.sh"
PREFIX="bk$$"
PREFIX=${PREFIX:0:8}
NODE_ADDR=10.77.0.11
CONTROL=7471
TENANT=bench
WORK=$(mktemp -d /tmp/aggbox-backend.XXXXXX)
PIN_ROOT="$WORK/bpffs"
ATTACH_PID=""
PIDS=()

cleanup() {
    local rc=$?
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ -n "$ATTACH_PID" ] && kill -0 "$ATTACH_PID" 2>/dev/null; then
        kill -INT "$ATTACH_PID" 2>/dev/null || true
        wait "$ATTACH_PID" 2>/dev/null || true
    fi
    "$TESTBED" down --prefix "$PREFIX" >/dev/null 2>&1 || true
    umount "$PIN_ROOT" 2>/dev/null || true
    rm -rf "$WORK"
    [ $rc -eq 0 ] || echo "backend_testbed.sh: FAILED (exit $rc)" >&2
    exit $rc
}
trap cleanup EXIT INT TERM

"$TESTBED" up --prefix "$PREFIX" --hosts $((WORKERS + 1)) --mtu "$MTU" >/dev/null
mkdir -p "$PIN_ROOT"
mount -t bpf bpf "$PIN_ROOT"

KEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
(umask 077; printf '[[tenant]]\nname = "%s"\nkey = "%s"\njobs = 8\n' "$TENANT" "$KEY" >"$WORK/keys.toml")
cat >"$WORK/node.toml" <<EOF
[node]
metrics = "off"
keys = "$WORK/keys.toml"
control = "0.0.0.0:$CONTROL"
EOF

ip netns exec "${PREFIX}h0" "$BIN" attach eth0 --config "$WORK/node.toml" --pin-root "$PIN_ROOT" >"$WORK/attach.log" 2>&1 &
ATTACH_PID=$!
for _ in $(seq 100); do
    grep -q "aggbox: attached to eth0" "$WORK/attach.log" && break
    kill -0 "$ATTACH_PID" 2>/dev/null || { cat "$WORK/attach.log" >&2; exit 1; }
    sleep 0.1
done
grep -q "aggbox: attached to eth0" "$WORK/attach.log" || { cat "$WORK/attach.log" >&2; exit 1; }
echo "node ${PREFIX}h0 ($NODE_ADDR): aggbox attach, jobs on demand on :$CONTROL; $WORKERS ranks, MTU $MTU" >&2

for r in $(seq 0 $((WORKERS - 1))); do
    ip netns exec "${PREFIX}h$((r + 1))" env PYTHONPATH="$SITE" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
        AGGBOX_NODE="$NODE_ADDR:$CONTROL" AGGBOX_TENANT="$TENANT" AGGBOX_KEY="$KEY" \
        "$PYTHON" "$SCRIPT" --rank "$r" --world "$WORKERS" --master-addr 10.77.0.12 "$@" \
        >"$WORK/rank$r.log" 2>&1 &
    PIDS+=($!)
done
failed=0
for r in $(seq 0 $((WORKERS - 1))); do
    if ! wait "${PIDS[$r]}"; then
        failed=1
        echo "--- rank $r failed:" >&2
        cat "$WORK/rank$r.log" >&2
    fi
done
PIDS=()
cat "$WORK/rank0.log"
exit $failed
