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
use super::upstream::{lock, Publish};

/// How often the thread looks whether the job still lives (the ring's end
/// reaches its members within this) and whether the node is stopping.
const LOOK: Duration = Duration::from_millis(100);

/// Proposals of a ring id and port before the run is refused.
pub const PROPOSALS: u32 = 16;

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
#[derive(Debug)]
enum Installed {
    /// Every member serves it, with these fragments.
    All(u32),
    /// A member uses the id or the port: propose another.
    InUse(String),
    /// A member cannot serve it at all.
    Failed(String),
}

/// Installs the proposals in turn while `wanted`: the first that every
/// member serves (id, port, fragment size), `None` once not wanted, or why
/// none could be (a member that cannot serve any, or every proposal in use).
fn first_installed(start: &RingStart, wanted: impl Fn() -> bool, mut install: impl FnMut(u16, u16) -> Installed) -> Result<Option<(u16, u16, u32)>, String> {
    let mut last = String::new();
    for k in 0..PROPOSALS {
        if !wanted() {
            return Ok(None);
        }
        let (ring, port) = proposal(start, k);
        match install(ring, port) {
            Installed::All(frag_elems) => return Ok(Some((ring, port, frag_elems))),
            Installed::InUse(why) => last = why,
            Installed::Failed(why) => return Err(why),
        }
    }
    Err(format!("{PROPOSALS} proposals of an id and a port were in use; the last: {last}"))
}

fn run(start: RingStart, registry: Arc<Mutex<Registry>>, changes: Sender<Change>, stop: Arc<AtomicBool>, publish: Publish) {
    let RingStart { job, incarnation, ref tenant, ref key, ref run, ref members, ref nodes, vector_len, lease_ms, .. } = start;
    let lease = Duration::from_millis(lease_ms);
    let nodes: Vec<SocketAddr> = nodes.clone();
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
            // The members that serve the proposal if this one fails it.
            let mut installed = rank;
            let why = match exchange(*node, tenant, key, &request, lease) {
                Ok(Reply::RingInstalled { frag_elems, .. }) if frag.is_none_or(|f| f == frag_elems) => {
                    frag = Some(frag_elems);
                    continue;
                }
                Ok(Reply::RingInstalled { frag_elems, .. }) => {
                    installed = rank + 1;
                    Installed::Failed(format!(
                        "rank {rank}'s node {node} cuts rings into fragments of {frag_elems} elements, the others' of {}: the nodes of a ring need the same [node] ring_frag_elems",
                        frag.unwrap_or(0)
                    ))
                }
                Ok(Reply::Refused { reason: Refusal::Conflict, message }) => Installed::InUse(format!("rank {rank}'s node {node}: {message}")),
                Ok(Reply::Refused { reason, message }) => {
                    Installed::Failed(format!("rank {rank}'s node {node} refused the run's ring ({}): {message}", reason.name()))
                }
                Ok(other) => Installed::Failed(format!("rank {rank}'s node {node}: unexpected reply to a ring: {other:?}")),
                Err(e) => Installed::Failed(format!("rank {rank}'s node could not be reached for the run's ring: {e}")),
            };
            end_at(ring, &nodes[..installed], "a member refused");
            return why;
        }
        Installed::All(frag.unwrap_or(0))
    };

    let wanted = || !stop.load(Ordering::Relaxed) && lock(&registry).is_live(job, incarnation);
    let ring = match first_installed(&start, wanted, install) {
        Ok(Some((id, port, frag_elems))) => RingGrant { id, port, members: members.clone(), vector_len, frag_elems },
        Ok(None) => return, // the job or the node went meanwhile
        Err(last) => {
            let why = format!("its ring could not be installed: {last}");
            let replies = {
                let mut registry = lock(&registry);
                let replies = registry.ring_failed(job, incarnation, &why);
                publish(&registry);
                replies
            };
            let _ = changes.send(Change { replies });
            return;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn start(job: u16) -> RingStart {
        RingStart {
            job,
            incarnation: 1,
            tenant: "t".into(),
            key: vec![1; 32],
            run: "r".into(),
            members: vec![[10, 0, 0, 1].into(), [10, 0, 0, 2].into()],
            nodes: vec!["10.0.0.1:7471".parse().unwrap(), "10.0.0.2:7471".parse().unwrap()],
            vector_len: 100,
            ring_ids: (0xF000, 0xFFFE),
            ring_ports: (48000, 48999),
            lease_ms: 10_000,
        }
    }

    #[test]
    fn proposals_stay_in_their_ranges_differ_and_start_apart_by_job() {
        let s = start(0xF123);
        let all: Vec<(u16, u16)> = (0..PROPOSALS).map(|k| proposal(&s, k)).collect();
        assert!(all.iter().all(|&(id, port)| (0xF000..=0xFFFE).contains(&id) && (48000..=48999).contains(&port)), "{all:?}");
        let ids: std::collections::BTreeSet<u16> = all.iter().map(|p| p.0).collect();
        let ports: std::collections::BTreeSet<u16> = all.iter().map(|p| p.1).collect();
        assert_eq!((ids.len(), ports.len()), (PROPOSALS as usize, PROPOSALS as usize), "every proposal another id and port");
        assert_ne!(proposal(&start(0xF124), 0), all[0], "another job starts elsewhere");
    }

    #[test]
    fn a_proposal_in_use_is_followed_by_the_next_and_a_failure_stops() {
        let s = start(0xF200);
        let mut tried = Vec::new();
        let got = first_installed(&s, || true, |id, port| {
            tried.push((id, port));
            if tried.len() < 3 { Installed::InUse(format!("port {port} is in use")) } else { Installed::All(362) }
        });
        assert_eq!(got, Ok(Some((proposal(&s, 2).0, proposal(&s, 2).1, 362))));
        assert_eq!(tried, (0..3).map(|k| proposal(&s, k)).collect::<Vec<_>>());
        let mut n = 0;
        let failed = first_installed(&s, || true, |_, _| {
            n += 1;
            Installed::Failed("rank 1's node refused".into())
        });
        assert_eq!((failed, n), (Err("rank 1's node refused".to_string()), 1), "a member that cannot serve stops at once");
        let busy = first_installed(&s, || true, |_, _| Installed::InUse("in use".into())).unwrap_err();
        assert!(busy.starts_with("16 proposals"), "{busy}");
        assert_eq!(first_installed(&s, || false, |_, _| Installed::All(362)), Ok(None), "a job gone meanwhile installs nothing");
    }
}
