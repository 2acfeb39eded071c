//! Backend `ring`: the in-kernel ring allreduce (docs/RING.md), every
//! worker's host attached as a ring member.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use crate::{progress, thousands, Csv, PrivateBpffs};
use aggbox::wire::abi::{self, Op};
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::runtime::Quantization;
use crate::testbed::{in_netns, Testbed};

use super::{
    call_deadline, call_times, check_ints, check_result, end_phase, fill_input, join_spans,
    worker_count, CallTime, Dtype, Gate, Point,
};
use super::counters::{counter_delta, node_counters};
use super::report::{csv_row, report_point};

/// First ring id and port of the `ring` points (ring `RING + i` on port
/// `RING_PORT + i` reduces `sizes[i]` elements).
pub(super) const RING: u16 = 40;
pub(super) const RING_PORT: u16 = 7400;

/// Elements per ring datagram at `mtu`: a full datagram (the XDP program
/// edits frames larger than a page in 256-element chunks), even.
pub(super) fn ring_frag_elems(mtu: u32) -> u32 {
    ((mtu.saturating_sub(52) / 4).min(abi::RING_MAX_FRAG_ELEMS) & !1).max(2)
}

/// Configuration of the ring points: one `[[ring]]` per size over the
/// workers' hosts (no aggregator: host 0 is idle).
pub(super) fn ring_config_text(tb: &Testbed, mtu: u32, sizes: &[u64]) -> String {
    let members: Vec<String> = (1..=worker_count()).map(|h| format!("\"{}\"", tb.host(h).addr)).collect();
    let mut text = "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\n".to_string();
    for (i, &n) in sizes.iter().enumerate() {
        let _ = write!(
            text,
            "\n[[ring]]\nid = {}\nport = {}\nmembers = [{}]\nvector_len = {n}\nfrag_elems = {}\n",
            RING + i as u16,
            RING_PORT + i as u16,
            members.join(", "),
            ring_frag_elems(mtu)
        );
    }
    text
}

/// The `ring` backend at one MTU (docs/RING.md): every worker's host
/// attaches as a ring member, each worker calls its RingCommunicator.
pub(super) fn ring_phase(
    tb: &Testbed,
    mtu: u32,
    dtypes: &[Dtype],
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let text = ring_config_text(tb, mtu, sizes);
    let config = Config::parse(&text, "large-ring.toml").map_err(|e| anyhow!("bench ring config: {e}"))?;
    let bpffs = PrivateBpffs::mount("large-ring")?;
    let mut attachments = Vec::new();
    let mut points = Vec::new();
    let result = (|| -> Result<()> {
        for h in 1..=worker_count() {
            let c = config.clone();
            let pins = bpffs.path.join(format!("h{h}"));
            std::fs::create_dir_all(&pins)?;
            let a = in_netns(&tb.host(h).netns, move || node::attach("eth0", &c, None, &pins, XdpMode::Native))?
                .with_context(|| format!("attaching ring member host {h} at MTU {mtu}"))?;
            attachments.push((h, a));
        }
        for &dtype in dtypes {
            let name = dtype.backend("ring");
            for (i, &n) in sizes.iter().enumerate() {
                let ring_id = RING + i as u16;
                let mut comms = Vec::new();
                for (h, a) in &attachments {
                    let pin_dir = a.pin_dir().to_path_buf();
                    let c = tb
                        .in_host(*h, || aggbox::runtime::RingCommunicator::open(&config, ring_id, &pin_dir))?
                        .map_err(|e| anyhow!("opening ring {ring_id} on host {h}: {e}"))?;
                    comms.push(c);
                }
                for c in &mut comms {
                    c.set_deadline(call_deadline(n));
                    c.set_quantization(Quantization::Adaptive);
                }
                let before: Vec<BTreeMap<String, u64>> =
                    attachments.iter().map(|(h, a)| node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir()))).collect();
                progress(format!("large: MTU {mtu}, {} elements, {name}: warm-up + {reps} calls", thousands(n as f64)));
                let r = ring_calls(&mut comms, n as usize, reps + 1, &bases[&n], dtype);
                let mut p = match r {
                    Ok(times) => {
                        for (k, t) in times.iter().enumerate() {
                            csv_row(csv, &name, mtu, n, k, t.all, t.workers, true);
                        }
                        Point::new(&name, mtu, n, &times, None)
                    }
                    Err(e) => Point::new(&name, mtu, n, &[], Some(format!("{e:#}"))),
                };
                p.elements_per_datagram = Some(ring_frag_elems(mtu) as usize);
                for ((h, a), b) in attachments.iter().zip(&before) {
                    let after = node_counters(&tb.host(*h).netns, a.pin_dir().parent().unwrap_or(a.pin_dir()));
                    for (k, v) in counter_delta(b, &after) {
                        *p.node_counters.entry(k).or_default() += v;
                    }
                }
                report_point(&p);
                points.push(p);
            }
        }
        Ok(())
    })();
    end_phase(tb, attachments, "ring member", result, "ring", dtypes, sizes, mtu, &mut points);
    drop(bpffs);
    Ok(points)
}

/// `calls` ring allreduces of `n` elements (call 0 = warm-up) on every
/// member at once, every result checked (as [`runtime_calls`]). An int32
/// call is the ring's zero-copy call: the input is written into the ring's
/// memory (`input_mut`) before the call and the result read from it after
/// (`allreduce_in_place`, `result`), as an application that keeps its vector there
/// does, and as Gloo reduces its tensor in place; a float call quantizes
/// from and into the caller's buffer (`allreduce_f32`).
pub(super) fn ring_calls(
    comms: &mut [aggbox::runtime::RingCommunicator],
    n: usize,
    calls: usize,
    base: &[i32],
    dtype: Dtype,
) -> Result<Vec<CallTime>> {
    let gate = Gate::new(comms.len());
    let gate = &gate;
    let spans: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| -> Result<Vec<Vec<(Instant, Instant)>>> {
        let hs: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || -> Result<Vec<(Instant, Instant)>> {
                    if c.len() != n {
                        bail!("ring member {r}: the ring's vector has {} elements, the call {n}", c.len());
                    }
                    let mut buf = vec![0i32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut fbuf = vec![0f32; if dtype == Dtype::F32 { n } else { 0 }];
                    let mut out = Vec::with_capacity(calls);
                    for k in 0..calls {
                        if dtype == Dtype::F32 {
                            fill_input(&mut buf, r, k);
                            fbuf.iter_mut().zip(&buf).for_each(|(f, &i)| *f = i as f32);
                        } else {
                            fill_input(c.input_mut(), r, k);
                        }
                        if !gate.wait() {
                            bail!("ring member {r}: stopped before call {k}: another participant failed");
                        }
                        let t0 = Instant::now();
                        let res = match dtype {
                            Dtype::I32 => c.allreduce_in_place(Op::Sum).map(|_| ()),
                            Dtype::F32 => c.allreduce_f32(&mut fbuf, false),
                        };
                        let t1 = Instant::now();
                        if let Err(e) = res {
                            gate.abort();
                            bail!("ring member {r}: allreduce ({dtype:?}) of {n} elements, call {k}: {e}");
                        }
                        let who = format!("ring member {r}");
                        let checked = match dtype {
                            Dtype::F32 => check_result(&who, &mut buf, &fbuf, base, k, dtype),
                            Dtype::I32 => check_ints(&who, c.result(), base, k),
                        };
                        if let Err(e) = checked {
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
    })?;
    Ok(call_times(&spans, calls, 0))
}
