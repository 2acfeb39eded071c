//! The attach record (`state` pin): what an attachment wrote, read back by
//! `status`, `detach` and `reload`, and whether its process still runs.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use serde::{Deserialize, Serialize};

use super::ReloadRecord;

/// Pin name of the one-entry array map holding the attach record as JSON
/// (bpffs holds only BPF objects, so the record lives in a map of its own).
pub const STATE_FILE: &str = "state";
/// Room for the JSON attach record.
pub(super) const STATE_VALUE_SIZE: u32 = 4096;

/// What `attach` records next to its pins, read by `status` and `detach`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AttachRecord {
    /// Interface name.
    pub iface: String,
    /// Interface index at attach time.
    pub ifindex: u32,
    /// "native" or "generic".
    pub xdp_mode: String,
    /// Build of the XDP chain: "frags" or "linear" (docs/JUMBO.md); empty
    /// in records written before it existed.
    #[serde(default)]
    pub xdp_chain: String,
    /// Process that attached and serves the node (0 once it has exited cleanly).
    pub pid: u32,
    /// Start time of `pid` (field 22 of `/proc/PID/stat`, clock ticks since
    /// boot): a PID alone may have been reused by an unrelated process after
    /// a crash, the pair names one process. 0 in records of older versions
    /// (then only the PID is compared).
    #[serde(default)]
    pub pid_start: u64,
    /// Seconds since the epoch.
    pub attached_at: u64,
    /// Config file used, if any.
    pub config: Option<String>,
    /// Jobs written into the maps.
    pub jobs: Vec<u16>,
    /// Whether the XDP program is also attached to `lo` (generic mode) for
    /// workers on this host; absent in records of older versions.
    #[serde(default)]
    pub lo_xdp: bool,
    /// Whether the TC broadcast programs are attached (clsact filters).
    #[serde(default)]
    pub tc: bool,
    /// Whether attach created the clsact qdisc (so detach removes it).
    #[serde(default)]
    pub tc_created_qdisc: bool,
    /// Whether the TC ingress program is on `lo` too (a worker on this
    /// host, `TcPlane::attach_lo_ingress`), and whether attach created lo's
    /// clsact qdisc.
    #[serde(default)]
    pub tc_lo: bool,
    #[serde(default)]
    pub tc_lo_created_qdisc: bool,
    /// Whether the user-space path (AF_XDP) runs in the attach process.
    #[serde(default)]
    pub userspace_path: bool,
    /// Why the user-space path is not running, when attach went on without
    /// it (`[node] userspace_path = "optional"`, or no job configured).
    #[serde(default)]
    pub userspace_path_error: Option<String>,
    /// Reloads asked for since attach (SIGHUP, `aggbox reload`), applied
    /// or refused.
    #[serde(default)]
    pub reloads: u64,
    /// The outcome of the last of them.
    #[serde(default)]
    pub last_reload: Option<ReloadRecord>,
}

/// The attach record as the state map's value: JSON, NUL-padded.
pub(super) fn record_value(record: &AttachRecord) -> Result<Vec<u8>> {
    let mut json = serde_json::to_vec(record)?;
    if json.len() >= STATE_VALUE_SIZE as usize {
        bail!("aggbox: attach record of {} bytes does not fit the state map", json.len());
    }
    json.resize(STATE_VALUE_SIZE as usize, 0);
    Ok(json)
}

pub(super) fn write_record(dir: &Path, record: &AttachRecord) -> Result<()> {
    let json = record_value(record)?;
    // SAFETY: zeroed opts with sz set are what libbpf expects.
    let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
    let mut map = MapHandle::create(libbpf_rs::MapType::Array, Some("aggbox_state"), 4, STATE_VALUE_SIZE, 1, &opts)
        .context("aggbox: creating the state map")?;
    map.update(&0u32.to_ne_bytes(), &json, MapFlags::ANY).context("aggbox: writing the state map")?;
    let path = dir.join(STATE_FILE);
    map.pin(&path).with_context(|| format!("aggbox: pinning {}", path.display()))?;
    Ok(())
}

/// Rewrite the pinned attach record of `dir` (a reload).
pub(super) fn update_record(dir: &Path, record: &AttachRecord) -> Result<()> {
    let json = record_value(record)?;
    let path = dir.join(STATE_FILE);
    let map = MapHandle::from_pinned_path(&path).with_context(|| format!("aggbox: opening {}", path.display()))?;
    map.update(&0u32.to_ne_bytes(), &json, MapFlags::ANY).context("aggbox: writing the state map")
}

pub(super) fn read_record(dir: &Path) -> Option<AttachRecord> {
    let map = MapHandle::from_pinned_path(dir.join(STATE_FILE)).ok()?;
    let raw = map.lookup(&0u32.to_ne_bytes(), MapFlags::ANY).ok()??;
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    serde_json::from_slice(&raw[..end]).ok()
}

/// Start time of process `pid` in clock ticks since boot (field 22 of
/// `/proc/PID/stat`), `None` when there is no such process.
pub fn process_start_time(pid: u32) -> Option<u64> {
    stat_start_time(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 (`starttime`) of a `/proc/PID/stat` line. The command name
/// (field 2) is in parentheses and may itself contain spaces and `)`, so the
/// fields are counted from the last `)`.
pub fn stat_start_time(stat: &str) -> Option<u64> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    // after_comm starts with field 3 (state): field 22 is the 20th.
    after_comm.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether the process that wrote `record` still runs: its PID exists and,
/// when the record has one, with the same start time, so a PID reused by
/// another process after a crash reads as dead.
pub fn attacher_alive(record: &AttachRecord) -> bool {
    if record.pid == 0 {
        return false;
    }
    match process_start_time(record.pid) {
        None => false,
        Some(start) => record.pid_start == 0 || start == record.pid_start,
    }
}

/// Whether `record` was written by this very process (not only by an
/// earlier process with the same PID).
pub(super) fn record_is_ours(record: &AttachRecord) -> bool {
    record.pid == std::process::id() && (record.pid_start == 0 || process_start_time(record.pid) == Some(record.pid_start))
}
