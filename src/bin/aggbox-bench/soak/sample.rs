//! The soak's samples of the node processes (memory, descriptors, ports,
//! pins, metrics) and the bounds each sample must keep.

use std::collections::{BTreeSet, HashSet};
use std::io::{Read as _, Write as _};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::soak_worker::unix_ms;
use crate::testbed;

use super::{
    Shared, EPHEMERAL_FIRST, FD_SLACK, METRICS_PORT, NODE_HOST, RSS_BOUND_MIB, SAMPLE_EVERY,
    SERVED_JOB, SPARE_JOB, SPARE_RESULT_PORT, STAR_JOB, WARMUP,
};

/// One resource sample of one node.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Sample {
    pub(super) t_s: f64,
    pub(super) node: String,
    pub(super) incarnation: u32,
    pub(super) rss_mib: f64,
    pub(super) fds: i64,
    pub(super) pins: usize,
    pub(super) udp_ports: String,
    pub(super) slots_star: f64,
    pub(super) slots_served: f64,
    pub(super) slots_spare: f64,
    pub(super) blocks: f64,
    pub(super) dropped: u64,
    pub(super) duplicated: u64,
}

/// Every [`SAMPLE_EVERY`]: each node's resources, checked.
pub(super) fn sampler(s: &Arc<Shared>) {
    while s.running() {
        for i in 0..s.nodes.len() {
            let smp = sample_node(s, i);
            check_sample(s, i, &smp, false);
            s.samples.lock().unwrap().push(smp);
        }
        s.sleep_while_running(SAMPLE_EVERY);
    }
}

pub(super) fn proc_status_kib(pid: u32, key: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// UDP ports of the sockets process `pid` holds (its descriptors' inodes
/// looked up in its namespace's /proc/PID/net/udp).
pub(super) fn udp_ports(pid: u32) -> BTreeSet<u16> {
    let mut inodes = HashSet::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            if let Ok(l) = std::fs::read_link(e.path()) {
                let l = l.to_string_lossy();
                if let Some(i) = l.strip_prefix("socket:[").and_then(|x| x.strip_suffix(']')) {
                    inodes.insert(i.to_string());
                }
            }
        }
    }
    let mut ports = BTreeSet::new();
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/udp")).unwrap_or_default();
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() > 9 && inodes.contains(f[9]) {
            if let Some(p) = f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) {
                ports.insert(p);
            }
        }
    }
    ports
}

/// Everything pinned under `root` (relative paths), without the files
/// every bpffs has at its root (the kernel's preloaded iterators).
pub(super) fn list_pins(root: &Path) -> BTreeSet<String> {
    const BPFFS_OWN: [&str; 2] = ["maps.debug", "progs.debug"];
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let p = e.path();
                if d == root && BPFFS_OWN.iter().any(|n| e.file_name() == *n) {
                    continue;
                }
                out.insert(p.strip_prefix(root).unwrap_or(&p).to_string_lossy().into_owned());
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    stack.push(p);
                }
            }
        }
    }
    out
}

/// Node h0's /metrics (NaN-filled when it does not answer).
pub(super) fn metrics(s: &Shared) -> Option<String> {
    testbed::in_netns(&s.tb.host(NODE_HOST).netns, || -> Option<String> {
        let mut stream = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], METRICS_PORT).into(), Duration::from_secs(2)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        Some(text)
    })
    .ok()
    .flatten()
}

pub(super) fn gauge(text: &str, name: &str, job: Option<u16>) -> f64 {
    let label = job.map(|j| format!("aggbox_job=\"{j}\""));
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| label.as_ref().map(|lb| l.contains(lb.as_str())).unwrap_or(true))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .fold(0.0, |a, b| a + b)
}

pub(super) fn sample_node(s: &Shared, i: usize) -> Sample {
    let (pid, name, incarnation, pin_root) = {
        let n = s.nodes[i].lock().unwrap();
        (n.pid(), n.name.clone(), n.incarnation, n.pins.path.clone())
    };
    let counts = s.injector.counts();
    let mut smp = Sample {
        t_s: s.t(),
        node: name,
        incarnation,
        rss_mib: f64::NAN,
        fds: -1,
        pins: list_pins(&pin_root).len(),
        slots_star: f64::NAN,
        slots_served: f64::NAN,
        slots_spare: f64::NAN,
        blocks: f64::NAN,
        dropped: counts.dropped,
        duplicated: counts.duplicated,
        ..Default::default()
    };
    if let Some(pid) = pid {
        smp.rss_mib = proc_status_kib(pid, "VmRSS:").map(|k| k / 1024.0).unwrap_or(f64::NAN);
        smp.fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as i64).unwrap_or(-1);
        smp.udp_ports = udp_ports(pid).iter().map(u16::to_string).collect::<Vec<_>>().join(";");
    }
    if i == 0 {
        if let Some(text) = metrics(s) {
            smp.slots_star = gauge(&text, "aggbox_job_slots_active", Some(STAR_JOB));
            smp.slots_served = gauge(&text, "aggbox_job_slots_active", Some(SERVED_JOB));
            smp.slots_spare = gauge(&text, "aggbox_job_slots_active", Some(SPARE_JOB));
            smp.blocks = gauge(&text, "aggbox_blocks_in_use", None);
        }
    }
    smp
}

/// Check one sample against the bounds (`end`: the final sample, with no
/// run going and the spare job removed).
pub(super) fn check_sample(s: &Shared, i: usize, smp: &Sample, end: bool) {
    let mut n = s.nodes[i].lock().unwrap();
    if n.child.is_none() || n.started.elapsed() < Duration::from_secs(5) {
        return;
    }
    let name = n.name.clone();
    // Pins: the set of the first check, always (reloads and restarts
    // change map contents, not pins).
    let pins = list_pins(&n.pins.path);
    match &n.pins_base {
        None => n.pins_base = Some(pins),
        Some(base) => {
            let extra: Vec<&String> = pins.difference(base).collect();
            let missing: Vec<&String> = base.difference(&pins).collect();
            if !extra.is_empty() {
                s.violation(format!("node {name}: pins beyond the expected set: {extra:?}"));
            }
            if !missing.is_empty() {
                s.violation(format!("node {name}: expected pins missing: {missing:?}"));
            }
        }
    }
    // UDP ports: node h0 holds its served jobs' result ports, a ring node
    // its ring's port, and each as many ephemeral ports (its unbound
    // sending socket) as at its first check; nothing else.
    let ports: BTreeSet<u16> = smp.udp_ports.split(';').filter_map(|p| p.parse().ok()).collect();
    let quiet = unix_ms().saturating_sub(*s.last_reload_ms.lock().unwrap()) > 3000;
    if quiet && smp.fds >= 0 {
        let mut named: BTreeSet<u16> = BTreeSet::new();
        if i == 0 {
            named.insert(7201);
            if *s.spare.lock().unwrap() != 0 {
                named.insert(SPARE_RESULT_PORT);
            }
        } else {
            named.insert(7400);
        }
        let ephemeral = ports.iter().filter(|p| **p >= EPHEMERAL_FIRST && !named.contains(p)).count();
        let base = *n.ephemeral_base.get_or_insert(ephemeral);
        let other: Vec<&u16> = ports.iter().filter(|p| **p < EPHEMERAL_FIRST && !named.contains(p)).collect();
        let missing: Vec<&u16> = named.difference(&ports).collect();
        if !other.is_empty() || !missing.is_empty() || ephemeral > base {
            s.violation(format!(
                "node {name}: UDP ports {ports:?} where {named:?} and {base} ephemeral port(s) are expected"
            ));
        }
    }
    // Descriptors and memory against the first sample after warm-up.
    let warm = s.t0.elapsed() >= WARMUP && n.started.elapsed() >= Duration::from_secs(20);
    if warm && smp.fds >= 0 && smp.rss_mib.is_finite() {
        let rss_kib = smp.rss_mib * 1024.0;
        let base_rss = *n.rss_base_kib.get_or_insert(rss_kib);
        let base_fds = *n.fd_base.get_or_insert(smp.fds);
        if rss_kib > base_rss + RSS_BOUND_MIB * 1024.0 {
            s.violation(format!(
                "node {name}: resident memory {:.1} MiB grew past its first warmed sample {:.1} MiB + {RSS_BOUND_MIB} MiB",
                smp.rss_mib,
                base_rss / 1024.0
            ));
        }
        let slack = if end { 2 } else { FD_SLACK };
        if smp.fds > base_fds + slack {
            s.violation(format!("node {name}: {} open descriptors, more than the first warmed sample's {base_fds} + {slack}", smp.fds));
        }
    }
}
