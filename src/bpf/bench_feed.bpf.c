// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Benchmark feeder (benches/xdp_chain.rs, "in a loop"): lets one
 * BPF_PROG_TEST_RUN with `repeat` time a stream of distinct contributions.
 *
 * A test run with repeat runs its program on one buffer again and again; an
 * aggregator would see the same contribution each time and drop it as a
 * duplicate. This program, run with repeat, turns the buffer into the next
 * contribution of a fixed schedule first (rank = i mod workers, fragment =
 * (i / workers) mod frags, round = first_round + i / (workers * frags), for
 * the i-th run since the benchmark zeroed the count) by writing the rank's
 * Ethernet + IPv4 + UDP + AGG1 header from a template and patching round
 * and frag_off, then tail-calls the program under test (slot 0 of
 * feed_target_frags or feed_target_linear). The payload is left as
 * the last run left it: a completing contribution writes the RESULT over its
 * own payload, so the benchmark's payload is zeros (sums stay in range; the
 * adds cost the same whatever the values). Its own cost is measured the same
 * way with a target that drops at once (feed_sink) and subtracted.
 *
 * Two entry points because a tail call needs a target of the same
 * multi-buffer flag: feed_frags for the frags chain, feed_linear for the
 * linear chain and the floor aggregator.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"

#define FEED_HDR (14 + 20 + 8 + 24) /* Ethernet, IPv4 without options, UDP, AGG1 */
#define FEED_RANKS 64

struct feed_cfg {
	__u32 workers;     /* contributions per fragment, <= FEED_RANKS */
	__u32 frags;       /* fragments per round */
	__u32 count;       /* elements per fragment (frag_off stride) */
	__u32 first_round; /* round of the first run */
};

struct feed_hdr {
	__u8 bytes[FEED_HDR];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct feed_cfg);
} feed_cfg SEC(".maps");

/* Rank r's header template, written by the benchmark. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FEED_RANKS);
	__type(key, __u32);
	__type(value, struct feed_hdr);
} feed_hdrs SEC(".maps");

/* Runs so far (the benchmark zeroes it before each test run, and runs
 * one test run at a time). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} feed_runs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} feed_target_frags SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} feed_target_linear SEC(".maps");

/* Write the next contribution of the schedule over the packet's headers;
 * 0 on success. */
static __always_inline int feed_next(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct aggbox_agg_hdr *agg = data + FEED_HDR - sizeof(*agg);
	struct feed_cfg *cfg;
	struct feed_hdr *tmpl;
	__u32 zero = 0, rank, frag;
	__u64 *runs, i, n;

	cfg = bpf_map_lookup_elem(&feed_cfg, &zero);
	runs = bpf_map_lookup_elem(&feed_runs, &zero);
	if (!cfg || !runs || cfg->workers == 0 || cfg->frags == 0)
		return -1;
	if (data + FEED_HDR > end)
		return -1;
	i = (*runs)++;
	rank = i % cfg->workers;
	n = i / cfg->workers;
	frag = n % cfg->frags;
	tmpl = bpf_map_lookup_elem(&feed_hdrs, &rank);
	if (!tmpl)
		return -1;
	__builtin_memcpy(data, tmpl->bytes, FEED_HDR);
	agg->round = bpf_htonl(cfg->first_round + (__u32)(n / cfg->frags));
	agg->frag_off = bpf_htonl(frag * cfg->count);
	return 0;
}

SEC("xdp.frags")
int feed_frags(struct xdp_md *ctx)
{
	if (feed_next(ctx))
		return XDP_ABORTED;
	bpf_tail_call(ctx, &feed_target_frags, 0);
	return XDP_ABORTED;
}

SEC("xdp")
int feed_linear(struct xdp_md *ctx)
{
	if (feed_next(ctx))
		return XDP_ABORTED;
	bpf_tail_call(ctx, &feed_target_linear, 0);
	return XDP_ABORTED;
}

/* The calibration targets: the feeder's own cost is what the loop costs
 * with these. */
SEC("xdp.frags")
int feed_sink_frags(struct xdp_md *ctx)
{
	return XDP_DROP;
}

SEC("xdp")
int feed_sink_linear(struct xdp_md *ctx)
{
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
