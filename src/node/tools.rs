//! Operator tools behind `aggbox contribute` and `aggbox listen`: send one
//! contribution vector as AGG1 datagrams, and collect the RESULT datagrams a
//! job's application would receive. They make a node checkable by hand (and
//! drive the demo) without the runtime library; they do no retransmission.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::wire::abi::{self, Op, Round};
use crate::wire::proto::{self, AggHeader};
use crate::wire::reducer;

/// Deterministic test values: element `i` of rank `rank`'s vector, spread
/// over both signs so SUM, MIN, MAX and COUNT (zeros included) all matter.
pub fn pattern_value(rank: u16, i: u32) -> i32 {
    let h = (i as u64).wrapping_mul(2_654_435_761).wrapping_add(rank as u64 * 40_503 + 17);
    (h % 2001) as i32 - 1000
}

/// Rank `rank`'s whole test vector of `elements` values.
pub fn pattern_vector(rank: u16, elements: u32) -> Vec<i32> {
    (0..elements).map(|i| pattern_value(rank, i)).collect()
}

/// What one contribution looks like on the wire.
#[derive(Debug, Clone, Copy)]
pub struct Contribution {
    /// Job id.
    pub job: u16,
    /// Sender's rank.
    pub rank: u16,
    /// Reduction round.
    pub round: Round,
    /// Operation.
    pub op: Op,
    /// First sequence number to use (one per datagram).
    pub first_seq: u32,
    /// Elements per datagram (see [`crate::wire::proto::elements_per_datagram`]).
    pub per_datagram: usize,
}

/// Send `values` to `to` as AGG1 datagrams of at most `per_datagram`
/// elements, the last one flagged LAST_FRAGMENT. Returns the datagram count.
pub fn contribute(socket: &UdpSocket, to: SocketAddrV4, c: &Contribution, values: &[i32]) -> Result<usize> {
    if values.is_empty() {
        bail!("nothing to send: the vector is empty");
    }
    if c.per_datagram == 0 || c.per_datagram > u16::MAX as usize {
        bail!("elements per datagram must be 1..=65535, not {}", c.per_datagram);
    }
    let mut buf = Vec::with_capacity(abi::AGG_HDR_LEN + 4 * c.per_datagram);
    let chunks = values.len().div_ceil(c.per_datagram);
    for (n, chunk) in values.chunks(c.per_datagram).enumerate() {
        let hdr = AggHeader {
            job: c.job,
            rank: c.rank,
            seq: c.first_seq.wrapping_add(n as u32),
            round: c.round,
            frag_off: (n * c.per_datagram) as u32,
            op: c.op,
            flags: if n + 1 == chunks { abi::AGG_F_LAST_FRAGMENT } else { 0 },
            count: chunk.len() as u16,
        };
        buf.clear();
        proto::encode_agg_into(&hdr, chunk, &mut buf)?;
        socket.send_to(&buf, to).with_context(|| format!("sending to {to}"))?;
    }
    Ok(chunks)
}

/// The RESULT datagrams of one round, reassembled.
#[derive(Debug, Clone)]
pub struct CollectedResult {
    /// The reduced vector (elements not received are 0 and listed in `missing`).
    pub values: Vec<i32>,
    /// RESULT datagrams received.
    pub datagrams: usize,
    /// Whether any fragment carried OVERFLOW.
    pub overflow: bool,
    /// Whether the fragment flagged LAST_FRAGMENT arrived.
    pub last_fragment_seen: bool,
    /// Element ranges `[start, end)` that no RESULT covered.
    pub missing: Vec<(u32, u32)>,
    /// Datagrams on the port that were not RESULTs of the job (ignored).
    pub ignored: usize,
}

/// Receive RESULT datagrams of `job` on `socket` until `elements` elements
/// are covered or `timeout` passes.
pub fn collect_results(socket: &UdpSocket, job: u16, elements: u32, timeout: Duration) -> Result<CollectedResult> {
    let deadline = Instant::now() + timeout;
    let mut values = vec![0i32; elements as usize];
    let mut covered = vec![false; elements as usize];
    let mut remaining = elements as usize;
    let mut out = CollectedResult { values: Vec::new(), datagrams: 0, overflow: false, last_fragment_seen: false, missing: Vec::new(), ignored: 0 };
    let mut buf = vec![0u8; 65536];
    let mut payload = Vec::new();
    while remaining > 0 {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        socket.set_read_timeout(Some(deadline - now))?;
        let len = match socket.recv(&mut buf) {
            Ok(len) => len,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
            Err(e) => return Err(e.into()),
        };
        let Ok((hdr, be)) = proto::split_agg(&buf[..len]) else {
            out.ignored += 1;
            continue;
        };
        if hdr.job != job || !hdr.is_result() || hdr.is_float() {
            out.ignored += 1;
            continue;
        }
        let start = hdr.frag_off as usize;
        let end = start + hdr.count as usize;
        if end > values.len() {
            out.ignored += 1;
            continue;
        }
        payload.resize(hdr.count as usize, 0);
        proto::read_i32_be(be, &mut payload);
        out.datagrams += 1;
        out.overflow |= hdr.has_overflow();
        out.last_fragment_seen |= hdr.is_last_fragment();
        for (i, v) in payload.iter().enumerate() {
            if !covered[start + i] {
                covered[start + i] = true;
                remaining -= 1;
            }
            values[start + i] = *v;
        }
    }
    let mut i = 0;
    while i < covered.len() {
        if !covered[i] {
            let start = i;
            while i < covered.len() && !covered[i] {
                i += 1;
            }
            out.missing.push((start as u32, i as u32));
        } else {
            i += 1;
        }
    }
    out.values = values;
    Ok(out)
}

/// What the reference reducer says `workers` ranks sending [`pattern_vector`]s
/// reduce to, with `weights` (empty = all 1).
pub fn expected_pattern_result(op: Op, workers: u16, elements: u32, weights: &[i32]) -> Result<reducer::ReduceResult> {
    let vectors: Vec<Vec<i32>> = (0..workers).map(|r| pattern_vector(r, elements)).collect();
    let contributions: Vec<(&[i32], i32)> =
        vectors.iter().enumerate().map(|(r, v)| (v.as_slice(), weights.get(r).copied().unwrap_or(1))).collect();
    Ok(reducer::reduce(op, &contributions)?)
}

/// A UDP socket bound to `0.0.0.0:port`.
pub fn bind_any(port: u16) -> Result<UdpSocket> {
    UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)).with_context(|| format!("binding UDP port {port}"))
}

/// Send one AGB1 datagram for `group` to `to` (a member of the group, by
/// convention the first: the root's TC program re-addresses a copy to every
/// member whose `mask` bit is set). Returns the datagram's length.
pub fn send_broadcast(socket: &UdpSocket, to: SocketAddrV4, group: u16, mask: u32, seq: u32, payload: &[u8]) -> Result<usize> {
    let hdr = proto::BcastHeader { mask, seq, group, flags: 0, hops: 0 };
    let mut buf = Vec::with_capacity(abi::BCAST_HDR_LEN + payload.len());
    proto::encode_bcast_into(&hdr, payload, &mut buf)?;
    socket.send_to(&buf, to).with_context(|| format!("sending to {to}"))?;
    Ok(buf.len())
}

/// One AGB1 datagram as a receiver got it.
#[derive(Debug, Clone)]
pub struct ReceivedBroadcast {
    /// Who sent this copy (the root node's address).
    pub from: std::net::SocketAddr,
    /// The AGB1 header.
    pub header: proto::BcastHeader,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

/// Receive up to `count` AGB1 datagrams on `socket` within `timeout`;
/// anything that is not AGB1 is skipped.
pub fn collect_broadcasts(socket: &UdpSocket, count: usize, timeout: Duration) -> Result<Vec<ReceivedBroadcast>> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    while out.len() < count {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        socket.set_read_timeout(Some(deadline - now))?;
        let (len, from) = match socket.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
            Err(e) => return Err(e.into()),
        };
        if let Ok((header, payload)) = proto::split_bcast(&buf[..len]) {
            out.push(ReceivedBroadcast { from, header, payload: payload.to_vec() });
        }
    }
    Ok(out)
}
