//! The node's result service: for every job with `consumer = "node"`,
//! `aggbox attach` itself takes the job's RESULTs on its `result_port` and
//! does what an aggregator application does for an in-kernel allreduce, so
//! the workers need nothing but the configuration:
//!
//! - it acknowledges every worker's contribution on the kernel's behalf: a
//!   RESULT proves every rank's contribution to its fragment arrived, and it
//!   names that contribution's seq (docs/PROTOCOL.md, "RESULT seq"), the
//!   same on every rank; the ACKs go per packet or per group as `[node]
//!   ack_mode` says, to every worker's socket;
//! - it keeps each RESULT until every worker acknowledged the copy the TC
//!   program brought it (AGK1 kind aggregation, the worker's rank, that
//!   seq), and resends it by unicast to only the workers that miss it, after
//!   the RTO or for a hole in their ACKs;
//! - it answers a worker's position query (`AGP1`, docs/PROTOCOL.md) with
//!   the round and contribution seq a new run of the job's communicators
//!   must start at, from the RESULTs it has seen
//!   ([`ResultService::position`]), so that a second MPI run on a running
//!   node starts where the first left off.
//!
//! Both halves are `wire::reliability` (`RecvTracker`, `SendWindow`), the
//! implementation the runtime's aggregator uses; this module adds only what
//! a node without calls must work out itself: where a round starts. A call
//! of round r+1 can only complete a fragment once every worker finished
//! round r, so the first RESULT of a newer round retires what is still held
//! of the older ones (a worker that missed one gave up on that call).
//!
//! A node-served job with a `parent` (a leaf of a tree of aggregators,
//! docs/PROTOCOL.md "Trees served by the node") is served the same way
//! toward its workers, but the kernel neither routes its RESULTs upstream
//! nor copies them to the group ([`JobConfig::kernel_parent`]): its own
//! RESULT, the subtree's partial reduction, is acknowledged on the kernel's
//! behalf as above and then sent by this service to the parent as the
//! node's contribution (same seq, round, frag_off, flags without RESULT),
//! held in a `SendWindow` until the parent acknowledges it; the parent's
//! RESULTs arrive on the same socket, are acknowledged to the parent's
//! result port, renamed to this job and delivered to every worker, and
//! held until each worker acknowledged its copy, like the kernel's copies
//! of a plain served job. The parent itself is a plain served job whose
//! workers are its children's result sockets.
//!
//! [`ResultService`] has no socket and no clock (`handle(now, from,
//! datagram)`, `poll(now)`); [`ResultServer`] is its thread, with one UDP
//! socket per served job bound to the job's `result_port`.
//!
//! One file per idea: `service.rs` the state machine ([`ResultService`]),
//! `server.rs` the thread and its sockets ([`ResultServer`]), `reload.rs`
//! the served jobs a configuration implies and the change between two
//! ([`ServedChange`]).

mod reload;
mod server;
mod service;
#[cfg(test)]
mod tests;

pub use reload::{BoundJobs, ServedChange};
pub use server::{ResultServer, ResultStatsFn};
pub use service::{ResultService, ServiceStats, Transmit, STATS_MAP};
