/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet parsing helpers in the style of xdp-tools' parsing_helpers.h: a
 * cursor (`struct hdr_cursor`) that points at the next header, and small
 * `parse_*()` helpers that bounds-check against data_end before every access,
 * advance the cursor and return the next protocol (host order) or a negative
 * code. Nothing here writes to the packet.
 *
 * Its twin in Rust is src/wire/frame.rs (parse_frame), which reads the frames
 * the AF_XDP path receives: one VLAN tag at most, IHL honoured, the UDP
 * payload length from the UDP header. A change to what is parsed here is a
 * change there.
 */
#ifndef AGGBOX_PARSE_H
#define AGGBOX_PARSE_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ETH_P_IP     0x0800
#define ETH_P_8021Q  0x8100
#define ETH_P_8021AD 0x88A8
#define IPPROTO_UDP_ 17 /* vmlinux.h has IPPROTO_UDP as an enum; keep ours distinct */

#define IP_MF     0x2000
#define IP_OFFSET 0x1fff

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
