//! Experiments 4–7: computation cost (aggregate + GEMM), parameter server,
//! MapReduce word count, and applications that broadcast their state.
//!
//! All of them run real traffic through the harnesses of experiments 1 and
//! 2: AggBox XDP (`kernel`) against the plain user-space UDP aggregator
//! (`plain`) for aggregation, the TC broadcast against per-destination
//! `sendto` for broadcast.
//!
//! One file per experiment: `gemm.rs`, `ps.rs`, `wordcount.rs`,
//! `bcast_apps.rs`; this file holds what they share.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use anyhow::{bail, Result};

use super::agg::{Harness, Mode, RunResult, RunSpec, Workload, PER};
use aggbox::wire::proto;

mod bcast_apps;
mod gemm;
mod ps;
mod wordcount;

pub use bcast_apps::run_bcast_apps;
pub use gemm::run_gemm;
pub use ps::run_ps;
pub use wordcount::run_wordcount;

/// Vectors given per rank; the reduced vector is checked and stored.
pub struct VecWorkload {
    data: Vec<Vec<u8>>,
    expected: Vec<u8>,
    /// The reduced vector as received.
    pub result: Vec<AtomicI32>,
}

impl VecWorkload {
    /// One vector per rank (equal lengths).
    pub fn new(vectors: &[Vec<i32>]) -> VecWorkload {
        let n = vectors.first().map(|v| v.len()).unwrap_or(0);
        let data = vectors
            .iter()
            .map(|v| {
                let mut b = Vec::with_capacity(4 * n);
                proto::write_i32_be(v, &mut b);
                b
            })
            .collect();
        let sum: Vec<i32> = (0..n).map(|i| vectors.iter().map(|v| v[i]).sum()).collect();
        let mut expected = Vec::with_capacity(4 * n);
        proto::write_i32_be(&sum, &mut expected);
        VecWorkload {
            data,
            expected,
            result: (0..n).map(|_| AtomicI32::new(0)).collect(),
        }
    }

    /// The stored result.
    pub fn result(&self) -> Vec<i32> {
        self.result
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect()
    }
}

impl Workload for VecWorkload {
    fn elements(&self) -> u64 {
        self.result.len() as u64
    }
    fn payload(&self, rank: u16, frag: u64, count: usize, out: &mut Vec<u8>) {
        let off = frag as usize * PER * 4;
        out.extend_from_slice(&self.data[rank as usize][off..off + 4 * count]);
    }
    fn check(&self, frag: u64, be: &[u8]) -> bool {
        let off = frag as usize * PER * 4;
        for (i, c) in be.chunks_exact(4).enumerate() {
            self.result[frag as usize * PER + i].store(
                i32::from_be_bytes([c[0], c[1], c[2], c[3]]),
                Ordering::Relaxed,
            );
        }
        self.expected.get(off..off + be.len()) == Some(be)
    }
}

fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// The runs of one mode, each with the value `after` computed for it.
type ModeRuns = (Mode, Vec<(RunResult, f64)>);

/// Run `w` once per mode per rep on `h` (fresh rounds), returning the runs
/// in (mode, results) order. Fails on a wrong or incomplete result.
fn compare(
    h: &Harness,
    modes: &[Mode],
    reps: usize,
    round: &mut u32,
    w: &dyn Workload,
    mut after: impl FnMut(Mode) -> f64,
) -> Result<Vec<ModeRuns>> {
    let mut out: Vec<ModeRuns> =
        modes.iter().map(|m| (*m, Vec::new())).collect();
    for _ in 0..reps {
        for (mode, rs) in out.iter_mut() {
            let r = h.with_mode(*mode, |a| -> Result<RunResult> {
                let spec = RunSpec {
                    round: *round,
                    window: super::agg::window_for(h.senders.len()),
                    deadline: Duration::from_secs(600),
                    rate_per_sender: None,
                };
                Ok(a.run(w, spec))
            })?;
            *round += 1;
            if !r.ok {
                bail!(
                    "{} run failed: {}",
                    mode.name(),
                    r.error.unwrap_or_default()
                );
            }
            let extra = after(*mode);
            rs.push((r, extra));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::gemm::gemm;
    use super::ps::{curve_diff, same_training, train, TRAIN_WORKERS};
    use super::*;

    #[test]
    fn blocked_gemm_matches_naive() {
        for n in [1usize, 3, 65, 130] {
            let mut seed = 5u64 + n as u64;
            let a: Vec<f32> = (0..n * n)
                .map(|_| (rng(&mut seed) % 7) as f32 - 3.0)
                .collect();
            let b: Vec<f32> = (0..n * n)
                .map(|_| (rng(&mut seed) % 7) as f32 - 3.0)
                .collect();
            let mut c = vec![0f32; n * n];
            gemm(n, &a, &b, &mut c);
            for i in 0..n {
                for j in 0..n {
                    let want: f32 = (0..n).map(|k| a[i * n + k] * b[k * n + j]).sum();
                    assert_eq!(c[i * n + j], want, "n={n} ({i},{j})");
                }
            }
        }
    }

    #[test]
    fn vec_workload_checks_and_stores() {
        let v: Vec<Vec<i32>> = (0..3)
            .map(|r| (0..800).map(|i| i * (r + 1) - 400).collect())
            .collect();
        let w = VecWorkload::new(&v);
        assert_eq!(w.elements(), 800);
        // Fragment 1 (elements 362..724), as the aggregator would return it.
        let sum: Vec<i32> = (362..724).map(|i| v.iter().map(|x| x[i]).sum()).collect();
        let mut be = Vec::new();
        proto::write_i32_be(&sum, &mut be);
        assert!(w.check(1, &be));
        assert_eq!(w.result()[362..724], sum[..]);
        be[0] ^= 1;
        assert!(!w.check(1, &be));
        let mut p = Vec::new();
        w.payload(2, 2, 76, &mut p);
        assert_eq!(p.len(), 4 * 76);
    }

    #[test]
    fn quantized_training_matches_f32() {
        let (f, q) = train(TRAIN_WORKERS, 50).expect("training");
        assert_eq!(f.len(), 50);
        assert!(f.last() < f.first(), "loss decreases");
        let d = curve_diff(&f, &q);
        assert!(same_training(d), "max |dloss| {d}");
    }

    /// A NaN loss, a shorter curve or a step off by more than the tolerance
    /// is a divergence (a plain `fold(0.0, f64::max)` skipped NaN).
    #[test]
    fn divergence_is_caught() {
        let f = vec![0.7, 0.5, 0.3];
        assert!(same_training(curve_diff(&f, &[0.7, 0.5005, 0.3])));
        assert!(!same_training(curve_diff(&f, &[0.7, 0.51, 0.3])));
        assert!(!same_training(curve_diff(&f, &[0.7, f64::NAN, 0.3])));
        assert!(!same_training(curve_diff(&f, &[f64::NAN, 0.5, 0.3])));
        assert!(!same_training(curve_diff(&f, &[0.7, 0.5])));
    }
}
