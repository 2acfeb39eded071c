// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Broadcast floor: the least a TC egress program that makes the broadcast
 * benchmark's copies can cost on a machine (src/bin/aggbox-bench/bcast.rs,
 * mode `floor`). A yardstick for aggbox_tc_egress, not a program to deploy.
 *
 * The benchmark writes, before the run, the destinations of the copies
 * already resolved (destination MAC, egress ifindex, IPv4 address, UDP
 * port) into bcast_floor_cfg. For one of the benchmark's datagrams (fixed
 * offsets: Ethernet, IPv4 without options, UDP to the configured port, AGB1
 * of the configured group) the program makes copy i of n, for i = 0..n-1,
 * with only what a copy cannot be delivered without:
 *
 *   - make the head writable (bpf_skb_pull_data: after a clone the head is
 *     shared with the copy already sent, and is copied here; the same
 *     unclone bpf_skb_store_bytes does in aggbox_tc_egress);
 *   - direct writes: destination MAC, IPv4 destination, IPv4 header checksum
 *     (updated in the program, RFC 1624), and the UDP destination port only
 *     where it differs from the previous copy's;
 *   - the UDP checksum through bpf_l4_csum_replace (BPF_F_PSEUDO_HDR for the
 *     address): the one way to keep it right in every skb->ip_summed state
 *     (CHECKSUM_PARTIAL: the pseudo-header seed; CHECKSUM_NONE: the full
 *     checksum), which a program cannot read. Writing 0 instead would be
 *     cheaper but wrong under CHECKSUM_PARTIAL (docs/BROADCAST.md,
 *     "Checksums"), and veth receivers would not even notice;
 *   - the copy: skb->mark = BCAST_FLOOR_MARK, bpf_clone_redirect() to the
 *     destination's ifindex, mark restored. The original itself becomes the
 *     last copy (n copies = n - 1 clones), returned with TC_ACT_OK (or
 *     bpf_redirect() when its ifindex is another one).
 *
 * Left out on purpose (what aggbox_tc_egress does and this does not): header
 * validation beyond the fixed offsets, VLAN, the group table (a hash lookup),
 * the mask, the next-hop cache and FIB, source MAC writes, per-copy and
 * per-group counters, local members, the neighbour path. The source MAC is
 * the egress interface's already (every destination leaves by it).
 *
 * Re-entry: bpf_clone_redirect() transmits the clone through this hook
 * again; BCAST_FLOOR_MARK makes it pass (TC_ACT_OK). Anything that is not
 * the benchmark's datagram gets TC_ACT_UNSPEC, i.e. the next filter (the
 * benchmark attaches this in front of AggBox's, at a lower priority
 * number, only while it measures the floor).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"

#define TC_ACT_UNSPEC (-1)
#define TC_ACT_OK     0
#define TC_ACT_SHOT   2
#define ETH_P_IP_     0x0800
#define IPPROTO_UDP_  17

#define BCAST_FLOOR_MAX_DESTS 32
/* skb->mark of the floor's copies (not one of AGGBOX_BCAST_MARK_*). */
#define BCAST_FLOOR_MARK 0xa6b1f100u

/* Ethernet, IPv4 without options, UDP, AGB1: the bytes the program touches. */
#define FLOOR_L3_OFF  14
#define FLOOR_UDP_OFF (FLOOR_L3_OFF + 20)
#define FLOOR_HDR_LEN (FLOOR_UDP_OFF + 8 + 16)
#define FLOOR_UDP_CSUM_OFF (FLOOR_UDP_OFF + 6)

/* One destination, resolved by the benchmark. */
struct bcast_floor_dest {
	__u8   mac[6];  /* destination MAC (wire order) */
	__be16 port;    /* big-endian: UDP destination port */
	__be32 addr;    /* big-endian: IPv4 destination */
	__u32  ifindex; /* host order: interface the copy leaves by */
};
_Static_assert(sizeof(struct bcast_floor_dest) == 16, "bcast_floor_dest is 16 bytes");

struct bcast_floor_cfg {
	__u32 count; /* host order: copies per datagram, 1..=BCAST_FLOOR_MAX_DESTS */
	__u16 port;  /* host order: UDP destination port of the benchmark's datagrams */
	__u16 group; /* host order: AGB1 group of the benchmark's datagrams */
	struct bcast_floor_dest dests[BCAST_FLOOR_MAX_DESTS];
};
_Static_assert(sizeof(struct bcast_floor_cfg) == 8 + 16 * BCAST_FLOOR_MAX_DESTS,
	       "bcast_floor_cfg has no padding");

/* [0]: the destinations of the copies; written by the benchmark before each
 * measurement, read here (one lookup per datagram). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bcast_floor_cfg);
} bcast_floor_cfg SEC(".maps");

/* [0]: the destinations of bench_result_floor's copies (the workers' data
 * sockets; `group` unused); written by `aggbox-bench large`'s floor. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bcast_floor_cfg);
} result_floor_cfg SEC(".maps");

/* Ones' complement sum of 16-bit words folded to 16 bits. */
static __always_inline __u16 csum_fold32(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m') for a 32-bit field m -> m'. */
static __always_inline __u16 csum_replace4(__u16 check, __u32 from, __u32 to)
{
	__u32 s = (__u16)~check;

	s += (__u16)~(from & 0xffff) + (__u16)~(from >> 16);
	s += (to & 0xffff) + (to >> 16);
	return (__u16)~csum_fold32(s);
}

/*
 * Point the datagram at destination d, from source MAC smac (NULL: keep the
 * frame's). Returns 0, or -1 when the headers cannot be made writable or
 * the checksum helper fails.
 */
static __always_inline int floor_rewrite(struct __sk_buff *skb, const struct bcast_floor_dest *d,
					 const __u8 *smac)
{
	void *data, *end;
	struct ethhdr *eth;
	struct iphdr *ip;
	struct udphdr *udp;
	__be32 old_addr;
	__be16 old_port;

	/* unclone (copies the head once a clone shares it) and re-read */
	if (bpf_skb_pull_data(skb, FLOOR_HDR_LEN))
		return -1;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	if (data + FLOOR_HDR_LEN > end)
		return -1;
	eth = data;
	ip = data + FLOOR_L3_OFF;
	udp = data + FLOOR_UDP_OFF;
	__builtin_memcpy(eth->h_dest, d->mac, 6);
	if (smac)
		__builtin_memcpy(eth->h_source, smac, 6);
	old_addr = ip->daddr;
	old_port = udp->dest;
	if (old_addr != d->addr) {
		ip->daddr = d->addr;
		ip->check = csum_replace4(ip->check, old_addr, d->addr);
	}
	if (old_port != d->port)
		udp->dest = d->port;
	/* packet pointers are invalid from here on */
	if (old_addr != d->addr &&
	    bpf_l4_csum_replace(skb, FLOOR_UDP_CSUM_OFF, old_addr, d->addr,
				BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | sizeof(__be32)))
		return -1;
	if (old_port != d->port &&
	    bpf_l4_csum_replace(skb, FLOOR_UDP_CSUM_OFF, old_port, d->port,
				BPF_F_MARK_MANGLED_0 | sizeof(__be16)))
		return -1;
	return 0;
}

SEC("tc")
int bench_bcast_floor(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct aggbox_bcast_hdr *b;
	struct bcast_floor_cfg *cfg;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	struct iphdr *ip;
	__u32 zero = 0, n, mark, hook_ifindex = skb->ifindex;

	if (skb->mark == BCAST_FLOOR_MARK)
		return TC_ACT_OK;
	if (data + FLOOR_HDR_LEN > end)
		return TC_ACT_UNSPEC;
	ip = data + FLOOR_L3_OFF;
	udp = data + FLOOR_UDP_OFF;
	b = (void *)(udp + 1);
	if (eth->h_proto != bpf_htons(ETH_P_IP_) || ip->ihl != 5 || ip->protocol != IPPROTO_UDP_ ||
	    b->magic != bpf_htonl(AGGBOX_MAGIC_BCAST))
		return TC_ACT_UNSPEC;
	cfg = bpf_map_lookup_elem(&bcast_floor_cfg, &zero);
	if (!cfg || udp->dest != bpf_htons(cfg->port) || b->group != bpf_htons(cfg->group))
		return TC_ACT_UNSPEC;
	n = cfg->count;
	if (n == 0 || n > BCAST_FLOOR_MAX_DESTS)
		return TC_ACT_UNSPEC;

	for (__u32 i = 0; i < BCAST_FLOOR_MAX_DESTS; i++) {
		const struct bcast_floor_dest *d = &cfg->dests[i];

		if (floor_rewrite(skb, d, NULL))
			return TC_ACT_SHOT;
		if (i + 1 >= n) {
			/* the original is the last copy */
			if (d->ifindex == hook_ifindex)
				return TC_ACT_OK;
			skb->mark = BCAST_FLOOR_MARK;
			return bpf_redirect(d->ifindex, 0);
		}
		mark = skb->mark;
		skb->mark = BCAST_FLOOR_MARK;
		bpf_clone_redirect(skb, d->ifindex, 0);
		skb->mark = mark;
	}
	return TC_ACT_SHOT;
}

/*
 * The allreduce floor's RESULT copier (`aggbox-bench large`, backend
 * `floor`), on the aggregator node's clsact ingress behind bench_floor's XDP
 * program: an AGG1 RESULT to the configured UDP port (result_floor_cfg's
 * `port`) becomes one copy per destination (the workers' data sockets),
 * n - 1 clones and the original redirected as the last, each with the
 * destination's MAC, address and port, and the node's own MAC as source
 * (the frame arrived addressed to it; a worker's MAC as source would teach
 * the bridge that worker is behind the node's port). What a RESULT copy
 * cannot be delivered without, as bench_bcast_floor for a broadcast; the
 * production path (aggbox_tc_ingress's result group) validates the job,
 * reads the group table and the next-hop cache, and counts.
 */
SEC("tc")
int bench_result_floor(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct aggbox_agg_hdr *agg;
	struct bcast_floor_cfg *cfg;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	struct iphdr *ip;
	__be32 old_src, node_addr;
	__u8 node_mac[6];
	__u32 zero = 0, n;

	if (data + FLOOR_UDP_OFF + 8 + sizeof(*agg) > end)
		return TC_ACT_UNSPEC;
	ip = data + FLOOR_L3_OFF;
	udp = data + FLOOR_UDP_OFF;
	agg = (void *)(udp + 1);
	if (eth->h_proto != bpf_htons(ETH_P_IP_) || ip->ihl != 5 || ip->protocol != IPPROTO_UDP_ ||
	    agg->magic != bpf_htonl(AGGBOX_MAGIC_AGG) || !(agg->flags & AGGBOX_AGG_F_RESULT))
		return TC_ACT_UNSPEC;
	cfg = bpf_map_lookup_elem(&result_floor_cfg, &zero);
	if (!cfg || udp->dest != bpf_htons(cfg->port))
		return TC_ACT_UNSPEC;
	n = cfg->count;
	if (n == 0 || n > BCAST_FLOOR_MAX_DESTS)
		return TC_ACT_UNSPEC;
	__builtin_memcpy(node_mac, eth->h_dest, 6);
	/* From the node's address, once: the completing worker's own address
	 * as the source of its copy would make its stack drop it (a martian
	 * source). bench_floor left the UDP checksum 0, which stays 0. */
	old_src = ip->saddr;
	node_addr = ip->daddr;
	ip->saddr = node_addr;
	ip->check = csum_replace4(ip->check, old_src, node_addr);

	for (__u32 i = 0; i < BCAST_FLOOR_MAX_DESTS; i++) {
		const struct bcast_floor_dest *d = &cfg->dests[i];

		if (floor_rewrite(skb, d, node_mac))
			return TC_ACT_SHOT;
		if (i + 1 >= n)
			return bpf_redirect(d->ifindex, 0);
		bpf_clone_redirect(skb, d->ifindex, 0);
	}
	return TC_ACT_SHOT;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
