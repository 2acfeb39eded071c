//! Prometheus exposition of a node's counters (`[node] metrics`, default
//! `http://127.0.0.1:9435/metrics`).
//!
//! Kernel counters are absolute values in pinned maps, so each scrape reads
//! the maps and builds the metric families directly (no shadow counters that
//! could drift); in-process metrics (user-space path histograms) live in
//! [`registry`] and are appended to every scrape.
//!
//! Names follow Prometheus conventions: `aggbox_` prefix, `_total` on
//! counters, base units (seconds, bytes), labels for the dimension.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, Registry, TextEncoder};

use crate::kernel::afxdp::UserspaceStatsFn;
use crate::node::serve::{ResultStatsFn, ServiceStats};
use crate::kernel::maps;
use crate::wire::abi;

/// The process-wide registry for in-process metrics (user-space path
/// counters and histograms); its families are appended to every scrape.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::new)
}

/// Time the node took to apply one change of its jobs on demand (a run
/// created, ended or expired) to the kernel, as a reload does; in
/// [`registry`]. Its buckets are fine where a change lands (about a
/// millisecond): `aggbox-bench ondemand` reads its p50 and p99 from them.
pub fn control_apply_seconds() -> &'static prometheus::Histogram {
    static HISTOGRAM: OnceLock<prometheus::Histogram> = OnceLock::new();
    HISTOGRAM.get_or_init(|| {
        let opts = prometheus::HistogramOpts::new(
            "aggbox_control_apply_seconds",
            "Time to apply one change of the jobs on demand (created, ended, expired) to the node's kernel state.",
        )
        .buckets(vec![
            0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
        ]);
        let h = prometheus::Histogram::with_opts(opts).expect("a valid histogram");
        // Registered once (this OnceLock): it cannot be a duplicate.
        let _ = registry().register(Box::new(h.clone()));
        h
    })
}

/// A BPF program whose run count and run time are exported.
#[derive(Debug, Clone)]
pub struct ProgramRef {
    /// Program name (label value).
    pub name: String,
    /// Kernel program id.
    pub id: u32,
}

/// Where a scrape reads the kernel's counters: one interface's pin directory.
#[derive(Clone)]
pub struct KernelSource {
    /// Interface name (label value).
    pub iface: String,
    /// The interface's pin directory (maps `stats`, `jobs`, `job_state`,
    /// `job_stats`, `handoff_stats`, and `bcast_*` when the broadcast plane is attached).
    pub pin_dir: PathBuf,
    /// Programs to report run statistics for.
    pub programs: Vec<ProgramRef>,
    /// The user-space path of this interface, if running.
    pub userspace: Option<UserspaceStatsFn>,
    /// The result service of the node-served jobs, if any.
    pub results: Option<ResultStatsFn>,
    /// The ring service of the node's rings, if any.
    pub rings: Option<crate::node::ring::RingStatsFn>,
    /// The control endpoint's registry (jobs on demand), if served.
    pub control: Option<ControlStatsFn>,
}

/// The control endpoint's counts and its live jobs, read at a scrape.
/// The registry's counts, its live jobs and the rings it serves for runs.
pub type ControlStatsFn = std::sync::Arc<dyn Fn() -> (crate::node::control::registry::Counts, usize, usize) + Send + Sync>;

/// The control endpoint's families: jobs created, ended, expired, refused
/// requests by reason (every reason listed, 0 included), live jobs and
/// rings on demand.
fn control_families(iface: &str, (counts, live, rings): &(crate::node::control::registry::Counts, usize, usize)) -> Vec<Family> {
    use crate::wire::control::Refusal;
    let mut out = Vec::new();
    for (name, help, value) in [
        ("aggbox_control_jobs_created_total", "Jobs on demand created (every rank of a run joined), and rings installed for runs.", counts.created),
        ("aggbox_control_jobs_ended_total", "Jobs on demand (and rings for runs) ended by their runs (or replaced by a restarted run).", counts.ended),
        ("aggbox_control_jobs_expired_total", "Jobs on demand (and rings for runs) removed because their lease ran out.", counts.expired),
    ] {
        let mut f = Family::counter(name, help);
        f.push(&[("iface", iface)], value as f64);
        out.push(f);
    }
    let mut refused = Family::counter("aggbox_control_refused_total", "Control requests refused, by reason (docs/PROTOCOL.md, AGC1).");
    for r in Refusal::ALL {
        refused.push(&[("iface", iface), ("reason", r.name())], counts.refused.get(&r).copied().unwrap_or(0) as f64);
    }
    out.push(refused);
    let mut f = Family::gauge("aggbox_control_live_jobs", "Jobs on demand the node serves now.");
    f.push(&[("iface", iface)], *live as f64);
    out.push(f);
    let mut f = Family::gauge("aggbox_control_live_rings", "Rings the node serves now for runs on demand of other nodes.");
    f.push(&[("iface", iface)], *rings as f64);
    out.push(f);
    out
}

impl std::fmt::Debug for KernelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSource").field("iface", &self.iface).field("pin_dir", &self.pin_dir).finish_non_exhaustive()
    }
}

fn label(name: &str, value: &str) -> LabelPair {
    let mut l = LabelPair::new();
    l.set_name(name.to_string());
    l.set_value(value.to_string());
    l
}

/// Builder for one metric family.
struct Family {
    family: MetricFamily,
}

impl Family {
    fn new(name: &str, help: &str, kind: MetricType) -> Family {
        let mut family = MetricFamily::default();
        family.set_name(name.to_string());
        family.set_help(help.to_string());
        family.set_field_type(kind);
        Family { family }
    }

    fn counter(name: &str, help: &str) -> Family {
        Family::new(name, help, MetricType::COUNTER)
    }

    fn gauge(name: &str, help: &str) -> Family {
        Family::new(name, help, MetricType::GAUGE)
    }

    fn push(&mut self, labels: &[(&str, &str)], value: f64) {
        let mut m = Metric::default();
        m.set_label(labels.iter().map(|(k, v)| label(k, v)).collect());
        match self.family.get_field_type() {
            MetricType::COUNTER => {
                let mut c = Counter::default();
                c.set_value(value);
                m.set_counter(c);
            }
            _ => {
                let mut g = Gauge::default();
                g.set_value(value);
                m.set_gauge(g);
            }
        }
        self.family.mut_metric().push(m);
    }
}

fn sum_percpu(map: &MapHandle, index: u32) -> Result<abi::Stat> {
    Ok(maps::percpu_array_sum(map, index)?)
}

/// Run count and total run time (ns) of program `id`; zeros unless
/// `kernel.bpf_stats_enabled` is on (or `aggbox attach --bpf-stats`).
pub fn program_run_stats(id: u32) -> Result<(u64, u64, u32)> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd)).context("bpf_prog_get_fd_by_id");
    }
    // SAFETY: fresh fd from the kernel, owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed info is a valid out-parameter; len set to its size.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: valid fd, info buffer of `len` bytes.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc < 0 {
        return Err(std::io::Error::from_raw_os_error(-rc)).context("bpf_prog_get_info_by_fd");
    }
    Ok((info.run_cnt, info.run_time_ns, info.xlated_prog_len / 8))
}

/// Read every kernel metric of `source` into metric families.
pub fn kernel_families(source: &KernelSource) -> Result<Vec<MetricFamily>> {
    let iface = source.iface.as_str();
    let dir = &source.pin_dir;
    let stats = maps::open_pinned(dir, maps::names::STATS).with_context(|| format!("opening {}/stats", dir.display()))?;

    let mut datagrams = Family::counter("aggbox_datagrams_total", "Datagrams seen by the XDP program on a job port or passed, by outcome.");
    let mut payload = Family::counter("aggbox_payload_bytes_total", "UDP payload bytes of the datagrams of aggbox_datagrams_total, by outcome.");
    for outcome in abi::Outcome::ALL {
        let s = sum_percpu(&stats, outcome as u32)?;
        datagrams.push(&[("iface", iface), ("outcome", outcome.label())], s.packets as f64);
        payload.push(&[("iface", iface), ("outcome", outcome.label())], s.bytes as f64);
    }
    let mut drops = Family::counter("aggbox_dropped_total", "Datagrams dropped by the XDP program, by reason.");
    for reason in abi::DropReason::ALL {
        let s = sum_percpu(&stats, reason.stats_index())?;
        drops.push(&[("iface", iface), ("reason", reason.label())], s.packets as f64);
    }

    let mut results = Family::counter("aggbox_job_results_total", "Slots of a job completed in the kernel (RESULT datagrams emitted).");
    let mut active = Family::gauge("aggbox_job_slots_active", "Slots of a job currently in the kernel's pool.");
    let mut limit = Family::gauge("aggbox_job_slots_limit", "Bound on the slots of a job.");
    let mut occupancy = Family::gauge("aggbox_job_slot_occupancy_ratio", "Active slots of a job over its bound.");
    let mut round = Family::gauge("aggbox_job_newest_round", "Newest completed round of a job.");
    let mut workers = Family::gauge("aggbox_job_workers", "Ranks configured for a job.");
    let jobs = maps::open_pinned(dir, maps::names::JOBS).with_context(|| format!("opening {}/jobs", dir.display()))?;
    let job_state = maps::open_pinned(dir, maps::names::JOB_STATE).ok();
    let job_stats = maps::open_pinned(dir, maps::names::JOB_STATS).ok();
    let mut contributions = Family::counter(
        "aggbox_job_contributions_total",
        "Datagrams of a job counted by the XDP program once the job was known, by outcome.",
    );
    let mut overflow_results = Family::counter("aggbox_job_overflow_results_total", "RESULTs of a job emitted with the OVERFLOW flag (some element clamped).");
    let mut job_bytes = Family::counter("aggbox_job_payload_bytes_total", "UDP payload bytes of the datagrams of aggbox_job_contributions_total.");
    let job_list: BTreeMap<u16, (u32, abi::Job)> =
        crate::kernel::xdp::pinned_jobs(&jobs)?.into_iter().map(|(dense, job)| (job.id, (dense, job))).collect();
    for (id, (dense, job)) in &job_list {
        let id_text = id.to_string();
        let labels = [("iface", iface), ("aggbox_job", id_text.as_str())];
        let key = dense.to_ne_bytes();
        let state = match &job_state {
            Some(map) => map.lookup(&key, MapFlags::ANY)?.and_then(|v| abi::from_bytes::<abi::JobState>(&v)),
            None => None,
        }
        .unwrap_or_default();
        active.push(&labels, state.active_slots as f64);
        let bound = if job.slots == 0 { abi::MAX_SLOTS } else { job.slots };
        limit.push(&labels, bound as f64);
        occupancy.push(&labels, state.active_slots as f64 / bound.max(1) as f64);
        round.push(&labels, state.newest_round as f64);
        workers.push(&labels, job.workers as f64);
        if let Some(map) = &job_stats {
            if let Some(js) = maps::lookup_percpu_sum::<abi::JobStats>(map, &key)? {
                for (outcome, n) in js.by_outcome() {
                    contributions.push(&[("iface", iface), ("aggbox_job", id_text.as_str()), ("outcome", outcome)], n as f64);
                }
                results.push(&labels, js.results as f64);
                overflow_results.push(&labels, js.overflow_results as f64);
                job_bytes.push(&labels, js.bytes as f64);
            }
        }
    }

    let mut runs = Family::counter("aggbox_program_runs_total", "Runs of a BPF program (needs bpf_stats: aggbox attach --bpf-stats).");
    let mut run_time = Family::counter("aggbox_program_run_seconds_total", "Time spent in a BPF program (needs bpf_stats).");
    let mut insns = Family::gauge("aggbox_program_instructions", "Instructions of a BPF program after verification (xlated).");
    for prog in &source.programs {
        if let Ok((count, ns, xlated)) = program_run_stats(prog.id) {
            let labels = [("iface", iface), ("program", prog.name.as_str())];
            runs.push(&labels, count as f64);
            run_time.push(&labels, ns as f64 / 1e9);
            insns.push(&labels, xlated as f64);
        }
    }

    // The block pool (docs/JUMBO.md) is shared by every job; it, not the
    // slot bound, is what limits jumbo fragments in flight.
    let mut blocks_used = Family::gauge("aggbox_blocks_in_use", "Accumulator blocks (256 elements each) the kernel's slots hold, all jobs.");
    let mut blocks_capacity = Family::gauge("aggbox_blocks_capacity", "Accumulator blocks in the kernel's pool.");
    if let Ok(map) = maps::open_pinned(dir, maps::names::BLOCKS_USED) {
        let used = map
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)?
            .and_then(|v| abi::from_bytes::<u64>(&v))
            .unwrap_or(0);
        blocks_used.push(&[("iface", iface)], used as f64);
        blocks_capacity.push(&[("iface", iface)], abi::MAX_BLOCKS as f64);
    }

    let mut families = vec![
        datagrams,
        payload,
        drops,
        results,
        active,
        limit,
        occupancy,
        round,
        workers,
        contributions,
        overflow_results,
        job_bytes,
        runs,
        run_time,
        insns,
        blocks_used,
        blocks_capacity,
    ];

    // The fast slots (docs/DATAPLANE.md "Fast slots"): busy, aborted and
    // checked growing against taken say the jobs' contributions are leaving
    // the one-lock path.
    if let Ok(fast) = maps::open_pinned(dir, maps::names::FAST_STATS) {
        let mut f = Family::counter(
            "aggbox_fast_slot_events_total",
            "Fast-slot events of all jobs: contributions joined, slots taken, fragments sent to the hash-map path (busy), \
             take-overs given up (aborted), unfinished slots released, takes that looked for hash-map records (checked).",
        );
        for (i, event) in abi::FAST_STAT_LABELS.iter().enumerate() {
            let n: u64 = maps::percpu_array_sum(&fast, i as u32)?;
            f.push(&[("iface", iface), ("event", event)], n as f64);
        }
        families.push(f);
    }
    if let Ok(handoff) = maps::open_pinned(dir, maps::names::HANDOFF_STATS) {
        let mut f = Family::counter("aggbox_userspace_handoffs_total", "Datagrams the XDP program redirected to the user-space path, by reason.");
        for reason in abi::HandoffReason::ALL {
            let s = sum_percpu(&handoff, reason as u32)?;
            f.push(&[("iface", iface), ("reason", reason.label())], s.packets as f64);
        }
        families.push(f);
    }
    families.extend(broadcast_families(source)?);
    // Whether the user-space path runs at all: without it (attach with
    // `[node] userspace_path = "optional"`) ops 5..8 and FLOAT32 reach the
    // stack unaggregated, which its counters alone would not show.
    let mut userspace_up = Family::gauge(
        "aggbox_userspace_path_up",
        "1 when the user-space path (AF_XDP) runs, 0 when attach went on without it (ops 5..8, FLOAT32 and slot-pool overflow then reach the stack unaggregated).",
    );
    userspace_up.push(&[("iface", iface)], if source.userspace.is_some() { 1.0 } else { 0.0 });
    families.push(userspace_up);
    if let Some(userspace) = &source.userspace {
        families.extend(userspace_families(iface, &userspace()));
    }
    if let Some(results) = &source.results {
        families.extend(result_service_families(iface, &results()));
    }
    if let Some(control) = &source.control {
        families.extend(control_families(iface, &control()));
    }
    families.extend(ring_families(source)?);
    Ok(families.into_iter().map(|f| f.family).filter(|f| !f.get_metric().is_empty()).collect())
}

/// A counter family of the result service: name, help, and its value.
type ServiceCounter = (&'static str, &'static str, fn(&ServiceStats) -> u64);

/// The result service's counters per node-served job (`consumer = "node"`).
fn result_service_families(iface: &str, stats: &std::collections::HashMap<u16, ServiceStats>) -> Vec<Family> {
    let counters: [ServiceCounter; 18] = [
        ("aggbox_result_service_results_total", "RESULTs the node's result service took (each fragment once).", |s| s.results),
        ("aggbox_result_service_duplicate_results_total", "RESULT copies of a fragment taken already.", |s| s.duplicate_results),
        ("aggbox_result_service_acks_sent_total", "ACKs the node sent on the kernel's behalf (one per worker each).", |s| s.acks_sent),
        ("aggbox_result_service_acks_received_total", "Workers' ACKs of RESULT copies.", |s| s.acks_received),
        ("aggbox_result_service_resent_total", "RESULT copies resent to a worker that missed them.", |s| s.resent),
        ("aggbox_result_service_refused_results_total", "RESULT-shaped datagrams from a source the node never sends RESULTs from.", |s| s.refused_results),
        ("aggbox_result_service_refused_acks_total", "ACKs from a socket other than the worker they name.", |s| s.refused_acks),
        ("aggbox_result_service_other_total", "Other datagrams on a served job's result port.", |s| s.other),
        ("aggbox_result_service_rounds_total", "Rounds (calls) the node's result service saw RESULTs of.", |s| s.rounds),
        ("aggbox_result_service_upstream_sent_total", "Tree jobs: contributions the node sent to its parent (each fragment once).", |s| s.upstream_sent),
        ("aggbox_result_service_upstream_resent_total", "Tree jobs: contributions resent to the parent, which had not acknowledged them.", |s| s.upstream_resent),
        ("aggbox_result_service_upstream_acks_total", "Tree jobs: the parent's ACKs of the node's contributions.", |s| s.upstream_acks),
        ("aggbox_result_service_parent_results_total", "Tree jobs: the parent's RESULTs taken (each fragment once) and delivered to every worker.", |s| s.parent_results),
        ("aggbox_result_service_duplicate_parent_results_total", "Tree jobs: copies of a parent's RESULT taken already.", |s| s.duplicate_parent_results),
        ("aggbox_result_service_parent_acks_sent_total", "Tree jobs: ACKs of the parent's RESULTs sent to the parent.", |s| s.parent_acks_sent),
        ("aggbox_result_service_position_queries_total", "Position queries (AGP1) of the job's workers the node answered.", |s| s.position_queries),
        ("aggbox_result_service_refused_queries_total", "AGP1 datagrams refused: malformed, or not from the worker they name.", |s| s.refused_queries),
        ("aggbox_result_service_released_slots_total", "Unfinished slots of rounds after the newest RESULT, released at a position query (left by an earlier run's failed calls).", |s| s.released_slots),
    ];
    let mut jobs: Vec<(&u16, &ServiceStats)> = stats.iter().collect();
    jobs.sort_by_key(|(id, _)| **id);
    counters
        .iter()
        .map(|(name, help, get)| {
            let mut f = Family::counter(name, help);
            for (id, s) in &jobs {
                let job = id.to_string();
                f.push(&[("iface", iface), ("aggbox_job", job.as_str())], get(s) as f64);
            }
            f
        })
        .chain(std::iter::once({
            let mut f = Family::gauge(
                "aggbox_result_service_workers_behind",
                "Workers that owe the node an ACK of a RESULT it holds (their copy was lost or is late).",
            );
            for (id, s) in &jobs {
                let job = id.to_string();
                f.push(&[("iface", iface), ("aggbox_job", job.as_str())], s.workers_behind as f64);
            }
            f
        }))
        .chain(std::iter::once({
            let mut f = Family::gauge(
                "aggbox_result_service_upstream_held",
                "Tree jobs: the node's contributions its parent has not acknowledged yet.",
            );
            for (id, s) in &jobs {
                let job = id.to_string();
                f.push(&[("iface", iface), ("aggbox_job", job.as_str())], s.upstream_held as f64);
            }
            f
        }))
        .collect()
}

/// Ring allreduce counters per ring (docs/RING.md "Counters"): the XDP
/// program's (`aggbox_ring_<label>_total`) and the ring service's
/// (`aggbox_ring_service_<name>_total`).
fn ring_families(source: &KernelSource) -> Result<Vec<Family>> {
    let iface = source.iface.as_str();
    let mut families = Vec::new();
    let xdp = crate::node::ring::pinned_ring_counters(&source.pin_dir)?;
    for stat in abi::RingStat::ALL {
        let mut f = Family::counter(&format!("aggbox_ring_{}_total", stat.label()), "Ring datagrams of the XDP ring program by outcome (docs/RING.md \"Counters\").");
        for (id, st) in &xdp {
            f.push(&[("iface", iface), ("aggbox_ring", id.to_string().as_str())], st.count[stat as usize] as f64);
        }
        families.push(f);
    }
    if let Some(rings) = &source.rings {
        let mut stats: Vec<_> = rings().into_iter().collect();
        stats.sort_by_key(|(id, _)| *id);
        let names = crate::node::ring::RingServiceStats::default().counters();
        for (i, (name, help, _)) in names.iter().enumerate() {
            let mut f = Family::counter(&format!("aggbox_ring_service_{name}_total"), help);
            for (id, st) in &stats {
                f.push(&[("iface", iface), ("aggbox_ring", id.to_string().as_str())], st.counters()[i].2 as f64);
            }
            families.push(f);
        }
    }
    Ok(families)
}

/// Broadcast counters, when the TC plane's maps are pinned next to the XDP ones.
fn broadcast_families(source: &KernelSource) -> Result<Vec<Family>> {
    let iface = source.iface.as_str();
    let Ok(stats) = maps::open_pinned(&source.pin_dir, maps::names::BCAST_STATS) else {
        return Ok(Vec::new());
    };
    let mut datagrams = Family::counter("aggbox_broadcast_datagrams_total", "AGB1 and other datagrams seen by the TC programs, by outcome.");
    let mut events = Family::counter("aggbox_broadcast_copy_events_total", "Per-copy events of the TC programs (copies sent, neighbour misses, cache hits, FIB lookups, failures).");
    for stat in abi::BcastStat::ALL {
        let s = sum_percpu(&stats, stat as u32)?;
        let labels = [("iface", iface), ("event", stat.label())];
        if stat.is_datagram_outcome() {
            datagrams.push(&[("iface", iface), ("outcome", stat.label())], s.packets as f64);
        } else {
            events.push(&labels, s.packets as f64);
        }
    }
    let mut out = vec![datagrams, events];
    if let Ok(gstats) = maps::open_pinned(&source.pin_dir, maps::names::BCAST_GSTATS) {
        let mut g_datagrams = Family::counter("aggbox_group_datagrams_total", "Datagrams broadcast (root) or forwarded (tree node) for a group.");
        let mut g_copies = Family::counter("aggbox_group_copies_total", "Copies sent for a group.");
        let mut g_misses = Family::counter("aggbox_group_neighbour_misses_total", "Copies of a group sent through the neighbour path (next hop unresolved).");
        let mut g_bytes = Family::counter("aggbox_group_payload_bytes_total", "UDP payload bytes broadcast for a group.");
        for (k, total) in maps::percpu_entries::<abi::GroupKey, abi::BcastGroupStat>(&gstats)? {
            let (group, port) = (k.group.to_string(), k.port.to_string());
            let labels = [("iface", iface), ("group", group.as_str()), ("port", port.as_str())];
            g_datagrams.push(&labels, total.datagrams as f64);
            g_copies.push(&labels, total.copies as f64);
            g_misses.push(&labels, total.neigh_misses as f64);
            g_bytes.push(&labels, total.bytes as f64);
        }
        out.extend([g_datagrams, g_copies, g_misses, g_bytes]);
    }
    Ok(out)
}

/// The user-space path's counters and its latency histogram.
fn userspace_families(iface: &str, s: &crate::kernel::afxdp::UserspaceStats) -> Vec<Family> {
    let labels = [("iface", iface)];
    let mut received = Family::counter("aggbox_userspace_received_total", "Frames received by the user-space path (AF_XDP).");
    received.push(&labels, s.received as f64);
    let mut accepted = Family::counter("aggbox_userspace_accepted_total", "Contributions the user-space path added to a slot.");
    accepted.push(&labels, s.accepted as f64);
    let mut results = Family::counter("aggbox_userspace_results_total", "RESULT datagrams sent by the user-space path.");
    results.push(&labels, s.results as f64);
    let mut send_errors = Family::counter("aggbox_userspace_result_send_errors_total", "RESULT datagrams the user-space path failed to send.");
    send_errors.push(&labels, s.result_send_errors as f64);
    let mut drops = Family::counter("aggbox_userspace_dropped_total", "Contributions dropped by the user-space path, by reason.");
    for reason in abi::DropReason::ALL {
        drops.push(&[("iface", iface), ("reason", reason.label())], s.drop(reason) as f64);
    }
    // The path's own reasons: a new slot past the job's or the node's
    // `userspace_slot_bytes`.
    for refusal in crate::kernel::afxdp::Refusal::OWN {
        drops.push(&[("iface", iface), ("reason", refusal.label())], s.refused(refusal) as f64);
    }
    let mut slots = Family::gauge("aggbox_userspace_slots_active", "Slots held by the user-space path.");
    slots.push(&labels, s.slots_in_use as f64);
    let mut job_slots = Family::gauge("aggbox_userspace_job_slots_active", "Slots a job holds on the user-space path.");
    let mut job_limit = Family::gauge("aggbox_userspace_job_slots_limit", "Bound on the slots a job may hold on the user-space path (config userspace_slots).");
    for (job, (used, limit)) in &s.slots_by_job {
        let job = job.to_string();
        job_slots.push(&[("iface", iface), ("aggbox_job", job.as_str())], *used as f64);
        job_limit.push(&[("iface", iface), ("aggbox_job", job.as_str())], *limit as f64);
    }
    let mut bytes = Family::gauge("aggbox_userspace_slot_bytes", "Bytes of slot memory held by the user-space path (all jobs).");
    bytes.push(&labels, s.slot_bytes as f64);
    let mut bytes_limit = Family::gauge("aggbox_userspace_slot_bytes_limit", "Bound on the user-space path's slot memory of all jobs (config [node] userspace_slot_bytes).");
    bytes_limit.push(&labels, s.slot_bytes_limit as f64);
    let mut job_bytes = Family::gauge("aggbox_userspace_job_slot_bytes", "Bytes of slot memory a job holds on the user-space path.");
    let mut job_bytes_limit = Family::gauge("aggbox_userspace_job_slot_bytes_limit", "Bound on a job's slot memory on the user-space path (config userspace_slot_bytes).");
    for (job, (used, limit)) in &s.slot_bytes_by_job {
        let job = job.to_string();
        job_bytes.push(&[("iface", iface), ("aggbox_job", job.as_str())], *used as f64);
        job_bytes_limit.push(&[("iface", iface), ("aggbox_job", job.as_str())], *limit as f64);
    }
    let mut overload = Family::counter("aggbox_userspace_overload_events_total", "Times a job's new slots were handed to user space because its kernel pool stayed full.");
    overload.push(&labels, s.overload_events as f64);
    let mut in_overload = Family::gauge("aggbox_userspace_jobs_in_overload", "Jobs whose new slots currently go to user space.");
    in_overload.push(&labels, s.jobs_in_overload.len() as f64);

    let mut latency = MetricFamily::default();
    latency.set_name("aggbox_userspace_result_latency_seconds".to_string());
    latency.set_help("Time from a slot's first contribution to its RESULT on the user-space path.".to_string());
    latency.set_field_type(MetricType::HISTOGRAM);
    let mut h = prometheus::proto::Histogram::default();
    let cumulative = s.latency.cumulative();
    let mut buckets = Vec::new();
    let mut total = 0;
    for (bound, count) in cumulative {
        total = count;
        if bound.is_finite() {
            let mut b = prometheus::proto::Bucket::default();
            b.set_upper_bound(bound);
            b.set_cumulative_count(count);
            buckets.push(b);
        }
    }
    h.set_bucket(buckets);
    h.set_sample_count(total);
    h.set_sample_sum(s.latency.sum_s);
    let mut m = Metric::default();
    m.set_label(vec![label("iface", iface)]);
    m.set_histogram(h);
    latency.mut_metric().push(m);

    vec![
        received, accepted, results, send_errors, drops, slots, job_slots, job_limit, bytes, bytes_limit, job_bytes,
        job_bytes_limit, overload, in_overload, Family { family: latency },
    ]
}

/// The text exposition of one scrape: kernel families plus [`registry`].
pub fn render(sources: &[KernelSource]) -> Result<String> {
    let mut families = Vec::new();
    for source in sources {
        families.extend(kernel_families(source)?);
    }
    families.extend(registry().gather());
    let mut out = Vec::new();
    TextEncoder::new().encode(&families, &mut out)?;
    Ok(String::from_utf8(out)?)
}

/// How long a client may take to send its request head. A scraper that
/// connects and stalls, or trickles an endless request line, holds one
/// connection for at most this long.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on a whole connection (request, rendering, a slow reader of the
/// response).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest request head accepted (hyper's smallest read buffer); a larger
/// one is answered 431 and closed. A scrape request is a few hundred bytes.
pub const MAX_REQUEST_BYTES: usize = 8192;
/// Connections served at once; beyond it a new connection is closed at once
/// instead of queueing behind slow ones. Each costs a task and a buffer of
/// at most [`MAX_REQUEST_BYTES`], so the bound caps memory, not scrapes.
pub const MAX_CONNECTIONS: usize = 64;

/// A running `/metrics` HTTP endpoint; stops when dropped.
///
/// Served by hyper on a one-thread tokio runtime of its own, so that a
/// client that stalls, trickles or sends an oversized request is bounded by
/// hyper's header timeout and buffer limit and never delays another
/// connection; reading the counters (BPF syscalls) runs on tokio's blocking
/// pool.
pub struct MetricsServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    addr: SocketAddr,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer").field("addr", &self.addr).finish_non_exhaustive()
    }
}

/// Bind the metrics address (before attaching anything, so that a port in
/// use fails the attach with the interface untouched).
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).with_context(|| format!("aggbox: metrics address {addr} unavailable (port in use?)"))
}

impl MetricsServer {
    /// Serve `GET /metrics` on `listener` from `sources` on a thread.
    pub fn start(listener: TcpListener, sources: Vec<KernelSource>) -> Result<MetricsServer> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .thread_name("aggbox-metrics")
            .build()
            .context("aggbox: starting the metrics server's runtime")?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener).context("aggbox: metrics listener")?
        };
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let sources = Arc::new(sources);
        let thread = std::thread::Builder::new().name("aggbox-metrics".into()).spawn(move || {
            runtime.block_on(serve(listener, sources, stopped));
            // A scrape still reading the maps gets a moment to finish.
            runtime.shutdown_timeout(Duration::from_secs(1));
        })?;
        Ok(MetricsServer { stop: Some(stop), thread: Some(thread), addr })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(listener: tokio::net::TcpListener, sources: Arc<Vec<KernelSource>>, mut stopped: tokio::sync::oneshot::Receiver<()>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // EMFILE and the like: back off instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let sources = sources.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| respond(request, sources.clone()));
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_REQUEST_BYTES)
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
            drop(permit);
        });
    }
}

fn text_response(status: hyper::StatusCode, content_type: &'static str, body: String) -> hyper::Response<http_body_util::Full<hyper::body::Bytes>> {
    let mut response = hyper::Response::new(http_body_util::Full::new(hyper::body::Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    response
}

async fn respond(
    request: hyper::Request<hyper::body::Incoming>,
    sources: Arc<Vec<KernelSource>>,
) -> Result<hyper::Response<http_body_util::Full<hyper::body::Bytes>>, std::convert::Infallible> {
    if request.method() != hyper::Method::GET || request.uri().path() != "/metrics" {
        return Ok(text_response(hyper::StatusCode::NOT_FOUND, "text/plain", "not found: metrics are at /metrics\n".into()));
    }
    let rendered = tokio::task::spawn_blocking(move || render(&sources)).await;
    Ok(match rendered {
        Ok(Ok(body)) => text_response(hyper::StatusCode::OK, "text/plain; version=0.0.4", body),
        Ok(Err(e)) => text_response(hyper::StatusCode::INTERNAL_SERVER_ERROR, "text/plain", format!("error reading counters: {e:#}\n")),
        Err(e) => text_response(hyper::StatusCode::INTERNAL_SERVER_ERROR, "text/plain", format!("error reading counters: {e}\n")),
    })
}

/// Turn on kernel-wide BPF run-time statistics while the returned fd lives
/// (BPF_ENABLE_STATS); they cost a few ns per program run, so it is opt-in.
pub fn enable_bpf_stats() -> Result<OwnedFd> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_enable_stats(libbpf_sys::BPF_STATS_RUN_TIME) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd)).context("aggbox: enabling BPF run-time statistics");
    }
    // SAFETY: fresh fd owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Pin directory helper re-exported for callers building a [`KernelSource`].
pub fn source_for(iface: &str, pin_dir: &Path, programs: Vec<ProgramRef>, userspace: Option<UserspaceStatsFn>) -> KernelSource {
    KernelSource { iface: iface.to_string(), pin_dir: pin_dir.to_path_buf(), programs, userspace, results: None, rings: None, control: None }
}
