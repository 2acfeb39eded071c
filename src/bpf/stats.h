/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-CPU outcome counters (cilium drop_reasons.h + per-CPU metrics style).
 *
 * Every program of the XDP chain ends in exactly one place that calls
 * aggbox_exit(): it counts the outcome or drop reason once and turns it into
 * the XDP verdict. Drop reasons are negative (enum aggbox_drop_reason), so
 * they can never be mistaken for a verdict or an outcome. Once the
 * datagram's job is known it is also counted under that job (job_stats).
 */
#ifndef AGGBOX_STATS_H
#define AGGBOX_STATS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "scratch.h"   /* struct aggbox_scratch */
#include "xdp_maps.h"  /* stats, job_stats, scratch */

/* A valid contribution that does not complete its slot is absorbed. */
#define AGGBOX_ACCEPTED_VERDICT XDP_DROP

/* Stats index of an outcome (>= 0) or a drop reason (< 0). */
static __always_inline __u32 aggbox_outcome_index(int code)
{
	if (code >= 0)
		return (__u32)code;
	return AGGBOX_STATS_DROP_BASE + (__u32)(AGGBOX_DROP_FIRST - code);
}

/*
 * Count one datagram under its job, if this entry run got far enough to know
 * it (scratch.job_known, reset at the start of every aggbox_xdp run and set
 * once the jobs lookup succeeded): drops before that stay global only.
 *
 * A global (noinline, non-static) function: the verifier checks it once,
 * with `code` unknown, instead of once per inlined aggbox_exit() site and
 * per path reaching it. Returns 1 when counted, 0 otherwise.
 */
__attribute__((noinline)) int aggbox_count_job(int code, __u32 bytes)
{
	struct aggbox_job_stats *js;
	struct aggbox_scratch *s;
	__u32 zero = 0, jidx;

	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s || !s->job_known)
		return 0;
	jidx = s->jidx;
	js = bpf_map_lookup_elem(&job_stats, &jidx);
	if (!js)
		return 0;
	/* per-CPU value, XDP runs with migration disabled: plain adds */
	switch (code) {
	case AGGBOX_OUTCOME_ACCEPTED:
		js->accepted += 1;
		break;
	case AGGBOX_OUTCOME_RESULT:
		js->results += 1;
		if (s->overflow)
			js->overflow_results += 1;
		break;
	case AGGBOX_OUTCOME_TO_USERSPACE:
		js->handed_to_userspace += 1;
		break;
	case AGGBOX_DROP_RETRANSMISSION:
		js->retransmissions += 1;
		break;
	case AGGBOX_DROP_STALE_ROUND:
		js->stale += 1;
		break;
	default:
		if (code >= 0)
			return 0; /* USERSPACE_UNAVAILABLE (passed): global only */
		js->dropped += 1;
		break;
	}
	js->bytes += bytes;
	return 1;
}

/* Count one datagram of `bytes` UDP payload bytes under `code` (globally,
 * and under its job when known). */
static __always_inline void aggbox_count(int code, __u32 bytes)
{
	__u32 idx = aggbox_outcome_index(code);
	struct aggbox_stat *st = bpf_map_lookup_elem(&stats, &idx);

	aggbox_count_job(code, bytes);
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
