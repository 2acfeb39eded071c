//! The node's ring service (docs/RING.md "One call", "The ring service"):
//! the user-space half of ring allreduce, one thread for every ring of the
//! node, UDP sockets on the member's address and on 127.0.0.1 (KICKs), at
//! the ring's port.
//!
//! It starts each round (on the runtime's KICK, or on seeing the round
//! ready in `ring_ctrl`), sends the PARTIAL hops 1 of every fragment this
//! member is the origin of (a window of them not final here at a time),
//! makes every hop XDP leaves to it (early PARTIALs held until their
//! round is ready; everything while no ring program runs) with the same
//! arithmetic ([`crate::wire::ring`]) and the same claim on `ring_done`,
//! and repairs losses: when the round's `finals` stop moving it NACKs what
//! is missing, and it answers the other members' NACKs.
//!
//! [`RingService`] is one ring's protocol with no socket and no clock
//! (`handle(now, from, datagram)` / `poll(now)` / `poll_timeout()`), over a
//! [`RingMemory`] (the node's mapped maps, or heap memory in tests);
//! [`RingServer`] is the I/O loop around all of them.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::wire::ring_memory::RingMemory;
pub use crate::wire::ring_memory::{RingServiceStats, SERVICE_STATS_MAP as STATS_MAP};
use crate::wire::abi::{self, Op, Round, RingJob};
use crate::wire::ring::{self as wire_ring, RingHeader, RingKind, RingLayout, MAX_NACK_INDEXES};

/// Own fragments sent and not final here, at most (docs/RING.md).
pub const DEFAULT_WINDOW: usize = 256;
/// Own fragments' bytes sent and not final here, at most: the window in
/// fragments is this over the fragment's size, within 2..=[`DEFAULT_WINDOW`].
/// Why bytes: a window counted in fragments alone lets large datagrams put
/// megabytes in flight per member, more than a veth's 256-frame queue holds;
/// the overflow's losses then stall the round until NACKs resend them
/// (docs/RING.md, "The ring service").
pub const WINDOW_BYTES: usize = 256 * 1024;
/// First wait for the round's `finals` to move before NACKing, at least:
/// the wait is the ring's cycle time ([`CycleTime`]) within this and
/// [`CYCLE_WAIT_MAX`].
pub const NACK_AFTER: Duration = Duration::from_millis(2);
/// The wait doubles while nothing moves, up to this.
pub const NACK_AFTER_MAX: Duration = Duration::from_millis(64);
/// The first wait before NACKing from the cycle time, at most: where
/// losses are real (MTU 1500 on 2 CPUs), a longer wait cost more than the
/// duplicates it saved (8 members, 1 M elements: 0.12 s a call with 4 ms,
/// 0.23 s with 16, 0.37 s with 64).
pub const CYCLE_WAIT_MAX: Duration = Duration::from_millis(4);
/// Early PARTIALs held per ring: every other member's window of a round
/// this node is not ready for yet, for the largest rings.
pub const HELD_MAX: usize = 16 * 1024;
/// How often the loop looks at `ring_ctrl` and the window while a round
/// runs here (XDP stores FINALs without telling the service).
const ACTIVE_TICK: Duration = Duration::from_micros(200);
/// How long the loop sleeps with nothing to do.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// How often the loop publishes its counters (metrics, status).
const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// A datagram to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Destination.
    pub to: SocketAddr,
    /// AGR1 datagram.
    pub bytes: Vec<u8>,
}

/// The stall timer: NACK when the round's `finals` has not moved for
/// `after` (doubling while nothing moves).
#[derive(Debug, Clone, Copy)]
struct Stall {
    finals: u32,
    since: Instant,
    after: Duration,
}

/// How long an own fragment takes from its PARTIAL hops 1 to its result
/// stored here (all 2(n − 1) transmissions), smoothed as TCP smooths its
/// round-trip time (RFC 6298: srtt, rttvar). A stall shorter than
/// srtt + 4 · rttvar is the ring being slow, not a loss: NACKing then
/// resends FINALs already on their way (measured with 8 members at MTU
/// 9000 on 2 CPUs: a 2 ms stall NACKed 83 k fragments a run, every one a
/// duplicate, for 39 k originals).
#[derive(Debug, Clone, Copy, Default)]
struct CycleTime {
    srtt: Option<Duration>,
    rttvar: Duration,
}

impl CycleTime {
    fn sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(s) => {
                let diff = if s > rtt { s - rtt } else { rtt - s };
                self.rttvar = self.rttvar * 3 / 4 + diff / 4;
                self.srtt = Some(s * 7 / 8 + rtt / 8);
            }
        }
    }

    /// The first wait before NACKing: [`NACK_AFTER`] at least,
    /// [`CYCLE_WAIT_MAX`] at most.
    fn nack_after(&self) -> Duration {
        self.srtt.map_or(NACK_AFTER, |s| (s + 4 * self.rttvar).clamp(NACK_AFTER, CYCLE_WAIT_MAX))
    }
}

/// One ring's service (see the module docs).
pub struct RingService {
    id: u16,
    dense: u32,
    job: RingJob,
    layout: RingLayout,
    /// The members' addresses in ring order, all of one IP version: what
    /// the service sends comes from `members[me]`, and a datagram is
    /// member k's only if it comes from `members[k]`.
    members: Vec<IpAddr>,
    memory: Arc<RingMemory>,
    window: usize,
    /// The round this service runs (started), if any.
    round: Option<Round>,
    /// This member's own fragments (ascending), how many of them the
    /// running round covers (`ring_ctrl.round_frags`: a prefix), and how
    /// many of those were sent.
    own: Vec<u32>,
    own_in_round: usize,
    own_sent: usize,
    /// Fragments the running round covers (0..round_frags).
    round_frags: u32,
    /// Own fragments sent and not final here yet, with when they were sent
    /// (`None` once resent: Karn's rule, a resent fragment's time is not a
    /// sample of the cycle).
    in_flight: Vec<(u32, Option<Instant>)>,
    cycle: CycleTime,
    /// Per fragment, the stall episode (`episode`) in which it was last
    /// seen missing at a stall: a fragment is NACKed when it is missing at
    /// two stalls of one episode, i.e. after `CycleTime::nack_after` and then its
    /// doubling with nothing final here meanwhile (at the first it is as
    /// likely still on its way round a slow ring).
    missing_since: Vec<u32>,
    /// Stall episodes: a new one each time the round's `finals` moves.
    episode: u32,
    held: Vec<Vec<u8>>,
    stall: Stall,
    stats: RingServiceStats,
}

impl std::fmt::Debug for RingService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingService").field("id", &self.id).field("job", &self.job).field("round", &self.round).finish_non_exhaustive()
    }
}

impl RingService {
    /// The service of the ring `job` (dense index `dense`) whose members
    /// are `members` (ring order, IPv4 or IPv6 addresses, one version for
    /// all), over `memory`.
    pub fn new(dense: u32, job: RingJob, members: Vec<IpAddr>, memory: Arc<RingMemory>) -> Result<RingService> {
        memory.check_job(&job)?;
        if members.len() != usize::from(job.members) || usize::from(job.me) >= members.len() {
            return Err(anyhow!("ring {}: {} member addresses for {} members (me {})", job.id, members.len(), job.members, job.me));
        }
        if members.iter().any(|m| m.is_ipv6() != members[0].is_ipv6()) {
            return Err(anyhow!("ring {}: its members mix IPv4 and IPv6 addresses; a ring's are all of one version", job.id));
        }
        let layout = RingLayout::of_job(&job);
        if layout.frags() != job.frags {
            return Err(anyhow!("ring {}: {} fragments, its vector has {}", job.id, job.frags, layout.frags()));
        }
        Ok(RingService {
            id: job.id,
            dense,
            own: layout.own_frags().collect(),
            job,
            layout,
            members,
            memory,
            window: default_window(job.frag_elems),
            round: None,
            own_in_round: 0,
            own_sent: 0,
            round_frags: job.frags,
            in_flight: Vec::new(),
            cycle: CycleTime::default(),
            missing_since: vec![0; job.frags as usize],
            episode: 1,
            held: Vec::new(),
            stall: Stall { finals: 0, since: Instant::now(), after: NACK_AFTER },
            stats: RingServiceStats::default(),
        })
    }

    /// Own fragments not final here, at most (default [`default_window`]).
    pub fn with_window(mut self, window: usize) -> RingService {
        self.window = window.max(1);
        self
    }

    /// The ring's id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The ring's port.
    pub fn port(&self) -> u16 {
        self.job.port
    }

    /// This member's address.
    pub fn self_addr(&self) -> IpAddr {
        self.members[usize::from(self.job.me)]
    }

    /// The counters.
    pub fn stats(&self) -> RingServiceStats {
        self.stats
    }

    fn addr(&self, member: u16) -> SocketAddr {
        SocketAddr::new(self.members[usize::from(member)], self.job.port)
    }

    /// Fragment `frag`'s entry in round `r`'s buffer (`RingJob::index`).
    fn index(&self, r: Round, frag: u32) -> u32 {
        self.job.index(r, frag)
    }

    /// One received datagram from `from`.
    pub fn handle(&mut self, now: Instant, from: SocketAddr, mut datagram: Vec<u8>, out: &mut Vec<Transmit>) {
        let hdr = match RingHeader::decode(&datagram) {
            Ok((hdr, _)) if hdr.ring == self.id && self.layout.check(&hdr).is_ok() => hdr,
            _ => {
                self.stats.refused += 1;
                return;
            }
        };
        if hdr.kind == RingKind::Kick {
            if !from.ip().is_loopback() {
                self.stats.refused += 1;
                return;
            }
            self.stats.kicks += 1;
            self.poll(now, out);
            return;
        }
        if from.ip() != self.members[usize::from(hdr.sender)] {
            self.stats.refused += 1;
            return;
        }
        self.sync_round(now, out);
        match hdr.kind {
            RingKind::Partial => self.partial(hdr, &mut datagram, out),
            RingKind::Final => self.store_final(hdr, &mut datagram, out),
            RingKind::Nack => self.answer_nack(hdr, &datagram[abi::RING_HDR_LEN..], out),
            RingKind::Kick => {}
        }
    }

    /// A PARTIAL: add to it if its round is ready here, hold it if the
    /// round is still to come, drop it if it is over.
    fn partial(&mut self, hdr: RingHeader, datagram: &mut Vec<u8>, out: &mut Vec<Transmit>) {
        let ctrl = self.memory.ctrl(self.dense);
        match ctrl.ready() {
            Some(r) if r == hdr.round => {
                if ctrl.op.load(Ordering::Relaxed) != hdr.op as u32 {
                    // Members disagree on the round's op (the XDP program's
                    // `malformed`).
                    self.stats.refused += 1;
                    return;
                }
                self.add_and_send(hdr, r, datagram, out)
            }
            ready => {
                let newest = ready.unwrap_or(Round(ctrl.ready_round.load(Ordering::Relaxed)));
                if hdr.round.is_before(newest) || (ready.is_some() && hdr.round == newest) {
                    self.stats.refused += 1;
                } else if self.held.len() < HELD_MAX {
                    self.held.push(std::mem::take(datagram));
                    self.stats.early_held += 1;
                } else {
                    self.stats.early_dropped += 1;
                }
            }
        }
    }

    /// A user-space hop of a PARTIAL of the ready round `r`: this member's
    /// elements added; the completing member stores the result and sends
    /// the FINAL, the others send the PARTIAL on.
    fn add_and_send(&mut self, hdr: RingHeader, r: Round, datagram: &mut [u8], out: &mut Vec<Transmit>) {
        let index = self.index(r, hdr.frag);
        let len = usize::from(hdr.count);
        let input = self.memory.data(index)[..len].iter().map(|c| c.load(Ordering::Relaxed));
        let (head, payload) = datagram.split_at_mut(abi::RING_HDR_LEN);
        let saturated = hdr.saturated() | wire_ring::combine_be(hdr.op, self.job.weight, payload, input);
        self.stats.user_hops += 1;
        let mut next = RingHeader { hops: hdr.hops + 1, sender: self.job.me, ..hdr };
        if hdr.hops == self.job.members - 1 {
            wire_ring::complete_be(hdr.op, self.job.weight_sum, payload);
            if !self.memory.claim_result(index, r) {
                self.stats.duplicates += 1;
                return;
            }
            self.store(hdr.frag, r, payload, saturated);
            next.kind = RingKind::Final;
        }
        if saturated {
            next.flags |= abi::RING_F_SATURATED;
        }
        head.copy_from_slice(&next.encode());
        out.push(Transmit { to: self.addr(self.layout.next()), bytes: datagram.to_vec() });
        self.stats.forwarded += 1;
    }

    /// Stores a claimed result (big-endian `payload`) of fragment `frag`
    /// of round `r` and counts it final.
    fn store(&mut self, frag: u32, r: Round, payload: &[u8], saturated: bool) {
        for (cell, v) in self.memory.data(self.index(r, frag)).iter().zip(wire_ring::elements_be(payload)) {
            cell.store(v, Ordering::Relaxed);
        }
        if saturated {
            self.stats.saturated += 1;
        }
        self.memory.publish_result(self.dense, self.index(r, frag), r, saturated);
    }

    /// A FINAL: stored unless this round's result is there already, sent
    /// on unless it was the last.
    fn store_final(&mut self, hdr: RingHeader, datagram: &mut [u8], out: &mut Vec<Transmit>) {
        let r = hdr.round;
        let index = self.index(r, hdr.frag);
        if self.memory.ctrl(self.dense).ready() != Some(r) {
            // Not a round whose input this member gave: a stale copy.
            if self.memory.has_result(index, r) {
                self.stats.duplicates += 1;
            } else {
                self.stats.refused += 1;
            }
            return;
        }
        if !self.memory.claim_result(index, r) {
            self.stats.duplicates += 1;
            return;
        }
        let (head, payload) = datagram.split_at_mut(abi::RING_HDR_LEN);
        self.store(hdr.frag, r, payload, hdr.saturated());
        self.stats.user_hops += 1;
        if hdr.hops < self.layout.last_hops() {
            head.copy_from_slice(&RingHeader { hops: hdr.hops + 1, sender: self.job.me, ..hdr }.encode());
            out.push(Transmit { to: self.addr(self.layout.next()), bytes: datagram.to_vec() });
            self.stats.forwarded += 1;
        }
    }

    /// A NACK from member `hdr.sender`: FINALs it misses that are stored
    /// here, or (PARTIAL NACK) this member's own PARTIALs it never got.
    fn answer_nack(&mut self, hdr: RingHeader, payload: &[u8], out: &mut Vec<Transmit>) {
        self.stats.nacks_received += 1;
        let k = hdr.sender;
        let r = hdr.round;
        let frags = self.job.frags;
        // Round r's buffer holds its results until this member starts round
        // r + 2 (docs/RING.md "Why two buffers"); a NACK of an older round
        // is a stale copy whose sender completed that round long ago.
        // (While a call writes its input, `ready` is None and the buffer
        // being written is that of ready_round + 1.)
        let ctrl = self.memory.ctrl(self.dense);
        let buffer_holds_r = match ctrl.ready() {
            Some(ready) => ready == r || ready == r.plus(1),
            None => Round(ctrl.ready_round.load(Ordering::Acquire)) == r,
        };
        for f in wire_ring::nack_indexes(payload).filter(|&f| f < frags) {
            let index = self.index(r, f);
            if hdr.flags & abi::RING_F_NACK_FINAL != 0 {
                let stored = buffer_holds_r && self.memory.done(index).load(Ordering::Acquire) == r.0.wrapping_add(1);
                if stored && self.layout.completer(f) == self.job.me && k != self.job.me {
                    let hops = self.layout.final_hops_to(f, k);
                    let saturated = self.memory.result_saturated(index, r);
                    let bytes = self.fragment_datagram(RingKind::Final, f, r, hops, hdr.op, saturated, |elems, out| {
                        for (chunk, c) in out.chunks_exact_mut(4).zip(elems) {
                            chunk.copy_from_slice(&c.load(Ordering::Relaxed).to_be_bytes());
                        }
                        false
                    });
                    out.push(Transmit { to: self.addr(k), bytes });
                    self.stats.resends += 1;
                }
            } else if self.layout.origin(f) == self.job.me
                && self.sent_already(f)
                && self.memory.ctrl(self.dense).ready() == Some(r)
                && !self.memory.has_result(index, r)
            {
                self.send_original(f, r, out);
                self.stats.resends += 1;
                if let Some(entry) = self.in_flight.iter_mut().find(|(g, _)| *g == f) {
                    entry.1 = None;
                }
            }
        }
    }

    /// Whether own fragment `f` has had its PARTIAL hops 1 this round (the
    /// window sends the others in their turn: a NACK of one of those is
    /// premature and answering it would start a second chain).
    fn sent_already(&self, f: u32) -> bool {
        let i = (f / u32::from(self.job.members)) as usize;
        self.round.is_some() && i < self.own_sent
    }

    /// A PARTIAL or FINAL of fragment `f` whose payload `fill` writes from
    /// the fragment's stored elements (returning whether it saturated).
    #[allow(clippy::too_many_arguments)]
    fn fragment_datagram(
        &self,
        kind: RingKind,
        f: u32,
        r: Round,
        hops: u16,
        op: Op,
        saturated: bool,
        fill: impl FnOnce(&[std::sync::atomic::AtomicI32], &mut [u8]) -> bool,
    ) -> Vec<u8> {
        let count = self.layout.frag_len(f) as u16;
        let mut bytes = vec![0u8; abi::RING_HDR_LEN + 4 * usize::from(count)];
        let elems = &self.memory.data(self.index(r, f))[..usize::from(count)];
        let saturated = fill(elems, &mut bytes[abi::RING_HDR_LEN..]) | saturated;
        let hdr = RingHeader {
            ring: self.id,
            kind,
            flags: if saturated { abi::RING_F_SATURATED } else { 0 },
            round: r,
            frag: f,
            hops,
            count,
            sender: self.job.me,
            op,
        };
        bytes[..abi::RING_HDR_LEN].copy_from_slice(&hdr.encode());
        bytes
    }

    /// The ready round's op, as the runtime wrote it (`ring_ctrl.op`).
    fn round_op(&self) -> Op {
        // The runtime writes only ring ops; SUM stands for anything else.
        Op::from_u8(self.memory.ctrl(self.dense).op.load(Ordering::Relaxed) as u8).filter(|o| o.runs_in_ring()).unwrap_or(Op::Sum)
    }

    /// The PARTIAL hops 1 of own fragment `f` of round `r`.
    fn send_original(&mut self, f: u32, r: Round, out: &mut Vec<Transmit>) {
        let op = self.round_op();
        let weight = self.job.weight;
        let bytes = self.fragment_datagram(RingKind::Partial, f, r, 1, op, false, |elems, out| {
            wire_ring::origin_be(op, weight, elems.iter().map(|c| c.load(Ordering::Relaxed)), out)
        });
        out.push(Transmit { to: self.addr(self.layout.next()), bytes });
    }

    /// Starts round `r`: its held PARTIALs are added to, the others of
    /// them dropped.
    fn start_round(&mut self, now: Instant, r: Round, out: &mut Vec<Transmit>) {
        self.round = Some(r);
        self.stats.rounds += 1;
        self.own_sent = 0;
        self.round_frags = self.memory.ctrl(self.dense).round_frags(self.job.frags);
        let covered = self.round_frags;
        self.own_in_round = self.own.partition_point(|&f| f < covered);
        self.in_flight.clear();
        self.missing_since.iter_mut().for_each(|s| *s = 0);
        self.episode = 1;
        self.stall = Stall { finals: 0, since: now, after: self.cycle.nack_after() };
        for mut d in std::mem::take(&mut self.held) {
            match RingHeader::decode(&d) {
                // Through `partial` again: the round's op is known now.
                Ok((hdr, _)) if hdr.round == r => self.partial(hdr, &mut d, out),
                _ => self.stats.early_dropped += 1,
            }
        }
    }

    /// Starts the round the runtime made ready, if this service has not.
    fn sync_round(&mut self, now: Instant, out: &mut Vec<Transmit>) {
        if let Some(r) = self.memory.ctrl(self.dense).ready() {
            if self.round != Some(r) {
                self.start_round(now, r, out);
            }
        }
    }

    /// Timers and the window: starts a round the runtime made ready, sends
    /// own PARTIALs while fewer than `window` are not final here, NACKs
    /// when the round stalls.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Transmit>) {
        let Some(r) = self.memory.ctrl(self.dense).ready() else { return };
        self.sync_round(now, out);
        let (memory, job) = (&self.memory, &self.job);
        let cycle = &mut self.cycle;
        self.in_flight.retain(|&(f, sent)| {
            let done = memory.has_result(job.index(r, f), r);
            if let (true, Some(sent)) = (done, sent) {
                cycle.sample(now.saturating_duration_since(sent));
            }
            !done
        });
        while self.in_flight.len() < self.window && self.own_sent < self.own_in_round {
            let f = self.own[self.own_sent];
            self.own_sent += 1;
            if !self.memory.has_result(self.index(r, f), r) {
                self.send_original(f, r, out);
                self.stats.originals_sent += 1;
                self.in_flight.push((f, Some(now)));
            }
        }
        let ctrl = self.memory.ctrl(self.dense);
        if ctrl.finals_round.load(Ordering::Acquire) != r.0 {
            return;
        }
        let finals = ctrl.finals.load(Ordering::Acquire);
        if finals != self.stall.finals {
            self.stall = Stall { finals, since: now, after: self.cycle.nack_after() };
            self.episode = self.episode.wrapping_add(1).max(1);
        } else if finals < self.round_frags && now >= self.stall.since + self.stall.after {
            self.send_nacks(r, out);
            self.stall.since = now;
            self.stall.after = (self.stall.after * 2).min(NACK_AFTER_MAX);
        }
    }

    /// NACKs of the fragments not final here at this stall and an earlier
    /// one of the same episode (own ones not sent yet aside): to the origin for those this member
    /// completes, to the completing member (FINAL) for the others.
    fn send_nacks(&mut self, r: Round, out: &mut Vec<Transmit>) {
        let unsent: std::collections::HashSet<u32> = self.own[self.own_sent..self.own_in_round].iter().copied().collect();
        let mut by_peer: HashMap<(u16, bool), Vec<u32>> = HashMap::new();
        for f in 0..self.round_frags {
            if unsent.contains(&f) || self.memory.has_result(self.index(r, f), r) {
                continue;
            }
            if std::mem::replace(&mut self.missing_since[f as usize], self.episode) != self.episode {
                continue;
            }
            let completer = self.layout.completer(f);
            let key = if completer == self.job.me { (self.layout.origin(f), false) } else { (completer, true) };
            by_peer.entry(key).or_default().push(f);
        }
        let op = self.round_op();
        let mut peers: Vec<_> = by_peer.into_iter().collect();
        peers.sort_unstable_by_key(|(k, _)| *k);
        for ((peer, final_), frags) in peers {
            for chunk in frags.chunks(MAX_NACK_INDEXES) {
                let hdr = RingHeader {
                    ring: self.id,
                    kind: RingKind::Nack,
                    flags: if final_ { abi::RING_F_NACK_FINAL } else { 0 },
                    round: r,
                    frag: 0,
                    hops: 0,
                    count: chunk.len() as u16,
                    sender: self.job.me,
                    op,
                };
                let mut bytes = hdr.encode().to_vec();
                for f in chunk {
                    bytes.extend_from_slice(&f.to_be_bytes());
                }
                out.push(Transmit { to: self.addr(peer), bytes });
                self.stats.nacks_sent += 1;
            }
        }
    }

    /// When [`RingService::poll`] wants to run next.
    pub fn poll_timeout(&self, now: Instant) -> Instant {
        match self.memory.ctrl(self.dense).ready() {
            Some(r) if self.round != Some(r) => now,
            Some(_) if self.memory.ctrl(self.dense).finals.load(Ordering::Relaxed) < self.round_frags => {
                (now + ACTIVE_TICK).min(self.stall.since + self.stall.after)
            }
            _ => now + IDLE_TICK,
        }
    }
}

/// The window of a ring whose fragments carry `frag_elems` elements
/// ([`WINDOW_BYTES`]).
pub fn default_window(frag_elems: u32) -> usize {
    (WINDOW_BYTES / (abi::RING_HDR_LEN + 4 * frag_elems as usize)).clamp(2, DEFAULT_WINDOW)
}

/// A ring's socket: `addr:port` (the member's address, or loopback for the
/// KICKs), non-blocking, 8 MiB buffers (a round's datagrams arrive in
/// bursts of every member's window).
pub fn bind_ring_socket(addr: IpAddr, port: u16) -> Result<UdpSocket> {
    let at = SocketAddr::new(addr, port);
    let socket = UdpSocket::bind(at).map_err(|e| anyhow!("ring port {at}: {e}; another process holds it"))?;
    socket.set_nonblocking(true)?;
    crate::netif::set_socket_buffers(&socket, 8 << 20);
    Ok(socket)
}

/// The counters of every ring's service by ring id, as of the last poll.
pub type RingStatsFn = Arc<dyn Fn() -> HashMap<u16, RingServiceStats> + Send + Sync>;

/// One served ring: its bound sockets (the first is the one it sends from,
/// every one is read) and its service.
pub type ServedRing = (Vec<UdpSocket>, RingService);

/// What the serving thread and the node share: the rings served now, and
/// the counters last published of each.
#[derive(Default)]
struct Served {
    rings: Vec<ServedRing>,
    last: HashMap<u16, RingServiceStats>,
}

/// The thread serving every ring of a node; stopped and joined on drop.
/// Rings come and go while it runs ([`RingServer::stop_rings`],
/// [`RingServer::serve_rings`]): a reload that adds or removes one leaves
/// the others' services (their rounds, held PARTIALs, counters) alone.
pub struct RingServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    served: Arc<Mutex<Served>>,
    stats: Arc<Mutex<HashMap<u16, RingServiceStats>>>,
    /// The node's mapped ring memory (`None` for servers over memory of
    /// their own, in tests).
    memory: Option<Arc<RingMemory>>,
    pinned: Option<Arc<libbpf_rs::MapHandle>>,
}

impl std::fmt::Debug for RingServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingServer").finish_non_exhaustive()
    }
}

impl RingServer {
    /// Serves the rings of `kernel` (their dense indices and `ring_jobs`
    /// entries) on the node whose maps are pinned in `pin_dir`; `None`
    /// when `pool` reserves no ring memory (no ring can ever be served).
    /// The counters also go to `pin_dir/ring_service` ([`STATS_MAP`]).
    pub fn start_for(
        kernel: &super::desired::KernelState,
        pin_dir: &Path,
        pool: &crate::kernel::xdp::RingPool,
    ) -> Result<Option<RingServer>> {
        if pool.usage().reserved == 0 {
            return Ok(None);
        }
        let memory = Arc::new(RingMemory::open_pinned(pin_dir)?);
        let pinned = Arc::new(crate::kernel::maps::create_pinned_counters(
            pin_dir,
            STATS_MAP,
            std::mem::size_of::<RingServiceStats>() as u32,
            abi::MAX_RINGS,
        )?);
        let mut rings = Vec::new();
        for (dense, (job, members)) in &kernel.rings {
            let members = members.iter().map(|&m| IpAddr::from(m)).collect();
            let service = RingService::new(*dense, *job, members, memory.clone()).map_err(|e| anyhow!("ring {}: {e:#}", job.id))?;
            let sockets = bind_service_sockets(&service)?;
            rings.push((sockets, service));
        }
        let mut server = RingServer::start(rings, Some(pinned))?;
        server.memory = Some(memory);
        Ok(Some(server))
    }

    /// Serves `rings` on a thread of its own.
    pub fn start(rings: Vec<ServedRing>, pinned: Option<Arc<libbpf_rs::MapHandle>>) -> Result<RingServer> {
        if rings.iter().any(|(sockets, _)| sockets.is_empty()) {
            return Err(anyhow!("a ring without a socket"));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(HashMap::new()));
        let served = Arc::new(Mutex::new(Served { rings, last: HashMap::new() }));
        let (flag, shared, serving, map) = (stop.clone(), stats.clone(), served.clone(), pinned.clone());
        let thread = std::thread::Builder::new()
            .name("aggbox-ring".into())
            .spawn(move || serve(&serving, &flag, &shared, map.as_deref()))?;
        Ok(RingServer { stop, thread: Some(thread), served, stats, memory: None, pinned })
    }

    /// The node's mapped ring memory, over which new rings' services run.
    pub fn memory(&self) -> Option<&Arc<RingMemory>> {
        self.memory.as_ref()
    }

    /// Stops serving the rings `ids` and hands their sockets and services
    /// back (to serve them again, or to reuse the sockets for the ring's
    /// next service); their counters leave `/metrics` and `aggbox status`.
    /// When this returns, the thread no longer touches them.
    pub fn stop_rings(&self, ids: &[u16]) -> Vec<ServedRing> {
        let mut served = self.served.lock().unwrap_or_else(|p| p.into_inner());
        let (taken, kept): (Vec<ServedRing>, Vec<ServedRing>) = served.rings.drain(..).partition(|(_, s)| ids.contains(&s.id()));
        served.rings = kept;
        let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            served.last.remove(id);
            stats.remove(id);
            if let Some(map) = &self.pinned {
                let _ = crate::kernel::maps::delete_if_present(map.as_ref(), &u32::from(*id).to_ne_bytes());
            }
        }
        taken
    }

    /// Serves `rings` too (new rings, or rings [`RingServer::stop_rings`]
    /// handed back).
    pub fn serve_rings(&self, rings: Vec<ServedRing>) -> Result<()> {
        if rings.iter().any(|(sockets, _)| sockets.is_empty()) {
            return Err(anyhow!("a ring without a socket"));
        }
        self.served.lock().unwrap_or_else(|p| p.into_inner()).rings.extend(rings);
        Ok(())
    }

    /// The ids of the rings served now.
    pub fn ring_ids(&self) -> Vec<u16> {
        self.served.lock().unwrap_or_else(|p| p.into_inner()).rings.iter().map(|(_, s)| s.id()).collect()
    }

    /// The counters of every ring, as of the last publish.
    pub fn stats(&self) -> HashMap<u16, RingServiceStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// A handle on the counters for the metrics endpoint.
    pub fn stats_fn(&self) -> RingStatsFn {
        let stats = self.stats.clone();
        Arc::new(move || stats.lock().map(|s| s.clone()).unwrap_or_default())
    }
}

/// A service's sockets: on the member's address, so that what the service
/// sends comes from the address the other members' XDP programs check (a
/// node may have several), and on 127.0.0.1 for the KICKs (the runtime
/// kicks there whatever the ring's IP version).
pub fn bind_service_sockets(service: &RingService) -> Result<Vec<UdpSocket>> {
    service_addrs(service.self_addr(), service.port()).into_iter().map(|at| bind_ring_socket(at.ip(), at.port())).collect()
}

/// Where a ring's service listens: `self_addr:port` first (the socket it
/// sends from), then 127.0.0.1:port.
fn service_addrs(self_addr: IpAddr, port: u16) -> [SocketAddr; 2] {
    [SocketAddr::new(self_addr, port), SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)]
}

/// A change of the rings a [`RingServer`] serves (a reload's): the rings
/// whose services stop (removed, changed or moved) and the services that
/// start, made and with their sockets bound before anything changes, so
/// that a port another process holds refuses the reload; a socket a
/// stopping ring holds at the same address and port passes to the new
/// service (a resized ring keeps its port).
#[derive(Debug, Default)]
pub struct RingServiceChange {
    stop: Vec<u16>,
    /// Each starting service with its sockets: `Ok` bound now, `Err` the
    /// address a stopped ring's socket is bound to.
    start: Vec<(Vec<std::result::Result<UdpSocket, SocketAddr>>, RingService)>,
}

impl RingServiceChange {
    /// The change that moves `server` from the rings of `old` to those of
    /// `new` (the node's kernel states: a ring whose entry is the same at
    /// the same dense index goes on untouched).
    pub fn between(
        server: Option<&RingServer>,
        old: &super::desired::KernelState,
        new: &super::desired::KernelState,
    ) -> Result<RingServiceChange> {
        let stopping: Vec<(&RingJob, IpAddr)> = old
            .rings
            .iter()
            .filter(|(dense, entry)| new.rings.get(dense) != Some(entry))
            .map(|(_, (job, members))| (job, IpAddr::from(members[usize::from(job.me)])))
            .collect();
        let starting: Vec<(u32, &RingJob, Vec<IpAddr>)> = new
            .rings
            .iter()
            .filter(|(dense, entry)| old.rings.get(dense) != Some(entry))
            .map(|(dense, (job, members))| (*dense, job, members.iter().map(|&m| IpAddr::from(m)).collect()))
            .collect();
        let mut change = RingServiceChange { stop: stopping.iter().map(|(j, _)| j.id).collect(), start: Vec::new() };
        if starting.is_empty() {
            return Ok(change);
        }
        let memory = server
            .and_then(RingServer::memory)
            .ok_or_else(|| anyhow!("the ring service is not running (this node reserved no ring memory at attach)"))?;
        let held: Vec<SocketAddr> = stopping.iter().flat_map(|(j, me)| service_addrs(*me, j.port)).collect();
        for (dense, job, members) in starting {
            let service = RingService::new(dense, *job, members, memory.clone()).map_err(|e| anyhow!("ring {}: {e:#}", job.id))?;
            let mut sockets = Vec::new();
            for at in service_addrs(service.self_addr(), job.port) {
                sockets.push(if held.contains(&at) { Err(at) } else { Ok(bind_ring_socket(at.ip(), at.port())?) });
            }
            change.start.push((sockets, service));
        }
        Ok(change)
    }

    /// Whether no service stops or starts.
    pub fn is_empty(&self) -> bool {
        self.stop.is_empty() && self.start.is_empty()
    }

    /// Step 1, before the kernel's maps change: the services of the rings
    /// that go stop (handed back, to [`RingServiceChange::undo`] if the
    /// maps are set back).
    pub fn stop(&self, server: Option<&RingServer>) -> Vec<ServedRing> {
        match server {
            Some(server) if !self.stop.is_empty() => server.stop_rings(&self.stop),
            _ => Vec::new(),
        }
    }

    /// Step 2, once the maps hold the new rings: their services start, with
    /// the sockets bound before or taken from `stopped`.
    pub fn start(self, server: Option<&RingServer>, stopped: Vec<ServedRing>) -> Result<()> {
        let mut spare: Vec<UdpSocket> = stopped.into_iter().flat_map(|(sockets, _)| sockets).collect();
        let mut rings = Vec::new();
        for (sockets, service) in self.start {
            let mut bound = Vec::new();
            for socket in sockets {
                bound.push(match socket {
                    Ok(socket) => socket,
                    Err(at) => match spare.iter().position(|s| s.local_addr().ok() == Some(at)) {
                        Some(i) => spare.swap_remove(i),
                        None => bind_ring_socket(at.ip(), at.port())?,
                    },
                });
            }
            rings.push((bound, service));
        }
        drop(spare);
        match server {
            Some(server) => server.serve_rings(rings),
            None if rings.is_empty() => Ok(()),
            None => Err(anyhow!("the ring service is not running")),
        }
    }

    /// The maps were set back: the stopped services serve again.
    pub fn undo(server: Option<&RingServer>, stopped: Vec<ServedRing>) -> Result<()> {
        match server {
            Some(server) => server.serve_rings(stopped),
            None => Ok(()),
        }
    }
}

impl Drop for RingServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}


fn publish_one(map: &libbpf_rs::MapHandle, id: u16, stats: &RingServiceStats) {
    use libbpf_rs::MapCore;
    let _ = map.update(&u32::from(id).to_ne_bytes(), abi::as_bytes(stats), libbpf_rs::MapFlags::ANY);
}

/// The XDP program's counters of every ring pinned in `pin_dir` (ring
/// id, counters summed over CPUs); empty when there is no ring.
pub fn pinned_ring_counters(pin_dir: &Path) -> Result<Vec<(u16, abi::RingStats)>> {
    use crate::kernel::maps::{self, names};
    use libbpf_rs::{MapCore, MapFlags};
    let (Ok(jobs), Ok(stats)) = (maps::open_pinned(pin_dir, names::RING_JOBS), maps::open_pinned(pin_dir, names::RING_STATS)) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for dense in 0..abi::MAX_RINGS {
        let key = dense.to_ne_bytes();
        let Some(job) = jobs.lookup(&key, MapFlags::ANY)?.and_then(|v| abi::from_bytes::<RingJob>(&v)) else { continue };
        if job.members < 2 {
            continue;
        }
        out.push((job.id, maps::percpu_array_sum::<abi::RingStats>(&stats, dense)?));
    }
    Ok(out)
}

/// The ring memory of the node whose maps are pinned in `pin_dir` and the
/// rings placed in it (`ring_data`'s size, `ring_jobs`' entries); an empty
/// pool when the ring maps are not pinned.
pub fn pinned_ring_pool(pin_dir: &Path) -> Result<crate::kernel::xdp::RingPool> {
    use crate::kernel::maps::{self, names};
    use crate::kernel::xdp::{RingPlace, RingPool, RingSizing};
    use libbpf_rs::{MapCore, MapFlags};
    let (Ok(data), Ok(jobs)) = (maps::open_pinned(pin_dir, names::RING_DATA), maps::open_pinned(pin_dir, names::RING_JOBS)) else {
        return Ok(RingPool::with_places(crate::config::DEFAULT_RING_FRAG_ELEMS, 0, []));
    };
    let mut places = Vec::new();
    for dense in 0..abi::MAX_RINGS {
        let Some(job) = jobs.lookup(&dense.to_ne_bytes(), MapFlags::ANY)?.and_then(|v| abi::from_bytes::<RingJob>(&v)) else { continue };
        if job.members >= 2 {
            places.push((job.id, RingPlace { dense, base: job.base, entries: job.entries() }));
        }
    }
    Ok(RingPool::with_places(data.value_size() / 4, RingSizing::reserved_in(data.max_entries()), places))
}

/// Datagrams read from one socket before the others get their turn.
const RECV_BATCH: usize = 256;

fn serve(served: &Mutex<Served>, stop: &AtomicBool, stats: &Mutex<HashMap<u16, RingServiceStats>>, pinned: Option<&libbpf_rs::MapHandle>) {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    let mut published = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // The lock is held for one pass over the rings, never while
        // waiting: a reload that adds or removes a ring waits one pass.
        let (mut fds, wait) = {
            let mut guard = served.lock().unwrap_or_else(|p| p.into_inner());
            let Served { rings, last } = &mut *guard;
            for (sockets, service) in rings.iter_mut() {
                for socket in sockets.iter() {
                    for _ in 0..RECV_BATCH {
                        match socket.recv_from(&mut buf) {
                            Ok((n, from)) => service.handle(Instant::now(), from, buf[..n].to_vec(), &mut out),
                            Err(_) => break,
                        }
                        send_all(&sockets[0], &mut out);
                    }
                }
                service.poll(Instant::now(), &mut out);
                send_all(&sockets[0], &mut out);
            }
            let now = Instant::now();
            if now >= published + PUBLISH_EVERY {
                published = now;
                publish(rings, stats, pinned, last);
            }
            let wake = rings.iter().map(|(_, s)| s.poll_timeout(now)).min().unwrap_or(now + IDLE_TICK);
            let fds: Vec<libc::pollfd> = rings
                .iter()
                .flat_map(|(sockets, _)| sockets.iter())
                .map(|s| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 })
                .collect();
            (fds, wake.saturating_duration_since(now).min(IDLE_TICK))
        };
        // A socket closed meanwhile (its ring stopped) only ends the wait
        // early: the next pass polls the rings served then.
        let ts = libc::timespec { tv_sec: 0, tv_nsec: wait.as_nanos() as libc::c_long };
        // SAFETY: fds is a valid pollfd array for the call; ts a valid timespec.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
    }
    let mut guard = served.lock().unwrap_or_else(|p| p.into_inner());
    let Served { rings, last } = &mut *guard;
    publish(rings, stats, pinned, last);
}

/// Sends what the services queued; a datagram the socket refuses is lost
/// like one the network drops (the NACKs repair it).
fn send_all(socket: &UdpSocket, out: &mut Vec<Transmit>) {
    for t in out.drain(..) {
        let _ = socket.send_to(&t.bytes, t.to);
    }
}

fn publish(
    rings: &[ServedRing],
    stats: &Mutex<HashMap<u16, RingServiceStats>>,
    pinned: Option<&libbpf_rs::MapHandle>,
    last: &mut HashMap<u16, RingServiceStats>,
) {
    let Ok(mut s) = stats.lock() else { return };
    for (_, service) in rings {
        let now = service.stats();
        s.insert(service.id(), now);
        if last.insert(service.id(), now) != Some(now) {
            if let Some(map) = pinned {
                publish_one(map, service.id(), &now);
            }
        }
    }
}

#[cfg(test)]
mod tests;
