/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Tail calls, cilium tailcall.h style: the numbered enum aggbox_call
 * (include/aggbox/abi.h, shared with the control plane that fills the
 * array), one prog array per chain (progs, progs_linear: xdp_maps.h), and
 * a counted fall-through after every bpf_tail_call(): a missed tail call
 * (an empty array slot) is a bug that must show up as the MISSED_TAIL_CALL
 * drop reason, never as a silent pass.
 */
#ifndef AGGBOX_TAILCALL_H
#define AGGBOX_TAILCALL_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "xdp_maps.h"  /* progs, progs_linear */

/*
 * Jump to program `index` of the chain (`linear`: a compile-time constant,
 * so each program references one array). Returns only if the tail call
 * failed; the caller then exits with AGGBOX_DROP_MISSED_TAIL_CALL.
 */
#define aggbox_tail_call(ctx, index, linear) \
	bpf_tail_call(ctx, (linear) ? (void *)&progs_linear : (void *)&progs, index)

#endif /* AGGBOX_TAILCALL_H */
