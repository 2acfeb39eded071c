#!/usr/bin/env bash
# mpi_netns_agent.sh: Open MPI's "rsh agent" for ranks in network namespaces
# (docs/MPI.md, "Running across namespaces"). mpirun runs
# `AGENT HOST COMMAND...` to start its daemon (orted) on each host of the
# hostfile, as it would run ssh; here each host name is a network namespace
# on this machine, so the daemon starts in it with `ip netns exec` and
# reaches mpirun over the namespaces' own network (mpirun runs in one of
# them). The command is a shell command line, as ssh would pass it.
#
#   mpirun.openmpi --mca plm_rsh_agent scripts/mpi_netns_agent.sh \
#       --hostfile HOSTS ...      # HOSTS: one namespace name per line
#   mpiexec.mpich -launcher ssh -launcher-exec scripts/mpi_netns_agent.sh \
#       -iface eth0 -hosts NS1,NS2,... ...
set -euo pipefail
# ssh options before the host name mean nothing here: MPICH's Hydra (ssh
# launcher with -launcher-exec set to this script) passes `-x`.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
[ $# -ge 2 ] || { echo "usage: $0 [SSH-OPTIONS] NETNS COMMAND..." >&2; exit 2; }
netns=$1
shift
ip netns list | awk '{print $1}' | grep -qx -- "$netns" \
  || { echo "$0: no network namespace \"$netns\" (hostfile names must be namespaces)" >&2; exit 1; }
# Every namespace shares the machine's host name, so Open MPI's daemons would
# all make their session directories under the same /tmp/ompi.HOST.UID and
# race creating the same subdirectories ("File exists"): a temporary
# directory per namespace keeps them apart (removed when the daemon exits).
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mpi-netns-$netns.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
TMPDIR=$tmp ip netns exec "$netns" /bin/sh -c "$*"
