/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The two builds of every program the XDP tail-call chain calls
 * (aggbox_xdp.bpf.c's stages and aggbox_ring.bpf.c's ring program;
 * docs/JUMBO.md "Kernels without multi-buffer XDP"): each stage is written
 * once with a compile-time `linear` and wrapped twice, as NAME
 * ("xdp.frags", linear = 0) and NAME_linear ("xdp", linear = 1). A prog
 * array holds programs of one frags flag, so the loader loads one build of
 * every program and puts it into that build's array.
 */
#ifndef AGGBOX_CHAIN_H
#define AGGBOX_CHAIN_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

/* The two programs of a stage: NAME (frags chain) and NAME_linear. */
#define CHAIN_PROGRAMS(name, stage)                  \
	SEC("xdp.frags")                             \
	int name(struct xdp_md *ctx)                 \
	{                                            \
		return stage(ctx, 0);                \
	}                                            \
	SEC("xdp")                                   \
	int name##_linear(struct xdp_md *ctx)        \
	{                                            \
		return stage(ctx, 1);                \
	}

#endif /* AGGBOX_CHAIN_H */
