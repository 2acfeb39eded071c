//! Jobs on demand, a worker's side (docs/INTERFACE.md, "Jobs on demand"):
//! [`RunJob::join`] joins this rank's run at a node's control endpoint and
//! returns when the node serves the run's job; the job is renewed in the
//! background for as long as the [`RunJob`] lives, and ended for this rank
//! when it is dropped. [`RunJob::builder`] gives the communicator of the
//! job: nothing of the node's file is needed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::runtime::api::{Collective, Elements, Served};
use crate::runtime::comm::{CallOptions, Communicator, CommunicatorBuilder, Participant};
use crate::runtime::striped::StripedCommunicator;
use crate::runtime::transport::CommStats;
use crate::runtime::backend::BackendKind;
use crate::runtime::{CommError, RingCommunicator, StarOrRing};
use crate::wire::abi::Op;
use crate::wire::control::{exchange, JobGrant, Reply, Request};
pub use crate::wire::control::{JobShape, RingGrant, TreeParent};

/// Environment variables of [`Credential::from_env`].
pub const ENV_TENANT: &str = "AGGBOX_TENANT";
pub const ENV_KEY: &str = "AGGBOX_KEY";

/// A credential the node's operator issued: a tenant of its key file and
/// that tenant's key.
#[derive(Clone)]
pub struct Credential {
    pub tenant: String,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Credential").field("tenant", &self.tenant).finish()
    }
}

impl Credential {
    /// `tenant` and its key as the key file writes it (hex).
    pub fn from_hex(tenant: &str, key: &str) -> Result<Credential, CommError> {
        let key = hex::decode(key.trim()).map_err(|e| CommError::Config(format!("tenant {tenant}'s key: not hex: {e}")))?;
        Ok(Credential { tenant: tenant.to_string(), key })
    }

    /// `AGGBOX_TENANT` and `AGGBOX_KEY` (hex).
    pub fn from_env() -> Result<Credential, CommError> {
        let tenant = std::env::var(ENV_TENANT)
            .map_err(|_| CommError::Config(format!("{ENV_TENANT} is not set: the tenant of the node's key file")))?;
        let key = std::env::var(ENV_KEY)
            .map_err(|_| CommError::Config(format!("{ENV_KEY} is not set: tenant {tenant}'s key, hex")))?;
        Credential::from_hex(&tenant, &key)
    }
}

/// This rank's part of a run's job (see the module docs).
#[derive(Debug)]
pub struct RunJob {
    grant: JobGrant,
    node: SocketAddr,
    rank: u16,
    /// Why the node no longer serves the job, once a renewal says so (see
    /// [`RunJob::lost`]).
    lost: Arc<Mutex<Option<String>>>,
    /// Dropped to wake the renewer at once when the rank ends.
    waker: Option<std::sync::mpsc::Sender<()>>,
    /// Renews until stopped, then ends this rank's part: a thread of the
    /// network namespace the join was made in, so that the renewals and
    /// the end reach the node from there whoever drops the RunJob.
    renewer: Option<JoinHandle<Result<(), CommError>>>,
}

/// One request to the node, its reply within `deadline`.
fn call(node: SocketAddr, credential: &Credential, request: &Request, deadline: Duration) -> Result<Reply, CommError> {
    exchange(node, &credential.tenant, &credential.key, request, deadline).map_err(CommError::Config)
}

impl RunJob {
    /// Joins rank `rank` of a run of `world` ranks under the key `run` at
    /// the control endpoint `node`, this rank's data socket `data`; returns
    /// once every rank joined and the node serves the job, or fails with
    /// the node's refusal or when nothing came within `deadline`.
    pub fn join(
        node: SocketAddr,
        credential: Credential,
        run: &str,
        world: u16,
        rank: u16,
        data: impl Into<SocketAddr>,
        vector_len: Option<u32>,
        deadline: Duration,
    ) -> Result<RunJob, CommError> {
        RunJob::join_shaped(node, credential, run, world, rank, data, JobShape { vector_len, ..JobShape::default() }, deadline)
    }

    /// [`RunJob::join`] asking the node for the job's `shape`: its vector
    /// length bound, window and fragment size (every rank the same).
    #[allow(clippy::too_many_arguments)]
    pub fn join_shaped(
        node: SocketAddr,
        credential: Credential,
        run: &str,
        world: u16,
        rank: u16,
        data: impl Into<SocketAddr>,
        shape: JobShape,
        deadline: Duration,
    ) -> Result<RunJob, CommError> {
        let data = data.into();
        let JobShape { vector_len, window, frag_elems, parent, ring } = shape;
        let request = Request::Join { run: run.to_string(), world, rank, data, vector_len, window, frag_elems, parent, ring };
        let grant = match call(node, &credential, &request, deadline)? {
            Reply::Joined(g) => g,
            Reply::Refused { reason, message } => {
                return Err(CommError::Config(format!("node {node} refused run {run} rank {rank} ({}): {message}", reason.name())))
            }
            other => return Err(CommError::Config(format!("node {node}: unexpected reply to a join: {other:?}"))),
        };
        let lost: Arc<Mutex<Option<String>>> = Arc::default();
        let (waker, wake) = std::sync::mpsc::channel::<()>();
        let renewer = {
            let (credential, lost) = (credential.clone(), lost.clone());
            let renew = Request::Renew { job: grant.job, incarnation: grant.incarnation };
            let end = Request::End { job: grant.job, incarnation: grant.incarnation, rank };
            let every = Duration::from_millis((grant.lease_ms / 3).max(100));
            let lease = Duration::from_millis(grant.lease_ms);
            let (job, incarnation) = (grant.job, grant.incarnation);
            std::thread::Builder::new()
                .name("aggbox-renew".into())
                .spawn(move || {
                    let mut next = Instant::now() + every;
                    let mut renewed = Instant::now();
                    let mut gone = None;
                    loop {
                        // Woken by end() or drop at once (the sender goes),
                        // else at the next renewal.
                        match wake.recv_timeout(next.saturating_duration_since(Instant::now())) {
                            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                            _ => break,
                        }
                        if gone.is_some() {
                            next = Instant::now() + lease;
                            continue;
                        }
                        // A lost renewal is retried at the next tick; the
                        // lease outlives two of them. A refusal is final: a
                        // node that restarted, or that expired or revoked
                        // the job, serves it no more.
                        gone = match call(node, &credential, &renew, every) {
                            Ok(Reply::Renewed { .. }) => {
                                renewed = Instant::now();
                                None
                            }
                            Ok(Reply::Refused { reason, message }) => Some(format!(
                                "node {node} no longer serves job {job} (incarnation {incarnation}): renewal refused ({}): {message}; \
                                 it restarted, or the lease ran out: join the run again",
                                reason.name()
                            )),
                            _ if renewed.elapsed() > lease => Some(format!(
                                "node {node} did not renew job {job} (incarnation {incarnation}) for {:.1} s, more than its lease: \
                                 the node is down or unreachable from this rank",
                                renewed.elapsed().as_secs_f64()
                            )),
                            _ => None,
                        };
                        if let Some(why) = &gone {
                            *lost.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
                        }
                        next = Instant::now() + every;
                    }
                    if gone.is_some() {
                        return Ok(()); // nothing left to end
                    }
                    match call(node, &credential, &end, Duration::from_secs(5))? {
                        Reply::Ended { .. } => Ok(()),
                        other => Err(CommError::Config(format!("node {node}: end of job {job}: {other:?}"))),
                    }
                })
                .map_err(|e| CommError::Config(format!("starting the renewal thread: {e}")))?
        };
        Ok(RunJob { grant, node, rank, waker: Some(waker), lost, renewer: Some(renewer) })
    }

    /// What the node granted.
    pub fn grant(&self) -> &JobGrant {
        &self.grant
    }

    /// The control endpoint of the node that serves the job.
    pub fn node(&self) -> SocketAddr {
        self.node
    }

    /// Why the node no longer serves the job (its renewal was refused, or
    /// it could not be renewed for a lease), `None` while it does.
    pub fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// This rank's communicator of the run's ring (the run asked for one:
    /// [`JobShape::ring`]), on its own node, whose `aggbox attach` pinned
    /// its maps in `pin_dir` (`node::pin_dir(pin_root, iface)`); open it in
    /// the node's network namespace. The ring lives as long as the job.
    pub fn ring(&self, pin_dir: &std::path::Path) -> Result<RingCommunicator, CommError> {
        let ring = self.grant.ring.as_ref().ok_or_else(|| {
            CommError::Config(format!("node {}: job {} has no ring: join with JobShape::ring naming this rank's own node", self.node, self.grant.job))
        })?;
        RingCommunicator::open_granted(ring, pin_dir)
    }

    /// The communicator of this rank for the job, built by `configure`
    /// from [`RunJob::builder`], with the run: see [`RunCommunicator`].
    pub fn communicator(
        self,
        configure: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder,
    ) -> Result<RunCommunicator, CommError> {
        RunCommunicator::from_runs(vec![self], configure)
    }

    /// The communicator of this rank for the job: the node's XDP program
    /// reduces, its result service delivers the RESULTs through the job's
    /// result group.
    pub fn builder(&self) -> CommunicatorBuilder {
        let node = self.node.ip();
        CommunicatorBuilder::for_node_served_job(
            self.grant.job,
            self.grant.workers.clone(),
            node,
            self.grant.port,
            self.grant.result_port,
            Participant::Worker(self.rank),
            self.grant.ack_mode,
            self.grant.ack_group,
        )
        .tree_workers(self.grant.tree_workers)
        .backend(BackendKind::Kernel)
    }

    /// Ends this rank's part now (also done on drop); the node removes the
    /// job when every rank has ended.
    pub fn end(mut self) -> Result<(), CommError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), CommError> {
        drop(self.waker.take());
        match self.renewer.take() {
            Some(t) => t.join().unwrap_or_else(|_| Err(CommError::Config("the renewal thread panicked".into()))),
            None => Ok(()),
        }
    }
}

impl Drop for RunJob {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The data socket of stripe `t` of a rank whose data socket is `data`:
/// the same address, its port plus `t` ([`RunCommunicator::join`]).
pub fn stripe_socket(data: SocketAddr, t: usize) -> Result<SocketAddr, CommError> {
    let port = u16::try_from(data.port() as usize + t)
        .map_err(|_| CommError::Config(format!("data port {} + stripe {t} is past 65535", data.port())))?;
    Ok(SocketAddr::new(data.ip(), port))
}

/// A rank's communicator of a run's job on demand, or of its jobs at
/// several nodes, one stripe each ([`RunCommunicator::join`]), with the
/// runs that hold them: each job is renewed while it lives and ended for
/// this rank when it is dropped (after the communicators have stopped:
/// field order). A call made once a node no longer serves its job (it
/// restarted, or the lease ran out) fails at once with
/// [`CommError::JobLost`], and a call that failed meanwhile (its deadline
/// passed) fails with it too, naming the node and why: join the run again
/// for a new job.
#[derive(Debug)]
pub struct RunCommunicator {
    comm: StripedCommunicator,
    runs: Vec<RunJob>,
}

impl RunCommunicator {
    /// Joins the run at every node of `nodes` (in that order; every rank
    /// must give the same nodes in the same order) and stripes each vector
    /// over their jobs, stripe `t` at `nodes[t]` through this rank's data
    /// socket `data` with its port plus `t` (docs/INTERFACE.md, "Jobs on
    /// demand"). `configure` sets the rest of each stripe's builder.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        nodes: &[SocketAddr],
        credential: Credential,
        run: &str,
        world: u16,
        rank: u16,
        data: impl Into<SocketAddr>,
        vector_len: Option<u32>,
        deadline: Duration,
        configure: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder,
    ) -> Result<RunCommunicator, CommError> {
        if nodes.is_empty() {
            return Err(CommError::Config("a run needs the control endpoint of at least one node".into()));
        }
        let data = data.into();
        let mut runs = Vec::with_capacity(nodes.len());
        for (t, node) in nodes.iter().enumerate() {
            let stripe = stripe_socket(data, t)?;
            runs.push(RunJob::join(*node, credential.clone(), run, world, rank, stripe, vector_len, deadline)?);
        }
        RunCommunicator::from_runs(runs, configure)
    }

    /// The communicator of runs this rank joined already, stripe `t`
    /// through `runs[t]` (joined with the data socket [`stripe_socket`]`(data,
    /// t)`, as [`RunCommunicator::join`] joins them): for a caller that
    /// holds its data ports until the communicators bind them.
    pub fn from_runs(
        runs: Vec<RunJob>,
        configure: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder,
    ) -> Result<RunCommunicator, CommError> {
        let stripes = runs.iter().map(|r| configure(r.builder()).build()).collect::<Result<Vec<_>, _>>()?;
        Ok(RunCommunicator { comm: StripedCommunicator::new(stripes)?, runs })
    }

    /// This communicator and the run's ring ([`RunJob::ring`] of the run at
    /// the first node, on this rank's own node whose pins are in
    /// `pin_dir`) as one collective that picks the star or the ring by
    /// size ([`StarOrRing`]); open it in the node's network namespace.
    pub fn with_ring(self, pin_dir: &std::path::Path) -> Result<StarOrRing<RunCommunicator>, CommError> {
        let mut ring = self.runs[0].ring(pin_dir)?;
        let config = self.communicator().config();
        ring.set_deadline(config.deadline);
        ring.set_quantization(config.quantization);
        let mtu = config.mtu;
        StarOrRing::of(Some(self), Some(ring), Some(mtu))
    }

    /// The first stripe's communicator (the only one of a run at one node).
    pub fn communicator(&self) -> &Communicator {
        &self.comm.stripes()[0]
    }

    /// Every stripe's communicator.
    pub fn striped(&self) -> &StripedCommunicator {
        &self.comm
    }

    /// The run at the first node.
    pub fn run(&self) -> &RunJob {
        &self.runs[0]
    }

    /// The run at each node, in stripe order.
    pub fn runs(&self) -> &[RunJob] {
        &self.runs
    }

    /// Ends this rank's part of every job now (also done on drop), after
    /// stopping the communicators; the first failure is returned.
    pub fn end(self) -> Result<(), CommError> {
        let RunCommunicator { comm, runs } = self;
        drop(comm);
        let mut first = Ok(());
        for run in runs {
            if let Err(e) = run.end() {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn served<T>(&self, call: impl FnOnce(&StripedCommunicator) -> Result<T, CommError>) -> Result<T, CommError> {
        if let Some(why) = self.lost() {
            return Err(CommError::JobLost(why));
        }
        call(&self.comm).map_err(|e| match self.lost() {
            Some(why) => CommError::JobLost(format!("{why} (the call failed: {e})")),
            None => e,
        })
    }
}

impl Collective for RunCommunicator {
    fn participant(&self) -> Participant {
        Collective::participant(&self.comm)
    }
    fn workers(&self) -> u16 {
        Collective::workers(&self.comm)
    }
    fn stats(&self) -> CommStats {
        Collective::stats(&self.comm)
    }
    fn lost(&self) -> Option<String> {
        self.runs.iter().find_map(|r| r.lost())
    }
    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.served(|c| c.allreduce_elements(data, op, opts))
    }
    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.served(|c| c.reduce_elements(data, op, opts))
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        self.served(|c| c.broadcast_bytes(buf, root, opts))
    }
}
