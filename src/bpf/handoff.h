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
#include "xdp_maps.h"  /* xsks, handoff_stats, xsk_limits */
#include "stats.h"     /* aggbox_exit, aggbox_count */

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
