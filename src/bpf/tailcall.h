/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Tail calls, cilium tailcall.h style: the numbered enum aggbox_call
 * (include/aggbox/abi.h, shared with the control plane that fills the
 * array), one prog array per chain (progs, progs_linear: xdp_maps.h), and
 * a counted fall-through after every bpf_tail_call(): a missed tail call
 * (an empty array slot, or the kernel's limit of 33 calls) is a bug that
 * must show up as the MISSED_TAIL_CALL drop reason, never as a silent pass.
 */
#ifndef AGGBOX_TAILCALL_H
#define AGGBOX_TAILCALL_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "xdp_maps.h"  /* progs, progs_linear */

/*
 * Jump to program `index` of the chain (`linear`: a compile-time constant,
 * so each program references one array). Returns only if the jump failed,
 * and then returns AGGBOX_DROP_MISSED_TAIL_CALL, the code the caller ends
 * the packet with: `return aggbox_exit(aggbox_tail_call(...), bytes);` or
 * `code = aggbox_tail_call(...);` before the caller's one exit. The drop
 * reason is the call's value and warn_unused_result (-Werror) rejects a
 * call whose value is ignored, so no tail call can be written without its
 * counted fall-through (cilium's tail_call_internal() returns it the same
 * way).
 */
static __always_inline __attribute__((warn_unused_result)) int
aggbox_tail_call(void *ctx, __u32 index, const int linear)
{
	bpf_tail_call(ctx, linear ? (void *)&progs_linear : (void *)&progs, index);
	return AGGBOX_DROP_MISSED_TAIL_CALL;
}

#endif /* AGGBOX_TAILCALL_H */
