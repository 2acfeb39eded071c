/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Every map of the broadcast TC programs (aggbox_tc.bpf.c), in one place as
 * katran's balancer_maps.h: one comment each saying what it maps (key ->
 * value), who writes it and who reads it. The helpers that use them
 * (tc_stats.h, fib.h, the programs) include this header.
 *
 * The control plane finds each map by its name in the skeleton
 * (skel.maps.<name>): a name here is part of the interface with the Rust
 * side. Value types come from include/aggbox/abi.h (shared with Rust), but
 * for bcast_neigh's, which adds a bpf_timer to the ABI part.
 */
#ifndef AGGBOX_TC_MAPS_H
#define AGGBOX_TC_MAPS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"

/* ---------------------------------------------------------------------------
 * Configuration: written by the control plane, read by the programs.
 * ------------------------------------------------------------------------- */

/*
 * bcast_groups: (group, receiving port) -> destination table (destination i =
 * mask bit i). Port AGGBOX_BCAST_PORT_ANY (0) is the root table used by the
 * egress program, and the table a tree node uses for datagrams arriving on any
 * port; a non-zero port is a tree node's table for datagrams arriving on that
 * port (a host with several members of one group). Written by the control
 * plane (BroadcastPlane::set_group / set_forwarding / remove_group); read
 * by both programs.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_BCAST_MAX_GROUPS);
	__type(key, struct aggbox_group_key);
	__type(value, struct aggbox_group);
} bcast_groups SEC(".maps");

/*
 * result_routes: job -> where its RESULT datagrams go besides (or instead
 * of) the local result port: a broadcast group (allreduce) and/or a parent
 * aggregator (trees of aggregators). Written by the control plane
 * (BroadcastPlane::set_result_route / set_parent_route / remove_*); read by
 * the ingress program.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_RESULT_ROUTES);
	__type(key, struct aggbox_job_key);
	__type(value, struct aggbox_result_route);
} result_routes SEC(".maps");

/*
 * bcast_config: [0] = struct aggbox_bcast_config (next-hop cache lifetime,
 * the attached interface). Written by the loader (TcPlane::load_with /
 * set_neigh_ttl) and by TcPlane::attach / detach; read by nh_resolve()
 * (fib.h) when it stores a fresh next hop, and by the ingress program on lo
 * for the interface its copies take the neighbour path from
 * (neigh_path_ifindex()).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct aggbox_bcast_config);
} bcast_config SEC(".maps");

/* ---------------------------------------------------------------------------
 * Next-hop cache (fib.h).
 * ------------------------------------------------------------------------- */

/* BPF-side value of bcast_neigh: the ABI part plus its staleness timer. */
struct neigh_entry {
	struct aggbox_neigh n;
	struct bpf_timer timer;
};

/*
 * bcast_neigh: (family, destination address, interface) -> next-hop MACs
 * and egress interface, from bpf_fib_lookup() (AF_INET or AF_INET6). Written by the TC programs on a miss or a
 * stale entry; entries are marked stale by their own bpf_timer; read (and
 * optionally flushed) by the control plane (BroadcastPlane::neigh_cache).
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, AGGBOX_BCAST_MAX_NEIGH);
	__type(key, struct aggbox_neigh_key);
	__type(value, struct neigh_entry);
} bcast_neigh SEC(".maps");

/* ---------------------------------------------------------------------------
 * Counters (tc_stats.h).
 * ------------------------------------------------------------------------- */

/*
 * bcast_stats: one struct aggbox_stat per enum aggbox_bcast_stat, per CPU.
 * Written only by the TC programs; read and summed over CPUs by the control
 * plane (BroadcastPlane::stats).
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_BCAST_STAT_MAX);
	__type(key, __u32);
	__type(value, struct aggbox_stat);
} bcast_stats SEC(".maps");

/*
 * bcast_gstats: per-group counters, per CPU, same key as bcast_groups.
 * Entries are created (zeroed) and deleted by the control plane with the
 * group; the TC programs only add to existing entries.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, AGGBOX_BCAST_MAX_GROUPS);
	__type(key, struct aggbox_group_key);
	__type(value, struct aggbox_bcast_group_stat);
} bcast_gstats SEC(".maps");

/* ---------------------------------------------------------------------------
 * Per-packet state (aggbox_tc.bpf.c).
 * ------------------------------------------------------------------------- */

/*
 * What a datagram's copies need beyond struct copy_state, kept here rather
 * than on the stack: 6.1 sums the frames of a call chain against 512 bytes,
 * and aggbox_tc_ingress -> copy_to_member -> send_copy is close to it
 * (aggbox_tc.bpf.c, struct copy_state).
 * The IPv6 addresses of the datagram being copied (as it arrived, as they
 * are now in the skb, the copies' source and this host's address: the
 * IPv6 twins of struct rewrite_state's and struct copy_state's IPv4
 * fields), and route_result()'s copy of the job's route and its parent as
 * a destination. BPF-only, not part of the ABI.
 *
 * One datagram at a time per CPU: the TC programs run with bottom halves
 * disabled, and the only program run nested inside another (a clone
 * re-entering an egress hook) carries an own-copy mark and returns before
 * it would look here.
 */
struct bcast_scratch {
	__be32 orig_saddr[4]; /* IPv6: the datagram's source as it arrived */
	__be32 orig_daddr[4]; /* IPv6: its destination as it arrived */
	__be32 saddr[4];      /* IPv6: the source as it is now in the skb */
	__be32 daddr[4];      /* IPv6: the destination as it is now in the skb */
	__be32 src[4];        /* IPv6: the copies' source (FIB source) */
	__be32 local[4];      /* IPv6: this host's address on the datagram */
	struct aggbox_group_dest parent;  /* route_result: the parent as a destination */
	struct aggbox_result_route route; /* route_result: the job's route, read once */
};

/*
 * bcast_scratch: [0] = struct bcast_scratch, per CPU. Written and read by
 * the TC programs only, within one datagram.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bcast_scratch);
} bcast_scratch SEC(".maps");

#endif /* AGGBOX_TC_MAPS_H */
