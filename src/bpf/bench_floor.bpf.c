// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Benchmark floor: the least any XDP aggregator of the benchmark's traffic
 * can cost on a machine (src/bin/aggbox-bench/agg.rs, mode `floor`;
 * benches/xdp_chain.rs).
 *
 * It does only the unavoidable work for the benchmark's own datagrams: parse
 * Ethernet / IPv4 / UDP to the job port, one array slot indexed by (round,
 * fragment), direct packet access, one spin lock per contribution, the adds
 * (fragments of bench_cfg.per elements unrolled in pairs), a rank bitmap so
 * that the benchmark's resends do not add twice, and on completion the last
 * contribution rewritten into the RESULT (rank 0xFFFF, RESULT flag, UDP
 * destination = the result port, checksum 0) and passed to the stack. No
 * validation of sources or ranks, no stale rounds, no hand-off, no clamping,
 * no counters beyond the kernel's run statistics: it is a yardstick, not an
 * aggregator to deploy. SUM only.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"

#define ETH_P_IP_ 0x0800
#define IPPROTO_UDP_ 17
#define FLOOR_PER 362 /* elements of a full benchmark fragment (MTU 1500) */
#define FLOOR_PAIRS (FLOOR_PER / 2)
#define FLOOR_SLOTS 8192

struct floor_cfg {
	__u32 port;        /* job port (host order) */
	__u32 result_port; /* RESULT destination port (host order) */
	__u32 workers;     /* contributions that complete a fragment, <= 64 */
	__u32 frags;       /* fragments per round (slot index stride) */
	__u32 slots_mask;  /* slots the index cycles over, minus 1 (a power of two <= FLOOR_SLOTS;
			    * the benchmark sets AggBox's region for the same job, so both keep the
			    * same memory in use) */
};

/* [0]: the benchmark's job; written by the benchmark before attaching. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct floor_cfg);
} floor_cfg SEC(".maps");

struct floor_slot {
	struct bpf_spin_lock lock;
	__u32 round;
	__u32 frag_off;
	__u32 done;
	__u32 pad;
	__u64 ranks;
	__s64 acc[FLOOR_PER + 1];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FLOOR_SLOTS);
	__type(key, __u32);
	__type(value, struct floor_slot);
} floor_slots SEC(".maps");

/* Payload offset (Ethernet, IPv4 without options, UDP, AGG1 header) and
 * the count read afresh from the packet. */
#define FLOOR_PAYLOAD (sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr) + sizeof(struct aggbox_agg_hdr))
static __always_inline __u32 FLOOR_COUNT(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	struct aggbox_agg_hdr *agg = data + FLOOR_PAYLOAD - sizeof(*agg);

	if ((void *)(agg + 1) > (void *)(long)ctx->data_end)
		return 0;
	return bpf_ntohs(*(volatile __be16 *)&agg->count);
}

#define FIRST(y) ((__s64)(y) >> 32)
#define SECOND(y) ((__s64)((y) << 32) >> 32)

SEC("xdp")
int bench_floor(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct aggbox_agg_hdr *agg;
	struct floor_slot *slot;
	struct floor_cfg *cfg;
	struct udphdr *udp;
	struct iphdr *ip;
	__u32 zero = 0, idx, round, frag_off, rank, j;
	__u64 *p, bit;
	int result = 0, first, dup = 0;

	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP_))
		return XDP_PASS;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP_ || ip->ihl != 5)
		return XDP_PASS;
	udp = (void *)(ip + 1);
	agg = (void *)(udp + 1);
	if ((void *)(agg + 1) > end)
		return XDP_PASS;
	cfg = bpf_map_lookup_elem(&floor_cfg, &zero);
	if (!cfg || bpf_ntohs(udp->dest) != cfg->port)
		return XDP_PASS;
	p = (void *)(agg + 1);
	round = bpf_ntohl(agg->round);
	frag_off = bpf_ntohl(agg->frag_off);
	rank = bpf_ntohs(agg->rank) & 63;
	bit = 1ULL << rank;
	idx = (round * cfg->frags + frag_off / FLOOR_PER) & cfg->slots_mask & (FLOOR_SLOTS - 1);
	slot = bpf_map_lookup_elem(&floor_slots, &idx);
	if (!slot)
		return XDP_PASS;

	/* A full fragment: one bounds check, the pairs unrolled. (The key
	 * stays in the slot after completion: a late resend finds its rank's
	 * bit and is dropped.) */
	if (bpf_ntohs(agg->count) == FLOOR_PER && (void *)(p + FLOOR_PAIRS) <= end) {
		bpf_spin_lock(&slot->lock);
		first = slot->round != round || slot->frag_off != frag_off;
		if (first) {
			slot->round = round;
			slot->frag_off = frag_off;
			slot->done = 0;
			slot->ranks = 0;
		}
		if (slot->ranks & bit) {
			dup = 1;
		} else {
			slot->ranks |= bit;
			if (first) {
#pragma unroll
				for (j = 0; j < FLOOR_PAIRS; j++) {
					__u64 y = __builtin_bswap64(p[j]);

					slot->acc[2 * j] = FIRST(y);
					slot->acc[2 * j + 1] = SECOND(y);
				}
			} else {
#pragma unroll
				for (j = 0; j < FLOOR_PAIRS; j++) {
					__u64 y = __builtin_bswap64(p[j]);

					slot->acc[2 * j] += FIRST(y);
					slot->acc[2 * j + 1] += SECOND(y);
				}
			}
			if (++slot->done == cfg->workers) {
				result = 1;
#pragma unroll
				for (j = 0; j < FLOOR_PAIRS; j++)
					p[j] = __builtin_bswap64(((__u64)slot->acc[2 * j] << 32) |
								 (__u32)slot->acc[2 * j + 1]);
			}
		}
		bpf_spin_unlock(&slot->lock);
	} else {
		/* A shorter fragment (a vector's last): element by element. The
		 * count is re-read from the packet and each loop starts from a
		 * fresh packet pointer, so that no loop exit carries state into
		 * what follows (the verifier walks each once). */
		if (bpf_ntohs(agg->count) > FLOOR_PER)
			return XDP_PASS;
		bpf_spin_lock(&slot->lock);
		first = slot->round != round || slot->frag_off != frag_off;
		if (first) {
			slot->round = round;
			slot->frag_off = frag_off;
			slot->done = 0;
			slot->ranks = 0;
		}
		if (slot->ranks & bit) {
			dup = 1;
		} else {
			__be32 *e = (void *)(long)ctx->data + FLOOR_PAYLOAD;

			slot->ranks |= bit;
			/* Unrolled: 6.1's verifier rejects a loop next to a
			 * helper call's fall-through ("back-edge"). */
#pragma unroll
			for (j = 0; j < FLOOR_PER; j++) {
				__s64 v;

				if (j >= FLOOR_COUNT(ctx) || (void *)(e + j + 1) > (void *)(long)ctx->data_end)
					break;
				v = (__s32)bpf_ntohl(e[j]);
				slot->acc[j] = first ? v : slot->acc[j] + v;
			}
			result = ++slot->done == cfg->workers;
		}
		bpf_spin_unlock(&slot->lock);
		if (result) {
			/* Complete: nobody writes the slot any more. */
			__be32 *e = (void *)(long)ctx->data + FLOOR_PAYLOAD;

#pragma unroll
			for (j = 0; j < FLOOR_PER; j++) {
				if (j >= FLOOR_COUNT(ctx) || (void *)(e + j + 1) > (void *)(long)ctx->data_end)
					break;
				e[j] = bpf_htonl((__u32)slot->acc[j]);
			}
		}
		/* Fresh header pointers for the rewrite below. */
		data = (void *)(long)ctx->data;
		end = (void *)(long)ctx->data_end;
		udp = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
		agg = (void *)(udp + 1);
		if ((void *)(agg + 1) > end)
			return XDP_DROP;
	}
	if (dup || !result)
		return XDP_DROP;
	agg->rank = bpf_htons(AGGBOX_RESULT_RANK);
	agg->flags |= AGGBOX_AGG_F_RESULT;
	udp->dest = bpf_htons(cfg->result_port);
	udp->check = 0;
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
