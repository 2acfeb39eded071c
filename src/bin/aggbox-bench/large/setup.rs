//! The testbed of a run at one MTU: its veth queues, and the largest MTU
//! that comes up.

use anyhow::{bail, Context, Result};

use crate::progress;
use crate::testbed::{Testbed, TestbedConfig};

use super::{env_list, largest_aggbox_mtu, worker_count};

// ------------------------------------------------------------ experiment ----

/// Veth queues of the testbed (`testbed.sh --queues`, each TX queue one
/// CPU's): a queue per CPU on a machine of 4 or more CPUs, the kernel's
/// default (one TX queue) below. With XDP on the aggregator's veth each RX
/// queue is one NAPI context, and the queue a frame takes is the bridge
/// port's TX queue: with one, one CPU at a time runs the aggregator's XDP
/// program for every worker, as on a NIC without RSS. Measured (21.8 M
/// elements, 4 workers, s per call at MTU 1500 / 65535; a 16-core machine
/// confined with taskset): 16 CPUs 2.26 / 0.265 with one queue, 1.65 /
/// 0.212 with 16; 4 CPUs 1.43 / 0.290 and 1.50 / 0.212; 2 CPUs 1.56 /
/// 0.289 and 2.09 / 0.339 (this 2-vCPU VM: 1.49–1.62 / 0.20–0.24 and 2.49–
/// 2.62 / 0.18–0.19): on 2 CPUs, which the workers already keep busy, the
/// second NAPI context only adds cross-CPU wake-ups and contention for the
/// same slots. `AGGBOX_LARGE_QUEUES=N` sets N, 0 the kernel's default.
pub(super) fn testbed_queues() -> Option<u32> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    match env_list("AGGBOX_LARGE_QUEUES").and_then(|q| q.first().copied()) {
        Some(0) => None,
        Some(q) => Some(q as u32),
        None => (cpus >= 4).then_some(cpus),
    }
}

/// Testbed at `mtu` (the aggregator and the workers' hosts), with the veth MTU
/// read back from host 1.
pub(super) fn testbed(mtu: u32) -> Result<Testbed> {
    let tb = Testbed::up(TestbedConfig {
        hosts: worker_count() + 1,
        // A prefix unique to this process (the default): two runs at once
        // must not tear down each other's namespaces.
        prefix: None,
        mtu,
        static_neigh: true,
        // the ring's XDP_TX (GRO on the switch's veth ends): for every
        // backend, so that all of them run on the same testbed
        xdp_tx: true,
        queues: testbed_queues(),
        ..Default::default()
    })
    .with_context(|| format!("testbed at MTU {mtu}"))?;
    let o = tb.run_in(1, &["cat", "/sys/class/net/eth0/mtu"])?;
    let got: u32 = String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    if got != mtu {
        bail!("testbed at MTU {mtu}: host 1's eth0 has MTU {got}");
    }
    Ok(tb)
}

/// The largest working MTU: the computed limit first, then lower ones, the
/// first testbed that comes up with it wins (and is used for the run).
pub(super) fn largest_testbed() -> Result<(u32, Testbed, Vec<String>)> {
    let mut tried = Vec::new();
    for mtu in [largest_aggbox_mtu(), 65_000, 32_768, 16_000] {
        match testbed(mtu) {
            Ok(tb) => return Ok((mtu, tb, tried)),
            Err(e) => {
                progress(format!("large: MTU {mtu} does not work here: {e:#}"));
                tried.push(format!("{mtu}: {e:#}"));
            }
        }
    }
    bail!("no large MTU works: {}", tried.join("; "))
}
