//! The small-message yardstick of `large` (backends `udp-rtt-poll` and
//! `udp-rtt-sleep`): one UDP round trip of a 64-byte datagram between two
//! hosts of the same testbed (worker 0 → worker 1 → worker 0), the least a
//! synchronous collective that crosses the network twice can cost here. An
//! allreduce of one datagram pays at least this (contribution to the node,
//! RESULT back). `poll`: both ends spin on a non-blocking socket (MPI's
//! default way of waiting); `sleep`: both ends sleep in `poll(2)` until the
//! datagram is there (the AggBox runtime with `caller_spin` zero).
//! Reported at the one-datagram size beside the allreduces; each "call" is
//! one round trip.

use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::report::{csv_row, report_point};
use super::{CallTime, Point};
use crate::testbed::Testbed;
use crate::{progress, Csv};

/// UDP port of both ends.
const RTT_PORT: u16 = 7970;
/// Bytes of the datagram (as the measurement).
const RTT_BYTES: usize = 64;
/// Round trips per mode (the first is the warm-up, as a call's).
const ROUND_TRIPS: usize = 1001;

/// Both modes at `mtu`, reported at `elements` (the one-datagram size).
pub(super) fn rtt_phase(tb: &Testbed, mtu: u32, elements: u64, csv: &mut Csv) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for (name, spin) in [("udp-rtt-poll", true), ("udp-rtt-sleep", false)] {
        progress(format!("large: MTU {mtu}, {name}: {} round trips of {RTT_BYTES} bytes, host 1 <-> host 2", ROUND_TRIPS - 1));
        let p = match round_trips(tb, spin) {
            Ok(times) => {
                for (k, t) in times.iter().enumerate() {
                    csv_row(csv, name, mtu, elements, k, t.all, t.workers, true);
                }
                Point::new(name, mtu, elements, &times, None)
            }
            Err(e) => Point::new(name, mtu, elements, &[], Some(format!("{e:#}"))),
        };
        report_point(&p);
        points.push(p);
    }
    Ok(points)
}

/// [`ROUND_TRIPS`] round trips from host 1 to host 2 and back, spinning or
/// sleeping on both ends.
fn round_trips(tb: &Testbed, spin: bool) -> Result<Vec<CallTime>> {
    let (a, b) = (SocketAddrV4::new(tb.host(1).addr, RTT_PORT), SocketAddrV4::new(tb.host(2).addr, RTT_PORT));
    let bind = |h: usize, at: SocketAddrV4| -> Result<UdpSocket> {
        let s = tb.in_host(h, || UdpSocket::bind(at))?.with_context(|| format!("binding {at}"))?;
        s.set_nonblocking(spin)?;
        // Sleeping ends wake at least every 100 ms, so that the echo sees
        // the end and the sender its deadline.
        s.set_read_timeout((!spin).then_some(std::time::Duration::from_millis(100)))?;
        Ok(s)
    };
    let (sa, sb) = (bind(1, a)?, bind(2, b)?);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| -> Result<Vec<CallTime>> {
        let echo = s.spawn(|| -> Result<()> {
            let mut buf = [0u8; RTT_BYTES];
            while !done.load(Ordering::Relaxed) {
                match sb.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        sb.send_to(&buf[..n], from)?;
                    }
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                    Err(e) => return Err(e).context("echo"),
                }
            }
            Ok(())
        });
        let mut times = Vec::with_capacity(ROUND_TRIPS);
        let mut buf = [0u8; RTT_BYTES];
        let out = [0x5au8; RTT_BYTES];
        let mut failure = None;
        for k in 0..ROUND_TRIPS {
            let t0 = Instant::now();
            if let Err(e) = sa.send_to(&out, b) {
                failure = Some(anyhow::Error::from(e).context(format!("round trip {k}: send")));
                break;
            }
            let got = loop {
                match sa.recv_from(&mut buf) {
                    Ok((n, _)) => break Ok(n),
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        if t0.elapsed().as_secs() >= 2 {
                            break Err(anyhow::anyhow!("round trip {k}: no echo within 2 s"));
                        }
                    }
                    Err(e) => break Err(anyhow::Error::from(e).context(format!("round trip {k}: receiving the echo"))),
                }
            };
            if let Err(e) = got {
                failure = Some(e);
                break;
            }
            let rtt = t0.elapsed().as_secs_f64();
            times.push(CallTime { all: rtt, workers: rtt });
        }
        done.store(true, Ordering::Relaxed);
        let echoed = echo.join().map_err(|_| anyhow::anyhow!("the echo thread panicked"))?;
        if let Some(e) = failure {
            bail!("{e:#}");
        }
        echoed?;
        Ok(times)
    })
}
