/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The full UDP checksum of an IPv6 datagram an XDP program rewrote in
 * place: one rule, used by the aggregation chain (aggbox_xdp.bpf.c, an IPv6
 * RESULT) and by the ring program (aggbox_ring.bpf.c, an IPv6 PARTIAL or
 * FINAL sent on). IPv4 datagrams these programs rewrite carry checksum 0
 * (no checksum); IPv6 has no such value (RFC 8200 section 8.1: the
 * receiving stack drops a UDP datagram with checksum 0), so once every
 * other byte of the datagram is final, the program sums it, pseudo-header
 * included: a pass over the datagram, for IPv6 only.
 *
 * Each object has its own maps: the includer defines UDP_CSUM_SCRATCH as
 * the type of its per-CPU scratch value, which holds at least
 *   __u64  csum;        the running (unfolded) one's-complement sum
 *   __u32  csum_words;  the UDP length in 4-byte words
 *   __u16  ip_off;      offset of the IPv6 header from ctx->data (< 256)
 *   __u16  udp_off;     offset of the UDP header from ctx->data (< 256)
 *   buf                 CSUM_PIECE bytes at least, 8-aligned
 * and calls udp6_csum_write() from a global function of its own (verified
 * once, not once per caller state: docs/DATAPLANE.md "Verifier cost").
 */
#ifndef AGGBOX_UDP_CSUM_H
#define AGGBOX_UDP_CSUM_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "aggbox/abi.h"
#include "parse.h"

#ifndef UDP_CSUM_SCRATCH
#error "define UDP_CSUM_SCRATCH (the includer's per-CPU scratch type) before including udp_csum.h"
#endif

/* Bytes one bpf_csum_diff call sums at most (the kernel's scratch buffer). */
#define CSUM_PIECE 512
/* Whole pieces of the longest datagram each chain takes. */
#define CSUM_PIECES_FRAGS (0x10000 / CSUM_PIECE)
#define CSUM_PIECES_LINEAR (AGGBOX_LINEAR_MAX_FRAME / CSUM_PIECE + 1)

/* A header offset read from scratch, bounded with a mask in the register
 * that offsets the packet pointer (no branch: no second verifier path; 6.1
 * keeps a bound only on the compared register). */
#define CSUM_BOUNDED_OFF(var, field)          \
	do {                                  \
		var = (field);                \
		asm volatile("" : "+r"(var)); \
		var &= 0xff;                  \
		asm volatile("" : "+r"(var)); \
	} while (0)

/*
 * The one's-complement sum (unfolded, added into s->csum) of the
 * s->csum_words 4-byte words from the UDP header on: whole CSUM_PIECE
 * byte pieces with bpf_csum_diff (the kernel's csum_partial), straight from
 * the packet in the linear chain, through s->buf with bpf_xdp_load_bytes
 * in the frags chain (a multi-buffer frame's datagram runs on into its
 * fragments); then the rest, < CSUM_PIECE bytes: the same way in the
 * frags chain, 8 bytes at a time from the packet in the linear one. Counts
 * and offsets are read from scratch at each step and the sum is kept
 * there, so every exit of a loop reaches what follows in one verifier
 * state. 0, or -1 when the frame is shorter (a validated length: never).
 */
static __always_inline int udp_sum(struct xdp_md *ctx, UDP_CSUM_SCRATCH *s, const int linear)
{
	const __u32 pieces = linear ? CSUM_PIECES_LINEAR : CSUM_PIECES_FRAGS;
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	__u32 i, off, base, rest, n;
	void *p;
	long r;

	CSUM_BOUNDED_OFF(base, s->udp_off);
	s->csum = 0;
	for (i = 0; i < pieces; i++) {
		if (i >= *(volatile __u32 *)&s->csum_words / (CSUM_PIECE / 4))
			break;
		off = base + i * CSUM_PIECE;
		if (linear) {
			p = data + off;
			if (p + CSUM_PIECE > data_end)
				return -1;
			r = bpf_csum_diff(NULL, 0, p, CSUM_PIECE, 0);
		} else {
			if (bpf_xdp_load_bytes(ctx, off, s->buf, CSUM_PIECE))
				return -1;
			r = bpf_csum_diff(NULL, 0, (void *)s->buf, CSUM_PIECE, 0);
		}
		if (r < 0)
			return -1;
		s->csum += (__u32)r;
	}

	/* The rest: its offset and length from scratch again. */
	n = *(volatile __u32 *)&s->csum_words;
	rest = 4 * (n % (CSUM_PIECE / 4));
	off = n / (CSUM_PIECE / 4) * CSUM_PIECE;
	asm volatile("" : "+r"(off));
	if (off > pieces * CSUM_PIECE)
		return -1;
	off += base;
	if (!rest)
		return 0;
	if (!linear) {
		asm volatile("" : "+r"(rest));
		if (rest < 4 || rest > CSUM_PIECE - 4)
			return -1;
		if (bpf_xdp_load_bytes(ctx, off, s->buf, rest))
			return -1;
		r = bpf_csum_diff(NULL, 0, (void *)s->buf, rest, 0);
		if (r < 0)
			return -1;
		s->csum += (__u32)r;
		return 0;
	}
	p = data + off;
	for (i = 0; i < CSUM_PIECE / 8; i++) {
		if (8 * i + 8 > *(volatile __u32 *)&s->csum_words % (CSUM_PIECE / 4) * 4)
			break;
		if (p + 8 > data_end)
			return -1;
		s->csum += *(__u32 *)p + (__u64) * (__u32 *)(p + 4);
		p += 8;
	}
	/* An odd word count's last word. */
	if (*(volatile __u32 *)&s->csum_words & 1) {
		p = data + off + (rest & ~7u);
		if (p + 4 > data_end)
			return -1;
		s->csum += *(__u32 *)p;
	}
	return 0;
}

/* A one's-complement sum folded to the 16 bits of a checksum field. */
static __always_inline __u16 csum_fold64(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/*
 * Write the UDP checksum of the IPv6 datagram this packet now is (headers
 * at s->ip_off and s->udp_off): the pseudo-header (source, destination,
 * UDP length, next header 17) and the datagram with its checksum field 0,
 * summed in the packet's byte order (the fold of a one's-complement sum of
 * native words is the checksum's bytes as they sit in the packet: RFC 1071
 * 2(B)). A computed 0 is sent as 0xffff. `min_len`: the shortest UDP
 * length the caller's datagram can have (its header included). Returns 0,
 * or -1 when the headers or the datagram are not where scratch says, or
 * the UDP length is below min_len or not a whole number of 4-byte words
 * (never, for a datagram the caller validated).
 */
static __always_inline int udp6_csum_write(struct xdp_md *ctx, UDP_CSUM_SCRATCH *s, const __u32 min_len,
					   const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct ipv6hdr *ip6h;
	struct udphdr *udph;
	__u32 ip_off, udp_off, ulen, i;
	__u64 sum;
	__u16 check;

	CSUM_BOUNDED_OFF(udp_off, s->udp_off);
	udph = data + udp_off;
	if ((void *)(udph + 1) > data_end)
		return -1;
	ulen = bpf_ntohs(udph->len);
	if (ulen < min_len || (ulen & 3))
		return -1;
	udph->check = 0;
	s->csum_words = ulen / 4;
	if (udp_sum(ctx, s, linear))
		return -1;

	/* The packet pointers again: the calls above may have moved them. */
	data_end = (void *)(long)ctx->data_end;
	data = (void *)(long)ctx->data;
	CSUM_BOUNDED_OFF(ip_off, s->ip_off);
	CSUM_BOUNDED_OFF(udp_off, s->udp_off);
	ip6h = data + ip_off;
	udph = data + udp_off;
	if ((void *)(ip6h + 1) > data_end || (void *)(udph + 1) > data_end)
		return -1;
	sum = s->csum + (__u64)bpf_htonl(ulen) + bpf_htonl(IPPROTO_UDP_);
#pragma unroll
	for (i = 0; i < 4; i++)
		sum += (__u64)ip6h->saddr.in6_u.u6_addr32[i] + ip6h->daddr.in6_u.u6_addr32[i];
	check = ~csum_fold64(sum);
	udph->check = check ? check : 0xffff;
	return 0;
}

#endif /* AGGBOX_UDP_CSUM_H */
