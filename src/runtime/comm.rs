//! The [`Communicator`]: one participant of a job (a worker rank, or the
//! aggregator's application), its builder, and the progress engine behind it.
//!
//! Every communicator owns one UDP socket and one progress thread. The thread
//! runs the calls in the order they were issued (blocking calls and
//! [`Work`] handles alike) and, between calls, keeps serving the socket: it
//! acknowledges late retransmissions, keeps early data of the next call, and
//! (aggregator) keeps reducing contributions that arrive before the
//! application asks for them. All participants must issue the same sequence
//! of collective calls; each call is one *round*.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::abi::{self, Op};
use crate::config::{AckMode, Config};
use crate::proto::{self, AckKind, AckMessage, AggHeader, BcastHeader, MessageKind, SeqBitmap};
use crate::runtime::backend::{send_ack, AckIo, Backend, BackendKind};
use crate::runtime::fragment;
use crate::runtime::fragment::{
    byte_window, elements_per_fragment, fragment_range, fragments, kernel_window, Coverage,
    BCAST_SUBHDR, SUBHDR_OVERFLOW,
};
use crate::runtime::kernel::KernelAggregator;
pub use crate::runtime::kernel::DEFAULT_EARLY_RESULT_BYTES;
use crate::runtime::quantize::{self, Quantization};
use crate::runtime::reliability::{RecvTracker, ReliabilityConfig, SendWindow, Verdict};
use crate::runtime::socket::SocketAggregator;
use crate::runtime::transport::{
    CommStats, Counters, ImpairedTransport, Impairment, Net, RecvMeta, RefusedStats, Refusal,
    Transport, UdpTransport, BATCH_MAX, RECV_SLOT,
};
use crate::runtime::work::Work;
use crate::runtime::{CommError, Partial, Peer, TimeoutInfo};

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
    fn index(self, workers: u16) -> usize {
        match self {
            Participant::Worker(r) => r as usize,
            Participant::Aggregator => workers as usize,
        }
    }

    fn peer(self) -> Peer {
        match self {
            Participant::Worker(r) => Peer::Rank(r),
            Participant::Aggregator => Peer::Aggregator,
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
    pub peers: Vec<SocketAddrV4>,
    /// This participant.
    pub me: Participant,
    /// The aggregator node's address.
    pub aggregator: Ipv4Addr,
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
    /// communicator's [`Communicator::config`] holds the value in use.
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
    pub first_round: u32,
    /// Contribution seq of the first call (same on every rank).
    pub first_agg_seq: u32,
    /// Most datagrams kept for a later call (early broadcast data).
    pub stash_limit: usize,
    /// Kernel backend, aggregator: most bytes the RESULTs of rounds this
    /// application has not called yet may hold (payload and bookkeeping;
    /// default [`DEFAULT_EARLY_RESULT_BYTES`]). The kernel sends each RESULT
    /// once, so one refused here is lost to this participant's next call:
    /// raise it when workers run several rounds of large vectors ahead of the
    /// aggregator application.
    pub early_result_bytes: usize,
    /// Kernel backend: the job has a `result_group` of the workers, so the
    /// node's TC program copies every RESULT to every worker (in-kernel
    /// allreduce): the aggregator's runtime does not forward results, it
    /// only retransmits the ones a worker did not acknowledge.
    pub kernel_result_group: bool,
    /// Kernel backend: this participant's node runs the TC broadcast program
    /// with this group; its broadcasts (as root) go out as one datagram per
    /// fragment that the program copies to the members.
    pub tc_group: Option<TcGroup>,
    /// Test hook: impair what this communicator receives (see
    /// [`crate::runtime::transport`]); `None` in production.
    pub impairment: Option<Impairment>,
    /// Send runs of datagrams to one destination as UDP GSO
    /// super-datagrams ([`Transport::send_batch_gso`]). `None`: on for the
    /// socket backend, off for the kernel backend (measured: docs/RUNTIME.md
    /// "UDP GSO"). Never with a TC group (the TC program parses each
    /// datagram it copies).
    pub udp_gso: Option<bool>,
}

/// A broadcast group configured on this participant's node (`[[group]]`):
/// its id and member table (mask bit i = `members[i]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcGroup {
    /// Group id (the `AGB1` `group`).
    pub id: u16,
    /// Members in table order; every other participant must be one.
    pub members: Vec<SocketAddrV4>,
}

impl CommConfig {
    fn workers(&self) -> u16 {
        self.peers.len() as u16
    }

    fn participants(&self) -> usize {
        self.peers.len() + 1
    }

    /// Socket address of participant index `i`.
    fn addr_of(&self, i: usize) -> SocketAddrV4 {
        if i < self.peers.len() {
            self.peers[i]
        } else {
            match self.backend {
                BackendKind::Socket => SocketAddrV4::new(self.aggregator, self.job_port),
                BackendKind::Kernel => SocketAddrV4::new(self.aggregator, self.result_port),
            }
        }
    }

    fn contrib_target(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.aggregator, self.job_port)
    }
}

/// Builds a [`Communicator`].
#[derive(Debug, Clone)]
pub struct CommunicatorBuilder {
    cfg: CommConfig,
}

impl CommunicatorBuilder {
    /// A job `job` whose workers listen at `peers` (rank r at `peers[r]`),
    /// with the aggregator at `aggregator:job_port`; this participant is `me`.
    pub fn new(
        job: u16,
        peers: Vec<SocketAddrV4>,
        aggregator: Ipv4Addr,
        job_port: u16,
        me: Participant,
    ) -> CommunicatorBuilder {
        CommunicatorBuilder {
            cfg: CommConfig {
                job,
                peers,
                me,
                aggregator,
                job_port,
                result_port: 0,
                backend: BackendKind::Socket,
                mtu: 0,
                reliability: ReliabilityConfig::default(),
                slots: 1024,
                deadline: Duration::from_secs(10),
                quantization: Quantization::default(),
                first_round: 0,
                first_agg_seq: 0,
                stash_limit: 4096,
                early_result_bytes: DEFAULT_EARLY_RESULT_BYTES,
                kernel_result_group: false,
                tc_group: None,
                impairment: None,
                udp_gso: None,
            },
        }
    }

    /// From a node configuration: job `job_id` of `config` (workers' addresses,
    /// port, result port, slots, ACK mode and group), each worker's data
    /// socket on `data_port`, the aggregator at `aggregator`. When the job has
    /// a `result_group`, the kernel backend uses it
    /// ([`CommunicatorBuilder::kernel_result_group`]), and the aggregator
    /// broadcasts through that group's TC table when its members are exactly
    /// the workers' data sockets ([`CommunicatorBuilder::tc_broadcast`]).
    pub fn from_config(
        config: &Config,
        job_id: u16,
        aggregator: Ipv4Addr,
        data_port: u16,
        me: Participant,
    ) -> Result<CommunicatorBuilder, CommError> {
        let job = config
            .job(job_id)
            .ok_or_else(|| CommError::Config(format!("no job {job_id} in the configuration")))?;
        let peers = job
            .workers
            .iter()
            .map(|&a| SocketAddrV4::new(a, data_port))
            .collect();
        let mut b = CommunicatorBuilder::new(job_id, peers, aggregator, job.port, me)
            .result_port(job.result_port)
            .slots(job.slots)
            .ack_mode(config.node.ack_mode)
            .group_size(config.node.ack_group as u32);
        b.cfg.reliability.window = b.cfg.reliability.window.min(b.cfg.reliability.group_size);
        if let Some(g) = job.result_group {
            b.cfg.kernel_result_group = true;
            if let Some(group) = config.group(g) {
                let mut members = group.members.clone();
                members.sort();
                let mut peers = b.cfg.peers.clone();
                peers.sort();
                if me == Participant::Aggregator && members == peers {
                    b.cfg.tc_group = Some(TcGroup {
                        id: g,
                        members: group.members.clone(),
                    });
                }
            }
        }
        Ok(b)
    }

    /// The configuration built so far.
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }
    /// Backend (default socket).
    pub fn backend(mut self, b: BackendKind) -> Self {
        self.cfg.backend = b;
        self
    }
    /// Kernel backend: the job's result port.
    pub fn result_port(mut self, p: u16) -> Self {
        self.cfg.result_port = p;
        self
    }
    /// Path MTU; overrides the discovery (default 0 = discover the path MTU
    /// to the aggregator and the peers when building, see [`CommConfig::mtu`]).
    pub fn mtu(mut self, mtu: usize) -> Self {
        self.cfg.mtu = mtu;
        self
    }
    /// Whether first transmissions leave as UDP GSO super-datagrams (default:
    /// socket backend yes, kernel backend no; never with a TC group).
    pub fn udp_gso(mut self, on: bool) -> Self {
        self.cfg.udp_gso = Some(on);
        self
    }
    /// Datagrams in flight per sender (default 256, at most the group size).
    pub fn window(mut self, w: u32) -> Self {
        self.cfg.reliability.window = w;
        self
    }
    /// Per-packet or group ACKs (default group).
    pub fn ack_mode(mut self, m: AckMode) -> Self {
        self.cfg.reliability.ack_mode = m;
        self
    }
    /// ACK group size G (default 1024).
    pub fn group_size(mut self, g: u32) -> Self {
        self.cfg.reliability.group_size = g;
        self
    }
    /// Kernel backend: the job's RESULTs reach every worker through the
    /// node's `result_group` (see [`CommConfig::kernel_result_group`]).
    pub fn kernel_result_group(mut self, on: bool) -> Self {
        self.cfg.kernel_result_group = on;
        self
    }
    /// Kernel backend: broadcasts from this participant go through its
    /// node's TC program, group `id` with member table `members` (every other
    /// participant's socket address must be a member).
    pub fn tc_broadcast(mut self, id: u16, members: Vec<SocketAddrV4>) -> Self {
        self.cfg.tc_group = Some(TcGroup { id, members });
        self
    }
    /// Test hook: receive through an [`ImpairedTransport`] (drop, duplicate,
    /// reorder; see [`crate::runtime::transport`]).
    pub fn impairment(mut self, imp: Impairment) -> Self {
        self.cfg.impairment = Some(imp);
        self
    }
    /// All reliability settings at once.
    pub fn reliability(mut self, r: ReliabilityConfig) -> Self {
        self.cfg.reliability = r;
        self
    }
    /// Kernel backend, aggregator: bound of the memory RESULTs of later
    /// rounds may hold (see [`CommConfig::early_result_bytes`]).
    pub fn early_result_bytes(mut self, bytes: usize) -> Self {
        self.cfg.early_result_bytes = bytes;
        self
    }
    /// Aggregator slots (socket) / the kernel job's slots (window cap).
    pub fn slots(mut self, s: u32) -> Self {
        self.cfg.slots = s;
        self
    }
    /// Default per-call deadline (default 10 s).
    pub fn deadline(mut self, d: Duration) -> Self {
        self.cfg.deadline = d;
        self
    }
    /// Float quantization (default fixed 1e8).
    pub fn quantization(mut self, q: Quantization) -> Self {
        self.cfg.quantization = q;
        self
    }
    /// Joins a job already running (a replacement for a failed participant):
    /// the round and contribution seq of its next call, as
    /// [`Communicator::position`] reports them on a surviving participant.
    pub fn resume(mut self, round: u32, agg_seq: u32) -> Self {
        self.cfg.first_round = round;
        self.cfg.first_agg_seq = agg_seq;
        self
    }

    /// Validates, binds the socket and starts the progress thread. The
    /// socket is bound to this participant's address (a worker's
    /// `peers[rank]`; the aggregator's `aggregator:job_port` for the socket
    /// backend, `aggregator:result_port` for the kernel backend).
    pub fn build(self) -> Result<Communicator, CommError> {
        let mut cfg = self.cfg;
        if cfg.mtu == 0 {
            cfg.mtu = discover_mtu(&cfg);
        }
        cfg.reliability.validate().map_err(CommError::Config)?;
        if cfg.peers.is_empty() {
            return Err(CommError::Config("a job needs at least one worker".into()));
        }
        if cfg.participants() > 64 {
            return Err(CommError::Config(format!(
                "{} participants: at most 63 workers per communicator",
                cfg.participants()
            )));
        }
        if let Participant::Worker(r) = cfg.me {
            if r as usize >= cfg.peers.len() {
                return Err(CommError::Config(format!(
                    "rank {r} but {} workers",
                    cfg.peers.len()
                )));
            }
        }
        if cfg.backend == BackendKind::Kernel && cfg.result_port == 0 {
            return Err(CommError::Config(
                "the kernel backend needs the job's result port".into(),
            ));
        }
        if cfg.mtu < 28 + abi::AGG_HDR_LEN + 4 {
            return Err(CommError::Config(format!("MTU {} too small", cfg.mtu)));
        }
        if let Some(g) = &cfg.tc_group {
            if g.members.is_empty() || g.members.len() > 32 {
                return Err(CommError::Config(format!(
                    "TC group {} has {} members (1..=32)",
                    g.id,
                    g.members.len()
                )));
            }
            let me = cfg.me.index(cfg.workers());
            for i in (0..cfg.participants()).filter(|&i| i != me) {
                let a = cfg.addr_of(i);
                if !g.members.contains(&a) {
                    return Err(CommError::Config(format!(
                        "TC group {}: participant {a} is not a member",
                        g.id
                    )));
                }
            }
        }
        cfg.udp_gso = Some(cfg.tc_group.is_none() && cfg.udp_gso.unwrap_or(cfg.backend == BackendKind::Socket));
        let me = cfg.addr_of(cfg.me.index(cfg.workers()));
        let sock = UdpSocket::bind(me)
            .map_err(|e| CommError::Io(io::Error::new(e.kind(), format!("binding {me}: {e}"))))?;
        sock.set_nonblocking(true)?;
        // 8 MiB, more for jumbo datagrams: at least 256 of them. With the
        // kernel backend everyone gets 64 MiB: the kernel sends each RESULT
        // once, as fast as the contributions complete, to the aggregator and
        // (result_group) to every worker; what a socket cannot hold is lost
        // and costs a retransmission timeout (measured, 21.8 M elements at
        // MTU 9000: 8 MiB overflowed at the aggregator, and at the workers,
        // whose windows hold up to 910 fragments). The socket backend's
        // aggregator too: 4 workers' windows of 233 datagrams at MTU 9000
        // overflowed its 8 MiB (`RcvbufErrors`, each a timeout).
        let dgram = fragment::IP_UDP_HDR + abi::AGG_HDR_LEN + 4 * elements_per_fragment(cfg.mtu);
        let mut rcv = (8usize << 20).max(256 * dgram);
        if cfg.backend == BackendKind::Kernel || cfg.me == Participant::Aggregator {
            rcv = rcv.max(64 << 20);
        }
        set_buffers(&sock, rcv.min(i32::MAX as usize) as i32);
        let transport: Box<dyn Transport> = match &cfg.impairment {
            None => Box::new(UdpTransport::new(sock)),
            Some(imp) => Box::new(ImpairedTransport::new(UdpTransport::new(sock), imp.clone())),
        };
        let counters = Arc::new(Counters::default());
        let net = Net {
            t: transport,
            c: counters.clone(),
        };
        let (waker_tx, waker_rx) = UnixDatagram::pair()?;
        waker_rx.set_nonblocking(true)?;
        let (tx, rx) = mpsc::channel::<Request>();
        let round = Arc::new(AtomicU32::new(cfg.first_round));
        let agg_seq = Arc::new(AtomicU32::new(cfg.first_agg_seq));
        let closing = Arc::new(AtomicBool::new(false));
        let engine = Engine::new(
            cfg.clone(),
            net,
            waker_rx,
            round.clone(),
            agg_seq.clone(),
            closing.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("aggbox-{}-{:?}", cfg.job, cfg.me))
            .spawn(move || engine.run(rx))?;
        Ok(Communicator {
            cfg,
            tx,
            waker: waker_tx,
            thread: Some(thread),
            round,
            agg_seq,
            closing,
            counters,
        })
    }
}

/// Most seqs the aggregator remembers as acknowledged before it registered
/// them (`Engine::res_early`): a few windows of results.
const RES_EARLY_LIMIT: usize = 1 << 16;

/// The path MTU of a communicator with `cfg.mtu == 0`: the smallest route
/// MTU to the aggregator and every other participant (1500 when none of
/// them has a route).
fn discover_mtu(cfg: &CommConfig) -> usize {
    let me = match cfg.me {
        Participant::Worker(r) => {
            Some(*cfg.peers[(r as usize).min(cfg.peers.len().saturating_sub(1))].ip())
        }
        Participant::Aggregator => None,
    };
    let others = std::iter::once(cfg.aggregator)
        .chain(cfg.peers.iter().map(|p| *p.ip()))
        .filter(|a| Some(*a) != me || *a == cfg.aggregator);
    crate::runtime::pmtu::min_path_mtu(others).unwrap_or(1500)
}

/// Socket buffers of `bytes`: the `*FORCE` options (beyond `rmem_max` /
/// `wmem_max`, with CAP_NET_ADMIN) first, else the capped ones.
fn set_buffers(sock: &UdpSocket, bytes: i32) {
    for (force, opt) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: valid fd, pointer to an int of the right size.
        unsafe {
            let p = &bytes as *const i32 as *const libc::c_void;
            if libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, force, p, 4) != 0 {
                libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, opt, p, 4);
            }
        }
    }
}

/// Result of an int reduction as the caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReduceOutput {
    /// The vector: the result where this participant gets it, else the input.
    pub values: Vec<i32>,
    /// Whether this participant got the result (aggregator for reduce,
    /// everyone for allreduce).
    pub has_result: bool,
    /// Some element was clamped (OVERFLOW).
    pub overflow: bool,
}

pub(crate) enum Request {
    Bcast {
        root: usize,
        data: Vec<u8>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<Vec<u8>, CommError>>,
    },
    Reduce {
        all: bool,
        op: Op,
        data: Vec<i32>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<ReduceOutput, CommError>>,
    },
    ReduceF32 {
        all: bool,
        mean: bool,
        data: Vec<f32>,
        opts: CallOptions,
        reply: mpsc::Sender<Result<Vec<f32>, CommError>>,
    },
    /// A blocking int reduction on the caller's slice (see [`Raw`]); replies
    /// whether the result was clamped (OVERFLOW).
    ReduceI32In {
        all: bool,
        op: Op,
        data: RawI32,
        opts: CallOptions,
        reply: mpsc::Sender<Result<bool, CommError>>,
    },
    /// A blocking float reduction on the caller's slice (see [`RawF32`]).
    ReduceF32In {
        all: bool,
        mean: bool,
        data: RawF32,
        opts: CallOptions,
        reply: mpsc::Sender<Result<(), CommError>>,
    },
}

/// The caller's slice of a blocking reduction (`&mut [f32]`: [`RawF32`],
/// `&mut [i32]`: [`RawI32`]), lent to the progress thread for the duration
/// of the call, so elements are encoded (floats quantized) straight from it
/// into datagram buffers and results decoded straight into it (no copy in,
/// no copy out, no per-call vector).
///
/// Soundness: the blocking caller holds the exclusive borrow and waits on
/// the reply channel; the engine uses the pointer only while executing the
/// request, and the reply (or the request's drop, if the thread is gone)
/// happens after its last use, so the caller's wait returns only then.
/// The engine also lends an owned vector this way (the aggregator's result
/// vector of a `Vec` call): it keeps the vector, unresized, until the call
/// is over.
#[derive(Debug)]
pub(crate) struct Raw<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Raw<T> {}

/// A lent `&mut [f32]` (see [`Raw`]).
pub(crate) type RawF32 = Raw<f32>;
/// A lent `&mut [i32]` (see [`Raw`]).
pub(crate) type RawI32 = Raw<i32>;

// SAFETY: see the type's docs: one thread uses it at a time, while the
// owner waits.
unsafe impl<T: Send> Send for Raw<T> {}

impl<T> Raw<T> {
    pub(crate) fn of(s: &mut [T]) -> Raw<T> {
        Raw {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// SAFETY: no `&mut` to the same memory may be alive while the result is.
    unsafe fn slice<'a>(self) -> &'a [T] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// SAFETY: no other reference to the same memory may be alive while the
    /// result is.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<'a>(self) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// One participant of a job: broadcast, reduce and allreduce over the
/// socket or the kernel backend (see the module docs and `docs/RUNTIME.md`).
///
/// Blocking int and float reductions work on the caller's slice in place
/// (lent to the progress thread for the call); blocking
/// broadcasts copy it in and out; the `i*` forms take owned vectors and
/// return a [`Work`] handle. Calls run one at a time, in
/// issue order. Dropping the communicator stops its thread and closes its
/// socket.
#[derive(Debug)]
pub struct Communicator {
    cfg: CommConfig,
    tx: mpsc::Sender<Request>,
    waker: UnixDatagram,
    thread: Option<JoinHandle<()>>,
    round: Arc<AtomicU32>,
    agg_seq: Arc<AtomicU32>,
    closing: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Communicator {
    /// Counters since the communicator was built: data datagrams sent and
    /// retransmitted, ACKs sent and received, duplicates, bytes delivered.
    pub fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }

    /// System-call batching since the communicator was built (`sendmmsg` /
    /// `recvmmsg` batches and the datagrams in them).
    pub fn io_stats(&self) -> crate::runtime::IoStats {
        self.counters.io_snapshot()
    }

    /// Datagrams refused since the communicator was built, by reason: from a
    /// source that may not send them, or beyond the early-result bound
    /// (docs/RUNTIME.md "Who may send what").
    pub fn refused(&self) -> RefusedStats {
        self.counters.refused_snapshot()
    }

    /// Starts a builder; see [`CommunicatorBuilder::new`].
    pub fn builder(
        job: u16,
        peers: Vec<SocketAddrV4>,
        aggregator: Ipv4Addr,
        job_port: u16,
        me: Participant,
    ) -> CommunicatorBuilder {
        CommunicatorBuilder::new(job, peers, aggregator, job_port, me)
    }

    /// This participant.
    pub fn participant(&self) -> Participant {
        self.cfg.me
    }

    /// This worker's rank, `None` for the aggregator.
    pub fn rank(&self) -> Option<u16> {
        match self.cfg.me {
            Participant::Worker(r) => Some(r),
            Participant::Aggregator => None,
        }
    }

    /// Number of workers.
    pub fn workers(&self) -> u16 {
        self.cfg.workers()
    }

    /// The configuration in use.
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }

    /// (round, contribution seq) the next call will use once every issued
    /// call finished; give them to [`CommunicatorBuilder::resume`] to
    /// replace a failed participant.
    pub fn position(&self) -> (u32, u32) {
        (
            self.round.load(Ordering::SeqCst),
            self.agg_seq.load(Ordering::SeqCst),
        )
    }

    fn submit(&self, req: Request) -> Result<(), CommError> {
        self.tx.send(req).map_err(|_| CommError::Closed)?;
        let _ = self.waker.send(&[1]);
        Ok(())
    }

    fn root_index(&self, root: Participant) -> Result<usize, CommError> {
        if let Participant::Worker(r) = root {
            if r >= self.workers() {
                return Err(CommError::Config(format!(
                    "root rank {r} but {} workers",
                    self.workers()
                )));
            }
        }
        Ok(root.index(self.workers()))
    }

    /// Non-blocking broadcast of bytes from `root`: the root's `data` is sent,
    /// every other participant's `data` (same length) is overwritten.
    pub fn ibroadcast(&self, data: Vec<u8>, root: Participant, opts: CallOptions) -> Work<Vec<u8>> {
        let (reply, rx) = mpsc::channel();
        match self.root_index(root) {
            Ok(root) => match self.submit(Request::Bcast {
                root,
                data,
                opts,
                reply,
            }) {
                Ok(()) => Work::pending(rx),
                Err(e) => Work::ready(Err(e)),
            },
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Broadcast of bytes from `root`, in place (every participant passes a
    /// buffer of the same length); blocks until this participant's part is
    /// done: a receiver has every byte, the root has every acknowledgement.
    pub fn broadcast(&self, buf: &mut [u8], root: Participant) -> Result<(), CommError> {
        self.broadcast_with(buf, root, CallOptions::default())
    }

    /// [`Communicator::broadcast`] with options.
    pub fn broadcast_with(
        &self,
        buf: &mut [u8],
        root: Participant,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        let out = self.ibroadcast(buf.to_vec(), root, opts).wait()?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    /// Broadcast of an int32 vector (sent big-endian).
    pub fn broadcast_i32(&self, buf: &mut [i32], root: Participant) -> Result<(), CommError> {
        let mut bytes = Vec::with_capacity(buf.len() * 4);
        proto::write_i32_be(buf, &mut bytes);
        let out = self
            .ibroadcast(bytes, root, CallOptions::default())
            .wait()?;
        proto::read_i32_be(&out, buf);
        Ok(())
    }

    /// Broadcast of a float32 vector (bit patterns, sent big-endian).
    pub fn broadcast_f32(&self, buf: &mut [f32], root: Participant) -> Result<(), CommError> {
        let mut bytes = Vec::with_capacity(buf.len() * 4);
        proto::write_f32_be(buf, &mut bytes);
        let out = self
            .ibroadcast(bytes, root, CallOptions::default())
            .wait()?;
        proto::read_f32_be(&out, buf);
        Ok(())
    }

    /// Non-blocking int reduction (`all`: allreduce). Workers pass their
    /// contribution; the aggregator passes a vector of the same length that
    /// receives the result.
    pub fn ireduce_i32(
        &self,
        data: Vec<i32>,
        op: Op,
        all: bool,
        opts: CallOptions,
    ) -> Work<ReduceOutput> {
        let (reply, rx) = mpsc::channel();
        match self.submit(Request::Reduce {
            all,
            op,
            data,
            opts,
            reply,
        }) {
            Ok(()) => Work::pending(rx),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Reduce to the aggregator: a worker's `buf` is its contribution (left
    /// unchanged); the aggregator's `buf` receives the result. Returns
    /// whether the result was clamped (OVERFLOW) — only the aggregator knows,
    /// workers get `false`.
    pub fn reduce_i32(&self, buf: &mut [i32], op: Op) -> Result<bool, CommError> {
        self.reduce_i32_with(buf, op, CallOptions::default())
    }

    /// [`Communicator::reduce_i32`] with options.
    pub fn reduce_i32_with(
        &self,
        buf: &mut [i32],
        op: Op,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        self.reduce_i32_in(buf, false, op, opts)
    }

    /// Allreduce: every participant's `buf` receives the result (workers
    /// contribute theirs). Returns whether it was clamped (OVERFLOW).
    /// Zero-copy: fragments are encoded straight from `buf` and results
    /// decoded straight into it; after the first call of a size nothing of
    /// the vector's size is allocated per call. On an error `buf` may hold
    /// part of the result.
    pub fn allreduce_i32(&self, buf: &mut [i32], op: Op) -> Result<bool, CommError> {
        self.allreduce_i32_with(buf, op, CallOptions::default())
    }

    /// [`Communicator::allreduce_i32`] with options.
    pub fn allreduce_i32_with(
        &self,
        buf: &mut [i32],
        op: Op,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        self.reduce_i32_in(buf, true, op, opts)
    }

    /// Zero-copy int reduction on `buf` (see [`Raw`]): a worker encodes each
    /// fragment straight from `buf` into its datagram; results (an allreduce
    /// worker's as they arrive, the aggregator's as fragments complete) are
    /// written straight into `buf`; after the first call of a size nothing
    /// of the vector's size is allocated per call. On an error `buf` may
    /// hold part of the result.
    fn reduce_i32_in(
        &self,
        buf: &mut [i32],
        all: bool,
        op: Op,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        // The engine uses `buf` until it replies (or drops the request);
        // `buf` stays borrowed here until then.
        self.start_reduce_i32(RawI32::of(buf), all, op, opts)?
            .recv()
            .unwrap_or(Err(CommError::Closed))
    }

    /// Submits an int reduction on the lent slice `data` and returns the
    /// channel of its reply, without waiting (several stripes of one vector
    /// run at once this way, `crate::runtime::striped`). The caller must keep
    /// the slice exclusively borrowed until the channel yields or
    /// disconnects (see [`Raw`]).
    pub(crate) fn start_reduce_i32(
        &self,
        data: RawI32,
        all: bool,
        op: Op,
        opts: CallOptions,
    ) -> Result<mpsc::Receiver<Result<bool, CommError>>, CommError> {
        self.start(|reply| Request::ReduceI32In {
            all,
            op,
            data,
            opts,
            reply,
        })
    }

    /// Submits the request `make(reply)` and returns the channel of its
    /// reply (it yields `Err` when the progress thread is gone).
    fn start<T>(
        &self,
        make: impl FnOnce(mpsc::Sender<Result<T, CommError>>) -> Request,
    ) -> Result<mpsc::Receiver<Result<T, CommError>>, CommError> {
        let (reply, rx) = mpsc::channel();
        self.submit(make(reply))?;
        Ok(rx)
    }

    /// Non-blocking float SUM (or mean) reduction through quantization
    /// (see [`crate::runtime::quantize`]).
    pub fn ireduce_f32(
        &self,
        data: Vec<f32>,
        all: bool,
        mean: bool,
        opts: CallOptions,
    ) -> Work<Vec<f32>> {
        let (reply, rx) = mpsc::channel();
        match self.submit(Request::ReduceF32 {
            all,
            mean,
            data,
            opts,
            reply,
        }) {
            Ok(()) => Work::pending(rx),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Float SUM to the aggregator through quantization (the aggregator's
    /// `buf` receives it; workers' are unchanged).
    pub fn reduce_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.reduce_f32_in(buf, false, false, CallOptions::default())
    }

    /// Float allreduce SUM through quantization; `mean` divides by the
    /// number of workers. Zero-copy: a worker's floats are quantized straight
    /// from `buf` into datagram buffers and the result is dequantized straight
    /// into `buf` as its fragments arrive; after the first call of a size
    /// nothing is allocated per call (docs/RUNTIME.md). On an error `buf`
    /// may hold part of the result.
    pub fn allreduce_f32(&self, buf: &mut [f32], mean: bool) -> Result<(), CommError> {
        self.reduce_f32_in(buf, true, mean, CallOptions::default())
    }

    /// [`Communicator::allreduce_f32`] / [`Communicator::reduce_f32`] with
    /// options (`all`: allreduce).
    pub fn reduce_f32_with(
        &self,
        buf: &mut [f32],
        all: bool,
        mean: bool,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        self.reduce_f32_in(buf, all, mean, opts)
    }

    fn reduce_f32_in(
        &self,
        buf: &mut [f32],
        all: bool,
        mean: bool,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        // The engine uses `buf` until it replies (or drops the request);
        // `buf` stays borrowed here until then.
        self.start_reduce_f32(RawF32::of(buf), all, mean, opts)?
            .recv()
            .unwrap_or(Err(CommError::Closed))
    }

    /// [`Communicator::start_reduce_i32`] for a float reduction.
    pub(crate) fn start_reduce_f32(
        &self,
        data: RawF32,
        all: bool,
        mean: bool,
        opts: CallOptions,
    ) -> Result<mpsc::Receiver<Result<(), CommError>>, CommError> {
        self.start(|reply| Request::ReduceF32In {
            all,
            mean,
            data,
            opts,
            reply,
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Closing the channel stops the thread (a call in progress fails with
        // `Closed`); the waker makes it notice.
        self.closing.store(true, Ordering::SeqCst);
        let (dead_tx, _) = mpsc::channel();
        let tx = std::mem::replace(&mut self.tx, dead_tx);
        drop(tx);
        let _ = self.waker.send(&[0]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------
// The progress engine
// ---------------------------------------------------------------------------

/// What a worker contributes: int32s, or floats quantized at `scale` as
/// each fragment is encoded.
enum Src {
    I32(Vec<i32>),
    /// A blocking call's slice (see [`Raw`]); the aggregator's receives the
    /// result.
    RawI32(RawI32),
    F32 {
        x: RawF32,
        scale: f64,
    },
    /// The aggregator's side of a float reduction: only the length.
    Len(usize),
}

impl Src {
    fn len(&self) -> usize {
        match self {
            Src::I32(v) => v.len(),
            Src::RawI32(x) => x.len,
            Src::F32 { x, .. } => x.len,
            Src::Len(n) => *n,
        }
    }
}

/// Where a receiving call writes what arrives: bytes (broadcast, int
/// results of a `Vec` call, big-endian), int32s decoded from big-endian on
/// arrival, or floats dequantized with `div` on arrival.
enum Sink {
    Bytes(Vec<u8>),
    I32(RawI32),
    F32 { out: RawF32, div: f64 },
}

impl Sink {
    fn len_bytes(&self) -> usize {
        match self {
            Sink::Bytes(b) => b.len(),
            Sink::I32(out) => out.len * 4,
            Sink::F32 { out, .. } => out.len * 4,
        }
    }

    /// Writes `data` at byte offset `off` (in range, 4-aligned for floats).
    fn put(&mut self, off: usize, data: &[u8]) {
        match self {
            Sink::Bytes(b) => b[off..off + data.len()].copy_from_slice(data),
            Sink::I32(out) => {
                // SAFETY: as for F32 below.
                let o = unsafe { out.slice_mut() };
                proto::read_i32_be(data, &mut o[off / 4..(off + data.len()) / 4]);
            }
            Sink::F32 { out, div } => {
                // SAFETY: the engine holds no other reference into `out`
                // while this one lives (RawF32's contract).
                let o = unsafe { out.slice_mut() };
                quantize::dequantize_be_into(data, *div, &mut o[off / 4..(off + data.len()) / 4]);
            }
        }
    }
}

/// What a reduction call leaves: the aggregator's result vector, the
/// contribution source back, a worker's received result.
struct Reduced {
    values: Option<(Vec<i32>, bool)>,
    src: Option<Src>,
    sink: Option<(Sink, bool)>,
}

struct Contrib {
    src: Src,
    op: Op,
    next: usize,
    nfrags: usize,
    seq_base: u32,
}

struct BcastOut {
    /// Bytes to send (plain broadcast); empty when forwarding results.
    bytes: Vec<u8>,
    len_bytes: usize,
    queue: VecDeque<u32>,
    overflow: Coverage,
    dests: u64,
}

struct BcastIn {
    root: usize,
    sink: Sink,
    cov: Coverage,
    overflow: bool,
    /// The data are RESULTs copied by the node's TC program (`AGG1`), not
    /// `AGB1` forwarded by the aggregator's runtime.
    results: bool,
}

struct Collect {
    /// The result vector: the caller's slice (a blocking int call) or an
    /// owned vector `reduce` keeps until the call is over (see [`Raw`]).
    out: RawI32,
    cov: Coverage,
    overflow: bool,
}

struct OpState {
    name: &'static str,
    round: u32,
    op: Op,
    /// Aggregator, kernel allreduce through the result group: completed
    /// fragments are registered in `res_tx` (the kernel sent them).
    rout: bool,
    contrib: Option<Contrib>,
    bout: Option<BcastOut>,
    bin: Option<BcastIn>,
    collect: Option<Collect>,
}

/// See `Engine::agg_windows`.
#[derive(Debug, Clone, Copy)]
struct ContribWindows {
    reduce: usize,
    allreduce: usize,
}

struct Stashed {
    buf: Vec<u8>,
    from: usize,
    round: u32,
}

/// The TC broadcast route of a root: where its one datagram goes and which
/// table bit each participant has.
struct TcRoute {
    id: u16,
    first: SocketAddrV4,
    bit_of: Vec<u32>,
    scratch: Vec<u8>,
}

impl TcRoute {
    fn mask(&self, dests: u64) -> u32 {
        (0..self.bit_of.len())
            .filter(|&d| dests & (1 << d) != 0)
            .fold(0, |m, d| m | self.bit_of[d])
    }

    /// One datagram to the first member with `mask` written into the `AGB1`
    /// header: the TC program copies it to the masked members.
    fn send(&mut self, net: &Net, bytes: &[u8], mask: u32, retx: bool) {
        self.scratch.clear();
        self.scratch.extend_from_slice(bytes);
        if self.scratch.len() >= 8 {
            self.scratch[4..8].copy_from_slice(&mask.to_be_bytes());
        }
        if retx {
            net.retx(self.first, &self.scratch);
        } else {
            net.tx(self.first, &self.scratch);
        }
    }
}

/// Which send window a queued first transmission is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxWin {
    Agg,
    Bcast,
}

/// Datagrams per receive batch (`recvmmsg`), each in a [`RECV_SLOT`] slot.
const RECV_BATCH: usize = 32;

struct Engine {
    cfg: CommConfig,
    net: Net,
    waker: UnixDatagram,
    me: usize,
    per: usize,
    chunk: usize,
    addrs: Vec<SocketAddrV4>,
    index: HashMap<SocketAddrV4, usize>,
    agg_tx: SendWindow,
    /// The contribution window of a reduce and of an allreduce whose
    /// RESULTs the kernel copies to every worker (the kernel backend's
    /// differ: `fragment::kernel_window`).
    agg_windows: ContribWindows,
    bc_tx: SendWindow,
    bc_rx: Vec<RecvTracker>,
    /// The `AGB1` group each sender used last (the id its ACKs carry).
    bc_group: Vec<u16>,
    /// Aggregator, kernel allreduce via the result group: results held until
    /// every worker acknowledged them (seq = contribution seq), resent by
    /// unicast to who misses them.
    res_tx: SendWindow,
    /// Aggregator: result ACKs that named seqs not registered yet (a worker
    /// got the kernel's copy before this runtime took the RESULT): seq →
    /// workers (bit per rank), applied when the seq is registered. (Keeping
    /// whole bitmaps and re-applying all of them at every registration cost
    /// 13 % of the CPU of a 21.8 M-element allreduce.) Bounded.
    res_early: HashMap<u32, u64>,
    /// Worker: acknowledges the results it receives (seq = contribution seq).
    res_rx: RecvTracker,
    /// Worker: (round, contribution seq base, fragments) of recent reductions,
    /// to re-acknowledge late result retransmissions.
    recent: VecDeque<(u32, u32, usize)>,
    tc: Option<TcRoute>,
    backend: Option<Box<dyn Backend>>,
    stash: Vec<Stashed>,
    stash_pool: Vec<Vec<u8>>,
    rxbuf: Vec<u8>,
    rxmeta: Vec<RecvMeta>,
    /// New datagrams registered by `pump`, sent by `flush_tx`: (window, seq,
    /// destination).
    txq: Vec<(TxWin, u32, SocketAddrV4)>,
    ackbuf: Vec<u8>,
    acks_sent: u64,
    round: u32,
    agg_seq: u32,
    round_pub: Arc<AtomicU32>,
    agg_seq_pub: Arc<AtomicU32>,
    spare_cov: Vec<Coverage>,
    /// Reused per-call buffers (kept between calls of the same size): a
    /// worker's int result bytes, the aggregator's int32 result, a float
    /// result held for a possible rerun, the forwarding queue.
    spare_bytes: Vec<u8>,
    spare_i32: Vec<i32>,
    spare_f32: Vec<f32>,
    spare_queue: VecDeque<u32>,
    closing: Arc<AtomicBool>,
}

fn random_group_base(g: u32) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ ((std::process::id() as u64) << 32) ^ (&t as *const u64 as u64);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let seq = x as u32;
    seq - seq % g.max(1)
}

fn retx_to(net: &Net, to: SocketAddrV4, b: &[u8]) {
    net.retx(to, b);
}

impl Engine {
    fn new(
        cfg: CommConfig,
        net: Net,
        waker: UnixDatagram,
        round_pub: Arc<AtomicU32>,
        agg_seq_pub: Arc<AtomicU32>,
        closing: Arc<AtomicBool>,
    ) -> Engine {
        let n = cfg.participants();
        let addrs: Vec<SocketAddrV4> = (0..n).map(|i| cfg.addr_of(i)).collect();
        let index = addrs.iter().enumerate().map(|(i, a)| (*a, i)).collect();
        let me = cfg.me.index(cfg.workers());
        let per = elements_per_fragment(cfg.mtu);
        let datagram = fragment::IP_UDP_HDR + abi::AGG_HDR_LEN + 4 * per;
        let window = byte_window(cfg.reliability.window as usize, datagram);
        let mut agg_tx = SendWindow::new(cfg.reliability, 1, cfg.first_agg_seq);
        let agg_windows = match cfg.backend {
            // The kernel's slot and block pools and the node's queues bound
            // the fragments in flight.
            BackendKind::Kernel => {
                let workers = cfg.peers.len();
                let of = |copies| {
                    kernel_window(window, cfg.slots as usize, per, workers, copies, datagram)
                };
                ContribWindows {
                    reduce: of(1),
                    allreduce: of(workers + 1),
                }
            }
            // A fragment in flight holds one of the socket aggregator's
            // slots until every worker's contribution to it arrived: more in
            // flight than slots is dropped unacknowledged, and resent after
            // timeouts that double every time it is dropped again.
            BackendKind::Socket => {
                let w = window.min(cfg.slots.max(1) as usize);
                ContribWindows {
                    reduce: w,
                    allreduce: w,
                }
            }
        };
        agg_tx.set_window(agg_windows.reduce);
        // The kernel's results acknowledge contributions; their holes are
        // not this worker's losses.
        agg_tx.set_holes_are_losses(cfg.backend == BackendKind::Socket);
        let mut bc_tx = SendWindow::new(
            cfg.reliability,
            n,
            random_group_base(cfg.reliability.group_size),
        );
        bc_tx.set_window(window);
        // Broadcast receivers and result receivers keep what arrives: one
        // gone quiet is busy, and gets probes (SendWindow::set_probe_quiet).
        bc_tx.set_probe_quiet(true);
        let bc_rx = (0..n).map(|_| RecvTracker::new(cfg.reliability)).collect();
        let mut res_tx = SendWindow::new(cfg.reliability, cfg.peers.len(), cfg.first_agg_seq);
        res_tx.set_probe_quiet(true);
        let res_rx = RecvTracker::new(cfg.reliability);
        let tc = match (&cfg.tc_group, cfg.backend) {
            (Some(g), BackendKind::Kernel) => Some(TcRoute {
                id: g.id,
                first: g.members[0],
                bit_of: addrs
                    .iter()
                    .map(|a| {
                        g.members
                            .iter()
                            .position(|m| m == a)
                            .map_or(0, |i| 1u32 << i)
                    })
                    .collect(),
                scratch: Vec::with_capacity(2048),
            }),
            _ => None,
        };
        let backend: Option<Box<dyn Backend>> = match (cfg.me, cfg.backend) {
            (Participant::Aggregator, BackendKind::Socket) => {
                Some(Box::new(SocketAggregator::new(
                    cfg.peers.clone(),
                    cfg.reliability,
                    cfg.slots as usize,
                    cfg.first_round,
                )))
            }
            (Participant::Aggregator, BackendKind::Kernel) => {
                Some(Box::new(KernelAggregator::new(
                    cfg.peers.clone(),
                    per,
                    cfg.reliability,
                    cfg.first_round,
                    cfg.first_agg_seq,
                    cfg.aggregator,
                    cfg.early_result_bytes,
                )))
            }
            _ => None,
        };
        Engine {
            me,
            per,
            chunk: per * 4,
            addrs,
            index,
            agg_tx,
            agg_windows,
            bc_tx,
            bc_rx,
            bc_group: vec![cfg.job; n],
            res_tx,
            res_early: HashMap::new(),
            res_rx,
            recent: VecDeque::new(),
            tc,
            backend,
            stash: Vec::new(),
            stash_pool: Vec::new(),
            rxbuf: vec![0u8; RECV_SLOT * RECV_BATCH],
            rxmeta: vec![RecvMeta::default(); RECV_BATCH],
            txq: Vec::with_capacity(BATCH_MAX),
            ackbuf: Vec::with_capacity(256),
            acks_sent: 0,
            round: cfg.first_round,
            agg_seq: cfg.first_agg_seq,
            round_pub,
            agg_seq_pub,
            spare_cov: Vec::new(),
            spare_bytes: Vec::new(),
            spare_i32: Vec::new(),
            spare_f32: Vec::new(),
            spare_queue: VecDeque::new(),
            closing,
            net,
            waker,
            cfg,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Request>) {
        let now = Instant::now();
        if let Some(b) = self.backend.as_mut() {
            b.expect_round(self.round, self.agg_seq, now);
        }
        loop {
            match rx.try_recv() {
                Ok(req) => self.execute(req),
                Err(mpsc::TryRecvError::Disconnected) => return,
                Err(mpsc::TryRecvError::Empty) => {
                    let now = Instant::now();
                    let next = self.timers(now, &mut None);
                    let until = next
                        .unwrap_or(now + Duration::from_millis(100))
                        .min(now + Duration::from_millis(100));
                    self.wait_and_drain(until, &mut None);
                }
            }
        }
    }

    fn cov(&mut self, n: usize) -> Coverage {
        let mut c = self.spare_cov.pop().unwrap_or_default();
        c.reset(n);
        c
    }

    fn execute(&mut self, req: Request) {
        match req {
            Request::Bcast {
                root,
                data,
                opts,
                reply,
            } => {
                let r = self.broadcast(root, data, opts);
                let _ = reply.send(r);
            }
            Request::Reduce {
                all,
                op,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_i32(all, op, data, opts);
                let _ = reply.send(r);
            }
            Request::ReduceI32In {
                all,
                op,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_i32_in(all, op, data, opts);
                // Last use of `data` was above: the caller may take its slice back.
                let _ = reply.send(r);
            }
            Request::ReduceF32 {
                all,
                mean,
                mut data,
                opts,
                reply,
            } => {
                let r = self.reduce_f32(all, mean, RawF32::of(&mut data), opts);
                let _ = reply.send(r.map(|()| data));
            }
            Request::ReduceF32In {
                all,
                mean,
                data,
                opts,
                reply,
            } => {
                let r = self.reduce_f32(all, mean, data, opts);
                // Last use of `data` was above: the caller may take its slice back.
                let _ = reply.send(r);
            }
        }
    }

    fn deadline(&self, opts: &CallOptions) -> Instant {
        Instant::now() + opts.deadline.unwrap_or(self.cfg.deadline)
    }

    fn new_op(&self, name: &'static str) -> OpState {
        OpState {
            name,
            round: self.round,
            op: Op::Sum,
            rout: false,
            contrib: None,
            bout: None,
            bin: None,
            collect: None,
        }
    }

    fn all_but(&self, i: usize) -> u64 {
        let n = self.cfg.participants();
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        all & !(1u64 << i)
    }

    fn broadcast(
        &mut self,
        root: usize,
        data: Vec<u8>,
        opts: CallOptions,
    ) -> Result<Vec<u8>, CommError> {
        let deadline = self.deadline(&opts);
        let mut st = self.new_op("broadcast");
        let n = fragments(data.len(), self.chunk);
        if root == self.me {
            let mut q = VecDeque::with_capacity(n);
            q.extend(0..n as u32);
            let ovf = self.cov(0);
            st.bout = Some(BcastOut {
                len_bytes: data.len(),
                bytes: data,
                queue: q,
                overflow: ovf,
                dests: self.all_but(self.me),
            });
        } else {
            let cov = self.cov(n);
            st.bin = Some(BcastIn {
                root,
                sink: Sink::Bytes(data),
                cov,
                overflow: false,
                results: false,
            });
        }
        let res = self.run_op(&mut st, deadline, opts);
        let out = st
            .bout
            .take()
            .map(|b| b.bytes)
            .or_else(|| {
                st.bin.take().map(|b| {
                    self.spare_cov.push(b.cov);
                    match b.sink {
                        Sink::Bytes(v) => v,
                        Sink::I32(_) | Sink::F32 { .. } => Vec::new(),
                    }
                })
            })
            .unwrap_or_default();
        self.finish_op(&mut st, res.is_err(), 0);
        res.map(|()| out)
    }

    fn reduce_i32(
        &mut self,
        all: bool,
        op: Op,
        data: Vec<i32>,
        opts: CallOptions,
    ) -> Result<ReduceOutput, CommError> {
        let r = self.reduce(all, op, Src::I32(data), None, opts)?;
        if let Some((values, overflow)) = r.values {
            return Ok(ReduceOutput {
                values,
                has_result: true,
                overflow,
            });
        }
        let c = match r.src {
            Some(Src::I32(v)) => v,
            _ => Vec::new(),
        };
        match r.sink {
            Some((Sink::Bytes(b), overflow)) => {
                let mut v = c;
                proto::read_i32_be(&b, &mut v);
                self.spare_bytes = b;
                Ok(ReduceOutput {
                    values: v,
                    has_result: true,
                    overflow,
                })
            }
            _ => Ok(ReduceOutput {
                values: c,
                has_result: false,
                overflow: false,
            }),
        }
    }

    /// A blocking int reduction on the caller's slice `x` (see [`Raw`]):
    /// a worker encodes its fragments straight from `x`; an allreduce
    /// worker's result fragments and the aggregator's completed fragments
    /// are written straight into `x`. Returns whether the result was
    /// clamped (OVERFLOW; a reduce worker gets `false`).
    fn reduce_i32_in(
        &mut self,
        all: bool,
        op: Op,
        x: RawI32,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        let is_agg = self.cfg.me == Participant::Aggregator;
        let sink = (all && !is_agg).then_some(Sink::I32(x));
        let r = self.reduce(all, op, Src::RawI32(x), sink, opts)?;
        Ok(match (r.values, r.sink) {
            (Some((_, o)), _) | (None, Some((_, o))) => o,
            _ => false,
        })
    }

    /// One reduction round. `src`: a worker's contribution (the aggregator
    /// passes its output vector as `Src::I32`, the caller's slice as
    /// `Src::RawI32`, or `Src::Len`: a reused vector);
    /// `sink`: where a worker's allreduce result goes (default: a reused
    /// byte buffer).
    fn reduce(
        &mut self,
        all: bool,
        op: Op,
        src: Src,
        sink: Option<Sink>,
        opts: CallOptions,
    ) -> Result<Reduced, CommError> {
        let deadline = self.deadline(&opts);
        let mut st = self.new_op(if all { "allreduce" } else { "reduce" });
        let len = src.len();
        let n = fragments(len, self.per);
        let is_agg = self.cfg.me == Participant::Aggregator;
        st.op = op;
        let in_kernel =
            all && self.cfg.backend == BackendKind::Kernel && self.cfg.kernel_result_group;
        let mut src = Some(src);
        // The aggregator's owned result vector (kept, unresized, until the
        // call is over: `Collect::out` points into it).
        let mut owned: Option<Vec<i32>> = None;
        if is_agg {
            let out = match src.take() {
                Some(Src::RawI32(x)) => x,
                Some(Src::I32(v)) => RawI32::of(owned.insert(v)),
                _ => {
                    let mut v = std::mem::take(&mut self.spare_i32);
                    v.clear();
                    v.resize(len, 0);
                    RawI32::of(owned.insert(v))
                }
            };
            if let Some(b) = self.backend.as_mut() {
                let (full, last) = (len / self.per, len % self.per);
                b.reserve(op, self.per, full);
                if last > 0 {
                    b.reserve(op, last, 1);
                }
            }
            let cov = self.cov(n);
            st.collect = Some(Collect {
                out,
                cov,
                overflow: false,
            });
            if in_kernel {
                self.res_tx.set_next_seq(self.agg_seq);
                st.rout = true;
            } else if all {
                let ovf = self.cov(n);
                let mut queue = std::mem::take(&mut self.spare_queue);
                queue.clear();
                st.bout = Some(BcastOut {
                    bytes: Vec::new(),
                    len_bytes: len * 4,
                    queue,
                    overflow: ovf,
                    dests: self.all_but(self.me),
                });
            }
        } else {
            self.agg_tx.set_next_seq(self.agg_seq);
            self.agg_tx.set_window(if in_kernel {
                self.agg_windows.allreduce
            } else {
                self.agg_windows.reduce
            });
            let Some(src) = src.take() else {
                return Err(CommError::Closed);
            };
            st.contrib = Some(Contrib {
                src,
                op,
                next: 0,
                nfrags: n,
                seq_base: self.agg_seq,
            });
            if all {
                let cov = self.cov(n);
                let sink = sink.unwrap_or_else(|| {
                    let mut b = std::mem::take(&mut self.spare_bytes);
                    b.clear();
                    b.resize(len * 4, 0);
                    Sink::Bytes(b)
                });
                st.bin = Some(BcastIn {
                    root: self.cfg.workers() as usize,
                    sink,
                    cov,
                    overflow: false,
                    results: in_kernel,
                });
            }
        }
        let res = self.run_op(&mut st, deadline, opts);
        if let Some(c) = st.contrib.as_ref() {
            self.recent.push_back((st.round, c.seq_base, c.nfrags));
            if self.recent.len() > 8 {
                self.recent.pop_front();
            }
        }
        let values = st.collect.take().map(|c| {
            self.spare_cov.push(c.cov);
            // Empty for the caller's slice (the result is already in it).
            (owned.take().unwrap_or_default(), c.overflow)
        });
        let sink = st.bin.take().map(|b| {
            self.spare_cov.push(b.cov);
            (b.sink, b.overflow)
        });
        if let Some(b) = st.bout.take() {
            self.spare_cov.push(b.overflow);
            self.spare_queue = b.queue;
        }
        let out = Reduced {
            values,
            src: st.contrib.take().map(|c| c.src).or(src),
            sink,
        };
        self.finish_op(&mut st, res.is_err(), n);
        res.map(|()| out)
    }

    /// A float SUM (or mean) reduction through quantization on `x` (see
    /// [`RawF32`]): a worker quantizes each fragment from `x` straight into
    /// its datagram and (allreduce) dequantizes each result fragment straight
    /// into `x`; the aggregator reduces into a reused int32 vector and
    /// dequantizes it into `x`. With `FixedOrAdaptive` the first attempt's
    /// result goes to a reused buffer (the input is needed for a rerun).
    fn reduce_f32(
        &mut self,
        all: bool,
        mean: bool,
        x: RawF32,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        let workers = self.cfg.workers();
        let is_agg = self.cfg.me == Participant::Aggregator;
        let len = x.len;
        let q = self.cfg.quantization;
        let mut scale = match q {
            Quantization::Fixed(s) | Quantization::FixedOrAdaptive(s) => {
                if !(s.is_finite() && s > 0.0) {
                    return Err(CommError::Config(
                        quantize::QuantizeError::BadScale(s).to_string(),
                    ));
                }
                if !is_agg {
                    // SAFETY: no other reference into x lives now.
                    quantize::check_finite(unsafe { x.slice() })
                        .map_err(|e| CommError::Config(e.to_string()))?;
                }
                s
            }
            Quantization::Adaptive => self.agree_scale(x, is_agg, opts)?,
        };
        for attempt in 0..2 {
            let rerun = attempt == 0 && all && matches!(q, Quantization::FixedOrAdaptive(_));
            let div = if mean { scale * workers as f64 } else { scale };
            let mut tmp = (rerun && !is_agg).then(|| {
                let mut o = std::mem::take(&mut self.spare_f32);
                o.clear();
                o.resize(len, 0.0);
                o
            });
            let sink = (all && !is_agg).then(|| Sink::F32 {
                out: tmp.as_deref_mut().map_or(x, RawF32::of),
                div,
            });
            let src = if is_agg {
                Src::Len(len)
            } else {
                Src::F32 { x, scale }
            };
            let r = self.reduce(all, Op::Sum, src, sink, opts)?;
            let (has_result, overflow) = match (&r.values, &r.sink) {
                (Some((_, o)), _) | (None, Some((_, o))) => (true, *o),
                _ => (false, false),
            };
            let values = r.values.map(|(v, _)| v);
            if has_result && overflow {
                if let Some(v) = values {
                    self.spare_i32 = v;
                }
                if let Some(o) = tmp {
                    self.spare_f32 = o;
                }
                // Everyone who got the result knows; for reduce only the
                // aggregator does, so only allreduce can rerun in lockstep.
                if rerun {
                    scale = self.agree_scale(x, is_agg, opts)?;
                    continue;
                }
                return Err(CommError::Overflow {
                    round: self.round.wrapping_sub(1),
                    scale,
                });
            }
            if let Some(v) = values {
                // SAFETY: no other reference into x lives now.
                quantize::dequantize_into(&v, div, unsafe { x.slice_mut() });
                self.spare_i32 = v;
            }
            if let Some(o) = tmp {
                // SAFETY: as above.
                unsafe { x.slice_mut() }.copy_from_slice(&o);
                self.spare_f32 = o;
            }
            return Ok(());
        }
        Err(CommError::Overflow {
            round: self.round.wrapping_sub(1),
            scale,
        })
    }

    /// One-element MAX allreduce of max|x| (as float bits) → the adaptive scale.
    fn agree_scale(
        &mut self,
        x: RawF32,
        is_agg: bool,
        opts: CallOptions,
    ) -> Result<f64, CommError> {
        // SAFETY: no other reference into x lives now.
        let m = if is_agg {
            0.0
        } else {
            quantize::max_abs(unsafe { x.slice() }).map_err(|e| CommError::Config(e.to_string()))?
        };
        let out = self.reduce_i32(true, Op::Max, vec![m.to_bits() as i32], opts)?;
        let agreed = f32::from_bits(out.values.first().copied().unwrap_or(0) as u32);
        Ok(quantize::adaptive_scale(agreed, self.cfg.workers()))
    }

    fn finish_op(&mut self, st: &mut OpState, failed: bool, nfrags: usize) {
        if failed {
            self.agg_tx.forget_all();
            self.bc_tx.forget_all();
            self.res_tx.forget_all();
        }

        for c in [
            st.bin.take().map(|b| b.cov),
            st.collect.take().map(|c| c.cov),
            st.bout.take().map(|b| b.overflow),
        ]
        .into_iter()
        .flatten()
        {
            self.spare_cov.push(c);
        }
        self.round = self.round.wrapping_add(1);
        self.agg_seq = self.agg_seq.wrapping_add(nfrags as u32);
        self.round_pub.store(self.round, Ordering::SeqCst);
        self.agg_seq_pub.store(self.agg_seq, Ordering::SeqCst);
        let now = Instant::now();
        if let Some(b) = self.backend.as_mut() {
            b.expect_round(self.round, self.agg_seq, now);
        }
        let r = self.round;
        let pool = &mut self.stash_pool;
        self.stash.retain_mut(|s| {
            let keep = (s.round.wrapping_sub(r) as i32) >= 0;
            if !keep {
                pool.push(std::mem::take(&mut s.buf));
            }
            keep
        });
    }

    fn run_op(
        &mut self,
        st: &mut OpState,
        deadline: Instant,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        // Data that arrived before the call started.
        let stash = std::mem::take(&mut self.stash);
        let mut keep = Vec::new();
        let mut op = Some(&mut *st);
        for s in stash {
            if s.round == st_round(&op) {
                if let Some(o) = op.as_deref_mut() {
                    self.deliver_bcast(o, s.from, &s.buf);
                }
                self.stash_pool.push(s.buf);
            } else {
                keep.push(s);
            }
        }
        self.stash = keep;
        self.drain_completed(st);
        loop {
            let now = Instant::now();
            self.pump(st, now);
            if self.is_done(st) {
                return Ok(());
            }
            if now >= deadline {
                return Err(self.timeout_error(st, opts));
            }
            if self.closing.load(Ordering::SeqCst) {
                return Err(CommError::Closed);
            }
            let mut op = Some(&mut *st);
            let next = self.timers(now, &mut op);
            let until = next.map_or(deadline, |n| n.min(deadline));
            self.wait_and_drain(until, &mut op);
        }
    }

    fn is_done(&mut self, st: &mut OpState) -> bool {
        if let Some(b) = &st.bin {
            if !b.cov.is_complete() {
                return false;
            }
            if st.contrib.is_some() {
                // allreduce worker: the result proves every contribution arrived.
                self.agg_tx.forget_all();
                return true;
            }
        }
        if let Some(c) = &st.contrib {
            if c.next < c.nfrags || !self.agg_tx.is_idle() {
                return false;
            }
        }
        if let Some(c) = &st.collect {
            if !c.cov.is_complete() {
                return false;
            }
            if st.rout && !self.res_tx.is_idle() {
                return false;
            }
        }
        if let Some(b) = &st.bout {
            let sent_all =
                b.queue.is_empty() && st.collect.as_ref().map_or(true, |c| c.cov.is_complete());
            if !sent_all || !self.bc_tx.is_idle() {
                return false;
            }
        }
        true
    }

    fn timeout_error(&mut self, st: &mut OpState, opts: CallOptions) -> CommError {
        let workers = self.cfg.workers();
        let mut missing: Vec<Peer> = Vec::new();
        let mut missing_known = true;
        let (mut arrived, mut expected) = (0usize, 0usize);
        let mut partial = None;
        let mut what = String::new();
        if let Some(c) = &st.contrib {
            if st.bin.is_none() && (c.next < c.nfrags || !self.agg_tx.is_idle()) {
                missing.push(Peer::Aggregator);
                arrived = c.nfrags - self.agg_tx.in_flight().min(c.nfrags) - (c.nfrags - c.next);
                expected = c.nfrags;
                what = "contribution fragments acknowledged".into();
            }
        }
        if let Some(b) = &st.bin {
            if !b.cov.is_complete() {
                missing.push(index_peer(b.root, workers));
                arrived = b.cov.have();
                expected = b.cov.total();
                what = "fragments received".into();
            }
        }
        if let Some(c) = &st.collect {
            if !c.cov.is_complete() {
                arrived = c.cov.have();
                expected = c.cov.total();
                what = "fragments reduced".into();
                let mut seen_missing = vec![false; workers as usize];
                let mut contributors = vec![workers; c.cov.total()];
                let mut values = if opts.partial {
                    // SAFETY: no `&mut` into c.out lives now.
                    Some(unsafe { c.out.slice() }.to_vec())
                } else {
                    None
                };
                if let Some(be) = self.backend.as_ref() {
                    for i in c.cov.missing() {
                        let off = (i * self.per) as u32;
                        let fs = be.fragment_state(st.round, off);
                        match &fs.contributors {
                            Some(ranks) => {
                                contributors[i] = ranks.len() as u16;
                                for r in 0..workers {
                                    if !ranks.contains(&r) {
                                        seen_missing[r as usize] = true;
                                    }
                                }
                            }
                            None => {
                                missing_known = false;
                                contributors[i] = 0;
                            }
                        }
                        if let Some(v) = values.as_mut() {
                            let range = fragment_range(i, v.len(), self.per);
                            match &fs.partial {
                                Some(p) if p.len() == range.len() => v[range].copy_from_slice(p),
                                _ => v[range].fill(0),
                            }
                        }
                    }
                }
                missing.extend(
                    (0..workers)
                        .filter(|&r| seen_missing[r as usize])
                        .map(Peer::Rank),
                );
                if let Some(values) = values {
                    partial = Some(Partial {
                        values,
                        contributors,
                        per_fragment: self.per,
                    });
                }
            }
        }
        if st.rout && st.collect.as_ref().is_some_and(|c| c.cov.is_complete()) {
            let pend = self.res_tx.unacked_dests();
            missing.extend(
                (0..workers)
                    .filter(|&r| pend & (1 << r) != 0)
                    .map(Peer::Rank),
            );
            let total = st.collect.as_ref().map_or(0, |c| c.cov.total());
            expected = total;
            arrived = total - self.res_tx.in_flight().min(total);
            what = "result fragments acknowledged by every worker".into();
        }
        if let Some(_b) = &st.bout {
            let pend = self.bc_tx.unacked_dests();
            if pend != 0 || st.collect.as_ref().is_some_and(|c| c.cov.is_complete()) {
                for i in 0..self.cfg.participants() {
                    if pend & (1 << i) != 0 {
                        let p = index_peer(i, workers);
                        if !missing.contains(&p) {
                            missing.push(p);
                        }
                    }
                }
                if what.is_empty() {
                    what = "broadcast fragments acknowledged by everyone".into();
                    let total = fragments(st.bout.as_ref().map_or(0, |b| b.len_bytes), self.chunk);
                    expected = total;
                    arrived = total
                        - self.bc_tx.in_flight().min(total)
                        - st.bout.as_ref().map_or(0, |b| b.queue.len()).min(total);
                }
            }
        }
        CommError::Timeout(Box::new(TimeoutInfo {
            op: st.name,
            round: st.round,
            missing,
            missing_known,
            arrived,
            expected,
            what,
            partial,
        }))
    }

    /// Sends new datagrams while the windows allow.
    fn pump(&mut self, st: &mut OpState, now: Instant) {
        let job = self.cfg.job;
        if let Some(c) = st.contrib.as_mut() {
            let rank = match self.cfg.me {
                Participant::Worker(r) => r,
                Participant::Aggregator => abi::RESULT_RANK,
            };
            let target = self.cfg.contrib_target();
            // An allreduce worker stays within half the aggregator's slots
            // of the first result it lacks. Every fragment below that one
            // is complete, so all workers' fragments in flight fit the
            // slots whatever the scheduler does: the socket aggregator
            // acknowledges on arrival, and a worker favoured by it ran ahead
            // of a slow one until the slots were full, then had its windows
            // dropped and resent after timeouts (docs/RUNTIME.md, "Not done").
            let ahead = st.bin.as_ref().map_or(usize::MAX, |b| {
                b.cov.first_missing() + (self.cfg.slots as usize / 2).max(1)
            });
            while c.next < c.nfrags && c.next < ahead && self.agg_tx.can_send() {
                let r = fragment_range(c.next, c.src.len(), self.per);
                let mut hdr = AggHeader {
                    job,
                    rank,
                    seq: 0,
                    round: st.round,
                    frag_off: r.start as u32,
                    op: c.op,
                    flags: if c.next + 1 == c.nfrags {
                        abi::AGG_F_LAST_FRAGMENT
                    } else {
                        0
                    },
                    count: r.len() as u16,
                };
                let src = &c.src;
                let res = self.agg_tx.send(
                    1,
                    now,
                    |seq, buf| {
                        hdr.seq = seq;
                        match src {
                            Src::I32(v) => proto::encode_agg_into(&hdr, &v[r], buf),
                            Src::RawI32(x) => {
                                // Encoded straight from the caller's slice.
                                // SAFETY: as for F32 below.
                                let xs = unsafe { x.slice() };
                                proto::encode_agg_into(&hdr, &xs[r], buf)
                            }
                            Src::F32 { x, scale } => {
                                // Quantized straight into the datagram buffer.
                                // SAFETY: no reference into x lives while this
                                // one does (results land only in fragments
                                // already sent, and not now).
                                let xs = unsafe { x.slice() };
                                let at = buf.len();
                                proto::write_agg_header(&hdr, buf);
                                if quantize::quantize_be_into(&xs[r], *scale, buf) {
                                    // A clamped value: the aggregator carries
                                    // OVERFLOW into the RESULT, so every
                                    // participant fails (Fixed) or reruns
                                    // (FixedOrAdaptive) instead of returning a
                                    // sum of clamped values.
                                    buf[at + proto::AGG_FLAGS_OFF] |= abi::AGG_F_OVERFLOW;
                                }
                                Ok(())
                            }
                            Src::Len(_) => proto::encode_agg_into(&hdr, &[], buf),
                        }
                    },
                    &mut |_, _| {},
                );
                debug_assert!(res.map_or(true, |s| s == c.seq_base.wrapping_add(c.next as u32)));
                if let Ok(seq) = res {
                    self.txq.push((TxWin::Agg, seq, target));
                }
                c.next += 1;
            }
        }
        if let Some(b) = st.bout.as_mut() {
            let addrs = &self.addrs;
            let tc = self.tc.as_ref();
            let txq = &mut self.txq;
            while self.bc_tx.can_send() {
                let Some(&i) = b.queue.front() else { break };
                let i = i as usize;
                let start = i * self.chunk;
                let end = (start + self.chunk).min(b.len_bytes);
                let ovf = if b.overflow.contains(i) {
                    SUBHDR_OVERFLOW
                } else {
                    0
                };
                let (mut mask, group) = match tc {
                    Some(t) => (t.mask(b.dests), t.id),
                    None => ((b.dests & 0xffff_ffff) as u32, job),
                };
                let hdr = BcastHeader {
                    mask,
                    seq: 0,
                    group,
                    flags: 0,
                    hops: 0,
                };
                let round = st.round;
                let (bytes, ints) = match st.collect.as_ref() {
                    // SAFETY: nothing writes into c.out while this lives.
                    Some(c) => (&[][..], Some(&unsafe { c.out.slice() }[start / 4..end / 4])),
                    None => (&b.bytes[start..end], None),
                };
                let mark = txq.len();
                let res = self.bc_tx.send::<()>(
                    b.dests,
                    now,
                    |seq, buf| {
                        let h = BcastHeader { seq, ..hdr };
                        buf.extend_from_slice(&proto::bcast_header_bytes(&h));
                        buf.extend_from_slice(&round.to_be_bytes());
                        buf.extend_from_slice(&((start as u32) | ovf).to_be_bytes());
                        match ints {
                            Some(v) => proto::write_i32_be(v, buf),
                            None => buf.extend_from_slice(bytes),
                        }
                        Ok(())
                    },
                    &mut |d, _| match tc {
                        // One datagram with the full mask (already in its
                        // header) to the first member: the TC program copies it.
                        Some(t) => {
                            if mask != 0 {
                                txq.push((TxWin::Bcast, 0, t.first));
                                mask = 0;
                            }
                        }
                        None => txq.push((TxWin::Bcast, 0, addrs[d])),
                    },
                );
                match res {
                    Ok(seq) => txq[mark..].iter_mut().for_each(|e| e.1 = seq),
                    Err(()) => txq.truncate(mark),
                }
                b.queue.pop_front();
            }
        }
        self.flush_tx();
    }

    /// Sends the new datagrams [`Engine::pump`] registered, in batches
    /// (`sendmmsg`), straight from the send windows' buffers; with UDP GSO
    /// ordered by destination first (stable: each destination keeps its
    /// order), so each destination's datagrams form runs.
    fn flush_tx(&mut self) {
        const NONE: (&[u8], SocketAddrV4) = (&[], SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
        let gso = self.cfg.udp_gso == Some(true);
        if gso {
            self.txq.sort_by_key(|&(_, _, to)| (u32::from(*to.ip()), to.port()));
        }
        let mut msgs = [NONE; BATCH_MAX];
        for chunk in self.txq.chunks(BATCH_MAX) {
            let mut n = 0;
            for &(w, seq, to) in chunk {
                let win = match w {
                    TxWin::Agg => &self.agg_tx,
                    TxWin::Bcast => &self.bc_tx,
                };
                if let Some(b) = win.bytes_of(seq) {
                    msgs[n] = (b, to);
                    n += 1;
                }
            }
            if n > 0 && gso {
                self.net.tx_batch_gso(&msgs[..n]);
            } else if n > 0 {
                self.net.tx_batch(&msgs[..n]);
            }
        }
        self.txq.clear();
    }

    /// The receive trackers' due ACKs (broadcast data, and a worker's
    /// results); returns when the next one is due. Also called between the
    /// batches of a long receive queue: draining thousands of datagrams
    /// takes milliseconds of copying and decoding, longer than the senders'
    /// RTO, and their timeouts fire for what is sitting in this queue while
    /// its ACKs wait for the end of the drain.
    fn receiver_acks(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut merge = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        let sock = &self.net;
        let addrs = &self.addrs;
        let (job, me) = (self.cfg.job, self.me as u16);
        let ackbuf = &mut self.ackbuf;
        for (i, t) in self.bc_rx.iter_mut().enumerate() {
            let id = self.bc_group[i];
            merge(t.poll(now, &mut |bm| {
                send_ack(sock, ackbuf, id, me, AckKind::Broadcast, bm, addrs[i])
            }));
        }
        if let Participant::Worker(_) = self.cfg.me {
            let agg = addrs[self.cfg.workers() as usize];
            merge(self.res_rx.poll(now, &mut |bm| {
                send_ack(sock, ackbuf, job, me, AckKind::Aggregation, bm, agg)
            }));
        }
        next
    }

    /// Retransmission and ACK timers; returns the next due time.
    fn timers(&mut self, now: Instant, _op: &mut Option<&mut OpState>) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut merge = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        let sock = &self.net;
        let target = self.cfg.contrib_target();
        merge(self.agg_tx.poll(now, &mut |_, b| retx_to(sock, target, b)));
        let addrs = &self.addrs;
        let mut tc = self.tc.as_mut();
        merge(self.bc_tx.poll(now, &mut |d, b| match tc.as_deref_mut() {
            Some(t) => {
                let m = t.bit_of[d];
                t.send(sock, b, m, true);
            }
            None => retx_to(sock, addrs[d], b),
        }));
        merge(
            self.res_tx
                .poll(now, &mut |d, b| retx_to(sock, addrs[d], b)),
        );
        merge(self.receiver_acks(now));
        let (sock, job) = (&self.net, self.cfg.job);
        let ackbuf = &mut self.ackbuf;
        if let Some(b) = self.backend.as_mut() {
            let mut io = AckIo {
                sock,
                buf: ackbuf,
                job,
                sent: &mut self.acks_sent,
            };
            merge(b.poll(now, &mut io));
        }
        next
    }

    /// Waits for a datagram (or a new request) until `until`, then handles
    /// everything queued on the socket.
    fn wait_and_drain(&mut self, until: Instant, op: &mut Option<&mut OpState>) {
        let now = Instant::now();
        let wait = until.saturating_duration_since(now);
        let mut fds = [
            libc::pollfd {
                fd: self.net.t.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.waker.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        let nfds = 2;
        // SAFETY: fds and ts are valid for the call.
        unsafe {
            libc::ppoll(fds.as_mut_ptr(), nfds, &ts, std::ptr::null());
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 64];
            while self.waker.recv(&mut b).is_ok() {}
        }
        let mut buf = std::mem::take(&mut self.rxbuf);
        let mut meta = std::mem::take(&mut self.rxmeta);
        let mut drained = 0;
        while drained < 4096 {
            match self.net.t.recv_batch(&mut buf, RECV_SLOT, &mut meta) {
                Ok(0) => break,
                Ok(n) => {
                    self.net.c.recv_batch(n);
                    drained += n;
                    for (k, m) in meta[..n].iter().enumerate() {
                        let d = &buf[k * RECV_SLOT..k * RECV_SLOT + m.len];
                        if let std::net::SocketAddr::V4(from) = m.from {
                            self.net.c.received(d);
                            self.handle(d, from, op);
                        }
                    }
                    if n < meta.len() {
                        break; // the socket is empty
                    }
                    self.receiver_acks(Instant::now());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => break, // e.g. ICMP port unreachable reported on a later recv
            }
        }
        self.rxbuf = buf;
        self.rxmeta = meta;
        if let Some(st) = op.as_deref_mut() {
            self.drain_completed(st);
        }
    }

    fn handle(&mut self, d: &[u8], from: SocketAddrV4, op: &mut Option<&mut OpState>) {
        let now = Instant::now();
        match proto::classify(d) {
            Some(MessageKind::Ack) => {
                let Ok(a) = AckMessage::decode(d) else { return };
                if a.id != self.cfg.job && !self.tc.as_ref().is_some_and(|t| t.id == a.id) {
                    return;
                }
                let sock = &self.net;
                match a.kind {
                    AckKind::Aggregation => {
                        if let Participant::Worker(me) = self.cfg.me {
                            // Contributions are acknowledged by the
                            // aggregator's socket only (the socket
                            // aggregator on `job_port`; the kernel backend's
                            // runtime, on the kernel's behalf, from
                            // `result_port`): a forged ACK would end the
                            // retransmission of a contribution that was lost.
                            if from != self.addrs[self.cfg.workers() as usize] {
                                self.net.c.refused(Refusal::AckFromWrongSource);
                                return;
                            }
                            if a.rank == me {
                                let target = self.cfg.contrib_target();
                                self.agg_tx.on_ack(0, &a.bitmap, now, &mut |_, b| {
                                    retx_to(sock, target, b)
                                });
                            }
                        } else if (a.rank as usize) >= self.cfg.peers.len()
                            || self.addrs[a.rank as usize] != from
                        {
                            self.net.c.refused(Refusal::AckFromWrongSource);
                        } else {
                            // A worker acknowledges results (in-kernel allreduce).
                            let addrs = &self.addrs;
                            self.res_tx
                                .on_ack(a.rank as usize, &a.bitmap, now, &mut |d, b| {
                                    retx_to(sock, addrs[d], b)
                                });
                            let res_tx = &self.res_tx;
                            let bit = 1u64 << a.rank.min(63);
                            for q in a.bitmap.received() {
                                if !res_tx.is_known(q) {
                                    *self.res_early.entry(q).or_default() |= bit;
                                }
                            }
                            if self.res_early.len() > RES_EARLY_LIMIT {
                                // Drop what was registered or retired meanwhile;
                                // if that is not enough, the oldest knowledge
                                // is lost and only costs resends.
                                self.res_early.retain(|q, _| !res_tx.is_known(*q));
                                if self.res_early.len() > RES_EARLY_LIMIT {
                                    self.res_early.clear();
                                }
                            }
                        }
                    }
                    AckKind::Broadcast => {
                        let dest = a.rank as usize;
                        if dest >= self.addrs.len() || self.addrs[dest] != from {
                            self.net.c.refused(Refusal::AckFromWrongSource);
                        } else {
                            let addrs = &self.addrs;
                            let mut tc = self.tc.as_mut();
                            self.bc_tx.on_ack(dest, &a.bitmap, now, &mut |d, b| match tc
                                .as_deref_mut()
                            {
                                Some(t) => {
                                    let m = t.bit_of[d];
                                    t.send(sock, b, m, true);
                                }
                                None => retx_to(sock, addrs[d], b),
                            });
                        }
                    }
                }
            }
            Some(MessageKind::Bcast) => {
                let Ok((h, payload)) = proto::split_bcast(d) else {
                    return;
                };
                if payload.len() < BCAST_SUBHDR {
                    return;
                }
                // Any group id: the source socket identifies the root (a TC
                // root uses its node's group id); ACKs carry the same id.
                let Some(&idx) = self.index.get(&from) else {
                    self.net.c.refused(Refusal::BroadcastFromWrongSource);
                    return;
                };
                if idx == self.me {
                    return;
                }
                self.bc_group[idx] = h.group;
                let round = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let (job, me) = (h.group, self.me as u16);
                let sock = &self.net;
                let ackbuf = &mut self.ackbuf;
                let mut emit =
                    |bm: &SeqBitmap| send_ack(sock, ackbuf, job, me, AckKind::Broadcast, bm, from);
                match self.bc_rx[idx].check(h.seq) {
                    Verdict::Duplicate => {
                        self.net.c.duplicate();
                        self.bc_rx[idx].reack(h.seq, &mut emit)
                    }
                    Verdict::New => {
                        let cur = op.as_ref().map_or(self.round, |o| o.round);
                        let wanted = op.as_ref().is_some_and(|o| {
                            o.round == round && o.bin.as_ref().is_some_and(|b| b.root == idx)
                        });
                        let last;
                        if wanted {
                            let o = op.as_deref_mut().expect("wanted implies an op");
                            last = self.deliver_bcast(o, idx, payload);
                        } else if (round.wrapping_sub(cur) as i32) > 0
                            || (op.is_none() && round == cur)
                        {
                            // Early data of a later call: keep it (and ACK it) if there is room.
                            if self.stash.len() >= self.cfg.stash_limit {
                                return;
                            }
                            let mut b = self.stash_pool.pop().unwrap_or_default();
                            b.clear();
                            b.extend_from_slice(payload);
                            self.stash.push(Stashed {
                                buf: b,
                                from: idx,
                                round,
                            });
                            last = false;
                        } else {
                            last = false; // old or unexpected: acknowledge and drop
                        }
                        let sock = &self.net;
                        let ackbuf = &mut self.ackbuf;
                        let mut emit = |bm: &SeqBitmap| {
                            send_ack(sock, ackbuf, job, me, AckKind::Broadcast, bm, from)
                        };
                        self.bc_rx[idx].record(h.seq, last, now, &mut emit);
                    }
                }
            }
            Some(MessageKind::Agg) => {
                let Ok((h, payload)) = proto::split_agg(d) else {
                    return;
                };
                if h.job != self.cfg.job {
                    return;
                }
                let Some(b) = self.backend.as_mut() else {
                    if h.is_result() {
                        if self.may_send_results(from) {
                            self.on_result(&h, payload, now, op);
                        } else {
                            // Taken, it would become the fragment's value
                            // (the genuine RESULT then a duplicate) and
                            // acknowledge this worker's contribution.
                            self.net.c.refused(Refusal::ResultFromWrongSource);
                        }
                    }
                    return;
                };
                let mut io = AckIo {
                    sock: &self.net,
                    buf: &mut self.ackbuf,
                    job: self.cfg.job,
                    sent: &mut self.acks_sent,
                };
                b.on_agg(&h, payload, from, now, &mut io);
                if h.is_result() {
                    // Take it into the call at once (an in-kernel allreduce
                    // registers it before the workers' ACKs of it arrive).
                    if let Some(st) = op.as_deref_mut() {
                        self.drain_completed(st);
                    }
                }
            }
            None => {}
        }
    }

    /// Worker: whether `from` may send this worker RESULTs: the aggregator's
    /// node, kernel backend only (the socket backend's results are `AGB1`).
    /// The aggregator's runtime resends from `result_port`; the node's TC
    /// copies leave with the node's address and the UDP source port of the
    /// contribution that completed the slot, a worker's data port.
    fn may_send_results(&self, from: SocketAddrV4) -> bool {
        self.cfg.backend == BackendKind::Kernel
            && *from.ip() == self.cfg.aggregator
            && (from.port() == self.cfg.result_port
                || self.cfg.peers.iter().any(|p| p.port() == from.port()))
    }

    /// Places one broadcast fragment (payload after the AGB1 header) into the
    /// receiving call; returns whether it completed the message.
    fn deliver_bcast(&mut self, st: &mut OpState, from: usize, payload: &[u8]) -> bool {
        let Some(b) = st.bin.as_mut() else {
            return false;
        };
        if b.root != from || payload.len() < BCAST_SUBHDR {
            return false;
        }
        let raw = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
        let off = (raw & !SUBHDR_OVERFLOW) as usize;
        let data = &payload[BCAST_SUBHDR..];
        if off % self.chunk != 0 || off + data.len() > b.sink.len_bytes() {
            return false;
        }
        let i = off / self.chunk;
        let expect = fragment_range(i, b.sink.len_bytes(), self.chunk).len();
        if data.len() != expect {
            return false;
        }
        if st.contrib.as_ref().is_some_and(|c| i >= c.next) {
            // A result of a fragment this worker has not sent yet cannot be
            // right (and would overwrite floats not yet quantized).
            return false;
        }
        if b.cov.insert(i) {
            self.net.c.delivered(data.len());
            b.sink.put(off, data);
            b.overflow |= raw & SUBHDR_OVERFLOW != 0;
            if let Some(c) = st.contrib.as_ref() {
                // allreduce: the result of fragment i acknowledges our contribution to it.
                self.agg_tx.ack_seq(0, c.seq_base.wrapping_add(i as u32));
            }
        }
        b.cov.is_complete()
    }

    /// Worker: a RESULT from the aggregator's node (a TC copy of the
    /// in-kernel allreduce, or the aggregator runtime's retransmission).
    /// Fragment i of a reduction is contribution seq `seq_base + i`: the
    /// result acknowledges our contribution and is acknowledged (`AGK1`
    /// kind aggregation, our rank) to the aggregator's runtime under that seq.
    fn on_result(
        &mut self,
        h: &AggHeader,
        payload: &[u8],
        now: Instant,
        op: &mut Option<&mut OpState>,
    ) {
        if h.is_float() || h.frag_off as usize % self.per != 0 {
            return;
        }
        let i = h.frag_off as usize / self.per;
        let me = self.me as u16;
        let (job, agg) = (self.cfg.job, self.addrs[self.cfg.workers() as usize]);
        let current = op
            .as_deref_mut()
            .filter(|o| o.round == h.round && o.contrib.is_some());
        if let Some(o) = current {
            let Some(c) = o.contrib.as_ref() else { return };
            if i >= c.nfrags {
                return;
            }
            let seq = c.seq_base.wrapping_add(i as u32);
            // Whatever the call, the result proves our contribution arrived.
            // (Workers are therefore clocked by the kernel, not by the
            // aggregator runtime: its socket buffer must hold the backlog,
            // see `build`.)
            self.agg_tx.ack_seq(0, seq);
            let Some(b) = o.bin.as_mut().filter(|b| b.results) else {
                return;
            };
            let off = h.frag_off as usize * 4;
            if payload.len() != h.count as usize * 4
                || off + payload.len() > b.sink.len_bytes()
                || i >= c.next
            {
                return;
            }
            // The fragment's coverage, not the ACK tracker, decides whether
            // the data is new: the tracker evicts a group with holes once
            // results run 2 groups ahead (the kernel sends results as fast as
            // contributions complete, unbounded by any window), and then
            // calls the retransmission of such a hole a duplicate. Dropping
            // it would leave the hole forever while the re-ACK tells the
            // aggregator it arrived.
            let fresh = b.cov.insert(i);
            if fresh {
                b.sink.put(off, payload);
                b.overflow |= h.has_overflow();
                self.net.c.delivered(payload.len());
            }
            let sock = &self.net;
            let ackbuf = &mut self.ackbuf;
            let mut emit =
                |bm: &SeqBitmap| send_ack(sock, ackbuf, job, me, AckKind::Aggregation, bm, agg);
            if self.res_rx.check(seq) == Verdict::Duplicate {
                if !fresh {
                    self.net.c.duplicate();
                }
                self.res_rx.reack(seq, &mut emit);
                return;
            }
            let last = b.cov.is_complete();
            self.res_rx.record(seq, last, now, &mut emit);
            return;
        }
        // A late copy or retransmission of a finished reduction's result: our
        // acknowledgement was lost, send it again.
        let Some(&(_, base, n)) = self.recent.iter().find(|r| r.0 == h.round) else {
            return;
        };
        if i >= n {
            return;
        }
        let seq = base.wrapping_add(i as u32);
        let sock = &self.net;
        let ackbuf = &mut self.ackbuf;
        let mut emit =
            |bm: &SeqBitmap| send_ack(sock, ackbuf, job, me, AckKind::Aggregation, bm, agg);
        self.net.c.duplicate();
        if self.res_rx.check(seq) == Verdict::Duplicate {
            self.res_rx.reack(seq, &mut emit);
        } else {
            self.res_rx.record(seq, true, now, &mut emit);
        }
    }

    /// Moves completed fragments of the collecting call into its output
    /// (and, for allreduce, queues them for broadcast).
    fn drain_completed(&mut self, st: &mut OpState) {
        let Some(c) = st.collect.as_mut() else { return };
        let Some(be) = self.backend.as_mut() else {
            return;
        };
        let per = self.per;
        let bout = st.bout.as_mut();
        let mut queue = bout;
        let res_tx = st.rout.then_some(&mut self.res_tx);
        let mut res_tx = res_tx;
        let (job, round, op, seq_base) = (self.cfg.job, st.round, st.op, self.agg_seq);
        let nfrags = c.cov.total();
        let all_workers = (1u64 << self.cfg.peers.len().min(63)) - 1;
        let now = Instant::now();
        let counters = &self.net.c;
        let early = &mut self.res_early;
        be.take_completed(st.round, &mut |done| {
            let off = done.frag_off as usize;
            if off % per != 0 {
                return;
            }
            let i = off / per;
            let range = fragment_range(i, c.out.len, per);
            if range.len() != done.values.len() || !c.cov.insert(i) {
                return;
            }
            // SAFETY: no other reference into c.out lives now.
            let out = unsafe { c.out.slice_mut() };
            out[range].copy_from_slice(done.values);
            c.overflow |= done.overflow;
            counters.delivered(done.values.len() * 4);
            if let Some(w) = res_tx.as_deref_mut() {
                // The kernel already sent this result to every worker; keep it
                // until each acknowledges it (retransmitted by unicast).
                let hdr = AggHeader {
                    job,
                    rank: abi::RESULT_RANK,
                    seq: 0,
                    round,
                    frag_off: done.frag_off,
                    op,
                    flags: abi::AGG_F_RESULT
                        | if i + 1 == nfrags {
                            abi::AGG_F_LAST_FRAGMENT
                        } else {
                            0
                        }
                        | if done.overflow {
                            abi::AGG_F_OVERFLOW
                        } else {
                            0
                        },
                    count: done.values.len() as u16,
                };
                let seq = seq_base.wrapping_add(i as u32);
                let _ = w.send_at(
                    seq,
                    all_workers,
                    now,
                    |seq, buf| proto::encode_agg_into(&AggHeader { seq, ..hdr }, done.values, buf),
                    &mut |_, _| {},
                );
                if let Some(bits) = early.remove(&seq) {
                    w.ack_early_bits(seq, bits);
                }
            }
            if let Some(b) = queue.as_deref_mut() {
                if done.overflow {
                    b.overflow.insert(i);
                }
                b.queue.push_back(i as u32);
            }
        });
    }
}

fn st_round(op: &Option<&mut OpState>) -> u32 {
    op.as_ref().map_or(0, |o| o.round)
}

fn index_peer(i: usize, workers: u16) -> Peer {
    if i < workers as usize {
        Peer::Rank(i as u16)
    } else {
        Peer::Aggregator
    }
}

#[allow(dead_code)]
fn participant_peer(p: Participant) -> Peer {
    p.peer()
}
