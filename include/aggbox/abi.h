/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * AggBox ABI, version 1: the wire headers of ../../docs/PROTOCOL.md and the
 * map keys/values shared by the BPF programs (src/bpf/) and the Rust control
 * plane (src/wire/abi.rs mirrors this file; tests/abi_layout.rs compiles this
 * header and checks every offset against the Rust mirror).
 *
 * Rules (katran balancer_structs.h / xdp-tools *_kern_user.h style):
 * fixed-width types only, explicit padding, the byte order of every field in
 * a comment, and a _Static_assert on every size. Wire fields are big-endian
 * (network order); map fields are host order unless marked otherwise.
 */
#ifndef AGGBOX_ABI_H
#define AGGBOX_ABI_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

/* ---------------------------------------------------------------------------
 * Wire format
 * ------------------------------------------------------------------------- */

#define AGGBOX_MAGIC_AGG   0x41474731u /* "AGG1": contribution or result */
#define AGGBOX_MAGIC_BCAST 0x41474231u /* "AGB1": broadcast data */
#define AGGBOX_MAGIC_ACK   0x41474B31u /* "AGK1": acknowledgement */

/* AGG1 `op`: the rows of ops.def, AGGBOX_OP_SUM = 0 .. AGGBOX_OP_LAST. */
enum aggbox_op {
#define AGGBOX_OP(number, NAME, ...) AGGBOX_OP_##NAME = number,
#include "ops.def"
#undef AGGBOX_OP
};
/* The ops (numbers 0..AGGBOX_OPS - 1), and bit `op` set in a mask when the
 * op is valid on FLOAT32, aggregated by the XDP program, combined by the
 * ring program. */
enum {
	AGGBOX_OPS = 0
#define AGGBOX_OP(...) + 1
#include "ops.def"
#undef AGGBOX_OP
	,
	AGGBOX_OP_FLOATS_MASK = 0
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) | ((floats) << (number))
#include "ops.def"
#undef AGGBOX_OP
	,
	AGGBOX_OP_KERNEL_MASK = 0
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) | ((kernel) << (number))
#include "ops.def"
#undef AGGBOX_OP
	,
	AGGBOX_OP_RING_MASK = 0
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) | ((ring) << (number))
#include "ops.def"
#undef AGGBOX_OP
};
#define AGGBOX_OP_LAST (AGGBOX_OPS - 1)
_Static_assert(AGGBOX_OPS <= 32, "the op masks are 32-bit");
/* The kernel's ops are 0..AGGBOX_OP_LAST_KERNEL: one compare tells them,
 * and it bounds op for the verifier (the fast path's op branches). A row
 * that breaks the run fails here: give the check a mask test then. */
#define AGGBOX_OP_LAST_KERNEL (31 - __builtin_clz(AGGBOX_OP_KERNEL_MASK))
_Static_assert(AGGBOX_OP_KERNEL_MASK == (1u << (AGGBOX_OP_LAST_KERNEL + 1)) - 1,
	       "the kernel's ops are 0..AGGBOX_OP_LAST_KERNEL");

/* AGG1 `flags` */
#define AGGBOX_AGG_F_LAST_FRAGMENT 0x01
#define AGGBOX_AGG_F_RESULT        0x02
#define AGGBOX_AGG_F_OVERFLOW      0x04
#define AGGBOX_AGG_F_FLOAT32       0x08
#define AGGBOX_AGG_F_KNOWN         0x0f /* any other bit set: invalid */
/* Contribution flags a slot's RESULT carries when any contribution had them:
 * the last fragment, and OVERFLOW (a clamped input: a subtree's clamped
 * result, or a float the sender clamped when quantizing), so a RESULT that
 * depends on a clamped value says so (docs/PROTOCOL.md, "Differences"). */
#define AGGBOX_AGG_F_CARRIED       (AGGBOX_AGG_F_LAST_FRAGMENT | AGGBOX_AGG_F_OVERFLOW)

/* AGG1 `rank` of a RESULT datagram */
#define AGGBOX_RESULT_RANK 0xffff

/* AGB1 `flags` */
#define AGGBOX_BCAST_F_FORWARD 0x01
#define AGGBOX_BCAST_F_KNOWN   0x01

/* AGK1 `kind` and `flags` */
#define AGGBOX_ACK_KIND_AGG   0
#define AGGBOX_ACK_KIND_BCAST 1
#define AGGBOX_ACK_F_FINAL    0x01
#define AGGBOX_ACK_F_KNOWN    0x01
#define AGGBOX_ACK_MAX_BITS   1024

/* Aggregation message header; `count` int32 elements follow. */
struct aggbox_agg_hdr {
	__be32 magic;    /* big-endian: AGGBOX_MAGIC_AGG */
	__be16 job;      /* big-endian: job id */
	__be16 rank;     /* big-endian: sender's rank, AGGBOX_RESULT_RANK on results */
	__be32 seq;      /* big-endian: sender's datagram sequence number */
	__be32 round;    /* big-endian: reduction generation */
	__be32 frag_off; /* big-endian: element index of payload[0] */
	__u8   op;       /* enum aggbox_op */
	__u8   flags;    /* AGGBOX_AGG_F_* */
	__be16 count;    /* big-endian: payload elements, >= 1 */
};
_Static_assert(sizeof(struct aggbox_agg_hdr) == 24, "AGG1 header is 24 bytes");

/* Broadcast message header; opaque payload follows. */
struct aggbox_bcast_hdr {
	__be32 magic; /* big-endian: AGGBOX_MAGIC_BCAST */
	__be32 mask;  /* big-endian: bit i = deliver to destination i of the group */
	__be32 seq;   /* big-endian: root's sequence number for this group */
	__be16 group; /* big-endian: broadcast group id */
	__u8   flags; /* AGGBOX_BCAST_F_* */
	__u8   hops;  /* hops travelled from the root */
};
_Static_assert(sizeof(struct aggbox_bcast_hdr) == 16, "AGB1 header is 16 bytes");

/*
 * The runtime's sub-header: the first 8 bytes of every AGB1 payload the
 * runtime sends (broadcast data and the results it forwards), after which
 * the fragment's bytes follow. Not part of the shared spec and never read by
 * the data plane, which treats the AGB1 payload as opaque; written here so
 * the layout is in one place (docs/PROTOCOL.md "AGB1: the runtime's
 * sub-header"; in Rust wire::proto::RuntimeSubHeader). With it an AGB1
 * header is as long as an AGG1 header, so a forwarded result fits the MTU
 * its contributions did.
 */
#define AGGBOX_BCAST_SUBHDR_OVERFLOW 0x80000000u /* offset bit 31: the forwarded result was clamped */
struct aggbox_bcast_runtime_subhdr {
	__be32 round;  /* big-endian: the call's round */
	__be32 offset; /* big-endian: byte offset of the data in the message; bit 31 AGGBOX_BCAST_SUBHDR_OVERFLOW */
};
_Static_assert(sizeof(struct aggbox_bcast_runtime_subhdr) == 8, "runtime sub-header is 8 bytes");
_Static_assert(sizeof(struct aggbox_bcast_hdr) + sizeof(struct aggbox_bcast_runtime_subhdr) ==
		       sizeof(struct aggbox_agg_hdr),
	       "AGB1 + runtime sub-header is as long as AGG1");

/* Acknowledgement header; ceil(nbits / 8) bitmap bytes follow (LSB first). */
struct aggbox_ack_hdr {
	__be32 magic;    /* big-endian: AGGBOX_MAGIC_ACK */
	__be16 id;       /* big-endian: job (aggregation) or group (broadcast) */
	__be16 rank;     /* big-endian: acknowledged sender's rank / receiver's index */
	__be32 base_seq; /* big-endian: first sequence number covered */
	__be16 nbits;    /* big-endian: sequence numbers covered, 1..=1024 */
	__u8   kind;     /* AGGBOX_ACK_KIND_* */
	__u8   flags;    /* AGGBOX_ACK_F_* */
};
_Static_assert(sizeof(struct aggbox_ack_hdr) == 16, "AGK1 header is 16 bytes");

/*
 * Position query and reply (AGP1): a worker of a node-served job asks the
 * node's result service, on the job's result_port, where a new run of the
 * job's communicators must start (the round and contribution seq of its
 * first call, newer than anything the node has seen of the job); the reply
 * comes back to the asking socket (docs/PROTOCOL.md "AGP1: the position of
 * a node-served job"; in Rust wire::proto::PositionMessage). User space
 * only: the XDP and TC programs pass it on untouched (an unknown magic).
 * Exactly AGGBOX_POSITION_LEN bytes; in a query round, agg_seq and pad are
 * 0 and AGGBOX_POSITION_F_REPLY is clear.
 */
#define AGGBOX_MAGIC_POSITION   0x41475031u /* "AGP1": position query or reply */
#define AGGBOX_POSITION_F_REPLY 0x01        /* the node's answer (clear: a query) */
#define AGGBOX_POSITION_F_FRESH 0x02        /* reply: the node has seen no RESULT of the job */
#define AGGBOX_POSITION_F_KNOWN 0x03
#define AGGBOX_POSITION_LEN     24
struct aggbox_position_hdr {
	__be32 magic;   /* big-endian: AGGBOX_MAGIC_POSITION */
	__be16 job;     /* big-endian: job id */
	__be16 rank;    /* big-endian: the asking worker's rank */
	__be32 nonce;   /* big-endian: the asker's; the reply carries it back */
	__be32 round;   /* big-endian: reply: round of a new run's first call */
	__be32 agg_seq; /* big-endian: reply: contribution seq of that call */
	__u8   flags;   /* AGGBOX_POSITION_F_* */
	__u8   pad[3];  /* zero */
};
_Static_assert(sizeof(struct aggbox_position_hdr) == AGGBOX_POSITION_LEN, "AGP1 is 24 bytes");

/* ---------------------------------------------------------------------------
 * Drop reasons and counters (cilium drop_reasons.h style)
 *
 * Every datagram the XDP program looks at ends in exactly one outcome. Drop
 * reasons are negative so they can never be confused with an XDP verdict
 * (0..4); the stats map is indexed by aggbox_outcome_index() (src/bpf/stats.h).
 *
 * Mirrored in these files; a reason or outcome added, renamed or renumbered
 * here changes them too (and AGGBOX_DROP_LAST below):
 *   src/wire/abi.rs           DropReason (values, ALL, label(): the name in the
 *                        metrics and `aggbox status`) and Outcome
 *   tests/abi_layout.rs  compiles this header and checks every enumerator
 *                        against DropReason by name (C name of IpFragment
 *                        spelled out there)
 *   docs/PROTOCOL.md     "Validation of a contribution": one table row per
 *                        reason, by its label
 *   docs/INTERFACE.md    `aggbox status`: the outcome labels
 * ------------------------------------------------------------------------- */

enum aggbox_drop_reason {
	AGGBOX_DROP_TRUNCATED_HEADER  = -130, /* UDP payload shorter than 24 bytes */
	AGGBOX_DROP_INVALID_OP        = -131, /* op > AGGBOX_OP_LAST */
	AGGBOX_DROP_RESERVED_FLAG     = -132, /* a flag bit outside AGGBOX_AGG_F_KNOWN */
	AGGBOX_DROP_ZERO_COUNT        = -133, /* count == 0 */
	AGGBOX_DROP_COUNT_TOO_LARGE   = -134, /* count larger than the datagram holds */
	AGGBOX_DROP_COUNT_TOO_SMALL   = -135, /* datagram longer than 24 + 4 * count */
	AGGBOX_DROP_UNKNOWN_JOB       = -136, /* job not configured on this node */
	AGGBOX_DROP_RANK_OUT_OF_RANGE = -137, /* rank >= workers */
	AGGBOX_DROP_SOURCE_MISMATCH   = -138, /* source address or IP version is not the rank's */
	AGGBOX_DROP_BEYOND_VECTOR     = -139, /* frag_off + count > vector_len */
	AGGBOX_DROP_RETRANSMISSION    = -140, /* rank already contributed to the slot */
	AGGBOX_DROP_STALE_ROUND       = -141, /* round older than the job's window */
	AGGBOX_DROP_SLOT_POOL_FULL    = -142, /* no free slot and no user-space path */
	AGGBOX_DROP_MISSED_TAIL_CALL  = -143, /* prog array slot empty: a bug */
	AGGBOX_DROP_SLOT_MISMATCH     = -144, /* op/count differ from the slot's first contribution */
	AGGBOX_DROP_IP_OPTIONS_OR_FRAGMENT = -145, /* IPv4 first fragment or IPv6 Fragment header:
						    * AggBox forbids IP fragmentation */
	AGGBOX_DROP_TOO_LARGE         = -146, /* count above what this build aggregates in the kernel */
	AGGBOX_DROP_PORT_MISMATCH     = -147, /* the job is not the job of the port it was sent to */
	AGGBOX_DROP_FORGED_RESULT     = -148, /* a RESULT from the network to its job's result port */
	AGGBOX_DROP_SLOT_BUSY         = -149, /* the fragment's fast slot stayed locked past the spin bound */
	AGGBOX_DROP_IPV6_EXTENSION_HEADER = -150, /* IPv6: an extension header other than Fragment
						   * before UDP (hop-by-hop, routing, destination options) */
	AGGBOX_DROP_UDP_ZERO_CHECKSUM = -151, /* IPv6: UDP checksum 0, which RFC 8200 forbids */
};
#define AGGBOX_DROP_FIRST AGGBOX_DROP_TRUNCATED_HEADER
#define AGGBOX_DROP_LAST  AGGBOX_DROP_UDP_ZERO_CHECKSUM

/* Outcomes that are not drops. */
enum aggbox_outcome {
	AGGBOX_OUTCOME_NOT_AGGBOX   = 0, /* passed to the stack untouched */
	AGGBOX_OUTCOME_ACCEPTED     = 1, /* contribution valid and absorbed */
	AGGBOX_OUTCOME_RESULT       = 2, /* contribution completed a slot: RESULT emitted */
	AGGBOX_OUTCOME_TO_USERSPACE = 3, /* handed to the user-space path */
	AGGBOX_OUTCOME_OTHER_AGGBOX = 4, /* AGB1/AGK1 or AGG1 to a non-job port: passed */
	AGGBOX_OUTCOME_USERSPACE_UNAVAILABLE = 5, /* for the user-space path, but no AF_XDP
						   * socket on this RX queue: passed */
	AGGBOX_OUTCOME_COUNT_OK     = 6,
};

/* stats map index: outcomes first, then one entry per drop reason */
#define AGGBOX_STATS_DROP_BASE AGGBOX_OUTCOME_COUNT_OK
#define AGGBOX_STATS_MAX (AGGBOX_STATS_DROP_BASE + (AGGBOX_DROP_FIRST - AGGBOX_DROP_LAST) + 1)

/* One per-CPU counter pair per outcome. */
struct aggbox_stat {
	__u64 packets; /* host order */
	__u64 bytes;   /* host order: UDP payload bytes */
};
_Static_assert(sizeof(struct aggbox_stat) == 16, "stat is 16 bytes");

/* ---------------------------------------------------------------------------
 * Job configuration (written by the control plane, read by XDP)
 * ------------------------------------------------------------------------- */

#ifndef AGGBOX_MAX_JOBS
#define AGGBOX_MAX_JOBS 256
#endif
#ifndef AGGBOX_MAX_RANKS
#define AGGBOX_MAX_RANKS 256 /* per job; the contributor bitmap is this wide */
#endif

/* Key of the jobs map. */
struct aggbox_job_key {
	__u16 job; /* host order */
	__u16 pad; /* zero */
};
_Static_assert(sizeof(struct aggbox_job_key) == 4, "job key is 4 bytes");

/* Value of the jobs map: how this node aggregates one job. */
struct aggbox_job {
	__u16 port;        /* host order: UDP port contributions arrive on */
	__u16 result_port; /* host order: local UDP port RESULTs are delivered to */
	__u16 workers;     /* host order: ranks 0..workers-1, 1..=AGGBOX_MAX_RANKS */
	__u16 result_group;/* host order: broadcast group for RESULTs, 0xffff = none */
	__u32 vector_len;  /* host order: 0 = unbounded */
	__u32 slots;       /* host order: bound on outstanding slots of this job */
	__u32 flags;       /* host order: AGGBOX_JOB_F_* */
	__u32 weight_sum;  /* host order: sum of rank weights (AVG divisor) */
	__u32 window;      /* host order: rounds older than newest completed - window
			    * are stale; 0 = AGGBOX_ROUND_WINDOW */
	__u16 fast_base;   /* host order: first index of the job's region of the
			    * fast_slots array (docs/DATAPLANE.md "Fast slots") */
	__u16 fast_slots;  /* host order: size of that region, a power of two,
			    * or 0: the job uses the hash-map slots only */
	__u16 id;          /* host order: the job's id (value of the jobs array,
			    * whose index is the job's dense index) */
	__u16 fast_granule;/* host order: elements of a round that share one
			    * fast-slot index: the job's full-fragment size
			    * when it fits a fast slot, else
			    * AGGBOX_FAST_GRANULE (docs/DATAPLANE.md) */
	__u32 fast_stride; /* host order: fast-slot indexes one round takes
			    * (ceil(vector_len / fast_granule)); granule and
			    * stride are set with the region and kept while
			    * the job keeps it, so a fragment's index never
			    * changes */
};
_Static_assert(sizeof(struct aggbox_job) == 40, "job is 40 bytes");

#define AGGBOX_JOB_F_USERSPACE_ONLY 0x01 /* every contribution goes to user space */
#define AGGBOX_JOB_F_HAS_PARENT     0x02 /* results go upstream, not to result_port */
#define AGGBOX_JOB_F_NO_FAST        0x04 /* control plane only: give the job no fast-slot
					  * region (every contribution takes the hash-map chain) */
#define AGGBOX_NO_GROUP             0xffff

/* Key of the ranks map: the paper's KEY, job << 16 | rank. */
struct aggbox_rank_key {
	__u16 job;  /* host order */
	__u16 rank; /* host order */
};
_Static_assert(sizeof(struct aggbox_rank_key) == 4, "rank key is 4 bytes");

/* Address family of a rank (struct aggbox_rank.family): the IP version. */
#define AGGBOX_FAMILY_NONE 0 /* no rank here (a removed or never written entry) */
#define AGGBOX_FAMILY_IPV4 4
#define AGGBOX_FAMILY_IPV6 6

/*
 * Value of the ranks map (and of the ring's ring_members): the source
 * address a rank sends from, and its weight. A contribution is the rank's
 * only if its IP version is `family` and its source address is `addr`, all
 * 16 bytes (an IPv4 source as addr[0] with three zero words), so an IPv4
 * sender never passes for an IPv6 rank whose address has the same first
 * bytes, nor the other way round. The control plane writes every rank of a
 * job with one family (XdpJob::validate).
 */
struct aggbox_rank {
	__u8   family;  /* AGGBOX_FAMILY_IPV4 or AGGBOX_FAMILY_IPV6 */
	__u8   pad[3];  /* zero */
	__s32  weight;  /* host order: SUM/AVG weight, default 1 */
	__be32 addr[4]; /* big-endian: the source address; IPv4: addr[0], addr[1..3] zero */
};
_Static_assert(sizeof(struct aggbox_rank) == 24, "rank is 24 bytes");

/* ---------------------------------------------------------------------------
 * Ports (written by the control plane, read by XDP)
 * ------------------------------------------------------------------------- */

/* Key of the ports map: a UDP destination port some job listens on. */
struct aggbox_port_key {
	__u16 port; /* host order */
	__u16 pad;  /* zero */
};
_Static_assert(sizeof(struct aggbox_port_key) == 4, "port key is 4 bytes");

/* Value of the ports map. */
struct aggbox_port {
	__u32 jobs; /* host order: number of configured jobs listening on the port */
};
_Static_assert(sizeof(struct aggbox_port) == 4, "port is 4 bytes");

/* ---------------------------------------------------------------------------
 * In-kernel aggregation state (XDP writes; the control plane creates and
 * reads the per-job state, fills the tail-call array)
 * ------------------------------------------------------------------------- */

/*
 * Payload sizes (docs/JUMBO.md). A slot is a small header (the `slots` map)
 * plus ceil(count / AGGBOX_CHUNK_ELEMS) blocks of AGGBOX_CHUNK_ELEMS s64
 * accumulators (the `blocks` map), so slot memory follows the datagram size:
 * 2 blocks at MTU 1500 (362 elements), 9 at MTU 9000 (2237 elements:
 * (9000 - 20 - 8 - 24) / 4), 64 for the largest IPv4 datagram (16370). One
 * chunk = one block = one spin-lock acquisition and one
 * bpf_xdp_load_bytes/store_bytes. One program run of the chain processes up
 * to AGGBOX_PROG_CHUNKS chunks with bpf_loop.
 */
#ifndef AGGBOX_MAX_ELEMS
#define AGGBOX_MAX_ELEMS 16384 /* largest count aggregated in the kernel (>= 16370, a 65535-byte IPv4
				* datagram, and >= 16375, the largest IPv6 one without a jumbogram) */
#endif
#ifndef AGGBOX_CHUNK_ELEMS
#define AGGBOX_CHUNK_ELEMS 256 /* elements of one slot block (one lock, one load/store) */
#endif
#define AGGBOX_MAX_CHUNKS (AGGBOX_MAX_ELEMS / AGGBOX_CHUNK_ELEMS)
_Static_assert(AGGBOX_MAX_ELEMS % AGGBOX_CHUNK_ELEMS == 0, "whole chunks");
#ifndef AGGBOX_PROG_CHUNKS
#define AGGBOX_PROG_CHUNKS 8 /* chunks one program run of the chain processes (bpf_loop) */
#endif
/* Tail-call budget (kernel MAX_TAIL_CALL_CNT = 33): slot + adds + results. */
_Static_assert(1 + 2 * ((AGGBOX_MAX_CHUNKS + AGGBOX_PROG_CHUNKS - 1) / AGGBOX_PROG_CHUNKS) <= 33,
	       "tail-call budget");
/*
 * The linear chain (kernels without multi-buffer XDP, docs/JUMBO.md): one
 * chunk per program run, so the tail-call budget (32 calls before 5.17)
 * bounds its chunks: 1 + 15 + 15 = 31. 3840 elements cover MTU 9000 in
 * generic mode (a linearised skb); a native driver without multi-buffer
 * support carries at most a page (~3.5 KB) anyway.
 */
#ifndef AGGBOX_LINEAR_MAX_CHUNKS
#define AGGBOX_LINEAR_MAX_CHUNKS 15
#endif
#define AGGBOX_LINEAR_MAX_ELEMS (AGGBOX_LINEAR_MAX_CHUNKS * AGGBOX_CHUNK_ELEMS)
/* Largest payload offset the linear chain copies at (headers + elements). */
#define AGGBOX_LINEAR_MAX_FRAME (128 + 24 + 4 * AGGBOX_LINEAR_MAX_ELEMS)
_Static_assert(1 + 2 * AGGBOX_LINEAR_MAX_CHUNKS <= 32, "linear tail-call budget (pre-5.17 kernels)");
_Static_assert(AGGBOX_LINEAR_MAX_CHUNKS <= AGGBOX_MAX_CHUNKS, "linear chunks within the slot layout");
#ifndef AGGBOX_MAX_SLOTS
#define AGGBOX_MAX_SLOTS 4096 /* slots of all jobs together */
#endif
#ifndef AGGBOX_MAX_BLOCKS
#define AGGBOX_MAX_BLOCKS (2 * AGGBOX_MAX_SLOTS) /* slot blocks of all jobs together (16 MiB) */
#endif
#ifndef AGGBOX_MAX_COMPLETED
#define AGGBOX_MAX_COMPLETED 65536 /* completed-slot markers kept (LRU) */
#endif
#ifndef AGGBOX_ROUND_WINDOW
#define AGGBOX_ROUND_WINDOW 64 /* rounds older than newest completed - window are stale */
#endif

/*
 * How many rounds a is ahead of b (negative: behind), in serial-number order
 * (RFC 1982): rounds wrap at 2^32. Every comparison of rounds, in the
 * programs and in Rust (src/wire/abi.rs Round::ahead_of), goes through this.
 */
static inline __s32 aggbox_rounds_ahead(__u32 a, __u32 b)
{
	return (__s32)(a - b);
}

/*
 * Fast slots (docs/DATAPLANE.md "Fast slots"): an array of slots, each job
 * owning a power-of-two region that the control plane assigns in set_job. A
 * contribution of at most AGGBOX_FAST_ELEMS elements has one fixed index in
 * its job's region, computed from (round, frag_off): no hash map on its
 * path. job.fast_granule elements of a round share an index, so a fragment
 * of at least that many elements has its own: the job's full-fragment size
 * packs its fragments densely; AGGBOX_FAST_GRANULE, the default, gives
 * every fragment of 256..=AGGBOX_FAST_ELEMS elements its own. The rounds
 * of a job with vector_len follow each other through the region.
 */
#ifndef AGGBOX_FAST_SLOTS
#define AGGBOX_FAST_SLOTS 8192 /* fast slots of all jobs together (~26 MiB) */
#endif
#ifndef AGGBOX_FAST_JOB_SLOTS
#define AGGBOX_FAST_JOB_SLOTS 4096 /* largest region of one job: the default slot bound */
#endif
#ifndef AGGBOX_FAST_ELEMS
#define AGGBOX_FAST_ELEMS 384 /* largest count a fast slot holds (MTU 1500: 362) */
#endif
#define AGGBOX_FAST_GRANULE 256 /* job.fast_granule when the job's fragment size is unknown or too large */
_Static_assert(AGGBOX_FAST_ELEMS % 2 == 0, "fast slots add pairs");
_Static_assert(AGGBOX_FAST_SLOTS <= 65536 && AGGBOX_FAST_JOB_SLOTS <= 32768, "indexes fit job.fast_base / fast_slots");

/* What the fast slots did, beside the outcomes (fast_stats map index). */
enum aggbox_fast_stat {
	AGGBOX_FAST_JOINED      = 0, /* contributions added to a fast slot */
	AGGBOX_FAST_TAKEN       = 1, /* fast slots taken by a new fragment */
	AGGBOX_FAST_BUSY        = 2, /* fragment's fast slot held another live fragment: hash-map path */
	AGGBOX_FAST_ABORTED     = 3, /* take-over given up: the fragment lives on the hash-map or user-space path */
	AGGBOX_FAST_RELEASED     = 4, /* unfinished fast slots released (stale round, membership change) */
	AGGBOX_FAST_CHECKED     = 5, /* takes that looked for the hash-map path's records (the job has used it) */
	AGGBOX_FAST_STAT_MAX    = 6,
};

/* Tail-call chain: index of each program in the prog array (cilium tailcall.h). */
enum aggbox_call {
	AGGBOX_CALL_SLOT   = 0, /* find or create the slot, claim the rank's bit */
	AGGBOX_CALL_ADD    = 1, /* add up to AGGBOX_PROG_CHUNKS chunks of the payload into the slot */
	AGGBOX_CALL_RESULT = 2, /* write up to AGGBOX_PROG_CHUNKS chunks of the result, then emit RESULT */
	AGGBOX_CALL_ENTRY  = 3, /* the entry program again: a fragment the fast slot won (fast_check) */
	AGGBOX_CALL_RING   = 4, /* a ring datagram (AGR1, docs/RING.md) */
	AGGBOX_CALL_MAX    = 5,
};

/* Key of the slots map (and of the completed map). */
struct aggbox_slot_key {
	__u16 job;      /* host order */
	__u16 pad;      /* zero */
	__u32 round;    /* host order */
	__u32 frag_off; /* host order */
};
_Static_assert(sizeof(struct aggbox_slot_key) == 12, "slot key is 12 bytes");

/* Value of the job_state map: runtime state of one job. */
struct aggbox_job_state {
	__u32 active_slots; /* host order: slots of this job in the pool (atomic) */
	__u32 newest_round; /* host order: newest completed round (valid if completed != 0) */
	__u32 completed;    /* host order: 1 once a slot of the job completed (newest_round
			     * valid); completions are counted in job_stats.results */
	__u32 result_seq;   /* host order: seq of the next RESULT of a job whose results go
			     * upstream (AGGBOX_JOB_F_HAS_PARENT; atomic); 0 for other jobs */
};
_Static_assert(sizeof(struct aggbox_job_state) == 16, "job state is 16 bytes");

/*
 * Per-CPU value of the job_stats map (key struct aggbox_job_key): what
 * became of the datagrams of one configured job. Created zeroed by the
 * control plane with the job, deleted with it; counted by XDP at the single
 * exit (stats.h) once the datagram's job is known. Drops before that
 * (truncated, reserved flag, bad op or count, unknown job) are global only,
 * and so is the USERSPACE_UNAVAILABLE outcome (passed to the stack).
 */
struct aggbox_job_stats {
	__u64 accepted;            /* host order: contributions absorbed into a slot */
	__u64 results;             /* host order: contributions that completed a slot (RESULT emitted) */
	__u64 overflow_results;    /* host order: RESULTs with AGGBOX_AGG_F_OVERFLOW */
	__u64 retransmissions;     /* host order: AGGBOX_DROP_RETRANSMISSION */
	__u64 stale;               /* host order: AGGBOX_DROP_STALE_ROUND */
	__u64 handed_to_userspace; /* host order: redirected to the user-space path */
	__u64 dropped;             /* host order: every other drop reason once the job is known */
	__u64 bytes;               /* host order: UDP payload bytes of the datagrams above */
};
_Static_assert(sizeof(struct aggbox_job_stats) == 64, "job stats is 64 bytes");

/* ---------------------------------------------------------------------------
 * Broadcast (TC data plane, src/bpf/aggbox_tc.bpf.c; docs/BROADCAST.md)
 *
 * The control plane writes group tables (struct aggbox_group) into the
 * bcast_groups map; the TC egress program turns one AGB1 datagram sent by the
 * application into one copy per masked destination; the TC ingress program
 * re-broadcasts FORWARD datagrams to a tree node's children.
 * ------------------------------------------------------------------------- */

#ifndef AGGBOX_BCAST_MAX_DESTS
#define AGGBOX_BCAST_MAX_DESTS 32 /* destinations per group table (mask bits) */
#endif
#ifndef AGGBOX_BCAST_MAX_GROUPS
#define AGGBOX_BCAST_MAX_GROUPS 1024 /* group tables per node (root + forwarding) */
#endif
#ifndef AGGBOX_BCAST_MAX_NEIGH
#define AGGBOX_BCAST_MAX_NEIGH 4096 /* next-hop cache entries (LRU) */
#endif
#ifndef AGGBOX_BCAST_MAX_HOPS
#define AGGBOX_BCAST_MAX_HOPS 16 /* a datagram with hops >= this is not forwarded again */
#endif
#define AGGBOX_BCAST_DEFAULT_NEIGH_TTL_S 3600 /* next-hop cache entries go stale after this */

/*
 * skb->mark values the TC programs put on their own copies so that a copy
 * re-entering the egress hook (bpf_clone_redirect runs dev_queue_xmit, which
 * runs clsact egress again) is recognised and passed, never copied again.
 */
#define AGGBOX_BCAST_MARK_COPY  0xa6b10001u /* finished copy: pass */
#define AGGBOX_BCAST_MARK_NEIGH 0xa6b10002u /* copy whose neighbour is unresolved: bpf_redirect_neigh it */
#define AGGBOX_BCAST_MARK_DONE  0xa6b10003u /* copy already sent through the neighbour path: pass */

/* bcast_groups key port: the root table (egress), or "any receiving port" (ingress). */
#define AGGBOX_BCAST_PORT_ANY 0

/* Key of the bcast_groups map. */
struct aggbox_group_key {
	__u16 group; /* host order: AGB1 group id */
	__u16 port;  /* host order: AGGBOX_BCAST_PORT_ANY, or the UDP port this
		      * node receives the group on (a tree node's own member port) */
};
_Static_assert(sizeof(struct aggbox_group_key) == 4, "group key is 4 bytes");

/*
 * One destination of a group table: an IPv4 or IPv6 address (the family
 * byte says which, as struct aggbox_rank's does) and a UDP port. Every
 * destination of one table has the same family (the control plane refuses
 * a mix), and a table copies only datagrams of its family: an AGB1 datagram
 * or a RESULT of the other IP version is dropped, counted
 * AGGBOX_BCAST_FAMILY_MISMATCH.
 */
struct aggbox_group_dest {
	__u8   family;  /* AGGBOX_FAMILY_IPV4 or AGGBOX_FAMILY_IPV6 */
	__u8   pad;     /* zero */
	__be16 port;    /* big-endian: UDP destination port */
	__be32 addr[4]; /* big-endian: the destination; IPv4: addr[0], addr[1..3] zero */
};
_Static_assert(sizeof(struct aggbox_group_dest) == 20, "group dest is 20 bytes");

/* Value of the bcast_groups map: destination i = mask bit i. */
struct aggbox_group {
	__u32 count; /* host order: destinations in use, 1..=AGGBOX_BCAST_MAX_DESTS */
	__u32 flags; /* host order: zero (reserved) */
	struct aggbox_group_dest dests[AGGBOX_BCAST_MAX_DESTS];
};
_Static_assert(sizeof(struct aggbox_group) == 8 + 20 * AGGBOX_BCAST_MAX_DESTS, "group is 648 bytes");

/* Key of the bcast_neigh next-hop cache: one entry per (family, address,
 * interface of the lookup). */
struct aggbox_neigh_key {
	__u8   family;  /* AGGBOX_FAMILY_IPV4 or AGGBOX_FAMILY_IPV6 */
	__u8   pad[3];  /* zero */
	__u32  ifindex; /* host order: interface the lookup was made for */
	__be32 addr[4]; /* big-endian: the destination; IPv4: addr[0], addr[1..3] zero */
};
_Static_assert(sizeof(struct aggbox_neigh_key) == 24, "neigh key is 24 bytes");

/* User-visible part of a bcast_neigh value (the BPF value adds a bpf_timer). */
struct aggbox_neigh {
	__u8  dmac[6];    /* next-hop MAC */
	__u8  smac[6];    /* source MAC of the egress interface */
	__u32 ifindex;    /* host order: egress interface */
	__u32 flags;      /* host order: AGGBOX_NEIGH_F_* */
	__u32 pad;        /* zero */
	__u64 updated_ns; /* host order: bpf_ktime_get_ns() of the last resolution */
};
_Static_assert(sizeof(struct aggbox_neigh) == 32, "neigh is 32 bytes");
#define AGGBOX_NEIGH_F_STALE 0x01 /* set by the bpf_timer: re-resolve on next use */

/* Value of the bcast_config array (one entry, written by the loader and
 * by attach). */
struct aggbox_bcast_config {
	__u64 neigh_ttl_ns;   /* host order: next-hop cache lifetime; 0 = never stale */
	__u32 egress_ifindex; /* host order: the interface whose clsact egress runs
			       * aggbox_tc_egress (the attached one), where copies
			       * to unresolved next hops are cloned for the
			       * neighbour path; 0 = not attached */
	__u32 pad;            /* zero */
};
_Static_assert(sizeof(struct aggbox_bcast_config) == 16, "bcast config is 16 bytes");

/*
 * Counters of the TC programs (bcast_stats, per CPU, struct aggbox_stat,
 * indexed by this enum). "Datagram" counters: every packet a TC program sees
 * ends in exactly one of them (bcast_exit()). "Copy" counters: events per
 * destination of a datagram, several per datagram.
 *
 * Mirrored in these files; a counter added, renamed or renumbered here
 * changes them too (and AGGBOX_BCAST_STAT_MAX):
 *   src/wire/abi.rs      BcastStat (values, ALL, label(): the name in the
 *                        metrics and `aggbox status`)
 *   tests/abi_layout.rs  checks every enumerator against BcastStat by label
 *   docs/BROADCAST.md    "Counters (`bcast_stats`)": every label; the
 *                        bcast_stats row of the maps table: its size
 */
enum aggbox_bcast_stat {
	/* datagram outcomes */
	AGGBOX_BCAST_NOT_AGGBOX      = 0,  /* not an AGB1 datagram: passed untouched */
	AGGBOX_BCAST_OWN_COPY        = 1,  /* our own copy re-entering the hook: passed */
	AGGBOX_BCAST_UNKNOWN_GROUP   = 2,  /* AGB1 of a group without a table here: passed untouched */
	AGGBOX_BCAST_MALFORMED       = 3,  /* AGB1 magic but truncated / reserved flags: passed untouched */
	AGGBOX_BCAST_IP_FRAGMENT     = 4,  /* AGB1 in an IPv4 fragment (forbidden): passed untouched */
	AGGBOX_BCAST_EMPTY_MASK      = 5,  /* egress: no mask bit names a destination: dropped */
	AGGBOX_BCAST_BROADCAST       = 6,  /* egress: datagram turned into its copies */
	AGGBOX_BCAST_FORWARDED       = 7,  /* ingress: re-broadcast to children and delivered locally */
	AGGBOX_BCAST_LOCAL_ONLY      = 8,  /* ingress: configured group, no FORWARD / not for this host: delivered */
	AGGBOX_BCAST_HOPS_LIMIT      = 9,  /* ingress: hops >= AGGBOX_BCAST_MAX_HOPS: delivered, not forwarded */
	/* copy events */
	AGGBOX_BCAST_COPY_SENT       = 10, /* copy sent with a known next-hop MAC */
	AGGBOX_BCAST_NEIGH_MISS      = 11, /* copy sent through bpf_redirect_neigh (NO_NEIGH) */
	AGGBOX_BCAST_CACHE_HIT       = 12, /* next hop taken from bcast_neigh */
	AGGBOX_BCAST_FIB_LOOKUP      = 13, /* bpf_fib_lookup called (miss or stale entry) */
	AGGBOX_BCAST_FWD_DISABLED    = 14, /* FIB: forwarding disabled; copy sent through the neighbour path */
	AGGBOX_BCAST_FIB_ERROR       = 15, /* FIB: no route / blackhole / frag needed...: copy not sent */
	AGGBOX_BCAST_CLONE_FAILED    = 16, /* bpf_clone_redirect failed: copy not sent */
	AGGBOX_BCAST_REWRITE_FAILED  = 17, /* a store/checksum helper failed: copy not sent */
	AGGBOX_BCAST_LOCAL_COPY      = 18, /* destination on this host: copy looped into our ingress */
	/* datagram outcomes of RESULT routing (ingress; struct aggbox_result_route) */
	AGGBOX_BCAST_RESULT_BROADCAST = 19, /* RESULT copied to its job's result group, then delivered locally */
	AGGBOX_BCAST_RESULT_UPSTREAM  = 20, /* RESULT rewritten into a contribution and sent to the parent */
	/* datagram outcome of both programs */
	AGGBOX_BCAST_FAMILY_MISMATCH  = 21, /* IP version other than the group table's / the parent's: dropped */
	AGGBOX_BCAST_STAT_MAX        = 22,
};

/* Value of the bcast_gstats per-CPU hash (same key as bcast_groups). */
struct aggbox_bcast_group_stat {
	__u64 datagrams;    /* host order: datagrams broadcast (egress) or forwarded (ingress) */
	__u64 copies;       /* host order: copies sent */
	__u64 neigh_misses; /* host order: copies sent through the neighbour path */
	__u64 bytes;        /* host order: UDP payload bytes of the datagrams */
};
_Static_assert(sizeof(struct aggbox_bcast_group_stat) == 32, "group stat is 32 bytes");

/* ---------------------------------------------------------------------------
 * Routes of RESULT datagrams (TC ingress, src/bpf/aggbox_tc.bpf.c;
 * docs/BROADCAST.md "RESULTs: in-kernel allreduce and trees of aggregators")
 *
 * The XDP aggregator passes each RESULT up the stack addressed to this node,
 * UDP port job.result_port; it then meets the TC ingress program on the same
 * interface. A job with a route in the result_routes map (key struct
 * aggbox_job_key, written by the control plane) has its RESULTs cloned to
 * every member of a broadcast group (allreduce) and/or rewritten into this
 * node's contribution to a parent aggregator (multi-level aggregation).
 * ------------------------------------------------------------------------- */

#ifndef AGGBOX_MAX_RESULT_ROUTES
#define AGGBOX_MAX_RESULT_ROUTES AGGBOX_MAX_JOBS /* result_routes entries */
#endif

#define AGGBOX_ROUTE_F_GROUP  0x01 /* copy each RESULT, unchanged, to every member of `group` */
#define AGGBOX_ROUTE_F_PARENT 0x02 /* send each RESULT upstream as this node's contribution */
#define AGGBOX_ROUTE_F_KNOWN  0x03

/* Value of the result_routes map. */
struct aggbox_result_route {
	__u16  result_port;    /* host order: UDP port the job's RESULTs arrive on (job.result_port) */
	__u16  group;          /* host order: broadcast group whose root table (port 0) gets copies; F_GROUP */
	__u32  flags;          /* host order: AGGBOX_ROUTE_F_* */
	__be16 parent_port;    /* big-endian: UDP port of the parent job's contributions; F_PARENT */
	__u16  parent_job;     /* host order: job id at the parent; F_PARENT */
	__u16  parent_rank;    /* host order: this node's rank in the parent job (never 0xffff); F_PARENT */
	__u8   parent_family;  /* AGGBOX_FAMILY_IPV4 or AGGBOX_FAMILY_IPV6 (the RESULTs' own); F_PARENT */
	__u8   pad;            /* zero */
	__be32 parent_addr[4]; /* big-endian: the parent aggregator's address; IPv4: [0], [1..3] zero; F_PARENT */
};
_Static_assert(sizeof(struct aggbox_result_route) == 32, "result route is 32 bytes");

/* ---------------------------------------------------------------------------
 * Hand-off to the user-space path (AF_XDP; src/kernel/xsk.rs, src/kernel/afxdp.rs,
 * docs/USERSPACE.md)
 *
 * What the kernel does not aggregate is redirected with bpf_redirect_map()
 * into the `xsks` XSKMAP (key: RX queue index, value: AF_XDP socket fd),
 * when a socket is registered for the queue the frame arrived on.
 * `xsk_limits` (ARRAY, 1 entry, key 0, value u32) bounds the frames
 * redirected: 0 = no limit (every socket multi-buffer, XDP_USE_SG), else a
 * longer frame keeps the fallback as if no socket were registered.
 * ------------------------------------------------------------------------- */

#ifndef AGGBOX_XSK_RX_HEADROOM
#define AGGBOX_XSK_RX_HEADROOM 256 /* XDP_PACKET_HEADROOM the kernel keeps in each UMEM frame */
#endif

#ifndef AGGBOX_MAX_QUEUES
#define AGGBOX_MAX_QUEUES 64 /* RX queues with an AF_XDP socket (xsks entries) */
#endif
#ifndef AGGBOX_MAX_OWNERS
#define AGGBOX_MAX_OWNERS (2 * AGGBOX_MAX_SLOTS) /* slot_owner entries */
#endif

/*
 * Why a datagram was handed to user space (index of the handoff_stats map).
 *
 * Mirrored in these files; a reason added, renamed or renumbered here
 * changes them too (and AGGBOX_HANDOFF_MAX):
 *   src/wire/abi.rs      HandoffReason (values, ALL, label(): the name in the
 *                        metrics and `aggbox status`)
 *   tests/abi_layout.rs  checks every enumerator against HandoffReason
 *   docs/USERSPACE.md    "What goes to user space": one table row per reason,
 *                        by its label
 */
enum aggbox_handoff_reason {
	AGGBOX_HANDOFF_OP             = 0, /* op 5..8 (PROD, BAND, BOR, BXOR) */
	AGGBOX_HANDOFF_FLOAT32        = 1, /* FLOAT32 payload */
	AGGBOX_HANDOFF_USERSPACE_ONLY = 2, /* job flagged AGGBOX_JOB_F_USERSPACE_ONLY */
	AGGBOX_HANDOFF_POOL_FULL      = 3, /* new slot, the job's (or the global) slot pool is full */
	AGGBOX_HANDOFF_OVERLOAD       = 4, /* new slot of a job in overload (AGGBOX_HANDOFF_F_OVERLOAD) */
	AGGBOX_HANDOFF_OWNED          = 5, /* slot already owned by user space */
	AGGBOX_HANDOFF_MAX            = 6,
};

/* Value of the slot_owner map (key struct aggbox_slot_key): which path serves
 * a slot. Inserted with BPF_NOEXIST by whichever path decides first, so a
 * fragment is never split between the kernel and user space. */
#define AGGBOX_OWNER_KERNEL    1
#define AGGBOX_OWNER_USERSPACE 2
struct aggbox_slot_owner {
	__u32 owner; /* host order: AGGBOX_OWNER_* */
};
_Static_assert(sizeof(struct aggbox_slot_owner) == 4, "slot owner is 4 bytes");

/* Value of the job_handoff map (key struct aggbox_job_key): written by the
 * user-space path only, read by XDP. */
#define AGGBOX_HANDOFF_F_OVERLOAD 0x01 /* new slots of the job go to user space */
struct aggbox_job_handoff {
	__u32 flags;        /* host order: AGGBOX_HANDOFF_F_* */
	__u32 newest_round; /* host order: newest round completed in user space (valid if completed != 0) */
	__u32 completed;    /* host order: slots completed in user space */
	__u32 pad;          /* zero */
};
_Static_assert(sizeof(struct aggbox_job_handoff) == 16, "job handoff is 16 bytes");

/* ---------------------------------------------------------------------------
 * Ring allreduce (docs/RING.md): every member of a ring job runs the XDP
 * program; a fragment's partial sum travels the ring once adding each
 * member's elements (PARTIAL), then once more being stored (FINAL).
 * ------------------------------------------------------------------------- */

#define AGGBOX_MAGIC_RING 0x41475231u /* "AGR1": ring datagram */

/* AGR1 `kind` */
#define AGGBOX_RING_PARTIAL 0 /* reduce-scatter: the partial result of the members it passed */
#define AGGBOX_RING_FINAL   1 /* allgather: the fragment's result */
#define AGGBOX_RING_NACK    2 /* payload: __be32 fragment indexes the sender misses */
#define AGGBOX_RING_KICK    3 /* local runtime -> its node: round `round` is ready (count 0) */
#define AGGBOX_RING_KIND_LAST AGGBOX_RING_KICK

/* AGR1 `flags` */
#define AGGBOX_RING_F_SATURATED 0x01 /* some partial left the int32 range and was saturated */
#define AGGBOX_RING_F_NACK_FINAL 0x02 /* NACK: resend the FINALs (else: the PARTIALs from the origin) */
#define AGGBOX_RING_F_KNOWN     0x03

/*
 * Ring message header; `count` elements follow (int32, big-endian; for a
 * NACK, __be32 fragment indexes). Fragment `frag` holds elements
 * frag * frag_elems .. + count of the vector; its origin is member
 * frag % members, and the member that receives transmission `hops` of it is
 * (origin + hops) % members: hops 1..members-1 are PARTIALs, the member of
 * hops members-1 completes it, hops members..2*members-2 are FINALs.
 */
struct aggbox_ring_hdr {
	__be32 magic;  /* big-endian: AGGBOX_MAGIC_RING */
	__be16 ring;   /* big-endian: ring job id */
	__u8   kind;   /* AGGBOX_RING_* */
	__u8   flags;  /* AGGBOX_RING_F_* */
	__be32 round;  /* big-endian: the call's round */
	__be32 frag;   /* big-endian: fragment index */
	__be16 hops;   /* big-endian: transmission number along the ring (see above) */
	__be16 count;  /* big-endian: payload elements */
	__be16 sender; /* big-endian: member index of the sender */
	__u8   op;     /* enum aggbox_op, kernel ops only (0..4) */
	__u8   pad;    /* zero */
};
_Static_assert(sizeof(struct aggbox_ring_hdr) == 24, "AGR1 header is 24 bytes");

#ifndef AGGBOX_MAX_RINGS
#define AGGBOX_MAX_RINGS 64 /* ring jobs per node */
#endif
#ifndef AGGBOX_RING_MAX_FRAG_ELEMS
#define AGGBOX_RING_MAX_FRAG_ELEMS 16384 /* largest ring fragment, elements (a 65535-byte datagram holds 16370) */
#endif

/*
 * Value of ring_jobs (index: the ring's dense index, ring_index maps the id
 * to 1 + it): how this node takes part in one ring. Written by the control
 * plane, read by XDP and the node's ring service.
 */
struct aggbox_ring_job {
	__u16  id;         /* host order: ring job id */
	__u16  port;       /* host order: UDP port of the ring on every member */
	__u16  members;    /* host order: members, 2..=AGGBOX_MAX_RANKS */
	__u16  me;         /* host order: this node's member index */
	__u32  frag_elems; /* host order: elements per fragment (the ring_data value) */
	__u32  frags;      /* host order: fragments of the vector */
	__u32  vector_len; /* host order: elements of the vector */
	__u32  base;       /* host order: index of fragment 0 of even rounds in ring_data and ring_done;
			    * odd rounds' follow (AGGBOX_RING_INDEX) */
	__u32  weight_sum; /* host order: sum of the members' weights (AVG divisor) */
	__s32  weight;     /* host order: this member's weight */
	__be32 self_addr;  /* big-endian: this member's IPv4 address (source of what it sends);
			    * an IPv6 ring's are its ring_members entries [me] and
			    * [(me + 1) % members], and these two are not read */
	__be32 next_addr;  /* big-endian: the next member's IPv4 address */
};
_Static_assert(sizeof(struct aggbox_ring_job) == 40, "ring job is 40 bytes");

/*
 * The ring_data / ring_done index of fragment `frag` in round `round`: a
 * ring has two buffers, one for even rounds and one for odd ones, so that
 * a round's results stay in place until this member starts the round
 * after next, when no member can ask for them any more (docs/RING.md "Why
 * two buffers"). Mirrored by RingJob::index (src/wire/abi.rs).
 */
#define AGGBOX_RING_INDEX(base, frags, round, frag) ((base) + ((round) & 1) * (frags) + (frag))

/*
 * Value of ring_ctrl (index: dense ring index; BPF_F_MMAPABLE, shared with
 * the application's runtime): the round whose input is in place and how
 * many fragments of it are final here.
 */
#define AGGBOX_RING_READY 0x01 /* state: ready_round's input is in ring_data */
struct aggbox_ring_ctrl {
	__u32 ready_round;  /* host order: written by the runtime */
	__u32 state;        /* host order: AGGBOX_RING_READY, written by the runtime after the input */
	__u32 finals;       /* host order: fragments of finals_round stored here (atomic) */
	__u32 finals_round; /* host order: the round `finals` counts */
	__u32 op;           /* host order: the round's op (written by the runtime) */
	__u32 round_frags;  /* host order: the round covers fragments 0..round_frags-1, 0: all (the runtime) */
	__u32 pad[10];      /* zero */
};
_Static_assert(sizeof(struct aggbox_ring_ctrl) == 64, "ring ctrl is 64 bytes");

/* Value of ring_done (index: AGGBOX_RING_INDEX; BPF_F_MMAPABLE):
 * the round whose result of the fragment is in ring_data. Whoever stores a
 * result (XDP or the ring service) first claims it: compare-and-swap of
 * claimed_plus1 to 1 + round (the loser of a race between two copies of a
 * datagram drops its copy), then writes ring_data, then sets round_plus1. */
struct aggbox_ring_done {
	__u32 round_plus1;     /* host order: 1 + round of the stored result, 0 = none */
	__u32 claimed_plus1;   /* host order: 1 + round being (or last) stored, 0 = none */
	__u32 saturated_plus1; /* host order: 1 + round whose stored result saturated
				* (AGGBOX_RING_F_SATURATED), written before round_plus1, so every
				* member's result of a fragment says the same and a resent FINAL
				* carries the flag */
	__u32 pad;             /* zero */
};
_Static_assert(sizeof(struct aggbox_ring_done) == 16, "ring done is 16 bytes");

/* Per-CPU counters of one ring (ring_stats, index: dense ring index). */
enum aggbox_ring_stat {
	AGGBOX_RING_ADDED      = 0,  /* PARTIALs this member added to and forwarded */
	AGGBOX_RING_COMPLETED  = 1,  /* PARTIALs completed here (FINAL stored and sent on) */
	AGGBOX_RING_STORED     = 2,  /* FINALs stored (and forwarded unless the last) */
	AGGBOX_RING_DUPLICATE  = 3,  /* FINALs or completing PARTIALs already stored: dropped */
	AGGBOX_RING_EARLY      = 4,  /* PARTIALs of a round whose input is not ready: to the ring service */
	AGGBOX_RING_TO_SERVICE = 5,  /* NACK, KICK, frames the program cannot edit: to the ring service */
	AGGBOX_RING_STALE      = 6,  /* PARTIALs of another round than the ready one: dropped */
	AGGBOX_RING_FORGED     = 7,  /* source not the member it names, or hops that do not lead here: dropped */
	AGGBOX_RING_MALFORMED  = 8,  /* bad header, count, fragment or op: dropped */
	AGGBOX_RING_NO_ROUTE   = 9,  /* next member's next hop unknown: to the ring service */
	AGGBOX_RING_SATURATED  = 10, /* PARTIALs or FINALs carrying AGGBOX_RING_F_SATURATED */
	AGGBOX_RING_STAT_MAX   = 11,
};
struct aggbox_ring_stats {
	__u64 count[16]; /* host order: indexed by enum aggbox_ring_stat */
};
_Static_assert(sizeof(struct aggbox_ring_stats) == 128, "ring stats is 128 bytes");

#endif /* AGGBOX_ABI_H */
