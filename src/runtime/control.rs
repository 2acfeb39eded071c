//! Jobs on demand, a worker's side (docs/INTERFACE.md, "Jobs on demand"):
//! [`RunJob::join`] joins this rank's run at a node's control endpoint and
//! returns when the node serves the run's job; the job is renewed in the
//! background for as long as the [`RunJob`] lives, and ended for this rank
//! when it is dropped. [`RunJob::builder`] gives the communicator of the
//! job: nothing of the node's file is needed.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::runtime::comm::{CommunicatorBuilder, Participant};
use crate::runtime::backend::BackendKind;
use crate::runtime::CommError;
use crate::wire::control::{read_frame, write_frame, Envelope, JobGrant, Reply, Request, NONCE_BYTES};

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
    stop: Arc<AtomicBool>,
    /// Renews until stopped, then ends this rank's part: a thread of the
    /// network namespace the join was made in, so that the renewals and
    /// the end reach the node from there whoever drops the RunJob.
    renewer: Option<JoinHandle<Result<(), CommError>>>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn nonce() -> Result<[u8; NONCE_BYTES], CommError> {
    let mut n = [0u8; NONCE_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| CommError::Config(format!("/dev/urandom: {e}")))?;
    Ok(n)
}

/// One request to the node, its reply within `deadline`.
fn call(node: SocketAddr, credential: &Credential, request: &Request, deadline: Duration) -> Result<Reply, CommError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        CommError::Config(format!("control endpoint {node}: {what}: {e}"))
    };
    let mut stream = TcpStream::connect_timeout(&node, deadline).map_err(|e| fail("connect", &e))?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(deadline)).map_err(|e| fail("socket", &e))?;
    let envelope = Envelope::sign(&credential.tenant, &credential.key, nonce()?, now_ms(), request);
    write_frame(&mut stream, &envelope).map_err(|e| fail("send", &e))?;
    let body = read_frame(&mut stream).map_err(|e| fail("no reply", &e))?;
    serde_json::from_slice(&body).map_err(|e| fail("reply", &e))
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
        data: SocketAddrV4,
        vector_len: Option<u32>,
        deadline: Duration,
    ) -> Result<RunJob, CommError> {
        let request = Request::Join { run: run.to_string(), world, rank, data, vector_len };
        let grant = match call(node, &credential, &request, deadline)? {
            Reply::Joined(g) => g,
            Reply::Refused { reason, message } => {
                return Err(CommError::Config(format!("node {node} refused run {run} rank {rank} ({}): {message}", reason.name())))
            }
            other => return Err(CommError::Config(format!("node {node}: unexpected reply to a join: {other:?}"))),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let renewer = {
            let (stop, credential) = (stop.clone(), credential.clone());
            let renew = Request::Renew { job: grant.job, incarnation: grant.incarnation };
            let end = Request::End { job: grant.job, incarnation: grant.incarnation, rank };
            let every = Duration::from_millis((grant.lease_ms / 3).max(100));
            let job = grant.job;
            std::thread::Builder::new()
                .name("aggbox-renew".into())
                .spawn(move || {
                    let mut next = Instant::now() + every;
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(20));
                        if Instant::now() >= next {
                            // A lost renewal is retried at the next tick;
                            // the lease outlives two of them.
                            let _ = call(node, &credential, &renew, every);
                            next = Instant::now() + every;
                        }
                    }
                    match call(node, &credential, &end, Duration::from_secs(5))? {
                        Reply::Ended { .. } => Ok(()),
                        other => Err(CommError::Config(format!("node {node}: end of job {job}: {other:?}"))),
                    }
                })
                .map_err(|e| CommError::Config(format!("starting the renewal thread: {e}")))?
        };
        Ok(RunJob { grant, node, rank, stop, renewer: Some(renewer) })
    }

    /// What the node granted.
    pub fn grant(&self) -> &JobGrant {
        &self.grant
    }

    /// The communicator of this rank for the job: the node's XDP program
    /// reduces, its result service delivers the RESULTs through the job's
    /// result group.
    pub fn builder(&self) -> CommunicatorBuilder {
        let node = match self.node.ip() {
            std::net::IpAddr::V4(a) => a,
            std::net::IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
        };
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
        .backend(BackendKind::Kernel)
    }

    /// Ends this rank's part now (also done on drop); the node removes the
    /// job when every rank has ended.
    pub fn end(mut self) -> Result<(), CommError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), CommError> {
        self.stop.store(true, Ordering::Relaxed);
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
