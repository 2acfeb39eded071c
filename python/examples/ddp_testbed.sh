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

JOB=21
PORT=7800
GROUP=9
DATA_PORT=7900
NODE_ADDR=10.77.0.11

. "$REPO/python/examples/testbed_lib.sh"
testbed_up ddp_testbed.sh ddp

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

node_attach
echo "node ${PREFIX}h0 ($NODE_ADDR): aggbox attach, job $JOB served by the node; $WORKERS workers, MTU $MTU" >&2

for r in $(seq 0 $((WORKERS - 1))); do
    ip netns exec "${PREFIX}h$((r + 1))" env PYTHONPATH="$SITE" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
        "$PYTHON" "$REPO/python/examples/train_ddp.py" --rank "$r" --world "$WORKERS" \
        --config "$WORK/node.toml" --job "$JOB" --aggregator "$NODE_ADDR" --master-addr 10.77.0.12 "$@" \
        >"$WORK/rank$r.log" 2>&1 &
    PIDS+=($!)
done
ranks_wait
