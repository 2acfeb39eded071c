//! The AggBox runtime as the aggregator of a workload (the parameter
//! server's and the ingest's reductions).

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use crate::testbed::in_netns;
use aggbox::node::tools;

use super::{kernel_counters, Harness, JOB, JOB_PORT, RESULT_PORT};

/// Data port of the runtime workers' sockets (section 1b).
pub const RT_DATA_PORT: u16 = 7100;

/// Section 1b: one `reduce_i32` (SUM) of `elements` per worker through
/// `aggbox::runtime` (4 workers + the aggregator application, each its own
/// `Communicator` in its namespace), socket backend vs kernel backend (XDP
/// attached on host 0). Returns seconds per call and whether the result
/// matched, per repetition; an error names the failing call.
pub fn runtime_reduce(h: &Harness, kernel: bool, elements: usize, reps: usize) -> Result<Vec<f64>> {
    with_runtime(h, kernel, None, |aggc, workers| {
        let senders = workers.len();
        let backend = if kernel { "Kernel" } else { "Socket" };
        let inputs: Vec<Vec<i32>> = (0..senders)
            .map(|r| tools::pattern_vector(r as u16, elements as u32))
            .collect();
        let want: Vec<i32> = (0..elements)
            .map(|i| inputs.iter().map(|v| v[i]).sum())
            .collect();
        let mut times = Vec::new();
        for rep in 0..reps {
            let t0 = Instant::now();
            let (agg_out, errs) = std::thread::scope(|s| {
                let hs: Vec<_> = workers
                    .iter()
                    .zip(&inputs)
                    .map(|(c, v)| {
                        s.spawn(move || {
                            let mut v = v.clone();
                            c.reduce(&mut v, Op::Sum).map(|_| ())
                        })
                    })
                    .collect();
                let mut out = vec![0i32; elements];
                let r = aggc.reduce(&mut out, Op::Sum);
                let errs: Vec<String> = hs
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, h)| match h.join() {
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => Some(format!("worker {i}: {e}")),
                        Err(_) => Some(format!("worker {i} panicked")),
                    })
                    .collect();
                (r.map(|_| out), errs)
            });
            let secs = t0.elapsed().as_secs_f64();
            let out = agg_out.map_err(|e| anyhow!("{backend} backend, rep {rep}: aggregator reduce_i32 failed: {e}; workers: {errs:?}"))?;
            if !errs.is_empty() {
                bail!("{backend} backend, rep {rep}: {}", errs.join("; "));
            }
            let wrong = out.iter().zip(&want).filter(|(a, b)| a != b).count();
            if wrong > 0 {
                bail!("{backend} backend, rep {rep}: {wrong} of {elements} elements differ from the reference sum");
            }
            times.push(secs);
        }
        Ok(times)
    })
}

/// Build the runtime communicators of [`Harness`]'s job (4 workers = the
/// sender hosts, each on `RT_DATA_PORT`; the aggregator application on host
/// 0), with AggBox attached on host 0 for the kernel backend, run `f`, and
/// detach. `quantization` sets the float quantization (default: runtime's).
pub fn with_runtime<T>(
    h: &Harness,
    kernel: bool,
    quantization: Option<aggbox::runtime::Quantization>,
    f: impl FnOnce(&aggbox::runtime::Communicator, &[aggbox::runtime::Communicator]) -> Result<T>,
) -> Result<T> {
    use aggbox::runtime::{BackendKind, Communicator, Participant};
    let senders = h.senders.len();
    let agg = h.tb.host(0);
    let peers: Vec<SocketAddrV4> = h
        .worker_addrs()
        .iter()
        .map(|a| SocketAddrV4::new(*a, RT_DATA_PORT))
        .collect();
    let backend = if kernel {
        BackendKind::Kernel
    } else {
        BackendKind::Socket
    };
    let build = |me: Participant, netns: &str| -> Result<Communicator> {
        let peers = peers.clone();
        in_netns(netns, move || {
            let mut b = Communicator::builder(JOB, peers, agg.addr, JOB_PORT, me)
                .backend(backend)
                .result_port(RESULT_PORT)
                .deadline(Duration::from_secs(60));
            if let Some(q) = quantization {
                b = b.quantization(q);
            }
            b.build()
                .map_err(|e| anyhow!("building the {me:?} communicator ({backend:?} backend): {e}"))
        })?
    };
    let text = h.config_text();
    let pins = h.bpffs.path.clone();
    let att = if kernel {
        Some(in_netns(&agg.netns, || -> Result<node::Attachment> {
            let config =
                Config::parse(&text, "bench.toml").map_err(|e| anyhow!("bench config: {e}"))?;
            node::attach("eth0", &config, None, &pins, XdpMode::Native)
        })??)
    } else {
        None
    };
    let result = (|| -> Result<T> {
        let aggc = build(Participant::Aggregator, &agg.netns)?;
        let workers: Vec<Communicator> = (0..senders)
            .map(|r| build(Participant::Worker(r as u16), &h.tb.host(r + 1).netns))
            .collect::<Result<_>>()?;
        f(&aggc, &workers)
    })();
    if let Some(att) = att {
        // A failure against the live XDP program: say what the kernel saw.
        let result = result.map_err(|e| match kernel_counters(&att) {
            Some(c) => e.context(format!("XDP counters at the failure: {c}")),
            None => e,
        });
        att.detach()?;
        return result;
    }
    result
}
