/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-CPU counters of the broadcast TC programs (aggbox_tc.bpf.c, fib.h):
 * every packet either program sees ends in bcast_exit(), which counts its
 * outcome once (enum aggbox_bcast_stat) and returns the TC verdict; events
 * on the way (copies, next-hop lookups) are counted with bcast_count().
 */
#ifndef AGGBOX_TC_STATS_H
#define AGGBOX_TC_STATS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "tc_maps.h"  /* bcast_stats */

/* Count one event of `bytes` UDP payload bytes. */
static __always_inline void bcast_count(__u32 stat, __u32 bytes)
{
	struct aggbox_stat *st = bpf_map_lookup_elem(&bcast_stats, &stat);

	if (!st)
		return;
	/* per-CPU value, TC runs with migration disabled: plain adds */
	st->packets += 1;
	st->bytes += bytes;
}

/* The one exit path of both programs: count the datagram outcome, return the verdict. */
static __always_inline int bcast_exit(__u32 stat, __u32 bytes, int verdict)
{
	bcast_count(stat, bytes);
	return verdict;
}

#endif /* AGGBOX_TC_STATS_H */
