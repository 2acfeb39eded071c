#!/usr/bin/env bash
# mpi_bench.sh: MPI_Allreduce (int32 SUM) and MPI_Bcast (MPI_BYTE from rank
# 0) latency and bandwidth, OSU style, over a netns testbed: plain MPI
# against the same programs with libaggbox_mpi preloaded (docs/MPI.md,
# "Benchmark"). Host 0 runs only `aggbox attach` with a node-served job;
# hosts 1..N are the ranks (scripts/mpi_netns_agent.sh).
#
# Usage: scripts/mpi_bench.sh [--ranks N[,N...]] [--mpi openmpi|mpich]
#                             [--max-bytes B] [--bcast-max-bytes B]
#                             [--iterations I] [--mtu M [--slots S]]
#                             [--out DIR] [--aggbox-env VAR=VALUE]...
# --ranks: one run of both programs per rank count, e.g. 4,8.
# --max-bytes: MPI_Allreduce's largest size (default 1 MiB; 87200000 or more
# adds the 21.8 M int32 point); --bcast-max-bytes: MPI_Bcast's (1 MiB).
# --mtu: the testbed's MTU (default 1500; the ranks' datagrams follow it);
# --slots: the job's `slots`, which jumbo MTUs need below the default 4096
# (910 at MTU 9000: the kernel's block pool, docs/JUMBO.md).
# --aggbox-env: a variable for the libaggbox_mpi run only (repeatable), e.g.
# AGGBOX_CALLER_THREAD=0 to measure with every call on the progress thread.
# Needs root, `make build mpi` (PROFILE=release). Writes DIR/mpi_allreduce.csv
# and DIR/mpi_bcast.csv (mpi, ranks, size_bytes, plain and aggbox avg/min/max
# µs and MB/s), prints them as tables, plots them in DIR/mpi.png
# (scripts/plot.py mpi, when matplotlib is installed) and writes the node's
# `aggbox status` after each library run to DIR/node_status.txt.
set -euo pipefail

ranks_list=4 mpi=openmpi max_bytes=$((1 << 20)) bcast_max_bytes=$((1 << 20)) iterations=200 out=results/mpi
mtu=1500 slots=
aggbox_env=()
while [ $# -gt 0 ]; do
  case $1 in
    --ranks) ranks_list=$2; shift 2 ;;
    --mpi) mpi=$2; shift 2 ;;
    --max-bytes) max_bytes=$2; shift 2 ;;
    --bcast-max-bytes) bcast_max_bytes=$2; shift 2 ;;
    --iterations) iterations=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --mtu) mtu=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
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
case $mpi in openmpi|mpich) ;; *) fail "--mpi must be openmpi or mpich" ;; esac
IFS=, read -r -a rank_counts <<< "$ranks_list"
max_ranks=0
for n in "${rank_counts[@]}"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || fail "--ranks: $n is not a rank count"
  [ "$n" -gt "$max_ranks" ] && max_ranks=$n
done

prefix=mb$(($$ % 1000000))
work=$(mktemp -d /tmp/aggbox-mpi-bench.XXXXXX)
pins=$work/pins
attach_pid=
# The node and its pinned maps go with each rank count: the next one is a
# different job (other workers), started on a fresh node.
stop_node() {
  if [ -n "$attach_pid" ]; then kill -INT "$attach_pid" 2>/dev/null || true; wait "$attach_pid" 2>/dev/null || true; fi
  attach_pid=
  if mountpoint -q "$pins"; then umount "$pins"; fi
}
cleanup() {
  stop_node
  "$repo/scripts/testbed.sh" down --prefix "$prefix" >/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$repo/scripts/testbed.sh" up --prefix "$prefix" --hosts $((max_ranks + 1)) --mtu "$mtu" >/dev/null
addr() { echo "10.77.0.$((11 + $1))"; }
for prog in osu_allreduce osu_bcast; do
  "mpicc.$mpi" -O2 -o "$work/$prog" "$repo/mpi/bench/$prog.c"
done

# write_job N: the node-served job of ranks 1..N, and the hosts they run on.
write_job() {
  local n=$1 workers= members= r
  hosts=
  : > "$work/hosts"
  for r in $(seq 1 "$n"); do
    workers+="${workers:+, }\"$(addr "$r")\""
    members+="${members:+, }\"$(addr "$r"):7700\""
    echo "${prefix}h$r slots=1" >> "$work/hosts"
    hosts+="${hosts:+,}${prefix}h$r"
  done
  cat > "$work/node.toml" <<TOML
[[job]]
id = 11
port = 7600
workers = [$workers]
result_port = 7601
result_group = 4
consumer = "node"
${slots:+slots = $slots}

[[group]]
id = 4
members = [$members]
TOML
}

start_node() {
  mkdir -p "$pins" && mount -t bpf bpf "$pins"
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

# run N PROG MAX_BYTES OUTPUT [VAR=VALUE...]: PROG on N ranks with those
# variables on every rank.
run() {
  local n=$1 prog=$2 max=$3 output=$4; shift 4
  local args=()
  case $mpi in
    openmpi)
      for kv in "$@"; do args+=(-x "$kv"); done
      ip netns exec "${prefix}h1" timeout 900 mpirun.openmpi --allow-run-as-root --oversubscribe -np "$n" \
        --hostfile "$work/hosts" --mca plm_rsh_agent "$agent" --mca btl tcp,self --mca mpi_yield_when_idle 1 \
        --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "${args[@]}" \
        "$work/$prog" "$max" "$iterations" > "$output" ;;
    mpich)
      for kv in "$@"; do args+=(-genv "${kv%%=*}" "${kv#*=}"); done
      ip netns exec "${prefix}h1" timeout 900 mpiexec.mpich -launcher ssh -launcher-exec "$agent" \
        -iface eth0 -hosts "$hosts" -np "$n" "${args[@]}" \
        "$work/$prog" "$max" "$iterations" > "$output" ;;
  esac
}

mkdir -p "$out"
: > "$out/node_status.txt"
for n in "${rank_counts[@]}"; do
  write_job "$n"
  echo "mpi_bench.sh: $mpi, $n ranks, MTU $mtu, plain MPI (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  run "$n" osu_allreduce "$max_bytes" "$work/allreduce-plain-$n.txt"
  run "$n" osu_bcast "$bcast_max_bytes" "$work/bcast-plain-$n.txt"
  # The node is started for the runs with the library, after the plain
  # ones (a fresh node keeps the plain runs' traffic out of its counters);
  # the bcast run follows the allreduce run on the running node (docs/MPI.md,
  # "Consecutive runs on one node").
  start_node
  echo "mpi_bench.sh: $mpi, $n ranks, MTU $mtu, libaggbox_mpi (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  aggbox_vars=(LD_PRELOAD="$lib" AGGBOX_MPI_CONFIG="$work/node.toml" AGGBOX_MPI_NODE="$(addr 0)"
    AGGBOX_MPI_DATA_PORT=7700 AGGBOX_MPI_STATS=1 ${aggbox_env[@]+"${aggbox_env[@]}"})
  run "$n" osu_allreduce "$max_bytes" "$work/allreduce-aggbox-$n.txt" "${aggbox_vars[@]}"
  run "$n" osu_bcast "$bcast_max_bytes" "$work/bcast-aggbox-$n.txt" "${aggbox_vars[@]}"
  # The node's counters of both runs (its result service's datagrams: what
  # the calls cost the node), beside the ranks' lines mpirun printed.
  { echo "# $mpi, $n ranks, MTU $mtu: aggbox status after osu_allreduce and osu_bcast"
    ip netns exec "${prefix}h0" "$aggbox" status --pin-root "$pins" 2>&1 || true
    echo; } >> "$out/node_status.txt"
  stop_node
done

# write_csv PROG: one row per rank count and size, the plain run's columns
# beside the library's.
write_csv() {
  local prog=$1 csv=$out/mpi_$1.csv n
  echo "mpi,ranks,size_bytes,plain_avg_us,plain_min_us,plain_max_us,aggbox_avg_us,aggbox_min_us,aggbox_max_us,plain_mb_per_s,aggbox_mb_per_s" > "$csv"
  for n in "${rank_counts[@]}"; do
    join <(grep -v '^#' "$work/$prog-plain-$n.txt" | sort -k1,1) <(grep -v '^#' "$work/$prog-aggbox-$n.txt" | sort -k1,1) \
      | sort -n -k1,1 \
      | awk -v m="$mpi" -v n="$n" '{print m "," n "," $1 "," $2 "," $3 "," $4 "," $6 "," $7 "," $8 "," $5 "," $9}' >> "$csv"
  done
  echo "mpi_bench.sh: $csv" >&2
  echo "$prog ($mpi, MTU $mtu; mean µs per call, MB/s = bytes / mean)"
  printf "%-6s %-12s %12s %12s %8s %12s %12s\n" ranks size_bytes plain_us aggbox_us ratio plain_MB/s aggbox_MB/s
  tail -n +2 "$csv" | awk -F, '{printf "%-6s %-12s %12s %12s %8.2f %12s %12s\n", $2, $3, $4, $7, $7 / $4, $10, $11}'
}
write_csv allreduce
write_csv bcast
# Debian's python3 holds python3-matplotlib (make bench-deps), whatever
# python3 comes first in PATH.
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 "$repo/scripts/plot.py" mpi "$out"
else
  echo "mpi_bench.sh: no matplotlib (make bench-deps): no plot" >&2
fi
