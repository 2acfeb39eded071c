//! A communicator's counters: what crossed its transport ([`CommStats`]),
//! its system-call batching ([`IoStats`]) and what it refused
//! ([`RefusedStats`]), kept in shared atomics ([`Counters`]).

use std::sync::atomic::{AtomicU64, Ordering};

use super::is_ack;

/// Counters of one communicator, see [`crate::runtime::Communicator::stats`].
///
/// Datagrams are counted where they cross the transport, so one broadcast
/// fragment sent to three receivers by the socket path counts 3, and once
/// when the TC program makes the copies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Data datagrams (`AGG1`, `AGB1`) handed to the transport, first
    /// transmissions and retransmissions.
    pub data_sent: u64,
    /// Of those, retransmissions (timeouts and selective ACK holes).
    pub retransmitted: u64,
    /// `AGK1` datagrams sent.
    pub acks_sent: u64,
    /// Of those, the kernel backend's aggregator runtime's unasked repeats
    /// of the ACKs it sent on the kernel's behalf (docs/RUNTIME.md "Who
    /// acknowledges contributions"); 0 elsewhere.
    pub acks_repeated: u64,
    /// Data datagrams received (duplicates included).
    pub data_received: u64,
    /// `AGK1` datagrams received.
    pub acks_received: u64,
    /// Received data datagrams that were duplicates (not delivered again).
    pub duplicates_received: u64,
    /// Payload bytes delivered to this participant's calls (broadcast data
    /// and reduction results, each byte once).
    pub bytes_delivered: u64,
    /// Adaptive float allreduces that took one round: every worker
    /// quantized at the agreed scale it guessed (docs/RUNTIME.md
    /// "Quantization").
    pub float_calls_one_round: u64,
    /// Adaptive float allreduces that guessed the scale and reduced again
    /// at the agreed one (two rounds; three when the checks did not add up).
    pub float_calls_redone: u64,
}

crate::fieldwise! {
    /// Counters of several communicators added up (the stripes of a
    /// `StripedCommunicator`, the participants of a job).
    impl Add::add for CommStats {
        data_sent, retransmitted, acks_sent, acks_repeated, data_received, acks_received,
        duplicates_received, bytes_delivered, float_calls_one_round, float_calls_redone,
    }
}

/// System-call batching of one communicator, see
/// [`crate::runtime::Communicator::io_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Batches of first transmissions handed to [`Transport::send_batch`].
    pub send_batches: u64,
    /// Datagrams in those batches.
    pub batched_datagrams: u64,
    /// Non-empty [`Transport::recv_batch`] calls.
    pub recv_batches: u64,
    /// Datagrams they returned.
    pub received_datagrams: u64,
    /// UDP GSO super-datagrams sent ([`Transport::send_batch_gso`]).
    pub gso_super_datagrams: u64,
    /// Datagrams inside them.
    pub gso_segments: u64,
    /// Calls run on the caller's thread (blocking calls issued while no
    /// other call was queued or running; docs/RUNTIME.md "Who runs a call").
    pub calls_on_caller: u64,
    /// Calls run by the progress thread (`Work` calls, stripes, and blocking
    /// calls issued while another call was in flight).
    pub calls_on_progress_thread: u64,
    /// Waits of a caller's thread that its polling answered: a datagram
    /// came within [`crate::runtime::CommConfig::caller_spin`].
    pub caller_waits_polled: u64,
    /// Waits of a caller's thread that slept in `ppoll` (no spin, or none
    /// came within it).
    pub caller_waits_slept: u64,
}

crate::fieldwise! {
    /// Batching of several communicators added up.
    impl Add::add for IoStats {
        send_batches, batched_datagrams, recv_batches, received_datagrams, gso_super_datagrams,
        gso_segments, calls_on_caller, calls_on_progress_thread, caller_waits_polled,
        caller_waits_slept,
    }
}

/// Datagrams a communicator refused because of who sent them or because a
/// bound was reached, by reason (see
/// [`crate::runtime::Communicator::refused`] and docs/RUNTIME.md "Who may
/// send what"). Each is dropped without any effect on a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefusedStats {
    /// `AGG1` RESULTs from a source that may not send this participant
    /// RESULTs (a worker: not the aggregator's node; the aggregator: not a
    /// worker's socket nor its own node).
    pub results_from_wrong_source: u64,
    /// `AGK1` of this job from an address that is not the peer the ACK is
    /// about (a worker: not the aggregator's socket; the aggregator or a
    /// broadcast root: not the socket of the rank or receiver it names).
    pub acks_from_wrong_source: u64,
    /// `AGB1` from an address that is not a participant of the job.
    pub broadcasts_from_wrong_source: u64,
    /// Aggregator (kernel backend): RESULTs of a later round not kept because
    /// the early-result buffer was at its byte or count bound
    /// ([`crate::runtime::CommConfig::early_result_bytes`]).
    pub early_results_over_limit: u64,
}

crate::fieldwise! {
    /// Refusals of several communicators added up.
    impl Add::add for RefusedStats {
        results_from_wrong_source, acks_from_wrong_source, broadcasts_from_wrong_source,
        early_results_over_limit,
    }
}

/// Why a datagram was refused (one [`RefusedStats`] counter each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// See [`RefusedStats::results_from_wrong_source`].
    ResultFromWrongSource,
    /// See [`RefusedStats::acks_from_wrong_source`].
    AckFromWrongSource,
    /// See [`RefusedStats::broadcasts_from_wrong_source`].
    BroadcastFromWrongSource,
    /// See [`RefusedStats::early_results_over_limit`].
    EarlyResultOverLimit,
}

/// Shared atomic counters behind [`CommStats`].
#[derive(Debug, Default)]
pub struct Counters {
    pub(super) data_sent: AtomicU64,
    pub(super) retransmitted: AtomicU64,
    pub(super) acks_sent: AtomicU64,
    pub(super) acks_repeated: AtomicU64,
    pub(super) data_received: AtomicU64,
    pub(super) acks_received: AtomicU64,
    pub(super) duplicates_received: AtomicU64,
    pub(super) bytes_delivered: AtomicU64,
    pub(super) float_one_round: AtomicU64,
    pub(super) float_redone: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) batched: AtomicU64,
    pub(super) recv_batches: AtomicU64,
    pub(super) recv_datagrams: AtomicU64,
    pub(super) gso_sends: AtomicU64,
    pub(super) gso_segments: AtomicU64,
    pub(super) caller_calls: AtomicU64,
    pub(super) progress_calls: AtomicU64,
    pub(super) caller_waits_polled: AtomicU64,
    pub(super) caller_waits_slept: AtomicU64,
    pub(super) refused_results: AtomicU64,
    pub(super) refused_acks: AtomicU64,
    pub(super) refused_broadcasts: AtomicU64,
    pub(super) refused_early_results: AtomicU64,
}

impl Counters {
    /// A snapshot.
    pub fn snapshot(&self) -> CommStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CommStats {
            data_sent: l(&self.data_sent),
            retransmitted: l(&self.retransmitted),
            acks_sent: l(&self.acks_sent),
            acks_repeated: l(&self.acks_repeated),
            data_received: l(&self.data_received),
            acks_received: l(&self.acks_received),
            duplicates_received: l(&self.duplicates_received),
            bytes_delivered: l(&self.bytes_delivered),
            float_calls_one_round: l(&self.float_one_round),
            float_calls_redone: l(&self.float_redone),
        }
    }

    /// One adaptive float allreduce that guessed its scale: it took one
    /// round, or reduced again (see [`CommStats::float_calls_one_round`]).
    pub fn float_call(&self, one_round: bool) {
        let c = if one_round { &self.float_one_round } else { &self.float_redone };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` ACK datagrams queued as repeats (see [`CommStats::acks_repeated`]).
    pub fn acks_repeated(&self, n: u64) {
        self.acks_repeated.fetch_add(n, Ordering::Relaxed);
    }

    /// One non-empty receive batch of `n` datagrams.
    pub fn recv_batch(&self, n: usize) {
        self.recv_batches.fetch_add(1, Ordering::Relaxed);
        self.recv_datagrams.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// One call run on the caller's thread.
    pub fn caller_call(&self) {
        self.caller_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// One call run by the progress thread.
    pub fn progress_call(&self) {
        self.progress_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// One wait of a caller's thread: answered while it polled, or slept.
    pub fn caller_wait(&self, polled: bool) {
        let c = if polled { &self.caller_waits_polled } else { &self.caller_waits_slept };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The batching counters.
    pub fn io_snapshot(&self) -> IoStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IoStats {
            send_batches: l(&self.batches),
            batched_datagrams: l(&self.batched),
            recv_batches: l(&self.recv_batches),
            received_datagrams: l(&self.recv_datagrams),
            gso_super_datagrams: l(&self.gso_sends),
            gso_segments: l(&self.gso_segments),
            calls_on_caller: l(&self.caller_calls),
            calls_on_progress_thread: l(&self.progress_calls),
            caller_waits_polled: l(&self.caller_waits_polled),
            caller_waits_slept: l(&self.caller_waits_slept),
        }
    }

    /// One datagram refused for `why`.
    pub fn refused(&self, why: Refusal) {
        let c = match why {
            Refusal::ResultFromWrongSource => &self.refused_results,
            Refusal::AckFromWrongSource => &self.refused_acks,
            Refusal::BroadcastFromWrongSource => &self.refused_broadcasts,
            Refusal::EarlyResultOverLimit => &self.refused_early_results,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The refusal counters.
    pub fn refused_snapshot(&self) -> RefusedStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RefusedStats {
            results_from_wrong_source: l(&self.refused_results),
            acks_from_wrong_source: l(&self.refused_acks),
            broadcasts_from_wrong_source: l(&self.refused_broadcasts),
            early_results_over_limit: l(&self.refused_early_results),
        }
    }

    /// One duplicate data datagram received.
    pub fn duplicate(&self) {
        self.duplicates_received.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` payload bytes delivered.
    pub fn delivered(&self, n: usize) {
        self.bytes_delivered.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts one received datagram by its magic.
    pub fn received(&self, bytes: &[u8]) {
        if is_ack(bytes) {
            self.acks_received.fetch_add(1, Ordering::Relaxed);
        } else {
            self.data_received.fetch_add(1, Ordering::Relaxed);
        }
    }
}
