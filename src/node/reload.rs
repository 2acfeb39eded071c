//! Reloading a running node's configuration (SIGHUP to `aggbox attach`, or
//! `aggbox reload IFACE`): the `[[job]]`s, `[[group]]`s and `[[ring]]`s of
//! the new file replace the old ones while the programs stay attached, so
//! that adding, changing or removing one job or ring does not disturb
//! another's calls.
//!
//! - A job whose settings are the same keeps everything: its kernel slots
//!   and counters, its user-space slots, its routes and, when the node
//!   serves it, its result service's window. Nothing of it is rewritten.
//! - A removed job is removed as `XdpPlane::remove_job` does (its datagrams
//!   are `unknown_job` from then on), with its routes, user-space slots and
//!   result service; a new job starts from nothing.
//! - A changed job is rewritten in place (`XdpPlane::set_job` keeps its
//!   kernel state when the membership is the same); its user-space slots and
//!   result service start afresh.
//! - `[[ring]]`s are placed in the ring memory reserved at attach
//!   (`RingPool::place`, docs/RING.md "Configuration"): a ring whose table
//!   is the same keeps its place, its entries and its service untouched; a
//!   removed ring's service stops and its entries go; a new or changed
//!   ring is written (its region cleared) at the place the pool gives it
//!   and its service starts.
//!
//! Everything that can be refused is checked before anything changes: a
//! file that does not parse (`Config::load` names file, line and key), a
//! changed `[node]` section (named key by key: those settings are the
//! attach's, a restart applies them), a config that needs what this attach
//! did not set up (TC programs, XDP on `lo`), a result port another process
//! holds, rings that do not fit the ring memory (named with the elements
//! asked and free) or have another `frag_elems`, a ring port another
//! process holds. A refused reload changes nothing; the outcome of every reload is
//! kept in the attach record, where `aggbox reload` reads it.
//!
//! The kernel's side of a reload is the difference between two
//! [`KernelState`] values (src/node/desired.rs), written and, if the kernel
//! refuses a write, undone there.

use std::fmt;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};

use super::desired::{self, KernelState};
use super::{check_local_members, local_workers, ring, serve, Attachment, LOOPBACK};
use crate::config::{Config, NodeConfig};

/// What a reload changed, by job and group id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadSummary {
    /// Jobs that are new.
    pub added: Vec<u16>,
    /// Jobs whose settings changed.
    pub changed: Vec<u16>,
    /// Jobs that are gone.
    pub removed: Vec<u16>,
    /// Jobs left exactly as they were.
    pub unchanged: Vec<u16>,
    /// Groups added, changed or removed.
    pub groups: Vec<u16>,
    /// Rings that are new.
    #[serde(default)]
    pub rings_added: Vec<u16>,
    /// Rings whose table changed (a new place when resized: applications
    /// open them again).
    #[serde(default)]
    pub rings_changed: Vec<u16>,
    /// Rings that are gone.
    #[serde(default)]
    pub rings_removed: Vec<u16>,
}

impl fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids = |v: &[u16]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.iter().map(|id| id.to_string()).collect::<Vec<_>>().join(", ")
            }
        };
        write!(
            f,
            "jobs added: {}; changed: {}; removed: {}; unchanged: {}; groups rewritten: {}",
            ids(&self.added),
            ids(&self.changed),
            ids(&self.removed),
            ids(&self.unchanged),
            ids(&self.groups)
        )?;
        if !(self.rings_added.is_empty() && self.rings_changed.is_empty() && self.rings_removed.is_empty()) {
            write!(
                f,
                "; rings added: {}; changed: {}; removed: {}",
                ids(&self.rings_added),
                ids(&self.rings_changed),
                ids(&self.rings_removed)
            )?;
        }
        Ok(())
    }
}

/// The outcome of the last reload, in the attach record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadRecord {
    /// Seconds since the epoch.
    pub at: u64,
    /// Whether it was applied (false: refused, or failed part way).
    pub ok: bool,
    /// What it changed, or why not.
    pub message: String,
}

/// The attach record holds at most this much of a reload's message.
const MESSAGE_MAX: usize = 1024;

/// The `[node]` keys whose values differ between `old` and `new`.
fn node_keys_changed(old: &NodeConfig, new: &NodeConfig) -> Vec<&'static str> {
    let mut keys = Vec::new();
    if old.metrics != new.metrics {
        keys.push("metrics");
    }
    if old.ack_mode != new.ack_mode {
        keys.push("ack_mode");
    }
    if old.ack_group != new.ack_group {
        keys.push("ack_group");
    }
    if old.userspace_path != new.userspace_path {
        keys.push("userspace_path");
    }
    if old.userspace_slot_bytes != new.userspace_slot_bytes {
        keys.push("userspace_slot_bytes");
    }
    if old.control != new.control {
        keys.push("control");
    }
    if old.keys != new.keys {
        keys.push("keys");
    }
    if old.ring_pool != new.ring_pool {
        keys.push("ring_pool");
    }
    if old.ring_frag_elems != new.ring_frag_elems {
        keys.push("ring_frag_elems");
    }
    keys
}

/// Whether `config` needs the TC programs (as `attach` decides): a node
/// with a control endpoint does too, for the result groups of the jobs runs
/// will bring.
pub(super) fn needs_tc(config: &Config) -> bool {
    !config.groups.is_empty()
        || config.jobs.iter().any(|j| j.result_group.is_some() || j.parent.is_some())
        || config.node.keys.is_some()
}

/// The job and group differences between `old` and `new`.
fn diff(old: &Config, new: &Config) -> ReloadSummary {
    let mut s = ReloadSummary::default();
    for j in &new.jobs {
        match old.job(j.id) {
            None => s.added.push(j.id),
            Some(o) if o != j => s.changed.push(j.id),
            Some(_) => s.unchanged.push(j.id),
        }
    }
    s.removed = old.jobs.iter().map(|j| j.id).filter(|&id| new.job(id).is_none()).collect();
    for g in &new.groups {
        if old.group(g.id) != Some(g) {
            s.groups.push(g.id);
        }
    }
    s.groups.extend(old.groups.iter().map(|g| g.id).filter(|&id| new.group(id).is_none()));
    for r in &new.rings {
        match old.ring(r.id) {
            None => s.rings_added.push(r.id),
            Some(o) if o != r => s.rings_changed.push(r.id),
            Some(_) => {}
        }
    }
    s.rings_removed = old.rings.iter().map(|r| r.id).filter(|&id| new.ring(id).is_none()).collect();
    s
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Attachment {
    /// Replace the running jobs and groups with those of `new` (see the
    /// module docs); `config_path` is where `new` was read. The outcome is
    /// also written to the attach record.
    pub fn reload(&mut self, new: &Config, config_path: Option<&Path>) -> Result<ReloadSummary> {
        let origin = config_path.map_or_else(|| "the configuration".to_string(), |p| p.display().to_string());
        let result = self.apply_reload(new, &origin);
        if result.is_ok() {
            self.record.jobs = new.jobs.iter().map(|j| j.id).collect();
            self.record.config = config_path.map(|p| p.display().to_string());
        }
        let message = match &result {
            Ok(summary) => summary.to_string(),
            Err(e) => format!("{e:#}"),
        };
        self.note_reload(result.is_ok(), message)?;
        result
    }

    /// Applies the jobs on demand: `new` is the file's configuration with
    /// the control endpoint's live jobs (`node::control::with_dynamic_jobs`),
    /// applied as a reload applies a file, but neither counted as an
    /// operator's reload nor changing the recorded file. Its `rings` are
    /// applied alike: a ring added to `new` is placed in the ring pool
    /// ([`Attachment::ring_pool`]), written and served.
    pub fn apply_jobs(&mut self, new: &Config) -> Result<ReloadSummary> {
        let summary = self.apply_reload(new, "the jobs on demand")?;
        self.record.jobs = new.jobs.iter().map(|j| j.id).collect();
        super::update_record(&self.dir, &self.record)?;
        Ok(summary)
    }

    /// Record a reload that was refused before it reached
    /// [`Attachment::reload`] (the file did not load).
    pub fn refuse_reload(&mut self, error: &anyhow::Error) -> Result<()> {
        self.note_reload(false, format!("{error:#}"))
    }

    fn note_reload(&mut self, ok: bool, mut message: String) -> Result<()> {
        if message.len() > MESSAGE_MAX {
            let mut end = MESSAGE_MAX;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        self.record.reloads += 1;
        self.record.last_reload = Some(ReloadRecord { at: now_secs(), ok, message });
        super::update_record(&self.dir, &self.record)
    }

    /// The ring memory reserved at attach and the rings placed in it (what
    /// a ring added now would find free: `RingPool::place` answers before
    /// anything changes).
    pub fn ring_pool(&self) -> &crate::kernel::xdp::RingPool {
        &self.ring_pool
    }

    /// `new` applied (see the module docs); `origin` names where it came
    /// from in a refusal (the file, or the jobs on demand).
    fn apply_reload(&mut self, new: &Config, origin: &str) -> Result<ReloadSummary> {
        let old = self.config.clone();
        // Checks: nothing changes until all pass.
        let keys = node_keys_changed(&old.node, &new.node);
        if !keys.is_empty() {
            bail!(
                "[node] {} changed: these are the attach's settings, restart `aggbox attach` to apply them; nothing was changed",
                keys.join(", ")
            );
        }
        let summary = diff(&old, new);
        if needs_tc(new) && self.tc.is_none() {
            bail!(
                "the new config has groups, a result_group or a parent, but this attach has no TC programs (its config needed none): restart `aggbox attach` to apply it; nothing was changed"
            );
        }
        if self.tc.is_some() {
            check_local_members(new)?;
        }
        if self.lo_link.is_none() && self.record.iface != LOOPBACK {
            if let Some((job, rank, addr)) = local_workers(new)?.first().copied() {
                bail!(
                    "job {job} rank {rank} ({addr}) is on this host, but this attach has no XDP program on {LOOPBACK} (no worker was local): restart `aggbox attach` to apply it; nothing was changed"
                );
            }
        }
        let iface_mtu = crate::netif::interface_mtu(&self.record.iface)
            .map_err(|e| anyhow!("reading the MTU of {}: {e}; nothing was changed", self.record.iface))?;
        let node_addrs = crate::netif::interface_addrs(&self.record.iface)
            .map_err(|e| anyhow!("reading the addresses of {}: {e}; nothing was changed", self.record.iface))?;
        // The rings in the memory reserved at attach: those that stay keep
        // their place, new and resized ones take free regions, or the
        // reload is refused with the numbers.
        let ring_pool = self.ring_pool.place(&new.rings).map_err(|e| anyhow!("{origin}: {e}; nothing was changed"))?;
        let ring_jobs = super::ring_jobs(new, &self.record.iface, &node_addrs, &ring_pool)
            .map_err(|e| anyhow!("{origin}: {e:#}; nothing was changed"))?;
        let kernel = KernelState::of(new, iface_mtu, &ring_jobs).map_err(|e| anyhow!("{origin}: {e:#}; nothing was changed"))?;
        kernel.check().map_err(|e| anyhow!("{e}; nothing was changed"))?;
        let ring_services = ring::RingServiceChange::between(self.rings.as_ref(), &self.kernel, &kernel)
            .map_err(|e| anyhow!("{e:#}; nothing was changed"))?;
        let served = serve::ServedChange::bind_change(&old, new, node_addrs).map_err(|e| anyhow!("{e:#}; nothing was changed"))?;

        // Apply. The kernel's maps move from the state in force to the new
        // one in one place (src/node/desired.rs), which undoes its own
        // writes if the kernel refuses one; the user-space path is then set
        // back to the old config too.
        let reset: Vec<u16> = summary.removed.iter().chain(&summary.changed).copied().collect();
        if let Some(userspace) = &mut self.userspace {
            userspace.reconfigure(new, &reset)?;
        }
        // The services of the rings that go stop before their entries do
        // (nothing of theirs may write a region a new ring is given), and
        // the new rings' start once their entries are written.
        let stopped = ring_services.stop(self.rings.as_ref());
        let mut planes = desired::Planes {
            xdp: &self.xdp,
            tc: self.tc.as_ref(),
        };
        if let Err(e) = desired::apply(&mut planes, &self.kernel, &kernel) {
            if let Some(userspace) = &mut self.userspace {
                let _ = userspace.reconfigure(&old, &reset);
            }
            let _ = ring::RingServiceChange::undo(self.rings.as_ref(), stopped);
            return Err(e.context("the kernel refused a write; the node's maps were set back to the old config"));
        }
        // Only the destinations this change adds: the others were resolved
        // when they came, and their entries live on as the traffic uses them.
        let known = self.kernel.next_hops();
        let hops: Vec<_> = kernel.next_hops().into_iter().filter(|a| !known.contains(a)).collect();
        if let Some(plane) = self.tc.as_mut().filter(|_| !hops.is_empty()) {
            match super::prepare_copy_paths(plane, &hops) {
                Ok(warnings) => warnings.iter().for_each(|w| eprintln!("aggbox: {w}")),
                Err(e) => eprintln!("aggbox: {e:#} (its unresolved-neighbour queue keeps its size)"),
            }
        }
        self.kernel = kernel;
        self.ring_pool = ring_pool;
        // Their sockets were bound above: only a stopped ring's socket that
        // could not be passed on is bound here, which hardly fails.
        let rings_started = ring_services.start(self.rings.as_ref(), stopped);
        if !served.is_empty() {
            match &self.results {
                Some(server) => server.apply(served)?,
                None => bail!("the result service is not running"),
            }
        }
        self.config = new.clone();
        rings_started.map_err(|e| anyhow!("applied, but the new rings' service did not start: {e:#}"))?;
        Ok(summary)
    }
}

/// Ask the `aggbox attach` process serving `iface` (pins under `pin_root`)
/// to reload its config file (SIGHUP) and wait up to `timeout` for the
/// outcome it records.
pub fn request_reload(iface: &str, pin_root: &Path, timeout: std::time::Duration) -> Result<ReloadRecord> {
    let dir = super::pin_dir(pin_root, iface);
    let record = super::read_record(&dir).ok_or_else(|| anyhow!("aggbox: nothing attached to {iface} (no state under {})", dir.display()))?;
    if record.pid == 0 || !super::attacher_alive(&record) {
        bail!("aggbox: the process that attached {iface} (pid {}) is gone: start `aggbox attach` again", record.pid);
    }
    if record.config.is_none() {
        bail!("aggbox: {iface} was attached without --config: there is no file to reload");
    }
    let pid = nix::unistd::Pid::from_raw(record.pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).map_err(|e| anyhow!("aggbox: signalling pid {}: {e}", record.pid))?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(now) = super::read_record(&dir) {
            if now.reloads > record.reloads {
                if let Some(outcome) = now.last_reload {
                    return Ok(outcome);
                }
            }
        }
        if std::time::Instant::now() > deadline {
            bail!("aggbox: pid {} did not report the reload within {} s", record.pid, timeout.as_secs());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
