#!/usr/bin/env bash
# DDP training over AggBox on a network-namespace testbed (docs/PYTHON.md):
# host 0 is the node and runs only `aggbox attach` (a node-served job, the
# in-kernel allreduce), hosts 1..W run python/examples/train_ddp.py, one
# worker each, which trains the model from the same seed with DDP's Gloo
# allreduce, with aggbox.torch.allreduce_hook through AggBox only, and with
# the hook's default route policy (AggBox or Gloo per bucket size, measured).
#
#   python/examples/ddp_testbed.sh [--workers 4] [--mtu 1500] [--slots N] [train_ddp.py options...]
#
# --slots sets the job's `slots`; jumbo MTUs need fewer than the default 4096
# to keep the job's fragments within the kernel's block pool (910 at MTU
# 9000: `slots_for_mtu` in src/bin/aggbox-bench/large/, docs/JUMBO.md).
#
# e.g. `python/examples/ddp_testbed.sh --models resnet18 --steps 10`. Needs
# root, `make build python` first (AGGBOX_BIN and AGGBOX_PYTHONPATH override
# where the binary and the package are). Everything it creates is removed on
# exit, also on failure; it stops only the processes it started, by pid.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$(readlink -f "${AGGBOX_BIN:-$REPO/target/release/aggbox}")
SITE=$(readlink -f "${AGGBOX_PYTHONPATH:-$REPO/target/python/site}")
PYTHON=/usr/bin/python3
WORKERS=4
MTU=1500
SLOTS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --workers) WORKERS=$2; shift 2 ;;
        --mtu) MTU=$2; shift 2 ;;
        --slots) SLOTS="slots = $2"; shift 2 ;;
        *) break ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "ddp_testbed.sh: needs root (network namespaces, XDP)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "ddp_testbed.sh: $BIN missing: run make build" >&2; exit 1; }
[ -f "$SITE/aggbox/__init__.py" ] || { echo "ddp_testbed.sh: no aggbox package in $SITE: run make python" >&2; exit 1; }

TESTBED="$REPO/scripts/testbed.sh"
PREFIX="ddp$$"
PREFIX=${PREFIX:0:8}
JOB=21
PORT=7800
GROUP=9
DATA_PORT=7900
NODE_ADDR=10.77.0.11
WORK=$(mktemp -d /tmp/aggbox-ddp.XXXXXX)
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
    [ $rc -eq 0 ] || echo "ddp_testbed.sh: FAILED (exit $rc)" >&2
    exit $rc
}
trap cleanup EXIT INT TERM

"$TESTBED" up --prefix "$PREFIX" --hosts $((WORKERS + 1)) --mtu "$MTU" >/dev/null
mkdir -p "$PIN_ROOT"
mount -t bpf bpf "$PIN_ROOT"

workers="" members=""
for i in $(seq 1 "$WORKERS"); do
    workers+="\"10.77.0.$((11 + i))\", "
    members+="\"10.77.0.$((11 + i)):$DATA_PORT\", "
done
cat >"$WORK/node.toml" <<EOF
[node]
metrics = "off"

[[job]]
id = $JOB
port = $PORT
workers = [ ${workers%, } ]
result_port = $((PORT + 1))
result_group = $GROUP
$SLOTS
consumer = "node"     # aggbox attach serves the results: no aggregator application

[[group]]
id = $GROUP
members = [ ${members%, } ]
EOF

ip netns exec "${PREFIX}h0" "$BIN" attach eth0 --config "$WORK/node.toml" --pin-root "$PIN_ROOT" >"$WORK/attach.log" 2>&1 &
ATTACH_PID=$!
for _ in $(seq 100); do
    grep -q "aggbox: attached to eth0" "$WORK/attach.log" && break
    kill -0 "$ATTACH_PID" 2>/dev/null || { cat "$WORK/attach.log" >&2; exit 1; }
    sleep 0.1
done
grep -q "aggbox: attached to eth0" "$WORK/attach.log" || { cat "$WORK/attach.log" >&2; exit 1; }
echo "node ${PREFIX}h0 ($NODE_ADDR): aggbox attach, job $JOB served by the node; $WORKERS workers, MTU $MTU" >&2

for r in $(seq 0 $((WORKERS - 1))); do
    ip netns exec "${PREFIX}h$((r + 1))" env PYTHONPATH="$SITE" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
        "$PYTHON" "$REPO/python/examples/train_ddp.py" --rank "$r" --world "$WORKERS" \
        --config "$WORK/node.toml" --job "$JOB" --aggregator "$NODE_ADDR" --master-addr 10.77.0.12 "$@" \
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
