//! A run's ring on demand (docs/INTERFACE.md, "Rings on demand"): once the
//! ranks of a run that asked for a ring have all joined, the node that
//! serves the run's job installs the ring at every rank's own node
//! ([`Request::RingInstall`]), proposing its id and port and proposing
//! others while a member node refuses them as in use, answers the ranks
//! only when every member serves it, renews it there for as long as the
//! job lives and ends it there when the job ends. One thread per such
//! job; every request is AGC1 over a connection of its own, signed with
//! the run's tenant's key from this node's key file (the ring's nodes
//! share their tenants, as a tree's do).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::wire::control::{exchange, Refusal, Reply, Request, RingGrant};

use super::registry::{Registry, RingStart};
use super::server::{now_ms, Change};

/// How often the thread looks whether the job still lives (the ring's end
/// reaches its members within this) and whether the node is stopping.
const LOOK: Duration = Duration::from_millis(100);

/// Proposals of a ring id and port before the run is refused.
pub const PROPOSALS: u32 = 16;

/// Shows the registry to `aggbox status` after the thread changed it.
pub type Publish = Box<dyn Fn(&Registry) + Send>;

/// Starts the thread of job `start`'s ring.
pub fn spawn(start: RingStart, registry: Arc<Mutex<Registry>>, changes: Sender<Change>, stop: Arc<AtomicBool>, publish: Publish) {
    let job = start.job;
    let spawned = std::thread::Builder::new()
        .name("aggbox-ring-od".into())
        .spawn(move || run(start, registry, changes, stop, publish));
    if let Err(e) = spawned {
        eprintln!("aggbox: control: cannot start the ring thread of job {job}: {e}");
    }
}

fn lock(registry: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// Proposal `k` of job `job`'s ring id and port: spread over the ranges by
/// the job id, so that the runs of one node start apart.
pub fn proposal(start: &RingStart, k: u32) -> (u16, u16) {
    let pick = |(lo, hi): (u16, u16), stride: u32| {
        let span = u32::from(hi) - u32::from(lo) + 1;
        lo + ((u32::from(start.job) * 7 + k * stride) % span) as u16
    };
    (pick(start.ring_ids, 1), pick(start.ring_ports, 37))
}

/// What installing one proposal at every member gave.
enum Installed {
    /// Every member serves it, with these fragments.
    All(u32),
    /// A member uses the id or the port: propose another.
    InUse(String),
    /// A member cannot serve it at all.
    Failed(String),
}

fn run(start: RingStart, registry: Arc<Mutex<Registry>>, changes: Sender<Change>, stop: Arc<AtomicBool>, publish: Publish) {
    let RingStart { job, incarnation, ref tenant, ref key, ref run, ref members, ref nodes, vector_len, lease_ms, .. } = start;
    let lease = Duration::from_millis(lease_ms);
    let nodes: Vec<SocketAddr> = nodes.iter().map(|n| SocketAddr::V4(*n)).collect();
    let end_at = |ring: u16, at: &[SocketAddr], why: &str| {
        for node in at {
            let end = Request::RingEnd { run: run.clone(), ring };
            if let Err(e) = exchange(*node, tenant, key, &end, Duration::from_secs(5)) {
                eprintln!("aggbox: control: job {job} ({why}): ending ring {ring} at {node}: {e}");
            }
        }
    };
    let install = |ring: u16, port: u16| -> Installed {
        let request = Request::RingInstall { run: run.clone(), ring, port, members: members.clone(), vector_len };
        let mut frag = None;
        for (rank, node) in nodes.iter().enumerate() {
            let why = match exchange(*node, tenant, key, &request, lease) {
                Ok(Reply::RingInstalled { frag_elems, .. }) if frag.is_none_or(|f| f == frag_elems) => {
                    frag = Some(frag_elems);
                    continue;
                }
                Ok(Reply::RingInstalled { frag_elems, .. }) => Installed::Failed(format!(
                    "rank {rank}'s node {node} cuts rings into fragments of {frag_elems} elements, the others' of {}: the nodes of a ring need the same [node] ring_frag_elems",
                    frag.unwrap_or(0)
                )),
                Ok(Reply::Refused { reason: Refusal::Conflict, message }) => Installed::InUse(format!("rank {rank}'s node {node}: {message}")),
                Ok(Reply::Refused { reason, message }) => {
                    Installed::Failed(format!("rank {rank}'s node {node} refused the run's ring ({}): {message}", reason.name()))
                }
                Ok(other) => Installed::Failed(format!("rank {rank}'s node {node}: unexpected reply to a ring: {other:?}")),
                Err(e) => Installed::Failed(format!("rank {rank}'s node could not be reached for the run's ring: {e}")),
            };
            end_at(ring, &nodes[..rank], "a member refused");
            return why;
        }
        Installed::All(frag.unwrap_or(0))
    };

    let mut granted = None;
    let mut last = String::new();
    for k in 0..PROPOSALS {
        if stop.load(Ordering::Relaxed) || !lock(&registry).is_live(job, incarnation) {
            return;
        }
        let (ring, port) = proposal(&start, k);
        match install(ring, port) {
            Installed::All(frag_elems) => {
                granted = Some(RingGrant { id: ring, port, members: members.clone(), vector_len, frag_elems });
                break;
            }
            Installed::InUse(why) => last = why,
            Installed::Failed(why) => {
                last = why;
                break;
            }
        }
    }
    let Some(ring) = granted else {
        let why = format!("its ring could not be installed: {last}");
        let replies = {
            let mut registry = lock(&registry);
            let replies = registry.ring_failed(job, incarnation, &why);
            publish(&registry);
            replies
        };
        let _ = changes.send(Change { replies });
        return;
    };
    let replies = {
        let mut registry = lock(&registry);
        let replies = registry.ring_ready(now_ms(), job, incarnation, ring.clone());
        publish(&registry);
        replies
    };
    if replies.is_empty() {
        return end_at(ring.id, &nodes, "ended while installing");
    }
    if changes.send(Change { replies }).is_err() {
        return;
    }

    // Renew at every member while the job lives; end it there after.
    let every = Duration::from_millis((lease_ms / 3).max(100));
    let renew = Request::RingRenew { run: run.clone(), ring: ring.id };
    let mut renewed = vec![Instant::now(); nodes.len()];
    let mut next = Instant::now() + every;
    loop {
        std::thread::sleep(LOOK);
        if stop.load(Ordering::Relaxed) {
            return; // the node stops: the members' leases run out
        }
        if !lock(&registry).is_live(job, incarnation) {
            return end_at(ring.id, &nodes, "ended");
        }
        if Instant::now() < next {
            continue;
        }
        next = Instant::now() + every;
        let mut lost = None;
        for (rank, node) in nodes.iter().enumerate() {
            match exchange(*node, tenant, key, &renew, every) {
                Ok(Reply::Renewed { .. }) => renewed[rank] = Instant::now(),
                Ok(Reply::Refused { reason, message }) => {
                    lost = Some(format!("rank {rank}'s node {node} refused to renew ring {} ({}): {message}", ring.id, reason.name()))
                }
                // A lost renewal is retried; the lease outlives two of them.
                _ if renewed[rank].elapsed() > lease => {
                    lost = Some(format!("rank {rank}'s node {node} did not renew ring {} for {:.1} s", ring.id, renewed[rank].elapsed().as_secs_f64()))
                }
                _ => {}
            }
        }
        if let Some(why) = lost {
            eprintln!("aggbox: control: job {job}: {why}; the job is removed");
            end_at(ring.id, &nodes, "a member lost its ring");
            let mut registry = lock(&registry);
            if registry.ring_lost(job, incarnation) {
                publish(&registry);
                let _ = changes.send(Change { replies: Vec::new() });
            }
            return;
        }
    }
}
