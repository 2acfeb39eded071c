//! The [`Communicator`]: one participant of a job (a worker rank, or the
//! aggregator's application), and its builder.
//!
//! Every communicator owns one UDP socket, one I/O driver
//! (`runtime::driver`) over its state machine (`runtime::engine`) and one
//! progress thread. Calls run in the order they were issued: a blocking call
//! issued while no other call is queued or running runs on the caller's
//! thread, which takes the driver for the call; the others ([`Work`]
//! handles, stripes, blocking calls behind them) on the progress thread
//! (docs/RUNTIME.md "Who runs a call"). Between calls the progress thread
//! keeps serving the socket: it
//! acknowledges late retransmissions, keeps early data of the next call, and
//! (aggregator) keeps reducing contributions that arrive before the
//! application asks for them. All participants must issue the same sequence
//! of collective calls; each call is one *round*.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::abi::{self, Op, Round};
use crate::config::{Config, ResultConsumer};
use crate::wire::proto::{self, AckMode};
use crate::runtime::backend::BackendKind;
pub use crate::runtime::calls::ReduceOutput;
use crate::runtime::calls::{Calls, Request};
use crate::runtime::driver::{self, random_group_base, Core, Driver, Shared};
// The engine's own types, public here where the builder fills them.
pub use crate::runtime::engine::{CallOptions, CommConfig, Participant, TcGroup};
use crate::runtime::engine::{Engine, RawF32, RawI32};
use crate::runtime::position::{query_position, NodePosition, PositionQueryError};
pub use crate::runtime::kernel::DEFAULT_EARLY_RESULT_BYTES;
use crate::runtime::quantize::Quantization;
use crate::wire::reliability::ReliabilityConfig;
use crate::runtime::transport::{
    CommStats, Counters, ImpairedTransport, Impairment, Net, RefusedStats, Transport, UdpTransport,
};
use crate::runtime::work::Work;
use crate::runtime::api::{float_mean, Collective, Elements, Served};
use crate::runtime::CommError;

/// How long a caller polls for its datagrams, yielding the CPU, before it
/// sleeps ([`CommConfig::caller_spin`]). Yielding gives the CPU to any
/// thread that can run, so a waiting caller holds it only while nothing
/// else wants it; a result that arrives within the spin costs no wake-up,
/// which is most of a small call's latency and a share of every call's
/// (docs/RUNTIME.md "Who runs a call"). 100 µs covers a one-datagram call
/// up to 16 workers on the 2-vCPU testbed; a longer wait sleeps.
pub const DEFAULT_CALLER_SPIN: Duration = Duration::from_micros(100);

/// Builds a [`Communicator`].
#[derive(Debug, Clone)]
pub struct CommunicatorBuilder {
    cfg: CommConfig,
}

/// Binds this participant's socket. A node-served worker's was bound a
/// moment before for its position query and closed: a process forked by
/// another thread meanwhile holds a copy of the descriptor until its exec
/// closes it (close-on-exec), and the address is in use until then, so
/// such a bind is retried for up to 200 ms.
fn bind_data_socket(me: SocketAddr, just_closed: bool) -> io::Result<UdpSocket> {
    let until = Instant::now() + Duration::from_millis(200);
    loop {
        match UdpSocket::bind(me) {
            Err(e) if just_closed && e.kind() == io::ErrorKind::AddrInUse && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5))
            }
            r => return r,
        }
    }
}

impl CommunicatorBuilder {
    /// A job `job` whose workers listen at `peers` (rank r at `peers[r]`),
    /// with the aggregator at `aggregator:job_port`; this participant is `me`.
    /// IPv4 or IPv6 (`SocketAddrV4`s and an `Ipv4Addr` convert), all of one
    /// family (`build` refuses a mix).
    pub fn new<P: Into<SocketAddr>>(
        job: u16,
        peers: impl IntoIterator<Item = P>,
        aggregator: impl Into<IpAddr>,
        job_port: u16,
        me: Participant,
    ) -> CommunicatorBuilder {
        CommunicatorBuilder {
            cfg: CommConfig {
                job,
                peers: peers.into_iter().map(Into::into).collect(),
                me,
                aggregator: aggregator.into(),
                job_port,
                result_port: 0,
                backend: BackendKind::Socket,
                mtu: 0,
                reliability: ReliabilityConfig::default(),
                slots: 1024,
                deadline: Duration::from_secs(10),
                quantization: Quantization::default(),
                first_round: Round(0),
                first_agg_seq: 0,
                ask_node_position: false,
                stash_limit: 4096,
                early_result_bytes: DEFAULT_EARLY_RESULT_BYTES,
                kernel_result_group: false,
                node_served: false,
                tc_group: None,
                impairment: None,
                udp_gso: None,
                caller_runs_calls: true,
                caller_spin: DEFAULT_CALLER_SPIN,
                tree_workers: None,
            },
        }
    }

    /// A worker of a node-served job that is not in any file (a job on
    /// demand, `runtime::control::RunJob`): the workers' data sockets by
    /// rank, the node, its contribution and RESULT ports; RESULTs come
    /// through the job's result group, as for a node-served `[[job]]`,
    /// acknowledged as the node's `ack_mode` and `ack_group` say.
    #[allow(clippy::too_many_arguments)]
    pub fn for_node_served_job<P: Into<SocketAddr>>(
        job_id: u16,
        peers: impl IntoIterator<Item = P>,
        node: impl Into<IpAddr>,
        job_port: u16,
        result_port: u16,
        me: Participant,
        ack_mode: AckMode,
        ack_group: u16,
    ) -> CommunicatorBuilder {
        let mut b = CommunicatorBuilder::new(job_id, peers, node, job_port, me)
            .result_port(result_port)
            .ack_mode(ack_mode)
            .group_size(u32::from(ack_group));
        b.cfg.reliability.window = b.cfg.reliability.window.min(b.cfg.reliability.group_size);
        b.cfg.node_served = true;
        b.cfg.kernel_result_group = true;
        b
    }

    /// The workers of the whole tree when the job is a leaf's of a tree of
    /// nodes (the divisor of a float mean; [`CommConfig::tree_workers`]);
    /// None: the job's own workers.
    pub fn tree_workers(mut self, workers: Option<u16>) -> CommunicatorBuilder {
        self.cfg.tree_workers = workers;
        self
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
        aggregator: impl Into<IpAddr>,
        data_port: u16,
        me: Participant,
    ) -> Result<CommunicatorBuilder, CommError> {
        let job = config
            .job(job_id)
            .ok_or_else(|| CommError::Config(format!("no job {job_id} in the configuration")))?;
        if me == Participant::Aggregator && job.consumer == ResultConsumer::Node {
            // The node's result service holds the job's result port; a
            // second taker would split the RESULTs between the two.
            return Err(CommError::Config(format!(
                "job {job_id} is served by the node (consumer = \"node\"): `aggbox attach` takes its RESULTs, so no aggregator application may; its workers need none"
            )));
        }
        let peers: Vec<SocketAddr> = job
            .workers
            .iter()
            .map(|&a| SocketAddr::new(a, data_port))
            .collect();
        let mut b = CommunicatorBuilder::new(job_id, peers, aggregator, job.port, me)
            .result_port(job.result_port)
            .slots(job.slots)
            .ack_mode(config.node.ack_mode)
            .group_size(config.node.ack_group as u32);
        b.cfg.reliability.window = b.cfg.reliability.window.min(b.cfg.reliability.group_size);
        b.cfg.node_served = job.consumer == ResultConsumer::Node;
        b.cfg.ask_node_position = b.cfg.node_served && matches!(me, Participant::Worker(_));
        b.cfg.tree_workers = job.parent.and_then(|p| p.tree_workers);
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
    pub fn tc_broadcast<M: Into<SocketAddr>>(mut self, id: u16, members: impl IntoIterator<Item = M>) -> Self {
        let members: Vec<SocketAddr> = members.into_iter().map(Into::into).collect();
        self.cfg.tc_group = Some(TcGroup { id, members });
        self
    }
    /// Whether blocking calls may run on the caller's thread (see
    /// [`CommConfig::caller_runs_calls`]).
    pub fn caller_runs_calls(mut self, on: bool) -> Self {
        self.cfg.caller_runs_calls = on;
        self
    }
    /// How long a caller's thread polls before it sleeps (see
    /// [`CommConfig::caller_spin`]).
    pub fn caller_spin(mut self, spin: Duration) -> Self {
        self.cfg.caller_spin = spin;
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
    pub fn resume(mut self, round: Round, agg_seq: u32) -> Self {
        self.cfg.first_round = round;
        self.cfg.first_agg_seq = agg_seq;
        self.cfg.ask_node_position = false;
        self
    }

    /// A worker's [`query_position`] of its job, from its data socket
    /// (`peers[rank]`) to the node's result service (the aggregator address
    /// and the job's `result_port`, as [`CommunicatorBuilder::from_config`]
    /// sets them). Give the answer, agreed among the workers, to
    /// [`CommunicatorBuilder::resume`].
    pub fn node_position(&self, deadline: Duration) -> Result<NodePosition, PositionQueryError> {
        let cfg = self.config();
        let Participant::Worker(rank) = cfg.me else {
            return Err(PositionQueryError::NotAWorker(cfg.job));
        };
        let from = *cfg
            .peers
            .get(usize::from(rank))
            .ok_or(PositionQueryError::NotAWorker(cfg.job))?;
        query_position(
            cfg.job,
            rank,
            from,
            SocketAddr::new(cfg.aggregator, cfg.result_port),
            deadline,
        )
    }

    /// Validates, binds the socket and starts the progress thread. The
    /// socket is bound to this participant's address (a worker's
    /// `peers[rank]`; the aggregator's `aggregator:job_port` for the socket
    /// backend, `aggregator:result_port` for the kernel backend). A worker
    /// of a node-served job built by [`CommunicatorBuilder::from_config`]
    /// without [`CommunicatorBuilder::resume`] first asks the node where its
    /// first call starts, within the deadline, and fails with
    /// [`CommError::Position`] when the node does not answer.
    pub fn build(self) -> Result<Communicator, CommError> {
        if self.cfg.ask_node_position {
            // Every worker of a new run gets the same answer without
            // talking to the others: the node's answer moves only when a
            // round completes, and the new run's first round completes
            // only after every worker has contributed, i.e. after every
            // worker has been built (docs/RUNTIME.md, "A new run on a
            // running node").
            let position = self.node_position(self.cfg.deadline)?;
            return self.resume(position.round, position.agg_seq).build();
        }
        let mut cfg = self.cfg;
        if std::env::var("AGGBOX_CALLER_THREAD").is_ok_and(|v| v == "0") {
            cfg.caller_runs_calls = false;
        }
        if let Ok(v) = std::env::var("AGGBOX_CALLER_SPIN_US") {
            let us: u64 = v.parse().map_err(|_| {
                CommError::Config(format!("AGGBOX_CALLER_SPIN_US={v:?} is not a number of microseconds"))
            })?;
            cfg.caller_spin = Duration::from_micros(us);
        }
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
        if let Some(p) = cfg.peers.iter().find(|p| p.is_ipv6() != cfg.aggregator.is_ipv6()) {
            return Err(CommError::Config(format!(
                "worker {p} and aggregator {}: a job's participants are of one family (IPv4 or IPv6)",
                cfg.aggregator
            )));
        }
        if cfg.mtu < proto::ip_udp_hdr(cfg.is_ipv6()) + abi::AGG_HDR_LEN + 4 {
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
        let sock = bind_data_socket(me, cfg.node_served)
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
        let dgram = proto::ip_udp_hdr(cfg.is_ipv6()) + abi::AGG_HDR_LEN + 4 * cfg.elements_per_fragment();
        let mut rcv = (8usize << 20).max(256 * dgram);
        if cfg.backend == BackendKind::Kernel || cfg.me == Participant::Aggregator {
            rcv = rcv.max(64 << 20);
        }
        crate::netif::set_socket_buffers(&sock, rcv.min(i32::MAX as usize) as i32);
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
        let round = Arc::new(AtomicU32::new(cfg.first_round.0));
        let agg_seq = Arc::new(AtomicU32::new(cfg.first_agg_seq));
        let closing = Arc::new(AtomicBool::new(false));
        let engine = Engine::new(
            cfg.clone(),
            counters.clone(),
            random_group_base(cfg.reliability.group_size),
            Instant::now(),
        );
        let shared = Shared {
            closing: closing.clone(),
            round: round.clone(),
            agg_seq: agg_seq.clone(),
        };
        let core = Arc::new(Core::new(Driver::new(engine, net, waker_rx, shared, cfg.caller_spin)?));
        let bg = core.clone();
        let thread = std::thread::Builder::new()
            .name(format!("aggbox-{}-{:?}", cfg.job, cfg.me))
            .spawn(move || driver::run(bg, rx))?;
        Ok(Communicator {
            cfg,
            core,
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



/// The path MTU of a communicator with `cfg.mtu == 0`: the smallest route
/// MTU to the aggregator and every other participant (1500 when none of
/// them has a route).
fn discover_mtu(cfg: &CommConfig) -> usize {
    let me = match cfg.me {
        Participant::Worker(r) => {
            Some(cfg.peers[(r as usize).min(cfg.peers.len().saturating_sub(1))].ip())
        }
        Participant::Aggregator => None,
    };
    let others = std::iter::once(cfg.aggregator)
        .chain(cfg.peers.iter().map(|p| p.ip()))
        .filter(|a| Some(*a) != me || *a == cfg.aggregator);
    crate::runtime::pmtu::min_path_mtu(others).unwrap_or(1500)
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
    core: Arc<Core>,
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
    pub fn builder<P: Into<SocketAddr>>(
        job: u16,
        peers: impl IntoIterator<Item = P>,
        aggregator: impl Into<IpAddr>,
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
    pub fn position(&self) -> (Round, u32) {
        (
            Round(self.round.load(Ordering::SeqCst)),
            self.agg_seq.load(Ordering::SeqCst),
        )
    }

    fn submit(&self, req: Request) -> Result<(), CommError> {
        self.core.queued.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(req).is_err() {
            self.core.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(CommError::Closed);
        }
        let _ = self.waker.send(&[1]);
        Ok(())
    }

    /// Runs a blocking call on this thread when no other call is queued or
    /// running (see `runtime::driver`); `None`: it must be queued.
    fn run_here<T>(
        &self,
        call: impl FnOnce(&mut Driver) -> Result<T, CommError>,
    ) -> Option<Result<T, CommError>> {
        if !self.cfg.caller_runs_calls {
            return None;
        }
        self.core.run_here(&self.waker, call)
    }

    fn root_index(&self, root: Participant) -> Result<usize, CommError> {
        if root == Participant::Aggregator && self.config().node_served {
            return Err(CommError::Config(format!(
                "job {} is served by the node: there is no aggregator participant to broadcast from",
                self.config().job
            )));
        }
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

    /// A blocking broadcast of `data` (on this thread when nothing else is
    /// in flight).
    pub(crate) fn broadcast_vec(
        &self,
        data: Vec<u8>,
        root: Participant,
        opts: CallOptions,
    ) -> Result<Vec<u8>, CommError> {
        let root_index = self.root_index(root)?;
        let mut data = Some(data);
        if let Some(r) =
            self.run_here(|d| d.broadcast(root_index, data.take().unwrap_or_default(), opts))
        {
            return r;
        }
        self.ibroadcast(data.take().unwrap_or_default(), root, opts)
            .wait()
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

    /// Zero-copy int reduction on `buf` (see [`Raw`]): a worker encodes each
    /// fragment straight from `buf` into its datagram; results (an allreduce
    /// worker's as they arrive, the aggregator's as fragments complete) are
    /// written straight into `buf`; after the first call of a size nothing
    /// of the vector's size is allocated per call. On an error `buf` may
    /// hold part of the result.
    pub(crate) fn reduce_i32_in(
        &self,
        buf: &mut [i32],
        all: bool,
        op: Op,
        opts: CallOptions,
    ) -> Result<bool, CommError> {
        let data = RawI32::of(buf);
        if let Some(r) = self.run_here(|d| d.reduce_i32_in(all, op, data, opts)) {
            return r;
        }
        // The engine uses `buf` until it replies (or drops the request);
        // `buf` stays borrowed here until then.
        self.start_reduce_i32(data, all, op, opts)?
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

    /// Float SUM (or mean) through quantization (see
    /// [`crate::runtime::quantize`]), zero-copy: a worker's floats are
    /// quantized straight from `buf` into datagram buffers and the result is
    /// dequantized straight into `buf` as its fragments arrive; after the
    /// first call of a size nothing is allocated per call (docs/RUNTIME.md).
    /// An adaptive allreduce of up to
    /// [`crate::runtime::quantize::ONE_ROUND_MAX_LEN`] elements goes through
    /// a reused int32 vector instead, and takes one round when every worker
    /// guessed the agreed scale. `mean` divides by the number of workers (of
    /// the whole tree for a tree's leaf job: [`CommConfig::tree_workers`]).
    pub(crate) fn reduce_f32_in(
        &self,
        buf: &mut [f32],
        all: bool,
        mean: bool,
        opts: CallOptions,
    ) -> Result<(), CommError> {
        let data = RawF32::of(buf);
        if let Some(r) = self.run_here(|d| d.reduce_f32(all, mean, data, opts)) {
            return r;
        }
        // The engine uses `buf` until it replies (or drops the request);
        // `buf` stays borrowed here until then.
        self.start_reduce_f32(data, all, mean, opts)?
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

/// The star: every call through this job's aggregator.
impl Collective for Communicator {
    fn participant(&self) -> Participant {
        Communicator::participant(self)
    }

    fn workers(&self) -> u16 {
        Communicator::workers(self)
    }

    fn stats(&self) -> CommStats {
        Communicator::stats(self)
    }

    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.reduce_elements_in(data, true, op, opts)
    }

    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.reduce_elements_in(data, false, op, opts)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        let out = self.broadcast_vec(buf.to_vec(), root, opts)?;
        buf.copy_from_slice(&out);
        Ok(Served::star(false))
    }
}

impl Communicator {
    /// An int32 reduction (exact, zero-copy) or a float32 one (quantized).
    fn reduce_elements_in(&self, data: Elements<'_>, all: bool, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        match data {
            Elements::I32(buf) => self.reduce_i32_in(buf, all, op, opts).map(Served::star),
            Elements::F32(buf) => {
                let mean = float_mean(op)?;
                self.reduce_f32_in(buf, all, mean, opts).map(|()| Served::star(false))
            }
        }
    }
}
