// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * AggBox broadcast data plane (PROTOCOL.md "Broadcast message AGB1",
 * docs/BROADCAST.md). Two TC (clsact) programs:
 *
 * aggbox_tc_egress (root): the application sends ONE AGB1 datagram (to any
 *   address whose neighbour resolves on the egress interface; by convention
 *   the group's first member). For every mask bit i whose destination exists
 *   in the group's table, the program rewrites the datagram in place for
 *   destination i (IPv4 daddr + header checksum, or the IPv6 daddr; UDP
 *   dport, UDP checksum updated incrementally, next-hop MACs) and sends a
 *   copy with
 *   bpf_clone_redirect() to the egress interface. The original datagram
 *   itself becomes the copy of the LAST masked destination (no extra clone;
 *   returned with TC_ACT_OK, or redirected). Copies are produced by one
 *   bounded loop over the 32 mask bits in this one program: no recursion
 *   (a clone-per-pass design re-enters dev_queue_xmit nested and hits
 *   XMIT_RECURSION_LIMIT = 8 long before 32 copies). Each iteration is one
 *   call of the global function copy_to_member(), which the verifier checks
 *   once instead of once per iteration and path (see there: 6.1 rejected the
 *   inlined loop at its 1M-instruction limit).
 *
 * aggbox_tc_ingress (tree node): an AGB1 datagram for this host with
 *   FORWARD set, of a group this node has a table for, is copied to every
 *   destination of that table with hops + 1 (clones to the egress
 *   interface), then its headers are restored and it is delivered locally.
 *   It also routes the AGG1 RESULT datagrams the XDP aggregator passes up
 *   the stack (result_routes): in-kernel allreduce (a copy of each RESULT,
 *   unchanged but for the IP source = this node, to every member of the
 *   job's result group; the original is delivered locally) and trees of
 *   aggregators (the RESULT rewritten into this node's contribution to its
 *   parent's job and redirected out, not delivered locally).
 *
 * Re-entry: bpf_clone_redirect() runs dev_queue_xmit(), which runs the clsact
 * egress hook again on the clone. Every copy carries skb->mark =
 * AGGBOX_BCAST_MARK_* (set on the original just before the clone, restored
 * right after), so the egress program passes it (OWN_COPY) instead of copying
 * it again. A copy whose neighbour is unresolved carries MARK_NEIGH and is
 * cloned to the egress of the interface this program is attached to, not
 * to the one the FIB names (which may have no AggBox program: a forwarder's
 * leaves behind another interface): on re-entry it is handed to
 * bpf_redirect_neigh() towards the interface the FIB names (marked DONE
 * first, because the neighbour path may transmit it through this hook once
 * more).
 *
 * Checksums: the UDP checksum is updated with bpf_l4_csum_replace(), which is
 * right in every skb->ip_summed state: CHECKSUM_NONE (full checksum, e.g.
 * TX offload off, BPF_PROG_TEST_RUN) gets a correct full checksum;
 * CHECKSUM_PARTIAL (locally generated with TX offload) gets its pseudo-header
 * seed updated, so whoever completes it (NIC, skb_checksum_help) writes the
 * right one; a checksum of 0 (sender disabled it) stays 0
 * (BPF_F_MARK_MANGLED_0). Writing 0 is NOT an option under CHECKSUM_PARTIAL:
 * BPF cannot reset ip_summed, and the completion would then write a checksum
 * without pseudo-header: a wrong one.
 *
 * IPv6 (docs/BROADCAST.md "IPv6"): both programs take IPv6 datagrams with
 * UDP right after the fixed header; a group table, a parent and the
 * datagram must be of one family (else FAMILY_MISMATCH, dropped). IPv6
 * copies go through send_copy6(): the 16-byte address change is one
 * bpf_csum_diff() and one bpf_l4_csum_replace() with BPF_F_PSEUDO_HDR, so
 * the checksum rules above hold (never 0 over IPv6: MARK_MANGLED_0 writes a
 * computed 0 as 0xffff); next hops from bpf_fib_lookup(AF_INET6). The
 * IPv6 addresses live in the per-CPU bcast_scratch map, not on the stack
 * (the 512-byte chain on 6.1, struct copy_state).
 *
 * Every packet either program sees ends in bcast_exit(): exactly one
 * datagram counter per packet; copy events are counted on the way.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"
#include "parse.h"
#include "tc_maps.h"
#include "tc_stats.h"
#include "fib.h"

#define TC_ACT_OK       0
#define TC_ACT_SHOT     2
#define TC_ACT_REDIRECT 7
#define PACKET_HOST_    0
#define LOOPBACK_IFINDEX_ 1 /* lo is ifindex 1 in every network namespace */

/* Offsets of the fields the programs rewrite, from the start of their
 * header (bytes): taken from the structs (vmlinux.h for IPv4 and UDP,
 * aggbox/abi.h for AGB1 and AGG1), never written by hand. */
#define IP_CSUM_OFF    __builtin_offsetof(struct iphdr, check)
#define IP_SADDR_OFF   __builtin_offsetof(struct iphdr, saddr)
#define IP_DADDR_OFF   __builtin_offsetof(struct iphdr, daddr)
#define IP6_SADDR_OFF  __builtin_offsetof(struct ipv6hdr, saddr)
#define IP6_DADDR_OFF  __builtin_offsetof(struct ipv6hdr, daddr)
#define IP6_HDR_LEN    40 /* the fixed header; no extension headers here */
#define UDP_DPORT_OFF  __builtin_offsetof(struct udphdr, dest)
#define UDP_CSUM_OFF   __builtin_offsetof(struct udphdr, check)
#define AGB1_FLAGS_OFF __builtin_offsetof(struct aggbox_bcast_hdr, flags) /* + hops: one 16-bit word */
#define AGG1_JOB_OFF   __builtin_offsetof(struct aggbox_agg_hdr, job)     /* + rank: one 32-bit word */
#define AGG1_OP_OFF    __builtin_offsetof(struct aggbox_agg_hdr, op)      /* + flags: one 16-bit word */

/* The word rewrites above change two adjacent fields with one store and one
 * checksum update. */
_Static_assert(__builtin_offsetof(struct aggbox_bcast_hdr, hops) == AGB1_FLAGS_OFF + 1,
	       "AGB1 flags and hops form one 16-bit word");
_Static_assert(__builtin_offsetof(struct aggbox_agg_hdr, rank) == AGG1_JOB_OFF + 2,
	       "AGG1 job and rank form one 32-bit word");
_Static_assert(__builtin_offsetof(struct aggbox_agg_hdr, flags) == AGG1_OP_OFF + 1,
	       "AGG1 op and flags form one 16-bit word");

/* Linear bytes the parser wants: Ethernet + one VLAN tag + IPv4 with the
 * longest options (IHL 15: 60 bytes; longer than IPv6's 40) + UDP + the
 * longer of the AGB1 and AGG1 headers. */
_Static_assert(IP6_HDR_LEN <= 60, "the pull covers an IPv6 header");
#define IPV4_MAX_HDR_LEN 60
#define PARSE_PULL_LEN                                                            \
	(sizeof(struct ethhdr) + sizeof(struct vlan_hdr) + IPV4_MAX_HDR_LEN +     \
	 sizeof(struct udphdr) +                                                  \
	 (sizeof(struct aggbox_agg_hdr) > sizeof(struct aggbox_bcast_hdr) ?       \
		  sizeof(struct aggbox_agg_hdr) : sizeof(struct aggbox_bcast_hdr)))

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Ethernet [+ VLAN] / IPv4 or IPv6 / UDP as parsed; packet pointers valid
 * until the next helper that may change the packet. */
struct udp_view {
	void *data;
	void *data_end;
	struct ethhdr *eth;
	void *l3;    /* struct iphdr (family 4) or struct ipv6hdr (family 6) */
	struct udphdr *udp;
	void *payload;
	int len;     /* UDP payload length announced by the UDP header */
	__u8 family; /* AGGBOX_FAMILY_IPV4 or AGGBOX_FAMILY_IPV6 */
};

/*
 * Parse Ethernet [+ VLAN] / IPv4 or IPv6 / UDP (xdp-tools cursor style),
 * pulling the headers into the linear area when they are paged. IPv6: the
 * fixed header with UDP right after it (an extension header, a Fragment
 * header among them, makes it not ours). Returns 0 with `v` filled, or -1
 * when the packet is not IPv4/UDP or IPv6/UDP (or too short).
 */
static __always_inline int parse_udp(struct __sk_buff *skb, struct udp_view *v)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct hdr_cursor nh = { .pos = data };
	int proto, len;

	if (data + PARSE_PULL_LEN > data_end && skb->len > (__u32)(data_end - data)) {
		/* headers in paged data: make them linear (as far as they go) */
		bpf_skb_pull_data(skb, skb->len < PARSE_PULL_LEN ? skb->len : PARSE_PULL_LEN);
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
		nh.pos = data;
	}

	proto = parse_ethhdr(&nh, data_end, &v->eth);
	if (proto == ETH_P_IP) {
		struct iphdr *iph;

		if (parse_iphdr(&nh, data_end, &iph) != IPPROTO_UDP_)
			return -1;
		v->l3 = iph;
		v->family = AGGBOX_FAMILY_IPV4;
	} else if (proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6h;

		if (parse_ip6hdr(&nh, data_end, &ip6h) != IPPROTO_UDP_)
			return -1;
		v->l3 = ip6h;
		v->family = AGGBOX_FAMILY_IPV6;
	} else {
		return -1;
	}
	len = parse_udphdr(&nh, data_end, &v->udp);
	if (len < 0)
		return -1;
	v->data = data;
	v->data_end = data_end;
	v->payload = nh.pos;
	v->len = len;
	return 0;
}

/* The key of bcast_scratch's one entry, read-only data rather than a
 * stack slot (the 512-byte chain on 6.1, see copy_state). */
static const __u32 scratch_key = 0;

static __always_inline struct bcast_scratch *scratch(void)
{
	return bpf_map_lookup_elem(&bcast_scratch, &scratch_key);
}

static __always_inline int addr6_eq(const __be32 *a, const __be32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* An IPv6 datagram's addresses (`ip6h` in the packet) into scratch: as
 * they arrived, and as they are now. */
static __always_inline void scratch_addrs6(struct bcast_scratch *s, struct ipv6hdr *ip6h)
{
	__builtin_memcpy(s->orig_saddr, &ip6h->saddr, 16);
	__builtin_memcpy(s->orig_daddr, &ip6h->daddr, 16);
	__builtin_memcpy(s->saddr, &ip6h->saddr, 16);
	__builtin_memcpy(s->daddr, &ip6h->daddr, 16);
}

/* A parsed AGB1 datagram: offsets and the header fields the programs need. */
struct agb1_pkt {
	__u32  l3_off;
	__u32  udp_off;
	__u32  payload_len; /* UDP payload bytes */
	__u16  tot_len;     /* IPv4 total length / IPv6 40 + payload length, host order */
	__u8   family;      /* AGGBOX_FAMILY_IPV4 or _IPV6 */
	__be32 saddr;       /* IPv4 only; IPv6: bcast_scratch.orig_saddr */
	__be32 daddr;       /* IPv4 only; IPv6: bcast_scratch.orig_daddr */
	__be16 dport;
	__u16  group;       /* host order */
	__u32  mask;        /* host order */
	__u8   flags;
	__u8   hops;
	__u8   macs[12];    /* destination + source MAC as received */
};

/*
 * AGB1 on top of a parsed UDP datagram. Returns -1 when the packet is not
 * AGB1 at all, or the stat code of a malformed AGB1 datagram, or 0 with `p`
 * filled (an IPv6 datagram's addresses in `s`).
 */
static __always_inline int parse_agb1_view(struct __sk_buff *skb, struct udp_view *v,
					   struct agb1_pkt *p, struct bcast_scratch *s)
{
	void *data = v->data;
	void *data_end = v->data_end;
	struct aggbox_bcast_hdr *b = v->payload;
	struct ethhdr *eth = v->eth;
	struct udphdr *udp = v->udp;
	int len = v->len;

	p->l3_off = v->l3 - data;
	p->udp_off = (void *)udp - data;
	if ((void *)&b->mask > data_end)
		return -1;
	if (b->magic != bpf_htonl(AGGBOX_MAGIC_BCAST))
		return -1;
	/* From here on it is AGB1: every failure is counted. */
	if (v->family == AGGBOX_FAMILY_IPV4) {
		struct iphdr *iph = v->l3;

		if ((void *)(iph + 1) > data_end)
			return -1;
		if (iph->frag_off & bpf_htons(IP_MF | IP_OFFSET))
			return AGGBOX_BCAST_IP_FRAGMENT;
		p->tot_len = bpf_ntohs(iph->tot_len);
		p->saddr = iph->saddr;
		p->daddr = iph->daddr;
	} else {
		struct ipv6hdr *ip6h = v->l3;

		if ((void *)(ip6h + 1) > data_end || !s)
			return -1;
		p->tot_len = IP6_HDR_LEN + bpf_ntohs(ip6h->payload_len);
		scratch_addrs6(s, ip6h);
	}
	if ((void *)(b + 1) > data_end || len < (int)sizeof(*b))
		return AGGBOX_BCAST_MALFORMED;
	if (p->udp_off + sizeof(*udp) + (__u32)len > skb->len)
		return AGGBOX_BCAST_MALFORMED;
	if (b->flags & ~AGGBOX_BCAST_F_KNOWN)
		return AGGBOX_BCAST_MALFORMED;

	p->payload_len = len;
	p->family = v->family;
	p->dport = udp->dest;
	p->group = bpf_ntohs(b->group);
	p->mask = bpf_ntohl(b->mask);
	p->flags = b->flags;
	p->hops = b->hops;
	__builtin_memcpy(p->macs, eth->h_dest, 6);
	__builtin_memcpy(p->macs + 6, eth->h_source, 6);
	return 0;
}

/* Parse Ethernet [+ VLAN] / IPv4 / UDP / AGB1 (see parse_agb1_view). */
static __always_inline int parse_agb1(struct __sk_buff *skb, struct agb1_pkt *p,
				      struct bcast_scratch *s)
{
	struct udp_view v = {};

	if (parse_udp(skb, &v))
		return -1;
	return parse_agb1_view(skb, &v, p, s);
}

/* A RESULT datagram of the XDP aggregator, as it arrives at TC ingress. */
struct agg_result {
	__u32  l3_off;
	__u32  udp_off;
	__u32  payload_len; /* UDP payload bytes */
	__u16  tot_len;     /* IPv4 total length / IPv6 40 + payload length, host order */
	__u8   family;      /* AGGBOX_FAMILY_IPV4 or _IPV6 */
	__be32 saddr;       /* the completing contributor's address (IPv4; IPv6: scratch) */
	__be32 daddr;       /* this node's address (IPv4; IPv6: scratch) */
	__be16 dport;       /* the job's result port */
	__u16  job;         /* host order */
	__u32  job_rank;    /* job + rank words as in the packet (memory order) */
	__u16  op_flags;    /* op + flags word as in the packet (memory order) */
	__u8   op;
	__u8   flags;
	__u8   macs[12];    /* destination + source MAC as received */
};

/*
 * AGG1 RESULT on top of a parsed UDP datagram: magic AGG1, rank 0xffff,
 * RESULT set, not an IP fragment, the datagram fully in the frame. Returns 0
 * with `r` filled, -1 otherwise (anything else is not ours to route: the XDP
 * program validated contributions, the stack gets the rest untouched).
 */
static __always_inline int parse_agg_result(struct __sk_buff *skb, struct udp_view *v,
					    struct agg_result *r, struct bcast_scratch *s)
{
	struct aggbox_agg_hdr *h = v->payload;

	if ((void *)(h + 1) > v->data_end)
		return -1;
	if (h->magic != bpf_htonl(AGGBOX_MAGIC_AGG) || h->rank != bpf_htons(AGGBOX_RESULT_RANK) ||
	    !(h->flags & AGGBOX_AGG_F_RESULT))
		return -1;
	if (v->len < (int)sizeof(*h))
		return -1;
	r->l3_off = v->l3 - v->data;
	r->udp_off = (void *)v->udp - v->data;
	if (r->udp_off + sizeof(struct udphdr) + (__u32)v->len > skb->len)
		return -1;
	if (v->family == AGGBOX_FAMILY_IPV4) {
		struct iphdr *iph = v->l3;

		if ((void *)(iph + 1) > v->data_end)
			return -1;
		if (iph->frag_off & bpf_htons(IP_MF | IP_OFFSET))
			return -1;
		r->tot_len = bpf_ntohs(iph->tot_len);
		r->saddr = iph->saddr;
		r->daddr = iph->daddr;
	} else {
		struct ipv6hdr *ip6h = v->l3;

		if ((void *)(ip6h + 1) > v->data_end || !s)
			return -1;
		r->tot_len = IP6_HDR_LEN + bpf_ntohs(ip6h->payload_len);
		scratch_addrs6(s, ip6h);
	}
	r->family = v->family;
	r->payload_len = v->len;
	r->dport = v->udp->dest;
	r->job = bpf_ntohs(h->job);
	__builtin_memcpy(&r->job_rank, &h->job, sizeof(r->job_rank));
	__builtin_memcpy(&r->op_flags, &h->op, sizeof(r->op_flags));
	r->op = h->op;
	r->flags = h->flags;
	__builtin_memcpy(r->macs, v->eth->h_dest, 6);
	__builtin_memcpy(r->macs + 6, v->eth->h_source, 6);
	return 0;
}

/* The headers as they are now in the skb (tracked across rewrites). An
 * IPv6 datagram's addresses are in bcast_scratch (saddr, daddr). */
struct rewrite_state {
	__u32  l3_off;
	__u32  udp_off;
	__be32 saddr;  /* IPv4 */
	__be32 daddr;  /* IPv4 */
	__be16 dport;
	__u8   family; /* AGGBOX_FAMILY_IPV4 or _IPV6 */
	__u8   pad;    /* explicit: see struct copy_state */
};

/* Replace the IPv4 source address, fixing the IPv4 and UDP checksums. */
static __always_inline int rewrite_src(struct __sk_buff *skb, struct rewrite_state *st,
				       __be32 saddr)
{
	if (saddr == st->saddr)
		return 0;
	if (bpf_l3_csum_replace(skb, st->l3_off + IP_CSUM_OFF, st->saddr, saddr, sizeof(saddr)))
		return -1;
	if (bpf_l4_csum_replace(skb, st->udp_off + UDP_CSUM_OFF, st->saddr, saddr,
				BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(saddr)))
		return -1;
	if (bpf_skb_store_bytes(skb, st->l3_off + IP_SADDR_OFF, &saddr, sizeof(saddr), 0))
		return -1;
	st->saddr = saddr;
	return 0;
}

/* Point the datagram at (daddr, dport), fixing the IPv4 and UDP checksums. */
static __always_inline int rewrite_dest(struct __sk_buff *skb, struct rewrite_state *st,
					__be32 daddr, __be16 dport)
{
	__u32 ip_csum = st->l3_off + IP_CSUM_OFF;
	__u32 udp_csum = st->udp_off + UDP_CSUM_OFF;

	if (daddr != st->daddr) {
		if (bpf_l3_csum_replace(skb, ip_csum, st->daddr, daddr, sizeof(daddr)))
			return -1;
		if (bpf_l4_csum_replace(skb, udp_csum, st->daddr, daddr,
					BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(daddr)))
			return -1;
		if (bpf_skb_store_bytes(skb, st->l3_off + IP_DADDR_OFF, &daddr, sizeof(daddr), 0))
			return -1;
		st->daddr = daddr;
	}
	if (dport != st->dport) {
		if (bpf_l4_csum_replace(skb, udp_csum, st->dport, dport,
					BPF_F_MARK_MANGLED_0 | sizeof(dport)))
			return -1;
		if (bpf_skb_store_bytes(skb, st->udp_off + UDP_DPORT_OFF, &dport, sizeof(dport), 0))
			return -1;
		st->dport = dport;
	}
	return 0;
}

/*
 * Replace the IPv6 address at `addr_off` (now `cur`, kept up to date) by
 * `to`, both 16 bytes in a map, with the UDP checksum updated over the
 * whole change (bpf_csum_diff, then bpf_l4_csum_replace with the pseudo-
 * header flag: right in every ip_summed state, as for IPv4; a computed 0 is
 * written 0xffff, BPF_F_MARK_MANGLED_0). IPv6 has no header checksum.
 */
static __always_inline int rewrite_addr6(struct __sk_buff *skb, __u32 udp_off, __u32 addr_off,
					 __be32 *cur, const __be32 *to)
{
	__s64 diff;

	if (addr6_eq(cur, to))
		return 0;
	diff = bpf_csum_diff(cur, 16, (__be32 *)to, 16, 0);
	if (diff < 0)
		return -1;
	if (bpf_l4_csum_replace(skb, udp_off + UDP_CSUM_OFF, 0, diff,
				BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0))
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, to, 16, 0))
		return -1;
	__builtin_memcpy(cur, to, 16);
	return 0;
}

/* rewrite_src() for an IPv6 datagram (its current addresses in `s`). */
static __always_inline int rewrite_src6(struct __sk_buff *skb, struct rewrite_state *st,
					struct bcast_scratch *s, const __be32 *saddr)
{
	return rewrite_addr6(skb, st->udp_off, st->l3_off + IP6_SADDR_OFF, s->saddr, saddr);
}

/* rewrite_dest() for an IPv6 datagram (its current addresses in `s`). */
static __always_inline int rewrite_dest6(struct __sk_buff *skb, struct rewrite_state *st,
					 struct bcast_scratch *s, const __be32 *daddr, __be16 dport)
{
	if (rewrite_addr6(skb, st->udp_off, st->l3_off + IP6_DADDR_OFF, s->daddr, daddr))
		return -1;
	if (dport != st->dport) {
		if (bpf_l4_csum_replace(skb, st->udp_off + UDP_CSUM_OFF, st->dport, dport,
					BPF_F_MARK_MANGLED_0 | sizeof(dport)))
			return -1;
		if (bpf_skb_store_bytes(skb, st->udp_off + UDP_DPORT_OFF, &dport, sizeof(dport), 0))
			return -1;
		st->dport = dport;
	}
	return 0;
}

/* Back to the destination (and for a RESULT, the source) the datagram
 * arrived with, either family. */
static __always_inline int restore_addrs(struct __sk_buff *skb, struct rewrite_state *st,
					 struct bcast_scratch *s, __be32 saddr, __be32 daddr,
					 __be16 dport)
{
	if (st->family == AGGBOX_FAMILY_IPV6) {
		if (!s)
			return -1;
		return rewrite_dest6(skb, st, s, s->orig_daddr, dport) ||
		       rewrite_src6(skb, st, s, s->orig_saddr);
	}
	return rewrite_dest(skb, st, daddr, dport) || rewrite_src(skb, st, saddr);
}

/*
 * rewrite_dest() and the next-hop MACs in one store instead of five helper
 * calls, for the common copy (next hop resolved, UDP port unchanged): the
 * Ethernet header (and VLAN tag) and the IPv4 header's first 20 bytes are
 * read directly from the packet into the stack, the MACs, the destination
 * and the header checksum (RFC 1624, what bpf_l3_csum_replace() computes)
 * patched there, and the whole written back with one bpf_skb_store_bytes()
 * (each helper call is ~25-50 ns on the VMs measured; the bytes rewritten
 * unchanged cost nothing extra). The UDP checksum still goes through
 * bpf_l4_csum_replace(): right in every ip_summed state (file comment).
 * Reads only: a program that WRITES packet data directly gets the
 * verifier's unclone prologue, which copies the head of every cloned skb it
 * sees (TCP's transmit clones among them). docs/BENCHMARKS.md, "Broadcast
 * floor". Packet pointers are invalid afterwards.
 *
 * L3 (the IPv4 header's offset: 14, or 18 after one VLAN tag) is a
 * constant at each call site, so every access has a constant offset.
 */
_Static_assert(__builtin_offsetof(struct bcast_nh, smac) == 6, "dmac and smac are adjacent");
#define NH_IP_BYTES 20 /* IPv4 header without options: up to and including daddr */
static __always_inline int rewrite_dest_nh_at(struct __sk_buff *skb, struct rewrite_state *st,
					      __be32 daddr, const struct bcast_nh *nh, const __u32 L3)
{
	/* 8-aligned, and the IPv4 fields written through memcpy: the verifier
	 * refuses a misaligned stack access (daddr sits at 30 or 34) */
	__u8 hdr[sizeof(struct ethhdr) + 4 + NH_IP_BYTES] __attribute__((aligned(8)));
	__be32 from = st->daddr;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u16 check;
	__u32 sum;

	if (data + L3 + NH_IP_BYTES > end)
		return -1;
	__builtin_memcpy(hdr, data, L3 + NH_IP_BYTES);
	__builtin_memcpy(hdr, nh->dmac, 12);
	__builtin_memcpy(&check, hdr + L3 + IP_CSUM_OFF, sizeof(check));
	sum = (__u16)~check;
	sum += (__u16)~(from & 0xffff) + (__u16)~(from >> 16);
	sum += (daddr & 0xffff) + (daddr >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	check = (__u16)~sum;
	__builtin_memcpy(hdr + L3 + IP_CSUM_OFF, &check, sizeof(check));
	__builtin_memcpy(hdr + L3 + IP_DADDR_OFF, &daddr, sizeof(daddr));
	if (bpf_skb_store_bytes(skb, 0, hdr, L3 + NH_IP_BYTES, 0))
		return -1;
	if (bpf_l4_csum_replace(skb, st->udp_off + UDP_CSUM_OFF, from, daddr,
				BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(daddr)))
		return -1;
	st->daddr = daddr;
	return 0;
}

static __always_inline int rewrite_dest_nh(struct __sk_buff *skb, struct rewrite_state *st,
					   __be32 daddr, const struct bcast_nh *nh)
{
	if (daddr == st->daddr)	/* the MACs only */
		return bpf_skb_store_bytes(skb, 0, nh->dmac, 12, 0) ? -1 : 0;
	if (st->l3_off == sizeof(struct ethhdr))
		return rewrite_dest_nh_at(skb, st, daddr, nh, sizeof(struct ethhdr));
	if (st->l3_off == sizeof(struct ethhdr) + 4)	/* one VLAN tag */
		return rewrite_dest_nh_at(skb, st, daddr, nh, sizeof(struct ethhdr) + 4);
	return -1;
}

/* Replace the 16-bit AGB1 flags+hops word, keeping the UDP checksum right. */
static __always_inline int rewrite_flags_hops(struct __sk_buff *skb, struct rewrite_state *st,
					      __be16 from, __be16 to)
{
	__u32 off = st->udp_off + sizeof(struct udphdr) + AGB1_FLAGS_OFF;

	if (bpf_l4_csum_replace(skb, st->udp_off + UDP_CSUM_OFF, from, to,
				BPF_F_MARK_MANGLED_0 | sizeof(to)))
		return -1;
	return bpf_skb_store_bytes(skb, off, &to, sizeof(to), 0);
}

/* How a copy leaves. */
enum copy_kind {
	COPY_CLONE = 0, /* bpf_clone_redirect a copy; the original stays ours */
	COPY_LAST  = 1, /* the original itself is the copy: returns its verdict */
};

/*
 * The copies of one datagram: where they come from, which destinations get
 * one, the headers as they are now, and what was sent. The one argument of
 * copy_to_member() and send_copy() besides the skb and the destination.
 *
 * Those two are global BPF functions (see send_copy), and the verifier types
 * a global function's pointer argument from BTF as plain memory of the
 * struct's size: only scalars can travel in it (no MAC pointer: the MAC
 * itself), and the caller's stack must be initialised over all of it. So
 * there is no implicit padding (every hole is a named field), and callers
 * memset it before filling it in.
 *
 * The stack: 6.1 refuses a call chain whose frames (each rounded up to 32
 * bytes) sum to more than 512 bytes, and the deepest is aggbox_tc_ingress
 * (256, this struct among it) -> copy_to_member (32) -> send_copy (192) =
 * 480 (send_copy6: 160). What would grow it is kept elsewhere: IPv6
 * addresses and the RESULT route in bcast_scratch, a new cache entry's
 * zero value in read-only data (fib.h), the ingress parse and
 * restore_l2() in global functions of their own.
 */
struct copy_state {
	struct rewrite_state st; /* in/out: the headers as they are now */
	__be32 saddr;            /* source of the copies (FIB source check);
				  * IPv6: bcast_scratch.src */
	__be32 local_addr;       /* this host's address on the datagram;
				  * IPv6: bcast_scratch.local */
	__u32  mask;             /* the destinations (bit i = dests[i]) that get a copy */
	__u16  tot_len;          /* IP datagram length (FIB MTU check) */
	__u8   ingress;          /* running at TC ingress: the original must be
				  * redirected to leave (TC_ACT_OK delivers it) */
	__u8   original_last;    /* 1: the original itself is the copy of the
				  * highest mask bit (egress); 0: every
				  * destination gets a clone (ingress) */
	__u8   has_local_mac;    /* 1: copies for this host go into the hook's
				  * own ingress addressed to local_mac (the
				  * source is remote); 0: through lo (the source
				  * is this host's own address) */
	__u8   local_mac[6];
	__u8   pad;
	__u32  copies;           /* out: copies sent */
	__u32  neigh_misses;     /* out: of which through the neighbour path */
	__u32  neigh_ifindex;    /* where a clone for the neighbour path goes:
				  * an interface whose egress runs
				  * aggbox_tc_egress (neigh_path_ifindex());
				  * 0: the one the FIB names */
};
_Static_assert(sizeof(struct copy_state) == 56, "struct copy_state has implicit padding");

/* A copy could not be rewritten: counted, not sent. */
static __always_inline int copy_rewrite_failed(int kind)
{
	bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
	return kind == COPY_LAST ? TC_ACT_SHOT : -1;
}

/*
 * The end of send_copy() and send_copy6(), either family: the copy,
 * rewritten for its destination (and, when `macs_done`, its next-hop MACs
 * too), leaves: into an ingress for a member on this host (NH_LOCAL),
 * cloned or redirected to the egress the FIB named (NH_OK), or towards the
 * neighbour path (NH_NEIGH). Counts it in cs.
 */
static __always_inline int copy_leave(struct __sk_buff *skb, struct copy_state *cs, int res,
				      struct bcast_nh *nh, int kind, int macs_done)
{
	__u32 hook_ifindex = skb->ifindex;
	__u32 mark;
	int rc;

	if (res == NH_LOCAL) {
		/*
		 * A member on this host: the copy is redirected into an
		 * interface's INGRESS (dev_forward_skb drops the output route
		 * the clone still carries; an egress redirect into lo would
		 * keep it and the stack would discard the packet). At egress
		 * the datagram's source is our own address, which the stack
		 * drops as martian when it arrives on eth0 (accept_local=0):
		 * use lo's ingress, whose MAC is all-zero. At ingress the
		 * source is the remote root: use our own ingress, addressed
		 * to our MAC, exactly like the datagram that just arrived.
		 * Either way the destination MAC makes it PACKET_HOST.
		 */
		__u32 lo_ifindex = cs->has_local_mac ? hook_ifindex : LOOPBACK_IFINDEX_;
		__u64 lo_flags = BPF_F_INGRESS;

		/* nh->dmac is all-zero: nh_resolve() writes MACs for NH_OK only.
		 * (Not a zeroed MAC of its own: the 512-byte chain on 6.1,
		 * see copy_state.) */
		if (bpf_skb_store_bytes(skb, 0, cs->has_local_mac ? cs->local_mac : nh->dmac, 6, 0))
			return copy_rewrite_failed(kind);
		bcast_count(AGGBOX_BCAST_LOCAL_COPY, 0);
		mark = skb->mark;
		skb->mark = AGGBOX_BCAST_MARK_COPY;
		if (kind == COPY_LAST) {
			cs->copies += 1;
			return bpf_redirect(lo_ifindex, lo_flags);
		}
		rc = bpf_clone_redirect(skb, lo_ifindex, lo_flags);
		skb->mark = mark;
		if (rc) {
			bcast_count(AGGBOX_BCAST_CLONE_FAILED, 0);
			return -1;
		}
		cs->copies += 1;
		return 0;
	}
	if (!macs_done) {
		if (res == NH_OK) {
			if (bpf_skb_store_bytes(skb, 0, nh->dmac, 12, 0))
				return copy_rewrite_failed(kind);
		} else {
			/* the neighbour path writes the real MAC; never leave a
			 * multicast one (bpf_redirect_neigh drops those) */
			if (bpf_skb_store_bytes(skb, 0, nh->dmac, 6, 0))	/* all-zero (NH_NEIGH) */
				return copy_rewrite_failed(kind);
		}
	}

	if (kind == COPY_LAST) {
		cs->copies += 1;
		if (res == NH_NEIGH) {
			bcast_count(AGGBOX_BCAST_NEIGH_MISS, 0);
			cs->neigh_misses += 1;
			skb->mark = AGGBOX_BCAST_MARK_DONE;
			return bpf_redirect_neigh(nh->ifindex, NULL, 0, 0);
		}
		bcast_count(AGGBOX_BCAST_COPY_SENT, 0);
		if (nh->ifindex == hook_ifindex && !cs->ingress)
			return TC_ACT_OK;
		skb->mark = AGGBOX_BCAST_MARK_COPY;
		return bpf_redirect(nh->ifindex, 0);
	}

	/* A clone for the neighbour path goes to an egress that runs
	 * aggbox_tc_egress, which hands it to bpf_redirect_neigh() towards the
	 * interface the FIB names (neigh_redirect()): that interface itself
	 * may have none (a forwarder's leaves behind its other interface).
	 * A resolved copy needs no program where it leaves. */
	if (res != NH_OK && cs->neigh_ifindex)
		nh->ifindex = cs->neigh_ifindex;
	mark = skb->mark;
	/* keeps clang from storing through a precomputed skb + offset, which
	 * the verifier rejects ("dereference of modified ctx ptr") */
	asm volatile("" : "+r"(skb));
	skb->mark = res == NH_OK ? AGGBOX_BCAST_MARK_COPY : AGGBOX_BCAST_MARK_NEIGH;
	rc = bpf_clone_redirect(skb, nh->ifindex, 0);
	skb->mark = mark;
	if (rc) {
		bcast_count(AGGBOX_BCAST_CLONE_FAILED, 0);
		return -1;
	}
	cs->copies += 1;
	if (res == NH_OK) {
		bcast_count(AGGBOX_BCAST_COPY_SENT, 0);
	} else {
		bcast_count(AGGBOX_BCAST_NEIGH_MISS, 0);
		cs->neigh_misses += 1;
	}
	return 0;
}

/*
 * Prepare the copy for (daddr, dport) and send it. For COPY_CLONE returns 0
 * when a copy left, -1 otherwise; for COPY_LAST returns the TC verdict of the
 * original. Counts COPY_SENT or NEIGH_MISS per copy sent, failures by kind.
 *
 * A GLOBAL function (non-static, __noinline), on purpose: the verifier checks
 * a global function once, on its own, with arguments it knows nothing about
 * (any skb, any copy_state, any kind), and at each call only checks the
 * arguments. Inlined into the copy loops, its branches (cache hit or FIB,
 * four next-hop outcomes, clone or last, rewrite failures) were explored
 * again for every loop iteration and every combination of earlier outcomes:
 * Linux 6.1, whose state pruning is weaker, gave up on aggbox_tc_egress at
 * the 1M-instruction limit. Packet pointers are invalid after it returns (it
 * rewrites and clones the skb): callers use only skb helpers afterwards.
 * Counts the copy in cs->copies (and cs->neigh_misses) when it left.
 */
__noinline int send_copy(struct __sk_buff *skb, struct copy_state *cs, __be32 daddr,
			 __be16 dport, int kind)
{
	struct bcast_nh nh = {};
	struct rewrite_state *st;
	__be32 local_addr;
	int res;

	if (!cs)	/* a global function's pointer argument may be NULL to the verifier */
		return kind == COPY_LAST ? TC_ACT_SHOT : -1;
	st = &cs->st;
	local_addr = cs->local_addr;
	res = nh_resolve(skb, skb->ifindex, cs->saddr, daddr, cs->tot_len, &nh);
	if (res == NH_LOCAL && daddr != local_addr) {
		/* NOT_FWDED for an address that is not ours on this datagram:
		 * no route (or another local address: not supported) */
		bcast_count(AGGBOX_BCAST_FIB_ERROR, 0);
		res = NH_ERROR;
	}
	if (res == NH_ERROR)
		return kind == COPY_LAST ? TC_ACT_SHOT : -1;

	if (res == NH_OK && dport == st->dport) {
		/* the common copy: Ethernet and IPv4 header in one store */
		if (rewrite_dest_nh(skb, st, daddr, &nh))
			return copy_rewrite_failed(kind);
		return copy_leave(skb, cs, res, &nh, kind, 1);
	}
	if (rewrite_dest(skb, st, daddr, dport))
		return copy_rewrite_failed(kind);
	return copy_leave(skb, cs, res, &nh, kind, 0);
}

/*
 * send_copy() to an IPv6 destination `d` (a group table's, or the parent's
 * in bcast_scratch): the addresses of the datagram, of its copies' source
 * and of this host are in bcast_scratch; the next hop from
 * bpf_fib_lookup(AF_INET6) / the cache; the destination address and the
 * UDP checksum rewritten by rewrite_dest6(); then as send_copy(), the
 * neighbour path (neighbour discovery in the stack) included. A global
 * function of its own: the IPv4 copies' send_copy() and its frame stay
 * as they were, and the verifier checks this one once.
 */
__noinline int send_copy6(struct __sk_buff *skb, struct copy_state *cs,
			  const struct aggbox_group_dest *d, int kind)
{
	struct bcast_nh nh = {};
	struct bcast_scratch *s = scratch();
	int res;

	if (!cs || !d || !s)
		return kind == COPY_LAST ? TC_ACT_SHOT : -1;
	res = nh_resolve6(skb, skb->ifindex, s->src, d->addr, cs->tot_len, &nh);
	if (res == NH_LOCAL && !addr6_eq(d->addr, s->local)) {
		bcast_count(AGGBOX_BCAST_FIB_ERROR, 0);
		res = NH_ERROR;
	}
	if (res == NH_ERROR)
		return kind == COPY_LAST ? TC_ACT_SHOT : -1;
	if (rewrite_dest6(skb, &cs->st, s, d->addr, d->port))
		return copy_rewrite_failed(kind);
	return copy_leave(skb, cs, res, &nh, kind, 0);
}

/* copy_to_member(): go on with the next destination. */
#define COPY_NEXT (-1)
/* copy_to_member(): no destination left after this one (clones only). */
#define COPY_END  (-2)

/*
 * One iteration of the copy loops: destination i of group table `g` gets its
 * copy if bit i of cs->mask is set. Returns COPY_NEXT to go on, COPY_END when
 * no higher bit is left, or, when cs->original_last and i is the highest
 * bit, the verdict of the original, which became that copy.
 *
 * Global for the same reason as send_copy(), and it holds the loop's
 * branches too (mask bit, last bit, copy sent or not): the loops in the
 * programs are then one call and one test per iteration. A loop body with a
 * few branches and no state worth keeping is what 6.1's verifier handles
 * worst: inside a loop it records a state for pruning only every 20 jumps or
 * 100 instructions, so every combination of outcomes between two records is
 * walked separately. It rejected aggbox_tc_egress (1M instructions) with
 * send_copy() global but these branches still in the loop.
 */
__noinline int copy_to_member(struct __sk_buff *skb, struct copy_state *cs,
			      const struct aggbox_group *g, __u32 i)
{
	__u32 rest;

	if (!cs || !g || i >= AGGBOX_BCAST_MAX_DESTS)
		return COPY_END;
	if (!(cs->mask & (1u << i)))
		return COPY_NEXT;
	rest = i == 31 ? 0 : cs->mask >> (i + 1);
	if (cs->st.family == AGGBOX_FAMILY_IPV6) {
		if (!rest && cs->original_last)
			return send_copy6(skb, cs, &g->dests[i], COPY_LAST);
		send_copy6(skb, cs, &g->dests[i], COPY_CLONE);
		return rest ? COPY_NEXT : COPY_END;
	}
	if (!rest && cs->original_last)
		return send_copy(skb, cs, g->dests[i].addr[0], g->dests[i].port, COPY_LAST);
	send_copy(skb, cs, g->dests[i].addr[0], g->dests[i].port, COPY_CLONE);
	return rest ? COPY_NEXT : COPY_END;
}

/* The mask naming every destination of a table of `count`. */
static __always_inline __u32 members_mask(__u32 count)
{
	return count >= 32 ? ~0u : (1u << count) - 1;
}

static __always_inline void group_count(struct aggbox_group_key *key, __u32 copies,
					__u32 neigh_misses, __u32 bytes)
{
	struct aggbox_bcast_group_stat *gs = bpf_map_lookup_elem(&bcast_gstats, key);

	if (!gs)
		return;
	gs->datagrams += 1;
	gs->copies += copies;
	gs->neigh_misses += neigh_misses;
	gs->bytes += bytes;
}

/*
 * The interface whose egress runs aggbox_tc_egress, for copies that take
 * the neighbour path (copy_state.neigh_ifindex): the hook's own, but for lo
 * (attach puts only the ingress program there: RESULTs completed through
 * lo), where it is the attached interface bcast_config names (0 when none:
 * the interface the FIB names, as before). Global, like send_copy(), so
 * that its map key does not add to the ingress program's frame, which 6.1
 * sums with copy_to_member()'s and send_copy()'s against 512 bytes.
 */
__noinline __u32 neigh_path_ifindex(struct __sk_buff *skb)
{
	struct aggbox_bcast_config *cfg;
	__u32 ifindex = skb->ifindex;
	__u32 zero = 0;

	if (ifindex != LOOPBACK_IFINDEX_)
		return ifindex;
	cfg = bpf_map_lookup_elem(&bcast_config, &zero);
	return cfg ? cfg->egress_ifindex : 0;
}

/*
 * A copy that came back with MARK_NEIGH: send_copy() cloned it to this
 * egress hook because its next hop was unresolved. Hand it to
 * bpf_redirect_neigh() (the stack routes it, creates the neighbour entry,
 * sends the ARP request, or the IPv6 neighbour solicitation, and holds it
 * until the reply) on the interface the
 * FIB names for its destination, which need not be this one: a
 * forwarder's leaves behind another interface, which has no AggBox program
 * (and need none). The lookup is made from this interface, like
 * send_copy()'s; without an answer the copy goes out by this interface.
 * No MTU check (tot_len 0 checks the skb against the egress device's MTU;
 * send_copy()'s lookup checked it already). Marked DONE first: the
 * neighbour path transmits it through an egress hook once more.
 *
 * Global, verified once on a frame of its own: its lookup struct does not
 * add to aggbox_tc_egress's frame, which 6.1 sums with copy_to_member()'s
 * and send_copy()'s against 512 bytes.
 */
__noinline int neigh_redirect(struct __sk_buff *skb)
{
	struct bpf_fib_lookup fib = {};
	union {
		struct iphdr v4;
		struct ipv6hdr v6;
	} ip;
	__u32 ifindex = skb->ifindex;
	__u32 proto = skb->protocol; /* read once: see copy_leave()'s asm */
	int rc;

	skb->mark = AGGBOX_BCAST_MARK_DONE;
	if (proto == bpf_htons(ETH_P_IP) &&
	    !bpf_skb_load_bytes(skb, sizeof(struct ethhdr), &ip.v4, sizeof(ip.v4))) {
		fib.family = AF_INET_;
		fib.l4_protocol = ip.v4.protocol;
		fib.ipv4_src = ip.v4.saddr;
		fib.ipv4_dst = ip.v4.daddr;
	} else if (proto == bpf_htons(ETH_P_IPV6) &&
		   !bpf_skb_load_bytes(skb, sizeof(struct ethhdr), &ip.v6, sizeof(ip.v6))) {
		fib.family = AF_INET6_;
		fib.l4_protocol = ip.v6.nexthdr;
		__builtin_memcpy(fib.ipv6_src, &ip.v6.saddr, sizeof(fib.ipv6_src));
		__builtin_memcpy(fib.ipv6_dst, &ip.v6.daddr, sizeof(fib.ipv6_dst));
	}
	if (fib.family) {
		fib.ifindex = ifindex;
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
		if ((rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) && fib.ifindex)
			ifindex = fib.ifindex;
	}
	return bpf_redirect_neigh(ifindex, NULL, 0, 0);
}

/* A copy of ours coming back through the egress hook. */
static __always_inline int own_copy_egress(struct __sk_buff *skb, __u32 mark)
{
	if (mark == AGGBOX_BCAST_MARK_NEIGH)
		return bcast_exit(AGGBOX_BCAST_OWN_COPY, 0, neigh_redirect(skb));
	return bcast_exit(AGGBOX_BCAST_OWN_COPY, 0, TC_ACT_OK);
}

static __always_inline int is_own_mark(__u32 mark)
{
	return mark == AGGBOX_BCAST_MARK_COPY || mark == AGGBOX_BCAST_MARK_NEIGH ||
	       mark == AGGBOX_BCAST_MARK_DONE;
}

SEC("tc")
int aggbox_tc_egress(struct __sk_buff *skb)
{
	struct aggbox_group_key key = {};
	struct copy_state cs;
	struct aggbox_group *g;
	struct agb1_pkt p = {};
	struct bcast_scratch *s;
	__u32 eff, count;
	int code, verdict = TC_ACT_SHOT;
	__u32 mark = skb->mark;

	if (is_own_mark(mark))
		return own_copy_egress(skb, mark);

	s = scratch();
	code = parse_agb1(skb, &p, s);
	if (code < 0)
		return bcast_exit(AGGBOX_BCAST_NOT_AGGBOX, 0, TC_ACT_OK);
	if (code > 0)
		return bcast_exit(code, 0, TC_ACT_OK);

	key.group = p.group;
	key.port = AGGBOX_BCAST_PORT_ANY;
	g = bpf_map_lookup_elem(&bcast_groups, &key);
	if (!g)
		return bcast_exit(AGGBOX_BCAST_UNKNOWN_GROUP, p.payload_len, TC_ACT_OK);
	if (g->dests[0].family != p.family)
		return bcast_exit(AGGBOX_BCAST_FAMILY_MISMATCH, p.payload_len, TC_ACT_SHOT);

	count = g->count;
	if (count > AGGBOX_BCAST_MAX_DESTS)
		count = AGGBOX_BCAST_MAX_DESTS;
	eff = p.mask & members_mask(count);
	if (!eff)
		return bcast_exit(AGGBOX_BCAST_EMPTY_MASK, p.payload_len, TC_ACT_SHOT);

	/* all of it initialised: send_copy() is a global function (see there) */
	__builtin_memset(&cs, 0, sizeof(cs));
	cs.st.l3_off = p.l3_off;
	cs.st.udp_off = p.udp_off;
	cs.st.saddr = p.saddr;
	cs.st.daddr = p.daddr;
	cs.st.dport = p.dport;
	cs.st.family = p.family;
	/* egress: copies for this host go through lo (our own source) */
	cs.saddr = p.saddr;
	cs.tot_len = p.tot_len;
	cs.local_addr = p.saddr;
	if (p.family == AGGBOX_FAMILY_IPV6 && s) {
		__builtin_memcpy(s->src, s->orig_saddr, 16);
		__builtin_memcpy(s->local, s->orig_saddr, 16);
	}
	/* the original becomes the copy of the highest bit (eff is not 0: the
	 * loop always ends with its verdict) */
	cs.mask = eff;
	cs.original_last = 1;
	/* this hook's egress runs this program: clones for the neighbour path
	 * come back here */
	cs.neigh_ifindex = skb->ifindex;

	for (__u32 i = 0; i < AGGBOX_BCAST_MAX_DESTS; i++) {
		verdict = copy_to_member(skb, &cs, g, i);
		if (verdict != COPY_NEXT)
			break;
	}
	if (verdict < 0)	/* COPY_END: cannot happen with original_last */
		verdict = TC_ACT_SHOT;

	group_count(&key, cs.copies, cs.neigh_misses, p.payload_len);
	return bcast_exit(AGGBOX_BCAST_BROADCAST, p.payload_len, verdict);
}

/*
 * Route one RESULT of the XDP aggregator (see the file comment and
 * docs/BROADCAST.md). The copies and the upstream contribution carry this
 * node's address (the RESULT's destination) as source; everything else
 * of a copy but destination address, port and MACs is the RESULT as it came.
 * Either family: an IPv6 RESULT's addresses are in `s` (parse_agg_result),
 * and its group table and parent must be IPv6 too (else FAMILY_MISMATCH).
 * The route is read once into `s` (not the stack: see copy_state).
 */
static __always_inline int route_result(struct __sk_buff *skb, struct agg_result *r,
					struct bcast_scratch *s)
{
	struct aggbox_job_key jk = { .job = r->job };
	struct aggbox_group_key gkey = {};
	struct aggbox_result_route *route;
	struct copy_state cs;
	struct aggbox_group *g = NULL;
	int verdict, six = r->family == AGGBOX_FAMILY_IPV6;
	__u32 flags;

	route = bpf_map_lookup_elem(&result_routes, &jk);
	/* only RESULTs for this host, at the job's result port, are routed */
	if (!route || !s || route->result_port != bpf_ntohs(r->dport) || skb->pkt_type != PACKET_HOST_)
		return bcast_exit(AGGBOX_BCAST_NOT_AGGBOX, 0, TC_ACT_OK);
	__builtin_memcpy(&s->route, route, sizeof(s->route));
	flags = s->route.flags;
	if (flags & AGGBOX_ROUTE_F_GROUP) {
		gkey.group = s->route.group;
		gkey.port = AGGBOX_BCAST_PORT_ANY;
		g = bpf_map_lookup_elem(&bcast_groups, &gkey);
	}
	if (!g && !(flags & AGGBOX_ROUTE_F_PARENT))
		/* group table not written (yet): local delivery only */
		return bcast_exit(AGGBOX_BCAST_RESULT_BROADCAST, r->payload_len, TC_ACT_OK);
	if ((g && g->dests[0].family != r->family) ||
	    ((flags & AGGBOX_ROUTE_F_PARENT) && s->route.parent_family != r->family))
		return bcast_exit(AGGBOX_BCAST_FAMILY_MISMATCH, r->payload_len, TC_ACT_SHOT);

	/* all of it initialised: send_copy() is a global function (see there) */
	__builtin_memset(&cs, 0, sizeof(cs));
	cs.st.l3_off = r->l3_off;
	cs.st.udp_off = r->udp_off;
	cs.st.saddr = r->saddr;
	cs.st.daddr = r->daddr;
	cs.st.dport = r->dport;
	cs.st.family = r->family;
	/* the source is now our own address: copies for this host go through lo */
	cs.saddr = r->daddr;
	cs.tot_len = r->tot_len;
	cs.ingress = 1;
	cs.has_local_mac = 0;
	cs.local_addr = r->daddr;
	cs.neigh_ifindex = neigh_path_ifindex(skb);

	if (six) {
		__builtin_memcpy(s->src, s->orig_daddr, 16);
		__builtin_memcpy(s->local, s->orig_daddr, 16);
	}
	if (six ? rewrite_src6(skb, &cs.st, s, s->orig_daddr) : rewrite_src(skb, &cs.st, r->daddr)) {
		bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
		return bcast_exit((flags & AGGBOX_ROUTE_F_PARENT) ? AGGBOX_BCAST_RESULT_UPSTREAM
								  : AGGBOX_BCAST_RESULT_BROADCAST,
				  r->payload_len, TC_ACT_SHOT);
	}

	if (g) {
		/* allreduce: the mask covers all members, each gets a clone */
		cs.mask = members_mask(g->count);
		for (__u32 i = 0; i < AGGBOX_BCAST_MAX_DESTS; i++) {
			if (copy_to_member(skb, &cs, g, i) != COPY_NEXT)
				break;
		}
		group_count(&gkey, cs.copies, cs.neigh_misses, r->payload_len);
	}

	if (flags & AGGBOX_ROUTE_F_PARENT) {
		/*
		 * Tree of aggregators: the original becomes this node's
		 * contribution to the parent's job: job, rank, flags without
		 * RESULT (LAST_FRAGMENT and OVERFLOW kept); seq, round,
		 * frag_off, op, count and payload unchanged. It leaves by the
		 * interface the FIB names and is not delivered locally.
		 */
		__be16 job_be = bpf_htons(s->route.parent_job);
		__be16 rank_be = bpf_htons(s->route.parent_rank);
		__u8 op_flags[2] = { r->op, r->flags & (__u8)~AGGBOX_AGG_F_RESULT };
		__u32 agg_off = cs.st.udp_off + sizeof(struct udphdr);
		__u32 job_rank;
		__u16 new_op_flags;

		__builtin_memcpy(&job_rank, &job_be, 2);
		__builtin_memcpy((__u8 *)&job_rank + 2, &rank_be, 2);
		__builtin_memcpy(&new_op_flags, op_flags, 2);
		if (bpf_l4_csum_replace(skb, cs.st.udp_off + UDP_CSUM_OFF, r->job_rank, job_rank,
					BPF_F_MARK_MANGLED_0 | sizeof(job_rank)) ||
		    bpf_skb_store_bytes(skb, agg_off + AGG1_JOB_OFF, &job_rank, sizeof(job_rank), 0) ||
		    bpf_l4_csum_replace(skb, cs.st.udp_off + UDP_CSUM_OFF, r->op_flags, new_op_flags,
					BPF_F_MARK_MANGLED_0 | sizeof(new_op_flags)) ||
		    bpf_skb_store_bytes(skb, agg_off + AGG1_OP_OFF, &new_op_flags,
					sizeof(new_op_flags), 0)) {
			bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
			return bcast_exit(AGGBOX_BCAST_RESULT_UPSTREAM, r->payload_len, TC_ACT_SHOT);
		}
		if (six) {
			s->parent.family = AGGBOX_FAMILY_IPV6;
			s->parent.port = s->route.parent_port;
			__builtin_memcpy(s->parent.addr, s->route.parent_addr, 16);
			verdict = send_copy6(skb, &cs, &s->parent, COPY_LAST);
		} else {
			verdict = send_copy(skb, &cs, s->route.parent_addr[0], s->route.parent_port,
					    COPY_LAST);
		}
		return bcast_exit(AGGBOX_BCAST_RESULT_UPSTREAM, r->payload_len, verdict);
	}

	/* back to the RESULT as it arrived, for the local application */
	if (restore_addrs(skb, &cs.st, s, r->saddr, r->daddr, r->dport) ||
	    bpf_skb_store_bytes(skb, 0, r->macs, sizeof(r->macs), 0)) {
		bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
		return bcast_exit(AGGBOX_BCAST_RESULT_BROADCAST, r->payload_len, TC_ACT_SHOT);
	}
	return bcast_exit(AGGBOX_BCAST_RESULT_BROADCAST, r->payload_len, TC_ACT_OK);
}

/*
 * Generic (skb-mode) XDP can hand this hook an skb without its link-layer
 * header: the data starts at the IPv4 header (6.18). Generic XDP copies
 * every skb that is cloned, nonlinear or has less than 256 bytes of
 * headroom (on veth and most drivers: every skb) into a new one whose MAC
 * header length is 0, and that length is what the TC hook pushes back
 * before running the program. `aggbox attach` runs generic XDP on lo (a
 * worker on the host) and on IFACE when the driver has no native XDP:
 * without the header, the parser would count every AGB1 datagram and
 * RESULT there "not AggBox" (delivered locally, never forwarded or
 * routed), and no copy could leave by an Ethernet device
 * (bpf_clone_redirect wants a MAC header).
 *
 * For an AGB1 datagram or an AGG1 RESULT, over IPv4 or IPv6, the Ethernet
 * header is put back (bpf_skb_change_head, which also sets the MAC header
 * and its length, so the stack's pull after this program leaves the
 * datagram as it was for local delivery): the Ethernet header the skb
 * still records at its MAC header when that is one of the datagram's IP
 * version right before its IP header (the frame's own), else zeros (lo's).
 * Everything else is left alone. Returns 0 when the skb now starts with an
 * Ethernet header (pushed or already there), -1 when it is something else
 * without one.
 *
 * Global, verified once on a frame of its own: its header buffers do not
 * add to aggbox_tc_ingress's frame (the 512-byte chain on 6.1).
 */
__noinline int restore_l2(struct __sk_buff *skb)
{
	union {
		struct iphdr v4;
		struct ipv6hdr v6;
	} ip;
	struct {
		struct udphdr udp;
		struct aggbox_agg_hdr agg;
	} h;
	struct ethhdr eth = {};
	__u32 at_data, at_net, l4_off;
	__be16 proto;

	/* With its Ethernet header, the skb's first bytes are a destination
	 * MAC, not the IP header's: the data starts at the network header
	 * exactly when both read the same. (A unicast MAC never starts with
	 * 0x45, the first byte of an IPv4 header without options.) */
	if (bpf_skb_load_bytes(skb, 0, &at_data, sizeof(at_data)) ||
	    bpf_skb_load_bytes_relative(skb, 0, &at_net, sizeof(at_net), BPF_HDR_START_NET) ||
	    at_data != at_net)
		return 0;
	/* IPv4 without options (the XDP program takes only those, parse.h),
	 * or IPv6 with UDP right after its fixed header */
	if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip.v4)))
		return -1;
	if (ip.v4.version == 4) {
		if (ip.v4.ihl != 5 || ip.v4.protocol != IPPROTO_UDP_)
			return -1;
		l4_off = sizeof(ip.v4);
		proto = bpf_htons(ETH_P_IP);
	} else if (ip.v4.version == 6) {
		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip.v6)) || ip.v6.nexthdr != IPPROTO_UDP_)
			return -1;
		l4_off = sizeof(ip.v6);
		proto = bpf_htons(ETH_P_IPV6);
	} else {
		return -1;
	}
	/* the AGB1 magic is where the AGG1 magic is */
	if (bpf_skb_load_bytes(skb, l4_off, &h, sizeof(h.udp) + sizeof(h.agg.magic)))
		return -1;
	if (h.agg.magic != bpf_htonl(AGGBOX_MAGIC_BCAST)) {
		if (h.agg.magic != bpf_htonl(AGGBOX_MAGIC_AGG) || bpf_skb_load_bytes(skb, l4_off, &h, sizeof(h)) ||
		    h.agg.rank != bpf_htons(AGGBOX_RESULT_RANK) || !(h.agg.flags & AGGBOX_AGG_F_RESULT))
			return -1;
	}
	/* the recorded MAC header is an Ethernet header right before the
	 * IP one (at_data: reused for the bytes after it) */
	if (bpf_skb_load_bytes_relative(skb, 0, &eth, sizeof(eth), BPF_HDR_START_MAC) ||
	    bpf_skb_load_bytes_relative(skb, sizeof(eth), &at_data, sizeof(at_data), BPF_HDR_START_MAC) ||
	    at_data != at_net || eth.h_proto != proto) {
		__builtin_memset(&eth, 0, sizeof(eth));
		eth.h_proto = proto;
	}
	if (bpf_skb_change_head(skb, sizeof(eth), 0) ||
	    bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0))
		return -1;
	return 0;
}

/* ingress_parse(): an AGG1 RESULT, `r` filled. */
#define INGRESS_RESULT 0x100

/*
 * What aggbox_tc_ingress sees: an AGB1 datagram (0 with `p` filled, or the
 * stat code of a malformed one, as parse_agb1_view()), an AGG1 RESULT
 * (INGRESS_RESULT with `r` filled, as parse_agg_result()), or anything else
 * (-1). An IPv6 datagram's addresses go to bcast_scratch.
 *
 * Global, verified once on a frame of its own: the parse keeps many values
 * alive at once, and their spills do not add to the ingress program's
 * frame (the 512-byte chain on 6.1, see copy_state). Packet pointers do
 * not survive it (it may pull the headers into the linear area): the
 * program uses skb helpers only afterwards.
 */
__noinline int ingress_parse(struct __sk_buff *skb, struct agb1_pkt *p, struct agg_result *r)
{
	struct bcast_scratch *s = scratch();
	struct udp_view v = {};
	int code;

	if (!p || !r || parse_udp(skb, &v))
		return -1;
	code = parse_agb1_view(skb, &v, p, s);
	if (code >= 0)
		return code;
	if (parse_agg_result(skb, &v, r, s))
		return -1;
	return INGRESS_RESULT;
}

SEC("tc")
int aggbox_tc_ingress(struct __sk_buff *skb)
{
	struct aggbox_group_key key = {};
	struct copy_state cs;
	struct aggbox_group *g;
	struct agb1_pkt p = {};
	struct agg_result r = {};
	struct bcast_scratch *s;
	__be16 word, fwd_word;
	int code;

	if (is_own_mark(skb->mark))
		return bcast_exit(AGGBOX_BCAST_OWN_COPY, 0, TC_ACT_OK);

	if (restore_l2(skb))
		return bcast_exit(AGGBOX_BCAST_NOT_AGGBOX, 0, TC_ACT_OK);
	code = ingress_parse(skb, &p, &r);
	if (code == INGRESS_RESULT)
		return route_result(skb, &r, scratch());
	if (code < 0)
		return bcast_exit(AGGBOX_BCAST_NOT_AGGBOX, 0, TC_ACT_OK);
	if (code > 0)
		return bcast_exit(code, 0, TC_ACT_OK);
	s = scratch();

	key.group = p.group;
	key.port = bpf_ntohs(p.dport);
	g = bpf_map_lookup_elem(&bcast_groups, &key);
	if (!g) {
		key.port = AGGBOX_BCAST_PORT_ANY;
		g = bpf_map_lookup_elem(&bcast_groups, &key);
	}
	if (!g)
		return bcast_exit(AGGBOX_BCAST_UNKNOWN_GROUP, p.payload_len, TC_ACT_OK);
	/* a bridge floods unknown unicast: only datagrams for this host count */
	if (!(p.flags & AGGBOX_BCAST_F_FORWARD) || skb->pkt_type != PACKET_HOST_)
		return bcast_exit(AGGBOX_BCAST_LOCAL_ONLY, p.payload_len, TC_ACT_OK);
	if (p.hops >= AGGBOX_BCAST_MAX_HOPS)
		return bcast_exit(AGGBOX_BCAST_HOPS_LIMIT, p.payload_len, TC_ACT_OK);
	if (g->dests[0].family != p.family)
		return bcast_exit(AGGBOX_BCAST_FAMILY_MISMATCH, p.payload_len, TC_ACT_SHOT);

	/* all of it initialised: send_copy() is a global function (see there) */
	__builtin_memset(&cs, 0, sizeof(cs));
	cs.st.l3_off = p.l3_off;
	cs.st.udp_off = p.udp_off;
	cs.st.saddr = p.saddr;
	cs.st.daddr = p.daddr;
	cs.st.dport = p.dport;
	cs.st.family = p.family;
	/* ingress: the arriving frame was addressed to our MAC, its source is
	 * the remote root: copies for this host go into our own ingress */
	cs.saddr = p.saddr;
	cs.tot_len = p.tot_len;
	cs.ingress = 1;
	cs.has_local_mac = 1;
	__builtin_memcpy(cs.local_mac, p.macs, 6);
	cs.local_addr = p.daddr;
	cs.neigh_ifindex = neigh_path_ifindex(skb);
	if (p.family == AGGBOX_FAMILY_IPV6 && s) {
		__builtin_memcpy(s->src, s->orig_saddr, 16);
		__builtin_memcpy(s->local, s->orig_daddr, 16);
	}

	/* children see hops + 1; every other byte of the AGB1 header unchanged */
	word = bpf_htons(((__u16)p.flags << 8) | p.hops);
	fwd_word = bpf_htons(((__u16)p.flags << 8) | (__u8)(p.hops + 1));
	if (rewrite_flags_hops(skb, &cs.st, word, fwd_word)) {
		bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
		return bcast_exit(AGGBOX_BCAST_LOCAL_ONLY, p.payload_len, TC_ACT_SHOT);
	}

	/* every destination of the table gets a clone */
	cs.mask = members_mask(g->count);
	for (__u32 i = 0; i < AGGBOX_BCAST_MAX_DESTS; i++) {
		if (copy_to_member(skb, &cs, g, i) != COPY_NEXT)
			break;
	}

	/* back to the datagram as it arrived, for local delivery */
	if (restore_addrs(skb, &cs.st, s, p.saddr, p.daddr, p.dport) ||
	    rewrite_flags_hops(skb, &cs.st, fwd_word, word) ||
	    bpf_skb_store_bytes(skb, 0, p.macs, sizeof(p.macs), 0)) {
		bcast_count(AGGBOX_BCAST_REWRITE_FAILED, 0);
		return bcast_exit(AGGBOX_BCAST_FORWARDED, p.payload_len, TC_ACT_SHOT);
	}

	group_count(&key, cs.copies, cs.neigh_misses, p.payload_len);
	return bcast_exit(AGGBOX_BCAST_FORWARDED, p.payload_len, TC_ACT_OK);
}
