/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Hand-off to the user-space path: what the kernel does not aggregate is
 * redirected into the AF_XDP socket registered for the RX queue the frame
 * arrived on (docs/USERSPACE.md). With no socket on that queue the datagram
 * keeps the kernel's fallback (pass, or drop and count).
 */
#ifndef AGGBOX_HANDOFF_H
#define AGGBOX_HANDOFF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "stats.h"

/*
 * xsks: RX queue index -> AF_XDP socket of the user-space path. Written by
 * the control plane (Dataplane::register_xsk, src/userspace.rs) for every
 * queue of the interface; an entry disappears when its socket is closed.
 * Read here by bpf_map_lookup_elem (is a socket there?) and
 * bpf_redirect_map.
 */
struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, AGGBOX_MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

/*
 * handoff_stats: datagrams actually redirected to user space, per CPU, by
 * enum aggbox_handoff_reason (their sum is the to_userspace outcome).
 * Written by XDP only; summed by Dataplane::handoff_stats.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_HANDOFF_MAX);
	__type(key, __u32);
	__type(value, struct aggbox_stat);
} handoff_stats SEC(".maps");

/*
 * xsk_limits[0]: the longest frame (bytes, bpf_xdp_get_buff_len) the
 * registered sockets can take, or 0 for no limit. Written by
 * UserspacePath::start (src/userspace.rs): 0 when every socket is bound
 * with XDP_USE_SG (multi-buffer AF_XDP, Linux 6.6+), else the UMEM frame
 * size minus headroom minus XDP_PACKET_HEADROOM (AGGBOX_XSK_RX_HEADROOM).
 * A longer frame would be lost by the kernel inside the redirect, so
 * aggbox_handoff() treats it as if no socket were registered
 * (docs/JUMBO.md "Kernels without multi-buffer AF_XDP").
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} xsk_limits SEC(".maps");

/* Whether an AF_XDP socket is registered for the frame's RX queue. */
static __always_inline int aggbox_has_xsk(struct xdp_md *ctx)
{
	__u32 q = ctx->rx_queue_index;

	return q < AGGBOX_MAX_QUEUES && bpf_map_lookup_elem(&xsks, &q) != NULL;
}

/*
 * Redirect the frame to user space (outcome TO_USERSPACE, handoff_stats
 * [reason]) when a socket is registered for its queue; otherwise end with
 * `fallback` (an outcome or drop reason) through aggbox_exit().
 * `frame_bytes`: the whole frame's length (fragments included).
 */
static __always_inline int aggbox_handoff(struct xdp_md *ctx, __u32 reason, int fallback, __u32 bytes,
					  __u32 frame_bytes)
{
	__u32 q = ctx->rx_queue_index;
	struct aggbox_stat *st;
	__u32 zero = 0, *limit;

	if (q >= AGGBOX_MAX_QUEUES || !bpf_map_lookup_elem(&xsks, &q))
		return aggbox_exit(fallback, bytes);
	/* Sockets without multi-buffer: a frame longer than one UMEM frame
	 * would be lost in the redirect; keep the fallback instead. */
	limit = bpf_map_lookup_elem(&xsk_limits, &zero);
	if (limit && *limit && frame_bytes > *limit)
		return aggbox_exit(fallback, bytes);
	aggbox_count(AGGBOX_OUTCOME_TO_USERSPACE, bytes);
	st = bpf_map_lookup_elem(&handoff_stats, &reason);
	if (st) {
		st->packets += 1;
		st->bytes += bytes;
	}
	/* The socket can only vanish in between: then the fallback verdict. */
	return bpf_redirect_map(&xsks, q, fallback < 0 ? XDP_DROP : XDP_PASS);
}

#endif /* AGGBOX_HANDOFF_H */
