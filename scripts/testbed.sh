#!/usr/bin/env bash
# testbed.sh: a star of network-namespace "hosts" joined by a Linux bridge.
#
# Every host i (0..N-1) is a network namespace ${PREFIX}h${i} holding one veth,
# `eth0`, whose peer `${PREFIX}p${i}` sits in the switch namespace ${PREFIX}sw and
# is a port of the bridge `br0` there. Nothing is created in the caller's
# namespace, and everything created carries the prefix, so parallel runs with
# different prefixes never collide and `down` only ever removes its own objects.
#
# Usage:
#   testbed.sh up     --prefix P --hosts N [--subnet 10.77] [--first 11]
#                     [--extra-addrs K] [--mtu 1500] [--queues Q]
#                     [--tx-csum-off] [--static-neigh] [--ipv6]
#   testbed.sh down   --prefix P
#   testbed.sh status --prefix P
#   testbed.sh list   --prefix P
#   testbed.sh exec   --prefix P --host I -- CMD [ARGS...]
#
# Addresses: host i gets BASE.0.(FIRST+i)/16 on eth0 (defaults: host 0 is
# 10.77.0.11) and, with --extra-addrs K, BASE.(1+k).(FIRST+i)/16 for k in 0..K-1.
# eth0 of host i has the MAC 02:00:B1:B2:00:(FIRST+i) (hex), BASE = B1.B2.
# With --ipv6 (dual stack) host i also has fd00:B1:B2::(FIRST+i)/64, each
# number written in decimal digits and read as hex (10.77, host 0:
# fd00:10:77::11).
#
#   up      Build the testbed. Idempotent: if a testbed with this prefix and the
#           same options is up and healthy it is left untouched ("unchanged");
#           if one exists with other options (or is broken) it is torn down and
#           rebuilt. On any failure everything made so far is removed.
#           --subnet       BASE as "A.B" or "A.B.0.0/16" (default 10.77)
#           --first        last octet of host 0's address (default 11)
#           --extra-addrs  K extra addresses per host (default 0)
#           --mtu          MTU of every veth (default 1500)
#           --queues       TX and RX queue count of every veth (default: kernel's:
#                          one TX queue, an RX queue per CPU); with it, TX queue q
#                          of every veth is CPU (q mod CPUs)'s (XPS), see set_xps
#           --tx-csum-off  `ethtool -K eth0 tx off` in every host, so locally
#                          generated packets carry full checksums
#           --static-neigh permanent ARP entries for every other host's addresses,
#                          and the switch's forwarding entry of every host's MAC
#                          (with --ipv6, permanent neighbour entries of their
#                          IPv6 addresses too)
#           --ipv6         IPv6 on in every host, each with its IPv6 address
#                          (above) beside its IPv4 ones, usable at once (no
#                          duplicate address detection); without it IPv6 is
#                          off in every namespace
#           --xdp-tx       GRO on the switch's end of every veth: a veth takes
#                          frames a host's XDP program sends back out (a
#                          redirect: the ring's forwarding) only when its
#                          peer runs NAPI
#   down    Remove every namespace of this prefix (no error if there is none).
#           Processes still running inside a namespace keep it alive unnamed:
#           stop them first (a warning lists their pids).
#   status  Describe the testbed. Exit 0 if up and healthy, 1 if absent,
#           3 if partial or broken.
#   list    Print the names of the namespaces that carry this prefix.
#   exec    Run CMD inside host I's namespace (ip netns exec).
#
# The prefix must match ^[a-z0-9]{1,8}$ (interface names are at most 15 bytes).
# up and down serialise on a lock in $AGGBOX_TESTBED_STATE_DIR (default
# /run/aggbox-testbed), which also holds one state file per live testbed.
# Needs root, ip (iproute2), sysctl, flock, and ethtool for --tx-csum-off and --xdp-tx.
# Testing hook: AGGBOX_TESTBED_FAIL_AFTER_HOST=I makes `up` fail right after
# building host I (to check that a failed `up` leaves nothing behind).

set -euo pipefail
set -E

PROG=${0##*/}
STATE_DIR=${AGGBOX_TESTBED_STATE_DIR:-/run/aggbox-testbed}
LOCK_TIMEOUT_S=${AGGBOX_TESTBED_LOCK_TIMEOUT_S:-300}

die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

usage_die() {
    echo "$PROG: $*" >&2
    echo "usage: $PROG up|down|status|list|exec --prefix P [options] (see the header of $0)" >&2
    exit 2
}

trap 'echo "$PROG: command failed (line $LINENO, status $?): $BASH_COMMAND" >&2' ERR

# ---------------------------------------------------------------- arguments

[[ $# -ge 1 ]] || usage_die "missing command"
CMD=$1
shift
case $CMD in
    -h | --help)
        sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
        exit 0
        ;;
    up | down | status | list | exec) ;;
    *) usage_die "unknown command '$CMD'" ;;
esac

PREFIX=""
HOSTS=""
SUBNET="10.77"
FIRST=11
EXTRA=0
MTU=1500
QUEUES=""
TX_CSUM_OFF=0
STATIC_NEIGH=0
XDP_TX=0
IPV6=0
HOST=""
EXEC_ARGV=()

need_value() {
    [[ $# -ge 2 ]] || usage_die "option $1 needs a value"
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --prefix) need_value "$@"; PREFIX=$2; shift 2 ;;
        --hosts) need_value "$@"; HOSTS=$2; shift 2 ;;
        --subnet) need_value "$@"; SUBNET=$2; shift 2 ;;
        --first) need_value "$@"; FIRST=$2; shift 2 ;;
        --extra-addrs) need_value "$@"; EXTRA=$2; shift 2 ;;
        --mtu) need_value "$@"; MTU=$2; shift 2 ;;
        --queues) need_value "$@"; QUEUES=$2; shift 2 ;;
        --tx-csum-off) TX_CSUM_OFF=1; shift ;;
        --static-neigh) STATIC_NEIGH=1; shift ;;
        --xdp-tx) XDP_TX=1; shift ;;
        --ipv6) IPV6=1; shift ;;
        --host) need_value "$@"; HOST=$2; shift 2 ;;
        --)
            shift
            EXEC_ARGV=("$@")
            break
            ;;
        *) usage_die "unknown argument '$1'" ;;
    esac
done

[[ -n $PREFIX ]] || usage_die "--prefix is required"
[[ $PREFIX =~ ^[a-z0-9]{1,8}$ ]] ||
    usage_die "invalid prefix '$PREFIX': must match ^[a-z0-9]{1,8}\$"

is_uint() { [[ $1 =~ ^[0-9]{1,9}$ ]]; }

# check_uint OPTION VAR MIN MAX: VAR must be a decimal integer in [MIN, MAX];
# normalises it (no leading zeros).
check_uint() {
    local opt=$1 var=$2 min=$3 max=$4 val=${!2}
    if ! is_uint "$val" || ((10#$val < min || 10#$val > max)); then
        usage_die "invalid $opt '$val' (an integer in $min..$max)"
    fi
    printf -v "$var" '%d' "$((10#$val))"
}

# Namespace and interface names of this prefix.
SW_NS="${PREFIX}sw"
host_ns() { echo "${PREFIX}h$1"; }
port_name() { echo "${PREFIX}p$1"; }
STATE_FILE="$STATE_DIR/$PREFIX.state"

# ---------------------------------------------------------------- helpers

# Namespaces carrying this prefix: ${PREFIX}h<digits> and ${PREFIX}sw. The
# patterns cannot match a name made with another valid prefix.
list_ns() {
    ip netns list 2>/dev/null | awk '{print $1}' |
        grep -E "^${PREFIX}(h[0-9]+|sw)\$" | sort -V || true
}

ns_exists() {
    [[ -e "/var/run/netns/$1" ]] || ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF "$1"
}

nsexec() {
    local ns=$1
    shift
    ip netns exec "$ns" "$@"
}

take_lock() {
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/lock"
    flock -w "$LOCK_TIMEOUT_S" 9 || die "timed out waiting for $STATE_DIR/lock"
}

host_addr6() { # host_addr6 I: the IPv6 address of host I (--ipv6)
    echo "fd00:${SUBNET//./:}::$((FIRST + $1))"
}

host_addr() { # host_addr I [K]: main address (no K) or extra address K
    local i=$1 k=${2:-}
    if [[ -z $k ]]; then
        echo "$SUBNET.0.$((FIRST + i))"
    else
        echo "$SUBNET.$((1 + k)).$((FIRST + i))"
    fi
}

# cpu_mask C N: the xps_cpus bitmap of CPU C among N CPUs (32-bit words,
# most significant first, comma-separated, as sysfs prints it).
cpu_mask() {
    local c=$1 n=$2 w out=""
    for ((w = (n + 31) / 32 - 1; w >= 0; w--)); do
        if ((c / 32 == w)); then
            out+=$(printf '%08x' $((1 << (c % 32))))
        else
            out+=00000000
        fi
        ((w == 0)) || out+=,
    done
    echo "$out"
}

# set_xps NS DEV: TX queue q of DEV is used by CPU (q mod CPUs). A veth's TX
# queue picks the peer's RX queue, and with XDP on the peer each RX queue is
# one NAPI context: without this the bridge sends every frame for a host into
# TX queue 0 (one TX queue) or by flow hash (several workers' flows can share
# a queue), so one CPU runs the peer's XDP program for all senders while the
# others wait. With it, a frame forwarded on CPU c is processed on CPU c, as
# a multi-queue NIC spreads its RX queues over CPUs. No XPS in the kernel: the
# flow hash picks.
set_xps() {
    local ns=$1 dev=$2 q cpus script=""
    cpus=$(nsexec "$ns" nproc --all)
    # One shell in the namespace for all queues (sysfs is the namespace's).
    for ((q = 0; q < QUEUES; q++)); do
        script+="f=/sys/class/net/$dev/queues/tx-$q/xps_cpus; [ -w \$f ] || exit 0; "
        script+="echo $(cpu_mask $((q % cpus)) "$cpus") >\$f || exit 1; "
    done
    nsexec "$ns" sh -c "$script"
}

host_mac() {
    local o1=${SUBNET%%.*} o2=${SUBNET#*.}
    printf '02:00:%02x:%02x:00:%02x' "$o1" "$o2" "$((FIRST + $1))"
}

# Removes every namespace of this prefix and the state file. Never fails.
do_down() {
    local ns pids
    for ns in $(list_ns); do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${pids// /} ]]; then
            echo "$PROG: warning: processes still in $ns (pids: $pids); it lives on unnamed until they exit" >&2
        fi
        ip netns del "$ns" 2>/dev/null || ip netns del "$ns" || true
    done
    rm -f "$STATE_FILE"
    local left
    left=$(list_ns)
    if [[ -n $left ]]; then
        echo "$PROG: warning: could not remove: $left" >&2
        return 0
    fi
}

normalize_subnet() {
    local s=$1
    s=${s%/16}
    if [[ $s =~ ^([0-9]{1,3})\.([0-9]{1,3})(\.0\.0)?$ ]]; then
        local a=${BASH_REMATCH[1]} b=${BASH_REMATCH[2]}
        ((10#$a <= 255 && 10#$b <= 255)) || usage_die "invalid --subnet '$1'"
        SUBNET="$((10#$a)).$((10#$b))"
    else
        usage_die "invalid --subnet '$1' (expected A.B or A.B.0.0/16)"
    fi
}

config_line() {
    echo "hosts=$HOSTS subnet=$SUBNET first=$FIRST extra=$EXTRA mtu=$MTU queues=${QUEUES:-default} tx_csum_off=$TX_CSUM_OFF static_neigh=$STATIC_NEIGH xdp_tx=$XDP_TX ipv6=$IPV6"
}

# Loads HOSTS (and the other options) from the state file; fails if absent.
load_state() {
    [[ -f $STATE_FILE ]] || return 1
    local kv
    for kv in $(cat "$STATE_FILE"); do
        case $kv in
            hosts=*) HOSTS=${kv#*=} ;;
            subnet=*) SUBNET=${kv#*=} ;;
            first=*) FIRST=${kv#*=} ;;
            extra=*) EXTRA=${kv#*=} ;;
            mtu=*) MTU=${kv#*=} ;;
            queues=*) QUEUES=${kv#*=}; [[ $QUEUES != default ]] || QUEUES="" ;;
            tx_csum_off=*) TX_CSUM_OFF=${kv#*=} ;;
            static_neigh=*) STATIC_NEIGH=${kv#*=} ;;
            xdp_tx=*) XDP_TX=${kv#*=} ;;
            ipv6=*) IPV6=${kv#*=} ;;
        esac
    done
    is_uint "$HOSTS"
}

# Healthy: the namespaces are exactly switch + hosts 0..N-1, and every host's
# eth0 is up and carries its address.
healthy() {
    local want have i
    want=$( (echo "$SW_NS"; for ((i = 0; i < HOSTS; i++)); do host_ns "$i"; done) | sort -V)
    have=$(list_ns)
    [[ $want == "$have" ]] || return 1
    for ((i = 0; i < HOSTS; i++)); do
        ip -n "$(host_ns "$i")" -o -4 addr show dev eth0 2>/dev/null |
            grep -qF " $(host_addr "$i")/16 " || return 1
        ip -n "$(host_ns "$i")" -o link show dev eth0 2>/dev/null | grep -q 'state UP' || return 1
        if ((IPV6)); then
            ip -n "$(host_ns "$i")" -o -6 addr show dev eth0 2>/dev/null |
                grep -qF " $(host_addr6 "$i")/64 " || return 1
        fi
    done
}

summary() {
    local last=$((HOSTS - 1)) note=$1
    echo "testbed $PREFIX: up, $HOSTS hosts ${PREFIX}h0..${PREFIX}h$last $(host_addr 0)..$(host_addr "$last")/16$( ((IPV6)) && echo " $(host_addr6 0)..$(host_addr6 "$last")/64") eth0 mtu $MTU, switch ${SW_NS}/br0${note:+ ($note)}"
}

# ---------------------------------------------------------------- commands

cmd_up() {
    [[ -n $HOSTS ]] || usage_die "--hosts is required"
    check_uint --hosts HOSTS 1 999
    check_uint --first FIRST 1 254
    ((FIRST + HOSTS - 1 <= 254)) || usage_die "--first $FIRST with --hosts $HOSTS runs past .254"
    check_uint --extra-addrs EXTRA 0 254
    check_uint --mtu MTU 68 65535
    [[ -z $QUEUES ]] || check_uint --queues QUEUES 1 4096
    normalize_subnet "$SUBNET"
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    if ((TX_CSUM_OFF)); then command -v ethtool >/dev/null || die "--tx-csum-off needs ethtool"; fi
    if ((XDP_TX)); then command -v ethtool >/dev/null || die "--xdp-tx needs ethtool"; fi

    take_lock
    local cfg
    cfg=$(config_line)

    if [[ -f $STATE_FILE && $(cat "$STATE_FILE") == "$cfg" ]] && healthy; then
        summary unchanged
        return 0
    fi
    if [[ -n $(list_ns) || -f $STATE_FILE ]]; then
        echo "$PROG: $PREFIX exists with other options or is incomplete: rebuilding" >&2
        do_down
    fi

    # From here on, any failure (or signal) removes everything made so far.
    UP_DONE=0
    trap 'if [[ $UP_DONE != 1 ]]; then echo "$PROG: up failed; removing $PREFIX*" >&2; do_down; fi' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    local qopt=() sys_common=(
        net.ipv6.conf.all.disable_ipv6=1
        net.ipv6.conf.default.disable_ipv6=1
    ) host_sys=()
    # The switch only bridges frames: IPv6 stays off there either way.
    ((IPV6)) && host_sys=(net.ipv6.conf.all.disable_ipv6=0 net.ipv6.conf.default.disable_ipv6=0
        net.ipv6.conf.all.forwarding=1 net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0)
    [[ -z $QUEUES ]] || qopt=(numtxqueues "$QUEUES" numrxqueues "$QUEUES")

    ip netns add "$SW_NS"
    nsexec "$SW_NS" sysctl -qw "${sys_common[@]}"
    # A switch forwards frames; it does not run them through iptables. When
    # the host has br_netfilter loaded (a container runtime does that), each
    # new namespace's bridge calls the IP hooks for every bridged frame, a
    # per-packet cost that no real switch adds to any of the compared paths.
    # The setting is per namespace: nothing outside the testbed changes.
    if nsexec "$SW_NS" test -e /proc/sys/net/bridge/bridge-nf-call-iptables; then
        nsexec "$SW_NS" sysctl -qw net.bridge.bridge-nf-call-iptables=0 \
            net.bridge.bridge-nf-call-ip6tables=0 net.bridge.bridge-nf-call-arptables=0
    fi
    ip -n "$SW_NS" link set lo up
    ip -n "$SW_NS" link add br0 type bridge stp_state 0 forward_delay 0 ageing_time 30000 mcast_snooping 0
    ip -n "$SW_NS" link set br0 up

    local i k ns port
    for ((i = 0; i < HOSTS; i++)); do
        ns=$(host_ns "$i")
        port=$(port_name "$i")
        ip netns add "$ns"
        nsexec "$ns" sysctl -qw "${sys_common[@]}" "${host_sys[@]}" \
            net.ipv4.ip_forward=1 \
            net.ipv4.conf.all.send_redirects=0 net.ipv4.conf.default.send_redirects=0 \
            net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
        ip -n "$ns" link set lo up
        ip -n "$SW_NS" link add "$port" "${qopt[@]}" mtu "$MTU" type veth \
            peer name eth0 "${qopt[@]}" mtu "$MTU" address "$(host_mac "$i")" netns "$ns"
        if [[ -n $QUEUES ]]; then
            set_xps "$SW_NS" "$port"
            set_xps "$ns" eth0
        fi
        ip -n "$SW_NS" link set "$port" master br0
        ip -n "$SW_NS" link set "$port" up
        if ((XDP_TX)); then
            nsexec "$SW_NS" ethtool -K "$port" gro on >/dev/null
        fi
        ip -n "$ns" addr add "$(host_addr "$i")/16" dev eth0
        for ((k = 0; k < EXTRA; k++)); do
            ip -n "$ns" addr add "$(host_addr "$i" "$k")/16" dev eth0
        done
        if ((IPV6)); then
            ip -n "$ns" addr add "$(host_addr6 "$i")/64" dev eth0 nodad
        fi
        if ((TX_CSUM_OFF)); then
            nsexec "$ns" ethtool -K eth0 tx off >/dev/null
        fi
        ip -n "$ns" link set eth0 up
        if [[ ${AGGBOX_TESTBED_FAIL_AFTER_HOST:-} == "$i" ]]; then
            die "failing on purpose after host $i (AGGBOX_TESTBED_FAIL_AFTER_HOST)"
        fi
    done

    if ((STATIC_NEIGH)); then
        local j
        for ((i = 0; i < HOSTS; i++)); do
            ns=$(host_ns "$i")
            # Without ARP a host that only receives (an aggregator whose
            # RESULTs stay local) never sends a frame the bridge could learn
            # its MAC from, and every datagram to it is flooded to all ports:
            # a clone and a delivery per other host, which a switch that saw
            # the host's ARP reply would not make.
            bridge -n "$SW_NS" fdb replace "$(host_mac "$i")" dev "$(port_name "$i")" master static
            for ((j = 0; j < HOSTS; j++)); do
                ((i != j)) || continue
                ip -n "$ns" neigh replace "$(host_addr "$j")" lladdr "$(host_mac "$j")" dev eth0 nud permanent
                for ((k = 0; k < EXTRA; k++)); do
                    ip -n "$ns" neigh replace "$(host_addr "$j" "$k")" lladdr "$(host_mac "$j")" dev eth0 nud permanent
                done
                if ((IPV6)); then
                    ip -n "$ns" neigh replace "$(host_addr6 "$j")" lladdr "$(host_mac "$j")" dev eth0 nud permanent
                fi
            done
        done
    fi

    # Wait (up to ~5 s) until every link reports carrier, so the first packet
    # of a test is not lost.
    local tries=0
    until healthy; do
        ((++tries <= 100)) || die "links did not come up"
        sleep 0.05
    done

    echo "$cfg" >"$STATE_FILE"
    UP_DONE=1
    summary ""
}

cmd_down() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    take_lock
    do_down
}

cmd_list() {
    list_ns
}

cmd_status() {
    trap - ERR # its exit status is an answer, not a failure
    local present
    present=$(list_ns)
    if [[ -z $present && ! -f $STATE_FILE ]]; then
        echo "testbed $PREFIX: absent"
        return 1
    fi
    if ! load_state; then
        echo "testbed $PREFIX: partial (no state file); namespaces: $(echo $present)"
        return 3
    fi
    local rc=0 i ns
    if healthy; then
        summary ""
    else
        echo "testbed $PREFIX: broken ($(cat "$STATE_FILE")); namespaces: $(echo $present)"
        rc=3
    fi
    echo "  config: $(cat "$STATE_FILE")"
    for ((i = 0; i < HOSTS; i++)); do
        ns=$(host_ns "$i")
        if ns_exists "$ns"; then
            echo "  $ns: $(ip -n "$ns" -br addr show dev eth0 2>/dev/null | tr -s ' ' || echo 'no eth0')"
        else
            echo "  $ns: missing"
        fi
    done
    if ns_exists "$SW_NS"; then
        echo "  $SW_NS: br0 ports: $(ip -n "$SW_NS" -o link show master br0 2>/dev/null | awk -F': ' '{split($2, a, "@"); printf "%s ", a[1]}')"
    else
        echo "  $SW_NS: missing"
    fi
    return $rc
}

cmd_exec() {
    [[ -n $HOST ]] || usage_die "--host is required"
    is_uint "$HOST" || usage_die "invalid --host '$HOST'"
    [[ ${#EXEC_ARGV[@]} -gt 0 ]] || usage_die "exec needs a command after --"
    local ns
    ns=$(host_ns "$((10#$HOST))")
    ns_exists "$ns" || die "no namespace $ns (is testbed $PREFIX up with more than $HOST hosts?)"
    trap - ERR
    exec ip netns exec "$ns" "${EXEC_ARGV[@]}"
}

case $CMD in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    list) cmd_list ;;
    exec) cmd_exec ;;
esac
