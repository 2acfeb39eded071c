//! Backend `sharded`: the sharded star (issue #26), one aggregator per
//! worker's host, each reducing one stripe of every vector.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Context, Result};

use crate::{Csv, PrivateBpffs};
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::runtime::{
    BackendKind, CommunicatorBuilder, Participant, Quantization, StripedCommunicator,
};
use crate::testbed::{in_netns, Testbed};

use super::{
    call_deadline, end_phase, slots_for_mtu, worker_count, Dtype, Point, DATA_PORT, GROUP, JOB,
};
use super::counters::node_counters;
use super::runtime::{config_text, runtime_points};

/// The `sharded` backend at one MTU, the sharded star (issue #26): worker
/// t's host runs `aggbox attach` for job `JOB + t` alone, which reduces
/// stripe t of every vector (`runtime::striped::stripe_bounds`) from all
/// workers and copies its RESULT to them (TC); every worker's
/// `StripedCommunicator` sends stripe t to worker t's address (its own
/// stripe through its host's lo, where the attach puts the program too).
/// As many datagrams as the ring (n − 1 contributions into and n − 1
/// copies out of each shard's node per fragment), in two steps instead of
/// 2(n − 1).
#[allow(clippy::too_many_arguments)]
pub(super) fn sharded_phase(
    tb: &Testbed,
    mtu: u32,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let workers_n = worker_count();
    let mut config = Config::parse(&config_text(tb, mtu, workers_n, true), "large-sharded.toml")
        .map_err(|e| anyhow!("bench sharded config: {e}"))?;
    // Each job has a node of its own: the whole slot bound of the MTU.
    for j in &mut config.jobs {
        j.slots = slots_for_mtu(mtu);
    }
    let bpffs = PrivateBpffs::mount("large-sharded")?;
    let mut attachments = Vec::new();
    let mut points = Vec::new();
    let injector = crate::impair::Injector::new();
    let result = (|| -> Result<()> {
        for t in 0..workers_n {
            let h = t + 1;
            let (job, group) = (JOB + t as u16, GROUP + t as u16);
            let mut c = config.clone();
            c.jobs.retain(|j| j.id == job);
            c.groups.retain(|g| g.id == group);
            let pins = bpffs.path.join(format!("h{h}"));
            std::fs::create_dir_all(&pins)?;
            // The node's own worker is a member of its result group: its
            // copy loops through lo with the host's own source address.
            let out = tb.run_in(h, &["sysctl", "-qw", "net.ipv4.conf.lo.accept_local=1"])?;
            if !out.status.success() {
                bail!("host {h}: sysctl net.ipv4.conf.lo.accept_local=1: {}", String::from_utf8_lossy(&out.stderr));
            }
            let a = in_netns(&tb.host(h).netns, move || node::attach("eth0", &c, None, &pins, XdpMode::Native))?
                .with_context(|| format!("attaching shard {t}'s node on host {h} at MTU {mtu}"))?;
            attachments.push((h, a));
        }
        let deadline = call_deadline(sizes.iter().copied().max().unwrap_or(0));
        let workers: Vec<StripedCommunicator> = (0..workers_n)
            .map(|r| {
                tb.in_host(r + 1, || -> std::result::Result<StripedCommunicator, aggbox::runtime::CommError> {
                    let stripes = (0..workers_n)
                        .map(|t| {
                            CommunicatorBuilder::from_config(
                                &config,
                                JOB + t as u16,
                                tb.host(t + 1).addr,
                                DATA_PORT + t as u16,
                                Participant::Worker(r as u16),
                            )?
                            .backend(BackendKind::Kernel)
                            .mtu(mtu as usize)
                            .quantization(Quantization::Adaptive)
                            .deadline(deadline)
                            .build()
                        })
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    StripedCommunicator::new(stripes)
                })?
                .map_err(|e| anyhow!("building worker {r}'s sharded communicator (MTU {mtu}): {e}"))
            })
            .collect::<Result<_>>()?;
        let counters = || {
            let mut sum = BTreeMap::new();
            for (h, a) in &attachments {
                for (k, v) in node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir())) {
                    *sum.entry(k).or_default() += v;
                }
            }
            sum
        };
        points = runtime_points("sharded", mtu, None, &workers, dtypes, sizes, reps, bases, csv, &injector, &counters);
        Ok(())
    })();
    end_phase(tb, attachments, "shard node", result, "sharded", dtypes, sizes, mtu, &mut points);
    drop(bpffs);
    Ok(points)
}
