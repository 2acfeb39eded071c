/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Tail calls, cilium tailcall.h style: the numbered enum aggbox_call
 * (include/aggbox/abi.h, shared with the control plane that fills the
 * array), one prog array, and a counted fall-through after every
 * bpf_tail_call(): a missed tail call (an empty array slot) is a bug that
 * must show up as the MISSED_TAIL_CALL drop reason, never as a silent pass.
 */
#ifndef AGGBOX_TAILCALL_H
#define AGGBOX_TAILCALL_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"

/*
 * progs: the XDP chain's programs indexed by enum aggbox_call. Filled once
 * by the control plane right after load (Dataplane::fill_prog_arrays in
 * src/dataplane.rs); read by bpf_tail_call() only.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, AGGBOX_CALL_MAX);
	__type(key, __u32);
	__type(value, __u32);
} progs SEC(".maps");

/*
 * progs_linear: the same for the linear chain (aggbox_xdp.bpf.c). A prog
 * array holds programs of one frags flag, so each chain has its own; with
 * both arrays every program of the object can load side by side (bpftool
 * prog loadall, the kernel matrix), while the control plane loads and
 * fills one chain.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, AGGBOX_CALL_MAX);
	__type(key, __u32);
	__type(value, __u32);
} progs_linear SEC(".maps");

/*
 * Jump to program `index` of the chain (`linear`: a compile-time constant,
 * so each program references one array). Returns only if the tail call
 * failed; the caller then exits with AGGBOX_DROP_MISSED_TAIL_CALL.
 */
#define aggbox_tail_call(ctx, index, linear) \
	bpf_tail_call(ctx, (linear) ? (void *)&progs_linear : (void *)&progs, index)

#endif /* AGGBOX_TAILCALL_H */
