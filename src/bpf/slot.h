/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Slot and per-packet scratch layouts of the XDP aggregator. BPF-only: the
 * control plane never reads a slot's contents (it only deletes slots of a
 * removed job, by key), so these structs are not part of the ABI.
 */
#ifndef AGGBOX_SLOT_H
#define AGGBOX_SLOT_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"

#define AGGBOX_BITMAP_WORDS (AGGBOX_MAX_RANKS / 32)

/*
 * A slot is a header (value of the `slots` map: lock, contributor bitmap,
 * completion count, the indexes of its blocks) plus one block per chunk of
 * AGGBOX_CHUNK_ELEMS elements, taken from a pre-allocated pool (the
 * `blocks` array, free indexes in the `free_blocks` stack): slot memory
 * follows the fragment's count (docs/JUMBO.md). Each block has its own spin
 * lock, taken once per contribution per chunk.
 */

/* Everything of a slot header but its lock. */
struct aggbox_slot_body {
	struct aggbox_slot_key key; /* copy of the map key: detects a reused element */
	__u16 workers;              /* contributions that complete the slot */
	__u16 claimed;              /* ranks whose bit is set */
	__u16 done;                 /* contributions fully added (all chunks) */
	__u8  op;                   /* op of the first contribution */
	__u8  flags;                /* OR of the contributions' AGGBOX_AGG_F_CARRIED */
	__u16 count;                /* count of the first contribution */
	__u16 pad;
	__u32 weight_sum;           /* AVG divisor, from the job at creation */
	__u32 bitmap[AGGBOX_BITMAP_WORDS];   /* bit r: rank r has contributed */
	__u16 block[AGGBOX_MAX_CHUNKS];      /* chunk i -> index in `blocks`; set at
					      * creation, never changed after */
};

/* Value of the slots map. */
struct aggbox_slot {
	struct bpf_spin_lock lock; /* rank claim and completion count */
	__u32 pad;
	struct aggbox_slot_body b;
};

/* Everything of a block but its lock. */
struct aggbox_block_body {
	struct aggbox_slot_key key; /* slot owning it: detects a block released
				     * and reused meanwhile */
	__u32 index;                /* its chunk index in that slot */
	__u32 seen;                 /* contributions added into this chunk; the
				     * first one stores instead of adding, so a
				     * block is never zeroed between owners */
	__u32 pad;
	__s64 acc[AGGBOX_CHUNK_ELEMS]; /* running result, never wraps */
};

/* Value of the blocks array (the block pool). */
struct aggbox_block {
	struct bpf_spin_lock lock; /* taken once per chunk, see docs/DATAPLANE.md */
	__u32 pad;
	struct aggbox_block_body b;
};

/* The same layout without the lock type: per-CPU maps cannot hold a spin lock. */
struct aggbox_slot_init {
	__u32 lock;
	__u32 pad;
	struct aggbox_slot_body b;
};
_Static_assert(sizeof(struct aggbox_slot) == sizeof(struct aggbox_slot_init), "init mirrors slot");
_Static_assert(AGGBOX_MAX_BLOCKS <= 65536, "a block index fits slot.block's __u16");

/* Value of the per-CPU slot_init template map. */
struct aggbox_init {
	struct aggbox_slot_init slot;
};

/* Per-packet state handed from one program of the chain to the next. */
_Static_assert(AGGBOX_MAX_CHUNKS <= 64, "scratch.finalized has a bit per chunk");

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
	__u16 chunk;       /* chunk the next callback processes */
	__u16 rank;
	__u16 workers;
	__u16 result_port; /* host order */
	__s32 weight;
	__u32 weight_sum;
	__u32 slots;       /* the job's slot bound (0 = AGGBOX_MAX_SLOTS) */
	__u32 handoff;     /* enum aggbox_handoff_reason when handed to user space */
	__u32 window;      /* the job's round window (never 0) */
	__s32 stop;        /* drop reason that stopped a bpf_loop callback, or 0
			    * (kept here, not on the caller's stack: distinct
			    * constants there multiply the verifier's walks) */
	__u32 chunk_n;     /* elements of the chunk in buf (read volatile in loops:
			    * a register bound would fork the verifier per element) */
	__u32 job_known;   /* 1 once aggbox_classify found key.job configured;
			    * 0 at the start of every entry run, so a previous
			    * packet's job is never counted (stats.h) */
	__u16 block[AGGBOX_MAX_CHUNKS];
			   /* the claimed slot's block indexes (copied under
			    * its lock: the add and result stages index the
			    * pool without looking the header up again) */
	__u64 finalized;   /* chunks whose RESULT values the add stage already
			    * wrote into this packet (bit i = chunk i) */
	__be32 buf[AGGBOX_CHUNK_ELEMS] __attribute__((aligned(8)));
			   /* one chunk of payload: bpf_xdp_load_bytes /
			    * store_bytes go through here; 8-aligned for the
			    * two-elements-per-load loops */
};

/*
 * scratch: per-packet state handed from one program of the tail-call chain
 * to the next (offsets, slot key, op, weight, chunk index, job_known).
 * Written and read by the XDP programs only; one entry per CPU is safe
 * because a chain runs start to end on one CPU with preemption disabled.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct aggbox_scratch);
} scratch SEC(".maps");

#endif /* AGGBOX_SLOT_H */
