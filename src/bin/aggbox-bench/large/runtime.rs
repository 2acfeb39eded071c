//! The backends of the AggBox runtime's star (`kernel`, `kernel-node`,
//! `socket`, their `-xS` striped and `-f32` forms): the job's
//! configuration, the attached node and every participant's calls.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use crate::{progress, thousands, Csv, PrivateBpffs};
use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::runtime::{
    BackendKind, CallOptions, CommunicatorBuilder, Participant, Quantization, StripedCommunicator,
};
use crate::testbed::{in_netns, Testbed};

use super::{
    backend_name, call_deadline, call_times, check_result, env_list, fill_input, impair_switch,
    join_spans, loss, slots_for_mtu, worker_count, CallTime, Dtype, Gate, Point, DATA_PORT, GROUP,
    JOB, JOB_PORT, RESULT_PORT,
};
use super::counters::{all_counters, counter_delta, process_context_switches, runtime_counters};
use super::report::{csv_row, report_point};

/// `calls` allreduces of `n` elements (call 0 = warm-up) on every
/// participant at once; every participant's result checked.
pub(super) fn runtime_calls(
    agg: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
    n: usize,
    calls: usize,
    base: &[i32],
    dtype: Dtype,
) -> Result<Vec<CallTime>> {
    let parts: Vec<(&StripedCommunicator, Option<usize>)> = agg.map(|a| (a, None)).into_iter()
        .chain(workers.iter().enumerate().map(|(r, c)| (c, Some(r))))
        .collect();
    let gate = Gate::new(parts.len());
    let gate = &gate;
    let spans: Vec<Vec<(Instant, Instant)>> = std::thread::scope(
        |s| -> Result<Vec<Vec<(Instant, Instant)>>> {
            let hs: Vec<_> = parts
            .iter()
            .map(|&(c, rank)| {
                s.spawn(move || -> Result<Vec<(Instant, Instant)>> {
                    let who = match rank {
                        Some(r) => format!("worker {r}"),
                        None => "aggregator".to_string(),
                    };
                    let mut buf = vec![0i32; n];
                    let mut fbuf = vec![0f32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut out = Vec::with_capacity(calls);
                    for k in 0..calls {
                        match rank {
                            Some(r) => fill_input(&mut buf, r, k),
                            None => buf.iter_mut().for_each(|x| *x = 0),
                        }
                        // The float input: the same integers (outside the timing).
                        fbuf.iter_mut().zip(&buf).for_each(|(f, &i)| *f = i as f32);
                        if !gate.wait() {
                            bail!("{who}: stopped before call {k}: another participant failed");
                        }
                        let opts = CallOptions::deadline(call_deadline(n as u64));
                        let t0 = Instant::now();
                        let r = match dtype {
                            Dtype::I32 => c.allreduce_with(&mut buf, Op::Sum, opts).map(|_| ()),
                            Dtype::F32 => c.allreduce_with(&mut fbuf, Op::Sum, opts).map(|_| ()),
                        };
                        let t1 = Instant::now();
                        if let Err(e) = r {
                            gate.abort();
                            bail!("{who}: allreduce ({dtype:?}) of {n} elements, call {k}: {e}");
                        }
                        if let Err(e) = check_result(&who, &mut buf, &fbuf, base, k, dtype) {
                            gate.abort();
                            return Err(e);
                        }
                        out.push((t0, t1));
                    }
                    Ok(out)
                })
            })
            .collect();
            join_spans(hs, gate)
        },
    )?;
    // The workers' end: every participant but the aggregator application.
    Ok(call_times(&spans, calls, usize::from(agg.is_some())))
}

/// The node configuration: per stripe a job of the workers, its result group
/// (RESULT copied to every worker's data socket by TC) and slots, the block
/// pool's share at this MTU divided between the stripes' jobs.
pub(super) fn config_text(tb: &Testbed, mtu: u32, stripes: usize, node_served: bool) -> String {
    let workers: Vec<Ipv4Addr> = (1..=worker_count()).map(|h| tb.host(h).addr).collect();
    let list =
        |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    let k = stripes;
    let slots = (slots_for_mtu(mtu) / k as u32).max(1);
    let mut text = "[node]\nmetrics = \"off\"\n".to_string();
    for t in 0..k as u16 {
        let (job, port, result, group, data) =
            (JOB + t, JOB_PORT + 2 * t, RESULT_PORT + 2 * t, GROUP + t, DATA_PORT + t);
        let _ = write!(
            text,
            "\n[[job]]\nid = {job}\nport = {port}\nworkers = [{}]\nresult_port = {result}\nresult_group = {group}\nslots = {slots}\nconsumer = \"{}\"\n\n[[group]]\nid = {group}\nmembers = [{}]\n",
            list(&|w| format!("\"{w}\"")),
            if node_served { "node" } else { "application" },
            list(&|w| format!("\"{w}:{data}\"")),
        );
    }
    text
}

/// Every size of `dtypes` × `sizes` on these participants: a warm-up and
/// `reps` calls each, a point per size with the deltas of `counters()`
/// (read before and after), of the runtime's counters and of this
/// process's context switches (and the injector's drops under loss). A
/// failure at one size skips the larger ones of that dtype.
#[allow(clippy::too_many_arguments)]
pub(super) fn runtime_points(
    backend: &str,
    mtu: u32,
    aggc: Option<&StripedCommunicator>,
    workers: &[StripedCommunicator],
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    injector: &crate::impair::Injector,
    counters: &dyn Fn() -> BTreeMap<String, u64>,
) -> Vec<Point> {
    let mut points = Vec::new();
    for &dtype in dtypes {
        let name = dtype.backend(backend);
        let mut failed_at: Option<u64> = None;
        for &n in sizes {
            if let Some(f) = failed_at {
                points.push(Point::new(
                    &name,
                    mtu,
                    n,
                    &[],
                    Some(format!(
                        "skipped: the {} -element point failed",
                        thousands(f as f64)
                    )),
                ));
                continue;
            }
            let base = &bases[&n];
            let runtime_before = runtime_counters(aggc, workers);
            let before = counters();
            let dropped_before = injector.counts().dropped;
            progress(format!(
                "large: MTU {mtu}, {} elements, {name}: warm-up + {reps} calls",
                thousands(n as f64)
            ));
            let switches_before = process_context_switches();
            let r = runtime_calls(aggc, workers, n as usize, reps + 1, base, dtype);
            let switches = process_context_switches();
            let after = counters();
            let mut p = match r {
                Ok(times) => {
                    for (k, t) in times.iter().enumerate() {
                        csv_row(csv, &name, mtu, n, k, t.all, t.workers, true);
                    }
                    Point::new(&name, mtu, n, &times, None)
                }
                Err(e) => {
                    failed_at = Some(n);
                    Point::new(&name, mtu, n, &[], Some(format!("{e:#}")))
                }
            };
            p.node_counters = counter_delta(&before, &after);
            // This process's context switches over the point's calls
            // (every participant's threads and the bench's barrier).
            p.node_counters.insert("process:voluntary_ctxt_switches".into(), switches.0 - switches_before.0);
            p.node_counters.insert("process:involuntary_ctxt_switches".into(), switches.1 - switches_before.1);
            if loss() > 0.0 {
                p.node_counters.insert("injector:dropped".into(), injector.counts().dropped - dropped_before);
            }
            p.node_counters.extend(counter_delta(&runtime_before, &runtime_counters(aggc, workers)));
            report_point(&p);
            points.push(p);
        }
    }
    points
}

/// The AggBox backends at one MTU: attach (kernel), build the communicators
/// from the configuration, run every size. A failure at one size skips the
/// larger ones of this backend and MTU.
#[allow(clippy::too_many_arguments)]
pub(super) fn runtime_phase(
    tb: &Testbed,
    mtu: u32,
    kernel: bool,
    node_served: bool,
    stripes: usize,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let backend = backend_name(kernel, node_served, stripes);
    let backend = backend.as_str();
    let text = config_text(tb, mtu, stripes, node_served);
    let config = Config::parse(&text, "large.toml").map_err(|e| anyhow!("bench config: {e}"))?;
    let agg = tb.host(0);
    let bpffs = PrivateBpffs::mount("large")?;
    let pins = bpffs.path.clone();
    let att = if kernel {
        let c = config.clone();
        let p = pins.clone();
        let a = in_netns(&agg.netns, move || {
            node::attach("eth0", &c, None, &p, XdpMode::Native)
        })?
        .with_context(|| format!("attaching AggBox to host 0's eth0 at MTU {mtu}"))?;
        for w in &a.warnings {
            progress(format!("large: attach warning: {w}"));
        }
        Some(a)
    } else {
        None
    };
    let mut points = Vec::new();
    let injector = crate::impair::Injector::new();
    let result = (|| -> Result<()> {
        let jobs: Vec<u16> = (0..stripes as u16).map(|t| JOB + t).collect();
        let tune = |b: CommunicatorBuilder| -> CommunicatorBuilder {
            let b = b
                .backend(if kernel {
                    BackendKind::Kernel
                } else {
                    BackendKind::Socket
                })
                .mtu(mtu as usize)
                // Float calls only: the scale from the agreed max |x|.
                .quantization(Quantization::Adaptive)
                .deadline(call_deadline(sizes.iter().copied().max().unwrap_or(0)));
            // `AGGBOX_LARGE_WINDOW`: the configured window (then bounded as
            // always, docs/RUNTIME.md "Windows"), to compare windows.
            match env_list("AGGBOX_LARGE_WINDOW").and_then(|w| w.first().copied()) {
                Some(w) => b.window(w as u32),
                None => b,
            }
        };
        let build = |host: usize, me: Participant| -> Result<StripedCommunicator> {
            tb.in_host(host, || {
                StripedCommunicator::from_config(&config, &jobs, agg.addr, DATA_PORT, me, tune)
            })?
            .map_err(|e| {
                anyhow!("building the {me:?} communicator ({backend} backend, MTU {mtu}): {e}")
            })
        };
        // A node-served job has no aggregator application: the workers'
        // calls are the whole call.
        let aggc = if node_served { None } else { Some(build(0, Participant::Aggregator)?) };
        let workers: Vec<StripedCommunicator> = (0..worker_count())
            .map(|r| build(r + 1, Participant::Worker(r as u16)))
            .collect::<Result<_>>()?;
        if kernel && workers.iter().flat_map(|w| w.stripes()).any(|c| !c.config().kernel_result_group) {
            bail!("the kernel backend does not use the jobs' result_group");
        }
        if loss() > 0.0 {
            impair_switch(tb, &injector, loss())?;
        }
        points = runtime_points(
            backend,
            mtu,
            aggc.as_ref(),
            &workers,
            dtypes,
            sizes,
            reps,
            bases,
            csv,
            &injector,
            &|| all_counters(tb, &pins, kernel),
        );
        Ok(())
    })();
    if loss() > 0.0 {
        if let Err(e) = impair_switch(tb, &injector, 0.0) {
            progress(format!("large: removing the loss: {e:#}"));
        }
    }
    // The TC detach must run in the namespace the attach ran in.
    let detached = match att {
        Some(att) => in_netns(&agg.netns, move || att.detach())
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .context("detaching AggBox from host 0"),
        None => Ok(()),
    };
    drop(bpffs);
    if let Err(e) = result {
        for dtype in dtypes {
            let name = dtype.backend(backend);
            for &n in sizes {
                if !points.iter().any(|p| p.backend == name && p.elements == n) {
                    points.push(Point::new(&name, mtu, n, &[], Some(format!("{e:#}"))));
                }
            }
        }
    }
    if let Err(e) = detached {
        // What was measured stands; the failed detach is reported.
        points.push(Point::new(backend, mtu, 0, &[], Some(format!("{e:#}"))));
    }
    Ok(points)
}
