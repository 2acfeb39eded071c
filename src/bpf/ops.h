/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The BPF side of the op table (include/aggbox/ops.def): identity, combine
 * and finish of every op, each a switch over the table's rows. Called with
 * `op` a compile-time constant (the ring's per-op functions) the switch
 * folds to the one row; called with a run-time op it is a chain of
 * compares, so per-element loops keep one loop per op (the fast slots and
 * blocks of aggbox_xdp.bpf.c, whose MIN is the maximum of negated values),
 * and tests/bpf_ops_agree.rs holds those loops to these rows.
 */
#ifndef AGGBOX_BPF_OPS_H
#define AGGBOX_BPF_OPS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"

/* AVG's finish: r / ws truncated toward zero (BPF v3 has only unsigned
 * division); ws 0 divides by 1. */
static __always_inline __s64 aggbox_op_div(__s64 r, __u32 ws)
{
	__u64 u = r < 0 ? -(__u64)r : (__u64)r;

	u /= ws ? ws : 1;
	return r < 0 ? -(__s64)u : (__s64)u;
}

/* The words ops.def's expressions are written in (int64); build.rs gives
 * Rust the same ones. mul never overflows here: BPF multiplies only a
 * weight by an element (two int32s). */
#define add(x, y) ((x) + (y))
#define mul(x, y) ((x) * (y))
#define nz(x) ((__s64)((x) != 0))
#define max(x, y) ((x) > (y) ? (x) : (y))
#define min(x, y) ((x) < (y) ? (x) : (y))
#define and(x, y) ((x) & (y))
#define or(x, y) ((x) | (y))
#define xor(x, y) ((x) ^ (y))
#define div(x, y) aggbox_op_div(x, y)
#define I32_MIN (-2147483648ll)
#define I32_MAX 2147483647ll

/* The int32 that leaves every element unchanged under combine. */
static __always_inline __s64 aggbox_op_identity(__u32 op)
{
	switch (op) {
#define AGGBOX_OP(number, NAME, name, identity, ...) \
	case number:                                 \
		return identity;
#include "aggbox/ops.def"
#undef AGGBOX_OP
	default:
		return 0;
	}
}

/* Accumulator a combined with element v of a sender of weight w. */
static __always_inline __s64 aggbox_op_combine(__u32 op, __s64 a, __s64 v, __s64 w)
{
	switch (op) {
#define AGGBOX_OP(number, NAME, name, identity, combine, ...) \
	case number:                                          \
		return combine;
#include "aggbox/ops.def"
#undef AGGBOX_OP
	default:
		return a; /* validated before: never */
	}
}

/* The result of accumulator r with weight sum ws, before the int32 clamp. */
static __always_inline __s64 aggbox_op_finish(__u32 op, __s64 r, __u32 ws)
{
	switch (op) {
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, ...) \
	case number:                                                  \
		return finish;
#include "aggbox/ops.def"
#undef AGGBOX_OP
	default:
		return r;
	}
}

#undef add
#undef mul
#undef nz
#undef max
#undef min
#undef and
#undef or
#undef xor
#undef div
#undef I32_MIN
#undef I32_MAX

/* The XDP program aggregates op itself (integer payloads); one compare
 * (abi.h: the kernel's ops are 0..AGGBOX_OP_LAST_KERNEL). */
static __always_inline int aggbox_op_runs_in_kernel(__u32 op)
{
	return op <= AGGBOX_OP_LAST_KERNEL;
}

/* The ring program combines op hop by hop. */
static __always_inline int aggbox_op_runs_in_ring(__u32 op)
{
	return op < AGGBOX_OPS && ((AGGBOX_OP_RING_MASK >> op) & 1);
}

/* Expands to its arguments for a row whose 0/1 column is 1 (an X-macro
 * emitting code only for the ops that run somewhere). */
#define AGGBOX_OP_IF_0(...)
#define AGGBOX_OP_IF_1(...) __VA_ARGS__

#endif /* AGGBOX_BPF_OPS_H */
