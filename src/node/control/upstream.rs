//! A leaf node's side of a tree on demand (docs/INTERFACE.md, "Trees on
//! demand"): once a leaf's ranks have all joined, the leaf joins the tree's
//! root as one rank of the root's run, renews the root's job for as long as
//! its own lives, and ends it there when its own ends. One thread per
//! leaf job; every request is AGC1 over a connection of its own
//! (`wire::control::exchange`), signed with the run's tenant's key from
//! this node's key file (the nodes of a tree share their tenants).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::wire::control::{exchange, exchange_from, JobGrant, Reply, Request};

use super::registry::{Registry, UpstreamOutcome, UpstreamStart};
use super::server::{now_ms, Change};

/// How often the thread looks whether the leaf's job still lives (its end
/// reaches the root within this) and whether the node is stopping.
const LOOK: Duration = Duration::from_millis(100);

/// Shows the registry to `aggbox status` after the thread changed it.
pub type Publish = Box<dyn Fn(&Registry) + Send>;

/// Starts the thread of leaf job `start`.
pub fn spawn(start: UpstreamStart, registry: Arc<Mutex<Registry>>, changes: Sender<Change>, stop: Arc<AtomicBool>, publish: Publish) {
    let job = start.job;
    let spawned = std::thread::Builder::new()
        .name("aggbox-upstream".into())
        .spawn(move || run(start, registry, changes, stop, publish));
    if let Err(e) = spawned {
        eprintln!("aggbox: control: cannot start the upstream thread of leaf job {job}: {e}");
    }
}

pub(super) fn lock(registry: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(start: UpstreamStart, registry: Arc<Mutex<Registry>>, changes: Sender<Change>, stop: Arc<AtomicBool>, publish: Publish) {
    let UpstreamStart { job, incarnation, ref tenant, ref key, ref run, parent, result_port, shape, lease_ms } = start;
    let lease = Duration::from_millis(lease_ms);
    let root = parent.node;
    // The other leaves may join the root up to a lease later.
    let joined = exchange_from(
        root,
        tenant,
        key,
        |local| {
            Ok(Request::Join {
                run: run.clone(),
                world: parent.leaves,
                rank: parent.leaf,
                data: SocketAddr::new(local.ip(), result_port),
                vector_len: shape.vector_len,
                window: shape.window,
                frag_elems: shape.frag_elems,
                parent: None,
                ring: None,
            })
        },
        lease,
    );
    let grant: JobGrant = match joined {
        Ok((Reply::Joined(g), _)) => g,
        failed => {
            let why = match failed {
                Ok((Reply::Refused { reason, message }, _)) => {
                    format!("the tree's root node {root} refused leaf {} ({}): {message}", parent.leaf, reason.name())
                }
                Ok((other, _)) => format!("the tree's root node {root}: unexpected reply to a join: {other:?}"),
                Err(e) => format!("the tree's root node could not be joined: {e}"),
            };
            let replies = {
                let mut registry = lock(&registry);
                let replies = registry.upstream_failed(job, incarnation, &why);
                publish(&registry);
                replies
            };
            let _ = changes.send(Change { replies });
            return;
        }
    };
    let end_root = |why: &str| {
        let end = Request::End { job: grant.job, incarnation: grant.incarnation, rank: parent.leaf };
        if let Err(e) = exchange(root, tenant, key, &end, Duration::from_secs(5)) {
            eprintln!("aggbox: control: leaf job {job} ({why}): ending root job {} at {root}: {e}", grant.job);
        }
    };
    let outcome = {
        let mut registry = lock(&registry);
        let outcome = registry.upstream_joined(now_ms(), job, incarnation, parent.node.ip(), grant.clone());
        publish(&registry);
        outcome
    };
    match outcome {
        UpstreamOutcome::Serving(replies) => {
            if changes.send(Change { replies }).is_err() {
                return;
            }
        }
        UpstreamOutcome::Refused(replies) => {
            let _ = changes.send(Change { replies });
            return end_root("refused");
        }
        UpstreamOutcome::Gone => return end_root("ended while joining"),
    }

    // Renew at the root while the leaf's job lives; end it there after.
    let every = Duration::from_millis((lease_ms / 3).max(100));
    let renew = Request::Renew { job: grant.job, incarnation: grant.incarnation };
    let (mut next, mut renewed) = (Instant::now() + every, Instant::now());
    loop {
        std::thread::sleep(LOOK);
        if stop.load(Ordering::Relaxed) {
            return; // the node stops: its jobs go with it
        }
        if !lock(&registry).is_live(job, incarnation) {
            return end_root("ended");
        }
        if Instant::now() < next {
            continue;
        }
        next = Instant::now() + every;
        let lost = match exchange(root, tenant, key, &renew, every) {
            Ok(Reply::Renewed { .. }) => {
                renewed = Instant::now();
                None
            }
            Ok(Reply::Refused { reason, message }) => Some(format!("renewal refused ({}): {message}", reason.name())),
            // A lost renewal is retried; the lease outlives two of them.
            _ if renewed.elapsed() > lease => Some(format!("not renewed for {:.1} s", renewed.elapsed().as_secs_f64())),
            _ => None,
        };
        if let Some(why) = lost {
            eprintln!("aggbox: control: leaf job {job}: the tree's root node {root} no longer serves root job {}: {why}; the leaf's job is removed", grant.job);
            let mut registry = lock(&registry);
            if registry.upstream_lost(job, incarnation) {
                publish(&registry);
                let _ = changes.send(Change { replies: Vec::new() });
            }
            return;
        }
    }
}
