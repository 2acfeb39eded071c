//! `aggbox status`: what a node has attached, read back from its pins
//! (the attach record, the `jobs`/`job_state`/per-CPU counter maps, the
//! broadcast groups and next-hop cache), and how it is printed.

use super::*;

/// One configured job as read back from the pinned `jobs` map.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct JobStatus {
    /// Job id.
    pub id: u16,
    /// Contribution port.
    pub port: u16,
    /// Result port.
    pub result_port: u16,
    /// Number of ranks.
    pub workers: u16,
    /// Vector length (0 = unbounded).
    pub vector_len: u32,
    /// Slot bound.
    pub slots: u32,
    /// Rank source addresses.
    pub ranks: Vec<IpAddr>,
    /// The job's XDP counters (`job_stats`, summed over CPUs); `None` when
    /// the pinned map or the job's entry is missing (attached by an older
    /// build).
    pub counters: Option<abi::JobStats>,
    /// For a job on demand: its owner, incarnation and lease (`None`: a job
    /// of the node's file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_demand: Option<crate::node::control::DynamicJobRecord>,
}

/// Status of one attached interface, read from its pins.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    /// The attach record.
    pub attach: AttachRecord,
    /// Whether the attaching process is still running.
    pub serving: bool,
    /// Configured jobs.
    pub jobs: Vec<JobStatus>,
    /// Datagrams per outcome (summed over CPUs).
    pub outcomes: BTreeMap<String, u64>,
    /// Dropped datagrams per reason (summed over CPUs).
    pub drops: BTreeMap<String, u64>,
    /// Datagrams handed to the user-space path, by reason.
    pub handoffs: BTreeMap<String, u64>,
    /// TC broadcast counters by label (empty when TC is not attached).
    pub broadcast: BTreeMap<String, u64>,
    /// The result service's counters by node-served job (`consumer =
    /// "node"`; empty when there is none).
    pub served: BTreeMap<u16, serve::ServiceStats>,
    /// Broadcast tables with their members and next hops (empty when TC
    /// is not attached).
    pub groups: Vec<GroupStatus>,
    /// Per ring id: the XDP ring program's counters by label (docs/RING.md
    /// "Counters"; empty when there is no ring).
    pub rings: BTreeMap<u16, BTreeMap<String, u64>>,
    /// Per ring id: the node's ring service's counters.
    pub ring_service: BTreeMap<u16, crate::node::ring::RingServiceStats>,
    /// The ring memory reserved at attach (the file's rings and `[node]
    /// ring_pool`), used by the rings now, and free (docs/RING.md
    /// "Configuration"); all 0 when none is reserved.
    pub ring_pool: crate::kernel::xdp::RingPoolUsage,
    /// Per ring id: the rings this node serves for runs on demand, with
    /// their owner and lease (docs/INTERFACE.md, "Rings on demand").
    pub rings_on_demand: BTreeMap<u16, crate::node::control::RingRecord>,
}

/// Sum the per-CPU `aggbox_stat` packets of a pinned array map for each
/// `(index, label)`; empty when the map is not pinned.
fn pinned_percpu_counts(dir: &Path, name: &str, entries: impl Iterator<Item = (u32, &'static str)>) -> Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    let Ok(map) = maps::open_pinned(dir, name) else {
        return Ok(out);
    };
    for (index, label) in entries {
        let sum: abi::Stat = maps::percpu_array_sum(&map, index)?;
        out.insert(label.to_string(), sum.packets);
    }
    Ok(out)
}

/// Status of `iface`, or of every interface with pins under `pin_root`.
pub fn status(iface: Option<&str>, pin_root: &Path) -> Result<Vec<NodeStatus>> {
    let dirs: Vec<PathBuf> = match iface {
        Some(name) => {
            let dir = pin_dir(pin_root, name);
            if !dir.join(STATE_FILE).exists() {
                match hidden_pins_hint(pin_root) {
                    Some(hint) => bail!("aggbox: {name} is not attached (no state under {}); {hint}", dir.display()),
                    None => bail!("aggbox: {name} is not attached (no state under {})", dir.display()),
                }
            }
            vec![dir]
        }
        None => match fs::read_dir(pin_root) {
            Ok(entries) => entries.flatten().map(|e| e.path()).filter(|p| p.join(STATE_FILE).exists()).collect(),
            Err(_) => Vec::new(),
        },
    };
    dirs.iter().map(|dir| status_of(dir)).collect()
}

fn status_of(dir: &Path) -> Result<NodeStatus> {
    let attach = read_record(dir).ok_or_else(|| anyhow!("aggbox: unreadable {}", dir.join(STATE_FILE).display()))?;
    let opening = |name: &str| format!("opening {}/{name}", dir.display());
    let stats_map = maps::open_pinned(dir, maps::names::STATS).with_context(|| opening(maps::names::STATS))?;
    let read = |index: u32| -> Result<u64> { Ok(maps::percpu_array_sum::<abi::Stat>(&stats_map, index)?.packets) };
    let mut outcomes = BTreeMap::new();
    for outcome in abi::Outcome::ALL {
        outcomes.insert(outcome.label().to_string(), read(outcome as u32)?);
    }
    let mut drops = BTreeMap::new();
    for reason in abi::DropReason::ALL {
        drops.insert(reason.label().to_string(), read(reason.stats_index())?);
    }

    let jobs_map = maps::open_pinned(dir, maps::names::JOBS).with_context(|| opening(maps::names::JOBS))?;
    let ranks_map = maps::open_pinned(dir, maps::names::RANKS).with_context(|| opening(maps::names::RANKS))?;
    let job_stats_map = maps::open_pinned(dir, maps::names::JOB_STATS).ok();
    let mut jobs = Vec::new();
    let mut on_demand = crate::node::control::published::read(dir);
    for (dense, job) in crate::kernel::xdp::pinned_jobs(&jobs_map)? {
        let key = dense.to_ne_bytes();
        let mut ranks = Vec::new();
        for rank in 0..u32::from(job.workers) {
            let rkey = dense * abi::MAX_RANKS + rank;
            if let Some(addr) = ranks_map
                .lookup(&rkey.to_ne_bytes(), MapFlags::ANY)?
                .and_then(|v| abi::from_bytes::<abi::Rank>(&v))
                .and_then(|r| r.ip())
            {
                ranks.push(addr);
            }
        }
        jobs.push(JobStatus {
            id: job.id,
            port: job.port,
            result_port: job.result_port,
            workers: job.workers,
            vector_len: job.vector_len,
            slots: job.slots,
            ranks,
            counters: match &job_stats_map {
                Some(map) => maps::lookup_percpu_sum(map, &key)?,
                None => None,
            },
            on_demand: on_demand.remove(&job.id),
        });
    }
    jobs.sort_by_key(|j| j.id);
    let serving = attacher_alive(&attach);
    let handoffs = pinned_percpu_counts(dir, maps::names::HANDOFF_STATS, abi::HandoffReason::ALL.iter().map(|r| (*r as u32, r.label())))?;
    let broadcast = if attach.tc {
        pinned_percpu_counts(dir, maps::names::BCAST_STATS, abi::BcastStat::ALL.iter().map(|s| (*s as u32, s.label())))?
    } else {
        BTreeMap::new()
    };
    let mut served = BTreeMap::new();
    if let Ok(map) = maps::open_pinned(dir, serve::STATS_MAP) {
        for (id, v) in maps::entries::<u32, serve::ServiceStats>(&map)? {
            served.insert(id as u16, v);
        }
    }
    let groups = if attach.tc { group_statuses(dir)? } else { Vec::new() };
    let rings = crate::node::ring::pinned_ring_counters(dir)?
        .into_iter()
        .map(|(id, st)| (id, abi::RingStat::ALL.iter().map(|&c| (c.label().to_string(), st.count[c as usize])).collect()))
        .collect();
    let mut ring_service = BTreeMap::new();
    if let Ok(map) = maps::open_pinned(dir, crate::node::ring::STATS_MAP) {
        for (id, v) in maps::entries::<u32, crate::node::ring::RingServiceStats>(&map)? {
            ring_service.insert(id as u16, v);
        }
    }
    let ring_pool = crate::node::ring::pinned_ring_pool(dir)?.usage();
    let rings_on_demand = crate::node::control::published::read_rings(dir);
    Ok(NodeStatus { attach, serving, jobs, outcomes, drops, handoffs, broadcast, served, groups, rings, ring_service, ring_pool, rings_on_demand })
}

/// One member of a broadcast table, with its next-hop cache entry.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MemberStatus {
    /// Destination address and port.
    pub addr: std::net::SocketAddr,
    /// The cached next hop (`None`: not resolved yet; the next copy asks
    /// the FIB).
    pub next_hop: Option<NextHopStatus>,
}

/// A next-hop cache entry (`bcast_neigh`) as `status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NextHopStatus {
    /// Destination MAC (the next hop's).
    pub mac: String,
    /// Egress interface index.
    pub ifindex: u32,
    /// Marked stale by its timer: re-resolved at the next copy.
    pub stale: bool,
    /// Seconds since it was resolved.
    pub age_seconds: f64,
}

/// A broadcast table: the root table of a `[[group]]` (port 0) or a tree
/// node's forwarding table (the port it forwards from).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GroupStatus {
    /// Group id.
    pub id: u16,
    /// 0: the root table; else the receive port of a forwarding table.
    pub port: u16,
    /// Destinations, mask bit order.
    pub members: Vec<MemberStatus>,
    /// Its counters (datagrams broadcast, copies, next-hop misses, bytes).
    pub counters: Option<abi::BcastGroupStat>,
}

/// The broadcast tables of the pinned TC maps in `dir`, with every
/// member's next-hop cache entry.
fn group_statuses(dir: &Path) -> Result<Vec<GroupStatus>> {
    let tables = maps::open_pinned(dir, maps::names::BCAST_GROUPS)?;
    let gstats = maps::open_pinned(dir, maps::names::BCAST_GSTATS).ok();
    let neigh = maps::open_pinned(dir, maps::names::BCAST_NEIGH).ok();
    let mut cache: Vec<(std::net::IpAddr, abi::Neigh)> = Vec::new();
    if let Some(map) = &neigh {
        for (key, n) in maps::entries::<abi::NeighKey, abi::Neigh>(map)? {
            cache.extend(key.ip().map(|a| (a, n)));
        }
    }
    // bpf_ktime_get_ns is CLOCK_MONOTONIC.
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now_ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let mut out = Vec::new();
    for (key, table) in maps::entries::<abi::GroupKey, abi::Group>(&tables)? {
        let members = table
            .dests
            .iter()
            .take(table.count.min(abi::BCAST_MAX_DESTS) as usize)
            .filter_map(|d| d.socket_addr())
            .map(|addr| {
                let ip = addr.ip();
                MemberStatus {
                    addr,
                    next_hop: cache.iter().find(|(a, _)| *a == ip).map(|(_, n)| NextHopStatus {
                        mac: n.dmac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
                        ifindex: n.ifindex,
                        stale: n.flags & abi::NEIGH_F_STALE != 0,
                        age_seconds: now_ns.saturating_sub(n.updated_ns) as f64 / 1e9,
                    }),
                }
            })
            .collect();
        let counters = match &gstats {
            Some(map) => maps::lookup_percpu_sum(map, abi::as_bytes(&key))?,
            None => None,
        };
        out.push(GroupStatus { id: key.group, port: key.port, members, counters });
    }
    out.sort_by_key(|g| (g.id, g.port));
    Ok(out)
}

/// Rates per second between two statuses of one attachment taken
/// `seconds` apart (`aggbox status --watch`): per job (contributions the
/// kernel took, RESULTs, retransmissions, drops, payload), per outcome and
/// per drop reason, per group (copies, next-hop misses). Counters that went
/// backwards (a job removed and added again by a reload) count from zero.
pub fn format_rates(before: &NodeStatus, now: &NodeStatus, seconds: f64) -> String {
    use std::fmt::Write;
    let rate = |a: u64, b: u64| if b >= a { (b - a) as f64 / seconds } else { b as f64 / seconds };
    let mut s = String::new();
    let _ = writeln!(s, "{}: rates per second over {seconds:.1} s", now.attach.iface);
    for job in &now.jobs {
        let old = before.jobs.iter().find(|j| j.id == job.id).and_then(|j| j.counters).unwrap_or_default();
        let Some(c) = job.counters else { continue };
        let _ = writeln!(
            s,
            "  job {:5}  contributions {:>10.0}  results {:>10.0}  retransmissions {:>8.0}  dropped {:>8.0}  {:>10.1} MB/s",
            job.id,
            rate(old.accepted + old.results, c.accepted + c.results),
            rate(old.results, c.results),
            rate(old.retransmissions, c.retransmissions),
            rate(old.dropped, c.dropped),
            rate(old.bytes, c.bytes) / 1e6
        );
    }
    let moving = |title: &str, a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>, s: &mut String| {
        let rows: Vec<(String, f64)> = b
            .iter()
            .map(|(k, &v)| (k.clone(), rate(a.get(k).copied().unwrap_or(0), v)))
            .filter(|(_, r)| *r > 0.0)
            .collect();
        if !rows.is_empty() {
            let _ = writeln!(s, "  {title}:");
            for (k, r) in rows {
                let _ = writeln!(s, "    {k:<28} {r:>12.0}");
            }
        }
    };
    moving("datagrams by outcome", &before.outcomes, &now.outcomes, &mut s);
    moving("dropped by reason", &before.drops, &now.drops, &mut s);
    moving("handed to user space by reason", &before.handoffs, &now.handoffs, &mut s);
    for g in &now.groups {
        let old = before.groups.iter().find(|o| (o.id, o.port) == (g.id, g.port)).and_then(|o| o.counters).unwrap_or_default();
        let Some(c) = g.counters else { continue };
        let _ = writeln!(
            s,
            "  group {:5} port {:5}  broadcasts {:>8.0}  copies {:>10.0}  next-hop misses {:>8.0}",
            g.id,
            g.port,
            rate(old.datagrams, c.datagrams),
            rate(old.copies, c.copies),
            rate(old.neigh_misses, c.neigh_misses)
        );
    }
    s
}

/// Human-readable status table.
/// `up S s  renewed S s ago, expires in S s` of something on demand
/// (times in ms since the Unix epoch).
fn lease_text(created_ms: u64, renewed_ms: u64, expires_ms: u64) -> String {
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_millis() as u64);
    let seconds = |ms: u64| ms as f64 / 1000.0;
    format!(
        "up {:.1} s  renewed {:.1} s ago, expires in {:.1} s",
        seconds(now_ms.saturating_sub(created_ms)),
        seconds(now_ms.saturating_sub(renewed_ms)),
        seconds(expires_ms.saturating_sub(now_ms))
    )
}

pub fn format_status(status: &NodeStatus) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let a = &status.attach;
    let _ = writeln!(
        s,
        "{}: ifindex {}, XDP {} mode{}, attached by pid {} ({})",
        a.iface,
        a.ifindex,
        a.xdp_mode,
        if a.xdp_chain.is_empty() { String::new() } else { format!(", {} chain", a.xdp_chain) },
        a.pid,
        if status.serving { "serving" } else { "not running: stale, `aggbox detach` cleans up" }
    );
    if a.lo_xdp {
        let _ = writeln!(s, "  also on lo (XDP generic mode): a worker runs on this host");
    }
    let _ = writeln!(
        s,
        "  TC broadcast: {}; user-space path: {}",
        match (a.tc, a.tc_lo) {
            (true, true) => "attached (ingress on lo too, for the RESULTs of this host's worker)",
            (true, false) => "attached",
            (false, _) => "not attached (no groups or result routes)",
        },
        match (&a.userspace_path_error, a.userspace_path) {
            (_, true) => "running (AF_XDP)".to_string(),
            (Some(e), false) => format!("NOT RUNNING ({e}): ops 5..8, FLOAT32 and slot-pool overflow reach the stack unaggregated"),
            (None, false) => "not running".to_string(),
        }
    );
    if let Some(r) = &a.last_reload {
        let _ = writeln!(
            s,
            "  reloads: {}; the last {} ({} s after the attach): {}",
            a.reloads,
            if r.ok { "applied" } else { "REFUSED" },
            r.at.saturating_sub(a.attached_at),
            r.message
        );
    }
    let _ = writeln!(s, "  jobs:");
    if status.jobs.is_empty() {
        let _ = writeln!(s, "    (none)");
    }
    for job in &status.jobs {
        let _ = writeln!(
            s,
            "    job {:5}  port {:5} -> results on {:5}  workers {:3}  vector_len {}  slots {}",
            job.id,
            job.port,
            job.result_port,
            job.workers,
            if job.vector_len == 0 { "-".to_string() } else { job.vector_len.to_string() },
            job.slots
        );
        if let Some(d) = &job.on_demand {
            let _ = writeln!(
                s,
                "      on demand: tenant {} run {:?} incarnation {}  {}{}",
                d.tenant,
                d.run,
                d.incarnation,
                lease_text(d.created_ms, d.renewed_ms, d.expires_ms),
                if d.ended.is_empty() { String::new() } else { format!("  ended ranks {:?}", d.ended) }
            );
            if let Some(r) = d.ring {
                let _ = writeln!(s, "      ring: {r} at the ranks' own nodes");
            }
            if let Some(t) = &d.tree {
                let _ = writeln!(
                    s,
                    "      tree: leaf {} of {} under root {}{}",
                    t.leaf,
                    t.leaves,
                    t.root,
                    t.root_job.map_or(" (waiting for its job)".to_string(), |j| format!(" job {j}"))
                );
            }
        }
        if let Some(c) = &job.counters {
            let _ = writeln!(
                s,
                "      counters: accepted {} result {} (overflow {}) retransmission {} stale {} to_userspace {} dropped {}  payload {} B",
                c.accepted, c.results, c.overflow_results, c.retransmissions, c.stale, c.handed_to_userspace, c.dropped, c.bytes
            );
        }
    }
    if a.tc {
        let _ = writeln!(s, "  groups:");
        if status.groups.is_empty() {
            let _ = writeln!(s, "    (none)");
        }
    }
    for g in &status.groups {
        let table = if g.port == 0 { "root table".to_string() } else { format!("forwarding table of port {}", g.port) };
        let counters = g.counters.map_or(String::new(), |c| {
            format!(": broadcast {} copies {} next-hop misses {} payload {} B", c.datagrams, c.copies, c.neigh_misses, c.bytes)
        });
        let _ = writeln!(s, "    group {:5}  {table}, {} member(s){counters}", g.id, g.members.len());
        for m in &g.members {
            let hop = match &m.next_hop {
                Some(h) => format!(
                    "next hop {} via ifindex {}, resolved {:.1} s ago{}",
                    h.mac,
                    h.ifindex,
                    h.age_seconds,
                    if h.stale { " (stale: re-resolved at the next copy)" } else { "" }
                ),
                None => "next hop not resolved yet".to_string(),
            };
            let _ = writeln!(s, "      {:<21} {hop}", m.addr.to_string());
        }
    }
    let _ = writeln!(s, "  datagrams by outcome:");
    for (name, count) in &status.outcomes {
        let _ = writeln!(s, "    {name:<28} {count:>12}");
    }
    let _ = writeln!(s, "  dropped by reason:");
    for (name, count) in &status.drops {
        let _ = writeln!(s, "    {name:<28} {count:>12}");
    }
    if status.handoffs.values().any(|&c| c > 0) {
        let _ = writeln!(s, "  handed to user space by reason:");
        for (name, count) in &status.handoffs {
            let _ = writeln!(s, "    {name:<28} {count:>12}");
        }
    }
    if !status.broadcast.is_empty() {
        let _ = writeln!(s, "  broadcast (TC) counters:");
        for (name, count) in &status.broadcast {
            let _ = writeln!(s, "    {name:<28} {count:>12}");
        }
    }
    for (job, st) in &status.served {
        let _ = writeln!(s, "  job {job} served by the node (consumer = \"node\"):");
        for (name, count) in [
            ("rounds", st.rounds),
            ("results", st.results),
            ("duplicate_results", st.duplicate_results),
            ("acks_sent", st.acks_sent),
            ("acks_received", st.acks_received),
            ("resent", st.resent),
            ("workers_behind", st.workers_behind),
            ("refused_results", st.refused_results),
            ("refused_acks", st.refused_acks),
            ("other", st.other),
            ("upstream_sent", st.upstream_sent),
            ("upstream_resent", st.upstream_resent),
            ("upstream_acks", st.upstream_acks),
            ("upstream_held", st.upstream_held),
            ("parent_results", st.parent_results),
            ("duplicate_parent_results", st.duplicate_parent_results),
            ("parent_acks_sent", st.parent_acks_sent),
            ("position_queries", st.position_queries),
            ("refused_queries", st.refused_queries),
            ("released_slots", st.released_slots),
        ] {
            let _ = writeln!(s, "    {name:<28} {count:>12}");
        }
    }
    let pool = &status.ring_pool;
    if pool.reserved > 0 {
        let _ = writeln!(
            s,
            "  ring pool: {} elements reserved (fragments of {}), {} used, {} free (largest free region {})",
            pool.reserved, pool.frag_elems, pool.used, pool.free, pool.largest_free
        );
    }
    for (ring, d) in &status.rings_on_demand {
        let lease = lease_text(d.created_ms, d.renewed_ms, d.expires_ms);
        let _ = writeln!(s, "  ring {ring} on demand: tenant {} run {:?}  {} members  {lease}", d.tenant, d.run, d.members);
    }
    for (ring, counts) in &status.rings {
        let _ = writeln!(s, "  ring {ring} (XDP):");
        for (name, count) in counts {
            let _ = writeln!(s, "    {name:<28} {count:>12}");
        }
    }
    for (ring, st) in &status.ring_service {
        let _ = writeln!(s, "  ring {ring} service:");
        for (name, _, count) in st.counters() {
            let _ = writeln!(s, "    {name:<28} {count:>12}");
        }
    }
    s
}

