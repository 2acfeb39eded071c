// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * AggBox XDP aggregator: parse and validate AGG1 contributions (PROTOCOL.md,
 * "Semantics at the aggregator").
 *
 * Ethernet [+ one VLAN tag] / IPv4 (IHL honoured) or IPv6 / UDP to a job
 * port / AGG1 (aggbox_parse_l3: what either IP version may carry). Anything
 * else goes to the stack untouched (outcome NOT_AGGBOX). Every datagram ends
 * in aggbox_exit() (stats.h), which counts the outcome or the drop reason
 * and returns the verdict.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"
#include "parse.h"
#include "slot.h"
#include "scratch.h"
#include "xdp_maps.h"
#include "stats.h"
#include "tailcall.h"
#include "handoff.h"
#include "chain.h"
#include "ops.h"
#define UDP_CSUM_SCRATCH struct aggbox_scratch
#include "udp_csum.h"

/* Internal code of a chain stage: more chunks to go (never counted). */
#define AGGBOX_CONTINUE 100

#define EEXIST 17

/* The two big-endian int32 elements of a 64-bit load after bswap64: the
 * first is the high half (one arithmetic shift sign-extends it). */
#define PAIR_FIRST(y) ((__s64)(y) >> 32)
#define PAIR_SECOND(y) ((__s64)((y) << 32) >> 32)
#define INT32_MAX_ ((__s64)0x7fffffff)
#define INT32_MIN_ (-(__s64)0x80000000)

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/*
 * The chain is built twice in this object, from the same code (docs/JUMBO.md,
 * "Kernels without multi-buffer XDP"); every stage takes a compile-time
 * `linear` that the SEC() wrappers at the end of each stage fix:
 *
 * - frags chain (linear = 0; "xdp.frags", kernels >= 5.18): frames of any
 *   size, payload through bpf_xdp_load_bytes/store_bytes, up to
 *   AGGBOX_PROG_CHUNKS chunks per program run with bpf_loop.
 * - linear chain (linear = 1; "xdp", the *_linear programs): single-buffer
 *   frames only (the MTU-bounded mode), direct packet access, one chunk per
 *   program run, bounded loops instead of bpf_loop, so it uses no helper
 *   newer than 5.15 (tests/bpf_linear.rs checks the helper ids).
 *
 * The control plane loads one of the two sets (Dataplane::load_chain probes
 * the kernel's helpers) and fills that set's prog array (progs or
 * progs_linear, xdp_maps.h: a prog array only holds programs of one frags
 * flag, so each set has its own).
 */

/* Bytes of the whole frame (fragments included). */
static __always_inline __u32 frame_len(struct xdp_md *ctx, const int linear)
{
	if (linear)
		return (__u32)(ctx->data_end - ctx->data);
	return bpf_xdp_get_buff_len(ctx);
}

/*
 * Run cb(i, data) for i = 0.. until n calls are made or cb returns nonzero:
 * bpf_loop in the frags chain; in the linear chain a bounded loop of at most
 * `max` calls (bpf_loop is 5.17+).
 */
#define chain_loop(linear, n, max, cb, data)                          \
	do {                                                          \
		if (linear) {                                         \
			__u32 i_;                                     \
			for (i_ = 0; i_ < (max); i_++)                \
				if (i_ >= (n) || cb(i_, (data)))      \
					break;                        \
		} else {                                              \
			bpf_loop((n), cb, (data), 0);                 \
		}                                                     \
	} while (0)

/*
 * Copy s->chunk_n (<= AGGBOX_CHUNK_ELEMS) elements between the packet at
 * byte `off` and s->buf (to_pkt: buf -> packet), the linear chain's
 * bpf_xdp_load_bytes / store_bytes: direct packet access, one bounds check
 * per element. Returns 0, or -1 when the frame ends first (a validated
 * length: a bug).
 *
 * Written for the verifier, which walks the loop once per element count it
 * could exit at:
 * - a BPF-to-BPF call, not inlined, so every exit returns to one caller
 *   state with 0 or -1;
 * - the count is read from memory, not passed: an argument is the caller's
 *   register, and each exit (`j >= n` at j = k) would pin that register to
 *   exactly k, so the caller's continuation could never be pruned (past 1M
 *   instructions for the add stage);
 * - one cursor, checked and accessed as the same register: older verifiers
 *   (6.1) carry a data_end check only over to that register, not to a
 *   pointer recomputed as data + off + 4 * j.
 */
static __noinline int linear_copy(struct xdp_md *ctx, __u32 off, struct aggbox_scratch *s, int to_pkt)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *cur = (void *)(long)ctx->data;
	__u32 j, n = *(volatile __u32 *)&s->chunk_n;

	if (off > AGGBOX_LINEAR_MAX_FRAME || n > AGGBOX_CHUNK_ELEMS)
		return -1;
	cur += off;
	for (j = 0; j < AGGBOX_CHUNK_ELEMS; j++) {
		if (j >= n)
			break;
		if (cur + 4 > data_end)
			return -1;
		if (to_pkt)
			*(__be32 *)cur = s->buf[j];
		else
			s->buf[j] = *(__be32 *)cur;
		cur += 4;
	}
	return 0;
}

/* len payload bytes at `off` into s->buf, or out of it (to_pkt), either
 * chain. */
static __always_inline int payload_copy(struct xdp_md *ctx, __u32 off, struct aggbox_scratch *s, __u32 len,
					const int to_pkt, const int linear)
{
	if (linear) {
		s->chunk_n = len / 4;
		return linear_copy(ctx, off, s, to_pkt);
	}
	if (to_pkt)
		return bpf_xdp_store_bytes(ctx, off, s->buf, len);
	return bpf_xdp_load_bytes(ctx, off, s->buf, len);
}

/* Chunks of a fragment of `count` elements (count <= AGGBOX_MAX_ELEMS). */
static __always_inline __u32 chunks_of(__u32 count)
{
	return (count + AGGBOX_CHUNK_ELEMS - 1) / AGGBOX_CHUNK_ELEMS;
}

static __always_inline void blocks_used_add(__s64 delta)
{
	__u32 zero = 0;
	__u64 *used = bpf_map_lookup_elem(&blocks_used, &zero);

	if (used)
		__sync_fetch_and_add(used, delta);
}

/* bpf_loop context of taking blocks for a new slot: the indexes go to
 * init->slot.b.block (looked up per call: a callback gets no map value
 * pointer from its caller that the verifier keeps). */
struct blocks_take {
	struct aggbox_slot_key key;
	__u32 taken;                /* indexes popped so far */
};

/*
 * bpf_loop callback: take block `index` of bl->key from the pool and make
 * it the key's: under its lock (a contributor of the block's previous owner
 * may still hold its index) the key and index change and `seen` goes to 0,
 * so that contributor sees a reused block and the first adder stores.
 */
static long block_take_cb(__u64 index, void *data)
{
	struct blocks_take *bl = data;
	struct aggbox_init *init;
	struct aggbox_block *blk;
	__u32 zero = 0, idx = 0;

	if (index >= AGGBOX_MAX_CHUNKS)
		return 1;
	init = bpf_map_lookup_elem(&slot_init, &zero);
	if (!init || bpf_map_pop_elem(&free_blocks, &idx))
		return 1; /* pool empty (or contended): bl->taken < wanted */
	init->slot.b.block[index] = (__u16)idx;
	bl->taken = (__u32)index + 1;
	blk = bpf_map_lookup_elem(&blocks, &idx);
	if (!blk)
		return 1; /* an index the control plane never pushed: a bug */
	bpf_spin_lock(&blk->lock);
	blk->b.key = bl->key;
	blk->b.index = (__u32)index;
	blk->b.seen = 0;
	bpf_spin_unlock(&blk->lock);
	return 0;
}

/* bpf_loop context of giving blocks back: the indexes are copied here (a
 * deleted header's memory may be reused at once; the stack is safe). */
struct blocks_give {
	__u16 block[AGGBOX_MAX_CHUNKS];
	__u32 given;
};

/* bpf_loop callback: give block `index` of the list back to the pool. A
 * push only fails if the stack's lock cannot be taken (a kernel with
 * resilient spin locks gives up after a deadlock check or timeout); the
 * block is then lost to the pool and stays counted in blocks_used, where
 * the metrics show it (aggbox_blocks_in_use). */
static __always_inline int block_give(__u32 idx)
{
	return !bpf_map_push_elem(&free_blocks, &idx, 0);
}

static long block_give_cb(__u64 index, void *data)
{
	struct blocks_give *bg = data;

	if (index >= AGGBOX_MAX_CHUNKS)
		return 1;
	bg->given += block_give(bg->block[index]);
	return 0;
}

/*
 * Give the first n blocks of `block` back to the pool. Only the program
 * that deleted the slot header listing them (or that took them and never
 * published a header) calls this, so each block is given back once.
 */
static __always_inline void blocks_give(const __u16 *block, __u32 n, const int linear)
{
	struct blocks_give bg;
	__u32 i, given = 0;

	if (n > AGGBOX_MAX_CHUNKS)
		n = AGGBOX_MAX_CHUNKS;
	if (linear) {
		/* A bounded loop reads the list where it is (a per-CPU map or
		 * the caller's copy): the 132-byte copy a bpf_loop context
		 * needs would take the linear result stage's stack, with the
		 * chunk function it calls, past 512 bytes (6.1 counts them
		 * together). */
		for (i = 0; i < AGGBOX_MAX_CHUNKS; i++) {
			if (i >= n)
				break;
			given += block_give(block[i]);
		}
		blocks_used_add(-(__s64)given);
		return;
	}
	__builtin_memcpy(bg.block, block, sizeof(bg.block));
	bg.given = 0;
	bpf_loop(n, block_give_cb, &bg, 0);
	blocks_used_add(-(__s64)bg.given);
}

/* job_state entry of the job at dense index jidx. */
static __always_inline struct aggbox_job_state *job_state_of(__u32 jidx)
{
	return bpf_map_lookup_elem(&job_state, &jidx);
}

/* Dense index of job `job`, or -1 when it is not configured (control-plane
 * rate paths: reclaim, discard; the datagram path has it in scratch). */
static __always_inline int job_index_of(__u16 job)
{
	__u32 key = job, *v = bpf_map_lookup_elem(&job_index, &key);

	if (!v || *v == 0 || *v > AGGBOX_MAX_JOBS)
		return -1;
	return (int)(*v - 1);
}

/* ---------------------------------------------------------------------------
 * Fast slots (docs/DATAPLANE.md "Fast slots"): a contribution of at most
 * AGGBOX_FAST_ELEMS elements of a job with a fast-slot region is aggregated
 * by the entry program itself, with no tail call and no hash-map slot: its
 * slot is fast_slots[job.fast_base + (seq & (job.fast_slots - 1))], seq =
 * round * ceil(vector_len / granule) + frag_off / granule, and the whole
 * contribution (rank claim, adds straight from the packet, completion
 * count) takes one lock acquisition. The fragment's slot holds its key; a
 * fragment whose slot is busy with another live fragment, or that is older
 * than the one in it, goes the hash-map way (CALL_SLOT) with every rule of
 * that path (slot_owner, user-space hand-off, pool bounds, completed
 * markers). Which of the two paths serves a fragment is settled by a
 * handshake in which each side publishes first and then looks at the
 * other: the taker of a fast slot marks it CLAIMING and then looks for a
 * slot_owner record or completed marker of the key; the hash-map path
 * inserts its slot_owner record and then looks at the fast slot under its
 * lock (fast_check). At least one side sees the other; a CLAIMING slot
 * loses to the hash-map path, an ACTIVE one wins.
 * ------------------------------------------------------------------------- */

/*
 * A header offset from scratch, bounded in the register that then offsets
 * a packet pointer: older verifiers (6.1) keep a bound only on the register
 * that was compared, and a packet pointer whose variable part may reach
 * 64 KiB gets no range from a data_end check at all.
 */
#define FAST_BOUNDED_OFF(var, field)             \
	do {                                     \
		var = (field);                   \
		asm volatile("" : "+r"(var));    \
		var &= 0xff; /* <= 128 once classified; no branch: no second verifier path */ \
		asm volatile("" : "+r"(var));    \
	} while (0)

/* The per-CPU scratch (into *sp) and the fast slot its fast_idx names. */
static __always_inline struct aggbox_fast_slot *fast_slot_of(struct aggbox_scratch **sp)
{
	__u32 zero = 0, idx;

	*sp = bpf_map_lookup_elem(&scratch, &zero);
	if (!*sp)
		return NULL;
	idx = (*sp)->fast_idx;
	return bpf_map_lookup_elem(&fast_slots, &idx);
}

/*
 * A fast slot's lock: one word taken with a cmpxchg and given back with an
 * xchg (both full barriers on every architecture), not a bpf_spin_lock.
 * bpf_spin_lock is a helper call that also saves, disables and restores
 * interrupts around its lock word: ~50 ns per acquisition on the VMs this
 * was measured on (docs/BENCHMARKS.md), a quarter of a 362-element
 * contribution's whole cost, where the two atomic instructions take a few
 * ns. Interrupts need not be off: XDP runs with bottom halves disabled, so
 * no other XDP run on the same CPU can start while one holds a slot; a
 * holder is only ever delayed by a hard interrupt or by its vCPU being
 * descheduled. A waiter therefore spins a bounded number of times
 * (FAST_LOCK_SPINS; a bounded loop, as the linear chain runs on 5.15
 * without bpf_loop) and then gives up: a contribution is dropped as
 * slot_busy (its sender resends it), the other users retry or leave the
 * slot to the control plane's reclaim. Nothing may call a helper that can
 * sleep or run another program while holding it (none of the fast path's
 * do).
 */
#define FAST_LOCK_SPINS_INNER 1024 /* the verifier's jump history bounds one loop's walk */
#define FAST_LOCK_ROUNDS 16
#define FAST_LOCK_SPINS (FAST_LOCK_ROUNDS * FAST_LOCK_SPINS_INNER)

/* FAST_LOCK_SPINS_INNER tries for the lock of fast slot idx: 0 taken, -1
 * still held. A global function: the verifier walks its loop once. */
__noinline int fast_lock_spin(__u32 idx)
{
	struct aggbox_fast_slot *f = bpf_map_lookup_elem(&fast_slots, &idx);
	__u32 i;

	if (!f)
		return -1;
	for (i = 0; i < FAST_LOCK_SPINS_INNER; i++)
		if (*(volatile __u32 *)&f->lock == 0 && __sync_val_compare_and_swap(&f->lock, 0, 1) == 0)
			return 0;
	return -1;
}

/* Spin for the lock of fast slot idx (its first try failed): 0 taken, -1
 * still held after FAST_LOCK_SPINS tries (tens of microseconds). */
__noinline int fast_lock_wait(__u32 idx)
{
	__u32 r;

	for (r = 0; r < FAST_LOCK_ROUNDS; r++)
		if (fast_lock_spin(idx) == 0)
			return 0;
	return -1;
}

/* Take the lock of fast slot f (index idx): 0 taken, -1 busy past the bound. */
static __always_inline int fast_lock(struct aggbox_fast_slot *f, __u32 idx)
{
	if (__sync_val_compare_and_swap(&f->lock, 0, 1) == 0)
		return 0;
	return fast_lock_wait(idx);
}

static __always_inline void fast_unlock(struct aggbox_fast_slot *f)
{
	__sync_lock_test_and_set(&f->lock, 0);
}

/*
 * The RESULT's seq (PROTOCOL.md leaves it to the aggregator; docs/PROTOCOL.md
 * "Differences"): for a job whose results go upstream, this node's own
 * counter `own`, since the RESULT becomes its contribution to the parent and
 * is numbered like one; otherwise the seq of the contribution that completed
 * the slot, left where it is: runtime workers number a fragment's
 * contributions alike, so it names the fragment to the node's result service
 * (ACKs on the kernel's behalf, retransmission of RESULT copies).
 */
static __always_inline void result_seq_write(struct aggbox_agg_hdr *agg, struct aggbox_scratch *s,
					     struct aggbox_job_state *js)
{
	/* Drawn only where it is written: an atomic on the job's shared
	 * state line per completion costs a cache-line transfer between
	 * CPUs, and no other RESULT carries it. */
	if (s->has_parent && js)
		agg->seq = bpf_htonl(__sync_fetch_and_add(&js->result_seq, 1));
}

/* Internal codes of the fast path (never counted under these values). */
#define FAST_NOT_MINE 102 /* the fast slot does not hold this fragment */
#define FAST_CLAIMED  105 /* fast_join took the free slot for this fragment (CLAIMING) */
#define FAST_EXACT    106 /* fast_payload: the exact pass (fast_write_exact) is needed */
#define AGGBOX_GO_FAST 104 /* hash-map path: the fragment's fast slot serves it */
#define FAST_SLOW     103 /* the hash-map path serves this fragment */

static __always_inline void fast_count(__u32 what)
{
	__u64 *c = bpf_map_lookup_elem(&fast_stats, &what);

	if (c)
		*c += 1; /* per-CPU, migration disabled */
}

/*
 * Whether the contribution's job has a fast-slot region: then every
 * contribution of it has a fast slot index (scratch.fast_idx), and the
 * hash-map path does the handshake with that slot (fast_check) whatever
 * the contribution's count, so that one fragment never lives on both.
 */
static __always_inline int fast_job(struct aggbox_scratch *s)
{
	return s->fast_slots != 0;
}

/* Whether the contribution fits a fast slot (may take or join one). */
static __always_inline int fast_fits(struct aggbox_scratch *s)
{
	return s->count <= AGGBOX_FAST_ELEMS;
}

/* Index of the contribution's fast slot: round * stride + frag_off /
 * granule in the job's region (power-of-two size). The granule is the
 * job's full-fragment size where that fits a fast slot, so the fragments
 * in flight fill consecutive slots and touch as few pages as the slots'
 * bytes need (a sparser index costs a TLB miss per fragment under live
 * traffic: docs/DATAPLANE.md "Fast slots"). */
static __always_inline __u32 fast_index(struct aggbox_scratch *s)
{
	__u32 seq = s->key.round * s->fast_stride + s->key.frag_off / s->fast_granule;

	return s->fast_base + (seq & (s->fast_slots - 1));
}

/* Whether fast slot f holds the fragment of s (under its lock). */
static __always_inline int fast_holds(struct aggbox_fast_slot *f, struct aggbox_scratch *s)
{
	return f->state != FAST_EMPTY && f->job == s->key.job && f->round == s->key.round &&
	       f->frag_off == s->key.frag_off;
}

/* Undo a take-over that has not committed (under the lock). */
static __always_inline void fast_restore(struct aggbox_fast_slot *f)
{
	if (f->prev_state == FAST_DONE && f->prev_valid) {
		f->round = f->prev_round;
		f->frag_off = f->prev_frag_off;
		f->state = FAST_DONE;
	} else {
		f->state = FAST_EMPTY;
	}
	f->prev_valid = 0;
	f->token = 0;
}

/* Whether f completed the fragment of s before the key it holds now: `prev`
 * or one of the history ring's keys (under its lock). */
static __always_inline int fast_held_before(struct aggbox_fast_slot *f, struct aggbox_scratch *s)
{
	__u32 i;

	if (f->job != s->key.job)
		return 0;
	if (f->prev_valid && f->prev_round == s->key.round && f->prev_frag_off == s->key.frag_off)
		return 1;
	/* Return at a hit: a flag OR-ed in would differ between the branches
	 * and the verifier would walk every combination of them. */
#pragma unroll
	for (i = 0; i < AGGBOX_FAST_HISTORY; i++)
		if (((f->hist_valid >> i) & 1) && f->hist_round[i] == s->key.round &&
		    f->hist_frag_off[i] == s->key.frag_off)
			return 1;
	return 0;
}

/* A take-over moves the completed `prev` key into the history ring (under
 * the lock); a slot passing to another job forgets its history. */
static __always_inline void fast_remember_prev(struct aggbox_fast_slot *f, __u16 job)
{
	__u32 at = f->hist_next & (AGGBOX_FAST_HISTORY - 1);

	if (f->job != job) {
		f->hist_valid = 0;
		return;
	}
	if (!f->prev_valid)
		return;
	f->hist_round[at] = f->prev_round;
	f->hist_frag_off[at] = f->prev_frag_off;
	f->hist_valid |= 1u << at;
	f->hist_next = at + 1;
}

/*
 * Release the hash-map slot of `key` (if any) that will never complete: the
 * daemon's stale-slot reclaim (aggbox_reclaim) and a fast slot that won the
 * handshake over a hash-map slot made meanwhile. Under the slot's lock: a
 * slot whose contributions are all done is completing (finish_result deletes
 * it and gives its reservation back) and is left alone; otherwise it is
 * poisoned (workers = 0xffff, so no contributor still in the chain can
 * complete it; the stored key changed, so a contributor that looked it up
 * before the delete sees a reused element and counts a retransmission).
 * Then it is deleted with its slot_owner record, and the reservation and
 * its blocks (indexes copied under the lock) are given back only if this
 * delete removed it.
 *
 * Returns XDP_PASS released, XDP_DROP no such slot, XDP_TX completing or
 * reused (left alone).
 */
static __always_inline int slot_release(struct aggbox_slot_key *key)
{
	struct aggbox_job_state *js;
	struct aggbox_slot *slot;
	struct blocks_give bg;
	__u32 count;
	int busy = 0, jidx;

	slot = bpf_map_lookup_elem(&slots, key);
	if (!slot)
		return XDP_DROP;
	bpf_spin_lock(&slot->lock);
	count = slot->b.count;
	if (slot->b.key.job != key->job || slot->b.key.round != key->round ||
	    slot->b.key.frag_off != key->frag_off || slot->b.done >= slot->b.workers) {
		busy = 1;
	} else {
		slot->b.workers = 0xffff;
		slot->b.key.round = ~key->round;
		__builtin_memcpy(bg.block, slot->b.block, sizeof(bg.block));
	}
	bpf_spin_unlock(&slot->lock);
	if (busy)
		return XDP_TX;
	if (bpf_map_delete_elem(&slots, key))
		return XDP_DROP;
	bpf_map_delete_elem(&slot_owner, key);
	if (count <= AGGBOX_MAX_ELEMS)
		blocks_give(bg.block, chunks_of(count), 1); /* no bpf_loop: loads on every kernel */
	jidx = job_index_of(key->job);
	js = jidx < 0 ? NULL : job_state_of((__u32)jidx);
	if (js)
		__sync_fetch_and_sub(&js->active_slots, 1);
	return XDP_PASS;
}

/*
 * Raise job_state.newest_round to `round` (serial order) and mark the job as
 * having completed a slot (job_state.completed, set once: its newest_round
 * is valid from then on): both paths' completions. Completions are counted
 * per CPU (job_stats.results), not here: job_state's line is written by
 * every take, and each further atomic on it is one more transfer of that
 * line between CPUs per fragment. A round that job_round (written only when
 * a newer round completes, and after job_state, both only ever raised)
 * already covers needs no write at all.
 */
static __always_inline void job_completed(struct aggbox_job_state *js, __u32 jidx, __u32 round)
{
	struct aggbox_job_round *jr = bpf_map_lookup_elem(&job_round, &jidx);
	__u32 cur, i;

	if (jr && jr->valid && aggbox_rounds_ahead(round, jr->newest) <= 0)
		return;
	for (i = 0; i < 4; i++) {
		cur = js->newest_round;
		if (js->completed && aggbox_rounds_ahead(round, cur) <= 0)
			break;
		if (__sync_val_compare_and_swap(&js->newest_round, cur, round) == cur)
			break;
	}
	if (!js->completed)
		__sync_val_compare_and_swap(&js->completed, 0, 1);
	/* The stale-round rule's copy, written only when the round is newer
	 * (once per round, not per fragment). */
	if (jr) {
		for (i = 0; i < 4; i++) {
			cur = jr->newest;
			if (jr->valid && aggbox_rounds_ahead(round, cur) <= 0)
				break;
			if (__sync_val_compare_and_swap(&jr->newest, cur, round) == cur) {
				if (!jr->valid)
					jr->valid = 1;
				break;
			}
		}
	}
}

/* Whether `round` is stale for the job at jidx (older than the newest
 * completed round of either path minus the window). Reads job_round, whose
 * cache line changes once per round, not job_state, which every fragment's
 * take and completion write. */
static __always_inline int round_is_stale(struct aggbox_scratch *s, struct aggbox_job_handoff *ho)
{
	struct aggbox_job_round *jr = bpf_map_lookup_elem(&job_round, &s->jidx);

	if (jr && jr->valid && aggbox_rounds_ahead(jr->newest, s->key.round) > (__s32)s->window)
		return 1;
	return ho && ho->completed && aggbox_rounds_ahead(ho->newest_round, s->key.round) > (__s32)s->window;
}

/* The one element of an odd count, at element index i (i < AGGBOX_FAST_ELEMS). */
static __always_inline int fast_load_last(struct aggbox_scratch *s, void *payload, void *data_end, __u32 i,
					  int use_buf, __s64 *v)
{
	__be32 *e;

	if (i >= AGGBOX_FAST_ELEMS)
		return -1;
	if (use_buf) {
		*v = (__s32)bpf_ntohl(s->buf[i]);
		return 0;
	}
	e = payload + 4 * (__u64)i;
	if ((void *)(e + 1) > data_end)
		return -1;
	*v = (__s32)bpf_ntohl(*e);
	return 0;
}

/*
 * Add the contribution into f (under its lock), op-specialised. The
 * payload is read straight from the packet (or scratch.buf with use_buf, a
 * compile-time constant) in blocks of FAST_BLOCK pairs of elements (one
 * 64-bit load each: after bswap64 the first big-endian int32 is the high
 * half), one bounds check and one count check per block, the block
 * unrolled; then the last < FAST_BLOCK pairs one by one. The body sees a, c (the pair), i (its first index),
 * dst (where the pair was read: the fused SUM writes the RESULT pair back
 * there) and wide (OR-ed into scratch.fast_wide after each block: never
 * branched on, so no second verifier path).
 */
#define FAST_BLOCK 8
_Static_assert(FAST_PAIRS % FAST_BLOCK == 0, "whole blocks");

#define FAST_NP (*(volatile __u32 *)&s->fast_npairs)
#define FAST_LOOP(...)                                                                    \
	do {                                                                              \
		const __u64 *p = payload;                                                 \
		__u32 b, k, j0;                                                           \
		void *pkt, *pkt_end;                                                      \
		for (b = 0; b < FAST_PAIRS / FAST_BLOCK; b++) {                           \
			if (FAST_BLOCK * (b + 1) > FAST_NP)                               \
				break;                                                    \
			if (!use_buf && (void *)(p + FAST_BLOCK) > data_end)              \
				break; /* validated length: never */                      \
			__u64 wide = 0;                                                   \
			_Pragma("unroll") for (k = 0; k < FAST_BLOCK; k++)                \
			{                                                                 \
				__u64 *dst = use_buf ? &((__u64 *)s->buf)[FAST_BLOCK * b + k] \
						     : (__u64 *)&p[k];                    \
				__u64 y = __builtin_bswap64(*dst);                        \
				__s64 a = PAIR_FIRST(y), c = PAIR_SECOND(y);              \
				__u32 i = 2 * (FAST_BLOCK * b + k);                       \
				__VA_ARGS__;                                              \
			}                                                                 \
			s->fast_wide |= wide;                                             \
			p += FAST_BLOCK;                                                  \
		}                                                                         \
		/* The last < FAST_BLOCK pairs, indexed from scratch and a fresh      \
		 * packet pointer: nothing of the block loop's exit (b, p and the     \
		 * packet range it proved) is live here, so the verifier walks this   \
		 * once, not once per exit of the loop above. */                      \
		j0 = FAST_NP & ~(__u32)(FAST_BLOCK - 1);                                  \
		pkt = (void *)(long)ctx->data;                                            \
		pkt_end = (void *)(long)ctx->data_end;                                    \
		for (k = 0; k < FAST_BLOCK; k++) {                                        \
			__u64 *q, *dst, y, wide = 0;                                      \
			__u32 i, off;                                                     \
			__s64 a, c;                                                       \
			if (j0 + k >= FAST_NP)                                            \
				break;                                                    \
			i = 2 * (j0 + k);                                                 \
			asm volatile("" : "+r"(i)); /* bound this register */             \
			if (i > AGGBOX_FAST_ELEMS - 2)                                    \
				break;                                                    \
			if (use_buf) {                                                    \
				dst = &((__u64 *)s->buf)[i / 2];                          \
			} else {                                                          \
				FAST_BOUNDED_OFF(off, s->agg_off);                        \
				q = pkt + off + sizeof(struct aggbox_agg_hdr) + 4 * i;    \
				if ((void *)(q + 1) > pkt_end)                            \
					break;                                            \
				dst = q;                                                  \
			}                                                                 \
			y = __builtin_bswap64(*dst);                                      \
			a = PAIR_FIRST(y);                                                \
			c = PAIR_SECOND(y);                                               \
			__VA_ARGS__;                                                      \
			s->fast_wide |= wide;                                             \
		}                                                                         \
	} while (0)

static __always_inline void fast_add(struct xdp_md *ctx, struct aggbox_fast_slot *f, struct aggbox_scratch *s,
				     void *payload, void *data_end, const int use_buf, __u8 op, __s64 w)
{
	__s64 *acc = f->acc;

	/*
	 * One loop per op: MIN keeps the maximum of the negated values
	 * (fast_payload negates it back), and a SUM of weight 1 multiplies
	 * by 1.
	 */
	if (op == AGGBOX_OP_COUNT)
		FAST_LOOP({ acc[i] += a != 0; acc[i + 1] += c != 0; });
	else if (op == AGGBOX_OP_MAX || op == AGGBOX_OP_MIN)
		FAST_LOOP({
			a *= w;
			c *= w;
			if (a > acc[i])
				acc[i] = a;
			if (c > acc[i + 1])
				acc[i + 1] = c;
		});
	else /* SUM, AVG */
		FAST_LOOP({ acc[i] += w * a; acc[i + 1] += w * c; });
}

/*
 * The first contribution of a linear frame stores (fast_add's values):
 * nothing fills a taken slot's accumulators. A multi-buffer frame's first
 * contribution fills them with the op's identity (0, or INT64_MIN for MAX
 * and MIN) and adds: one loop fewer for the verifier on a rare path.
 */
static __always_inline void fast_store(struct xdp_md *ctx, struct aggbox_fast_slot *f, struct aggbox_scratch *s,
				       void *payload, void *data_end, __u8 op, __s64 w)
{
	const int use_buf = 0;
	__s64 *acc = f->acc;

	if (op == AGGBOX_OP_COUNT)
		FAST_LOOP({ acc[i] = a != 0; acc[i + 1] = c != 0; });
	else /* SUM, AVG; MAX and MIN with w the sign */
		FAST_LOOP({ acc[i] = w * a; acc[i + 1] = w * c; });
}

/*
 * One pair of the last SUM contribution's pass (fast_sum_result, fast_w1):
 * the sums (of the weighted pair wa, wc) into the accumulators, their
 * int32 halves over the pair in the packet (dst), `wide` nonzero if one
 * does not fit. Pair by pair (the empty asm): scheduled across the block,
 * clang keeps every pair's values for the block's end and spills ~200
 * bytes, more than the call chain's stack (512 in all) has room for.
 */
#define FAST_SUM_RESULT_PAIR(wa, wc)                                              \
	{                                                                         \
		__s64 ra = acc[i] + (wa), rc = acc[i + 1] + (wc);                 \
                                                                                  \
		acc[i] = ra;                                                      \
		acc[i + 1] = rc;                                                  \
		wide |= (ra ^ (__s64)(__s32)ra) | (rc ^ (__s64)(__s32)rc);        \
		*dst = __builtin_bswap64(((__u64)ra << 32) | (__u32)rc);          \
		asm volatile("" : "+r"(wide) : : "memory");                       \
	}

/*
 * The last contribution of a SUM in a linear frame: adds and writes the
 * RESULT pair over its own payload in the same pass (the completion then
 * does not read the accumulators again); scratch.fast_wide gets nonzero
 * when some value does not fit int32 (then fast_write_exact rewrites it,
 * clamped, from the accumulators, which keep the sums).
 */
static __always_inline void fast_sum_result(struct xdp_md *ctx, struct aggbox_fast_slot *f,
					    struct aggbox_scratch *s, void *payload, void *data_end, __s64 w)
{
	const int use_buf = 0;
	__s64 *acc = f->acc;

	FAST_LOOP(FAST_SUM_RESULT_PAIR(w * a, w * c));
}

/*
 * The weight-1 SUM loops (and MAX's store), the common case of a linear
 * frame: without the multiply, two of the 14 instructions a pair costs.
 * A global function of its own: the verifier walks its three loops once,
 * not once per state in which fast_join reaches its adds (inline they
 * would cost the entry program ~0.14 M verified instructions). Called
 * under the slot's lock by fast_join (which has checked that the payload
 * is in the frame, n <= AGGBOX_FAST_ELEMS and scratch.fast_npairs is set);
 * `what`: FAST_W1_STORE, FAST_W1_ADD or FAST_W1_RESULT (fast_store,
 * fast_add, fast_sum_result with w = 1). 0 when done; nonzero, having
 * written nothing, when its lookups fail.
 */
#define FAST_W1_STORE 0
#define FAST_W1_ADD 1
#define FAST_W1_RESULT 2
__noinline int fast_w1(struct xdp_md *ctx, __u32 what)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	const int use_buf = 0;
	struct aggbox_fast_slot *f;
	struct aggbox_scratch *s;
	void *payload;
	__u32 agg_off;
	__s64 *acc;

	f = fast_slot_of(&s);
	if (!f)
		return -1;
	acc = f->acc;
	FAST_BOUNDED_OFF(agg_off, s->agg_off);
	payload = data + agg_off + sizeof(struct aggbox_agg_hdr);
	if (what == FAST_W1_STORE) {
		FAST_LOOP({ acc[i] = a; acc[i + 1] = c; });
	} else if (what == FAST_W1_ADD) {
		FAST_LOOP({ acc[i] += a; acc[i + 1] += c; });
	} else {
		FAST_LOOP(FAST_SUM_RESULT_PAIR(a, c));
	}
	return 0;
}

/* Every accumulator of f to `ident` (a multi-buffer frame's first contribution). */
static __always_inline void fast_fill(struct aggbox_fast_slot *f, __s64 ident)
{
	__u32 j;

	for (j = 0; j < AGGBOX_FAST_ELEMS; j++)
		f->acc[j] = ident;
}

/* One element of an odd count, added like the loops above (under the lock). */
static __always_inline void fast_add_one(__s64 *acc, __s64 v, __u8 op, __s64 w, __u32 first)
{
	if (first)
		*acc = op == AGGBOX_OP_COUNT ? v != 0 : w * v;
	else if (op == AGGBOX_OP_COUNT)
		*acc += v != 0;
	else if (op == AGGBOX_OP_MAX || op == AGGBOX_OP_MIN)
		*acc = w * v > *acc ? w * v : *acc;
	else
		*acc += w * v;
}

/*
 * The completing contribution turns its own packet into the RESULT (the
 * slot is RESULTING: nobody else writes it, no take-over): fast_payload
 * writes the payload, fast_commit the rest, counts the completion and marks
 * the slot DONE. With use_buf the payload is written into scratch.buf and
 * the caller stores it (bpf_xdp_store_bytes is not a helper of the linear
 * chain's kernels).
 *
 * The common case is one pass: each pair of accumulators is written as
 * int32 and OR-ed into a word that is nonzero when some value did not fit;
 * then (rare: OVERFLOW, or AVG) a second pass (fast_write_exact) writes the
 * exact clamped and divided values. Nothing per element is kept on the
 * stack, so the verifier's walk stays linear. Global functions: each is
 * checked once.
 */
#define FAST_STORE_PAIR(y, j)                                                 \
	if (use_buf) {                                                        \
		((__u64 *)s->buf)[j] = __builtin_bswap64(y);                  \
	} else {                                                              \
		if ((void *)(p + 1) > data_end)                               \
			break;                                                \
		*p = __builtin_bswap64(y);                                    \
		p++;                                                          \
	}

static __always_inline __s64 fast_clamp(__s64 r)
{
	if (r > INT32_MAX_)
		return INT32_MAX_;
	if (r < INT32_MIN_)
		return INT32_MIN_;
	return r;
}

/*
 * Two result elements, exactly: AVG divided, both clamped to int32, packed
 * as (first << 32 | second). A clamped element sets scratch.overflow
 * (the second only if `second_real`: an odd count's last pair holds one
 * accumulator past the fragment). A global function, so that its branches
 * are verified once and not once per element of the caller's loop.
 */
__noinline __u64 fast_exact_pair(__s64 a, __s64 b, __u32 ws, __u32 op, __u32 second_real)
{
	struct aggbox_scratch *s;
	__s64 ca, cb;
	__u32 zero = 0;

	if (op == AGGBOX_OP_MIN) {
		a = -a; /* fast slots keep MIN as the maximum of the negated values */
		b = -b;
	}
	a = aggbox_op_finish(op, a, ws);
	b = aggbox_op_finish(op, b, ws);
	ca = fast_clamp(a);
	cb = fast_clamp(b);
	if (ca != a || (cb != b && second_real)) {
		s = bpf_map_lookup_elem(&scratch, &zero);
		if (s)
			s->overflow = 1;
	}
	return ((__u64)ca << 32) | (__u32)cb;
}

/* The payload of the RESULT (fast_payload), into the packet or scratch.buf:
 * use_buf is a compile-time constant, so the loops do not branch on it. */
static __always_inline int fast_write_result(struct xdp_md *ctx, struct aggbox_fast_slot *f,
					      struct aggbox_scratch *s, void *data, void *data_end, __u32 agg_off,
					      __u32 n, __u8 op, __u32 ws, const int use_buf)
{

	__u64 wide = 0, *p;

	/*
	 * The bounds are read from scratch at each use, never kept in a
	 * register: a register compared in the first loop would carry a
	 * different range out of each of its exits, and the verifier would
	 * walk the second loop once per exit.
	 */
	s->fast_npairs = (n + 1) / 2; /* an odd count's last pair holds one stale accumulator */
#define FAST_NPAIRS (*(volatile __u32 *)&s->fast_npairs)
#define FAST_N ((__u32)*(volatile __u16 *)&s->count)

	if (op == AGGBOX_OP_AVG)
		return 1;
	{
		/*
		 * Whole blocks of FAST_BLOCK full pairs: one bounds check and
		 * one count check per block, the block unrolled; then the
		 * remaining pairs (an odd count's last element among them) one
		 * by one, from a fresh packet pointer (see FAST_LOOP).
		 */
		__s64 sign = op == AGGBOX_OP_MIN ? -1 : 1;
		__u32 b, k, j0;
		void *pkt, *pkt_end;

		p = data + agg_off + sizeof(struct aggbox_agg_hdr);
		for (b = 0; b < FAST_PAIRS / FAST_BLOCK; b++) {
			if (FAST_BLOCK * (b + 1) > FAST_N / 2)
				break;
			if (!use_buf && (void *)(p + FAST_BLOCK) > data_end)
				break; /* validated length: never */
#pragma unroll
			for (k = 0; k < FAST_BLOCK; k++) {
				__s64 a = sign * f->acc[2 * (FAST_BLOCK * b + k)];
				__s64 c = sign * f->acc[2 * (FAST_BLOCK * b + k) + 1];
				__u64 y = __builtin_bswap64(((__u64)a << 32) | (__u32)c);

				wide |= (a ^ (__s64)(__s32)a) | (c ^ (__s64)(__s32)c);
				if (use_buf)
					((__u64 *)s->buf)[FAST_BLOCK * b + k] = y;
				else
					p[k] = y;
			}
			p += FAST_BLOCK;
		}
		j0 = (FAST_N / 2) & ~(__u32)(FAST_BLOCK - 1);
		pkt = (void *)(long)ctx->data;
		pkt_end = (void *)(long)ctx->data_end;
		for (k = 0; k < FAST_BLOCK; k++) {
			__u32 i = 2 * (j0 + k), off;
			__s64 a, c;
			__u64 y;
			__u64 *q;

			FAST_BOUNDED_OFF(off, s->agg_off);
			asm volatile("" : "+r"(i)); /* bound this register */
			if (i >= FAST_N || i > AGGBOX_FAST_ELEMS - 2)
				break;
			a = sign * f->acc[i];
			c = sign * f->acc[i + 1];
			if (i + 1 >= FAST_N) {
				/* the odd last element, stored by the caller */
				wide |= a ^ (__s64)(__s32)a;
				s->chunk_n = (__u32)a;
				break;
			}
			wide |= (a ^ (__s64)(__s32)a) | (c ^ (__s64)(__s32)c);
			y = __builtin_bswap64(((__u64)a << 32) | (__u32)c);
			if (use_buf) {
				((__u64 *)s->buf)[i / 2] = y;
			} else {
				q = pkt + off + sizeof(struct aggbox_agg_hdr) + 4 * i;
				if ((void *)(q + 1) > pkt_end)
					break;
				*q = y;
			}
		}
	}
	return wide != 0;
}

/*
 * The exact pass of the RESULT payload (AVG, or some value out of int32):
 * its own global function, so that the verifier walks it once and not once
 * per exit of the first pass's loop.
 */
static __always_inline void fast_write_exact_to(struct xdp_md *ctx, struct aggbox_scratch *s,
						struct aggbox_fast_slot *f, const int use_buf)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	__u32 j, agg_off, ws = f->weight_sum ? f->weight_sum : 1;
	__u8 op = s->op;
	__u64 *p;

	FAST_BOUNDED_OFF(agg_off, s->agg_off);
	{
		/* Exact pass: divide (AVG) and clamp; only real elements set OVERFLOW. */
		p = data + agg_off + sizeof(struct aggbox_agg_hdr);
		for (j = 0; j < FAST_PAIRS; j++) {
			__u64 y;

			if (j >= FAST_NPAIRS)
				break;
			y = fast_exact_pair(f->acc[2 * j], f->acc[2 * j + 1], ws, op, 2 * j + 1 < FAST_N);
			if (2 * j + 1 < FAST_N) {
				FAST_STORE_PAIR(y, j);
			} else {
				s->chunk_n = (__u32)(y >> 32);
				break;
			}
		}
	}
}

__noinline int fast_write_exact(struct xdp_md *ctx, __u32 use_buf)
{
	struct aggbox_fast_slot *f;
	struct aggbox_scratch *s;
	__u32 zero = 0, idx;

	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s)
		return -1;
	idx = s->fast_idx;
	f = bpf_map_lookup_elem(&fast_slots, &idx);
	if (!f)
		return -1;
	if (use_buf)
		fast_write_exact_to(ctx, s, f, 1);
	else
		fast_write_exact_to(ctx, s, f, 0);
	return 0;
}

/*
 * The hash-map path made a slot_owner record (and maybe a slot nobody added
 * to) for a fragment before it saw the fast slot that serves it: drop them
 * once the fast slot completed. A global function: its loops are verified
 * once, not once per state of the caller.
 */
__noinline int fast_spill_cleanup(__u32 job, __u32 round, __u32 frag_off, __u32 jidx)
{
	struct aggbox_slot_key key = { .job = (__u16)job, .round = round, .frag_off = frag_off };
	struct aggbox_job_state *js;
	struct aggbox_slot *slot;
	__u16 block[2];
	__u32 count = 0;
	int busy = 0;

	/* slot_release() for a slot of at most AGGBOX_FAST_ELEMS elements (2
	 * blocks: a small copy keeps the callers' combined stack in bounds). */
	_Static_assert(AGGBOX_FAST_ELEMS <= 2 * AGGBOX_CHUNK_ELEMS, "a fast-eligible slot has <= 2 blocks");
	slot = bpf_map_lookup_elem(&slots, &key);
	if (slot) {
		bpf_spin_lock(&slot->lock);
		count = slot->b.count;
		if (slot->b.key.job != key.job || slot->b.key.round != key.round ||
		    slot->b.key.frag_off != key.frag_off || slot->b.done >= slot->b.workers ||
		    count > AGGBOX_FAST_ELEMS) {
			busy = 1;
		} else {
			slot->b.workers = 0xffff;
			slot->b.key.round = ~key.round;
			block[0] = slot->b.block[0];
			block[1] = slot->b.block[1];
		}
		bpf_spin_unlock(&slot->lock);
		if (!busy && !bpf_map_delete_elem(&slots, &key)) {
			__u32 given = block_give(block[0]);

			if (count > AGGBOX_CHUNK_ELEMS)
				given += block_give(block[1]);
			blocks_used_add(-(__s64)given);
			js = job_state_of(jidx);
			if (js)
				__sync_fetch_and_sub(&js->active_slots, 1);
		}
	}
	bpf_map_delete_elem(&slot_owner, &key);
	return 0;
}

__noinline int fast_payload(struct xdp_md *ctx, __u32 use_buf)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_fast_slot *f;
	struct aggbox_scratch *s;
	__u32 n, ws, agg_off;
	__u8 op;

	f = fast_slot_of(&s);
	if (!f)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	n = s->count;
	FAST_BOUNDED_OFF(agg_off, s->agg_off);
	if (n > AGGBOX_FAST_ELEMS)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	op = s->op;
	ws = f->weight_sum ? f->weight_sum : 1;
	s->overflow = 0;

	if (use_buf ? fast_write_result(ctx, f, s, data, data_end, agg_off, n, op, ws, 1)
		    : fast_write_result(ctx, f, s, data, data_end, agg_off, n, op, ws, 0))
		return FAST_EXACT;
	return 0;
}

/*
 * The RESULT's header once its payload is written (fast_payload, and
 * fast_write_exact when that asked for it): an odd count's last element,
 * rank, seq, flags, destination port. Returns RESULT, or (never: the
 * length was validated) a drop reason.
 */
static __always_inline int fast_result_header(struct xdp_md *ctx, struct aggbox_scratch *s,
					      struct aggbox_fast_slot *f, struct aggbox_job_state *js, __u32 use_buf)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_agg_hdr *agg;
	struct udphdr *udph;
	__u32 n, agg_off, udp_off;
	__u8 flags;

	n = s->count;
	FAST_BOUNDED_OFF(agg_off, s->agg_off);
	FAST_BOUNDED_OFF(udp_off, s->udp_off);
	if (n > AGGBOX_FAST_ELEMS)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	if (n & 1) {
		__u32 i = n - 1;
		__be32 v = bpf_htonl(s->chunk_n);

		if (i >= AGGBOX_FAST_ELEMS)
			return AGGBOX_DROP_MISSED_TAIL_CALL;
		if (use_buf) {
			s->buf[i] = v;
		} else {
			__be32 *e = data + agg_off + sizeof(*agg) + 4 * (__u64)i;

			if ((void *)(e + 1) > data_end)
				return AGGBOX_DROP_MISSED_TAIL_CALL;
			*e = v;
		}
	}

	udph = data + udp_off;
	agg = data + agg_off;
	if ((void *)(udph + 1) > data_end || (void *)(agg + 1) > data_end)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	flags = AGGBOX_AGG_F_RESULT | (f->flags & AGGBOX_AGG_F_CARRIED);
	if (s->overflow)
		flags |= AGGBOX_AGG_F_OVERFLOW;
	agg->rank = bpf_htons(AGGBOX_RESULT_RANK);
	result_seq_write(agg, s, js);
	agg->flags = flags;
	udph->dest = bpf_htons(s->result_port);
	udph->check = 0;
	return AGGBOX_OUTCOME_RESULT;
}

/*
 * Finish a completion: the header (unless writing the payload failed:
 * `payload`, a drop reason, which cannot happen), the job's completion
 * counters, the slot DONE, and the slot's lock given back (fast_join
 * returned RESULT holding it). Separate global functions keep the deepest
 * call chain at three frames (6.1 counts their stacks together).
 */
__noinline int fast_commit(struct xdp_md *ctx, __u32 use_buf, int payload)
{
	struct aggbox_job_state *js;
	struct aggbox_fast_slot *f;
	struct aggbox_scratch *s;
	int code = payload;

	f = fast_slot_of(&s);
	if (!f)
		return AGGBOX_DROP_MISSED_TAIL_CALL; /* fast_join found it: never */
	js = job_state_of(s->jidx);
	if (!code)
		code = use_buf ? fast_result_header(ctx, s, f, js, 1) : fast_result_header(ctx, s, f, js, 0);
	if (js) {
		__sync_fetch_and_sub(&js->active_slots, 1);
		job_completed(js, s->jidx, s->key.round);
	}
	f->state = FAST_DONE;
	s->fast_spilled = f->fast_flags & FAST_F_SPILLED;
	f->fast_flags = 0;
	fast_unlock(f);
	return code;
}

/* Whether fragment (round, frag_off) of s comes after the one f holds. */
static __always_inline int fast_newer(struct aggbox_fast_slot *f, struct aggbox_scratch *s)
{
	__s32 d = aggbox_rounds_ahead(s->key.round, f->round);

	return d > 0 || (d == 0 && s->key.frag_off > f->frag_off);
}

/*
 * Add the contribution in scratch to its fast slot if the slot holds its
 * fragment (ACTIVE; or CLAIMING under `token`, which commits the take-over).
 * One lock acquisition: fragment check, rank claim, adds, completion count.
 * Returns ACCEPTED, RESULT (the packet now is the RESULT, or scratch.buf
 * holds its payload with use_buf), RETRANSMISSION, SLOT_MISMATCH, or
 * FAST_NOT_MINE when the slot holds another fragment (or is being taken for
 * this one by another CPU).
 *
 * A global function: the verifier checks it once, not once per caller
 * state; it calls no helper newer than 5.15 (the linear chain uses it too).
 */
__noinline int fast_join(struct xdp_md *ctx, __u32 token, __u32 use_buf)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_fast_slot *f;
	struct aggbox_scratch *s;
	__u32 word, bit, npairs, n, agg_off, j, *paths;
	struct aggbox_job_state *js;
	void *payload;
	__s64 w, last = 0, ident;
	int code, last_ok = 1, claim;
	__u8 op;

	f = fast_slot_of(&s);
	if (!f)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	n = s->count;
	FAST_BOUNDED_OFF(agg_off, s->agg_off);
	if (n > AGGBOX_FAST_ELEMS)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	/* The loops read their bound from scratch at each check: a register
	 * compared there would leave each loop exit with its own range of it,
	 * and the verifier would walk what follows once per exit. */
	npairs = n / 2;
	s->fast_npairs = npairs;
	payload = data + agg_off + sizeof(struct aggbox_agg_hdr);
	op = s->op;
	w = s->weight;
	/* The fast slots' identity (a multi-buffer frame's first
	 * contribution): 0 for SUM, COUNT and AVG (ops.def's), INT64_MIN for
	 * MAX and MIN (kept as the maximum of negated values), below every
	 * int32 and its negation. Not aggbox_op_identity(): with its INT32_MIN
	 * clang branches here, and 6.1's verifier then walks the rest of the
	 * entry program once per value (0.42 M -> 0.92 M instructions). */
	ident = op == AGGBOX_OP_MAX || op == AGGBOX_OP_MIN ? (__s64)((__u64)1 << 63) : 0;
	word = (s->rank >> 5) & (AGGBOX_BITMAP_WORDS - 1);
	bit = 1u << (s->rank & 31);
	/* The odd element, read before the lock (no calls under it). */
	if (n & 1)
		last_ok = !fast_load_last(s, payload, data_end, n - 1, use_buf, &last);
	if (!last_ok)
		return AGGBOX_DROP_MISSED_TAIL_CALL; /* validated length: never */

	s->fast_prev_valid = 0;
	s->fast_taken = 0;
	s->fast_reserved = 0;
	s->fast_held = 0;
	s->fast_fused = 0;
	s->fast_wide = 0;
	/*
	 * A free slot is taken and committed in one lock acquisition while the
	 * job has never used the hash-map path (job_paths clear, read under
	 * the lock: that path sets it before its first record, and looks at
	 * the fast slot under this lock after that record, so it either sees
	 * the flag's effect here or finds this slot holding the fragment).
	 * Such a take needs its share of the job's slot bound first: taken
	 * when the slot looks free, given back if the take does not happen.
	 */
	paths = bpf_map_lookup_elem(&job_paths, &s->jidx);
	js = job_state_of(s->jidx);
	if (!token && !s->fast_no_take && paths && !*paths && js && !fast_holds(f, s) &&
	    (f->state == FAST_EMPTY || f->state == FAST_DONE || f->job != s->key.job)) {
		if (__sync_fetch_and_add(&js->active_slots, 1) >= (s->slots ? s->slots : AGGBOX_MAX_SLOTS)) {
			__sync_fetch_and_sub(&js->active_slots, 1);
			return FAST_NOT_MINE; /* over the bound: the hash-map path's pool-full rules */
		}
		/* In scratch, not a register: the take and the join below then
		 * reach the adds in the same verifier state (walked once). */
		s->fast_held = 1;
	}

	if (fast_lock(f, s->fast_idx)) {
		if (s->fast_held && js)
			__sync_fetch_and_sub(&js->active_slots, 1); /* not taken */
		return AGGBOX_DROP_SLOT_BUSY; /* its sender resends it */
	}
	claim = 0;
	code = FAST_NOT_MINE;
	if (!fast_holds(f, s)) {
		if (fast_held_before(f, s)) {
			code = AGGBOX_DROP_RETRANSMISSION;
		} else if (token || s->fast_no_take) {
			code = FAST_NOT_MINE;
		} else if (f->state == FAST_EMPTY || f->job != s->key.job ||
			   (f->state == FAST_DONE && fast_newer(f, s))) {
			/*
			 * Free: take it for this fragment (its first
			 * contribution stores into the accumulators); committed
			 * at once (above), or CLAIMING under this CPU's token
			 * while the caller checks the other paths. The key it
			 * completed becomes `prev`, the one before that goes
			 * into the history ring. (A stale round's unfinished
			 * slot is released by the control plane's reclaim, as a
			 * hash-map slot is.)
			 */
			fast_remember_prev(f, s->key.job);
			s->fast_prev_valid = f->state == FAST_DONE && f->job == s->key.job;
			s->fast_prev.job = f->job;
			s->fast_prev.pad = 0;
			s->fast_prev.round = f->round;
			s->fast_prev.frag_off = f->frag_off;
			f->prev_valid = s->fast_prev_valid;
			f->prev_state = f->prev_valid ? FAST_DONE : FAST_EMPTY;
			f->prev_round = f->round;
			f->prev_frag_off = f->frag_off;
			f->job = s->key.job;
			f->round = s->key.round;
			f->frag_off = s->key.frag_off;
			f->token = s->fast_token;
			f->count = n;
			f->op = op;
			f->flags = 0;
			f->fast_flags = 0;
			f->workers = s->workers;
			f->done = 0;
			f->weight_sum = s->weight_sum;
			for (j = 0; j < AGGBOX_BITMAP_WORDS; j++)
				f->bitmap[j] = 0;
			if (s->fast_held && paths && !*paths) {
				f->state = FAST_ACTIVE;
				s->fast_taken = 1;
				claim = 1;
			} else {
				f->state = FAST_CLAIMING;
				s->fast_reserved = s->fast_held;
				code = FAST_CLAIMED;
			}
		}
	} else if (f->state == FAST_CLAIMING && !(token && f->token == token)) {
		code = FAST_NOT_MINE; /* another CPU is taking it for this fragment */
	} else if (f->state != FAST_CLAIMING && f->state != FAST_ACTIVE) {
		code = AGGBOX_DROP_RETRANSMISSION; /* RESULTING or DONE */
	} else if (f->op != op || f->count != n) {
		code = AGGBOX_DROP_SLOT_MISMATCH;
		if (f->state == FAST_CLAIMING)
			fast_restore(f); /* never committed: nobody else is in it */
	} else if (f->bitmap[word] & bit) {
		code = AGGBOX_DROP_RETRANSMISSION;
	} else {
		claim = 1;
	}
	if (claim) {
		f->state = FAST_ACTIVE;
		f->bitmap[word] |= bit;
		f->flags |= s->flags & AGGBOX_AGG_F_CARRIED;
		/* MAX and MIN: w is the sign (MIN keeps the negated maximum). */
		if (op == AGGBOX_OP_MAX)
			w = 1;
		else if (op == AGGBOX_OP_MIN)
			w = -1;
		if (use_buf) {
			if (f->done == 0)
				fast_fill(f, ident);
			fast_add(ctx, f, s, payload, data_end, 1, op, w);
		} else if (f->done == 0) {
			/* fast_w1 fails only before it writes anything (its
			 * lookups, which cannot fail here): then the general
			 * loop does the same work. */
			if (w != 1 || op == AGGBOX_OP_COUNT || fast_w1(ctx, FAST_W1_STORE))
				fast_store(ctx, f, s, payload, data_end, op, w);
		} else if (op == AGGBOX_OP_SUM && f->done + 1 >= f->workers) {
			s->fast_fused = 1;
			if (w != 1 || fast_w1(ctx, FAST_W1_RESULT))
				fast_sum_result(ctx, f, s, payload, data_end, w);
		} else if (w != 1 || (op != AGGBOX_OP_SUM && op != AGGBOX_OP_AVG) || fast_w1(ctx, FAST_W1_ADD)) {
			fast_add(ctx, f, s, payload, data_end, 0, op, w);
		}
		if ((n & 1) && n - 1 < AGGBOX_FAST_ELEMS) {
			fast_add_one(&f->acc[n - 1], last, op, w, f->done == 0);
			if (s->fast_fused) {
				/* The odd last element: fast_commit stores it. */
				__s64 r = f->acc[n - 1];

				s->chunk_n = (__u32)r;
				s->fast_wide |= r ^ (__s64)(__s32)r;
			}
		}
		f->done++;
		if (f->done >= f->workers) {
			f->state = FAST_RESULTING;
			code = AGGBOX_OUTCOME_RESULT;
		} else {
			code = AGGBOX_OUTCOME_ACCEPTED;
		}
	}
	/* The completing contribution keeps the lock: the RESULT is written
	 * from the accumulators and the slot marked DONE (fast_commit) with no
	 * second acquisition. */
	if (code != AGGBOX_OUTCOME_RESULT)
		fast_unlock(f);
	if (s->fast_held && !s->fast_taken && !s->fast_reserved && js)
		__sync_fetch_and_sub(&js->active_slots, 1); /* not taken */
	if (code == AGGBOX_OUTCOME_ACCEPTED || code == AGGBOX_OUTCOME_RESULT)
		fast_count(AGGBOX_FAST_JOINED);
	return code;
}

/*
 * The hash-map path's side of the handshake, for a contribution of a job
 * with fast slots, after the fragment's slot_owner record exists (made or
 * found) and before anything is added or handed over: a fast slot CLAIMING
 * this fragment is made to give it up (0: the hash-map path goes on); one
 * that holds it further (ACTIVE, RESULTING, DONE) wins: AGGBOX_GO_FAST for
 * a contribution that fits a fast slot (the entry program again: the fast
 * slot adds it, or counts the retransmission), else the verdict of the
 * hash-map path for a contribution whose count differs from its slot's
 * (slot_mismatch, or retransmission once complete). Without may_abort (a
 * look before the record exists, so that a fragment the fast slot holds is
 * answered as its slot answers, not by the pool bound) CLAIMING is left
 * alone.
 */
static __always_inline int fast_check(struct aggbox_scratch *s, const int may_abort)
{
	struct aggbox_fast_slot *f;
	__u32 idx = s->fast_idx;
	int code = 0;

	f = bpf_map_lookup_elem(&fast_slots, &idx);
	if (!f)
		return 0;
	if (fast_lock(f, idx))
		return AGGBOX_DROP_SLOT_BUSY;
	if (fast_holds(f, s)) {
		if (f->state == FAST_CLAIMING) {
			if (may_abort)
				fast_restore(f);
		} else if (fast_fits(s)) {
			f->fast_flags |= FAST_F_SPILLED;
			code = AGGBOX_GO_FAST;
		} else {
			code = f->state == FAST_ACTIVE ? AGGBOX_DROP_SLOT_MISMATCH : AGGBOX_DROP_RETRANSMISSION;
		}
	} else if (fast_held_before(f, s)) {
		code = AGGBOX_DROP_RETRANSMISSION; /* completed there (no `completed` marker is written) */
	}
	fast_unlock(f);
	return code;
}

/* fast_join with the payload where it is: in the packet for a linear frame,
 * else copied into scratch.buf (frags chain only) and the RESULT stored back. */
static __always_inline int fast_join_frame(struct xdp_md *ctx, struct aggbox_scratch *s, __u32 token,
					   const int linear)
{
	__u32 off = s->agg_off + sizeof(struct aggbox_agg_hdr), len = 4 * (__u32)s->count, use_buf = 0;
	int code;

	if (len > 4 * AGGBOX_FAST_ELEMS || off > 256)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	if (off + len > (__u32)(ctx->data_end - ctx->data)) {
		if (linear)
			return AGGBOX_DROP_MISSED_TAIL_CALL; /* single-buffer: cannot happen */
		asm volatile("" : "+r"(len));
		if (len < 4 || len > 4 * AGGBOX_FAST_ELEMS ||
		    bpf_xdp_load_bytes(ctx, off, s->buf, len))
			return AGGBOX_DROP_MISSED_TAIL_CALL;
		use_buf = 1;
	}
	code = fast_join(ctx, token, use_buf);
	if (code != AGGBOX_OUTCOME_RESULT)
		return code;
	/* This contribution completed the fragment and holds its slot's lock
	 * until fast_commit: its packet becomes the RESULT (separate global
	 * functions keep each one's stack and verifier walk small). */
	if (s->fast_fused) {
		/* fast_sum_result wrote the payload; exact only if some sum left
		 * int32 (over every pair, an odd count's last one included, as
		 * after fast_payload). */
		s->overflow = 0;
		s->fast_npairs = ((__u32)s->count + 1) / 2;
		code = s->fast_wide ? FAST_EXACT : 0;
	} else {
		code = fast_payload(ctx, use_buf);
	}
	if (code == FAST_EXACT) {
		fast_write_exact(ctx, use_buf);
		code = 0;
	}
	code = fast_commit(ctx, use_buf, code);
	if (code == AGGBOX_OUTCOME_RESULT && s->fast_spilled)
		fast_spill_cleanup(s->key.job, s->key.round, s->key.frag_off, s->jidx);
	if (!linear && use_buf && code == AGGBOX_OUTCOME_RESULT) {
		len = 4 * (__u32)s->count;
		asm volatile("" : "+r"(len));
		if (len < 4 || len > 4 * AGGBOX_FAST_ELEMS || bpf_xdp_store_bytes(ctx, off, s->buf, len))
			return AGGBOX_DROP_MISSED_TAIL_CALL;
	}
	return code;
}

/*
 * A take-over replaced the completed fragment scratch.fast_prev. The slot
 * remembers it with the AGGBOX_FAST_HISTORY before it: for a job with a
 * vector length that is its last (1 + AGGBOX_FAST_HISTORY) x region
 * fragments in index order (docs/DATAPLANE.md). A job without one indexes
 * by fragment offset alone, so every round lands on the same few slots:
 * its keys also go into the `completed` LRU, as the hash-map path's do.
 */
static __always_inline void fast_remember_completed(struct aggbox_scratch *s)
{
	__u32 one = 1;

	if (s->fast_prev_valid && s->fast_stride == 0)
		bpf_map_update_elem(&completed, &s->fast_prev, &one, BPF_ANY);
}

/*
 * The fast path of the entry program. Returns an outcome or drop reason, or
 * FAST_SLOW: the hash-map chain serves the contribution.
 *
 * A contribution to a fragment its fast slot holds is one fast_join (one
 * lock). The first contribution of a fragment takes the free slot in that
 * same lock (CLAIMING), then publishes, checks the other paths and commits
 * with a second fast_join. The other paths need checking only once the job
 * has used the hash-map path (job_paths, set before that path's first
 * slot_owner record): until then no record or marker can exist.
 */
static __always_inline int fast_path(struct xdp_md *ctx, struct aggbox_scratch *s, const int linear)
{
	__u32 jidx = s->jidx, idx, limit, *paths;
	struct aggbox_job_handoff *ho;
	struct aggbox_job_state *js;
	struct aggbox_fast_slot *f;
	int code;

	js = job_state_of(jidx);
	if (!js)
		return FAST_SLOW;
	ho = bpf_map_lookup_elem(&job_handoff, &jidx);
	/* The stale-round rule of slot_claim, first: it holds for both paths. */
	if (round_is_stale(s, ho))
		return AGGBOX_DROP_STALE_ROUND;

	idx = s->fast_idx;
	/* New fragments of a job in overload go to user space (slot_place). */
	s->fast_no_take = ho && (ho->flags & AGGBOX_HANDOFF_F_OVERLOAD) && aggbox_has_xsk(ctx);
	/* Unique among concurrent takers: one chain runs per CPU at a time. */
	s->fast_token = bpf_get_smp_processor_id() + 1;

	code = fast_join_frame(ctx, s, 0, linear);
	if (code == FAST_NOT_MINE) {
		fast_count(AGGBOX_FAST_BUSY);
		return FAST_SLOW;
	}
	if (s->fast_taken) {
		/* Taken and committed in one go: the fragment it replaced is
		 * remembered by the slot (fast_held_before), and by the
		 * `completed` LRU where that does not cover the window. */
		fast_remember_completed(s);
		fast_count(AGGBOX_FAST_TAKEN);
		return code;
	}
	if (code != FAST_CLAIMED)
		return code;

	/* Taken (CLAIMING, published). */
	f = bpf_map_lookup_elem(&fast_slots, &idx);
	if (!f)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	/* A full barrier between publishing and looking at the other paths. */
	__sync_fetch_and_add(&f->fence, 1);
	fast_remember_completed(s);
	/* The job's slot bound counts fast slots too. */
	limit = s->slots ? s->slots : AGGBOX_MAX_SLOTS;
	code = 0;
	paths = bpf_map_lookup_elem(&job_paths, &jidx);
	if (paths && *paths)
		fast_count(AGGBOX_FAST_CHECKED);
	if (!s->fast_reserved && __sync_fetch_and_add(&js->active_slots, 1) >= limit)
		code = FAST_SLOW; /* over the bound: the hash-map path's pool-full rules */
	else if (paths && *paths && bpf_map_lookup_elem(&slot_owner, &s->key))
		code = FAST_SLOW;
	else if (paths && *paths && bpf_map_lookup_elem(&completed, &s->key))
		code = AGGBOX_DROP_RETRANSMISSION;
	if (code) {
		/* Held past the bound: the slot stays CLAIMING until the
		 * control plane's reclaim restores it (its round gone stale). */
		if (!fast_lock(f, idx)) {
			if (f->state == FAST_CLAIMING && f->token == s->fast_token)
				fast_restore(f);
			fast_unlock(f);
		}
		__sync_fetch_and_sub(&js->active_slots, 1);
		fast_count(AGGBOX_FAST_ABORTED);
		return code;
	}
	code = fast_join_frame(ctx, s, s->fast_token, linear);
	if (code == FAST_NOT_MINE) {
		/* The hash-map path made the take-over give up. */
		__sync_fetch_and_sub(&js->active_slots, 1);
		fast_count(AGGBOX_FAST_ABORTED);
		return FAST_SLOW;
	}
	if (code != AGGBOX_OUTCOME_ACCEPTED && code != AGGBOX_OUTCOME_RESULT)
		__sync_fetch_and_sub(&js->active_slots, 1);
	else
		fast_count(AGGBOX_FAST_TAKEN);
	return code;
}

/*
 * A datagram to a UDP port that is no job's: a RESULT-shaped AGG1 (magic,
 * RESULT flag, a job of this node) to that job's result port is dropped.
 * Only this node's own aggregation makes those (the entry program passes
 * them up the stack and never sees them again), and TC ingress routes what
 * arrives there as one (copies to the result group, upstream as this
 * node's contribution): PROTOCOL.md, "only RESULTs this node's own
 * aggregation produced go upstream". IP fragments (an IPv4 first fragment,
 * an IPv6 Fragment header) are left to TC ingress, which never routes one;
 * other IPv6 extension headers do not make a forged RESULT any less forged.
 */
static __always_inline int result_from_network(void *pos, void *data_end, int len, int fragment, __u32 port)
{
	struct aggbox_agg_hdr *agg = pos;
	struct aggbox_job *job;
	__u32 jidx, *index;

	if (fragment || len < (int)sizeof(*agg) || (void *)(agg + 1) > data_end)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	if (agg->magic != bpf_htonl(AGGBOX_MAGIC_AGG) || !(agg->flags & AGGBOX_AGG_F_RESULT))
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	jidx = bpf_ntohs(agg->job);
	index = bpf_map_lookup_elem(&job_index, &jidx);
	if (!index || *index == 0 || *index > AGGBOX_MAX_JOBS)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	jidx = *index - 1;
	job = bpf_map_lookup_elem(&jobs, &jidx);
	if (!job || !job->workers || job->id != bpf_ntohs(agg->job) || job->result_port != port)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	return AGGBOX_DROP_FORGED_RESULT;
}

/* scratch.l3_flags: what aggbox_parse_l3 found on the way to UDP that a
 * datagram to a job port may not carry. */
#define L3_F_FRAGMENT  0x1 /* IPv4 first fragment (MF), or an IPv6 Fragment header */
#define L3_F_EXTENSION 0x2 /* IPv6 hop-by-hop, routing or destination options */
#define L3_F_ZERO_CSUM 0x4 /* IPv6 UDP checksum 0 (RFC 8200 forbids it) */

/* The UDP header of a datagram the program reads starts within this many
 * bytes of the frame, so its AGG1 header starts within 128 (the header
 * offsets' bound: FAST_BOUNDED_OFF, AGGBOX_LINEAR_MAX_FRAME). IPv4 with
 * options and a VLAN tag needs 78; IPv6, 58 plus its extension headers. */
#define AGGBOX_MAX_UDP_OFF 120

/*
 * The headers up to UDP, for either IP version: Ethernet [+ one VLAN tag],
 * then IPv4 (IHL honoured, options skipped) or IPv6 (extension headers
 * skipped: parse_ip6_ext), then the UDP header. Writes into scratch the IP
 * version (family), the source address as a rank holds it (src: IPv4 in
 * src[0], zeros after), the IP and UDP header offsets and L3_F_* flags.
 * Returns 0, or PARSE_TOO_SHORT for a frame that carries no UDP datagram
 * the program reads (outcome not_aggbox): another EtherType or protocol,
 * a non-first fragment of either version (no UDP header, its port is
 * unknown), an extension-header chain parse_ip6_ext does not follow, or a
 * UDP header past AGGBOX_MAX_UDP_OFF.
 *
 * A global function (verified once, for both versions): the entry program
 * goes on from the offsets in scratch, one verifier state whatever the
 * version; inline, the two versions' packet pointers would differ and the
 * verifier would walk the fast path after it once per version.
 */
__noinline int aggbox_parse_l3(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor nh = { .pos = data };
	struct aggbox_scratch *s;
	struct udphdr *udph;
	struct ethhdr *eth;
	__u32 zero = 0, flags = 0, ext = 0;
	__u64 off;
	int proto;

	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s)
		return PARSE_TOO_SHORT;
	proto = parse_ethhdr(&nh, data_end, &eth);
	s->ip_off = (__u16)(nh.pos - data);
	if (proto == ETH_P_IP) {
		struct iphdr *iph;
		__u16 frag;

		if (parse_iphdr(&nh, data_end, &iph) != IPPROTO_UDP_)
			return PARSE_TOO_SHORT;
		frag = bpf_ntohs(iph->frag_off);
		/* A non-first fragment carries no UDP header: its port is unknown. */
		if (frag & IP_OFFSET)
			return PARSE_TOO_SHORT;
		if (frag & IP_MF)
			flags |= L3_F_FRAGMENT;
		s->family = AGGBOX_FAMILY_IPV4;
		s->src[0] = iph->saddr;
		s->src[1] = 0;
		s->src[2] = 0;
		s->src[3] = 0;
	} else if (proto == ETH_P_IPV6) {
		struct ipv6hdr *ip6h;

		proto = parse_ip6hdr(&nh, data_end, &ip6h);
		if (proto < 0 || parse_ip6_ext(&nh, data_end, proto, &ext) != IPPROTO_UDP_)
			return PARSE_TOO_SHORT;
		if (ext & IP6_EXT_F_FRAGMENT)
			flags |= L3_F_FRAGMENT;
		if (ext & IP6_EXT_F_OTHER)
			flags |= L3_F_EXTENSION;
		s->family = AGGBOX_FAMILY_IPV6;
		s->src[0] = ip6h->saddr.in6_u.u6_addr32[0];
		s->src[1] = ip6h->saddr.in6_u.u6_addr32[1];
		s->src[2] = ip6h->saddr.in6_u.u6_addr32[2];
		s->src[3] = ip6h->saddr.in6_u.u6_addr32[3];
	} else {
		return PARSE_TOO_SHORT;
	}
	udph = nh.pos;
	if ((void *)(udph + 1) > data_end)
		return PARSE_TOO_SHORT;
	off = (void *)udph - data;
	if (off > AGGBOX_MAX_UDP_OFF)
		return PARSE_TOO_SHORT;
	if (s->family == AGGBOX_FAMILY_IPV6 && udph->check == 0)
		flags |= L3_F_ZERO_CSUM;
	s->udp_off = (__u16)off;
	s->l3_flags = flags;
	return 0;
}

/* Internal code of aggbox_classify: a datagram to a ring's port, for the
 * ring program (never counted under this value). */
#define AGGBOX_RING_CODE 103

/*
 * Validate one AGG1 contribution in the order of PROTOCOL.md. Returns an
 * outcome (>= 0) or a drop reason (< 0); *bytes gets the UDP payload length
 * once known.
 */
static __always_inline int aggbox_classify(struct xdp_md *ctx, struct aggbox_scratch *s, const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor nh = { .pos = data };
	__u32 port_key, jidx, rank_key, *index;
	__u16 job_id, rank_id;
	struct aggbox_port *port;
	struct aggbox_agg_hdr *agg;
	struct aggbox_rank *rank;
	struct aggbox_job *job;
	struct udphdr *udph;
	__u32 avail, count, plen, udp_off;
	__u64 end;
	int len;

	if (aggbox_parse_l3(ctx))
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	/* From here on one path for both IP versions: the UDP header from its
	 * offset, bounded as the fast path bounds its offsets. */
	FAST_BOUNDED_OFF(udp_off, s->udp_off);
	nh.pos = data + udp_off;
	len = parse_udphdr(&nh, data_end, &udph);
	if (len < 0)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	s->bytes = len;

	port_key = bpf_ntohs(udph->dest);
	port = bpf_map_lookup_elem(&ports, &port_key);
	if (!port || !port->jobs) {
		/* A ring's port, either IP version: the ring program checks the
		 * version against the ring's members (docs/RING.md "XDP"). */
		index = bpf_map_lookup_elem(&ring_ports, &port_key);
		if (index && *index)
			return AGGBOX_RING_CODE;
		return result_from_network(nh.pos, data_end, len, s->l3_flags & L3_F_FRAGMENT, port_key);
	}

	/* A datagram to a job port: first what its IP headers may not carry.
	 * The first fragment of a fragmented datagram (either version). */
	if (s->l3_flags & L3_F_FRAGMENT)
		return AGGBOX_DROP_IP_OPTIONS_OR_FRAGMENT;
	/* IPv6 extension headers: no AggBox sender puts any there, and the
	 * RESULT's checksum, the user-space path and TC read UDP right after
	 * the 40-byte header (docs/PROTOCOL.md, "IPv6"). */
	if (s->l3_flags & L3_F_EXTENSION)
		return AGGBOX_DROP_IPV6_EXTENSION_HEADER;
	/* IPv6 makes the UDP checksum mandatory (RFC 8200 section 8.1). */
	if (s->l3_flags & L3_F_ZERO_CSUM)
		return AGGBOX_DROP_UDP_ZERO_CHECKSUM;

	agg = nh.pos;
	/* Bytes the frame holds past the UDP header, fragments included
	 * (multi-buffer XDP: the headers are in the linear part, the payload
	 * may run on into fragments). */
	avail = (__u32)(data_end - nh.pos);
	plen = len;                /* bytes the UDP header announces */
	/* The whole frame's length (a helper call) only when the linear part
	 * does not hold the datagram: a multi-buffer frame, or a short one. */
	if (!linear && plen > avail)
		avail = frame_len(ctx, linear) - (__u32)(nh.pos - data);
	if (plen < 4 || avail < 4 || (void *)agg + 4 > data_end)
		return AGGBOX_OUTCOME_NOT_AGGBOX;

	switch (agg->magic) {
	case bpf_htonl(AGGBOX_MAGIC_AGG):
		break;
	case bpf_htonl(AGGBOX_MAGIC_BCAST):
	case bpf_htonl(AGGBOX_MAGIC_ACK):
		return AGGBOX_OUTCOME_OTHER_AGGBOX;
	default:
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	}

	/* The frame must hold the whole datagram its UDP header announces. */
	if (plen < sizeof(*agg) || plen > avail)
		return AGGBOX_DROP_TRUNCATED_HEADER;
	if ((void *)(agg + 1) > data_end)
		return AGGBOX_DROP_TRUNCATED_HEADER;

	if (agg->flags & ~AGGBOX_AGG_F_KNOWN)
		return AGGBOX_DROP_RESERVED_FLAG;
	if (agg->op > AGGBOX_OP_LAST)
		return AGGBOX_DROP_INVALID_OP;
	count = bpf_ntohs(agg->count);
	if (count == 0)
		return AGGBOX_DROP_ZERO_COUNT;
	if (sizeof(*agg) + 4 * count > plen)
		return AGGBOX_DROP_COUNT_TOO_LARGE;
	if (sizeof(*agg) + 4 * count < plen)
		return AGGBOX_DROP_COUNT_TOO_SMALL;

	job_id = bpf_ntohs(agg->job);
	jidx = job_id;
	index = bpf_map_lookup_elem(&job_index, &jidx);
	if (!index || *index == 0 || *index > AGGBOX_MAX_JOBS)
		return AGGBOX_DROP_UNKNOWN_JOB;
	jidx = *index - 1;
	job = bpf_map_lookup_elem(&jobs, &jidx);
	if (!job || job->id != job_id || !job->workers)
		return AGGBOX_DROP_UNKNOWN_JOB; /* being reconfigured: a bug if it lasts */
	/* A port serves one job (PROTOCOL.md): another job's datagram sent to
	 * it never reaches that job's slots. Not charged to the job it names. */
	if (job->port != port_key)
		return AGGBOX_DROP_PORT_MISMATCH;
	/* From here on every outcome is the job's too (job_stats, stats.h). */
	s->key.job = job_id;
	s->jidx = jidx;
	s->job_known = 1;

	rank_id = bpf_ntohs(agg->rank);
	if (rank_id >= job->workers)
		return AGGBOX_DROP_RANK_OUT_OF_RANGE;
	rank_key = jidx * AGGBOX_MAX_RANKS + rank_id;
	rank = bpf_map_lookup_elem(&ranks, &rank_key);
	/* The rank's IP version and all 16 bytes of its address (an IPv4
	 * source is src[0] and three zero words, as an IPv4 rank's address). */
	if (!rank || rank->family != s->family ||
	    ((rank->addr[0] ^ s->src[0]) | (rank->addr[1] ^ s->src[1]) | (rank->addr[2] ^ s->src[2]) |
	     (rank->addr[3] ^ s->src[3])))
		return AGGBOX_DROP_SOURCE_MISMATCH;

	end = (__u64)bpf_ntohl(agg->frag_off) + count;
	if (job->vector_len && end > job->vector_len)
		return AGGBOX_DROP_BEYOND_VECTOR;

	if (job->flags & AGGBOX_JOB_F_USERSPACE_ONLY) {
		s->handoff = AGGBOX_HANDOFF_USERSPACE_ONLY;
		return AGGBOX_OUTCOME_TO_USERSPACE;
	}
	if (agg->flags & AGGBOX_AGG_F_FLOAT32) {
		s->handoff = AGGBOX_HANDOFF_FLOAT32;
		return AGGBOX_OUTCOME_TO_USERSPACE;
	}
	if (!aggbox_op_runs_in_kernel(agg->op)) {
		s->handoff = AGGBOX_HANDOFF_OP;
		return AGGBOX_OUTCOME_TO_USERSPACE;
	}

	/* ip_off and udp_off: aggbox_parse_l3 */
	s->agg_off = udp_off + sizeof(*udph);
	s->key.job = job_id;
	s->key.pad = 0;
	s->key.round = bpf_ntohl(agg->round);
	s->key.frag_off = bpf_ntohl(agg->frag_off);
	s->count = count;
	s->op = agg->op;
	s->flags = agg->flags;
	s->overflow = 0;
	s->result_flags = 0;
	s->chunk = 0;
	s->rank = rank_id;
	s->workers = job->workers;
	s->result_port = job->result_port;
	s->weight = rank->weight;
	s->weight_sum = job->weight_sum;
	s->slots = job->slots;
	s->window = job->window ? job->window : AGGBOX_ROUND_WINDOW;
	s->vector_len = job->vector_len;
	s->fast_base = job->fast_base;
	s->fast_slots = job->fast_slots;
	s->fast_stride = job->fast_stride;
	s->fast_granule = job->fast_granule; /* >= 1: kernel::xdp::fast_granule */
	s->has_parent = !!(job->flags & AGGBOX_JOB_F_HAS_PARENT);
	return AGGBOX_OUTCOME_ACCEPTED;
}

/* ---------------------------------------------------------------------------
 * The UDP checksum of an IPv6 RESULT (udp_csum.h, the rule the ring program
 * shares): the completing contribution computes the full checksum of its
 * rewritten datagram once every other byte of it is final.
 * ------------------------------------------------------------------------- */

_Static_assert(sizeof(((struct aggbox_scratch *)0)->buf) >= CSUM_PIECE, "a checksum piece fits scratch.buf");

static __always_inline int udp6_result_csum(struct xdp_md *ctx, const int linear)
{
	__u32 zero = 0;
	struct aggbox_scratch *s = bpf_map_lookup_elem(&scratch, &zero);

	if (!s)
		return -1;
	return udp6_csum_write(ctx, s, sizeof(struct udphdr) + sizeof(struct aggbox_agg_hdr), linear);
}

/* udp6_result_csum of each chain as a global function: verified once, not
 * once per state in which a stage reaches its RESULT (inline, it tripled
 * the result stage's verifier walk). */
__noinline int udp6_result_csum_frags(struct xdp_md *ctx)
{
	return udp6_result_csum(ctx, 0);
}

__noinline int udp6_result_csum_linear(struct xdp_md *ctx)
{
	return udp6_result_csum(ctx, 1);
}

/* The RESULT outcome of a completed IPv6 RESULT once its checksum is
 * written (MISSED_TAIL_CALL, a bug, if that failed). */
static __always_inline int udp6_result(struct xdp_md *ctx, const int linear)
{
	if (linear ? udp6_result_csum_linear(ctx) : udp6_result_csum_frags(ctx))
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	return AGGBOX_OUTCOME_RESULT;
}

/* CALL_* entry: parse, validate, then hand a kernel-op contribution on.
 * Every program of the chain is "xdp.frags" (BPF_F_XDP_HAS_FRAGS): frames
 * larger than a page arrive as multi-buffer xdp_buffs and the payload is
 * read and written with bpf_xdp_load_bytes / bpf_xdp_store_bytes. */
static __always_inline int entry_stage(struct xdp_md *ctx, const int linear)
{
	__u32 zero = 0;
	struct aggbox_scratch *s = bpf_map_lookup_elem(&scratch, &zero);
	int code;

	if (!s)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, 0); /* cannot happen */
	s->job_known = 0; /* never count the previous packet's job */
	s->bytes = 0;
	s->handoff = AGGBOX_HANDOFF_OP;
	code = aggbox_classify(ctx, s, linear);
	if (code == AGGBOX_RING_CODE) /* counted by the ring program (ring_stats) */
		return aggbox_exit(aggbox_tail_call(ctx, AGGBOX_CALL_RING, linear), s->bytes);
	if (code == AGGBOX_OUTCOME_TO_USERSPACE)
		return aggbox_handoff(ctx, s->handoff, AGGBOX_OUTCOME_USERSPACE_UNAVAILABLE, s->bytes,
				      frame_len(ctx, linear));
	if (code == AGGBOX_OUTCOME_ACCEPTED) {
		if (s->count > (linear ? AGGBOX_LINEAR_MAX_ELEMS : AGGBOX_MAX_ELEMS)) {
			code = AGGBOX_DROP_TOO_LARGE;
		} else {
			if (fast_job(s))
				s->fast_idx = fast_index(s);
			code = fast_job(s) && fast_fits(s) ? fast_path(ctx, s, linear) : FAST_SLOW;
			if (code == FAST_SLOW) {
				code = aggbox_tail_call(ctx, AGGBOX_CALL_SLOT, linear);
			} else if (code == AGGBOX_OUTCOME_RESULT && s->family == AGGBOX_FAMILY_IPV6) {
				code = udp6_result(ctx, linear);
			}
		}
	}
	return aggbox_exit(code, s->bytes);
}

CHAIN_PROGRAMS(aggbox_xdp, entry_stage)

/* CALL_RING (an AGR1 datagram) is the ring program's, in its own object:
 * aggbox_ring.bpf.c. */

/* ---------------------------------------------------------------------------
 * CALL_SLOT: find or create the slot, reject stale rounds and
 * retransmissions, claim the rank's bit.
 * ------------------------------------------------------------------------- */

/* Internal code of slot_claim: hand the contribution to user space
 * (reason in s->handoff); never counted under this value. */
#define AGGBOX_HANDOFF_CODE 101

#define SLOT_CREATOR_CPU_SHIFT 22
#define SLOT_CREATOR_SEQ ((1u << SLOT_CREATOR_CPU_SHIFT) - 1)

/*
 * Take back the header slot_create just published for s->key (tag
 * `creator`) because the fragment completed meanwhile. Returns 1 when this
 * call removed it (the caller gives its reservation and blocks back), 0
 * when someone else did: a completion (every contribution joined it) or an
 * aggbox_reclaim, which give them back themselves.
 *
 * Why not a plain delete by key: after a reclaim released our header,
 * another late creator of the same key can publish its own; a delete by
 * key would remove that one, and our blocks (already given back by the
 * reclaim) would be given back twice while its blocks leaked. So the header
 * is ours only if it carries our tag; it is poisoned under its lock as
 * slot_release() does (no contributor can complete it, no release takes
 * it), which leaves this call the only one that can delete it.
 */
static __always_inline int slot_undo(struct aggbox_scratch *s, __u32 creator)
{
	struct aggbox_slot *slot = bpf_map_lookup_elem(&slots, &s->key);
	int mine = 0;

	if (!slot)
		return 0;
	bpf_spin_lock(&slot->lock);
	if (slot->b.creator == creator && slot->b.key.round == s->key.round &&
	    slot->b.done < slot->b.workers) {
		slot->b.workers = 0xffff;
		slot->b.key.round = ~s->key.round;
		mine = 1;
	}
	bpf_spin_unlock(&slot->lock);
	return mine && !bpf_map_delete_elem(&slots, &s->key);
}

/*
 * Create the slot of s->key. `reserved`: the caller already holds one
 * job_state.active_slots reservation for it (else one is taken here, past
 * the bound: the slot is kernel-owned already and must exist). Returns 0
 * when the slot exists (made here or by another CPU), else a drop reason.
 */
static __always_inline int slot_create(struct aggbox_scratch *s, struct aggbox_job_state *js, int reserved,
				       const int linear)
{
	struct blocks_take bl = {};
	struct aggbox_init *init;
	__u32 zero = 0, nb;
	int err;

	if (!reserved)
		__sync_fetch_and_add(&js->active_slots, 1);
	init = bpf_map_lookup_elem(&slot_init, &zero);
	if (!init) {
		__sync_fetch_and_sub(&js->active_slots, 1);
		return AGGBOX_DROP_SLOT_POOL_FULL;
	}
	/*
	 * Blocks first, then the header: whoever finds the header in `slots`
	 * finds every block of it ready.
	 */
	nb = chunks_of(s->count);
	bl.key = s->key;
	chain_loop(linear, nb, AGGBOX_LINEAR_MAX_CHUNKS, block_take_cb, &bl);
	blocks_used_add(bl.taken);
	if (bl.taken < nb) {
		/* Block pool empty. */
		blocks_give(init->slot.b.block, bl.taken, linear);
		__sync_fetch_and_sub(&js->active_slots, 1);
		return AGGBOX_DROP_SLOT_POOL_FULL;
	}
	init->slot.b.key = s->key;
	init->slot.b.workers = s->workers;
	init->slot.b.op = s->op;
	init->slot.b.count = s->count;
	init->slot.b.weight_sum = s->weight_sum;
	/* The template is per CPU: its last tag counts this CPU's creations. */
	init->slot.b.creator = ((init->slot.b.creator + 1) & SLOT_CREATOR_SEQ) |
			       (bpf_get_smp_processor_id() << SLOT_CREATOR_CPU_SHIFT);
	err = bpf_map_update_elem(&slots, &s->key, &init->slot, BPF_NOEXIST);
	if (err) {
		/* Lost the race to another CPU (-EEXIST: its header and blocks
		 * serve the fragment) or the map is full: ours were never
		 * published. */
		blocks_give(init->slot.b.block, nb, linear);
		__sync_fetch_and_sub(&js->active_slots, 1);
		return err == -EEXIST ? 0 : AGGBOX_DROP_SLOT_POOL_FULL;
	}
	/*
	 * Completion writes `completed` before it deletes the slot; if the
	 * fragment completed between our lookups and this insert, undo it.
	 */
	if (bpf_map_lookup_elem(&completed, &s->key)) {
		if (slot_undo(s, init->slot.b.creator)) {
			__sync_fetch_and_sub(&js->active_slots, 1);
			blocks_give(init->slot.b.block, nb, linear);
		}
		return AGGBOX_DROP_RETRANSMISSION;
	}
	return 0;
}

/*
 * A contribution whose slot is not in the pool: decide (once per fragment,
 * through slot_owner) whether the kernel or user space serves it. Returns 0
 * when a kernel slot exists now, AGGBOX_HANDOFF_CODE, or a drop reason.
 */
static __always_inline int slot_place(struct xdp_md *ctx, struct aggbox_scratch *s,
				      struct aggbox_job_state *js, struct aggbox_job_handoff *ho,
				      const int linear)
{
	struct aggbox_slot_owner mine = { .owner = AGGBOX_OWNER_KERNEL };
	struct aggbox_slot_owner *owner;
	__u32 limit, *paths;
	int err, reserved = 0, fast;

	if (bpf_map_lookup_elem(&completed, &s->key))
		return AGGBOX_DROP_RETRANSMISSION;
	owner = bpf_map_lookup_elem(&slot_owner, &s->key);
	if (!owner) {
		fast = fast_job(s) ? fast_check(s, 0) : 0;
		if (fast)
			return fast; /* the fragment's fast slot holds it */
		limit = s->slots ? s->slots : AGGBOX_MAX_SLOTS;
		if (ho && (ho->flags & AGGBOX_HANDOFF_F_OVERLOAD) && aggbox_has_xsk(ctx)) {
			mine.owner = AGGBOX_OWNER_USERSPACE;
			s->handoff = AGGBOX_HANDOFF_OVERLOAD;
		} else if (__sync_fetch_and_add(&js->active_slots, 1) >= limit) {
			__sync_fetch_and_sub(&js->active_slots, 1);
			if (!aggbox_has_xsk(ctx))
				return AGGBOX_DROP_SLOT_POOL_FULL;
			mine.owner = AGGBOX_OWNER_USERSPACE;
			s->handoff = AGGBOX_HANDOFF_POOL_FULL;
		} else {
			reserved = 1;
		}
		/* The fast slots' takers look for slot_owner records only
		 * once this is set (fast_path): set before the record. */
		paths = bpf_map_lookup_elem(&job_paths, &s->jidx);
		if (paths && !*paths)
			__sync_fetch_and_or(paths, 1);
		err = bpf_map_update_elem(&slot_owner, &s->key, &mine, BPF_NOEXIST);
		if (!err) {
			/* The record is published: the handshake with the
			 * fragment's fast slot before anything is made. */
			fast = fast_job(s) ? fast_check(s, 1) : 0;
			if (fast) {
				if (reserved)
					__sync_fetch_and_sub(&js->active_slots, 1);
				bpf_map_delete_elem(&slot_owner, &s->key);
				return fast;
			}
			if (mine.owner == AGGBOX_OWNER_USERSPACE)
				return AGGBOX_HANDOFF_CODE;
			err = slot_create(s, js, reserved, linear);
			if (err == AGGBOX_DROP_SLOT_POOL_FULL) {
				/* Global pool full: user space takes it, or it is dropped. */
				if (aggbox_has_xsk(ctx)) {
					mine.owner = AGGBOX_OWNER_USERSPACE;
					bpf_map_update_elem(&slot_owner, &s->key, &mine, BPF_EXIST);
					s->handoff = AGGBOX_HANDOFF_POOL_FULL;
					return AGGBOX_HANDOFF_CODE;
				}
				bpf_map_delete_elem(&slot_owner, &s->key);
			} else if (err == AGGBOX_DROP_RETRANSMISSION) {
				bpf_map_delete_elem(&slot_owner, &s->key);
			}
			return err;
		}
		if (reserved)
			__sync_fetch_and_sub(&js->active_slots, 1);
		if (err != -EEXIST)
			return AGGBOX_DROP_SLOT_POOL_FULL; /* slot_owner full */
		/* Another CPU decided first: follow it. */
		owner = bpf_map_lookup_elem(&slot_owner, &s->key);
		if (!owner)
			return AGGBOX_DROP_RETRANSMISSION; /* completed meanwhile */
	}
	/* A record made by another contribution: the same handshake. */
	fast = fast_job(s) ? fast_check(s, 1) : 0;
	if (fast)
		return fast;
	if (owner->owner == AGGBOX_OWNER_USERSPACE) {
		s->handoff = AGGBOX_HANDOFF_OWNED;
		return AGGBOX_HANDOFF_CODE;
	}
	/* Kernel-owned: the slot exists, or its creator is about to insert it. */
	if (bpf_map_lookup_elem(&slots, &s->key))
		return 0;
	return slot_create(s, js, 0, linear);
}

static __always_inline int slot_claim(struct xdp_md *ctx, struct aggbox_scratch *s, const int linear)
{
	__u32 jidx = s->jidx;
	struct aggbox_job_state *js = job_state_of(jidx);
	struct aggbox_job_handoff *ho;
	struct aggbox_slot *slot;
	__u32 word, bit;
	int code;

	if (!js)
		return AGGBOX_DROP_SLOT_POOL_FULL;
	ho = bpf_map_lookup_elem(&job_handoff, &jidx);
	/* Serial-number comparison: rounds may wrap. Either path's newest
	 * completed round makes older rounds stale. */
	if (round_is_stale(s, ho))
		return AGGBOX_DROP_STALE_ROUND;

	slot = bpf_map_lookup_elem(&slots, &s->key);
	if (!slot) {
		/* slot_place does the handshake with the fragment's fast slot
		 * (fast_check) once the slot_owner record exists. */
		code = slot_place(ctx, s, js, ho, linear);
		if (code)
			return code;
		slot = bpf_map_lookup_elem(&slots, &s->key);
		if (!slot)
			return AGGBOX_DROP_RETRANSMISSION; /* completed meanwhile */
	} else if (fast_job(s)) {
		/* A hash-map slot made before its fast slot won: the fast one
		 * serves the fragment (and drops this one when it completes). */
		code = fast_check(s, 1);
		if (code)
			return code;
	}

	word = (s->rank >> 5) & (AGGBOX_BITMAP_WORDS - 1);
	bit = 1u << (s->rank & 31);
	bpf_spin_lock(&slot->lock);
	if (slot->b.key.job != s->key.job || slot->b.key.round != s->key.round ||
	    slot->b.key.frag_off != s->key.frag_off) {
		/* The element was completed, deleted and reused meanwhile. */
		code = AGGBOX_DROP_RETRANSMISSION;
	} else if (slot->b.op != s->op || slot->b.count != s->count) {
		code = AGGBOX_DROP_SLOT_MISMATCH;
	} else if (slot->b.bitmap[word] & bit) {
		code = AGGBOX_DROP_RETRANSMISSION;
	} else {
		slot->b.bitmap[word] |= bit;
		slot->b.claimed++;
		slot->b.flags |= s->flags & AGGBOX_AGG_F_CARRIED;
		__builtin_memcpy(s->block, slot->b.block, sizeof(s->block));
		code = AGGBOX_OUTCOME_ACCEPTED;
	}
	bpf_spin_unlock(&slot->lock);
	return code;
}

static __always_inline int slot_stage(struct xdp_md *ctx, const int linear)
{
	__u32 zero = 0;
	struct aggbox_scratch *s = bpf_map_lookup_elem(&scratch, &zero);
	int code;

	if (!s)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, 0);
	code = slot_claim(ctx, s, linear);
	if (code == AGGBOX_GO_FAST) {
		/* The fragment's fast slot serves it: the entry program again
		 * (its fast path has the stack this stage's frame leaves no
		 * room for). */
		return aggbox_exit(aggbox_tail_call(ctx, AGGBOX_CALL_ENTRY, linear), s->bytes);
	}
	if (code == AGGBOX_HANDOFF_CODE)
		return aggbox_handoff(ctx, s->handoff, AGGBOX_DROP_SLOT_POOL_FULL, s->bytes,
				      frame_len(ctx, linear));
	if (code == AGGBOX_OUTCOME_ACCEPTED) {
		s->chunk = 0;
		s->finalized = 0;
		code = aggbox_tail_call(ctx, AGGBOX_CALL_ADD, linear);
	}
	return aggbox_exit(code, s->bytes);
}

CHAIN_PROGRAMS(aggbox_slot, slot_stage)

/* ---------------------------------------------------------------------------
 * CALL_ADD: add chunks s->chunk.. of the payload into the slot's blocks.
 *
 * One program run processes up to AGGBOX_PROG_CHUNKS chunks with bpf_loop,
 * then tail-calls itself for the rest (tail-call budget: docs/JUMBO.md).
 * Per chunk: bpf_xdp_load_bytes copies its AGGBOX_CHUNK_ELEMS elements (from
 * the linear part or the fragments of a multi-buffer frame) into the per-CPU
 * scratch buffer, then one spin-lock acquisition of the chunk's block adds
 * them with plain s64 loads/stores (MAX/MIN, which have no atomic form, need
 * a lock anyway). After the last chunk the slot header's lock counts the
 * contribution as done: exactly one contribution sees done == workers and
 * completes the slot.
 * ------------------------------------------------------------------------- */

/* bpf_loop context of the add and result stages (the drop reason that
 * stops a loop goes to scratch.stop). */
struct chain_loop {
	struct xdp_md *ctx;
};

/*
 * Check the chain state of chunk s->chunk; returns its element count
 * (1..AGGBOX_CHUNK_ELEMS) or 0 when the state is corrupt (a bug).
 */
static __always_inline __u32 chunk_elems(struct aggbox_scratch *s, __u32 *base)
{
	__u32 chunk = s->chunk, count = s->count, n;

	if (chunk >= AGGBOX_MAX_CHUNKS || count > AGGBOX_MAX_ELEMS || s->agg_off > 128)
		return 0;
	*base = chunk * AGGBOX_CHUNK_ELEMS;
	if (*base >= count)
		return 0;
	n = count - *base;
	if (n > AGGBOX_CHUNK_ELEMS)
		n = AGGBOX_CHUNK_ELEMS;
	return n;
}

/* Packet bytes of n elements, 4..4*AGGBOX_CHUNK_ELEMS or 0 if n is out of
 * range; the barrier keeps the compiler from folding the check away from
 * the helper call (the verifier needs the bound on the register it gets). */
static __always_inline __u32 chunk_bytes(__u32 n)
{
	__u32 len = n * 4;

	asm volatile("" : "+r"(len));
	if (len < 4 || len > 4 * AGGBOX_CHUNK_ELEMS)
		return 0;
	return len;
}

static __always_inline int block_matches(struct aggbox_block *blk, struct aggbox_scratch *s, __u32 chunk)
{
	return blk->b.key.job == s->key.job && blk->b.key.round == s->key.round &&
	       blk->b.key.frag_off == s->key.frag_off && blk->b.index == chunk;
}

/*
 * The element loops of the add stage. Each runs over the whole block with
 * no data-dependent exit: elements past the chunk's n add stale scratch
 * bytes into accumulators that are never read (a slot holds `count`
 * elements, its last block only the first n of them), and a loop without
 * an early exit is one straight path for the verifier.
 *
 * Two elements per 64-bit load: after bswap64 the first big-endian int32 is
 * the high half (one arithmetic shift sign-extends it) and the second the
 * low half; that halves loads and byte swaps. The common cases get their own
 * loops: the first contributor of a block stores instead of adding (every
 * op: a block from the pool still holds its previous owner's values, it is
 * never zeroed), and weight 1 needs no multiplication. Unrolled by 4 pairs
 * so the loop counter and branch are paid once per 8 elements (the verifier
 * walks the same 256 elements either way).
 */
#define PAIRS (AGGBOX_CHUNK_ELEMS / 2)

static __always_inline void add_block(__s64 *acc, const __u64 *src, __u8 op, __s64 w, int first)
{
	__u32 j;

	if (first && (op == AGGBOX_OP_MAX || op == AGGBOX_OP_MIN ||
		      ((op == AGGBOX_OP_SUM || op == AGGBOX_OP_AVG) && w == 1))) {
		/* The first value is the running one. */
#pragma clang loop unroll_count(4)
		for (j = 0; j < PAIRS; j++) {
			__u64 y = __builtin_bswap64(src[j]);

			acc[2 * j] = PAIR_FIRST(y);
			acc[2 * j + 1] = PAIR_SECOND(y);
		}
	} else if (op == AGGBOX_OP_SUM || op == AGGBOX_OP_AVG) {
		if (first) {
#pragma clang loop unroll_count(4)
			for (j = 0; j < PAIRS; j++) {
				__u64 y = __builtin_bswap64(src[j]);

				acc[2 * j] = w * PAIR_FIRST(y);
				acc[2 * j + 1] = w * PAIR_SECOND(y);
			}
		} else if (w == 1) {
#pragma clang loop unroll_count(4)
			for (j = 0; j < PAIRS; j++) {
				__u64 y = __builtin_bswap64(src[j]);

				acc[2 * j] += PAIR_FIRST(y);
				acc[2 * j + 1] += PAIR_SECOND(y);
			}
		} else {
#pragma clang loop unroll_count(4)
			for (j = 0; j < PAIRS; j++) {
				__u64 y = __builtin_bswap64(src[j]);

				acc[2 * j] += w * PAIR_FIRST(y);
				acc[2 * j + 1] += w * PAIR_SECOND(y);
			}
		}
	} else if (op == AGGBOX_OP_COUNT) {
		/* nonzero test: byte order does not matter */
		if (first) {
#pragma clang loop unroll_count(4)
			for (j = 0; j < PAIRS; j++) {
				__u64 y = src[j];

				acc[2 * j] = (__u32)y != 0;
				acc[2 * j + 1] = (y >> 32) != 0;
			}
		} else {
#pragma clang loop unroll_count(4)
			for (j = 0; j < PAIRS; j++) {
				__u64 y = src[j];

				acc[2 * j] += (__u32)y != 0;
				acc[2 * j + 1] += (y >> 32) != 0;
			}
		}
	} else if (op == AGGBOX_OP_MAX) {
#pragma clang loop unroll_count(4)
		for (j = 0; j < PAIRS; j++) {
			__u64 y = __builtin_bswap64(src[j]);
			__s64 a = PAIR_FIRST(y), b = PAIR_SECOND(y);

			if (a > acc[2 * j])
				acc[2 * j] = a;
			if (b > acc[2 * j + 1])
				acc[2 * j + 1] = b;
		}
	} else { /* AGGBOX_OP_MIN */
#pragma clang loop unroll_count(4)
		for (j = 0; j < PAIRS; j++) {
			__u64 y = __builtin_bswap64(src[j]);
			__s64 a = PAIR_FIRST(y), b = PAIR_SECOND(y);

			if (a < acc[2 * j])
				acc[2 * j] = a;
			if (b < acc[2 * j + 1])
				acc[2 * j + 1] = b;
		}
	}
}

/*
 * The result stage's common case: write the block's accumulators as
 * big-endian int32, two per 64-bit store, and return 1 when every one of
 * them fit (no clamping, no OVERFLOW). Overflow is rare, so it is detected
 * once per block (OR of each value XOR its int32 truncation) instead of
 * with two compares per element; on 0 the caller redoes the block with the
 * exact clamping loop, which also ignores accumulators past the chunk's n
 * (stale ones may well exceed int32).
 */
static __always_inline int result_block_fits(const __s64 *acc, __u64 *dst)
{
	__u64 wide = 0;
	__u32 j;

#pragma clang loop unroll_count(4)
	for (j = 0; j < PAIRS; j++) {
		__s64 a = acc[2 * j], b = acc[2 * j + 1];

		wide |= (a ^ (__s64)(__s32)a) | (b ^ (__s64)(__s32)b);
		dst[j] = __builtin_bswap64(((__u64)a << 32) | (__u32)b);
	}
	return wide == 0;
}

/* Add chunk s->chunk into its block (bpf_loop callback body). */
static __always_inline long add_chunk(void *data, const int linear)
{
	struct chain_loop *lp = data;
	struct aggbox_scratch *s;
	struct aggbox_block *blk;
	__u32 zero = 0, chunk, base = 0, n, off, len, idx;
	__s64 w;
	__u8 op;
	int first, last;

	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s)
		return 1; /* cannot happen: the caller found it */
	chunk = s->chunk;
	n = chunk_elems(s, &base);
	if (n == 0 || n > AGGBOX_CHUNK_ELEMS || base > AGGBOX_MAX_ELEMS) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL; /* chain state corrupt: a bug */
		return 1;
	}
	off = s->agg_off + sizeof(struct aggbox_agg_hdr) + base * 4;
	len = chunk_bytes(n);
	if (!len || payload_copy(lp->ctx, off, s, len, 0, linear)) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL; /* validated length: a bug */
		return 1;
	}
	if (chunk >= AGGBOX_MAX_CHUNKS) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL; /* chain state corrupt: a bug */
		return 1;
	}
	idx = s->block[chunk];
	blk = bpf_map_lookup_elem(&blocks, &idx);
	if (!blk) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL; /* an index past the pool: a bug */
		return 1;
	}
	w = s->weight;
	op = s->op;

	bpf_spin_lock(&blk->lock);
	if (!block_matches(blk, s, chunk)) {
		/* The slot was released (reclaimed, job removed) and the
		 * element reused meanwhile. */
		bpf_spin_unlock(&blk->lock);
		s->stop = AGGBOX_DROP_RETRANSMISSION;
		return 1;
	}
	first = blk->b.seen == 0;
	last = ++blk->b.seen == s->workers;
	add_block(blk->b.acc, (const __u64 *)s->buf, op, w, first);
	bpf_spin_unlock(&blk->lock);
	/*
	 * The last adder of a block writes its result into this packet now,
	 * while the accumulators are in cache, instead of the result stage
	 * looking the block up and reading it again. The block is final: every
	 * rank has added it and a retransmission never gets past the slot's
	 * bitmap. Usually this contribution then also completes the slot and
	 * the result stage skips the chunk (bit in s->finalized); if another
	 * contribution completes it (interleaved on another CPU), that one
	 * writes the chunk itself and this packet is dropped anyway. AVG (a
	 * division by the weight sum) and a block with a clamped value are left
	 * to the result stage.
	 */
	if (last && op != AGGBOX_OP_AVG && chunk < AGGBOX_MAX_CHUNKS &&
	    result_block_fits(blk->b.acc, (__u64 *)s->buf) &&
	    !payload_copy(lp->ctx, off, s, len, 1, linear))
		s->finalized |= 1ULL << chunk;
	s->chunk = chunk + 1;
	return 0;
}

static long add_chunk_cb(__u64 index, void *data)
{
	return add_chunk(data, 0);
}

/*
 * The linear chain's chunk: a global function, which the verifier checks
 * once on its own (like a bpf_loop callback), not once per state the stage
 * reaches it with (inlined, the MAX/MIN loops went past 1M instructions).
 */
__noinline int add_chunk_linear(struct xdp_md *ctx)
{
	struct chain_loop lp = { .ctx = ctx };

	return add_chunk(&lp, 1);
}

/*
 * Count the contribution as done in the slot header. Returns RESULT for
 * the one contribution that completes the slot, ACCEPTED for the others.
 */
static __always_inline int slot_done(struct aggbox_scratch *s)
{
	struct aggbox_slot *slot;
	int code;

	slot = bpf_map_lookup_elem(&slots, &s->key);
	if (!slot)
		return AGGBOX_DROP_SLOT_MISMATCH; /* removed by the control plane */
	bpf_spin_lock(&slot->lock);
	if (slot->b.key.job != s->key.job || slot->b.key.round != s->key.round ||
	    slot->b.key.frag_off != s->key.frag_off) {
		code = AGGBOX_DROP_RETRANSMISSION; /* released and reused meanwhile */
	} else {
		slot->b.done++;
		code = slot->b.done == slot->b.workers ? AGGBOX_OUTCOME_RESULT : AGGBOX_OUTCOME_ACCEPTED;
		s->result_flags = AGGBOX_AGG_F_RESULT | (slot->b.flags & AGGBOX_AGG_F_CARRIED);
		s->weight_sum = slot->b.weight_sum;
	}
	bpf_spin_unlock(&slot->lock);
	return code;
}

/* Chunks left to this program run (0 when the chain state is corrupt). */
static __always_inline __u32 chunks_this_run(struct aggbox_scratch *s, __u32 *total, const int linear)
{
	const __u32 per_run = linear ? 1 : AGGBOX_PROG_CHUNKS;
	__u32 left;

	if (s->count > AGGBOX_MAX_ELEMS)
		return 0;
	*total = chunks_of(s->count);
	if (s->chunk >= *total)
		return 0;
	left = *total - s->chunk;
	return left > per_run ? per_run : left;
}

static __always_inline int add_stage(struct xdp_md *ctx, const int linear)
{
	struct chain_loop lp = { .ctx = ctx };
	__u32 zero = 0, todo, total = 0;
	struct aggbox_scratch *s = bpf_map_lookup_elem(&scratch, &zero);
	int code;

	if (!s)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, 0);
	todo = chunks_this_run(s, &total, linear);
	if (!todo)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, s->bytes);
	s->stop = 0;
	if (linear)
		add_chunk_linear(ctx);
	else
		bpf_loop(todo, add_chunk_cb, &lp, 0);
	if (s->stop)
		return aggbox_exit(s->stop, s->bytes);
	if (s->chunk < total) {
		return aggbox_exit(aggbox_tail_call(ctx, AGGBOX_CALL_ADD, linear), s->bytes);
	}
	code = slot_done(s);
	if (code == AGGBOX_OUTCOME_RESULT) {
		s->chunk = 0;
		s->overflow = 0;
		code = aggbox_tail_call(ctx, AGGBOX_CALL_RESULT, linear);
	}
	return aggbox_exit(code, s->bytes);
}

CHAIN_PROGRAMS(aggbox_add, add_stage)

/* ---------------------------------------------------------------------------
 * CALL_RESULT: the completing contribution rewrites its own packet into the
 * RESULT, AGGBOX_PROG_CHUNKS chunks per program run (bpf_xdp_store_bytes
 * from the scratch buffer), then releases the slot. No lock: every other
 * contribution of the slot is done and retransmissions only read the
 * header's bitmap.
 * ------------------------------------------------------------------------- */

static __always_inline int finish_result(struct xdp_md *ctx, struct aggbox_scratch *s, const int linear)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_job_state *js = job_state_of(s->jidx);
	struct aggbox_agg_hdr *agg;
	struct udphdr *udph;
	__u32 one = 1, udp_off = s->udp_off;

	if (udp_off > 128)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	udph = data + udp_off;
	agg = (void *)(udph + 1);
	if ((void *)(agg + 1) > data_end)
		return AGGBOX_DROP_MISSED_TAIL_CALL;

	agg->rank = bpf_htons(AGGBOX_RESULT_RANK);
	result_seq_write(agg, s, js);
	agg->flags = s->result_flags | (s->overflow ? AGGBOX_AGG_F_OVERFLOW : 0);
	udph->dest = bpf_htons(s->result_port);
	udph->check = 0;

	/* Release: the marker first, so the key can never get a new slot. */
	bpf_map_update_elem(&completed, &s->key, &one, BPF_ANY);
	bpf_map_delete_elem(&slots, &s->key);
	bpf_map_delete_elem(&slot_owner, &s->key);
	blocks_give(s->block, chunks_of(s->count), linear);
	if (js) {
		__sync_fetch_and_sub(&js->active_slots, 1);
		job_completed(js, s->jidx, s->key.round);
	}
	return AGGBOX_OUTCOME_RESULT;
}

/* Clamp to int32; a clamped element of the fragment (`real`: not one of the
 * never-read accumulators past count) sets s->overflow (map memory: no
 * verifier state per value). */
static __always_inline __s64 clamp_i32(struct aggbox_scratch *s, __s64 r, int real)
{
	if (r > INT32_MAX_) {
		if (real)
			s->overflow = 1;
		return INT32_MAX_;
	}
	if (r < INT32_MIN_) {
		if (real)
			s->overflow = 1;
		return INT32_MIN_;
	}
	return r;
}

/* Write chunk s->chunk of the result into the packet (bpf_loop callback
 * body). */
static __always_inline long result_chunk(void *data, const int linear)
{
	struct chain_loop *lp = data;
	struct aggbox_scratch *s;
	struct aggbox_block *blk;
	__u32 zero = 0, chunk, base = 0, n, j, off, ws, len, idx;

	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s)
		return 1; /* cannot happen: the caller found it */
	chunk = s->chunk;
	n = chunk_elems(s, &base);
	if (n == 0 || n > AGGBOX_CHUNK_ELEMS || base > AGGBOX_MAX_ELEMS) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL;
		return 1;
	}
	if (chunk < AGGBOX_MAX_CHUNKS && (s->finalized >> chunk) & 1) {
		s->chunk = chunk + 1; /* written by this packet's add stage */
		return 0;
	}
	if (chunk >= AGGBOX_MAX_CHUNKS) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL;
		return 1;
	}
	idx = s->block[chunk];
	blk = bpf_map_lookup_elem(&blocks, &idx);
	if (!blk) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL;
		return 1;
	}
	ws = s->weight_sum ? s->weight_sum : 1;
	s->chunk_n = n;

	/* Whole block, no data-dependent exit (see add_chunk_cb); only the
	 * first n results are stored into the packet. */
	if (s->op == AGGBOX_OP_AVG) {
		for (j = 0; j < AGGBOX_CHUNK_ELEMS; j++) {
			__s64 r = aggbox_op_finish(AGGBOX_OP_AVG, blk->b.acc[j], ws);

			s->buf[j] = bpf_htonl((__u32)clamp_i32(s, r, j < *(volatile __u32 *)&s->chunk_n));
		}
	} else if (result_block_fits(blk->b.acc, (__u64 *)s->buf)) {
		/* every accumulator fit in int32: nothing was clamped */
	} else {
		for (j = 0; j < AGGBOX_CHUNK_ELEMS; j++)
			s->buf[j] = bpf_htonl((__u32)clamp_i32(s, blk->b.acc[j], j < *(volatile __u32 *)&s->chunk_n));
	}
	off = s->agg_off + sizeof(struct aggbox_agg_hdr) + base * 4;
	len = chunk_bytes(n);
	if (!len || payload_copy(lp->ctx, off, s, len, 1, linear)) {
		s->stop = AGGBOX_DROP_MISSED_TAIL_CALL;
		return 1;
	}
	s->chunk = chunk + 1;
	return 0;
}

static long result_chunk_cb(__u64 index, void *data)
{
	return result_chunk(data, 0);
}

/* The linear chain's result chunk: a global function (see add_chunk_linear). */
__noinline int result_chunk_linear(struct xdp_md *ctx)
{
	struct chain_loop lp = { .ctx = ctx };

	return result_chunk(&lp, 1);
}

static __always_inline int result_stage(struct xdp_md *ctx, const int linear)
{
	struct chain_loop lp = { .ctx = ctx };
	__u32 zero = 0, todo, total = 0;
	struct aggbox_scratch *s = bpf_map_lookup_elem(&scratch, &zero);
	int code;

	if (!s)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, 0);
	todo = chunks_this_run(s, &total, linear);
	if (!todo)
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, s->bytes);
	s->stop = 0;
	if (linear)
		result_chunk_linear(ctx);
	else
		bpf_loop(todo, result_chunk_cb, &lp, 0);
	if (s->stop)
		return aggbox_exit(s->stop, s->bytes);
	if (s->chunk < total) {
		return aggbox_exit(aggbox_tail_call(ctx, AGGBOX_CALL_RESULT, linear), s->bytes);
	}
	code = finish_result(ctx, s, linear);
	if (code == AGGBOX_OUTCOME_RESULT && s->family == AGGBOX_FAMILY_IPV6)
		code = udp6_result(ctx, linear);
	return aggbox_exit(code, s->bytes);
}

CHAIN_PROGRAMS(aggbox_result, result_stage)

/* ---------------------------------------------------------------------------
 * aggbox_reclaim: release the slot of a round that can never complete.
 *
 * Not attached anywhere and not in the tail-call array: the control plane
 * runs it with BPF_PROG_TEST_RUN (Dataplane::reclaim_slot, from the daemon's
 * periodic tick) on a frame of an Ethernet header's 14 bytes followed by a
 * struct aggbox_slot_key (host order), for slots whose round is stale (older
 * than the job's newest completed round - window): the stale-round rule
 * drops every later contribution to them, so they would hold their share of
 * the job's slot bound forever. Doing it here, not with a map delete from
 * user space, keeps job_state.active_slots exact: only the kernel updates it,
 * atomically.
 *
 * The work is slot_release()'s (shared with a fast slot that wins over a
 * hash-map slot nobody added to).
 *
 * Verdicts: XDP_PASS reclaimed, XDP_DROP no such slot, XDP_TX completing or
 * reused (left alone), XDP_ABORTED malformed request.
 * ------------------------------------------------------------------------- */
SEC("xdp")
int aggbox_reclaim(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_slot_key *in = data + sizeof(struct ethhdr);
	struct aggbox_slot_key key;

	if ((void *)(in + 1) > data_end)
		return XDP_ABORTED;
	key.job = in->job;
	key.pad = 0;
	key.round = in->round;
	key.frag_off = in->frag_off;
	return slot_release(&key);
}

/* ---------------------------------------------------------------------------
 * aggbox_fast_discard: release one fast slot of a job whose membership
 * changed (Dataplane::set_job), or (FAST_DISCARD_F_ROUND) one that still
 * holds an unfinished fragment of a stale round (KernelMaps::
 * reclaim_stale_slots), like aggbox_reclaim for the hash-map slots and run
 * the same way, on a frame of an Ethernet header's 14 bytes followed by a
 * struct aggbox_fast_discard_req. Under the slot's lock an ACTIVE or
 * DONE slot of the job becomes EMPTY, and an ACTIVE one gives its
 * job_state.active_slots reservation back. A CLAIMING slot is left to its
 * taker and a RESULTING one to its completer (both end by themselves),
 * except a CLAIMING take-over of the stale round asked for: its taker could
 * not undo it (fast_lock busy past its bound), so it is undone here.
 *
 * Verdicts: XDP_PASS released an ACTIVE slot, XDP_DROP nothing to release,
 * XDP_TX the lock stayed held past its bound (try again), XDP_ABORTED
 * malformed request.
 * ------------------------------------------------------------------------- */
struct aggbox_fast_discard_req {
	__u16 job;
	__u16 flags;  /* FAST_DISCARD_F_ROUND: only if the slot holds `round` */
	__u32 index;
	__u32 round;
};
#define FAST_DISCARD_F_ROUND 0x1

SEC("xdp")
int aggbox_fast_discard(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct aggbox_fast_discard_req *in = data + sizeof(struct ethhdr);
	struct aggbox_job_state *js;
	struct aggbox_fast_slot *f;
	__u32 idx;
	int active = 0, jidx;

	if ((void *)(in + 1) > data_end)
		return XDP_ABORTED;
	idx = in->index;
	f = bpf_map_lookup_elem(&fast_slots, &idx);
	if (!f)
		return XDP_ABORTED;
	if (fast_lock(f, idx))
		return XDP_TX; /* busy: the caller tries again */
	if (f->job == in->job && (f->state == FAST_ACTIVE || f->state == FAST_DONE) &&
	    (!(in->flags & FAST_DISCARD_F_ROUND) || (f->state == FAST_ACTIVE && f->round == in->round))) {
		active = f->state == FAST_ACTIVE;
		f->state = FAST_EMPTY;
		f->prev_valid = 0;
	} else if (f->job == in->job && f->state == FAST_CLAIMING && (in->flags & FAST_DISCARD_F_ROUND) &&
		   f->round == in->round) {
		/* A take-over of a stale round that its taker could not undo
		 * (the lock busy past the bound): undone as the hash-map path
		 * undoes one. The taker gave its reservation back itself. */
		fast_restore(f);
	}
	fast_unlock(f);
	if (!active)
		return XDP_DROP;
	jidx = job_index_of(in->job);
	js = jidx < 0 ? NULL : job_state_of((__u32)jidx);
	if (js)
		__sync_fetch_and_sub(&js->active_slots, 1);
	fast_count(AGGBOX_FAST_RELEASED);
	return XDP_PASS;
}
