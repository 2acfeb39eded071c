//! Shared by the runtime tests (`tests/runtime_*.rs`): every participant of
//! a job runs the same call at once (an int32 reduction of the test pattern,
//! or a broadcast), and what each gets is checked (against the reference
//! reducer, or byte for byte against what the root sent).
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};

use aggbox::wire::abi::Op;
use aggbox::wire::reducer;
use aggbox::runtime::{CallOptions, Collective, Participant, StripedCommunicator};
use aggbox::node::tools::pattern_vector;

/// The reference result of `op` over the pattern vectors of `workers` ranks.
pub fn expected(op: Op, workers: usize, len: usize) -> Vec<i32> {
    let v: Vec<Vec<i32>> = (0..workers)
        .map(|r| pattern_vector(r as u16, len as u32))
        .collect();
    let c: Vec<(&[i32], i32)> = v.iter().map(|x| (x.as_slice(), 1)).collect();
    reducer::reduce(op, &c).unwrap().ints().unwrap().to_vec()
}

/// Runs an allreduce (`all`) or a reduce of `len` pattern elements
/// on every communicator at once (the aggregator contributes zeros) and
/// checks every result that participant gets against `expected`: all of
/// them for allreduce, the aggregator's for reduce. Panics with the
/// participant and the first differing element.
pub fn int_reduction<C: Collective>(comms: &[&C], workers: usize, op: Op, len: usize, all: bool) {
    let want = expected(op, workers, len);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|&c| {
                s.spawn(move || {
                    let mut v = match c.participant() {
                        Participant::Worker(r) => pattern_vector(r, len as u32),
                        Participant::Aggregator => vec![0; len],
                    };
                    let r = if all { c.allreduce(&mut v, op) } else { c.reduce(&mut v, op) };
                    r.unwrap_or_else(|e| {
                        panic!("{:?} {op:?} len {len} all {all}: {e}", c.participant())
                    });
                    (c.participant(), v)
                })
            })
            .collect();
        for h in hs {
            let (p, v) = h.join().unwrap();
            if all || p == Participant::Aggregator {
                if let Some(i) = v.iter().zip(&want).position(|(a, b)| a != b) {
                    panic!(
                        "{p:?} {op:?} len {len}: element {i} is {}, the reference reducer says {}",
                        v[i], want[i]
                    );
                }
            }
        }
    });
}

/// Broadcasts `len` bytes of a fixed pattern from `root` with every
/// communicator at once; every participant must end with exactly the root's
/// bytes, in order.
pub fn broadcast<C: Collective>(comms: &[&C], len: usize, root: Participant) {
    let msg: Vec<u8> = (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|&c| {
                let msg = msg.clone();
                s.spawn(move || {
                    let mut buf = if c.participant() == root { msg } else { vec![0u8; len] };
                    c.broadcast_bytes(&mut buf, root, CallOptions::default()).unwrap_or_else(|e| {
                        panic!("{:?}: broadcast of {len} from {root:?}: {e}", c.participant())
                    });
                    (c.participant(), buf)
                })
            })
            .collect();
        for h in hs {
            let (p, got) = h.join().unwrap();
            assert!(got == msg, "{p:?}: broadcast of {len} bytes from {root:?}: not every byte in order");
        }
    });
}

/// Loopback addresses for a job of `workers`: the aggregator's port and the
/// workers' socket addresses, each port free when handed out and never
/// handed out twice in this process.
///
/// Why not ports the kernel picks (bind to 0, release): released ports go
/// back to the ephemeral range, where the next `loopback_job_addrs` or any
/// socket of a test running beside this one can be given the same port
/// before the communicator binds it (`AddrInUse`). These ports come from
/// below the ephemeral range, which the kernel never hands out by itself,
/// through one counter for the whole test binary.
pub fn loopback_job_addrs(workers: usize) -> (u16, Vec<SocketAddrV4>) {
    let lo = Ipv4Addr::LOCALHOST;
    let ports: Vec<u16> = (0..=workers).map(|_| free_loopback_port()).collect();
    let peers = ports[1..].iter().map(|&p| SocketAddrV4::new(lo, p)).collect();
    (ports[0], peers)
}

/// A loopback UDP port below the kernel's ephemeral range that no earlier
/// call in this process returned and that nothing holds right now.
pub fn free_loopback_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;
    static RANGE: OnceLock<(u32, u32)> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let &(first, span) = RANGE.get_or_init(|| {
        let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u32>().ok()))
            .unwrap_or(32768);
        assert!(ephemeral_low > 11024, "ip_local_port_range starts at {ephemeral_low}: no room below it for test ports");
        (10000, ephemeral_low - 10000)
    });
    // Start where this process's pid points, so that two test binaries run
    // at once (e.g. by hand) are unlikely to probe the same ports.
    let start = std::process::id() % span;
    for _ in 0..span {
        let port = (first + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback UDP port in {first}..{}", first + span);
}

/// The two-round definition of an adaptive float allreduce (SUM) over the
/// workers' vectors `xs`: every vector quantized at `adaptive_scale` of
/// the global max, summed as integers, dequantized.
pub fn two_round_result(xs: &[Vec<f32>]) -> Vec<f32> {
    use aggbox::runtime::quantize;
    let m = xs.iter().map(|x| quantize::max_abs(x).unwrap()).fold(0f32, f32::max);
    let s = quantize::adaptive_scale(m, xs.len() as u16);
    let mut sum = vec![0i64; xs[0].len()];
    let mut q = Vec::new();
    for x in xs {
        quantize::quantize_into(x, s, &mut q).unwrap();
        sum.iter_mut().zip(&q).for_each(|(a, &v)| *a += i64::from(v));
    }
    let sum: Vec<i32> = sum.iter().map(|&a| i32::try_from(a).unwrap()).collect();
    let mut out = vec![0f32; sum.len()];
    quantize::dequantize_into(&sum, s, &mut out);
    out
}

/// One float allreduce (SUM) on every participant of a striped job at once
/// (participant 0 the aggregator, with zeros; participant p > 0 worker p - 1
/// with `xs[p - 1]`); what each got, in participant order.
pub fn striped_allreduce_f32(parts: &[StripedCommunicator], xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let len = xs[0].len();
    std::thread::scope(|s| {
        let hs: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(p, c)| {
                let mut x = if p == 0 { vec![0f32; len] } else { xs[p - 1].clone() };
                s.spawn(move || {
                    c.allreduce(&mut x, Op::Sum).unwrap();
                    x
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
