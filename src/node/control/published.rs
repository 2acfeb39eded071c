//! The live jobs on demand as `aggbox status` reads them: the attach
//! process owns the [`Registry`], so it publishes each live job's owner,
//! incarnation and lease into a pinned hash map (`control_jobs`, beside
//! the attach record; removed with the other pins on detach) that any
//! process can read back; the rings it serves for runs on demand too
//! (keys [`RING_KEYS`] + the ring id).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use serde::{Deserialize, Serialize};

use super::Registry;

/// Pin name of the map.
pub const PIN: &str = "control_jobs";
/// Where the keys of the rings on demand start (a job's key is its id).
pub const RING_KEYS: u32 = 0x1_0000;
/// Room for one job's JSON record (tenant and run names are bounded by the
/// AGC1 frame, not here: a longer record is cut to its owner's name).
const VALUE_SIZE: u32 = 1024;

/// One live job on demand, as published.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DynamicJobRecord {
    /// The tenant (credential name) that owns it.
    pub tenant: String,
    /// The run key its ranks joined with.
    pub run: String,
    /// Which start of that run it serves (1, 2, ...).
    pub incarnation: u64,
    /// Ranks in the run.
    pub workers: u16,
    /// Ranks that have ended their part.
    pub ended: Vec<u16>,
    /// When it was created, ms since the Unix epoch (the node's clock).
    pub created_ms: u64,
    /// When its lease was last renewed, ms since the Unix epoch.
    pub renewed_ms: u64,
    /// When it is removed unless renewed, ms since the Unix epoch.
    pub expires_ms: u64,
    /// A leaf's job of a tree on demand: its place in the tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeRecord>,
    /// The ring granted with the job (a run with a ring on demand), served
    /// by its ranks' own nodes; none while it is being installed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring: Option<u16>,
}

/// A ring this node serves for a run of another node's (docs/INTERFACE.md,
/// "Rings on demand"), as published.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RingRecord {
    /// The tenant and run it belongs to.
    pub tenant: String,
    pub run: String,
    /// Members of the ring.
    pub members: u16,
    /// Created, last renewed and removed unless renewed, ms since the Unix
    /// epoch (the node's clock).
    pub created_ms: u64,
    pub renewed_ms: u64,
    pub expires_ms: u64,
}

/// Where a leaf's job on demand sends its partial results.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TreeRecord {
    /// The root node's control endpoint.
    pub root: String,
    /// This leaf's rank at the root, of `leaves`.
    pub leaf: u16,
    pub leaves: u16,
    /// The root's job over the leaves; none while the leaf waits for it.
    pub root_job: Option<u16>,
}

/// The map, created and pinned by the attach process.
pub struct PublishedJobs {
    map: MapHandle,
    published: Vec<u32>,
}

impl std::fmt::Debug for PublishedJobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishedJobs").field("published", &self.published).finish()
    }
}

impl PublishedJobs {
    /// Creates the map for at most `capacity` live jobs and pins it under
    /// `dir` (replacing a pin a crashed attach left behind).
    pub fn create(dir: &Path, capacity: u32) -> Result<PublishedJobs> {
        // SAFETY: zeroed opts with sz set are what libbpf expects.
        let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
        let mut map = MapHandle::create(libbpf_rs::MapType::Hash, Some("aggbox_ctl_jobs"), 4, VALUE_SIZE, capacity.max(1), &opts)
            .context("aggbox: creating the control_jobs map")?;
        let path = dir.join(PIN);
        let _ = std::fs::remove_file(&path);
        map.pin(&path).with_context(|| format!("aggbox: pinning {}", path.display()))?;
        Ok(PublishedJobs { map, published: Vec::new() })
    }

    /// Writes the registry's live jobs and deletes the entries of jobs
    /// that are gone.
    pub fn publish(&mut self, registry: &Registry) -> Result<()> {
        let lease = registry.limits().lease_ms;
        let mut now = Vec::with_capacity(registry.live().len());
        for (id, job) in registry.live() {
            let record = DynamicJobRecord {
                tenant: job.tenant.clone(),
                run: job.run.clone(),
                incarnation: job.grant.incarnation,
                workers: job.grant.workers.len() as u16,
                ended: job.ended.iter().copied().collect(),
                created_ms: job.created_ms,
                renewed_ms: job.expires_ms.saturating_sub(lease).max(job.created_ms),
                expires_ms: job.expires_ms,
                tree: job.upstream.as_ref().map(|u| TreeRecord {
                    root: u.parent.node.to_string(),
                    leaf: u.parent.leaf,
                    leaves: u.parent.leaves,
                    root_job: u.root.as_ref().map(|(_, g)| g.job),
                }),
                ring: job.grant.ring.as_ref().map(|r| r.id),
            };
            self.map.update(&u32::from(*id).to_ne_bytes(), &value_of(&record)?, MapFlags::ANY).context("aggbox: writing control_jobs")?;
            now.push(u32::from(*id));
        }
        for (id, ring) in registry.rings() {
            let record = RingRecord {
                tenant: ring.tenant.chars().take(64).collect(),
                run: ring.run.chars().take(256).collect(),
                members: ring.config.members.len() as u16,
                created_ms: ring.created_ms,
                renewed_ms: ring.expires_ms.saturating_sub(lease).max(ring.created_ms),
                expires_ms: ring.expires_ms,
            };
            let mut json = serde_json::to_vec(&record)?;
            json.resize(VALUE_SIZE as usize, 0);
            let key = RING_KEYS + u32::from(*id);
            self.map.update(&key.to_ne_bytes(), &json, MapFlags::ANY).context("aggbox: writing control_jobs")?;
            now.push(key);
        }
        for gone in self.published.iter().filter(|id| !now.contains(id)) {
            let _ = self.map.delete(&gone.to_ne_bytes());
        }
        self.published = now;
        Ok(())
    }
}

/// A record as the map's value: JSON, NUL-padded; a record too long for
/// the value keeps its owner and lease and cuts the run key.
fn value_of(record: &DynamicJobRecord) -> Result<Vec<u8>> {
    let mut json = serde_json::to_vec(record)?;
    if json.len() >= VALUE_SIZE as usize {
        let mut short = record.clone();
        short.run = short.run.chars().take(64).collect::<String>() + "…";
        short.tenant = short.tenant.chars().take(64).collect();
        json = serde_json::to_vec(&short)?;
        if json.len() >= VALUE_SIZE as usize {
            bail!("aggbox: control_jobs record of {} bytes", json.len());
        }
    }
    json.resize(VALUE_SIZE as usize, 0);
    Ok(json)
}

/// The published jobs under `dir` by job id; empty when the node serves no
/// jobs on demand (no pin).
pub fn read(dir: &Path) -> BTreeMap<u16, DynamicJobRecord> {
    read_keys(dir, 0)
}

/// The published rings on demand under `dir` by ring id.
pub fn read_rings(dir: &Path) -> BTreeMap<u16, RingRecord> {
    read_keys(dir, RING_KEYS)
}

/// The records whose keys are `base` + a u16 id.
fn read_keys<T: serde::de::DeserializeOwned>(dir: &Path, base: u32) -> BTreeMap<u16, T> {
    let mut out = BTreeMap::new();
    let Ok(map) = MapHandle::from_pinned_path(dir.join(PIN)) else {
        return out;
    };
    for key in map.keys() {
        let Ok(Some(raw)) = map.lookup(&key, MapFlags::ANY) else { continue };
        let Ok(key) = <[u8; 4]>::try_from(key.as_slice()).map(u32::from_ne_bytes) else { continue };
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        let id = key.checked_sub(base).and_then(|id| u16::try_from(id).ok());
        if let (Some(id), Ok(record)) = (id, serde_json::from_slice(&raw[..end])) {
            out.insert(id, record);
        }
    }
    out
}
