//! Jobs on demand (docs/INTERFACE.md, "Jobs on demand"): the credentials a
//! run proves ([`keys`]) and the jobs runs create, renew and end
//! ([`registry`], without I/O). The messages are `wire::control` (AGC1).
//!
//! `aggbox attach` serves the endpoint ([`server`]) when `[node] keys`
//! names a key file, and applies [`with_dynamic_jobs`] of its file and the
//! registry as a reload does.

pub mod keys;
pub mod published;
pub mod registry;
pub mod ring;
pub mod server;
pub mod upstream;

pub use keys::{Keys, Tenant};
pub use published::{DynamicJobRecord, PublishedJobs, RingRecord, TreeRecord};
pub use registry::{Limits, LiveJob, Registry};

use crate::config::Config;

/// The node's configuration with the registry's live jobs and the rings it
/// serves for runs added: what its kernel state is made from. Refused when
/// the file uses what a live dynamic job or ring holds (a file reloaded
/// with an id, port or group the registry handed out or accepted).
pub fn with_dynamic_jobs(file: &Config, registry: &Registry) -> Result<Config, String> {
    let (jobs, groups) = registry.desired();
    let mut config = file.clone();
    for j in jobs {
        if let Some(f) = file.jobs.iter().find(|f| f.id == j.id || [f.port, f.result_port].iter().any(|p| [j.port, j.result_port].contains(p))) {
            return Err(format!("the file's job {} takes the id or a port of live dynamic job {}", f.id, j.id));
        }
        config.jobs.push(j);
    }
    for g in groups {
        if file.groups.iter().any(|f| f.id == g.id) {
            return Err(format!("the file's group {} is live dynamic job's group", g.id));
        }
        config.groups.push(g);
    }
    for r in registry.desired_rings() {
        let ports = file.jobs.iter().flat_map(|j| [j.port, j.result_port]).chain(file.rings.iter().map(|f| f.port));
        if file.rings.iter().any(|f| f.id == r.id) || ports.into_iter().any(|p| p == r.port) {
            return Err(format!("the file takes the id or the port of ring {} that a run on demand holds", r.id));
        }
        config.rings.push(r);
    }
    Ok(config)
}
