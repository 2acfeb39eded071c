/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Every map of the ring program (aggbox_ring.bpf.c, docs/RING.md), as
 * xdp_maps.h is the aggregation chain's: written by the control plane
 * (XdpPlane::set_ring), read by the ring program; ring_data, ring_done and
 * ring_ctrl are BPF_F_MMAPABLE and shared with the application's runtime
 * and the node's ring service, which find them by these names (pinned next
 * to the chain's maps).
 */
#ifndef AGGBOX_RING_MAPS_H
#define AGGBOX_RING_MAPS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "ring_ports.h"  /* shared with the aggregation chain */


/* ring_index: ring id (index) -> 1 + dense ring index, 0: not configured. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} ring_index SEC(".maps");

/* ring_jobs: dense ring index -> how this node takes part in the ring. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_RINGS);
	__type(key, __u32);
	__type(value, struct aggbox_ring_job);
} ring_jobs SEC(".maps");

/* ring_members: dense ring index * AGGBOX_MAX_RANKS + member -> address
 * (struct aggbox_rank: the member's IP version and address, every member
 * of a ring of one version; weight 0: weights are in ring_jobs). An IPv6
 * ring sends from its entry [me] to its entry [(me + 1) % members]. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_RINGS * AGGBOX_MAX_RANKS);
	__type(key, __u32);
	__type(value, struct aggbox_rank);
} ring_members SEC(".maps");

/*
 * ring_data: AGGBOX_RING_INDEX(base, frags, round, fragment) -> the
 * fragment's elements (host order int32) in that round's buffer: the
 * member's input, then the result. The value size is 4 * ring_frag_elems
 * and max_entries twice the fragments of the file's rings (two buffers a
 * ring) plus [node] ring_pool's, both set by the loader from the
 * configuration (1 entry of the default size when nothing is reserved);
 * the control plane places each ring in it (RingPool). Mapped by the
 * runtime: each buffer of a ring holds its vector contiguously.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(key_size, 4);
	__uint(value_size, 4 * 362);
} ring_data SEC(".maps");

/* ring_done: the same index -> 1 + the round of the result in that
 * ring_data entry (0: none). max_entries set by the loader like
 * ring_data's. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct aggbox_ring_done);
} ring_done SEC(".maps");

/* ring_ctrl: dense ring index -> ready round and final count (runtime and
 * ring service write, XDP reads and counts). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_RINGS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct aggbox_ring_ctrl);
} ring_ctrl SEC(".maps");

/* ring_stats: dense ring index -> per-CPU counters (enum aggbox_ring_stat). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_MAX_RINGS);
	__type(key, __u32);
	__type(value, struct aggbox_ring_stats);
} ring_stats SEC(".maps");

/* The next hop of a ring's next member: MACs and interface from
 * bpf_fib_lookup, re-resolved when older than a second (ring program). */
struct ring_nexthop {
	__u8  dmac[6];
	__u8  smac[6];
	__u32 ifindex;
	__u64 resolved_ns; /* 0: never */
};
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_RINGS);
	__type(key, __u32);
	__type(value, struct ring_nexthop);
} ring_nexthop SEC(".maps");

/* ring_scratch: per CPU, what one datagram's run of the ring program keeps
 * outside its stack (the ring program writes and reads it): the parsed
 * headers (ring_parse_l3), one chunk of a multi-buffer payload
 * (ring_chunks), the IPv6 checksum pass (udp_csum.h). */
#define RING_CHUNK_ELEMS 128 /* elements of one chunk of ring_chunks */
struct ring_scratch {
	__be32 buf[RING_CHUNK_ELEMS] __attribute__((aligned(8)));
			  /* one chunk (ring_chunks), or one piece of the IPv6
			   * checksum pass (udp_csum.h) */
	__be32 src[4];    /* the source address as a member's (struct
			   * aggbox_rank.addr): IPv4 in src[0], zeros after */
	__u64 csum;       /* the IPv6 checksum pass: the datagram's unfolded sum */
	__u32 csum_words; /* its UDP length in 4-byte words */
	__u32 ip_len;     /* the IP packet's length, headers included */
	__u16 ip_off;     /* offset of the IPv4 or IPv6 header from ctx->data */
	__u16 udp_off;    /* offset of the UDP header from ctx->data */
	__u8  family;     /* AGGBOX_FAMILY_IPV4 or _IPV6 (ring_parse_l3) */
	__u8  l3_flags;   /* RING_L3_F_* (ring_parse_l3) */
	__u8  pad[2];
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ring_scratch);
} ring_scratch SEC(".maps");

#endif /* AGGBOX_RING_MAPS_H */
