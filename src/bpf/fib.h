/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Next-hop resolution for the broadcast TC programs: bpf_fib_lookup() with
 * the TC context (AF_INET or AF_INET6), results cached in bcast_neigh, each cache entry carrying a
 * bpf_timer that marks it stale after bcast_config.neigh_ttl_ns (default
 * AGGBOX_BCAST_DEFAULT_NEIGH_TTL_S, set by the loader). A stale or missing
 * entry is re-resolved by the next datagram that needs it: the timer callback
 * has no packet context and cannot call bpf_fib_lookup() itself.
 *
 * Outcomes of nh_resolve():
 *   NH_OK     next-hop MAC known: the copy gets it written in and is cloned
 *   NH_NEIGH  neighbour not resolved (NO_NEIGH), or FIB says forwarding is
 *             disabled: the copy leaves through bpf_redirect_neigh(), which
 *             resolves the neighbour in the stack (counted NEIGH_MISS)
 *   NH_LOCAL  FIB: NOT_FWDED: a local (or broadcast) route, but also "no
 *             route at all" (-ENETUNREACH maps to NOT_FWDED too). The caller
 *             treats it as local only when the destination is this host's own
 *             address on the datagram (see send_copy), else as FIB_ERROR
 *   NH_ERROR  no usable route (unreachable, blackhole, frag needed...):
 *             the copy is not sent (counted FIB_ERROR)
 */
#ifndef AGGBOX_FIB_H
#define AGGBOX_FIB_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "parse.h"     /* IPPROTO_UDP_ */
#include "tc_maps.h"   /* bcast_neigh, bcast_config, struct neigh_entry */
#include "tc_stats.h"  /* bcast_count */

#define AF_INET_        2
#define AF_INET6_       10
#define CLOCK_MONOTONIC_ 1
#define NS_PER_SEC      1000000000ull

enum bcast_nh_result {
	NH_OK    = 0,
	NH_NEIGH = 1,
	NH_ERROR = 2,
	NH_LOCAL = 3,
};

/* What a copy needs to leave: MACs and egress interface. */
struct bcast_nh {
	__u8  dmac[6];
	__u8  smac[6];
	__u32 ifindex;
};

/* bpf_timer callback: no packet context, so it only marks the entry stale. */
static int neigh_stale_cb(void *map, struct aggbox_neigh_key *key, struct neigh_entry *e)
{
	__sync_fetch_and_or(&e->n.flags, AGGBOX_NEIGH_F_STALE);
	return 0;
}

static __always_inline __u64 neigh_ttl_ns(void)
{
	__u32 zero = 0;
	struct aggbox_bcast_config *cfg = bpf_map_lookup_elem(&bcast_config, &zero);

	if (!cfg)
		return AGGBOX_BCAST_DEFAULT_NEIGH_TTL_S * NS_PER_SEC;
	return cfg->neigh_ttl_ns;
}

/* A new cache entry's first value: all zero, in the object's read-only
 * data rather than on the stack (send_copy()'s frame counts in 6.1's
 * 512-byte chain; aggbox_tc.bpf.c, struct copy_state). */
static const __u8 neigh_entry_zero[sizeof(struct neigh_entry)] __attribute__((aligned(8))) = { 0 };

/* Store a fresh resolution and (re)arm its staleness timer. */
static __always_inline void neigh_store(struct aggbox_neigh_key *key, struct bcast_nh *nh)
{
	struct neigh_entry *e = bpf_map_lookup_elem(&bcast_neigh, key);
	__u64 ttl = neigh_ttl_ns();

	if (!e) {
		/* -EEXIST when another CPU inserted it first: use theirs */
		bpf_map_update_elem(&bcast_neigh, key, neigh_entry_zero, BPF_NOEXIST);
		e = bpf_map_lookup_elem(&bcast_neigh, key);
		if (!e)
			return;
		/* -EBUSY when another CPU initialised it first: fine */
		bpf_timer_init(&e->timer, &bcast_neigh, CLOCK_MONOTONIC_);
		bpf_timer_set_callback(&e->timer, neigh_stale_cb);
	}
	__builtin_memcpy(e->n.dmac, nh->dmac, 6);
	__builtin_memcpy(e->n.smac, nh->smac, 6);
	e->n.ifindex = nh->ifindex;
	e->n.updated_ns = bpf_ktime_get_ns();
	e->n.flags = 0;
	if (ttl)
		bpf_timer_start(&e->timer, ttl, 0);
}

/* A fresh cache entry for `key`: its next hop in `nh`. Counts CACHE_HIT. */
static __always_inline int nh_cached(struct aggbox_neigh_key *key, struct bcast_nh *nh)
{
	struct neigh_entry *e = bpf_map_lookup_elem(&bcast_neigh, key);

	if (!e || (e->n.flags & AGGBOX_NEIGH_F_STALE))
		return 0;
	__builtin_memcpy(nh->dmac, e->n.dmac, 6);
	__builtin_memcpy(nh->smac, e->n.smac, 6);
	nh->ifindex = e->n.ifindex;
	bcast_count(AGGBOX_BCAST_CACHE_HIT, 0);
	return 1;
}

/* What bpf_fib_lookup()'s answer `rc` (in `fib`) means for the copy, both
 * families alike; a resolved next hop is cached under `key`. */
static __always_inline int nh_from_fib(int rc, struct bpf_fib_lookup *fib,
				       struct aggbox_neigh_key *key, __u32 ifindex,
				       struct bcast_nh *nh)
{
	switch (rc) {
	case BPF_FIB_LKUP_RET_SUCCESS:
		__builtin_memcpy(nh->dmac, fib->dmac, 6);
		__builtin_memcpy(nh->smac, fib->smac, 6);
		nh->ifindex = fib->ifindex;
		neigh_store(key, nh);
		return NH_OK;
	case BPF_FIB_LKUP_RET_NO_NEIGH:
		nh->ifindex = fib->ifindex ? fib->ifindex : ifindex;
		return NH_NEIGH;
	case BPF_FIB_LKUP_RET_FWD_DISABLED:
		/* the loader refuses to attach in this state (IPv4); if someone
		 * turns forwarding off later, or never on for IPv6, copies still
		 * leave through the stack */
		bcast_count(AGGBOX_BCAST_FWD_DISABLED, 0);
		nh->ifindex = ifindex;
		return NH_NEIGH;
	case BPF_FIB_LKUP_RET_NOT_FWDED:
		/* local route, or no route: send_copy() decides */
		nh->ifindex = ifindex;
		return NH_LOCAL;
	default:
		bcast_count(AGGBOX_BCAST_FIB_ERROR, 0);
		return NH_ERROR;
	}
}

/*
 * Next hop of IPv4 `daddr` for a copy leaving a packet seen on `ifindex`
 * (`saddr` and `tot_len` of the datagram feed the FIB's source and MTU
 * checks). Counts CACHE_HIT / FIB_LOOKUP / FWD_DISABLED / FIB_ERROR
 * (bcast_count, tc_stats.h).
 */
static __always_inline int nh_resolve(struct __sk_buff *skb, __u32 ifindex, __be32 saddr,
				      __be32 daddr, __u16 tot_len, struct bcast_nh *nh)
{
	struct aggbox_neigh_key key = { .family = AGGBOX_FAMILY_IPV4, .ifindex = ifindex,
					.addr = { daddr } };
	struct bpf_fib_lookup fib = {};
	int rc;

	if (nh_cached(&key, nh))
		return NH_OK;

	bcast_count(AGGBOX_BCAST_FIB_LOOKUP, 0);
	fib.family = AF_INET_;
	fib.l4_protocol = IPPROTO_UDP_;
	fib.tot_len = tot_len;
	fib.ifindex = ifindex;
	fib.ipv4_src = saddr;
	fib.ipv4_dst = daddr;
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	return nh_from_fib(rc, &fib, &key, ifindex, nh);
}

/*
 * nh_resolve() for IPv6 `daddr` (16 bytes, from `saddr`; `tot_len`: the
 * IPv6 header's 40 bytes plus its payload length): bpf_fib_lookup() with
 * AF_INET6, the same cache (key family AGGBOX_FAMILY_IPV6), the same
 * outcomes and counters. NO_NEIGH: no neighbour entry in NUD_VALID yet
 * (neighbour discovery not done).
 */
static __always_inline int nh_resolve6(struct __sk_buff *skb, __u32 ifindex, const __be32 *saddr,
				       const __be32 *daddr, __u16 tot_len, struct bcast_nh *nh)
{
	struct aggbox_neigh_key key = { .family = AGGBOX_FAMILY_IPV6, .ifindex = ifindex };
	struct bpf_fib_lookup fib = {};
	int rc;

	__builtin_memcpy(key.addr, daddr, sizeof(key.addr));
	if (nh_cached(&key, nh))
		return NH_OK;

	bcast_count(AGGBOX_BCAST_FIB_LOOKUP, 0);
	fib.family = AF_INET6_;
	fib.l4_protocol = IPPROTO_UDP_;
	fib.tot_len = tot_len;
	fib.ifindex = ifindex;
	__builtin_memcpy(fib.ipv6_src, saddr, sizeof(fib.ipv6_src));
	__builtin_memcpy(fib.ipv6_dst, daddr, sizeof(fib.ipv6_dst));
	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	return nh_from_fib(rc, &fib, &key, ifindex, nh);
}

#endif /* AGGBOX_FIB_H */
