/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-packet state of the XDP aggregator, handed from one program of the
 * tail-call chain to the next: the value of the per-CPU `scratch` map
 * (xdp_maps.h). BPF-only, not part of the ABI.
 */
#ifndef AGGBOX_SCRATCH_H
#define AGGBOX_SCRATCH_H

#include "vmlinux.h"
#include "aggbox/abi.h"

_Static_assert(AGGBOX_MAX_CHUNKS <= 64, "scratch.finalized has a bit per chunk");

struct aggbox_scratch {
	struct aggbox_slot_key key;
	__u32 bytes;       /* UDP payload bytes, for the stats */
	__u16 agg_off;     /* offset of the AGG1 header from ctx->data */
	__u16 udp_off;     /* offset of the UDP header from ctx->data */
	__u16 ip_off;      /* offset of the IPv4 or IPv6 header from ctx->data */
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
	__u32 vector_len;  /* the job's (0 = unbounded) */
	__u32 jidx;        /* the job's dense index (job_index) */
	__u32 fast_stride; /* the job's fast-slot indexes per round */
	__u32 fast_granule;/* the job's elements per fast-slot index (never 0) */
	__u16 fast_base;   /* the job's fast-slot region */
	__u16 fast_slots;
	__u32 fast_idx;    /* index of the fragment's fast slot */
	__u32 fast_token;  /* this packet's take-over token */
	__u32 fast_npairs; /* element pairs of the RESULT being written */
	__u32 fast_spilled;/* the completed fast slot had FAST_F_SPILLED */
	__u8  fast_no_take;   /* fast_join may not take a free slot (overload) */
	__u8  fast_taken;     /* fast_join took a free slot and committed at once */
	__u8  fast_reserved;  /* fast_join's CLAIMING take already holds its slot-bound share */
	__u8  fast_held;      /* fast_join holds a slot-bound share for a take */
	__u8  fast_fused;     /* fast_join wrote the RESULT payload while adding (fast_sum_result) */
	__u8  fast_prev_valid;/* fast_join's take-over replaced a DONE fragment: fast_prev */
	__u8  has_parent;     /* the job's RESULTs go upstream (AGGBOX_JOB_F_HAS_PARENT) */
	__u8  family;         /* AGGBOX_FAMILY_IPV4 or _IPV6 (aggbox_parse_l3) */
	__u8  l3_flags;       /* L3_F_* of aggbox_parse_l3 */
	__u8  fast_pad2[3];
	__u64 fast_wide;      /* fast_sum_result: nonzero when some sum left int32 */
	struct aggbox_slot_key fast_prev;
	__be32 src[4];        /* source address as a rank's (aggbox_rank.addr):
			       * IPv4 in src[0], src[1..3] zero */
	__u64 csum;           /* an IPv6 RESULT's checksum pass: the datagram's
			       * unfolded one's-complement sum */
	__u32 csum_words;     /* its UDP length in 4-byte words (read volatile
			       * in the linear chain's loop) */
	__u32 csum_pad;
	__be32 buf[AGGBOX_FAST_ELEMS > AGGBOX_CHUNK_ELEMS ? AGGBOX_FAST_ELEMS : AGGBOX_CHUNK_ELEMS]
		__attribute__((aligned(8)));
			   /* one chunk of payload: bpf_xdp_load_bytes /
			    * store_bytes go through here; 8-aligned for the
			    * two-elements-per-load loops */
};

#endif /* AGGBOX_SCRATCH_H */
