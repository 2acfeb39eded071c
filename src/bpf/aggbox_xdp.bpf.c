// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * AggBox XDP aggregator: parse and validate AGG1 contributions (PROTOCOL.md,
 * "Semantics at the aggregator").
 *
 * Ethernet [+ one VLAN tag] / IPv4 (IHL honoured) / UDP to a job port / AGG1.
 * Anything else goes to the stack untouched (outcome NOT_AGGBOX). Every
 * datagram ends in aggbox_exit() (stats.h), which counts the outcome or the
 * drop reason and returns the verdict.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "aggbox/abi.h"

/* A valid contribution that does not complete its slot is absorbed. */
#define AGGBOX_ACCEPTED_VERDICT XDP_DROP

#include "parse.h"
#include "slot.h"
#include "stats.h"
#include "tailcall.h"
#include "handoff.h"

/* Internal code of a chain stage: more chunks to go (never counted). */
#define AGGBOX_CONTINUE 100

#define EEXIST 17
#define INT32_MAX_ ((__s64)0x7fffffff)
#define INT32_MIN_ (-(__s64)0x80000000)

#ifndef MAX_PORTS
#define MAX_PORTS 256
#endif
#ifndef MAX_RANK_ENTRIES
#define MAX_RANK_ENTRIES (AGGBOX_MAX_JOBS * AGGBOX_MAX_RANKS)
#endif

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
 * the kernel's helpers) and fills that set's prog array (tailcall.h: a prog
 * array only holds programs of one frags flag, so each set has its own).
 */

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

/*
 * ports: UDP destination ports (host order) on which some job listens ->
 * number of jobs on that port. Written by the control plane
 * (Dataplane::set_job / remove_job); read here to tell AggBox traffic from
 * the rest before touching the payload.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PORTS);
	__type(key, struct aggbox_port_key);
	__type(value, struct aggbox_port);
} ports SEC(".maps");

/*
 * jobs: job id -> how this node aggregates it (workers, vector length,
 * slot bound, flags, AVG divisor). Written by the control plane
 * (Dataplane::set_job / remove_job), read-only here.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, struct aggbox_job_key);
	__type(value, struct aggbox_job);
} jobs SEC(".maps");

/*
 * ranks: (job, rank) -> the rank's IPv4 source address and weight. Written
 * by the control plane with the job (Dataplane::set_job), read-only here.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_RANK_ENTRIES);
	__type(key, struct aggbox_rank_key);
	__type(value, struct aggbox_rank);
} ranks SEC(".maps");

/* scratch: slot.h (stats.h reads its job_known / key.job at the exit). */

/*
 * slots: the slot pool, (job, round, frag_off) -> running reduction of one
 * fragment with its contributor bitmap and spin lock. Created, updated and
 * deleted (on completion) by the XDP programs; the control plane deletes the
 * slots of a removed job. Bounded per job by job.slots through
 * job_state.active_slots and globally by AGGBOX_MAX_SLOTS.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_SLOTS);
	__type(key, struct aggbox_slot_key);
	__type(value, struct aggbox_slot);
} slots SEC(".maps");

/*
 * blocks: the block pool, AGGBOX_MAX_BLOCKS chunks of AGGBOX_CHUNK_ELEMS s64
 * accumulators, each with its own spin lock. A slot of `count` elements
 * owns ceil(count / AGGBOX_CHUNK_ELEMS) of them, taken from free_blocks
 * before its header is inserted into `slots` (their indexes are in the
 * header) and given back by whoever deletes that header: the completing
 * program, aggbox_reclaim (also the control plane's way to release the
 * slots of a removed job), or a creator that lost a race. An array, not a
 * hash keyed by (slot, chunk): a lookup is an index computation, and
 * creating or completing a slot costs a stack pop or push per block
 * instead of a hash insert or delete (docs/JUMBO.md). XDP only.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_BLOCKS);
	__type(key, __u32);
	__type(value, struct aggbox_block);
} blocks SEC(".maps");

/*
 * free_blocks: indexes of the unused blocks. A stack: the block given back
 * last is taken first, while its 2 KB are still in cache (a FIFO hands out
 * the coldest block; measured, creating a 64-block slot took 21.5 µs with a
 * queue, 17.2 µs with the stack). Filled with every index by the control
 * plane right after load (Dataplane::load), before any program is attached;
 * popped and pushed by the XDP programs only.
 */
struct {
	__uint(type, BPF_MAP_TYPE_STACK);
	__uint(max_entries, AGGBOX_MAX_BLOCKS);
	__type(value, __u32);
} free_blocks SEC(".maps");

/*
 * blocks_used: [0] = blocks owned by slots (all jobs), updated atomically
 * with every take and give-back: what the metrics and tests read (a
 * stack's length cannot be read from user space).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} blocks_used SEC(".maps");

/*
 * slot_init: per-CPU template a new slot header is copied from (too big for
 * the stack); it also holds the block indexes being taken for it. Only
 * keys, block indexes and op/count/workers/weight_sum are ever written, so
 * bitmaps and counters stay zero. XDP only.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct aggbox_init);
} slot_init SEC(".maps");

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

/*
 * completed: keys of recently completed slots (LRU). Written by the XDP
 * program that completes a slot, before it deletes the slot, so that a late
 * retransmission never starts a new slot for a finished fragment.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, AGGBOX_MAX_COMPLETED);
	__type(key, struct aggbox_slot_key);
	__type(value, __u32);
} completed SEC(".maps");

/*
 * job_state: job id -> runtime state (slots in use, newest completed round,
 * completions, RESULT seq counter). Created zeroed by the control plane in
 * set_job (and by XDP if missing), updated atomically by the XDP programs,
 * deleted by remove_job.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, struct aggbox_job_key);
	__type(value, struct aggbox_job_state);
} job_state SEC(".maps");

/*
 * slot_owner: (job, round, frag_off) -> which path serves the slot
 * (AGGBOX_OWNER_KERNEL / AGGBOX_OWNER_USERSPACE). Inserted with BPF_NOEXIST
 * by the XDP program that decides where a NEW slot lives, so every
 * contribution of one fragment goes to the same path; deleted by the path
 * that completes the slot (after it wrote `completed`), by the user-space
 * path when it stops, and by the control plane with the job.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_OWNERS);
	__type(key, struct aggbox_slot_key);
	__type(value, struct aggbox_slot_owner);
} slot_owner SEC(".maps");

/*
 * job_handoff: job id -> user-space path state the kernel honours: the
 * OVERLOAD flag (new slots of the job go to user space) and the newest
 * round completed in user space (stale-round rule across both paths).
 * Written by the user-space path (src/userspace.rs) only; read here.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, struct aggbox_job_key);
	__type(value, struct aggbox_job_handoff);
} job_handoff SEC(".maps");

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
	struct aggbox_port_key port_key = {};
	struct aggbox_job_key job_key = {};
	struct aggbox_rank_key rank_key = {};
	struct aggbox_agg_hdr *agg;
	struct aggbox_rank *rank;
	struct aggbox_job *job;
	struct ethhdr *eth;
	struct iphdr *iph;
	struct udphdr *udph;
	__u32 avail, count, plen;
	__u64 end;
	int proto, len;
	__u16 frag, l3;

	proto = parse_ethhdr(&nh, data_end, &eth);
	if (proto != ETH_P_IP)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	l3 = proto_is_vlan(bpf_ntohs(eth->h_proto)) ? sizeof(*eth) + sizeof(struct vlan_hdr) : sizeof(*eth);
	proto = parse_iphdr(&nh, data_end, &iph);
	if (proto != IPPROTO_UDP_)
		return AGGBOX_OUTCOME_NOT_AGGBOX;

	frag = bpf_ntohs(iph->frag_off);
	/* A non-first fragment carries no UDP header: its port is unknown. */
	if (frag & IP_OFFSET)
		return AGGBOX_OUTCOME_NOT_AGGBOX;

	len = parse_udphdr(&nh, data_end, &udph);
	if (len < 0)
		return AGGBOX_OUTCOME_NOT_AGGBOX;
	s->bytes = len;

	port_key.port = bpf_ntohs(udph->dest);
	if (!bpf_map_lookup_elem(&ports, &port_key))
		return AGGBOX_OUTCOME_NOT_AGGBOX;

	/* First fragment of a fragmented datagram to a job port. */
	if (frag & IP_MF)
		return AGGBOX_DROP_IP_OPTIONS_OR_FRAGMENT;

	agg = nh.pos;
	/* Bytes the frame holds past the UDP header, fragments included
	 * (multi-buffer XDP: the headers are in the linear part, the payload
	 * may run on into fragments). */
	avail = frame_len(ctx, linear) - (__u32)(nh.pos - data);
	plen = len;                /* bytes the UDP header announces */
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

	job_key.job = bpf_ntohs(agg->job);
	job = bpf_map_lookup_elem(&jobs, &job_key);
	if (!job)
		return AGGBOX_DROP_UNKNOWN_JOB;
	/* From here on every outcome is the job's too (job_stats, stats.h). */
	s->key.job = job_key.job;
	s->job_known = 1;

	rank_key.job = job_key.job;
	rank_key.rank = bpf_ntohs(agg->rank);
	if (rank_key.rank >= job->workers)
		return AGGBOX_DROP_RANK_OUT_OF_RANGE;
	rank = bpf_map_lookup_elem(&ranks, &rank_key);
	if (!rank || rank->addr != iph->saddr)
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
	if (agg->op > AGGBOX_OP_LAST_KERNEL) {
		s->handoff = AGGBOX_HANDOFF_OP;
		return AGGBOX_OUTCOME_TO_USERSPACE;
	}

	s->ip_off = l3;
	s->udp_off = l3 + iph->ihl * 4;
	s->agg_off = s->udp_off + sizeof(*udph);
	s->key.job = job_key.job;
	s->key.pad = 0;
	s->key.round = bpf_ntohl(agg->round);
	s->key.frag_off = bpf_ntohl(agg->frag_off);
	s->count = count;
	s->op = agg->op;
	s->flags = agg->flags;
	s->overflow = 0;
	s->result_flags = 0;
	s->chunk = 0;
	s->rank = rank_key.rank;
	s->workers = job->workers;
	s->result_port = job->result_port;
	s->weight = rank->weight;
	s->weight_sum = job->weight_sum;
	s->slots = job->slots;
	s->window = job->window ? job->window : AGGBOX_ROUND_WINDOW;
	return AGGBOX_OUTCOME_ACCEPTED;
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
	if (code == AGGBOX_OUTCOME_TO_USERSPACE)
		return aggbox_handoff(ctx, s->handoff, AGGBOX_OUTCOME_USERSPACE_UNAVAILABLE, s->bytes,
				      frame_len(ctx, linear));
	if (code == AGGBOX_OUTCOME_ACCEPTED) {
		if (s->count > (linear ? AGGBOX_LINEAR_MAX_ELEMS : AGGBOX_MAX_ELEMS)) {
			code = AGGBOX_DROP_TOO_LARGE;
		} else {
			aggbox_tail_call(ctx, AGGBOX_CALL_SLOT, linear);
			code = AGGBOX_DROP_MISSED_TAIL_CALL;
		}
	}
	return aggbox_exit(code, s->bytes);
}

CHAIN_PROGRAMS(aggbox_xdp, entry_stage)

/* ---------------------------------------------------------------------------
 * CALL_SLOT: find or create the slot, reject stale rounds and
 * retransmissions, claim the rank's bit.
 * ------------------------------------------------------------------------- */

static __always_inline struct aggbox_job_state *job_state_of(__u16 job)
{
	struct aggbox_job_key key = { .job = job };
	struct aggbox_job_state zero = {};
	struct aggbox_job_state *js;

	js = bpf_map_lookup_elem(&job_state, &key);
	if (js)
		return js;
	bpf_map_update_elem(&job_state, &key, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&job_state, &key);
}

/* Internal code of slot_claim: hand the contribution to user space
 * (reason in s->handoff); never counted under this value. */
#define AGGBOX_HANDOFF_CODE 101

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
		/* Give the reservation and blocks back only if our delete
		 * removed the header: a completion or aggbox_reclaim that
		 * deleted it gave them back. */
		if (!bpf_map_delete_elem(&slots, &s->key)) {
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
	__u32 limit;
	int err, reserved = 0;

	if (bpf_map_lookup_elem(&completed, &s->key))
		return AGGBOX_DROP_RETRANSMISSION;
	owner = bpf_map_lookup_elem(&slot_owner, &s->key);
	if (!owner) {
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
		err = bpf_map_update_elem(&slot_owner, &s->key, &mine, BPF_NOEXIST);
		if (!err) {
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
	struct aggbox_job_key jkey = { .job = s->key.job };
	struct aggbox_job_state *js = job_state_of(s->key.job);
	struct aggbox_job_handoff *ho;
	struct aggbox_slot *slot;
	__u32 word, bit;
	int code;

	if (!js)
		return AGGBOX_DROP_SLOT_POOL_FULL;
	ho = bpf_map_lookup_elem(&job_handoff, &jkey);
	/* Serial-number comparison: rounds may wrap. Either path's newest
	 * completed round makes older rounds stale. */
	if (js->completed && (__s32)(js->newest_round - s->key.round) > (__s32)s->window)
		return AGGBOX_DROP_STALE_ROUND;
	if (ho && ho->completed && (__s32)(ho->newest_round - s->key.round) > (__s32)s->window)
		return AGGBOX_DROP_STALE_ROUND;

	slot = bpf_map_lookup_elem(&slots, &s->key);
	if (!slot) {
		code = slot_place(ctx, s, js, ho, linear);
		if (code)
			return code;
		slot = bpf_map_lookup_elem(&slots, &s->key);
		if (!slot)
			return AGGBOX_DROP_RETRANSMISSION; /* completed meanwhile */
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
	if (code == AGGBOX_HANDOFF_CODE)
		return aggbox_handoff(ctx, s->handoff, AGGBOX_DROP_SLOT_POOL_FULL, s->bytes,
				      frame_len(ctx, linear));
	if (code == AGGBOX_OUTCOME_ACCEPTED) {
		s->chunk = 0;
		s->finalized = 0;
		aggbox_tail_call(ctx, AGGBOX_CALL_ADD, linear);
		code = AGGBOX_DROP_MISSED_TAIL_CALL;
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
#define PAIR_FIRST(y) ((__s64)(y) >> 32)
#define PAIR_SECOND(y) ((__s64)((y) << 32) >> 32)
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
		aggbox_tail_call(ctx, AGGBOX_CALL_ADD, linear);
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, s->bytes);
	}
	code = slot_done(s);
	if (code == AGGBOX_OUTCOME_RESULT) {
		s->chunk = 0;
		s->overflow = 0;
		aggbox_tail_call(ctx, AGGBOX_CALL_RESULT, linear);
		code = AGGBOX_DROP_MISSED_TAIL_CALL;
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
	struct aggbox_job_state *js = job_state_of(s->key.job);
	struct aggbox_agg_hdr *agg;
	struct udphdr *udph;
	__u32 one = 1, seq = 0, cur, udp_off = s->udp_off, i;

	if (udp_off > 128)
		return AGGBOX_DROP_MISSED_TAIL_CALL;
	udph = data + udp_off;
	agg = (void *)(udph + 1);
	if ((void *)(agg + 1) > data_end)
		return AGGBOX_DROP_MISSED_TAIL_CALL;

	if (js)
		seq = __sync_fetch_and_add(&js->result_seq, 1);
	agg->rank = bpf_htons(AGGBOX_RESULT_RANK);
	agg->seq = bpf_htonl(seq);
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
		for (i = 0; i < 4; i++) {
			cur = js->newest_round;
			if (js->completed && (__s32)(s->key.round - cur) <= 0)
				break;
			if (__sync_val_compare_and_swap(&js->newest_round, cur, s->key.round) == cur)
				break;
		}
		__sync_fetch_and_add(&js->completed, 1);
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
			__s64 r = blk->b.acc[j];
			/* truncation toward zero; BPF v3 has unsigned division only */
			__u64 u = r < 0 ? -(__u64)r : (__u64)r;

			u /= ws;
			r = r < 0 ? -(__s64)u : (__s64)u;
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
		aggbox_tail_call(ctx, AGGBOX_CALL_RESULT, linear);
		return aggbox_exit(AGGBOX_DROP_MISSED_TAIL_CALL, s->bytes);
	}
	return aggbox_exit(finish_result(ctx, s, linear), s->bytes);
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
 * Under the slot's lock: a slot whose contributions are all done is
 * completing (finish_result deletes it and gives its reservation back) and
 * is left alone; otherwise it is poisoned (workers = 0xffff, so no
 * contributor still in the chain can complete it; the stored key changed, so
 * a contributor that looked it up before the delete sees a reused element
 * and counts a retransmission). Then it is deleted with its slot_owner
 * record, and the reservation and its blocks (indexes copied under the lock)
 * are given back only if this delete removed it.
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
	struct aggbox_job_key jkey = {};
	struct aggbox_slot_key key;
	struct aggbox_job_state *js;
	struct aggbox_slot *slot;
	struct blocks_give bg;
	__u32 count;
	int busy = 0;

	if ((void *)(in + 1) > data_end)
		return XDP_ABORTED;
	key.job = in->job;
	key.pad = 0;
	key.round = in->round;
	key.frag_off = in->frag_off;
	slot = bpf_map_lookup_elem(&slots, &key);
	if (!slot)
		return XDP_DROP;
	bpf_spin_lock(&slot->lock);
	count = slot->b.count;
	if (slot->b.key.job != key.job || slot->b.key.round != key.round ||
	    slot->b.key.frag_off != key.frag_off || slot->b.done >= slot->b.workers) {
		busy = 1;
	} else {
		slot->b.workers = 0xffff;
		slot->b.key.round = ~key.round;
		__builtin_memcpy(bg.block, slot->b.block, sizeof(bg.block));
	}
	bpf_spin_unlock(&slot->lock);
	if (busy)
		return XDP_TX;
	if (bpf_map_delete_elem(&slots, &key))
		return XDP_DROP;
	bpf_map_delete_elem(&slot_owner, &key);
	if (count <= AGGBOX_MAX_ELEMS)
		blocks_give(bg.block, chunks_of(count), 1); /* no bpf_loop: loads on every kernel */
	jkey.job = key.job;
	js = bpf_map_lookup_elem(&job_state, &jkey);
	if (js)
		__sync_fetch_and_sub(&js->active_slots, 1);
	return XDP_PASS;
}
