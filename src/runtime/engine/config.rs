//! What the engine is configured with: who the participant is
//! ([`Participant`]), the communicator's validated configuration
//! ([`CommConfig`]) and one call's options ([`CallOptions`]). The engine
//! owns them; the public API (`runtime::comm`) re-exports them and its
//! builder fills a [`CommConfig`].

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::runtime::backend::BackendKind;
use crate::runtime::quantize::Quantization;
use crate::runtime::transport::Impairment;
use crate::wire::abi::Round;
use crate::wire::reliability::ReliabilityConfig;

/// Who a communicator is in its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Participant {
    /// Worker `rank` (0..workers): contributes to reductions.
    Worker(u16),
    /// The aggregator's application: receives reduction results (and, for
    /// the socket backend, runs the user-space aggregator).
    Aggregator,
}

impl Participant {
    pub(crate) fn index(self, workers: u16) -> usize {
        match self {
            Participant::Worker(r) => r as usize,
            Participant::Aggregator => workers as usize,
        }
    }
}

/// Options of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// Deadline of the call, from its start; `None` = the communicator's.
    pub deadline: Option<Duration>,
    /// On a reduction timeout, put the partial result (with contributor
    /// counts) into the error.
    pub partial: bool,
}

impl CallOptions {
    /// Options with a deadline.
    pub fn deadline(d: Duration) -> CallOptions {
        CallOptions {
            deadline: Some(d),
            partial: false,
        }
    }
}

/// Everything a communicator needs, validated by the builder.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Job id (also the broadcast group id).
    pub job: u16,
    /// Worker data addresses, by rank.
    pub peers: Vec<SocketAddr>,
    /// This participant.
    pub me: Participant,
    /// The aggregator node's address.
    pub aggregator: IpAddr,
    /// The job's contribution port on the aggregator.
    pub job_port: u16,
    /// Kernel backend: the job's result port (the aggregator application's
    /// socket). Unused by the socket backend.
    pub result_port: u16,
    /// Backend.
    pub backend: BackendKind,
    /// Path MTU; fragments are sized from it
    /// ([`crate::runtime::fragment::elements_per_fragment`]). 0 (the
    /// builder's default) = discover it when the communicator is built: the
    /// smallest route MTU to the aggregator and every peer
    /// ([`crate::runtime::pmtu`]; 1500 if no route answers). A built
    /// communicator's [`crate::runtime::Communicator::config`] holds the value in use.
    pub mtu: usize,
    /// Reliability settings.
    pub reliability: ReliabilityConfig,
    /// Socket backend: slots of the user-space aggregator. Kernel backend:
    /// the job's `slots`, which caps the contribution window.
    pub slots: u32,
    /// Default per-call deadline.
    pub deadline: Duration,
    /// Float quantization.
    pub quantization: Quantization,
    /// Round of the first call.
    pub first_round: Round,
    /// Contribution seq of the first call (same on every rank).
    pub first_agg_seq: u32,
    /// Set for a worker of a node-served job by
    /// [`crate::runtime::CommunicatorBuilder::from_config`], cleared by
    /// [`crate::runtime::CommunicatorBuilder::resume`]: `build()` asks the node where the
    /// first call starts ([`crate::runtime::CommunicatorBuilder::node_position`], `AGP1`)
    /// and uses its answer instead of `first_round` and `first_agg_seq`.
    /// The node keeps a job's rounds across runs, so a new run that started
    /// at round 0 would find its contributions taken for the old run's.
    pub ask_node_position: bool,
    /// Most datagrams kept for a later call (early broadcast data).
    pub stash_limit: usize,
    /// Kernel backend, aggregator: most bytes the RESULTs of rounds this
    /// application has not called yet may hold (payload and bookkeeping;
    /// default [`crate::runtime::kernel::DEFAULT_EARLY_RESULT_BYTES`]). The kernel sends each RESULT
    /// once, so one refused here is lost to this participant's next call:
    /// raise it when workers run several rounds of large vectors ahead of the
    /// aggregator application.
    pub early_result_bytes: usize,
    /// Kernel backend: the job has a `result_group` of the workers, so the
    /// node's TC program copies every RESULT to every worker (in-kernel
    /// allreduce): the aggregator's runtime does not forward results, it
    /// only retransmits the ones a worker did not acknowledge.
    pub kernel_result_group: bool,
    /// The node serves the job itself (`consumer = "node"`): there is no
    /// aggregator participant, so broadcasts go to the workers only and
    /// none may come from the aggregator.
    pub node_served: bool,
    /// Kernel backend: this participant's node runs the TC broadcast program
    /// with this group; its broadcasts (as root) go out as one datagram per
    /// fragment that the program copies to the members.
    pub tc_group: Option<TcGroup>,
    /// Test hook: impair what this communicator receives (see
    /// [`crate::runtime::transport`]); `None` in production.
    pub impairment: Option<Impairment>,
    /// Send runs of datagrams to one destination as UDP GSO
    /// super-datagrams ([`crate::runtime::transport::Transport::send_batch_gso`]). `None`: on for the
    /// socket backend, off for the kernel backend (measured: docs/RUNTIME.md
    /// "UDP GSO"). Never with a TC group (the TC program parses each
    /// datagram it copies).
    pub udp_gso: Option<bool>,
    /// A blocking call issued while no other call is queued or running runs
    /// on the caller's thread, which takes the I/O driver for the call
    /// (docs/RUNTIME.md "Who runs a call"); `false`: every call goes through
    /// the progress thread. Default `true`; the environment variable
    /// `AGGBOX_CALLER_THREAD=0` turns it off at `build()` (for A/B
    /// measurements under an unchanged application, e.g. the MPI library).
    pub caller_runs_calls: bool,
    /// How long a caller's thread that waits for a datagram polls its
    /// socket, yielding the CPU between looks (`poll` with no timeout, then
    /// `sched_yield`), before it sleeps in `ppoll`: a result that comes
    /// within it costs no wake-up (docs/RUNTIME.md "Who runs a call").
    /// MPI implementations wait this way for every message. Default
    /// [`crate::runtime::DEFAULT_CALLER_SPIN`]; zero sleeps at once; the environment
    /// variable `AGGBOX_CALLER_SPIN_US` sets it at `build()` (A/B
    /// measurements under an unchanged application).
    pub caller_spin: Duration,
    /// The workers whose values a reduction sums: the divisor of a float
    /// mean (`allreduce_f32(.., mean = true)`) and the count an adaptive
    /// scale keeps the sum in int32 for. `None` = the workers; a tree's leaf
    /// job sets the tree's workers (`parent.tree_workers`,
    /// [`crate::runtime::CommunicatorBuilder::from_config`]).
    pub tree_workers: Option<u16>,
}

/// A broadcast group configured on this participant's node (`[[group]]`):
/// its id and member table (mask bit i = `members[i]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcGroup {
    /// Group id (the `AGB1` `group`).
    pub id: u16,
    /// Members in table order; every other participant must be one.
    pub members: Vec<SocketAddr>,
}

impl CommConfig {
    pub(crate) fn workers(&self) -> u16 {
        self.peers.len() as u16
    }

    /// [`CommConfig::tree_workers`], or the workers.
    pub(crate) fn total_workers(&self) -> u16 {
        self.tree_workers.unwrap_or_else(|| self.workers())
    }

    pub(crate) fn participants(&self) -> usize {
        self.peers.len() + 1
    }

    /// Whether the job runs over IPv6 (its aggregator's address; the
    /// builder checks that every peer is of the same family).
    pub fn is_ipv6(&self) -> bool {
        self.aggregator.is_ipv6()
    }

    /// Elements per fragment at [`CommConfig::mtu`] for the job's family:
    /// an IPv6 header is 20 bytes longer than an IPv4 one, so a datagram
    /// carries 5 elements fewer ([`crate::wire::proto::elements_per_fragment_in`]).
    pub fn elements_per_fragment(&self) -> usize {
        crate::wire::proto::elements_per_fragment_in(self.mtu, self.is_ipv6())
    }

    /// Socket address of participant index `i`.
    pub(crate) fn addr_of(&self, i: usize) -> SocketAddr {
        if i < self.peers.len() {
            self.peers[i]
        } else {
            match self.backend {
                BackendKind::Socket => SocketAddr::new(self.aggregator, self.job_port),
                BackendKind::Kernel => SocketAddr::new(self.aggregator, self.result_port),
            }
        }
    }

    /// Where contributions go: the job's port on the aggregator's node.
    pub(crate) fn contrib_target(&self) -> SocketAddr {
        SocketAddr::new(self.aggregator, self.job_port)
    }
}
