/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet parsing helpers in the style of xdp-tools' parsing_helpers.h: a
 * cursor (`struct hdr_cursor`) that points at the next header, and small
 * `parse_*()` helpers that bounds-check against data_end before every access,
 * advance the cursor and return the next protocol (host order) or a negative
 * code. Nothing here writes to the packet.
 *
 * Its twin in Rust is src/wire/frame.rs (parse_frame), which reads the frames
 * the AF_XDP path receives: one VLAN tag at most, IPv4 with IHL honoured or
 * IPv6 without extension headers, the UDP payload length from the UDP
 * header. A change to what is parsed here is a change there.
 */
#ifndef AGGBOX_PARSE_H
#define AGGBOX_PARSE_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ETH_P_IP     0x0800
#define ETH_P_IPV6   0x86DD
#define ETH_P_8021Q  0x8100
#define ETH_P_8021AD 0x88A8
#define IPPROTO_UDP_ 17 /* vmlinux.h has IPPROTO_UDP as an enum; keep ours distinct */

#define IP_MF     0x2000
#define IP_OFFSET 0x1fff

/* IPv6 Next Header values of the extension headers parse_ip6_ext() walks
 * (RFC 8200 section 4), and the offset bits of a Fragment header's
 * frag_off (host order). */
#define IP6_NEXT_HOPOPTS  0
#define IP6_NEXT_ROUTING  43
#define IP6_NEXT_FRAGMENT 44
#define IP6_NEXT_DSTOPTS  60
#define IP6_OFFSET        0xfff8

/* Extension headers parse_ip6_ext() follows before it gives up: RFC 8200's
 * recommended order has at most five of its four kinds (destination options
 * twice); more than this is no AggBox sender's. */
#ifndef AGGBOX_IPV6_MAX_EXT
#define AGGBOX_IPV6_MAX_EXT 5
#endif

/* What parse_ip6_ext() found before the upper-layer header. */
#define IP6_EXT_F_FRAGMENT 0x1 /* a Fragment header (first fragment, or atomic) */
#define IP6_EXT_F_OTHER    0x2 /* hop-by-hop, routing or destination options */

/* Returned by the parse helpers when a header does not fit in the frame. */
#define PARSE_TOO_SHORT (-1)

/* Where the next header starts. */
struct hdr_cursor {
	void *pos;
};

static __always_inline int proto_is_vlan(__u16 h_proto_host)
{
	return h_proto_host == ETH_P_8021Q || h_proto_host == ETH_P_8021AD;
}

/*
 * Ethernet header plus at most one VLAN tag (802.1Q or 802.1ad).
 * Returns the encapsulated EtherType in host order.
 */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end,
					struct ethhdr **ethhdr)
{
	struct ethhdr *eth = nh->pos;
	struct vlan_hdr *vlh;
	__u16 h_proto;

	if ((void *)(eth + 1) > data_end)
		return PARSE_TOO_SHORT;
	nh->pos = eth + 1;
	*ethhdr = eth;
	h_proto = bpf_ntohs(eth->h_proto);

	if (proto_is_vlan(h_proto)) {
		vlh = nh->pos;
		if ((void *)(vlh + 1) > data_end)
			return PARSE_TOO_SHORT;
		nh->pos = vlh + 1;
		h_proto = bpf_ntohs(vlh->h_vlan_encapsulated_proto);
	}
	return h_proto;
}

/*
 * IPv4 header, honouring IHL (options are skipped, never read).
 * Returns the IP protocol number.
 */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end,
				       struct iphdr **iphdr)
{
	struct iphdr *iph = nh->pos;
	int hdrsize;

	if ((void *)(iph + 1) > data_end)
		return PARSE_TOO_SHORT;
	if (iph->version != 4)
		return PARSE_TOO_SHORT;
	hdrsize = iph->ihl * 4;
	if (hdrsize < (int)sizeof(*iph))
		return PARSE_TOO_SHORT;
	if (nh->pos + hdrsize > data_end)
		return PARSE_TOO_SHORT;
	nh->pos += hdrsize;
	*iphdr = iph;
	return iph->protocol;
}

/*
 * IPv6 fixed header (40 bytes). Returns its Next Header value.
 */
static __always_inline int parse_ip6hdr(struct hdr_cursor *nh, void *data_end,
					struct ipv6hdr **ip6hdr)
{
	struct ipv6hdr *ip6h = nh->pos;

	if ((void *)(ip6h + 1) > data_end)
		return PARSE_TOO_SHORT;
	if (ip6h->version != 6)
		return PARSE_TOO_SHORT;
	nh->pos = ip6h + 1;
	*ip6hdr = ip6h;
	return ip6h->nexthdr;
}

static __always_inline int ip6_next_is_ext(int nexthdr)
{
	return nexthdr == IP6_NEXT_HOPOPTS || nexthdr == IP6_NEXT_ROUTING || nexthdr == IP6_NEXT_DSTOPTS ||
	       nexthdr == IP6_NEXT_FRAGMENT;
}

/*
 * The extension headers after the IPv6 header, `nexthdr` the first one's
 * type: hop-by-hop options, routing and destination options (8 bytes plus
 * hdrlen units of 8) and Fragment (8 bytes), at most AGGBOX_IPV6_MAX_EXT of
 * them, skipped (never read past their lengths and next-header fields);
 * IP6_EXT_F_* in *flags say which kinds there were. Returns the protocol
 * after them, or PARSE_TOO_SHORT: a header past the frame, a longer chain,
 * or a Fragment header with a nonzero offset (a non-first fragment: no
 * upper-layer header follows).
 */
static __always_inline int parse_ip6_ext(struct hdr_cursor *nh, void *data_end, int nexthdr,
					 __u32 *flags)
{
	int i;

#pragma unroll
	for (i = 0; i < AGGBOX_IPV6_MAX_EXT; i++) {
		if (nexthdr == IP6_NEXT_FRAGMENT) {
			struct frag_hdr *fh = nh->pos;

			if ((void *)(fh + 1) > data_end)
				return PARSE_TOO_SHORT;
			if (bpf_ntohs(fh->frag_off) & IP6_OFFSET)
				return PARSE_TOO_SHORT;
			*flags |= IP6_EXT_F_FRAGMENT;
			nexthdr = fh->nexthdr;
			nh->pos = fh + 1;
		} else if (ip6_next_is_ext(nexthdr)) {
			struct ipv6_opt_hdr *oh = nh->pos;

			if ((void *)(oh + 1) > data_end)
				return PARSE_TOO_SHORT;
			*flags |= IP6_EXT_F_OTHER;
			nexthdr = oh->nexthdr;
			nh->pos += ((__u32)oh->hdrlen + 1) * 8;
		} else {
			return nexthdr;
		}
	}
	return ip6_next_is_ext(nexthdr) ? PARSE_TOO_SHORT : nexthdr;
}

/*
 * UDP header. Returns the UDP payload length announced by the header
 * (udp->len - 8), which may be shorter than what the frame holds (short
 * Ethernet frames are padded) or, for a broken packet, longer.
 */
static __always_inline int parse_udphdr(struct hdr_cursor *nh, void *data_end,
					struct udphdr **udphdr)
{
	struct udphdr *h = nh->pos;
	int len;

	if ((void *)(h + 1) > data_end)
		return PARSE_TOO_SHORT;
	nh->pos = h + 1;
	*udphdr = h;
	len = bpf_ntohs(h->len) - (int)sizeof(*h);
	if (len < 0)
		return PARSE_TOO_SHORT;
	return len;
}

#endif /* AGGBOX_PARSE_H */
