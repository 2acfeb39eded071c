//! Ring allreduce for applications (docs/RING.md "One call"): a
//! [`RingCommunicator`] is one member's application of a `[[ring]]` job. It
//! maps its node's ring memory (`ring_data`, `ring_done`, `ring_ctrl`,
//! pinned by `aggbox attach`), writes its input there, makes the round
//! ready, KICKs its node's ring service and waits until every fragment's
//! result is stored here, by the XDP program or the service. No datagram
//! passes through this process.
//!
//! Rounds: a communicator starts at its node's `ring_ctrl.ready_round + 1`,
//! so an application that restarts continues where the last one stopped;
//! every member's application must make the same calls in the same order
//! (as with any collective), and the members' nodes must have attached
//! together (fresh ring memory starts every member at round 1).
//!
//! This module maps the node's maps itself ([`crate::wire::ring_memory`]):
//! the one place the runtime touches what the node pinned.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};


use crate::config::Config;
use crate::wire::ring_memory::{self, RingMemory};
use crate::runtime::quantize::{self, Quantization};
use crate::runtime::{CommError, Peer, TimeoutInfo};
use crate::wire::abi::{Op, Round, RingJob};
use crate::wire::ring::{RingHeader, RingKind, RingLayout};

/// Default deadline of a call.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

/// Fragments named in a timeout error, at most.
const MISSING_SHOWN: usize = 16;

/// What a ring allreduce says besides the values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOutput {
    /// Some partial left the int32 range and was saturated (OVERFLOW):
    /// the result may differ from the star's clamped one.
    pub overflow: bool,
}

/// One member's application of a ring job (see the module docs).
#[derive(Debug)]
pub struct RingCommunicator {
    dense: u32,
    job: RingJob,
    memory: Arc<RingMemory>,
    kick: UdpSocket,
    /// The last round this communicator started.
    round: Round,
    deadline: Duration,
    quantization: Quantization,
}

impl RingCommunicator {
    /// The communicator of ring `ring_id` (a `[[ring]]` of `config`) on
    /// the node whose `aggbox attach` pinned its maps in `pin_dir`; its
    /// ring service is reached at 127.0.0.1 on the ring's port, so call it
    /// in the node's network namespace.
    pub fn open(config: &Config, ring_id: u16, pin_dir: &Path) -> Result<RingCommunicator, CommError> {
        let ring = config.ring(ring_id).ok_or_else(|| CommError::Config(format!("ring {ring_id} is not in the configuration")))?;
        let map_err = |e: ring_memory::RingMemoryError| CommError::Config(format!("ring {ring_id}: {e}"));
        let (dense, job) = ring_memory::pinned_ring_job(pin_dir, ring_id).map_err(map_err)?;
        if job.port != ring.port || job.vector_len != ring.vector_len || usize::from(job.members) != ring.members.len() {
            return Err(CommError::Config(format!(
                "ring {ring_id}: the node's ring (port {}, {} elements, {} members) is not the configuration's (port {}, {}, {}); attach again with this configuration",
                job.port, job.vector_len, job.members, ring.port, ring.vector_len, ring.members.len()
            )));
        }
        let memory = Arc::new(RingMemory::open_pinned(pin_dir).map_err(map_err)?);
        RingCommunicator::over(memory, dense, job, SocketAddrV4::new(Ipv4Addr::LOCALHOST, job.port))
    }

    /// The communicator of the ring a run on demand was granted
    /// (`JobGrant::ring`, docs/INTERFACE.md "Rings on demand") on this
    /// rank's own node, whose `aggbox attach` pinned its maps in `pin_dir`;
    /// as [`RingCommunicator::open`], in the node's network namespace.
    pub fn open_granted(ring: &crate::wire::control::RingGrant, pin_dir: &Path) -> Result<RingCommunicator, CommError> {
        let map_err = |e: ring_memory::RingMemoryError| CommError::Config(format!("ring {}: {e}", ring.id));
        let (dense, job) = ring_memory::pinned_ring_job(pin_dir, ring.id).map_err(map_err)?;
        if job.port != ring.port || job.vector_len != ring.vector_len || usize::from(job.members) != ring.members.len() {
            return Err(CommError::Config(format!(
                "ring {}: this node's ring (port {}, {} elements, {} members) is not the one granted (port {}, {}, {}): is {} the pin directory of this rank's own node?",
                ring.id, job.port, job.vector_len, job.members, ring.port, ring.vector_len, ring.members.len(), pin_dir.display()
            )));
        }
        let memory = Arc::new(RingMemory::open_pinned(pin_dir).map_err(map_err)?);
        RingCommunicator::over(memory, dense, job, SocketAddrV4::new(Ipv4Addr::LOCALHOST, job.port))
    }

    /// The communicator of the ring `job` (dense index `dense`) in
    /// `memory`, KICKing `kick_to` (the ring service; tests over heap
    /// memory give their own).
    fn over(memory: Arc<RingMemory>, dense: u32, job: RingJob, kick_to: SocketAddrV4) -> Result<RingCommunicator, CommError> {
        memory.check_job(&job).map_err(|e| CommError::Config(format!("ring {}: {e}", job.id)))?;
        let kick = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))?;
        kick.connect(kick_to)?;
        let round = Round(memory.ctrl(dense).ready_round.load(Ordering::Acquire));
        Ok(RingCommunicator {
            dense,
            job,
            memory,
            kick,
            round,
            deadline: DEFAULT_DEADLINE,
            quantization: Quantization::default(),
        })
    }

    /// Each call's deadline (default [`DEFAULT_DEADLINE`]).
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    /// How [`RingCommunicator::allreduce_f32`] quantizes (default
    /// `Fixed(1e8)`).
    pub fn set_quantization(&mut self, q: Quantization) {
        self.quantization = q;
    }

    /// The ring's id.
    pub fn ring_id(&self) -> u16 {
        self.job.id
    }

    /// Elements of the ring's vector (every call reduces exactly that).
    pub fn len(&self) -> usize {
        self.job.vector_len as usize
    }

    /// Never: a ring has at least one element.
    pub fn is_empty(&self) -> bool {
        self.job.vector_len == 0
    }

    /// This member's index in the ring.
    pub fn member(&self) -> u16 {
        self.job.me
    }

    /// The ring's member count.
    pub fn members(&self) -> u16 {
        self.job.members
    }

    /// The round of the last call.
    pub fn round(&self) -> Round {
        self.round
    }

    /// The next call's input buffer in the node's memory, to fill with the
    /// input of [`RingCommunicator::allreduce_in_place`] (no copy). It is
    /// not the last call's [`RingCommunicator::result`]: the ring keeps two
    /// buffers, rounds alternating, so that a round's results stay in place
    /// while another member may still ask for them (docs/RING.md "Why two
    /// buffers"). Between calls nothing else writes it (the next round's
    /// datagrams wait for the next call; the round before last is over on
    /// every member).
    pub fn input_mut(&mut self) -> &mut [i32] {
        let cells = self.memory.data(self.job.round_base(self.round.plus(1)));
        // SAFETY: a buffer's fragments are consecutive `ring_data` values
        // of frag_elems int32 each (value size frag_elems · 4, a multiple
        // of 8, so no padding between them), checked to fit the map by
        // `check_job`; `&mut self` makes this the only user in this
        // process, and between calls no other writer touches it (above).
        unsafe { std::slice::from_raw_parts_mut(cells.as_ptr() as *mut i32, self.job.vector_len as usize) }
    }

    /// The last call's result in the node's memory (no copy), valid until
    /// the next call: stored before the call returned, and no datagram of
    /// its round stores anything any more (duplicates find it claimed).
    pub fn result(&self) -> &[i32] {
        let cells = self.memory.data(self.job.round_base(self.round));
        // SAFETY: as `input_mut`; shared, and the stores of this buffer's
        // round are over (above).
        unsafe { std::slice::from_raw_parts(cells.as_ptr() as *const i32, self.job.vector_len as usize) }
    }

    /// Allreduce of `buf` (exactly [`RingCommunicator::len`] elements)
    /// with `op` (one that [`Op::runs_in_ring`]: SUM, COUNT, MAX, MIN, AVG,
    /// LAND, LOR; weights of the configuration),
    /// the result written back into `buf`.
    pub fn allreduce_i32(&mut self, buf: &mut [i32], op: Op) -> Result<RingOutput, CommError> {
        self.check_len(buf.len())?;
        let out = self.run(op, self.job.frags, |m, base| m.write_vector(base, buf))?;
        self.memory.read_vector(self.job.round_base(self.round), buf);
        Ok(out)
    }

    /// Allreduce of what [`RingCommunicator::input_mut`] holds, the result
    /// left in [`RingCommunicator::result`].
    pub fn allreduce_in_place(&mut self, op: Op) -> Result<RingOutput, CommError> {
        self.run(op, self.job.frags, |_, _| {})
    }

    /// Float allreduce through the quantization (as
    /// `Communicator::allreduce_f32`): the SUM of `w · round(x · S)`, or
    /// the mean (divided by the weight sum too). OVERFLOW is an error with
    /// a fixed scale, a rerun at the adaptive scale with
    /// `FixedOrAdaptive`; `Adaptive` agrees on `max |x|` with a ring MAX
    /// of fragment 0 first (a round of one fragment).
    pub fn allreduce_f32(&mut self, buf: &mut [f32], mean: bool) -> Result<(), CommError> {
        self.check_len(buf.len())?;
        quantize::check_finite(buf).map_err(|e| CommError::Config(e.to_string()))?;
        let (mut scale, mut rerun) = match self.quantization {
            Quantization::Fixed(s) => (s, false),
            Quantization::FixedOrAdaptive(s) => (s, true),
            Quantization::Adaptive => (self.adaptive_scale(buf)?, false),
        };
        if !(scale.is_finite() && scale > 0.0) {
            return Err(CommError::Config(quantize::QuantizeError::BadScale(scale).to_string()));
        }
        loop {
            let mut q = Vec::new();
            quantize::quantize_into(buf, scale, &mut q).map_err(|e| CommError::Config(e.to_string()))?;
            let out = self.run(Op::Sum, self.job.frags, |m, base| m.write_vector(base, &q))?;
            if out.overflow {
                if rerun {
                    // The saturated fragments' FINALs reach every member
                    // flagged, so every member reruns alike.
                    rerun = false;
                    scale = self.adaptive_scale(buf)?;
                    continue;
                }
                return Err(CommError::Overflow { round: self.round, scale });
            }
            self.memory.read_vector(self.job.round_base(self.round), &mut q);
            let div = if mean { scale * f64::from(self.job.weight_sum) } else { scale };
            quantize::dequantize_into(&q, div, buf);
            return Ok(());
        }
    }

    fn check_len(&self, len: usize) -> Result<(), CommError> {
        if len != self.len() {
            return Err(CommError::Config(format!(
                "ring {}: a vector of {len} elements; the ring reduces {} (its vector_len)",
                self.job.id,
                self.len()
            )));
        }
        Ok(())
    }

    /// The adaptive scale, agreed with the other members by a ring MAX of
    /// `max |x|`'s bits over fragment 0 alone (element 0; the rest 0): a
    /// round of one fragment, not of the whole vector.
    fn adaptive_scale(&mut self, buf: &[f32]) -> Result<f64, CommError> {
        let m = quantize::max_abs(buf).map_err(|e| CommError::Config(e.to_string()))?;
        let bits = m.to_bits() as i32;
        let first = (self.job.frag_elems as usize).min(self.len());
        self.run(Op::Max, 1, |mem, base| {
            let mut v = vec![0; first];
            v[0] = bits;
            mem.write_vector(base, &v);
        })?;
        let agreed = f32::from_bits(self.memory.data(self.job.round_base(self.round))[0].load(Ordering::Relaxed) as u32);
        // Σ|w| contributions of at most max |x| · S each.
        let weights = u16::try_from(self.job.weight_sum).unwrap_or(u16::MAX);
        Ok(quantize::adaptive_scale(agreed, weights))
    }

    /// One round over fragments `0..frags` (every member calls with the
    /// same `frags`): the input through `write` (given the memory and the
    /// index of fragment 0 in the round's buffer), then the KICK, then the
    /// wait for those fragments' results.
    fn run(&mut self, op: Op, frags: u32, write: impl FnOnce(&RingMemory, u32)) -> Result<RingOutput, CommError> {
        if !op.runs_in_ring() {
            let ring_ops: Vec<&str> = Op::ALL.iter().filter(|o| o.runs_in_ring()).map(|o| o.name()).collect();
            return Err(CommError::Config(format!("op {} is not a ring op ({})", op.name(), ring_ops.join(", "))));
        }
        let r = self.round.plus(1);
        let base = self.job.round_base(r);
        self.memory.begin_round(self.dense, r, op, frags, |m| write(m, base));
        self.round = r;
        let kick = RingHeader { ring: self.job.id, kind: RingKind::Kick, flags: 0, round: r, frag: 0, hops: 0, count: 0, sender: self.job.me, op };
        // A lost KICK costs the service's next look at ring_ctrl (20 ms).
        let _ = self.kick.send(&kick.encode());
        let start = Instant::now();
        let ctrl = self.memory.ctrl(self.dense);
        let mut spins = 0u32;
        loop {
            if ctrl.finals_round.load(Ordering::Acquire) == r.0 && ctrl.finals.load(Ordering::Acquire) >= frags {
                break;
            }
            if start.elapsed() >= self.deadline {
                return Err(self.timeout(r, frags));
            }
            // A call of a few fragments takes tens of microseconds.
            // Short waits while the round may be about to end, longer ones
            // after (a spinning caller takes a CPU from the ring service).
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(if spins < 200 { 20 } else { 500 }));
            }
        }
        let missing = self.missing(r, frags);
        if !missing.is_empty() {
            return Err(CommError::Config(format!(
                "ring {} round {r}: finals counted every fragment, but ring_done lacks {missing:?}",
                self.job.id
            )));
        }
        Ok(RingOutput { overflow: self.saturated(r, frags) })
    }

    /// Fragments of round `r` (covering `0..frags`) not stored here.
    fn missing(&self, r: Round, frags: u32) -> Vec<u32> {
        (0..frags).filter(|&f| !self.memory.has_result(self.job.index(r, f), r)).collect()
    }

    fn timeout(&self, r: Round, frags: u32) -> CommError {
        let missing = self.missing(r, frags);
        let layout = RingLayout::of_job(&self.job);
        let mut completers: Vec<u16> = missing.iter().map(|&f| layout.completer(f)).collect();
        completers.sort_unstable();
        completers.dedup();
        let shown: Vec<String> = missing.iter().take(MISSING_SHOWN).map(u32::to_string).collect();
        let more = missing.len().saturating_sub(MISSING_SHOWN);
        CommError::Timeout(Box::new(TimeoutInfo {
            op: "ring allreduce",
            round: r,
            missing: completers.into_iter().map(Peer::Rank).collect(),
            missing_known: true,
            arrived: (frags as usize).saturating_sub(missing.len()),
            expected: frags as usize,
            what: format!(
                "fragments of ring {} stored here; missing fragments {}{} (the ranks named complete them)",
                self.job.id,
                shown.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            ),
            partial: None,
        }))
    }

    /// Datagrams carrying SATURATED seen by this node's XDP program, plus
    /// saturated fragments stored by its ring service.
    /// Whether some fragment's result of round `r` saturated: the flag
    /// stored with each result (`ring_done.saturated_plus1`), the same on
    /// every member, so every member's call says OVERFLOW alike.
    fn saturated(&self, r: Round, frags: u32) -> bool {
        (0..frags).any(|f| self.memory.result_saturated(self.job.index(r, f), r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::ring::{bind_ring_socket, RingServer, RingService};
    use crate::wire::reducer;

    /// Three members on 127.0.0.{1,2,3} at one port, each a ring service
    /// over heap memory and a communicator over the same memory.
    struct Loop {
        comms: Vec<RingCommunicator>,
        _servers: Vec<RingServer>,
    }

    const WEIGHTS: [i32; 3] = [1, 2, 3];

    fn ring(len: u32) -> Loop {
        let addrs: Vec<Ipv4Addr> = (0..3).map(|m| Ipv4Addr::new(127, 0, 0, 1 + m)).collect();
        let (port, sockets) = (30000..40000u16)
            .find_map(|p| addrs.iter().map(|&a| bind_ring_socket(a.into(), p)).collect::<anyhow::Result<Vec<_>>>().ok().map(|s| (p, s)))
            .expect("a free port");
        let frag_elems = 6;
        let frags = len.div_ceil(frag_elems);
        let (mut comms, mut servers) = (Vec::new(), Vec::new());
        for (m, socket) in sockets.into_iter().enumerate() {
            let memory = Arc::new(RingMemory::heap(frag_elems, 2 * frags + 1));
            let job = RingJob {
                id: 40,
                port,
                members: 3,
                me: m as u16,
                frag_elems,
                frags,
                vector_len: len,
                base: 1,
                weight_sum: WEIGHTS.iter().sum::<i32>() as u32,
                weight: WEIGHTS[m],
                self_addr: 0,
                next_addr: 0,
            };
            let service = RingService::new(0, job, addrs.iter().map(|&a| a.into()).collect(), memory.clone()).expect("service");
            servers.push(RingServer::start(vec![(vec![socket], service)], None).expect("server"));
            let mut c = RingCommunicator::over(memory, 0, job, SocketAddrV4::new(addrs[m], port)).expect("communicator");
            c.set_deadline(Duration::from_secs(20));
            comms.push(c);
        }
        Loop { comms, _servers: servers }
    }

    fn each<T: Send>(l: &mut Loop, call: impl Fn(usize, &mut RingCommunicator) -> T + Sync) -> Vec<T> {
        let call = &call;
        std::thread::scope(|s| {
            let hs: Vec<_> = l.comms.iter_mut().enumerate().map(|(m, c)| s.spawn(move || call(m, c))).collect();
            hs.into_iter().map(|h| h.join().expect("member")).collect()
        })
    }

    fn input(m: usize, len: usize) -> Vec<i32> {
        (0..len).map(|i| ((i * 37 + m * 1001) % 2001) as i32 - 1000).collect()
    }

    #[test]
    fn int_calls_in_place_and_copied_match_the_reference() {
        let len = 40;
        let mut l = ring(len as u32);
        let inputs: Vec<Vec<i32>> = (0..3).map(|m| input(m, len)).collect();
        for op in Op::ALL.into_iter().filter(|o| o.runs_in_ring()) {
            let c: Vec<(&[i32], i32)> = inputs.iter().map(Vec::as_slice).zip(WEIGHTS).collect();
            let want = reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec();
            let got = each(&mut l, |m, c| {
                let mut v = inputs[m].clone();
                let out = c.allreduce_i32(&mut v, op).expect("allreduce");
                assert!(!out.overflow);
                v
            });
            assert!(got.iter().all(|g| *g == want), "{op:?}");
            let got = each(&mut l, |m, c| {
                c.input_mut().copy_from_slice(&inputs[m]);
                c.allreduce_in_place(op).expect("in place");
                c.result().to_vec()
            });
            assert!(got.iter().all(|g| *g == want), "{op:?} in place");
        }
        // two calls per ring op
        let ring_ops = Op::ALL.iter().filter(|o| o.runs_in_ring()).count() as u32;
        assert_eq!(l.comms[0].round(), Round(2 * ring_ops));
        // Wrong length, and an op the ring does not reduce.
        let mut short = vec![0; len - 1];
        assert!(matches!(l.comms[0].allreduce_i32(&mut short, Op::Sum), Err(CommError::Config(_))));
        let mut v = vec![0; len];
        assert!(matches!(l.comms[0].allreduce_i32(&mut v, Op::Prod), Err(CommError::Config(_))));
    }

    #[test]
    fn floats_through_each_quantization() {
        let len = 25;
        let mut l = ring(len as u32);
        let floats: Vec<Vec<f32>> = (0..3).map(|m| (0..len).map(|i| ((i * 7 + m * 3) % 50) as f32 / 7.0 - 3.0).collect()).collect();
        // (A saturating fixed scale is seen through the node's counters,
        // which heap memory has not: tests/netns_ring.rs covers the rerun.)
        for q in [Quantization::Fixed(1e6), Quantization::Adaptive, Quantization::FixedOrAdaptive(1e6)] {
            let got = each(&mut l, |m, c| {
                c.set_quantization(q);
                let mut v = floats[m].clone();
                c.allreduce_f32(&mut v, true).expect("f32");
                v
            });
            for i in 0..len {
                let exact: f64 = floats.iter().zip(WEIGHTS).map(|(v, w)| f64::from(w) * f64::from(v[i])).sum::<f64>() / 6.0;
                for g in &got {
                    assert!((f64::from(g[i]) - exact).abs() < 1e-5, "{q:?} element {i}: {} vs {exact}", g[i]);
                }
            }
        }
        // The sum, not the mean.
        let got = each(&mut l, |m, c| {
            let mut v = floats[m].clone();
            c.allreduce_f32(&mut v, false).expect("f32 sum");
            v
        });
        let exact: f64 = floats.iter().zip(WEIGHTS).map(|(v, w)| f64::from(w) * f64::from(v[3])).sum();
        assert!(got.iter().all(|g| (f64::from(g[3]) - exact).abs() < 1e-4), "{} vs {exact}", got[0][3]);
    }

    #[test]
    fn a_member_that_does_not_call_makes_the_others_time_out_naming_what_is_missing() {
        let len = 30;
        let mut l = ring(len as u32);
        let c = &mut l.comms[0];
        c.set_deadline(Duration::from_millis(300));
        let mut v = input(0, len);
        let err = c.allreduce_i32(&mut v, Op::Sum).expect_err("member 1 and 2 never call");
        let text = err.to_string();
        let info = err.timeout().expect("a timeout");
        assert_eq!(info.expected, 5);
        assert_eq!(info.arrived, 0);
        assert!(text.contains("ring 40") && text.contains("missing fragments 0, 1, 2, 3, 4"), "{text}");
    }
}
