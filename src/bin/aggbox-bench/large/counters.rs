//! The counters a point records: the node's XDP and TC counters, the
//! hosts' UDP counters, the runtime's own, and this process's context
//! switches, as deltas over a phase.

use std::collections::BTreeMap;
use std::path::Path;

use aggbox::node;
use aggbox::runtime::StripedCommunicator;
use crate::testbed::{in_netns, Testbed};

use super::worker_count;

/// Non-zero counters of the node on host 0 (outcomes, `drop:`, `handoff:`,
/// `tc:`), as `aggbox status` shows them.
pub(super) fn node_counters(netns: &str, pins: &Path) -> BTreeMap<String, u64> {
    let st = in_netns(netns, || node::status(Some("eth0"), pins))
        .ok()
        .and_then(|r| r.ok());
    let mut out = BTreeMap::new();
    if let Some(s) = st.and_then(|mut v| {
        if v.is_empty() {
            None
        } else {
            Some(v.remove(0))
        }
    }) {
        for (k, v) in s.outcomes {
            out.insert(k, v);
        }
        for (k, v) in s.drops {
            out.insert(format!("drop:{k}"), v);
        }
        for (k, v) in s.handoffs {
            out.insert(format!("handoff:{k}"), v);
        }
        for (k, v) in s.broadcast {
            out.insert(format!("tc:{k}"), v);
        }
        // Rings: the XDP program's and the node service's counters, summed
        // over the rings (a ring point runs one ring at a time).
        for (k, v) in s.rings.into_values().flatten() {
            *out.entry(format!("ring:{k}")).or_default() += v;
        }
        for (k, _, v) in s.ring_service.into_values().flat_map(|st| st.counters()) {
            *out.entry(format!("ring_service:{k}")).or_default() += v;
        }
    }
    out
}

/// UDP counters of a host's namespace (`/proc/net/snmp`, the `Udp:` rows):
/// `RcvbufErrors` says datagrams were dropped because a socket's receive
/// buffer was full.
pub(super) fn udp_counters(netns: &str) -> BTreeMap<String, u64> {
    let text = in_netns(netns, || {
        std::fs::read_to_string("/proc/thread-self/net/snmp")
    })
    .ok()
    .and_then(|r| r.ok())
    .unwrap_or_default();
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("Udp:")).collect();
    let mut out = BTreeMap::new();
    if let [names, values] = rows[..] {
        for (n, v) in names
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
        {
            if let Ok(v) = v.parse::<u64>() {
                if matches!(
                    n,
                    "InDatagrams" | "InErrors" | "RcvbufErrors" | "SndbufErrors"
                ) {
                    out.insert(n.to_string(), v);
                }
            }
        }
    }
    out
}

/// Node counters of host 0 plus the UDP counters of host 0 (`h0:udp:`) and
/// of the workers summed (`workers:udp:`).
pub(super) fn all_counters(tb: &Testbed, pins: &Path, kernel: bool) -> BTreeMap<String, u64> {
    let mut out = if kernel {
        node_counters(&tb.host(0).netns, pins)
    } else {
        BTreeMap::new()
    };
    for (k, v) in udp_counters(&tb.host(0).netns) {
        out.insert(format!("h0:udp:{k}"), v);
    }
    for h in 1..=worker_count() {
        for (k, v) in udp_counters(&tb.host(h).netns) {
            *out.entry(format!("workers:udp:{k}")).or_insert(0) += v;
        }
    }
    out
}

pub(super) fn counter_delta(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.saturating_sub(before.get(k).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// Counters of all participants' runtimes summed (`runtime:`): datagrams
/// they resent, and data datagrams they received a second time (a resend
/// that was not needed, or one whose ACK was lost).
pub(super) fn runtime_counters(
    agg: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for c in agg.into_iter().chain(workers) {
        let s = c.stats();
        *out.entry("runtime:retransmitted".to_string()).or_insert(0) += s.retransmitted;
        *out.entry("runtime:duplicates_received".to_string()).or_insert(0) +=
            s.duplicates_received;
        if s.acks_repeated > 0 {
            *out.entry("runtime:acks_repeated".to_string()).or_insert(0) += s.acks_repeated;
        }
    }
    out
}

pub(super) fn counters_line(c: &BTreeMap<String, u64>) -> String {
    if c.is_empty() {
        return "(none)".into();
    }
    c.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// This process's (voluntary, involuntary) context switches so far, all
/// threads (`getrusage(RUSAGE_SELF)`).
pub(super) fn process_context_switches() -> (u64, u64) {
    // SAFETY: zeroed rusage is valid; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    (u.ru_nvcsw as u64, u.ru_nivcsw as u64)
}
