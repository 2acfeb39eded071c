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

NODE_ADDR=10.77.0.11
CONTROL=7471
TENANT=bench

. "$REPO/python/examples/testbed_lib.sh"
testbed_up backend_testbed.sh bk

KEY=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
(umask 077; printf '[[tenant]]\nname = "%s"\nkey = "%s"\njobs = 8\n' "$TENANT" "$KEY" >"$WORK/keys.toml")
cat >"$WORK/node.toml" <<EOF
[node]
metrics = "off"
keys = "$WORK/keys.toml"
control = "0.0.0.0:$CONTROL"
EOF

node_attach
echo "node ${PREFIX}h0 ($NODE_ADDR): aggbox attach, jobs on demand on :$CONTROL; $WORKERS ranks, MTU $MTU" >&2

for r in $(seq 0 $((WORKERS - 1))); do
    ip netns exec "${PREFIX}h$((r + 1))" env PYTHONPATH="$SITE" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
        AGGBOX_NODE="$NODE_ADDR:$CONTROL" AGGBOX_TENANT="$TENANT" AGGBOX_KEY="$KEY" \
        "$PYTHON" "$SCRIPT" --rank "$r" --world "$WORKERS" --master-addr 10.77.0.12 "$@" \
        >"$WORK/rank$r.log" 2>&1 &
    PIDS+=($!)
done
ranks_wait
