//! Experiment 10: the runtime's passes over a vector at the edge, against
//! `memcpy` of the same bytes measured in the same run.
//!
//! Issue "Large frames", point 4: the runtime quantizes and fragments a large
//! f32 vector without extra copies "at memory bandwidth". Per call a worker
//! runs, over its whole vector: one check (`check_finite` with a fixed scale,
//! `max_abs` with the adaptive one), quantize + big-endian encode straight
//! into the datagram buffers (header included, fragment by fragment), and
//! dequantize out of each RESULT's payload into the caller's vector; an
//! int32 call runs the big-endian encode and decode instead. Each pass is
//! timed over a vector of `elements` (21.8 M = 87 MB by default: ResNet-34,
//! as in experiment 9, far beyond the caches) at the elements per datagram
//! of MTU 1500, 9000 and 65535, best of `reps`, and reported in GB/s of the
//! vector (4 bytes per element) and as a ratio to `copy_from_slice` of the
//! same vector (which reads and writes the same bytes). No network, no root.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use super::{progress, BenchOptions, Context_, Csv, Section};
use aggbox::wire::abi::Op;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::runtime::fragment::elements_per_fragment;
use aggbox::runtime::quantize;

/// Vector length of a full run (ResNet-34's parameters, as experiment 9).
pub const ELEMENTS: usize = 21_800_000;
/// Vector length of a `--quick` run.
pub const QUICK_ELEMENTS: usize = 2_000_000;
/// MTUs whose fragment sizes are measured.
pub const MTUS: [u32; 3] = [1500, 9000, 65535];

/// One pass: its name and its best time over the vector.
#[derive(Debug, Clone, Serialize)]
pub struct Pass {
    /// What the pass does.
    pub name: String,
    /// Elements per datagram (0: the pass does not fragment).
    pub per_datagram: usize,
    /// Best wall time of the pass over the whole vector (s).
    pub secs: f64,
    /// Vector bytes per second (4 bytes per element).
    pub gb_per_s: f64,
    /// `gb_per_s` / `memcpy`'s.
    pub vs_memcpy: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Serialize)]
pub struct Edge {
    /// Elements of the vector.
    pub elements: usize,
    /// Repetitions (best of).
    pub reps: usize,
    /// `copy_from_slice` of the vector (the baseline).
    pub memcpy_gb_per_s: f64,
    /// The passes.
    pub passes: Vec<Pass>,
}

/// The input: finite floats in ±0.1 with varied bits (no run of one value
/// that would flatter branch prediction), as the runtime tests use.
fn input(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 % 20_001) as f32 - 10_000.0) * 1e-5)
        .collect()
}

/// Best of `reps` runs of `f`, in seconds.
fn best(reps: usize, f: &mut dyn FnMut()) -> f64 {
    let mut b = f64::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    b
}

/// Best time of encoding `src` fragment by fragment (`per` elements) as the
/// runtime does: a header, then `payload`, into one reused datagram buffer.
fn encode_pass<T>(
    src: &[T],
    per: usize,
    reps: usize,
    dgram: &mut Vec<u8>,
    payload: impl Fn(&[T], &mut Vec<u8>),
) -> f64 {
    best(reps, &mut || {
        for (i, c) in src.chunks(per).enumerate() {
            dgram.clear();
            let hdr = AggHeader {
                job: 1,
                rank: 0,
                seq: i as u32,
                round: aggbox::wire::abi::Round(0),
                frag_off: (i * per) as u32,
                op: Op::Sum,
                flags: 0,
                count: c.len() as u16,
            };
            proto::write_agg_header(&hdr, dgram);
            payload(c, dgram);
            black_box(&dgram);
        }
    })
}

/// Best time of decoding `payload` (one datagram's) into every `per`-element
/// fragment of `dst`, as the runtime decodes each RESULT into the vector.
fn decode_pass<T>(
    dst: &mut [T],
    per: usize,
    reps: usize,
    payload: &[u8],
    decode: impl Fn(&[u8], &mut [T]),
) -> f64 {
    best(reps, &mut || {
        for c in dst.chunks_mut(per) {
            let n = c.len();
            decode(&payload[..4 * n], c);
        }
        black_box(&dst);
    })
}

/// Times every pass over a vector of `elements` (best of `reps`).
pub fn measure(elements: usize, reps: usize) -> Edge {
    let x = input(elements);
    let xi: Vec<i32> = x.iter().map(|v| (v * 1e6) as i32).collect();
    let bytes = (elements * 4) as f64;
    let mut y = vec![0f32; elements];
    let t_copy = best(reps, &mut || {
        y.copy_from_slice(black_box(&x));
        black_box(&y);
    });
    let memcpy = bytes / t_copy;
    let mut passes = Vec::new();
    let mut add = |name: &str, per: usize, secs: f64| {
        let g = bytes / secs;
        passes.push(Pass {
            name: name.into(),
            per_datagram: per,
            secs,
            gb_per_s: g / 1e9,
            vs_memcpy: g / memcpy,
        });
    };
    add(
        "check_finite (fixed scale)",
        0,
        best(reps, &mut || {
            black_box(quantize::check_finite(black_box(&x)).is_ok());
        }),
    );
    add(
        "max_abs (adaptive scale)",
        0,
        best(reps, &mut || {
            black_box(quantize::max_abs(black_box(&x)).ok());
        }),
    );
    let scale = quantize::adaptive_scale(quantize::max_abs(&x).unwrap_or(0.0), 4);
    let mut dgram = Vec::with_capacity(64 << 10);
    let mut z = vec![0f32; elements];
    let mut zi = vec![0i32; elements];
    for mtu in MTUS {
        let per = elements_per_fragment(mtu as usize);
        add(
            "quantize + encode (f32 contribution)",
            per,
            encode_pass(&x, per, reps, &mut dgram, |c, d| {
                quantize::quantize_be_into(c, scale, d);
            }),
        );
        add(
            "encode (int32 contribution)",
            per,
            encode_pass(&xi, per, reps, &mut dgram, proto::write_i32_be),
        );
        // One full datagram's payload stands for every RESULT: decoding
        // reads it from the cache, as the runtime reads a just-received
        // datagram, and writes the vector.
        let mut payload = Vec::new();
        quantize::quantize_be_into(&x[..per.min(elements)], scale, &mut payload);
        add(
            "dequantize (f32 result)",
            per,
            decode_pass(&mut z, per, reps, &payload, |p, c| {
                quantize::dequantize_be_into(p, scale, c)
            }),
        );
        add(
            "decode (int32 result)",
            per,
            decode_pass(&mut zi, per, reps, &payload, proto::read_i32_be),
        );
    }
    Edge {
        elements,
        reps,
        memcpy_gb_per_s: memcpy / 1e9,
        passes,
    }
}

/// Experiment 10.
pub fn run(opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    let elements = if opts.quick { QUICK_ELEMENTS } else { ELEMENTS };
    let reps = opts.reps().max(3);
    let e = measure(elements, reps);
    let mut csv = Csv::new(&["pass", "per_datagram", "secs", "gb_per_s", "vs_memcpy"]);
    csv.row(vec![
        "memcpy".into(),
        "0".into(),
        format!("{:.6}", elements as f64 * 4.0 / (e.memcpy_gb_per_s * 1e9)),
        format!("{:.3}", e.memcpy_gb_per_s),
        "1.000".into(),
    ]);
    for p in &e.passes {
        csv.row(vec![
            format!("\"{}\"", p.name),
            p.per_datagram.to_string(),
            format!("{:.6}", p.secs),
            format!("{:.3}", p.gb_per_s),
            format!("{:.3}", p.vs_memcpy),
        ]);
    }
    csv.write(&opts.out_dir.join("edge.csv"))?;
    super::write_json(&opts.out_dir.join("edge.json"), &e)?;
    let worst = e
        .passes
        .iter()
        .min_by(|a, b| a.vs_memcpy.total_cmp(&b.vs_memcpy))
        .map(|p| format!("{} at {} per datagram: {:.2}×", p.name, p.per_datagram, p.vs_memcpy))
        .unwrap_or_default();
    let q = |per: usize| {
        e.passes
            .iter()
            .find(|p| p.name.starts_with("quantize") && p.per_datagram == per)
            .map_or(0.0, |p| p.vs_memcpy)
    };
    let big = elements_per_fragment(65535);
    progress(format!(
        "edge: memcpy {:.1} GB/s; quantize + encode {:.2}× of it at {big} per datagram; slowest: {worst}",
        e.memcpy_gb_per_s,
        q(big)
    ));
    let mut md = String::new();
    let _ = writeln!(md, "## 10. The runtime's passes over the vector (vs memcpy)\n");
    let _ = writeln!(
        md,
        "{} elements ({:.1} MB), best of {reps}; `memcpy` (`copy_from_slice`, read + write) **{:.1} GB/s** in this run. \
         GB/s of the vector (4 bytes per element); ratio = that / memcpy's. Code: `src/bin/aggbox-bench/edge.rs`.\n",
        elements,
        elements as f64 * 4e-6,
        e.memcpy_gb_per_s
    );
    let _ = writeln!(md, "| pass | elements/datagram | s | GB/s | × memcpy |");
    let _ = writeln!(md, "|---|---:|---:|---:|---:|");
    for p in &e.passes {
        let per = if p.per_datagram == 0 { "—".to_string() } else { p.per_datagram.to_string() };
        let _ = writeln!(
            md,
            "| {} | {per} | {:.4} | {:.2} | {:.2} |",
            p.name, p.secs, p.gb_per_s, p.vs_memcpy
        );
    }
    let _ = writeln!(md, "\nPlot: `edge.png`.\n");
    Ok(Section {
        name: "edge".into(),
        markdown: md,
        headline: vec![format!(
            "edge: quantize + encode {:.2}× memcpy at {big} per datagram ({:.1} GB/s memcpy); slowest pass {worst}",
            q(big),
            e.memcpy_gb_per_s
        )],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pass is measured once per fragment size (the whole-vector
    /// checks once), each against the memcpy of the same run.
    #[test]
    fn every_pass_is_measured_against_memcpy() {
        let e = measure(100_000, 1);
        assert!(e.memcpy_gb_per_s > 0.0 && e.memcpy_gb_per_s.is_finite());
        assert_eq!(e.passes.len(), 2 + 4 * MTUS.len());
        for mtu in MTUS {
            let per = elements_per_fragment(mtu as usize);
            assert_eq!(e.passes.iter().filter(|p| p.per_datagram == per).count(), 4, "{per}");
        }
        for p in &e.passes {
            assert!(p.secs > 0.0 && p.gb_per_s.is_finite(), "{p:?}");
            let want = p.gb_per_s / e.memcpy_gb_per_s;
            assert!((p.vs_memcpy - want).abs() <= 1e-9 * want.max(1.0), "{p:?}");
        }
    }
}
