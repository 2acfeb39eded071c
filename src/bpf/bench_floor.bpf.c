// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Benchmark floor: the least any XDP aggregator of the benchmark's traffic
 * can cost on a machine (src/bin/aggbox-bench/agg/, mode `floor`;
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
 *
 * Two programs: `bench_floor` for the MTU 1500 fragments of FLOOR_PER
 * elements by direct packet access, and `bench_floor_frags`
 * ("xdp.frags") for fragments of any size up to FLOOR_MAX_ELEMS (MTU 9000
 * and 65535, whose frames veth hands XDP as several buffers), read and
 * written in chunks of FLOOR_PER elements with bpf_xdp_load_bytes /
 * store_bytes, each chunk in a slot of its own (the slot of a fragment's
 * chunk 0 keeps the rank bitmap and the completion count).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"

#define ETH_P_IP_ 0x0800
#define IPPROTO_UDP_ 17
#define FLOOR_PER 362 /* elements of a full benchmark fragment (MTU 1500) */
#define FLOOR_PAIRS (FLOOR_PER / 2)
#define FLOOR_SLOTS 32768
/* Largest fragment of bench_floor_frags: a 65,535-byte MTU's datagram. */
#define FLOOR_MAX_ELEMS 16370
#define FLOOR_MAX_CHUNKS ((FLOOR_MAX_ELEMS + FLOOR_PER - 1) / FLOOR_PER)

struct floor_cfg {
	__u32 port;        /* job port (host order) */
	__u32 result_port; /* RESULT destination port (host order) */
	__u32 workers;     /* contributions that complete a fragment, <= 64 */
	__u32 frags;       /* fragments per round (slot index stride) */
	__u32 slots_mask;  /* slots the index cycles over, minus 1 (a power of two <= FLOOR_SLOTS;
			    * the benchmark sets AggBox's region for the same job, so both keep the
			    * same memory in use) */
	__u32 per;         /* bench_floor_frags: elements of a full fragment (its
			    * frag_off stride); chunks of a fragment = per / FLOOR_PER rounded up */
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
	__u32 adds;        /* bench_floor_frags: contributions added to this chunk */
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

/* A full fragment's FLOOR_PER big-endian elements at p (packet or chunk
 * buffer) into slot->acc, two per 64-bit load: set by the first
 * contribution, added by the others; and slot->acc written back to p. */
static __always_inline void floor_pairs_set(struct floor_slot *slot, __u64 *p)
{
	__u32 j;

#pragma unroll
	for (j = 0; j < FLOOR_PAIRS; j++) {
		__u64 y = __builtin_bswap64(p[j]);

		slot->acc[2 * j] = FIRST(y);
		slot->acc[2 * j + 1] = SECOND(y);
	}
}

static __always_inline void floor_pairs_add(struct floor_slot *slot, __u64 *p)
{
	__u32 j;

#pragma unroll
	for (j = 0; j < FLOOR_PAIRS; j++) {
		__u64 y = __builtin_bswap64(p[j]);

		slot->acc[2 * j] += FIRST(y);
		slot->acc[2 * j + 1] += SECOND(y);
	}
}

static __always_inline void floor_pairs_store(struct floor_slot *slot, __u64 *p)
{
	__u32 j;

#pragma unroll
	for (j = 0; j < FLOOR_PAIRS; j++)
		p[j] = __builtin_bswap64(((__u64)slot->acc[2 * j] << 32) | (__u32)slot->acc[2 * j + 1]);
}

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
			if (first)
				floor_pairs_set(slot, p);
			else
				floor_pairs_add(slot, p);
			if (++slot->done == cfg->workers) {
				result = 1;
				floor_pairs_store(slot, p);
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


/* bench_floor_frags: one chunk of a contribution's payload, loaded from or
 * stored to the packet. */
struct floor_chunk {
	__be32 e[FLOOR_PER];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct floor_chunk);
} floor_chunk SEC(".maps");

/* Elements of chunk k of the contribution in ctx (0: none). */
static __always_inline __u32 floor_chunk_elems(struct xdp_md *ctx, __u32 k)
{
	__u32 count = FLOOR_COUNT(ctx), start = k * FLOOR_PER;

	if (start >= count)
		return 0;
	return count - start > FLOOR_PER ? FLOOR_PER : count - start;
}

/* The bytes of a chunk of n elements for bpf_xdp_load_bytes /
 * bpf_xdp_store_bytes, in [4, 4 * FLOOR_PER], or -1 when n is 0 or more than
 * a chunk. The compiler barriers keep both tests on len itself: clang would
 * otherwise test n == 0 (from which 6.1's verifier learns no lower bound for
 * n * 4) or fuse the two into one unsigned test of len - 4 (whose bound
 * kernels before 6.11 do not carry back to len), and the helper's size
 * would not be proven nonzero. */
static __always_inline int floor_chunk_bytes(__u32 n)
{
	__u32 len = n * 4;

	asm volatile("" : "+r"(len));
	if (len < 4)
		return -1;
	asm volatile("" : "+r"(len));
	if (len > 4 * FLOOR_PER)
		return -1;
	return len;
}

/* Chunk k of the contribution in ctx (to fragment frag_off of round) added
 * into slot idx. A global function: verified once, not once per chunk of
 * the caller's loop. Returns 0, or -1 when the packet or the maps fail it. */
__noinline int floor_add_chunk(struct xdp_md *ctx, __u32 k, __u32 idx, __u32 round, __u32 frag_off)
{
	__u32 zero = 0, j, n = floor_chunk_elems(ctx, k), off = frag_off + k * FLOOR_PER;
	struct floor_chunk *buf;
	struct floor_slot *slot;
	int first, len;

	buf = bpf_map_lookup_elem(&floor_chunk, &zero);
	slot = bpf_map_lookup_elem(&floor_slots, &idx);
	len = floor_chunk_bytes(n);
	if (!buf || !slot || k >= FLOOR_MAX_CHUNKS || len < 0)
		return -1;
	if (bpf_xdp_load_bytes(ctx, FLOOR_PAYLOAD + k * 4 * FLOOR_PER, buf->e, len))
		return -1;
	bpf_spin_lock(&slot->lock);
	if (k && (slot->round != round || slot->frag_off != off)) {
		slot->round = round;
		slot->frag_off = off;
		slot->adds = 0;
	}
	first = slot->adds++ == 0;
	if (n == FLOOR_PER) {
		if (first)
			floor_pairs_set(slot, (__u64 *)buf->e);
		else
			floor_pairs_add(slot, (__u64 *)buf->e);
	} else {
		for (j = 0; j < FLOOR_PER; j++) {
			__s64 v;

			if (j >= n)
				break;
			v = (__s32)bpf_ntohl(buf->e[j]);
			slot->acc[j] = first ? v : slot->acc[j] + v;
		}
	}
	bpf_spin_unlock(&slot->lock);
	return 0;
}

/* The result of chunk k from slot idx written into the packet. Global, as
 * floor_add_chunk. */
__noinline int floor_store_chunk(struct xdp_md *ctx, __u32 k, __u32 idx)
{
	__u32 zero = 0, j, n = floor_chunk_elems(ctx, k);
	struct floor_chunk *buf;
	struct floor_slot *slot;
	int len;

	buf = bpf_map_lookup_elem(&floor_chunk, &zero);
	slot = bpf_map_lookup_elem(&floor_slots, &idx);
	len = floor_chunk_bytes(n);
	if (!buf || !slot || k >= FLOOR_MAX_CHUNKS || len < 0)
		return -1;
	if (n == FLOOR_PER) {
		floor_pairs_store(slot, (__u64 *)buf->e);
	} else {
		for (j = 0; j < FLOOR_PER; j++) {
			if (j >= n)
				break;
			buf->e[j] = bpf_htonl((__u32)slot->acc[j]);
		}
	}
	return bpf_xdp_store_bytes(ctx, FLOOR_PAYLOAD + k * 4 * FLOOR_PER, buf->e, len) ? -1 : 0;
}

SEC("xdp.frags")
int bench_floor_frags(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct aggbox_agg_hdr *agg;
	struct floor_slot *slot;
	struct floor_cfg *cfg;
	struct udphdr *udp;
	struct iphdr *ip;
	__u32 zero = 0, base, idx, round, frag_off, rank, count, chunks, k, per, mask;
	__u64 bit;
	int result = 0, dup = 0;

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
	round = bpf_ntohl(agg->round);
	frag_off = bpf_ntohl(agg->frag_off);
	rank = bpf_ntohs(agg->rank) & 63;
	count = bpf_ntohs(agg->count);
	per = cfg->per;
	if (count == 0 || count > FLOOR_MAX_ELEMS || per == 0 || per > FLOOR_MAX_ELEMS)
		return XDP_PASS;
	bit = 1ULL << rank;
	chunks = (count + FLOOR_PER - 1) / FLOOR_PER;
	mask = cfg->slots_mask & (FLOOR_SLOTS - 1);
	/* A fragment's chunks take consecutive slots. */
	base = (round * cfg->frags + frag_off / per) * ((per + FLOOR_PER - 1) / FLOOR_PER);

	/* Chunk 0's slot: the rank bitmap (a resend adds nothing) and, below,
	 * the completion count. */
	idx = base & mask;
	slot = bpf_map_lookup_elem(&floor_slots, &idx);
	if (!slot)
		return XDP_PASS;
	bpf_spin_lock(&slot->lock);
	if (slot->round != round || slot->frag_off != frag_off) {
		slot->round = round;
		slot->frag_off = frag_off;
		slot->done = 0;
		slot->adds = 0;
		slot->ranks = 0;
	}
	if (slot->ranks & bit)
		dup = 1;
	else
		slot->ranks |= bit;
	bpf_spin_unlock(&slot->lock);
	if (dup)
		return XDP_DROP;

	for (k = 0; k < FLOOR_MAX_CHUNKS; k++) {
		if (k >= chunks)
			break;
		if (floor_add_chunk(ctx, k, (base + k) & mask, round, frag_off))
			return XDP_DROP;
	}

	idx = base & mask;
	slot = bpf_map_lookup_elem(&floor_slots, &idx);
	if (!slot)
		return XDP_DROP;
	bpf_spin_lock(&slot->lock);
	result = slot->round == round && slot->frag_off == frag_off && ++slot->done == cfg->workers;
	bpf_spin_unlock(&slot->lock);
	if (!result)
		return XDP_DROP;

	/* Complete: nobody writes its slots any more. */
	for (k = 0; k < FLOOR_MAX_CHUNKS; k++) {
		if (k >= chunks)
			break;
		if (floor_store_chunk(ctx, k, (base + k) & mask))
			return XDP_DROP;
	}
	data = (void *)(long)ctx->data;
	end = (void *)(long)ctx->data_end;
	udp = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
	agg = (void *)(udp + 1);
	if ((void *)(agg + 1) > end)
		return XDP_DROP;
	agg->rank = bpf_htons(AGGBOX_RESULT_RANK);
	agg->flags |= AGGBOX_AGG_F_RESULT;
	udp->dest = bpf_htons(cfg->result_port);
	udp->check = 0;
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
