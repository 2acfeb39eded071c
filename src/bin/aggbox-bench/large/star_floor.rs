//! The star's floor on this testbed (backend `floor` of `large`): what an
//! allreduce through one in-kernel aggregator cannot cost less than here,
//! measured in the same run as AggBox, Gloo and Open MPI.
//!
//! - The node (host 0) runs the floor aggregator (`src/bpf/bench_floor.bpf.c`:
//!   array slot by (round, fragment), direct packet access, one lock, the
//!   adds, the completing contribution rewritten into the RESULT) in native
//!   XDP, and the minimal RESULT copier (`bench_result_floor` in
//!   `src/bpf/bench_bcast_floor.bpf.c`) on its clsact ingress, which clones
//!   each RESULT to every worker's data socket.
//! - Each worker encodes its whole vector as AGG1 datagrams before the call
//!   (outside the timing), then sends them with `sendmmsg` (the runtime's
//!   `UdpTransport`, batches of 64) as fast as a window of fragments beyond
//!   the RESULTs it has received allows (the path's self-clocking; the
//!   floor's 8192 slots must hold every fragment in flight; each size is
//!   measured at windows of 8 to 64 and its floor is the fastest the path
//!   takes without loss, [`windows`]), and receives
//!   the RESULTs with `recvmmsg` straight into its output vector; when
//!   nothing is there it looks again, yielding the CPU between looks, for
//!   the runtime's default caller spin, then sleeps in `poll` (the
//!   runtime's own way of waiting, so that neither pays a wake-up the
//!   other does not).
//! - No reliability (a lost datagram ends the call, [`STALL`]: a failure at
//!   the smallest window, else the end of the size's window sweep), no
//!   validation, SUM of int32 only. Full fragments of the MTU's size:
//!   `bench_floor` (direct packet access) takes MTU 1500's 362 elements,
//!   `bench_floor_frags` (multi-buffer frames, chunks of 362 elements
//!   through `bpf_xdp_load_bytes`/`store_bytes`) those of MTU 9000 and
//!   65535, as AggBox's frags chain does.
//!
//! Every call's result is checked on every worker after the call, as for the
//! other backends.

use std::collections::BTreeMap;
use std::net::{SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::report::{csv_row, report_point};
use super::{
    call_deadline, call_times, check_ints, fill_input, join_spans, worker_count, Gate, Point,
    Spans, JOB_PORT, RESULT_PORT,
};
use crate::bcast::{mac_of, BcastFloor, FloorDest};
use crate::floor::{Floor, FLOOR_MAX_ELEMS, FLOOR_PER, FLOOR_SLOTS};
use crate::testbed::{in_netns, Testbed};
use crate::{progress, thousands, Csv};
use aggbox::node;
use aggbox::runtime::transport::{RecvMeta, Transport, UdpTransport, BATCH_MAX};
use aggbox::runtime::DEFAULT_CALLER_SPIN;
use aggbox::wire::abi::{self, Op, Round};
use aggbox::wire::proto::{self, AggHeader};

/// The workers' data port for the floor (not the runtime's, which a later
/// phase binds).
const FLOOR_DATA_PORT: u16 = 7960;
/// Slots the index cycles over at MTU 1500 (one per fragment), as the
/// floor always had: the same memory in use whatever the map's size.
const SLOTS_AT_1500: u32 = 8192;

/// Slots one fragment of `per` elements takes (one per 362-element chunk).
fn chunks(per: usize) -> usize {
    per.div_ceil(FLOOR_PER as usize)
}

/// Slots the index cycles over for fragments of `per` elements.
fn slots_for(per: usize) -> u32 {
    if per <= FLOOR_PER as usize {
        SLOTS_AT_1500
    } else {
        FLOOR_SLOTS
    }
}

/// The windows the floor is measured at, in fragments a worker keeps in
/// flight beyond the RESULTs it has received: `AGGBOX_FLOOR_WINDOW` alone,
/// else 8, 16, 32 and 64; each size's floor is the fastest of those the
/// path takes without loss. The floor has no reliability, so a window too
/// large for the path loses datagrams (the node's veth queues 256 frames
/// for its XDP program, and every worker's fragments in flight wait there:
/// windows of 1024 lost datagrams there with 4 workers) and ends the sweep.
/// At most a quarter of the floor's slots: the workers' windows are apart
/// by at most the RESULTs some has not read yet.
fn windows(per: usize) -> Vec<usize> {
    let most = (slots_for(per) / 4) as usize / chunks(per) / worker_count();
    match std::env::var("AGGBOX_FLOOR_WINDOW").ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(w) => vec![w.clamp(1, most)],
        None => [8, 16, 32, 64].into_iter().filter(|&w| w <= most).collect(),
    }
}

/// How long a floor call waits with nothing arriving before it counts a
/// datagram as lost (the path is the kernel's alone: a RESULT is
/// microseconds behind its contributions, and no one resends).
const STALL: Duration = Duration::from_millis(300);

/// The floor at `mtu`: attach on the node, one point per size.
pub(super) fn floor_phase(
    tb: &Testbed,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
) -> Result<Vec<Point>> {
    let per = proto::elements_per_datagram(mtu as usize);
    if per > FLOOR_MAX_ELEMS as usize {
        bail!("the floor aggregator takes fragments of up to {FLOOR_MAX_ELEMS} elements, not {per} (MTU {mtu})");
    }
    let workers = worker_count();
    let node_ns = tb.host(0).netns.clone();
    // The workers' MACs, as the node's copier writes them.
    let mut dests = Vec::with_capacity(workers);
    for r in 0..workers {
        let mac = tb.in_host(r + 1, || mac_of("eth0"))??;
        dests.push((mac, SocketAddrV4::new(tb.host(r + 1).addr, FLOOR_DATA_PORT)));
    }
    let floor = Floor::load(JOB_PORT, RESULT_PORT, workers as u32)?;
    floor.set_per(per as u32)?;
    let frames = per > FLOOR_PER as usize;
    let copier = BcastFloor::load()?;
    let (link, ifindex, created) = in_netns(&node_ns, || -> Result<_> {
        let ifindex = node::ifindex("eth0")?;
        let dests: Vec<FloorDest> = dests.iter().map(|&(mac, addr)| FloorDest { mac, addr, ifindex }).collect();
        copier.configure_results(RESULT_PORT, &dests)?;
        let created = copier.attach_results(ifindex)?;
        let prog = if frames { floor.prog_frags() } else { floor.prog() };
        let link = prog.attach_xdp(ifindex as i32).context("attaching the floor aggregator")?;
        Ok((link, ifindex, created))
    })??;
    let mut sockets: Vec<UdpTransport> = (0..workers)
        .map(|r| {
            tb.in_host(r + 1, || -> Result<UdpTransport> {
                let addr = SocketAddrV4::new(tb.host(r + 1).addr, FLOOR_DATA_PORT);
                let s = UdpSocket::bind(addr).with_context(|| format!("binding {addr}"))?;
                aggbox::netif::set_socket_buffers(&s, 64 << 20);
                Ok(UdpTransport::new(s))
            })?
        })
        .collect::<Result<_>>()?;
    let node_addr = SocketAddrV4::new(tb.host(0).addr, JOB_PORT);
    let mut points = Vec::new();
    let mut round = 0u32;
    for &n in sizes {
        let frags = (n as usize).div_ceil(per) as u32;
        floor.set_index(frags, slots_for(per))?;
        // The fastest window the path takes without loss; past the first
        // that holds all the call's fragments the larger ones are the same.
        let mut best: Option<(usize, Vec<super::CallTime>, Point)> = None;
        let mut lost: Option<(usize, String)> = None;
        let ws = windows(per);
        if ws.is_empty() {
            bail!("no window fits the floor's {} slots at {workers} workers and {per}-element fragments", slots_for(per));
        }
        let all_at = ws.iter().position(|&w| w >= frags as usize).unwrap_or(ws.len() - 1);
        for &w in &ws[..=all_at] {
            if lost.is_some() {
                break;
            }
            progress(format!(
                "large: MTU {mtu}, {} elements, floor: warm-up + {reps} calls (window {w} fragments a worker)",
                thousands(n as f64),
            ));
            let r = floor_calls(&mut sockets, node_addr, per, n as usize, reps + 1, round, &bases[&n], w);
            round = round.wrapping_add(reps as u32 + 1);
            match r {
                Ok(times) => {
                    let p = Point::new("floor", mtu, n, &times, None);
                    if best.as_ref().is_none_or(|(_, _, b)| p.secs.median < b.secs.median) {
                        best = Some((w, times, p));
                    }
                }
                Err(e) => lost = Some((w, format!("{e:#}"))),
            }
        }
        let p = match (best, lost) {
            (Some((w, times, mut p)), lost) => {
                for (k, t) in times.iter().enumerate() {
                    csv_row(csv, "floor", mtu, n, k, t.all, t.workers, true);
                }
                p.node_counters.insert("floor:window_per_worker".into(), w as u64);
                if let Some((lw, _)) = lost {
                    p.node_counters.insert("floor:lossy_window_per_worker".into(), lw as u64);
                }
                p
            }
            (None, Some((_, e))) => Point::new("floor", mtu, n, &[], Some(e)),
            (None, None) => Point::new("floor", mtu, n, &[], Some("no window to measure".into())),
        };
        report_point(&p);
        let failed = p.error.is_some();
        points.push(p);
        if failed {
            break;
        }
    }
    drop(sockets);
    in_netns(&node_ns, || -> Result<()> {
        drop(link);
        copier.detach_results(ifindex, created)
    })??;
    Ok(points)
}

/// `calls` allreduces (call 0 the warm-up) of `n` elements on every worker
/// at once, the first in round `first_round`; each worker's result checked.
fn floor_calls(
    sockets: &mut [UdpTransport],
    node: SocketAddrV4,
    per: usize,
    n: usize,
    calls: usize,
    first_round: u32,
    base: &[i32],
    window: usize,
) -> Result<Vec<super::CallTime>> {
    let gate = Gate::new(sockets.len());
    let gate = &gate;
    let spans: Vec<Spans> = std::thread::scope(|s| -> Result<Vec<Spans>> {
        let hs: Vec<_> = sockets
            .iter_mut()
            .enumerate()
            .map(|(rank, sock)| {
                s.spawn(move || -> Result<Spans> {
                    let mut input = vec![0i32; n];
                    let mut out = vec![0i32; n];
                    let mut spans = Vec::with_capacity(calls);
                    let mut wire = Vec::new();
                    // The receive buffers, made once: a batch of full
                    // datagrams is 4 MB at MTU 65535, whose allocation and
                    // first touch per call cost ~0.7 ms, more than a small
                    // call's whole path (the runtime reuses its buffers too).
                    let mut rx = vec![0u8; BATCH_MAX * dgram(per)];
                    for k in 0..calls {
                        fill_input(&mut input, rank, k);
                        let round = Round(first_round.wrapping_add(k as u32));
                        encode(&input, per, rank as u16, round, &mut wire)?;
                        if !gate.wait() {
                            bail!("floor worker {rank}: stopped before call {k}: another worker failed");
                        }
                        let t0 = Instant::now();
                        let r = one_call(sock, node, per, round, &wire, &mut rx, &mut out, window, call_deadline(n as u64));
                        let t1 = Instant::now();
                        if let Err(e) = r.and_then(|()| check_ints(&format!("floor worker {rank}"), &out, base, k)) {
                            gate.abort();
                            return Err(e.context(format!("floor worker {rank}, call {k}")));
                        }
                        spans.push((t0, t1));
                    }
                    Ok(spans)
                })
            })
            .collect();
        join_spans(hs, gate)
    })?;
    Ok(call_times(&spans, calls, 0))
}

/// One worker's contributions of `input` in `round` (fragments of `per`
/// elements), as datagrams of `per`-element stride in `wire` (the last may
/// be shorter; its length is in its header).
fn encode(input: &[i32], per: usize, rank: u16, round: Round, wire: &mut Vec<u8>) -> Result<()> {
    wire.clear();
    let frags = input.len().div_ceil(per);
    for (f, chunk) in input.chunks(per).enumerate() {
        let hdr = AggHeader {
            job: 0,
            rank,
            seq: f as u32,
            round,
            frag_off: (f * per) as u32,
            op: Op::Sum,
            flags: if f + 1 == frags { abi::AGG_F_LAST_FRAGMENT } else { 0 },
            count: chunk.len() as u16,
        };
        let at = wire.len();
        proto::encode_agg_into(&hdr, chunk, wire).map_err(|e| anyhow!("encoding fragment {f}: {e}"))?;
        // Every datagram in a slot of one stride, so that datagram f is at
        // f · stride (the last one's slot is not filled up).
        wire.resize(at + dgram(per), 0);
    }
    Ok(())
}

/// Bytes of a full floor datagram (AGG1 header + `per` int32).
fn dgram(per: usize) -> usize {
    abi::AGG_HDR_LEN + 4 * per
}

/// One worker's call: send every datagram of `wire` within `window`
/// fragments beyond the RESULTs received, take every RESULT (received into
/// `rx`, a batch of full datagrams) into `out`,
/// until all its elements arrived, or fail when nothing arrived for
/// [`STALL`] (a lost datagram) or the deadline passed.
#[allow(clippy::too_many_arguments)]
fn one_call(
    sock: &mut UdpTransport,
    node: SocketAddrV4,
    per: usize,
    round: Round,
    wire: &[u8],
    rx: &mut [u8],
    out: &mut [i32],
    window: usize,
    deadline: Duration,
) -> Result<()> {
    let n = out.len();
    let frags = n.div_ceil(per);
    let last_len = abi::AGG_HDR_LEN + 4 * (n - (frags - 1) * per);
    let full = dgram(per);
    let end = Instant::now() + deadline;
    let mut progress_at = Instant::now();
    // Since when the socket has been found empty (the spin before a sleep).
    let mut polling_since: Option<Instant> = None;
    let mut seen = vec![false; frags];
    let (mut sent, mut got) = (0usize, 0usize);
    let mut meta = [RecvMeta::default(); BATCH_MAX];
    let mut batch: Vec<(&[u8], std::net::SocketAddr)> = Vec::with_capacity(BATCH_MAX);
    // Send when the window has room for a batch (or the call's last
    // datagrams), so that a sendmmsg carries many datagrams, not the one or
    // two each RESULT frees.
    let batch_at = (window / 2).clamp(1, BATCH_MAX);
    while got < frags {
        let allowed = (got + window).min(frags);
        while sent < allowed && (allowed - sent >= batch_at || allowed == frags) {
            batch.clear();
            for f in sent..allowed.min(sent + BATCH_MAX) {
                let len = if f + 1 == frags { last_len } else { full };
                batch.push((&wire[f * full..f * full + len], node.into()));
            }
            let took = sock.send_batch(&batch);
            if took < batch.len() {
                bail!("the socket took {took} of {} datagrams (no reliability here)", batch.len());
            }
            sent += took;
        }
        match sock.recv_batch(rx, full, &mut meta) {
            Ok(k) => {
                polling_since = None;
                for (i, m) in meta[..k].iter().enumerate() {
                    let d = &rx[i * full..i * full + m.len];
                    let Ok((hdr, payload)) = proto::split_agg(d) else { continue };
                    // Only this call's (a late copy of an earlier call's
                    // RESULT has another round).
                    if !hdr.is_result() || hdr.round != round {
                        continue;
                    }
                    let off = hdr.frag_off as usize;
                    let f = off / per;
                    let count = usize::from(hdr.count);
                    if f >= frags || seen[f] || off + count > n {
                        continue;
                    }
                    seen[f] = true;
                    got += 1;
                    progress_at = Instant::now();
                    for (o, b) in out[off..off + count].iter_mut().zip(payload.chunks_exact(4)) {
                        *o = i32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now.duration_since(*polling_since.get_or_insert(now)) < DEFAULT_CALLER_SPIN {
                    std::thread::yield_now();
                    continue;
                }
                polling_since = None;
                if sent > got && now.duration_since(progress_at) > STALL {
                    bail!(
                        "{got} of {frags} RESULTs, none for {} ms with {} in flight (window {window}): \
                         the path lost a datagram (no reliability here)",
                        STALL.as_millis(),
                        sent - got
                    );
                }
                let left = end.saturating_duration_since(now);
                if left.is_zero() {
                    bail!(
                        "{got} of {frags} RESULTs after {:.1} s ({sent} sent; no reliability: a lost datagram ends the call)",
                        deadline.as_secs_f64()
                    );
                }
                let mut pfd = libc::pollfd { fd: sock.raw_fd(), events: libc::POLLIN, revents: 0 };
                let ms = left.min(STALL).as_millis().clamp(1, 100) as libc::c_int;
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut pfd, 1, ms) };
            }
            Err(e) => return Err(e).context("receiving RESULTs"),
        }
    }
    Ok(())
}
