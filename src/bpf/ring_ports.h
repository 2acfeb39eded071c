/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The one ring map both XDP objects declare: the entry program of the
 * aggregation chain (aggbox_xdp.bpf.c) looks a datagram's port up here to
 * tail-call the ring program (aggbox_ring.bpf.c), which looks it up again
 * for the ring's dense index. The loader creates it with the aggregation
 * object and hands the ring object the same map (libbpf map reuse), so the
 * control plane writes it once (XdpPlane::set_ring).
 */
#ifndef AGGBOX_RING_PORTS_H
#define AGGBOX_RING_PORTS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

/* ring_ports: UDP port (index) -> 1 + dense ring index, 0: not a ring port. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} ring_ports SEC(".maps");

#endif /* AGGBOX_RING_PORTS_H */
