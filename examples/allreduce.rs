//! Allreduce over loopback with the socket backend: one aggregator and N
//! workers as threads of this process, int32 and float32 (adaptive
//! quantization), with timing.
//!
//! `cargo run --example allreduce -- [workers] [elements]`

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::Instant;

use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use aggbox::runtime::{Communicator, Participant, Quantization};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let workers: usize = args.get(1).map_or(Ok(3), |s| s.parse())?;
    let elements: usize = args.get(2).map_or(Ok(1_000_000), |s| s.parse())?;
    let lo = Ipv4Addr::LOCALHOST;
    // Free ports for the aggregator and every worker.
    let probes: Vec<UdpSocket> = (0..=workers).map(|_| UdpSocket::bind((lo, 0))).collect::<Result<_, _>>()?;
    let ports: Vec<u16> = probes.iter().map(|s| s.local_addr().map(|a| a.port())).collect::<Result<_, _>>()?;
    drop(probes);
    let peers: Vec<SocketAddrV4> = ports[1..].iter().map(|&p| SocketAddrV4::new(lo, p)).collect();
    let build = |me| {
        Communicator::builder(1, peers.clone(), lo, ports[0], me)
            .quantization(Quantization::Adaptive)
            .deadline(std::time::Duration::from_secs(300))
            .build()
    };
    let agg = build(Participant::Aggregator)?;
    let comms: Vec<Communicator> = (0..workers).map(|r| build(Participant::Worker(r as u16))).collect::<Result<_, _>>()?;

    let t0 = Instant::now();
    let results = std::thread::scope(|s| {
        let a = s.spawn(|| {
            let mut out = vec![0i32; elements];
            agg.allreduce(&mut out, Op::Sum).map(|_| out)
        });
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut v: Vec<i32> = (0..elements).map(|i| (i % 1000) as i32 * (r as i32 + 1)).collect();
                    c.allreduce(&mut v, Op::Sum).map(|_| v)
                })
            })
            .collect();
        let mut all = vec![a.join().expect("aggregator thread")];
        all.extend(hs.into_iter().map(|h| h.join().expect("worker thread")));
        all
    });
    let el = t0.elapsed();
    let tri = (workers * (workers + 1) / 2) as i32;
    for r in results {
        let v = r?;
        assert!(v.iter().enumerate().all(|(i, &x)| x == (i % 1000) as i32 * tri));
    }
    println!(
        "int32 allreduce: {workers} workers x {elements} elements in {el:?} ({:.1} M elements/s per worker)",
        elements as f64 / el.as_secs_f64() / 1e6
    );

    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| agg.allreduce(&mut vec![0f32; elements], Op::Avg));
        for c in &comms {
            s.spawn(move || {
                let mut g: Vec<f32> = (0..elements).map(|i| ((i as f32) * 1e-3).sin() * 1e-2).collect();
                c.allreduce(&mut g, Op::Avg).map(|_| g)
            });
        }
    });
    println!("float32 mean allreduce (adaptive quantization): {:?}", t0.elapsed());
    Ok(())
}
