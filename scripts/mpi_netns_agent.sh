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
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NETNS COMMAND..." >&2; exit 2; }
netns=$1
shift
# ssh-style options mpirun may pass before the host (none with plm_rsh_agent
# set to this script, but ssh's -x is harmless to skip).
ip netns list | awk '{print $1}' | grep -qx -- "$netns" \
  || { echo "$0: no network namespace \"$netns\" (hostfile names must be namespaces)" >&2; exit 1; }
exec ip netns exec "$netns" /bin/sh -c "$*"
