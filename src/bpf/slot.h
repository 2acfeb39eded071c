/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Slot layouts of the XDP aggregator. BPF-only: the
 * control plane never reads a slot's contents (it only deletes slots of a
 * removed job, by key), so these structs are not part of the ABI.
 */
#ifndef AGGBOX_SLOT_H
#define AGGBOX_SLOT_H

#include "vmlinux.h"
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
	__u32 creator;              /* this header's creation (slot_create): CPU
				     * and that CPU's count of creations; tells a
				     * creator's own header from a later one of
				     * the same key */
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

/*
 * A fast slot (value of the `fast_slots` array; docs/DATAPLANE.md "Fast
 * slots"): the whole reduction of one fragment of at most AGGBOX_FAST_ELEMS
 * elements in one map value under one lock, at an index computed from the
 * key. It carries its key as a version and its state:
 *
 *   EMPTY ──take (job never used the hash-map path)───────────> ACTIVE ──last rank──> RESULTING
 *     │                                                          ▲                         │
 *     └─take──> CLAIMING ──commit (no slot_owner record,         │          RESULT written │
 *                  │        no completed marker)─────────────────┘                         ▼
 *                  └ abort (the hash-map path has the fragment) ──> back as it was       DONE ──take──> ...
 *
 * Only EMPTY and DONE slots are taken by a new key (an unfinished slot of a
 * stale round is released by the control plane's periodic reclaim); a DONE
 * slot keeps its key, so a late retransmission of it is recognised until the
 * slot is taken, then through `prev`, the key it held before, and then
 * through `hist`, the AGGBOX_FAST_HISTORY keys before that (a ring written
 * under the lock by the taker: no map update per fragment, and no other job
 * can evict them). Older keys are caught by the stale-round rule once the
 * job has completed a round more than its window ahead. Every contribution
 * is added under the lock in one acquisition.
 */
enum aggbox_fast_state {
	FAST_EMPTY     = 0,
	FAST_CLAIMING  = 1, /* taken, the taker checks the other paths */
	FAST_ACTIVE    = 2,
	FAST_RESULTING = 3, /* complete: the last contributor writes the RESULT (holding the lock) */
	FAST_DONE      = 4,
};

#define FAST_F_SPILLED 0x01 /* the hash-map path made a record for this key */
#define AGGBOX_FAST_HISTORY 16 /* completed keys a fast slot remembers past `prev` */
_Static_assert((AGGBOX_FAST_HISTORY & (AGGBOX_FAST_HISTORY - 1)) == 0, "a power of two: ring index by mask");
#define FAST_PAIRS (AGGBOX_FAST_ELEMS / 2)

/*
 * Laid out by who touches what: the first cache line holds everything a
 * joining contribution reads or writes besides its accumulators (lock, key,
 * state, op, count, workers, done, flags, the rank bitmap), so a join moves
 * one header line between CPUs, as a minimal aggregator's would; a take
 * also writes the second line onwards (prev, the history ring). The
 * accumulators start on a cache line, and the whole value is a multiple of
 * one, so every slot of the array starts on a line too.
 */
struct aggbox_fast_slot {
	__u32 lock;        /* 0 free, 1 held: fast_lock() (aggbox_xdp.bpf.c), not a bpf_spin_lock */
	__u16 state;       /* enum aggbox_fast_state; offset 4 (read by the control plane) */
	__u16 job;         /* job of the key (a region is reassigned when jobs change) */
	__u32 round;       /* key */
	__u32 frag_off;
	__u16 count;       /* of the first contribution */
	__u8  op;
	__u8  flags;       /* OR of the contributions' AGGBOX_AGG_F_CARRIED */
	__u16 workers;
	__u16 done;        /* contributions added */
	__u32 weight_sum;  /* AVG divisor */
	__u8  fast_flags;  /* FAST_F_* */
	__u8  prev_valid;
	__u8  prev_state;  /* what an aborted take-over restores: FAST_DONE or FAST_EMPTY */
	__u8  pad;
	__u32 bitmap[AGGBOX_BITMAP_WORDS];
	/* second line: written by a take */
	__u32 token;       /* CLAIMING: who took it */
	__u32 prev_round;  /* key held before the current one, if prev_valid */
	__u32 prev_frag_off;
	__u32 fence;       /* atomically added to: a full barrier (take-over vs hash path) */
	__u16 hist_valid;  /* bit i: hist_*[i] holds a completed key of `job` */
	__u16 hist_next;   /* next ring position (mod AGGBOX_FAST_HISTORY) */
	__u32 hist_round[AGGBOX_FAST_HISTORY];
	__u32 hist_frag_off[AGGBOX_FAST_HISTORY];
	__s64 acc[AGGBOX_FAST_ELEMS] __attribute__((aligned(64)));
};
_Static_assert(__builtin_offsetof(struct aggbox_fast_slot, token) == 64, "a join's fields in the first line");
_Static_assert(__builtin_offsetof(struct aggbox_fast_slot, state) == 4, "the control plane reads state at 4");
_Static_assert(sizeof(struct aggbox_fast_slot) % 64 == 0, "slots start on a cache line");

/* Value of the job_round array (xdp_maps.h): one cache line. */
struct aggbox_job_round {
	__u32 newest; /* newest completed round, valid if valid != 0 */
	__u32 valid;
	__u32 pad[14];
};
_Static_assert(sizeof(struct aggbox_job_round) == 64, "a cache line");

#endif /* AGGBOX_SLOT_H */
