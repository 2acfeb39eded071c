# Sourced by ddp_testbed.sh and backend_testbed.sh: the testbed, the node's
# private bpffs and the cleanup both share. `testbed_up NAME TAG` (NAME: the
# script's name for messages, TAG: a short prefix for the namespaces and the
# work directory) sets WORK, PIN_ROOT, PREFIX, ATTACH_PID and PIDS, installs
# the cleanup on exit (the workers in PIDS and the attach process stopped by
# pid, the testbed taken down, the bpffs unmounted, WORK removed, also on
# failure), brings up WORKERS + 1 hosts at MTU and mounts the bpffs;
# `node_attach` starts the node, `ranks_wait` collects the ranks. Needs
# REPO, WORKERS and MTU (and BIN for node_attach).

testbed_up() {
    TESTBED_NAME=$1
    TESTBED="$REPO/scripts/testbed.sh"
    PREFIX="$2$$"
    PREFIX=${PREFIX:0:8}
    WORK=$(mktemp -d "/tmp/aggbox-$2.XXXXXX")
    PIN_ROOT="$WORK/bpffs"
    ATTACH_PID=""
    PIDS=()
    trap testbed_cleanup EXIT INT TERM
    "$TESTBED" up --prefix "$PREFIX" --hosts $((WORKERS + 1)) --mtu "$MTU" >/dev/null
    mkdir -p "$PIN_ROOT"
    mount -t bpf bpf "$PIN_ROOT"
}

testbed_cleanup() {
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
    [ $rc -eq 0 ] || echo "$TESTBED_NAME: FAILED (exit $rc)" >&2
    exit $rc
}

# Starts `aggbox attach eth0` on host 0 with $WORK/node.toml (BIN) and waits
# for its "attached" line; exits with its log when it fails.
node_attach() {
    ip netns exec "${PREFIX}h0" "$BIN" attach eth0 --config "$WORK/node.toml" --pin-root "$PIN_ROOT" >"$WORK/attach.log" 2>&1 &
    ATTACH_PID=$!
    for _ in $(seq 100); do
        grep -q "aggbox: attached to eth0" "$WORK/attach.log" && return 0
        kill -0 "$ATTACH_PID" 2>/dev/null || { cat "$WORK/attach.log" >&2; exit 1; }
        sleep 0.1
    done
    cat "$WORK/attach.log" >&2
    exit 1
}

# Waits for every rank's process in PIDS (rank r's log: $WORK/rank$r.log,
# shown when it failed), prints rank 0's log and exits 1 if any failed.
ranks_wait() {
    local failed=0
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
}
