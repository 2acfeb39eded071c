//! Broadcast over a netns testbed (needs root): host 0 runs the aggregator's
//! communicator, hosts 1..=N the workers; worker 0 broadcasts a buffer to
//! everyone with the socket backend.
//!
//! `sudo cargo run --example broadcast -- [workers] [bytes]`

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::runtime::{Communicator, Participant};
use crate::testbed::{Testbed, TestbedConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let workers: usize = args.get(1).map_or(Ok(3), |s| s.parse())?;
    let bytes: usize = args.get(2).map_or(Ok(4 << 20), |s| s.parse())?;
    let tb = Testbed::up(TestbedConfig { hosts: workers + 1, ..Default::default() })?;
    let peers: Vec<SocketAddrV4> = (1..=workers).map(|h| SocketAddrV4::new(tb.host(h).addr, 7500)).collect();
    let agg_addr = tb.host(0).addr;
    let mk = |host: usize, me: Participant| -> Result<Communicator, Box<dyn std::error::Error>> {
        let b = Communicator::builder(1, peers.clone(), agg_addr, 7400, me).deadline(Duration::from_secs(30));
        Ok(tb.in_host(host, move || b.build())??)
    };
    let mut comms = vec![mk(0, Participant::Aggregator)?];
    for r in 0..workers {
        comms.push(mk(r + 1, Participant::Worker(r as u16))?);
    }
    let root = Participant::Worker(0);
    let msg: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for c in &comms {
            let msg = msg.clone();
            s.spawn(move || {
                let mut buf = if c.participant() == root { msg.clone() } else { vec![0; bytes] };
                c.broadcast(&mut buf, root).expect("broadcast");
                assert!(buf == msg);
            });
        }
    });
    let el = t0.elapsed();
    println!(
        "broadcast of {bytes} bytes to {} receivers in {el:?} ({:.1} MB/s per receiver)",
        comms.len() - 1,
        bytes as f64 / el.as_secs_f64() / 1e6
    );
    Ok(())
}
