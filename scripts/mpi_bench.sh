#!/usr/bin/env bash
# mpi_bench.sh: MPI_Allreduce latency (int32 SUM, OSU style) over a netns
# testbed, plain MPI against the same program with libaggbox_mpi preloaded
# (docs/MPI.md, "Benchmark"). Host 0 runs only `aggbox attach` with a
# node-served job; hosts 1..N are the ranks (scripts/mpi_netns_agent.sh).
#
# Usage: scripts/mpi_bench.sh [--ranks N] [--mpi openmpi|mpich]
#                             [--max-bytes B] [--iterations I] [--out DIR]
#                             [--aggbox-env VAR=VALUE]...
# --aggbox-env: a variable for the libaggbox_mpi run only (repeatable), e.g.
# AGGBOX_CALLER_THREAD=0 to measure with every call on the progress thread.
# Needs root, `make build mpi` (PROFILE=release). Writes DIR/mpi_allreduce.csv
# (size_bytes, plain_us, aggbox_us, ...) and prints it as a table.
set -euo pipefail

ranks=4 mpi=openmpi max_bytes=$((1 << 20)) iterations=200 out=results/mpi
aggbox_env=()
while [ $# -gt 0 ]; do
  case $1 in
    --ranks) ranks=$2; shift 2 ;;
    --mpi) mpi=$2; shift 2 ;;
    --max-bytes) max_bytes=$2; shift 2 ;;
    --iterations) iterations=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --aggbox-env) aggbox_env+=("$2"); shift 2 ;;
    *) echo "mpi_bench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

repo=$(cd "$(dirname "$0")/.." && pwd)
aggbox=$repo/target/release/aggbox
lib=$repo/target/release/libaggbox_mpi_$mpi.so
agent=$repo/scripts/mpi_netns_agent.sh
fail() { echo "mpi_bench.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (network namespaces, XDP)"
[ -x "$aggbox" ] || fail "$aggbox missing: run make build"
[ -f "$lib" ] || fail "$lib missing: run make mpi"
command -v "mpicc.$mpi" >/dev/null || fail "mpicc.$mpi not found: run make deps"

prefix=mb$(($$ % 1000000))
work=$(mktemp -d /tmp/aggbox-mpi-bench.XXXXXX)
pins=$work/pins
attach_pid=
cleanup() {
  if [ -n "$attach_pid" ]; then kill -INT "$attach_pid" 2>/dev/null || true; wait "$attach_pid" 2>/dev/null || true; fi
  mountpoint -q "$pins" && umount "$pins"
  "$repo/scripts/testbed.sh" down --prefix "$prefix" >/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$repo/scripts/testbed.sh" up --prefix "$prefix" --hosts $((ranks + 1)) >/dev/null
addr() { echo "10.77.0.$((11 + $1))"; }
workers= members= hosts=
for r in $(seq 1 "$ranks"); do
  workers+="${workers:+, }\"$(addr "$r")\""
  members+="${members:+, }\"$(addr "$r"):7700\""
  echo "${prefix}h$r slots=1" >> "$work/hosts"
  hosts+="${hosts:+,}${prefix}h$r"
done
cat > "$work/node.toml" <<EOF
[[job]]
id = 11
port = 7600
workers = [$workers]
result_port = 7601
result_group = 4
consumer = "node"

[[group]]
id = 4
members = [$members]
EOF
mkdir -p "$pins" && mount -t bpf bpf "$pins"
"mpicc.$mpi" -O2 -o "$work/osu_allreduce" "$repo/mpi/bench/osu_allreduce.c"

# The node is started for the run with the library, after the plain one
# (runs on a running node need no restart: docs/MPI.md, "Consecutive runs
# on one node"; a fresh node keeps the plain run's traffic out of its
# counters).
start_node() {
  ip netns exec "${prefix}h0" "$aggbox" attach eth0 --config "$work/node.toml" --pin-root "$pins" \
    > "$work/attach.log" 2>&1 &
  attach_pid=$!
  for _ in $(seq 100); do
    grep -q "attached to eth0" "$work/attach.log" && return 0
    kill -0 "$attach_pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$work/attach.log" >&2
  fail "aggbox attach did not start"
}

# run NAME [VAR=VALUE...]: the benchmark with those variables on every rank.
run() {
  local name=$1; shift
  local args=()
  case $mpi in
    openmpi)
      for kv in "$@"; do args+=(-x "$kv"); done
      ip netns exec "${prefix}h1" timeout 600 mpirun.openmpi --allow-run-as-root --oversubscribe -np "$ranks" \
        --hostfile "$work/hosts" --mca plm_rsh_agent "$agent" --mca btl tcp,self --mca mpi_yield_when_idle 1 \
        --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "${args[@]}" \
        "$work/osu_allreduce" "$max_bytes" "$iterations" > "$work/$name.txt" ;;
    mpich)
      for kv in "$@"; do args+=(-genv "${kv%%=*}" "${kv#*=}"); done
      ip netns exec "${prefix}h1" timeout 600 mpiexec.mpich -launcher ssh -launcher-exec "$agent" \
        -iface eth0 -hosts "$hosts" -np "$ranks" "${args[@]}" \
        "$work/osu_allreduce" "$max_bytes" "$iterations" > "$work/$name.txt" ;;
    *) fail "--mpi must be openmpi or mpich" ;;
  esac
}

echo "mpi_bench.sh: $mpi, $ranks ranks, plain MPI" >&2
run plain
start_node
echo "mpi_bench.sh: $mpi, $ranks ranks, libaggbox_mpi" >&2
run aggbox LD_PRELOAD="$lib" AGGBOX_MPI_CONFIG="$work/node.toml" AGGBOX_MPI_NODE="$(addr 0)" \
  AGGBOX_MPI_DATA_PORT=7700 AGGBOX_MPI_STATS=1 ${aggbox_env[@]+"${aggbox_env[@]}"}
# The node's counters of the run (its result service's datagrams: what a
# call costs the node), beside the ranks' lines mpirun printed.
mkdir -p "$out"
ip netns exec "${prefix}h0" "$aggbox" status --pin-root "$pins" > "$out/node_status.txt" 2>&1 || true

mkdir -p "$out"
csv=$out/mpi_allreduce.csv
{
  echo "mpi,ranks,size_bytes,plain_avg_us,plain_min_us,plain_max_us,aggbox_avg_us,aggbox_min_us,aggbox_max_us"
  join <(grep -v '^#' "$work/plain.txt" | sort -k1,1) <(grep -v '^#' "$work/aggbox.txt" | sort -k1,1) \
    | sort -n -k1,1 | awk -v m="$mpi" -v n="$ranks" '{print m "," n "," $1 "," $2 "," $3 "," $4 "," $5 "," $6 "," $7}'
} > "$csv"
echo "mpi_bench.sh: $csv" >&2
printf "%-12s %12s %12s %8s\n" size_bytes plain_us aggbox_us ratio
tail -n +2 "$csv" | awk -F, '{printf "%-12s %12s %12s %8.2f\n", $3, $4, $7, $7 / $4}'
