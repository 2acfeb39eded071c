//! Reliability numbers for docs/RUNTIME.md: goodput, retransmissions and
//! ACK datagrams per data datagram under loss, group vs per-packet ACKs.
//!
//! Socket backend over loopback, 3 workers + the aggregator in this process;
//! loss is injected with the runtime's test hook (`Impairment`, receive side:
//! data and ACKs are both dropped). Each row runs an allreduce of
//! `ELEMENTS` int32 and a broadcast of as many bytes ×4 from worker 0.
//!
//! `cargo run --release --example reliability_bench [ELEMENTS] [REPEATS]`
//! (defaults 1000000 and 3; the median time of the repeats is reported).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use aggbox::config::AckMode;
use aggbox::wire::reliability::{RecvTracker, SendWindow};
use aggbox::runtime::{CommStats, Communicator, ImpairControl, Impairment, Participant};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;
const WORKERS: usize = 3;

fn job(mode: AckMode, control: &ImpairControl, seed: u64) -> Vec<Communicator> {
    let socks: Vec<UdpSocket> = (0..=WORKERS).map(|_| UdpSocket::bind((LO, 0)).expect("bind")).collect();
    let ports: Vec<u16> = socks.iter().map(|s| s.local_addr().expect("addr").port()).collect();
    drop(socks);
    let peers: Vec<SocketAddrV4> = ports[1..].iter().map(|&p| SocketAddrV4::new(LO, p)).collect();
    std::iter::once(Participant::Aggregator)
        .chain((0..WORKERS as u16).map(Participant::Worker))
        .enumerate()
        .map(|(i, me)| {
            let mut b = Communicator::builder(5, peers.clone(), LO, ports[0], me)
                .deadline(Duration::from_secs(60))
                .ack_mode(mode)
                // The docs' table is at Ethernet MTU (loopback's 64 KB would send 40× fewer datagrams).
                .mtu(1500)
                .impairment(Impairment { seed: seed + i as u64, reorder_window: 1, control: control.clone() });
            if let Some(ms) = std::env::var("MIN_RTO_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
                let mut r = b.config().reliability;
                r.min_rto = Duration::from_millis(ms);
                b = b.reliability(r);
            }
            b.build().expect("build")
        })
        .collect()
}

fn sum(s: &[CommStats]) -> CommStats {
    s.iter().fold(CommStats::default(), |a, &x| a + x)
}

fn allreduce(comms: &[Communicator], len: usize) {
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || {
                let mut v = vec![c.rank().map_or(0, |r| r as i32 + 1); len];
                c.allreduce(&mut v, Op::Sum).expect("allreduce");
                assert!(v.iter().all(|&x| x == 6), "allreduce result");
            });
        }
    });
}

fn broadcast(comms: &[Communicator], bytes: usize) {
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || {
                let mut v = if c.rank() == Some(0) { vec![7u8; bytes] } else { vec![0u8; bytes] };
                c.broadcast(&mut v, Participant::Worker(0)).expect("broadcast");
                assert!(v.iter().all(|&x| x == 7), "broadcast data");
            });
        }
    });
}

struct Row {
    label: String,
    mode: AckMode,
    secs: f64,
    payload: u64,
    st: CommStats,
}

fn run(label: &str, mode: AckMode, loss: f64, burst: bool, len: usize, repeats: usize) -> Row {
    let control = ImpairControl::new(if burst { 0.0 } else { loss }, 0.0);
    let comms = job(mode, &control, 17);
    // warm-up (RTT estimate, buffers)
    allreduce(&comms, 10_000);
    let before: Vec<CommStats> = comms.iter().map(|c| c.stats()).collect();
    let mut times = Vec::new();
    for _ in 0..repeats {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            if burst {
                let c = control.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(20));
                    c.set(0.10, 0.0);
                    std::thread::sleep(Duration::from_millis(300));
                    c.set(0.0, 0.0);
                });
            }
            allreduce(&comms, len);
            broadcast(&comms, len * 4);
        });
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let after: Vec<CommStats> = comms.iter().map(|c| c.stats()).collect();
    let delta: Vec<CommStats> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| CommStats {
            data_sent: a.data_sent - b.data_sent,
            retransmitted: a.retransmitted - b.retransmitted,
            acks_sent: a.acks_sent - b.acks_sent,
            acks_repeated: a.acks_repeated - b.acks_repeated,
            data_received: a.data_received - b.data_received,
            acks_received: a.acks_received - b.acks_received,
            duplicates_received: a.duplicates_received - b.duplicates_received,
            bytes_delivered: a.bytes_delivered - b.bytes_delivered,
            float_calls_one_round: a.float_calls_one_round - b.float_calls_one_round,
            float_calls_redone: a.float_calls_redone - b.float_calls_redone,
        })
        .collect();
    let st = sum(&delta);
    Row { label: label.into(), mode, secs: times[times.len() / 2], payload: st.bytes_delivered / repeats as u64, st }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let len: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let repeats: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    println!(
        "allreduce of {len} int32 + broadcast of {} bytes from worker 0; {WORKERS} workers + aggregator on loopback; median of {repeats}",
        len * 4
    );
    println!("| loss | ACK mode | time (s) | goodput (MB/s delivered) | data datagrams | retransmitted | retx % | ACK datagrams | ACKs per data datagram |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for (label, loss, burst) in [("0", 0.0, false), ("0.01 %", 0.0001, false), ("1 %", 0.01, false), ("5 %", 0.05, false), ("10 % burst 300 ms", 0.10, true)] {
        for mode in [AckMode::Group, AckMode::Packet] {
            let r = run(label, mode, loss, burst, len, repeats);
            let st = r.st;
            println!(
                "| {} | {} | {:.3} | {:.1} | {} | {} | {:.2} | {} | {:.4} |",
                r.label,
                r.mode.as_str(),
                r.secs,
                r.payload as f64 / r.secs / 1e6,
                st.data_sent / repeats as u64,
                st.retransmitted / repeats as u64,
                100.0 * st.retransmitted as f64 / st.data_sent.max(1) as f64,
                st.acks_sent / repeats as u64,
                st.acks_sent as f64 / st.data_sent.max(1) as f64,
            );
        }
    }
    println!();
    println!(
        "reliability state per group of 1024 datagrams: receiver {} bytes per sender (at most {} groups), sender {} bytes of bookkeeping ({} per datagram in flight) + the datagram copies",
        RecvTracker::GROUP_BYTES,
        RecvTracker::MAX_GROUPS,
        1024 * SendWindow::ENTRY_BYTES,
        SendWindow::ENTRY_BYTES
    );
}
