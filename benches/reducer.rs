//! Throughput of the reference reducer's hot path (`add_be_bytes`), per op,
//! int and float. Plain `std::time`, no extra dependency; needs
//! `[[bench]] name = "reducer" harness = false` in Cargo.toml.
//! Run: `cargo bench --bench reducer [-- ELEMENTS]`.

// Without `harness = false` this file is built under libtest, which has its
// own main; keep that build warning-free.
#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use aggbox::wire::abi::Op;
use aggbox::wire::proto;
use aggbox::wire::reducer::Accumulator;

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(362);
    let ranks = 8;
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let int_payloads: Vec<Vec<u8>> = (0..ranks)
        .map(|_| {
            let v: Vec<i32> = (0..n).map(|_| (next() >> 40) as i32 - (1 << 23)).collect();
            let mut b = Vec::new();
            proto::write_i32_be(&v, &mut b);
            b
        })
        .collect();
    let float_payloads: Vec<Vec<u8>> = (0..ranks)
        .map(|_| {
            let v: Vec<f32> = (0..n)
                .map(|_| ((next() >> 40) as f32 - 8e6) / 1e3)
                .collect();
            let mut b = Vec::new();
            proto::write_f32_be(&v, &mut b);
            b
        })
        .collect();
    println!("{n} elements x {ranks} ranks per reduction; throughput = contribution bytes / s");
    for float in [false, true] {
        for op in Op::ALL {
            let Ok(mut acc) = Accumulator::new(op, n, float) else {
                continue;
            };
            let payloads = if float {
                &float_payloads
            } else {
                &int_payloads
            };
            for weight in [1, 3] {
                if weight != 1 && !matches!(op, Op::Sum | Op::Avg) {
                    continue;
                }
                let mut iters = 0u64;
                let start = Instant::now();
                while start.elapsed() < Duration::from_millis(300) {
                    for _ in 0..64 {
                        acc.reset(op, n, float).expect("valid shape");
                        for p in payloads {
                            acc.add_be_bytes(black_box(p), weight)
                                .expect("valid payload");
                        }
                        black_box(acc.finish().expect("finish"));
                    }
                    iters += 64;
                }
                let secs = start.elapsed().as_secs_f64();
                let bytes = iters as f64 * (ranks * 4 * n) as f64;
                println!(
                    "{:>5} {:<5} w={weight}: {:7.2} GB/s ({:.1} ns/element/rank)",
                    if float { "f32" } else { "i32" },
                    op.name(),
                    bytes / secs / 1e9,
                    secs * 1e9 / (iters as f64 * (ranks * n) as f64)
                );
            }
        }
    }
}
