/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Every map of the XDP aggregator (aggbox_xdp.bpf.c), in one place as katran's
 * balancer_maps.h: one comment each saying what it maps (key -> value), who
 * writes it and who reads it. The helpers that use them (stats.h,
 * handoff.h, tailcall.h, the programs) include this header.
 *
 * The control plane finds each map by its name in the skeleton
 * (skel.maps.<name>), and the user-space path and tests by the same names:
 * a name here is part of the interface with the Rust side. Value types come
 * from include/aggbox/abi.h (shared with Rust) or slot.h and scratch.h
 * (BPF-only).
 */
#ifndef AGGBOX_XDP_MAPS_H
#define AGGBOX_XDP_MAPS_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "aggbox/abi.h"
#include "slot.h"     /* slots, blocks, slot_init, fast_slots, job_round values */
#include "scratch.h"  /* scratch value */

/* ranks: AGGBOX_MAX_RANKS entries per job. */
#ifndef MAX_RANK_ENTRIES
#define MAX_RANK_ENTRIES (AGGBOX_MAX_JOBS * AGGBOX_MAX_RANKS)
#endif

/* ---------------------------------------------------------------------------
 * Configuration: written by the control plane, read by every datagram.
 * ------------------------------------------------------------------------- */

/*
 * ports: UDP destination port (host order, the array index) -> number of
 * jobs listening on it (0: not an AggBox port). An array: the lookup on
 * every datagram is an index, not a hash. Written by the control plane
 * (Dataplane::set_job / remove_job); read by the entry program to tell
 * AggBox traffic from the rest before touching the payload.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct aggbox_port);
} ports SEC(".maps");

/*
 * job_index: job id (the array index) -> 1 + the job's dense index
 * (0..AGGBOX_MAX_JOBS-1) in jobs, ranks, job_state, job_handoff and
 * job_stats, or 0 when the job is not configured. Written by the control
 * plane last when it adds a job and first when it removes one, so a
 * datagram never finds an index whose entries are not the job's.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u32);
} job_index SEC(".maps");

/*
 * jobs: dense job index -> how this node aggregates the job (its id,
 * workers, vector length, slot bound, flags, AVG divisor, fast-slot
 * region). Written by the control plane (Dataplane::set_job / remove_job),
 * read by the XDP programs (and the user-space path).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct aggbox_job);
} jobs SEC(".maps");

/*
 * ranks: dense job index * AGGBOX_MAX_RANKS + rank -> the rank's IP version,
 * source address and weight (a job's ranks are all IPv4 or all IPv6).
 * Written by the control plane with the job (Dataplane::set_job), read by
 * the entry program (source check, weight).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_RANK_ENTRIES);
	__type(key, __u32);
	__type(value, struct aggbox_rank);
} ranks SEC(".maps");

/* ---------------------------------------------------------------------------
 * The tail-call chain (tailcall.h) and the state its programs hand on.
 * ------------------------------------------------------------------------- */

/*
 * progs: the XDP chain's programs indexed by enum aggbox_call. Filled once
 * by the control plane right after load (XdpPlane::fill_prog_arrays in
 * src/kernel/xdp/load.rs); read by bpf_tail_call() only.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, AGGBOX_CALL_MAX);
	__type(key, __u32);
	__type(value, __u32);
} progs SEC(".maps");

/*
 * progs_linear: the same for the linear chain (the *_linear programs). A prog
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

/* ---------------------------------------------------------------------------
 * Hash-map slots: the path of a fragment without a fast slot (CALL_SLOT,
 * CALL_ADD, CALL_RESULT), and the markers both paths consult.
 * ------------------------------------------------------------------------- */

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
 * by the XDP programs with every take and give-back: what the metrics and
 * tests read (a stack's length cannot be read from user space).
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

/*
 * completed: (job, round, frag_off) -> 1, keys of recently completed slots
 * (LRU). Written by the path that completes a slot (XDP, or the user-space
 * path), before it deletes the slot, so that a late retransmission never
 * starts a new slot for a finished fragment; read by the XDP programs
 * before they make a slot or take a fast slot. The control plane deletes
 * a removed job's.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, AGGBOX_MAX_COMPLETED);
	__type(key, struct aggbox_slot_key);
	__type(value, __u32);
} completed SEC(".maps");

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

/* ---------------------------------------------------------------------------
 * Per-job runtime state (dense job index, see job_index).
 * ------------------------------------------------------------------------- */

/*
 * job_state: dense job index -> runtime state (slots in use, newest
 * completed round, completions, RESULT seq counter). Zeroed by the control
 * plane when a job gets its index, updated atomically by the XDP programs;
 * read by the control plane and the user-space path.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct aggbox_job_state);
} job_state SEC(".maps");

/*
 * job_round: dense job index -> the newest completed round (of the kernel's
 * paths) as the stale-round rule reads it on every datagram: a copy of
 * job_state.newest_round on a cache line of its own, written only when a
 * newer round completes (job_state is written by every fragment's take and
 * completion, and a line that bounces between CPUs on every datagram costs
 * more than the lookups around it). Zeroed by the control plane with the
 * job's other entries; XDP writes.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct aggbox_job_round);
} job_round SEC(".maps");

/*
 * job_paths: dense job index -> bit 0 set once the hash-map path has made a
 * slot_owner record for the job (set before the record, with a full
 * barrier). Until then a fast slot's taker has no other path to check.
 * Zeroed by the control plane with the job's other entries; XDP sets it.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, __u32);
} job_paths SEC(".maps");

/*
 * job_handoff: dense job index -> user-space path state the kernel honours:
 * the OVERLOAD flag (new slots of the job go to user space) and the newest
 * round completed in user space (stale-round rule across both paths).
 * Written by the user-space path (src/kernel/afxdp.rs) only; read by the XDP
 * programs.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct aggbox_job_handoff);
} job_handoff SEC(".maps");

/* ---------------------------------------------------------------------------
 * Fast slots (docs/DATAPLANE.md "Fast slots").
 * ------------------------------------------------------------------------- */

/*
 * fast_slots: slot index -> struct aggbox_fast_slot (slot.h), the fast-slot
 * pool of AGGBOX_FAST_SLOTS slots; job regions are assigned by the control
 * plane (Dataplane::set_job), which zeroes a region before handing it to a
 * job. Written by XDP only otherwise.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AGGBOX_FAST_SLOTS);
	/* Mapped read-only by the control plane, whose stale-slot scan reads
	 * each slot's header from memory instead of copying the whole value
	 * out with a syscall per slot (possible since the lock is a plain
	 * word: a bpf_spin_lock value cannot be mapped). */
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct aggbox_fast_slot);
} fast_slots SEC(".maps");

/* fast_stats: per-CPU counters by enum aggbox_fast_stat. XDP writes; the
 * control plane sums (Dataplane::fast_stats). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_FAST_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} fast_stats SEC(".maps");

/* ---------------------------------------------------------------------------
 * Hand-off to the user-space path (handoff.h).
 * ------------------------------------------------------------------------- */

/*
 * xsks: RX queue index -> AF_XDP socket of the user-space path. Written by
 * the control plane (XdpPlane::register_xsk, src/kernel/afxdp.rs) for every
 * queue of the interface; an entry disappears when its socket is closed.
 * Read by aggbox_handoff() (handoff.h) with bpf_map_lookup_elem (is a
 * socket there?) and bpf_redirect_map.
 */
struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, AGGBOX_MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

/*
 * handoff_stats: datagrams actually redirected to user space, per CPU, by
 * enum aggbox_handoff_reason (their sum is the to_userspace outcome).
 * Written by XDP only; summed by Dataplane::handoff_stats.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_HANDOFF_MAX);
	__type(key, __u32);
	__type(value, struct aggbox_stat);
} handoff_stats SEC(".maps");

/*
 * xsk_limits[0]: the longest frame (bytes, bpf_xdp_get_buff_len) the
 * registered sockets can take, or 0 for no limit. Written by
 * UserspacePath::start (src/kernel/afxdp.rs): 0 when every socket is bound
 * with XDP_USE_SG (multi-buffer AF_XDP, Linux 6.6+), else the UMEM frame
 * size minus headroom minus XDP_PACKET_HEADROOM (AGGBOX_XSK_RX_HEADROOM).
 * A longer frame would be lost by the kernel inside the redirect, so
 * aggbox_handoff() treats it as if no socket were registered
 * (docs/JUMBO.md "Kernels without multi-buffer AF_XDP").
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} xsk_limits SEC(".maps");

/* ---------------------------------------------------------------------------
 * Outcome counters (stats.h).
 * ------------------------------------------------------------------------- */

/*
 * stats: one struct aggbox_stat per outcome and per drop reason, per CPU,
 * indexed by aggbox_outcome_index(). Written only by the XDP programs (one
 * increment per datagram, at its exit); read and summed over CPUs by the
 * control plane (src/kernel/xdp/stats.rs, XdpPlane::stats).
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_STATS_MAX);
	__type(key, __u32);
	__type(value, struct aggbox_stat);
} stats SEC(".maps");

/*
 * job_stats: dense job index (job_index) -> struct aggbox_job_stats, per
 * CPU. Zeroed by the control plane when a job gets its index (a
 * reconfigured job keeps its counters) and when it is removed; XDP only
 * increments. Summed over CPUs by Dataplane::job_stats and the metrics
 * scrape (aggbox_job_*_total).
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGGBOX_MAX_JOBS);
	__type(key, __u32);
	__type(value, struct aggbox_job_stats);
} job_stats SEC(".maps");

/* ---------------------------------------------------------------------------
 * Ring allreduce: the entry program reads ring_ports to hand a ring's
 * datagrams to the ring program (aggbox_ring.bpf.c), which owns the other
 * ring maps (ring_maps.h).
 * ------------------------------------------------------------------------- */
#include "ring_ports.h"

#endif /* AGGBOX_XDP_MAPS_H */
