/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Slot and per-packet scratch layouts of the XDP aggregator. BPF-only: the
 * control plane never reads a slot's contents (it only deletes slots of a
 * removed job, by key), so these structs are not part of the ABI.
 */
#ifndef AGGBOX_SLOT_H
#define AGGBOX_SLOT_H

#include "vmlinux.h"
#include "aggbox/abi.h"

#define AGGBOX_BITMAP_WORDS (AGGBOX_MAX_RANKS / 32)

/* Everything of a slot but its lock. */
struct aggbox_slot_body {
	struct aggbox_slot_key key; /* copy of the map key: detects a reused element */
	__u16 workers;              /* contributions that complete the slot */
	__u16 claimed;              /* ranks whose bit is set */
	__u16 done;                 /* contributions fully added (all chunks) */
	__u8  op;                   /* op of the first contribution */
	__u8  flags;                /* OR of the contributions' LAST_FRAGMENT */
	__u16 count;                /* count of the first contribution */
	__u16 pad;
	__u32 weight_sum;           /* AVG divisor, from the job at creation */
	__u32 bitmap[AGGBOX_BITMAP_WORDS];   /* bit r: rank r has contributed */
	__u16 chunk_seen[AGGBOX_MAX_CHUNKS]; /* contributions added per chunk */
	__s64 acc[AGGBOX_MAX_ELEMS];         /* running result, never wraps */
};

/* Value of the slots map. */
struct aggbox_slot {
	struct bpf_spin_lock lock; /* taken once per chunk, see docs/DATAPLANE.md */
	__u32 pad;
	struct aggbox_slot_body b;
};

/* Same layout without the lock type: per-CPU maps cannot hold a spin lock. */
struct aggbox_slot_init {
	__u32 lock;
	__u32 pad;
	struct aggbox_slot_body b;
};
_Static_assert(sizeof(struct aggbox_slot) == sizeof(struct aggbox_slot_init), "init mirrors slot");

/* Per-packet state handed from one program of the chain to the next. */
struct aggbox_scratch {
	struct aggbox_slot_key key;
	__u32 bytes;       /* UDP payload bytes, for the stats */
	__u16 agg_off;     /* offset of the AGG1 header from ctx->data */
	__u16 udp_off;     /* offset of the UDP header from ctx->data */
	__u16 ip_off;      /* offset of the IPv4 header from ctx->data */
	__u16 count;       /* payload elements */
	__u8  op;
	__u8  flags;       /* the contribution's flags */
	__u8  overflow;    /* result stage: some element was clamped */
	__u8  result_flags;/* result stage: flags of the RESULT */
	__u16 chunk;       /* chunk the next program processes */
	__u16 rank;
	__u16 workers;
	__u16 result_port; /* host order */
	__s32 weight;
	__u32 weight_sum;
	__u32 slots;       /* the job's slot bound (0 = AGGBOX_MAX_SLOTS) */
	__u32 handoff;     /* enum aggbox_handoff_reason when handed to user space */
	__u32 window;      /* the job's round window (never 0) */
};

#endif /* AGGBOX_SLOT_H */
