// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The ring program (AGGBOX_CALL_RING, docs/RING.md "XDP"): one AGR1
 * datagram of a ring job this node is a member of. A PARTIAL gets this
 * member's elements added in place and goes on to the next member (the
 * member that completes it stores the result first and sends it on as a
 * FINAL); a FINAL is stored and goes on unless it was the last. What the
 * program cannot do (a round not ready yet, NACK, KICK, a frame whose
 * payload is not in the linear part, a next hop not resolved) is passed to
 * the node's ring service, which does the same steps in user space
 * (src/node/ring.rs; the arithmetic's reference is src/wire/ring.rs).
 *
 * Its own object, tail-called by the aggregation chain's entry program
 * (aggbox_xdp.bpf.c) at AGGBOX_CALL_RING, which the loader fills with this
 * object's program of the loaded build (chain.h). Its maps are ring_maps.h;
 * ring_ports is the chain's own map, handed to this object at load.
 *
 * Both IP versions (a ring's members are all of one): ring_parse_l3, a
 * global function, leaves the version, the source address and the header
 * offsets in ring_scratch, and everything after it is one path for both
 * (one verifier walk, not one per version); what differs by version is in
 * global functions too: ring_resolve (the next hop) and ring_set_ip_*
 * (the addresses and the checksum of the version).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "aggbox/abi.h"
#include "ops.h"
#include "parse.h"
#include "chain.h"
#include "ring_maps.h"
#define UDP_CSUM_SCRATCH struct ring_scratch
#include "udp_csum.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Elements of a ring_data value (its value size / 4), set by the loader
 * from the configuration: the verifier reads it as a constant. */
const volatile __u32 ring_frag_elems = 362;

/* Largest fragment the direct-access loops edit in place (MTU 1500's 362
 * fits; the verifier walks each of the ten loops this far). Longer ones,
 * and payloads that run on into a multi-buffer frame's fragments, take the
 * chunked path (ring_chunks), 128 elements a chunk. */
#define RING_DIRECT_MAX_ELEMS 384

#define RING_AF_INET 2
#define RING_AF_INET6 10
#define RING_NS_PER_SEC 1000000000ull
#define RING_INT32_MAX 2147483647ll
#define RING_INT32_MIN (-2147483648ll)

static __always_inline void ring_count(__u32 ridx, __u32 what)
{
	struct aggbox_ring_stats *st = bpf_map_lookup_elem(&ring_stats, &ridx);

	if (st && what < AGGBOX_RING_STAT_MAX)
		st->count[what]++;
}

/* The verdict of a datagram and its counter. */
static __always_inline int ring_end(__u32 ridx, __u32 what, int verdict)
{
	ring_count(ridx, what);
	return verdict;
}

static __always_inline __s64 ring_sat(__s64 v, __u32 *saturated)
{
	if (v > RING_INT32_MAX) {
		*saturated = 1;
		return RING_INT32_MAX;
	}
	if (v < RING_INT32_MIN) {
		*saturated = 1;
		return RING_INT32_MIN;
	}
	return v;
}

/*
 * One element: partial (from the datagram) combined with this member's x
 * by the op table's row, saturated to int32 (what leaves int32 is SUM and
 * AVG's; docs/RING.md). `op` is a compile-time constant at every call site
 * (one loop per op), so the switch folds to the row.
 */
static __always_inline __s64 ring_combine(__u8 op, __s64 partial, __s32 x, __s64 w, __u32 *saturated)
{
	return ring_sat(aggbox_op_combine(op, partial, x, w), saturated);
}

/*
 * Add this member's elements (ring_data[key]) into the datagram's payload
 * (`count` elements at byte `off` of the frame; weights from ring_jobs
 * [ridx]); when COMPLETE, also finish
 * them (AVG: divide) and store the result over this member's elements (each
 * is read before it is written). Returns 1 when some value saturated, 0,
 * or -1 when the fragment is missing. One global function per op and
 * COMPLETE, each verified once with its op a constant: the loop is bounded
 * by ring_frag_elems (a load-time constant) for the map value and by
 * data_end for the packet. The packet's bytes change, its length does not.
 */
#define RING_ADD_FN(name, OP, COMPLETE)                                                         \
	__noinline int name(struct xdp_md *ctx, __u32 off, __u32 count, __u32 key, __u32 ridx)  \
	{                                                                                       \
		void *data_end = (void *)(long)ctx->data_end;                                   \
		void *data = (void *)(long)ctx->data;                                           \
		__s32 *mine = bpf_map_lookup_elem(&ring_data, &key);                            \
		struct aggbox_ring_job *rj = bpf_map_lookup_elem(&ring_jobs, &ridx);            \
		__u32 saturated = 0, i, ws;                                                     \
		__be32 *p;                                                                      \
		__s64 v, w;                                                                     \
                                                                                                \
		if (!mine || !rj || off > 256)                                                  \
			return -1;                                                              \
		w = rj->weight;                                                                 \
		ws = rj->weight_sum;                                                            \
		p = data + off;                                                                 \
		for (i = 0; i < RING_DIRECT_MAX_ELEMS; i++) {                                   \
			if (i >= count || i >= ring_frag_elems)                                 \
				break;                                                          \
			if ((void *)(p + 1) > data_end)                                         \
				break;                                                          \
			v = ring_combine(OP, (__s32)bpf_ntohl(*p), mine[i], w, &saturated);     \
			if (COMPLETE) {                                                         \
				v = aggbox_op_finish(OP, v, ws);                                \
				mine[i] = (__s32)v;                                             \
			}                                                                       \
			*p = bpf_htonl((__u32)v);                                               \
			p++;                                                                    \
		}                                                                               \
		return saturated;                                                               \
	}

/* ring_add_<OP> and ring_complete_<OP> for every op the ring runs. */
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) \
	AGGBOX_OP_IF_##ring(RING_ADD_FN(ring_add_##NAME, number, 0) RING_ADD_FN(ring_complete_##NAME, number, 1))
#include "aggbox/ops.def"
#undef AGGBOX_OP

/* `op` passed ring_validate (aggbox_op_runs_in_ring). */
static __always_inline int ring_add_op(struct xdp_md *ctx, __u32 off, __u32 count, __u32 key, __u8 op, __u32 ridx,
				       int complete)
{
	switch (op) {
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi)          \
	AGGBOX_OP_IF_##ring(case number : return complete ? ring_complete_##NAME(ctx, off, count, key, ridx) \
							 : ring_add_##NAME(ctx, off, count, key, ridx);)
#include "aggbox/ops.def"
#undef AGGBOX_OP
	default:
		return -1;
	}
}

/* Store a FINAL's payload (big-endian, at byte `off`) into ring_data[key]
 * (host order). 0, or -1 when the fragment is missing. */
__noinline int ring_store(struct xdp_md *ctx, __u32 off, __u32 count, __u32 key)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	__s32 *mine = bpf_map_lookup_elem(&ring_data, &key);
	__be32 *p;
	__u32 i;

	if (!mine || off > 256)
		return -1;
	p = data + off;
	for (i = 0; i < RING_DIRECT_MAX_ELEMS; i++) {
		if (i >= count || i >= ring_frag_elems)
			break;
		if ((void *)(p + 1) > data_end)
			break;
		mine[i] = (__s32)bpf_ntohl(*p);
		p++;
	}
	return 0;
}

/*
 * The chunked path, for a payload that runs on into the frame's fragments
 * (multi-buffer XDP, frags chain only): 128 elements at a time are copied
 * out with bpf_xdp_load_bytes into ring_scratch, combined with this
 * member's (and, completing, stored over them), and copied back with
 * bpf_xdp_store_bytes (a FINAL's chunk is only stored). One global
 * function per op and COMPLETE handles one chunk (`start_n`: first element
 * << 16 | elements), each verified once; ring_chunks loops over them.
 */
_Static_assert(sizeof(((struct ring_scratch *)0)->buf) == 4 * RING_CHUNK_ELEMS, "a chunk fits ring_scratch.buf");

/* Keep `var` in one register from its bounds check to its use (else clang
 * may index with the check's parts separately, which the verifier cannot
 * bound). */
#define ring_barrier_var(var) asm volatile("" : "+r"(var))

#define RING_CHUNK_FN(name, OP, COMPLETE, STORE)                                               \
	__noinline int name(struct xdp_md *ctx, __u32 off, __u32 start_n, __u32 key, __u32 ridx)  \
	{                                                                                      \
		__u32 zero = 0, start = start_n >> 16, n = start_n & 0xffff, i, k, saturated = 0; \
		__s32 *mine = bpf_map_lookup_elem(&ring_data, &key);                           \
		struct aggbox_ring_job *rj = bpf_map_lookup_elem(&ring_jobs, &ridx);           \
		struct ring_scratch *sc = bpf_map_lookup_elem(&ring_scratch, &zero);           \
		__s64 v;                                                                       \
                                                                                               \
		if (!mine || !rj || !sc || n > RING_CHUNK_ELEMS || off > 256)                  \
			return -1;                                                             \
		if (n == 0)                                                                    \
			return -1;                                                             \
		/* the same n, in a form the verifier bounds to 1..128 (6.1 and 6.12    \
		 * do not raise n's minimum from the n == 0 test) */                    \
		n = ((n - 1) & (RING_CHUNK_ELEMS - 1)) + 1;                                    \
		/* and keep the loop's own bound (i < 128) for the verifier */           \
		ring_barrier_var(n);                                                           \
		if (bpf_xdp_load_bytes(ctx, off + start * 4, sc->buf, n * 4))                  \
			return -1;                                                             \
		for (i = 0; i < RING_CHUNK_ELEMS; i++) {                                       \
			if (i >= n)                                                            \
				break;                                                         \
			k = start + i;                                                         \
			ring_barrier_var(k);                                                   \
			if (k >= ring_frag_elems)                                              \
				break;                                                         \
			if (STORE) {                                                           \
				mine[k] = (__s32)bpf_ntohl(sc->buf[i]);                        \
				continue;                                                      \
			}                                                                      \
			v = ring_combine(OP, (__s32)bpf_ntohl(sc->buf[i]), mine[k], rj->weight, \
					 &saturated);                                          \
			if (COMPLETE) {                                                        \
				v = aggbox_op_finish(OP, v, rj->weight_sum);                   \
				mine[k] = (__s32)v;                                            \
			}                                                                      \
			sc->buf[i] = bpf_htonl((__u32)v);                                      \
		}                                                                              \
		if (!STORE && bpf_xdp_store_bytes(ctx, off + start * 4, sc->buf, n * 4))       \
			return -1;                                                             \
		return saturated;                                                              \
	}

#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) \
	AGGBOX_OP_IF_##ring(RING_CHUNK_FN(ring_chunk_##NAME, number, 0, 0)                   \
				    RING_CHUNK_FN(ring_chunk_complete_##NAME, number, 1, 0))
#include "aggbox/ops.def"
#undef AGGBOX_OP
RING_CHUNK_FN(ring_chunk_store, AGGBOX_OP_SUM, 0, 1)

/* bpf_loop's context for ring_chunks. */
struct ring_chunks_ctx {
	struct xdp_md *ctx;
	__u32 off;
	__u32 count;
	__u32 key;
	__u32 ridx;
	int saturated;
	int err;
};

/* bpf_loop callback of chunk function `fn`: chunk `index`. */
#define RING_CHUNK_CB(cb, fn)                                                                   \
	static long cb(__u64 index, void *data)                                                \
	{                                                                                      \
		struct ring_chunks_ctx *c = data;                                              \
		__u32 start = (__u32)index * RING_CHUNK_ELEMS, n;                              \
		int rc;                                                                        \
                                                                                               \
		if (start >= c->count)                                                         \
			return 1;                                                              \
		n = c->count - start;                                                          \
		if (n > RING_CHUNK_ELEMS)                                                      \
			n = RING_CHUNK_ELEMS;                                                  \
		rc = fn(c->ctx, c->off, start << 16 | n, c->key, c->ridx);                     \
		if (rc < 0) {                                                                  \
			c->err = 1;                                                            \
			return 1;                                                              \
		}                                                                              \
		c->saturated |= rc;                                                            \
		return 0;                                                                      \
	}

#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) \
	AGGBOX_OP_IF_##ring(RING_CHUNK_CB(ring_cb_##NAME, ring_chunk_##NAME)                 \
				    RING_CHUNK_CB(ring_cb_complete_##NAME, ring_chunk_complete_##NAME))
#include "aggbox/ops.def"
#undef AGGBOX_OP
RING_CHUNK_CB(ring_cb_store, ring_chunk_store)

/* ring_chunks' mode: add or complete (op), or store. */
#define RING_MODE(op, complete) ((op) << 1 | (complete))
#define RING_MODE_STORE 0xff
_Static_assert(RING_MODE(AGGBOX_OP_LAST, 1) < RING_MODE_STORE, "modes fit 8 bits");

/*
 * The chunked add, completion or store of a multi-buffer frame's
 * `count` elements at byte `off`; `ridx_mode`: the dense ring index << 8 |
 * the mode (RING_MODE_*: op << 1 | complete, or store). A global function
 * (verified once); bpf_loop over the chunks. Returns 1 saturated, 0, -1
 * error.
 */
__noinline int ring_chunks(struct xdp_md *ctx, __u32 off, __u32 count, __u32 key, __u32 ridx_mode)
{
	struct ring_chunks_ctx c = { .ctx = ctx, .off = off, .count = count, .key = key, .ridx = ridx_mode >> 8 };
	__u32 chunks = (count + RING_CHUNK_ELEMS - 1) / RING_CHUNK_ELEMS;

	if (count > AGGBOX_RING_MAX_FRAG_ELEMS)
		return -1;
	switch (ridx_mode & 0xff) {
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) \
	AGGBOX_OP_IF_##ring(case RING_MODE(number, 0) : bpf_loop(chunks, ring_cb_##NAME, &c, 0); break;  \
			    case RING_MODE(number, 1) : bpf_loop(chunks, ring_cb_complete_##NAME, &c, 0); break;)
#include "aggbox/ops.def"
#undef AGGBOX_OP
	default: bpf_loop(chunks, ring_cb_store, &c, 0); break;
	}
	if (c.err)
		return -1;
	return c.saturated ? 1 : 0;
}

/*
 * Claim the result of `round` in `done` (docs/RING.md "ring_done"): 1 when
 * this datagram is the first to store it, 0 when it is stored or being
 * stored already (a duplicate).
 */
static __always_inline int ring_claim(struct aggbox_ring_done *done, __u32 round)
{
	__u32 want = round + 1, old = done->claimed_plus1;

	if (old == want || (old && aggbox_rounds_ahead(old - 1, round) > 0))
		return 0;
	return __sync_val_compare_and_swap(&done->claimed_plus1, old, want) == old;
}

/* Publish a stored result (saturated or not) and count it for the runtime. */
static __always_inline void ring_publish(struct aggbox_ring_done *done, struct aggbox_ring_ctrl *ctrl, __u32 round,
					 int saturated)
{
	if (saturated)
		done->saturated_plus1 = round + 1;
	/* an atomic exchange orders the stores above before it */
	__sync_lock_test_and_set(&done->round_plus1, round + 1);
	if (ctrl->finals_round == round)
		__sync_fetch_and_add(&ctrl->finals, 1);
}

/* ring_scratch.l3_flags: what ring_parse_l3 found on the way to UDP. */
#define RING_L3_F_FRAGMENT  0x1 /* IPv4 MF or fragment offset, or an IPv6 Fragment header */
#define RING_L3_F_EXTENSION 0x2 /* IPv6 hop-by-hop, routing or destination options */
#define RING_L3_F_ZERO_CSUM 0x4 /* IPv6 UDP checksum 0 (RFC 8200 section 8.1 forbids it) */
#define RING_L3_F_OPTIONS   0x8 /* IPv4 options (the rewrite covers a 20-byte header) */
/* What no ring member sends: dropped, counted malformed (docs/RING.md). */
#define RING_L3_F_MALFORMED (RING_L3_F_FRAGMENT | RING_L3_F_EXTENSION | RING_L3_F_ZERO_CSUM)

/* The UDP header of a datagram the program reads starts within this many
 * bytes of the frame (as the entry program's AGGBOX_MAX_UDP_OFF, which
 * hands nothing later to it). */
#define RING_MAX_UDP_OFF 120

/*
 * The headers up to UDP, for either IP version: Ethernet [+ one VLAN tag],
 * then IPv4 (IHL honoured, options skipped) or IPv6 (extension headers
 * skipped: parse_ip6_ext, so a datagram that carries them is still found
 * by its port, and counted), then the UDP header. Writes into ring_scratch
 * the IP version, the source address as a member holds it (IPv4 in
 * src[0], zeros after), the IP packet's length, the IP and UDP header
 * offsets and RING_L3_F_* flags. Returns 0, or -1 for a frame that carries
 * no UDP datagram the program reads (passed to the stack).
 *
 * A global function (verified once, for both versions): the program goes
 * on from the offsets in ring_scratch, one verifier state whatever the
 * version (aggbox_parse_l3's technique, docs/DATAPLANE.md).
 */
__noinline int ring_parse_l3(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor nh = { .pos = data };
	struct ring_scratch *sc;
	struct udphdr *udph;
	struct ethhdr *eth;
	__u32 zero = 0, flags = 0, ext = 0;
	__u64 off;
	int proto;

	sc = bpf_map_lookup_elem(&ring_scratch, &zero);
	if (!sc)
		return -1;
	proto = parse_ethhdr(&nh, data_end, &eth);
	sc->ip_off = (__u16)(nh.pos - data);
	if (proto == ETH_P_IP) {
		struct iphdr *iph;

		if (parse_iphdr(&nh, data_end, &iph) != IPPROTO_UDP_)
			return -1;
		if (bpf_ntohs(iph->frag_off) & (IP_MF | IP_OFFSET))
			flags |= RING_L3_F_FRAGMENT;
		if (iph->ihl != 5)
			flags |= RING_L3_F_OPTIONS;
		sc->family = AGGBOX_FAMILY_IPV4;
		sc->src[0] = iph->saddr;
		sc->src[1] = 0;
		sc->src[2] = 0;
		sc->src[3] = 0;
		sc->ip_len = bpf_ntohs(iph->tot_len);
	} else if (proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6h;

		proto = parse_ip6hdr(&nh, data_end, &ip6h);
		if (proto < 0 || parse_ip6_ext(&nh, data_end, proto, &ext) != IPPROTO_UDP_)
			return -1;
		if (ext & IP6_EXT_F_FRAGMENT)
			flags |= RING_L3_F_FRAGMENT;
		if (ext & IP6_EXT_F_OTHER)
			flags |= RING_L3_F_EXTENSION;
		sc->family = AGGBOX_FAMILY_IPV6;
		sc->src[0] = ip6h->saddr.in6_u.u6_addr32[0];
		sc->src[1] = ip6h->saddr.in6_u.u6_addr32[1];
		sc->src[2] = ip6h->saddr.in6_u.u6_addr32[2];
		sc->src[3] = ip6h->saddr.in6_u.u6_addr32[3];
		sc->ip_len = sizeof(*ip6h) + bpf_ntohs(ip6h->payload_len);
	} else {
		return -1;
	}
	udph = nh.pos;
	if ((void *)(udph + 1) > data_end)
		return -1;
	off = (void *)udph - data;
	if (off > RING_MAX_UDP_OFF)
		return -1;
	if (sc->family == AGGBOX_FAMILY_IPV6 && udph->check == 0)
		flags |= RING_L3_F_ZERO_CSUM;
	sc->udp_off = (__u16)off;
	sc->l3_flags = flags;
	return 0;
}

/* This member's (`which` 0) or the next member's (1) entry of an IPv6 ring
 * (ring_members [me], [(me + 1) % members]), NULL when it is not IPv6. */
static __always_inline struct aggbox_rank *ring_member6(__u32 ridx, struct aggbox_ring_job *rj, __u32 which)
{
	struct aggbox_rank *m;
	__u32 key;

	if (rj->members < 2 || rj->members > AGGBOX_MAX_RANKS)
		return NULL;
	key = ridx * AGGBOX_MAX_RANKS + (rj->me + which) % rj->members;
	m = bpf_map_lookup_elem(&ring_members, &key);
	return m && m->family == AGGBOX_FAMILY_IPV6 ? m : NULL;
}

/*
 * Resolve the next member's next hop into ring_nexthop[ridx], unless it
 * was resolved less than a second ago: bpf_fib_lookup in the ring's IP
 * version, from this member's address to the next member's (IPv4:
 * ring_jobs' self_addr, next_addr; IPv6: ring_member6), with the
 * datagram's length for the route's MTU. 0: known. A global function:
 * verified once, whatever the version.
 */
__noinline int ring_resolve(struct xdp_md *ctx, __u32 ridx)
{
	struct ring_nexthop *nh = bpf_map_lookup_elem(&ring_nexthop, &ridx);
	struct aggbox_ring_job *rj = bpf_map_lookup_elem(&ring_jobs, &ridx);
	struct bpf_fib_lookup fib = {};
	struct aggbox_rank *self, *next;
	struct ring_scratch *sc;
	__u64 now = bpf_ktime_get_ns();
	__u32 zero = 0;
	int i;

	sc = bpf_map_lookup_elem(&ring_scratch, &zero);
	if (!nh || !rj || !sc)
		return -1;
	if (nh->resolved_ns && now - nh->resolved_ns < RING_NS_PER_SEC)
		return 0;
	fib.l4_protocol = IPPROTO_UDP_;
	fib.tot_len = sc->ip_len > 0xffff ? 0xffff : sc->ip_len;
	fib.ifindex = ctx->ingress_ifindex;
	if (sc->family == AGGBOX_FAMILY_IPV6) {
		self = ring_member6(ridx, rj, 0);
		next = ring_member6(ridx, rj, 1);
		if (!self || !next)
			return -1;
		fib.family = RING_AF_INET6;
#pragma unroll
		for (i = 0; i < 4; i++) {
			fib.ipv6_src[i] = self->addr[i];
			fib.ipv6_dst[i] = next->addr[i];
		}
	} else {
		fib.family = RING_AF_INET;
		fib.ipv4_src = rj->self_addr;
		fib.ipv4_dst = rj->next_addr;
	}
	if (bpf_fib_lookup(ctx, &fib, sizeof(fib), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return -1;
	__builtin_memcpy(nh->dmac, fib.dmac, 6);
	__builtin_memcpy(nh->smac, fib.smac, 6);
	nh->ifindex = fib.ifindex;
	nh->resolved_ns = now;
	return 0;
}

/* IPv4 header checksum of a 20-byte header (checksum field included as 0). */
static __always_inline __u16 ring_ip_csum(struct iphdr *iph)
{
	__u16 *w = (__u16 *)iph;
	__u32 sum = 0;
	int i;

	iph->check = 0;
#pragma unroll
	for (i = 0; i < 10; i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

/*
 * The IP part of sending a datagram on, once the rest of it is final:
 * source = this member, destination = the next member, and the checksum
 * of the version. IPv4: ring_jobs' self_addr and next_addr, the header
 * checksum, UDP checksum 0 (none: the payload was rewritten in place).
 * IPv6: ring_member6's addresses, hop limit as it came (as IPv4's TTL),
 * and the UDP checksum over the whole datagram (udp_csum.h; IPv6 has no
 * "no checksum"), also over a multi-buffer frame's fragments. 0, or -1
 * when the headers are not where ring_scratch says (never). A global
 * function per chain (verified once, whatever the version).
 */
static __always_inline int ring_set_ip(struct xdp_md *ctx, __u32 ridx, const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_ring_job *rj = bpf_map_lookup_elem(&ring_jobs, &ridx);
	struct aggbox_rank *self, *next;
	struct ring_scratch *sc;
	struct udphdr *udph;
	struct iphdr *iph;
	__u32 zero = 0, ip_off, udp_off;
	int i;

	sc = bpf_map_lookup_elem(&ring_scratch, &zero);
	if (!rj || !sc)
		return -1;
	CSUM_BOUNDED_OFF(ip_off, sc->ip_off);
	CSUM_BOUNDED_OFF(udp_off, sc->udp_off);
	if (sc->family == AGGBOX_FAMILY_IPV6) {
		struct ipv6hdr *ip6h = data + ip_off;

		self = ring_member6(ridx, rj, 0);
		next = ring_member6(ridx, rj, 1);
		if (!self || !next || (void *)(ip6h + 1) > data_end)
			return -1;
#pragma unroll
		for (i = 0; i < 4; i++) {
			ip6h->saddr.in6_u.u6_addr32[i] = self->addr[i];
			ip6h->daddr.in6_u.u6_addr32[i] = next->addr[i];
		}
		return udp6_csum_write(ctx, sc, sizeof(struct udphdr) + sizeof(struct aggbox_ring_hdr), linear);
	}
	iph = data + ip_off;
	udph = data + udp_off;
	if ((void *)(iph + 1) > data_end || (void *)(udph + 1) > data_end)
		return -1;
	iph->saddr = rj->self_addr;
	iph->daddr = rj->next_addr;
	iph->check = ring_ip_csum(iph);
	udph->check = 0;
	return 0;
}

__noinline int ring_set_ip_frags(struct xdp_md *ctx, __u32 ridx)
{
	return ring_set_ip(ctx, ridx, 0);
}

__noinline int ring_set_ip_linear(struct xdp_md *ctx, __u32 ridx)
{
	return ring_set_ip(ctx, ridx, 1);
}

/*
 * Send the datagram to the next member, rewriting its headers (their
 * offsets from ring_scratch; the packet re-derived from ctx: the add
 * functions ran in between): MACs of the next hop, UDP source port, the
 * AGR1 fields, then the IP part (ring_set_ip, last: IPv6's checksum covers
 * everything else).
 */
static __always_inline int ring_send_on(struct xdp_md *ctx, __u32 ridx, struct aggbox_ring_job *rj,
					struct ring_nexthop *nh, __u16 hops, __u32 saturated, __u8 kind,
					const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct ethhdr *eth = data;
	struct aggbox_ring_hdr *rh;
	struct ring_scratch *sc;
	struct udphdr *udph;
	__u32 zero = 0, udp_off;

	sc = bpf_map_lookup_elem(&ring_scratch, &zero);
	if (!sc)
		return XDP_DROP;
	CSUM_BOUNDED_OFF(udp_off, sc->udp_off);
	udph = data + udp_off;
	rh = (void *)(udph + 1);
	if ((void *)(eth + 1) > data_end || (void *)(rh + 1) > data_end)
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	__builtin_memcpy(eth->h_dest, nh->dmac, 6);
	__builtin_memcpy(eth->h_source, nh->smac, 6);
	udph->source = bpf_htons(rj->port);
	rh->kind = kind;
	rh->hops = bpf_htons(hops + 1);
	rh->sender = bpf_htons(rj->me);
	if (saturated)
		rh->flags |= AGGBOX_RING_F_SATURATED;
	if ((linear ? ring_set_ip_linear(ctx, ridx) : ring_set_ip_frags(ctx, ridx)) < 0)
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	/* A redirect, also to the interface it came in on: XDP_TX on a veth
	 * leaves the frame in the peer's ring until something else wakes the
	 * peer (its NAPI is kicked only when it runs an XDP program), where a
	 * redirect's flush (ndo_xdp_xmit with XDP_XMIT_FLUSH) kicks it. */
	return bpf_redirect(nh->ifindex, 0);
}

static __always_inline int ring_stage(struct xdp_md *ctx, const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor cur = { .pos = data };
	struct aggbox_ring_done *done;
	struct aggbox_ring_ctrl *ctrl;
	struct aggbox_ring_job *rj;
	struct aggbox_ring_hdr *rh;
	struct aggbox_rank *member;
	struct ring_nexthop nh = {}, *cached;
	struct ring_scratch *sc;
	struct udphdr *udph;
	__u32 ridx, *index, key, frag, count, want, round, n, origin, last, udp_off, off, zero = 0;
	__u16 hops, sender;
	__u8 kind, op, rh_flags;
	__be32 *payload;
	int len, rc, complete, chunked;

	/* Either IP version; from here on one path (ring_parse_l3). */
	if (ring_parse_l3(ctx))
		return XDP_PASS;
	sc = bpf_map_lookup_elem(&ring_scratch, &zero);
	if (!sc)
		return XDP_PASS;
	CSUM_BOUNDED_OFF(udp_off, sc->udp_off);
	cur.pos = data + udp_off;
	len = parse_udphdr(&cur, data_end, &udph);
	if (len < 0)
		return XDP_PASS;
	key = bpf_ntohs(udph->dest);
	index = bpf_map_lookup_elem(&ring_ports, &key);
	if (!index || *index == 0 || *index > AGGBOX_MAX_RINGS)
		return XDP_PASS;
	ridx = *index - 1;
	rj = bpf_map_lookup_elem(&ring_jobs, &ridx);
	if (!rj || rj->port != key || rj->members < 2)
		return XDP_PASS; /* being reconfigured */

	rh = cur.pos;
	if ((void *)(rh + 1) > data_end || len < (int)sizeof(*rh))
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	/* An IP fragment (either version), IPv6 extension headers, an IPv6
	 * UDP checksum 0: no member sends those. */
	if (rh->magic != bpf_htonl(AGGBOX_MAGIC_RING) || bpf_ntohs(rh->ring) != rj->id ||
	    rh->kind > AGGBOX_RING_KIND_LAST || (rh->flags & ~AGGBOX_RING_F_KNOWN) ||
	    (sc->l3_flags & RING_L3_F_MALFORMED))
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	/* The service checks a KICK's source itself (it comes from lo). */
	if (rh->kind == AGGBOX_RING_KICK)
		return ring_end(ridx, AGGBOX_RING_TO_SERVICE, XDP_PASS);
	n = rj->members;
	sender = bpf_ntohs(rh->sender);
	if (sender >= n || sender >= AGGBOX_MAX_RANKS)
		return ring_end(ridx, AGGBOX_RING_FORGED, XDP_DROP);
	key = ridx * AGGBOX_MAX_RANKS + sender;
	member = bpf_map_lookup_elem(&ring_members, &key);
	/* The member's IP version and all 16 bytes of its address (an IPv4
	 * source is src[0] and three zero words, as an IPv4 member's). */
	if (!member || member->family != sc->family ||
	    ((member->addr[0] ^ sc->src[0]) | (member->addr[1] ^ sc->src[1]) | (member->addr[2] ^ sc->src[2]) |
	     (member->addr[3] ^ sc->src[3])))
		return ring_end(ridx, AGGBOX_RING_FORGED, XDP_DROP);
	if (rh->kind == AGGBOX_RING_NACK)
		return ring_end(ridx, AGGBOX_RING_TO_SERVICE, XDP_PASS);

	/* PARTIAL or FINAL */
	frag = bpf_ntohl(rh->frag);
	count = bpf_ntohs(rh->count);
	hops = bpf_ntohs(rh->hops);
	if (frag >= rj->frags || !aggbox_op_runs_in_ring(rh->op))
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	want = rj->vector_len - frag * rj->frag_elems;
	if (want > rj->frag_elems)
		want = rj->frag_elems;
	if (count != want || count > ring_frag_elems || len != (int)(sizeof(*rh) + 4 * count))
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	if (rh->kind == AGGBOX_RING_PARTIAL ? (hops < 1 || hops > n - 1) : (hops < n || hops > 2 * n - 2))
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	origin = frag % n;
	/* Transmission `hops` goes from member origin + hops - 1 to origin +
	 * hops; a FINAL may also come straight from the completing member
	 * (origin - 1), which answers a NACK_FINAL that way. */
	if ((origin + hops) % n != rj->me ||
	    ((hops + n - 1) % n != (sender + n - origin) % n &&
	     !(rh->kind == AGGBOX_RING_FINAL && sender == (origin + n - 1) % n)))
		return ring_end(ridx, AGGBOX_RING_FORGED, XDP_DROP);
	if (rh->flags & AGGBOX_RING_F_SATURATED)
		ring_count(ridx, AGGBOX_RING_SATURATED);

	payload = (__be32 *)(rh + 1);
	/* The headers must be linear and an IPv4 header 20 bytes (the
	 * rewrite covers 20). A payload that runs on into the frame's
	 * fragments (multi-buffer) takes the chunked path on the frags chain;
	 * the linear chain's kernels have no such frames. */
	if (sc->l3_flags & RING_L3_F_OPTIONS)
		return ring_end(ridx, AGGBOX_RING_TO_SERVICE, XDP_PASS);
	chunked = (void *)(payload + count) > data_end || count > RING_DIRECT_MAX_ELEMS;
	if (chunked && (linear || bpf_xdp_get_buff_len(ctx) < (__u64)((void *)(payload + count) - data)))
		return ring_end(ridx, linear ? AGGBOX_RING_TO_SERVICE : AGGBOX_RING_MALFORMED,
				linear ? XDP_PASS : XDP_DROP);
	/* the payload's offset as a bounded value (no pointer difference) */
	off = udp_off + sizeof(*udph) + sizeof(*rh);
	kind = rh->kind;
	op = rh->op;
	rh_flags = rh->flags;

	key = ridx;
	ctrl = bpf_map_lookup_elem(&ring_ctrl, &key);
	round = bpf_ntohl(rh->round);
	/* this round's buffer (the other holds the last round's results) */
	key = AGGBOX_RING_INDEX(rj->base, rj->frags, round, frag);
	done = bpf_map_lookup_elem(&ring_done, &key);
	if (!ctrl || !done)
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	if (!(ctrl->state & AGGBOX_RING_READY) || round != ctrl->ready_round) {
		if (kind == AGGBOX_RING_PARTIAL && aggbox_rounds_ahead(round, ctrl->ready_round) >= 0)
			return ring_end(ridx, AGGBOX_RING_EARLY, XDP_PASS);
		/* a FINAL of a round not ready here, or an older PARTIAL: this
		 * member completed that round already (docs/RING.md) */
		return ring_end(ridx, kind == AGGBOX_RING_FINAL ? AGGBOX_RING_DUPLICATE : AGGBOX_RING_STALE, XDP_DROP);
	}
	if (op != ctrl->op)
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);

	last = kind == AGGBOX_RING_FINAL && hops == 2 * n - 2;
	/* Resolve the next hop before the datagram changes: when it is not
	 * known the service gets the datagram as it arrived. */
	if (!last) {
		cached = ring_resolve(ctx, ridx) ? NULL : bpf_map_lookup_elem(&ring_nexthop, &ridx);
		if (!cached)
			return ring_end(ridx, AGGBOX_RING_NO_ROUTE, XDP_PASS);
		nh = *cached;
	}

	if (kind == AGGBOX_RING_PARTIAL) {
		complete = hops == n - 1;
		/* completing: claim, add + finish + store, publish */
		if (complete && !ring_claim(done, round))
			return ring_end(ridx, AGGBOX_RING_DUPLICATE, XDP_DROP);
		if (chunked)
			rc = ring_chunks(ctx, off, count, key,
					 ridx << 8 | RING_MODE(op, complete));
		else
			rc = ring_add_op(ctx, off, count, key, op, ridx, complete);
		if (rc < 0)
			return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
		if (complete) {
			ring_publish(done, ctrl, round, rc || (rh_flags & AGGBOX_RING_F_SATURATED));
			ring_count(ridx, AGGBOX_RING_COMPLETED);
		} else {
			ring_count(ridx, AGGBOX_RING_ADDED);
		}
		if (rc)
			ring_count(ridx, AGGBOX_RING_SATURATED);
		return ring_send_on(ctx, ridx, rj, &nh, hops, rc, complete ? AGGBOX_RING_FINAL : AGGBOX_RING_PARTIAL,
				    linear);
	}

	/* FINAL */
	if (!ring_claim(done, round))
		return ring_end(ridx, AGGBOX_RING_DUPLICATE, XDP_DROP);
	if ((chunked ? ring_chunks(ctx, off, count, key, ridx << 8 | RING_MODE_STORE) : ring_store(ctx, off, count, key)) < 0)
		return ring_end(ridx, AGGBOX_RING_MALFORMED, XDP_DROP);
	ring_publish(done, ctrl, round, rh_flags & AGGBOX_RING_F_SATURATED);
	ring_count(ridx, AGGBOX_RING_STORED);
	if (last)
		return XDP_DROP;
	return ring_send_on(ctx, ridx, rj, &nh, hops, 0, AGGBOX_RING_FINAL, linear);
}

/* CALL_RING of both chains. */
CHAIN_PROGRAMS(aggbox_ring, ring_stage)
