// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Benchmark ceiling: a plain XDP count-and-drop program (src/bin/aggbox-bench/agg/).
 *
 * Ethernet / IPv4 / UDP to the port in bench_cfg[0] is counted (packets,
 * bytes) per CPU and dropped; everything else (ARP, other ports) passes. It
 * does the least an aggregator must do per datagram (parse to the UDP port),
 * so the senders' rate into it is the ceiling any XDP aggregator can reach on
 * the same testbed.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ETH_P_IP_ 0x0800
#define IPPROTO_UDP_ 17

struct bench_count {
	__u64 packets;
	__u64 bytes;
};

/* Per-CPU counter of dropped datagrams; read by the benchmark. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_count);
} bench_counts SEC(".maps");

/* [0] = UDP destination port to drop (host order); written by the benchmark. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} bench_cfg SEC(".maps");

SEC("xdp")
int bench_drop(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip;
	struct udphdr *udp;
	__u32 zero = 0, *port;
	struct bench_count *c;

	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP_))
		return XDP_PASS;
	ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP_ || ip->ihl < 5)
		return XDP_PASS;
	udp = (void *)ip + ip->ihl * 4;
	if ((void *)(udp + 1) > end)
		return XDP_PASS;
	port = bpf_map_lookup_elem(&bench_cfg, &zero);
	if (!port || bpf_ntohs(udp->dest) != *port)
		return XDP_PASS;
	c = bpf_map_lookup_elem(&bench_counts, &zero);
	if (c) {
		c->packets++;
		c->bytes += end - data;
	}
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
