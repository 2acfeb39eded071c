/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-CPU outcome counters (cilium drop_reasons.h + per-CPU metrics style).
 *
 * Every program of the XDP chain ends in exactly one place that calls
 * aggbox_exit(): it counts the outcome or drop reason once and turns it into
 * the XDP verdict. Drop reasons are negative (enum aggbox_drop_reason), so
 * they can never be mistaken for a verdict or an outcome.
 */
#ifndef AGGBOX_STATS_H
#define AGGBOX_STATS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"

/*
 * stats: one struct aggbox_stat per outcome and per drop reason, per CPU,
 * indexed by aggbox_outcome_index(). Written only by the XDP programs (one
 * increment per datagram, at its exit); read and summed over CPUs by the
 * control plane (src/dataplane.rs, Dataplane::stats).
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_STATS_MAX);
	__type(key, __u32);
	__type(value, struct aggbox_stat);
} stats SEC(".maps");

/* Stats index of an outcome (>= 0) or a drop reason (< 0). */
static __always_inline __u32 aggbox_outcome_index(int code)
{
	if (code >= 0)
		return (__u32)code;
	return AGGBOX_STATS_DROP_BASE + (__u32)(AGGBOX_DROP_FIRST - code);
}

/* Count one datagram of `bytes` UDP payload bytes under `code`. */
static __always_inline void aggbox_count(int code, __u32 bytes)
{
	__u32 idx = aggbox_outcome_index(code);
	struct aggbox_stat *st = bpf_map_lookup_elem(&stats, &idx);

	if (!st)
		return;
	/* per-CPU value, XDP runs with migration disabled: plain adds */
	st->packets += 1;
	st->bytes += bytes;
}

/*
 * The one exit path: record, then map the outcome to a verdict. Every drop
 * reason drops; RESULT and the outcomes that leave the packet to the stack
 * pass; ACCEPTED (a contribution absorbed into its slot) drops.
 */
static __always_inline int aggbox_exit(int code, __u32 bytes)
{
	aggbox_count(code, bytes);
	if (code < 0)
		return XDP_DROP;
	if (code == AGGBOX_OUTCOME_ACCEPTED)
		return AGGBOX_ACCEPTED_VERDICT;
	return XDP_PASS;
}

#endif /* AGGBOX_STATS_H */
