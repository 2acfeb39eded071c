//! Packet fuzzing of the XDP aggregator and the TC broadcast programs through
//! BPF_PROG_TEST_RUN (docs/ROBUSTNESS.md, "Packet fuzzing").
//!
//! XDP: at least 1,000,000 mutated datagrams (bit flips, truncations,
//! extensions, and field edits around every boundary: count 0/1/max/max+1,
//! frag_off near vector_len, rank workers-1/workers/0xffff, op 4/5/8/9/255,
//! each flag bit, magic variants, UDP length vs frame length, IPv4 IHL and
//! fragment bits, IPv6 extension headers and zero checksums, VLAN tags,
//! source addresses of other ranks, other jobs and the other IP version)
//! interleaved with valid rounds of three kernel jobs (two of IPv4 ranks,
//! one of IPv6 ranks). Every input is
//! classified by an independent oracle (a Rust model of PROTOCOL.md's
//! aggregator that uses `aggbox::wire::proto` for decoding and `aggbox::wire::reducer`
//! for the arithmetic), and checked:
//!
//! - per input: the verdict, the outcome/drop reason the model predicts, the
//!   frame untouched unless it is a RESULT, RESULT frames byte for byte
//!   (header rewrite, seq, flags, payload = the reducer's result);
//! - per batch: every stats counter (packets and bytes) equals the model's, so
//!   the outcome + drop counters add up to the datagrams run; `job_state`
//!   (active slots, newest round, completions, RESULT seq) and the number of
//!   slots and slot_owner records equal the model's. A rejected datagram that
//!   changed any slot would show up here (or in a later RESULT).
//!
//! Each worker thread has its own loaded dataplane (its own maps), so the
//! model stays deterministic while several CPUs run the programs.
//!
//! TC: mutated AGB1/AGG1/AGK1 frames through the egress and ingress programs
//! inside a testbed host: the per-datagram counters add up to the runs, and
//! datagrams of groups not configured here pass untouched.
//!
//! CI mode: 1,000,000 XDP inputs (4 threads), 40,000 TC inputs.
//! Soak: `AGGBOX_SOAK=1` (or `AGGBOX_FUZZ_INPUTS=N`) runs 20,000,000 XDP inputs.
//! `AGGBOX_FUZZ_SEED` changes the seed (default fixed, printed).
//!
//! Needs root: `sudo -E cargo test --test fuzz_bpf -- --nocapture`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod bpf_common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Instant;

use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::kernel::xdp::{XdpPlane, XdpJob, TestRunner};
use aggbox::wire::proto::{self, ProtoError};
use aggbox::wire::reducer;
use bpf_common::*;

// ---------------------------------------------------------------------------
// Deterministic PRNG (no external crates in dev-dependencies).
// ---------------------------------------------------------------------------

#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

// ---------------------------------------------------------------------------
// Jobs of every fuzzed dataplane.
// ---------------------------------------------------------------------------

const PORT_A: u16 = JOB_PORT; // 7000: jobs 7, 8 and 11
const PORT_B: u16 = 7002; // job 9 (user-space only)
/// The job of IPv6 ranks.
const JOB6: u16 = 11;

fn rank_addr4(job: u16, rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, job as u8, 11 + rank as u8)
}

/// Rank `rank`'s address: IPv4, or for JOB6 the IPv6 twin.
fn rank_addr(job: u16, rank: u16) -> IpAddr {
    let fam = if job == JOB6 { Family::V6 } else { Family::V4 };
    fam.addr(rank_addr4(job, rank))
}

fn jobs() -> Vec<XdpJob> {
    vec![
        XdpJob {
            id: 7,
            port: PORT_A,
            result_port: RESULT_PORT,
            ranks: (0..4).map(|r| rank_addr(7, r)).collect(),
            weights: vec![1, 1, 2, 1],
            vector_len: 1024,
            slots: 96,
            flags: 0,
            result_group: None,
            window: 4,
            frag_elems: 0,
        },
        XdpJob {
            id: 8,
            port: PORT_A,
            result_port: 7003,
            ranks: (0..2).map(|r| rank_addr(8, r)).collect(),
            weights: vec![],
            vector_len: 0,
            slots: 48,
            flags: 0,
            result_group: None,
            window: 0,
            frag_elems: 0,
        },
        XdpJob {
            id: 9,
            port: PORT_B,
            result_port: 7004,
            ranks: (0..3).map(|r| rank_addr(9, r)).collect(),
            weights: vec![],
            vector_len: 500,
            slots: 16,
            flags: abi::JOB_F_USERSPACE_ONLY,
            result_group: None,
            window: 4,
            frag_elems: 0,
        },
        XdpJob {
            id: JOB6,
            port: PORT_A,
            result_port: 7005,
            ranks: (0..3).map(|r| rank_addr(JOB6, r)).collect(),
            weights: vec![2, 1, -1],
            vector_len: 0,
            slots: 48,
            flags: 0,
            result_group: None,
            window: 8,
            frag_elems: 0,
        },
    ]
}

/// Workers of each job of [`jobs`] (1 for a job there is not).
fn workers_of(job: u16) -> u16 {
    match job {
        7 => 4,
        8 => 2,
        9 | JOB6 => 3,
        _ => 1,
    }
}

/// Fragments (frag_off, count) of one valid round of a kernel job.
fn fragments(job: u16) -> Vec<(u32, u16)> {
    match job {
        7 => vec![(0, 362), (362, 362), (724, 300)],
        _ => vec![(0, 100), (100, 3)],
    }
}

// ---------------------------------------------------------------------------
// The oracle: PROTOCOL.md's aggregator, in the XDP program's check order.
// ---------------------------------------------------------------------------

/// What the model predicts for one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    /// Stats label the datagram is counted under.
    pub label: &'static str,
    /// Bytes counted with it (the UDP payload length from the UDP header).
    pub bytes: u64,
    /// XDP verdict.
    pub verdict: u32,
    /// For RESULTs: the expected output frame.
    pub result: Option<Vec<u8>>,
    /// The datagram passed every per-datagram check (a valid contribution).
    pub valid: bool,
}

impl Expect {
    fn pass(o: Outcome, bytes: u64) -> Expect {
        Expect {
            label: o.label(),
            bytes,
            verdict: XDP_PASS,
            result: None,
            valid: false,
        }
    }
    fn drop(r: DropReason, bytes: u64) -> Expect {
        Expect {
            label: r.label(),
            bytes,
            verdict: XDP_DROP,
            result: None,
            valid: false,
        }
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MState {
    pub active: u32,
    pub newest: u32,
    pub completed: u32,
    pub result_seq: u32,
}

#[derive(Debug)]
struct MSlot {
    op: u8,
    count: u16,
    bitmap: [u64; 4],
    done: u16,
    /// OR of the contributions' AGG_F_CARRIED flags.
    carried: u8,
    contribs: Vec<(Vec<i32>, i32)>,
    /// Every accepted contribution was a genuine one of the valid traffic.
    genuine: bool,
}

pub struct Model {
    jobs: HashMap<u16, XdpJob>,
    ports: HashSet<u16>,
    pub state: HashMap<u16, MState>,
    slots: HashMap<(u16, u32, u32), MSlot>,
    completed: HashSet<(u16, u32, u32)>,
    /// RESULTs whose contributions were all genuine valid traffic.
    pub genuine_results: u64,
    pub results: u64,
}

fn be16(b: &[u8], o: usize) -> u16 {
    u16::from_be_bytes([b[o], b[o + 1]])
}
fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes(b[o..o + 4].try_into().unwrap())
}

impl Model {
    pub fn new(jobs: &[XdpJob]) -> Model {
        Model {
            ports: jobs.iter().map(|j| j.port).collect(),
            state: jobs.iter().map(|j| (j.id, MState::default())).collect(),
            jobs: jobs.iter().map(|j| (j.id, j.clone())).collect(),
            slots: HashMap::new(),
            completed: HashSet::new(),
            genuine_results: 0,
            results: 0,
        }
    }

    /// Forget a job's runtime state (what `remove_job` + `set_job` do).
    pub fn reset_job(&mut self, id: u16) {
        self.state.insert(id, MState::default());
        self.slots.retain(|k, _| k.0 != id);
        self.completed.retain(|k| k.0 != id);
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Run one frame through the model. `genuine`: the input is a valid
    /// contribution of the valid traffic (for the genuine-results count).
    pub fn step(&mut self, f: &[u8], genuine: bool) -> Expect {
        use DropReason as D;
        use Outcome as O;
        let na = |bytes| Expect::pass(O::NotAggbox, bytes);
        if f.len() < 14 {
            return na(0);
        }
        let mut proto_ = be16(f, 12);
        let mut off = 14;
        if proto_ == 0x8100 || proto_ == 0x88a8 {
            if f.len() < 18 {
                return na(0);
            }
            proto_ = be16(f, 16);
            off = 18;
        }
        // The IP header(s): the UDP header's offset, the source, and what
        // a datagram to a job port may not carry (aggbox_parse_l3).
        let (u, src, fragment, extension, zero_csum);
        match proto_ {
            0x0800 => {
                if f.len() < off + 20 || f[off] >> 4 != 4 {
                    return na(0);
                }
                let ihl = (f[off] & 15) as usize * 4;
                if ihl < 20 || off + ihl > f.len() || f[off + 9] != 17 {
                    return na(0);
                }
                let frag = be16(f, off + 6);
                if frag & 0x1fff != 0 {
                    return na(0);
                }
                u = off + ihl;
                src = IpAddr::V4(Ipv4Addr::new(f[off + 12], f[off + 13], f[off + 14], f[off + 15]));
                fragment = frag & 0x2000 != 0;
                extension = false;
                zero_csum = false;
            }
            0x86dd => {
                if f.len() < off + 40 || f[off] >> 4 != 6 {
                    return na(0);
                }
                let mut next = f[off + 6];
                let mut h = off + 40;
                let (mut frag6, mut ext6) = (false, false);
                for _ in 0..5 {
                    match next {
                        IP6_FRAGMENT => {
                            if h + 8 > f.len() || be16(f, h + 2) & 0xfff8 != 0 {
                                return na(0);
                            }
                            frag6 = true;
                            next = f[h];
                            h += 8;
                        }
                        IP6_HOPOPTS | IP6_ROUTING | IP6_DSTOPTS => {
                            if h + 2 > f.len() {
                                return na(0);
                            }
                            ext6 = true;
                            next = f[h];
                            h += (f[h + 1] as usize + 1) * 8;
                        }
                        _ => break,
                    }
                }
                if next != 17 {
                    return na(0);
                }
                u = h;
                if u + 8 > f.len() {
                    return na(0);
                }
                let a: [u8; 16] = f[off + 8..off + 24].try_into().unwrap();
                src = IpAddr::V6(Ipv6Addr::from(a));
                fragment = frag6;
                extension = ext6;
                zero_csum = be16(f, u + 6) == 0;
            }
            _ => return na(0),
        }
        if u + 8 > f.len() || u > 120 {
            return na(0);
        }
        let ulen = i64::from(be16(f, u + 4)) - 8;
        if ulen < 0 {
            return na(0);
        }
        let bytes = ulen as u64;
        let dport = be16(f, u + 2);
        if !self.ports.contains(&dport) {
            // A RESULT-shaped AGG1 to its job's result port: forged.
            let p = u + 8;
            if !fragment
                && ulen >= 24
                && f.len() >= p + 24
                && be32(f, p) == abi::MAGIC_AGG
                && f[p + 21] & abi::AGG_F_RESULT != 0
                && self.jobs.get(&be16(f, p + 4)).is_some_and(|j| j.result_port == dport)
            {
                return Expect::drop(D::ForgedResult, bytes);
            }
            return na(bytes);
        }
        if fragment {
            return Expect::drop(D::IpFragment, bytes);
        }
        if extension {
            return Expect::drop(D::Ipv6ExtensionHeader, bytes);
        }
        if zero_csum {
            return Expect::drop(D::UdpZeroChecksum, bytes);
        }
        let p = u + 8;
        let avail = f.len() - p;
        let plen = ulen as usize;
        if plen < 4 || avail < 4 {
            return na(bytes);
        }
        match be32(f, p) {
            abi::MAGIC_AGG => {}
            abi::MAGIC_BCAST | abi::MAGIC_ACK => return Expect::pass(O::OtherAggbox, bytes),
            _ => return na(bytes),
        }
        if plen < 24 || plen > avail {
            return Expect::drop(D::TruncatedHeader, bytes);
        }
        let d = &f[p..p + plen];
        match proto::decode_agg_header(d) {
            Ok(_) | Err(ProtoError::FloatBitwise(_)) => {}
            Err(e) => {
                let reason = e
                    .drop_reason()
                    .unwrap_or_else(|| panic!("decoder error {e:?} has no drop reason"));
                return Expect::drop(reason, bytes);
            }
        }
        let (job, rank, round, frag_off) = (be16(d, 4), be16(d, 6), be32(d, 12), be32(d, 16));
        let (op, flags, count) = (d[20], d[21], be16(d, 22));
        let Some(cfg) = self.jobs.get(&job) else {
            return Expect::drop(D::UnknownJob, bytes);
        };
        if cfg.port != dport {
            return Expect::drop(D::PortMismatch, bytes);
        }
        if rank as usize >= cfg.ranks.len() {
            return Expect::drop(D::RankOutOfRange, bytes);
        }
        if cfg.ranks[rank as usize] != src {
            return Expect::drop(D::SourceMismatch, bytes);
        }
        if cfg.vector_len != 0 && u64::from(frag_off) + u64::from(count) > u64::from(cfg.vector_len) {
            return Expect::drop(D::BeyondVector, bytes);
        }
        if cfg.flags & abi::JOB_F_USERSPACE_ONLY != 0 || flags & abi::AGG_F_FLOAT32 != 0 || op > 4 {
            let mut e = Expect::pass(O::UserspaceUnavailable, bytes);
            e.valid = true;
            return e;
        }
        let mut e = self.slot_step(f, p, cfg.clone(), rank, round, frag_off, op, flags, count, genuine, bytes);
        e.valid = true;
        e
    }

    #[allow(clippy::too_many_arguments)]
    fn slot_step(
        &mut self,
        f: &[u8],
        p: usize,
        cfg: XdpJob,
        rank: u16,
        round: u32,
        frag_off: u32,
        op: u8,
        flags: u8,
        count: u16,
        genuine: bool,
        bytes: u64,
    ) -> Expect {
        use DropReason as D;
        if u32::from(count) > abi::MAX_ELEMS {
            return Expect::drop(D::TooLarge, bytes);
        }
        let job = cfg.id;
        let window = if cfg.window == 0 { abi::ROUND_WINDOW } else { cfg.window } as i32;
        let st = *self.state.get(&job).expect("job state");
        if st.completed != 0 && (st.newest.wrapping_sub(round) as i32) > window {
            return Expect::drop(D::StaleRound, bytes);
        }
        let key = (job, round, frag_off);
        if !self.slots.contains_key(&key) {
            if self.completed.contains(&key) {
                return Expect::drop(D::Retransmission, bytes);
            }
            let limit = if cfg.slots == 0 { abi::MAX_SLOTS } else { cfg.slots };
            if st.active >= limit || self.slots.len() >= abi::MAX_SLOTS as usize {
                return Expect::drop(D::SlotPoolFull, bytes);
            }
            self.state.get_mut(&job).unwrap().active += 1;
            self.slots.insert(
                key,
                MSlot {
                    op,
                    count,
                    bitmap: [0; 4],
                    done: 0,
                    carried: 0,
                    contribs: Vec::new(),
                    genuine: true,
                },
            );
        }
        let slot = self.slots.get_mut(&key).unwrap();
        if slot.op != op || slot.count != count {
            return Expect::drop(D::SlotMismatch, bytes);
        }
        let (w, b) = (rank as usize / 64, rank % 64);
        if slot.bitmap[w] & (1 << b) != 0 {
            return Expect::drop(D::Retransmission, bytes);
        }
        slot.bitmap[w] |= 1 << b;
        slot.carried |= flags & abi::AGG_F_CARRIED;
        slot.genuine &= genuine;
        let mut vals = vec![0i32; count as usize];
        proto::read_i32_be(&f[p + 24..p + 24 + 4 * count as usize], &mut vals);
        slot.contribs.push((vals, cfg.effective_weights()[rank as usize]));
        slot.done += 1;
        if (slot.done as usize) < cfg.ranks.len() {
            return Expect::drop(D::Retransmission, bytes).accepted();
        }
        // Completion: exactly once.
        let slot = self.slots.remove(&key).unwrap();
        self.completed.insert(key);
        let st = self.state.get_mut(&job).unwrap();
        st.active -= 1;
        if st.completed == 0 || (round.wrapping_sub(st.newest) as i32) > 0 {
            st.newest = round;
        }
        st.completed = 1;
        let seq = st.result_seq;
        if cfg.flags & abi::JOB_F_HAS_PARENT != 0 {
            st.result_seq += 1;
        }
        self.results += 1;
        if slot.genuine {
            self.genuine_results += 1;
        }
        let op = Op::from_u8(slot.op).expect("kernel op");
        let contribs: Vec<(&[i32], i32)> = slot.contribs.iter().map(|(v, w)| (v.as_slice(), *w)).collect();
        let res = reducer::reduce(op, &contribs).expect("reducer");
        let mut out = f.to_vec();
        let u = p - 8;
        out[u + 2..u + 4].copy_from_slice(&cfg.result_port.to_be_bytes());
        out[u + 6..u + 8].copy_from_slice(&[0, 0]);
        out[p + 6..p + 8].copy_from_slice(&abi::RESULT_RANK.to_be_bytes());
        // The RESULT keeps the completing contribution's seq, unless the
        // job's results go upstream (then the node's own counter).
        if cfg.flags & abi::JOB_F_HAS_PARENT != 0 {
            out[p + 8..p + 12].copy_from_slice(&seq.to_be_bytes());
        }
        out[p + 21] = abi::AGG_F_RESULT | slot.carried | res.flags();
        let mut payload = Vec::new();
        res.write_be(&mut payload);
        out[p + 24..p + 24 + payload.len()].copy_from_slice(&payload);
        // Over IPv6 the RESULT carries its full UDP checksum (0 is not
        // allowed there); over IPv4, 0.
        if let Some((Family::V6, ip, _)) = frame_offsets(&out) {
            let a = |o: usize| -> [u8; 16] { out[ip + o..ip + o + 16].try_into().unwrap() };
            let ulen = be16(&out, u + 4) as usize;
            let c = match udp6_checksum(a(8).into(), a(24).into(), &out[u..u + ulen]) {
                0 => 0xffff,
                c => c,
            };
            out[u + 6..u + 8].copy_from_slice(&c.to_be_bytes());
        }
        Expect {
            label: Outcome::Result.label(),
            bytes,
            verdict: XDP_PASS,
            result: Some(out),
            valid: true,
        }
    }
}

impl Expect {
    fn accepted(mut self) -> Expect {
        self.label = Outcome::Accepted.label();
        self.verdict = XDP_DROP;
        self
    }
}

// ---------------------------------------------------------------------------
// Input generation.
// ---------------------------------------------------------------------------

/// One valid contribution of the valid traffic.
#[derive(Clone)]
struct Valid {
    agg: Agg,
    src: IpAddr,
    dport: u16,
}

/// Valid rounds of jobs 7 and 8, contributions shuffled.
struct Traffic {
    pending: Vec<Valid>,
    round: HashMap<u16, u32>,
    seq: u32,
    recent: Vec<Valid>,
}

impl Traffic {
    fn new() -> Traffic {
        Traffic {
            pending: Vec::new(),
            round: [(7, 100), (8, 0xffff_fff0), (JOB6, 0x7fff_fffe)].into_iter().collect(), // job 8 wraps
            seq: 1,
            recent: Vec::new(),
        }
    }

    fn values(rng: &mut Rng, n: usize) -> Vec<i32> {
        let style = rng.below(4);
        (0..n)
            .map(|_| match style {
                0 => rng.below(2000) as i32 - 1000,
                1 => rng.pick(&[0, 1, -1, i32::MAX, i32::MIN, i32::MAX - 1, 1 << 30]),
                2 => rng.next() as i32,
                _ => rng.below(3) as i32,
            })
            .collect()
    }

    fn refill(&mut self, rng: &mut Rng) {
        for job in [7u16, 8, JOB6] {
            let round = self.round[&job];
            self.round.insert(job, round.wrapping_add(1));
            let op = rng.below(5) as u8;
            let workers = workers_of(job);
            let frags = fragments(job);
            for (i, &(frag_off, count)) in frags.iter().enumerate() {
                for rank in 0..workers {
                    self.seq = self.seq.wrapping_add(1);
                    let mut agg = Agg::new(job, rank, op, Traffic::values(rng, count as usize));
                    agg.seq = self.seq;
                    agg.round = round;
                    agg.frag_off = frag_off;
                    if i + 1 == frags.len() {
                        agg.flags = abi::AGG_F_LAST_FRAGMENT;
                    }
                    // A clamped input now and then (a subtree's clamped
                    // result): the RESULT must carry OVERFLOW.
                    if rng.chance(1, 16) {
                        agg.flags |= abi::AGG_F_OVERFLOW;
                    }
                    self.pending.push(Valid {
                        agg,
                        src: rank_addr(job, rank),
                        dport: PORT_A,
                    });
                }
            }
        }
        // shuffle
        for i in (1..self.pending.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            self.pending.swap(i, j);
        }
    }

    fn next_valid(&mut self, rng: &mut Rng) -> Valid {
        if self.pending.is_empty() {
            self.refill(rng);
        }
        let v = self.pending.pop().unwrap();
        if self.recent.len() >= 64 {
            let i = rng.below(64) as usize;
            self.recent[i] = v.clone();
        } else {
            self.recent.push(v.clone());
        }
        v
    }
}

fn to_frame(v: &Valid) -> Frame {
    let mut f = Frame::udp(v.src, v.agg.bytes());
    f.dport = v.dport;
    f
}

/// A random seed datagram to mutate: a plausible contribution of any job
/// (known or not), or a recent valid one (retransmission-like).
fn seed(rng: &mut Rng, tr: &Traffic) -> Valid {
    if !tr.recent.is_empty() && rng.chance(1, 2) {
        return tr.recent[rng.below(tr.recent.len() as u64) as usize].clone();
    }
    let job = rng.pick(&[7u16, 7, 8, 8, 9, 10, JOB6, JOB6, 0, 0xffff]);
    let workers = match job {
        7 | 8 | 9 | JOB6 => u64::from(workers_of(job)),
        _ => 2,
    };
    let rank = rng.below(workers) as u16;
    let count = rng.pick(&[1usize, 2, 3, 31, 32, 33, 64, 100, 300, 362, 383, 384, 385, 400]);
    let op = rng.below(9) as u8;
    let mut agg = Agg::new(job, rank, op, Traffic::values(rng, count));
    agg.round = match job {
        7 => tr.round[&7].wrapping_sub(rng.below(10) as u32),
        8 => tr.round[&8].wrapping_sub(rng.below(70) as u32),
        JOB6 => tr.round[&JOB6].wrapping_sub(rng.below(12) as u32),
        _ => rng.next() as u32,
    };
    agg.frag_off = if rng.chance(1, 2) {
        fragments(7)[rng.below(3) as usize].0
    } else {
        rng.below(1200) as u32
    };
    agg.flags = if rng.chance(1, 4) { abi::AGG_F_LAST_FRAGMENT } else { 0 };
    agg.seq = rng.next() as u32;
    let dport = if job == 9 { PORT_B } else { PORT_A };
    Valid {
        agg,
        src: rank_addr(job, rank),
        dport,
    }
}

const FRAME_MAX: usize = 2000;

/// Mutate one seed into a frame.
fn mutate(rng: &mut Rng, v: &Valid) -> Vec<u8> {
    let mut v = v.clone();
    let mut frame_edits: Vec<u8> = Vec::new();
    let n = 1 + rng.below(3);
    for _ in 0..n {
        match rng.below(22) {
            // ---- AGG1 header field edits around the boundaries
            0 => {
                let c = v.agg.values.len() as u16;
                v.agg.count = rng.pick(&[0, 1, c.wrapping_sub(1), c, c.wrapping_add(1), 384, 385, 0xffff, 0x8000]);
            }
            1 => {
                let vl = rng.pick(&[1024u32, 500, 0]);
                let c = v.agg.count as u32;
                v.agg.frag_off = rng.pick(&[
                    vl.wrapping_sub(c),
                    vl.wrapping_sub(c).wrapping_add(1),
                    vl.wrapping_sub(c).wrapping_sub(1),
                    vl,
                    0,
                    u32::MAX,
                    (u32::MAX - c).wrapping_add(1),
                    362,
                    724,
                ]);
            }
            2 => {
                let w = workers_of(v.agg.job);
                v.agg.rank = rng.pick(&[w - 1, w, w + 1, 0xffff, 0, 255, 256]);
            }
            3 => {
                let r = rng.next() as u8;
                v.agg.op = rng.pick(&[0, 1, 2, 3, 4, 5, 8, 9, 255, r]);
            }
            4 => v.agg.flags ^= 1 << rng.below(8),
            5 => v.agg.flags = rng.next() as u8,
            6 => {
                let r = v.agg.round;
                v.agg.round = rng.pick(&[
                    r.wrapping_sub(4),
                    r.wrapping_sub(5),
                    r.wrapping_sub(64),
                    r.wrapping_sub(65),
                    r.wrapping_add(1),
                    r.wrapping_add(0x8000_0000),
                    0,
                    u32::MAX,
                ]);
            }
            7 => v.agg.job = rng.pick(&[7, 8, 9, 10, JOB6, 0, 0xffff, 0x0700]),
            8 => {
                // payload length differs from count
                match rng.below(3) {
                    0 => {
                        v.agg.values.pop();
                    }
                    1 => v.agg.values.push(rng.next() as i32),
                    _ => v.agg.values.truncate(rng.below(4) as usize),
                }
            }
            9 => frame_edits.push(rng.pick(&[0u8, 1, 2, 3])), // magic variants
            // ---- addresses
            10 => {
                let job = rng.pick(&[7u16, 8, 9, JOB6, 42]);
                let rank = rng.below(4) as u16;
                v.src = match rng.below(8) {
                    0 => IpAddr::V4(Ipv4Addr::from(rng.next() as u32)),
                    1 => IpAddr::V6(Ipv6Addr::from(u128::from(rng.next()) << 64 | u128::from(rng.next()))),
                    // the other IP version with the same address bits
                    2 => IpAddr::V6(same_bits(rank_addr4(job, rank))),
                    3 => IpAddr::V6(rank_addr4(job, rank).to_ipv6_mapped()),
                    4 => Family::V6.addr(rank_addr4(job, rank)),
                    5 => IpAddr::V4(rank_addr4(job, rank)),
                    _ => rank_addr(job, rank),
                };
            }
            11 => {
                let r = rng.next() as u16;
                v.dport = rng.pick(&[PORT_A, PORT_B, RESULT_PORT, 7003, 53, r]);
            }
            // ---- frame-level structure (applied in build)
            12..=15 => frame_edits.push(10 + rng.below(10) as u8),
            // ---- byte-level
            _ => frame_edits.push(20 + rng.below(4) as u8),
        }
    }
    let mut f = to_frame(&v);
    let mut bytes_ops = Vec::new();
    for e in frame_edits {
        match e {
            0..=3 => {
                // magic variants: other kinds, byte-swapped, near misses
                let mut p = v.agg.bytes();
                let m = match e {
                    0 => abi::MAGIC_BCAST,
                    1 => abi::MAGIC_ACK,
                    2 => abi::MAGIC_AGG.swap_bytes(),
                    _ => abi::MAGIC_AGG ^ (1 << rng.below(32)),
                };
                p[..4].copy_from_slice(&m.to_be_bytes());
                f.payload = p;
            }
            10 => {
                let l = 8 + f.payload.len() as i64;
                f.udp_len = Some(rng.pick(&[l - 1, l + 1, l - 4, l + 4, 0, 7, 8, 11, 12, 31, 32, 0xffff, l - 24]).clamp(0, 0xffff) as u16);
            }
            11 => f.trailer = rng.pick(&[1usize, 3, 4, 8, 60]),
            12 => {
                let words = rng.below(11) as usize;
                f.ip_options = (0..words * 4).map(|_| 1u8).collect(); // NOPs
            }
            13 => f.frag = rng.pick(&[0x2000u16, 0x0001, 0x2001, 0x1fff, 0x0000, 0x8000, 0x4000 | 0x2000]),
            // IPv6 only (an IPv4 frame ignores them): extension headers,
            // the UDP checksum
            18 => {
                let n = rng.pick(&[1usize, 1, 2, 3, 5, 6]);
                f.ip6_ext = (0..n)
                    .map(|_| match rng.below(4) {
                        0 => ip6_ext(IP6_FRAGMENT, 8, rng.pick(&[0u16, 1, 8, 9, 0xfff8, 0xfff9])),
                        1 => ip6_ext(IP6_HOPOPTS, rng.pick(&[8usize, 16, 64, 80]), 0),
                        2 => ip6_ext(IP6_ROUTING, 8 * (1 + rng.below(3) as usize), 0),
                        _ => ip6_ext(IP6_DSTOPTS, 8 * (1 + rng.below(3) as usize), 0),
                    })
                    .collect();
            }
            19 => {
                let r = rng.next() as u16;
                f.udp_csum = Some(rng.pick(&[0u16, 0, 0xffff, r]));
            }
            14 => f.vlan = Some(rng.next() as u16),
            15 => f.ethertype = rng.pick(&[0x86dd, 0x0800, 0x0806, 0x8100, 0x88a8, 0x0801]),
            16 => f.protocol = rng.pick(&[6u8, 1, 0, 136, 255]),
            17 => bytes_ops.push(99), // IHL edit after build
            _ => bytes_ops.push(e),
        }
    }
    let mut b = f.build();
    for op in bytes_ops {
        let len = b.len();
        if len == 0 {
            break;
        }
        match op {
            99 => {
                let o = if f.vlan.is_some() { 18 } else { 14 };
                if len > o {
                    b[o] = (b[o] & 0xf0) | rng.below(16) as u8;
                    if rng.chance(1, 4) {
                        b[o] = rng.next() as u8;
                    }
                }
            }
            20 => {
                // bit flips anywhere
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(len as u64) as usize;
                    b[i] ^= 1 << rng.below(8);
                }
            }
            21 => {
                // truncation, biased to header boundaries
                let cut = if rng.chance(1, 2) {
                    let bound = rng.pick(&[14usize, 18, 34, 38, 42, 46, 54, 58, 62, 66, 70, 86]);
                    (bound as i64 + rng.below(5) as i64 - 2).max(0) as usize
                } else {
                    rng.below(len as u64 + 1) as usize
                };
                b.truncate(cut.min(len));
            }
            22 => {
                let extra = 1 + rng.below(64) as usize;
                b.extend((0..extra).map(|_| rng.next() as u8));
            }
            _ => {
                // random bytes in the headers (first 70 bytes)
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(len.min(70) as u64) as usize;
                    if i < len {
                        b[i] = rng.next() as u8;
                    }
                }
            }
        }
    }
    b.truncate(FRAME_MAX);
    b
}

// ---------------------------------------------------------------------------
// One fuzzing worker: its own dataplane, model and traffic.
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Report {
    inputs: u64,
    run_errors: u64,
    by_label: BTreeMap<&'static str, u64>,
    valid_mutants: u64,
    results: u64,
    genuine_results: u64,
    resets: u64,
    batches: u64,
}

fn configure(dp: &XdpPlane, jobs: &[XdpJob]) {
    for j in jobs {
        dp.set_job(j.id, j).expect("set_job");
    }
}

fn check_batch(dp: &XdpPlane, model: &Model, base: &aggbox::kernel::xdp::Stats, counted: &BTreeMap<&'static str, (u64, u64)>, runs: u64, ctx: &str) {
    let now = dp.stats().expect("stats");
    let d = deltas(base, &now);
    let mut got: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    for (label, p, b) in d {
        got.insert(label, (p, b));
    }
    assert_eq!(&got, counted, "{ctx}: stats counters differ from the model");
    let total: u64 = got.values().map(|c| c.0).sum();
    assert_eq!(total, runs, "{ctx}: outcome + drop counters must add up to the datagrams run");
    for (&id, st) in &model.state {
        let js = dp.job_state(id).expect("job_state").unwrap_or_default();
        assert_eq!(
            (js.active_slots, js.completed, js.result_seq),
            (st.active, st.completed, st.result_seq),
            "{ctx}: job {id} state (active_slots, completed, result_seq)"
        );
        if st.completed != 0 {
            assert_eq!(js.newest_round, st.newest, "{ctx}: job {id} newest_round");
        }
    }
    assert_eq!(dp.slots_in_use(), model.slots(), "{ctx}: slots in the pool");
    assert_eq!(dp.slot_owners_in_use(), model.slots(), "{ctx}: slot_owner records");
}

fn worker(id: usize, seed_val: u64, inputs: u64) -> Report {
    if let Ok(cpus) = std::thread::available_parallelism() {
        let mut set = nix::sched::CpuSet::new();
        #[allow(clippy::let_underscore_must_use)]
        let _ = set.set(id % cpus.get());
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
    let jobs = jobs();
    let dp = load();
    configure(&dp, &jobs);
    let runner: TestRunner = dp.test_runner().expect("runner");
    let mut model = Model::new(&jobs);
    let mut rng = Rng::new(seed_val.wrapping_add(id as u64 * 0x1234_5678_9abc));
    let mut tr = Traffic::new();
    let mut rep = Report::default();
    const BATCH: u64 = 2000;
    const RESET_EVERY: u64 = 5; // batches
    let mut base = dp.stats().expect("stats");
    let mut counted: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut runs = 0u64;
    for i in 0..inputs {
        // one valid contribution in every 4 inputs
        let (frame, genuine) = if rng.chance(1, 4) {
            (to_frame(&tr.next_valid(&mut rng)).build(), true)
        } else {
            let s = seed(&mut rng, &tr);
            (mutate(&mut rng, &s), false)
        };
        rep.inputs += 1;
        match runner.run(&frame) {
            Ok((verdict, out)) => {
                let e = model.step(&frame, genuine);
                let ctx = format!("worker {id} input {i} ({} bytes: {})", frame.len(), hex(&frame));
                assert_eq!((e.label, verdict), (e.label, e.verdict), "{ctx}: verdict for {}", e.label);
                match &e.result {
                    Some(want) => assert_eq!(&out, want, "{ctx}: RESULT frame"),
                    None => assert_eq!(out, frame, "{ctx}: frame must be untouched ({})", e.label),
                }
                let c = counted.entry(e.label).or_default();
                c.0 += 1;
                c.1 += e.bytes;
                runs += 1;
                *rep.by_label.entry(e.label).or_default() += 1;
                if e.valid && !genuine {
                    rep.valid_mutants += 1;
                }
            }
            Err(err) => {
                assert!(frame.len() < 14, "worker {id} input {i}: test_run failed on a {}-byte frame: {err}", frame.len());
                rep.run_errors += 1;
            }
        }
        if (i + 1) % BATCH == 0 || i + 1 == inputs {
            rep.batches += 1;
            check_batch(&dp, &model, &base, &counted, runs, &format!("worker {id} batch ending at input {i}"));
            if rep.batches % RESET_EVERY == 0 {
                // Control-plane reset of the kernel jobs: slots of garbage
                // rounds never complete; start over (remove_job + set_job).
                for j in &jobs {
                    dp.remove_job(j.id).expect("remove_job");
                    dp.set_job(j.id, j).expect("set_job");
                    model.reset_job(j.id);
                }
                tr.pending.clear();
                tr.recent.clear();
                rep.resets += 1;
                check_batch(&dp, &model, &base, &counted, runs, &format!("worker {id} after reset"));
            }
            base = dp.stats().expect("stats");
            counted.clear();
            runs = 0;
        }
    }
    rep.results = model.results;
    rep.genuine_results = model.genuine_results;
    rep
}

/// An IPv6 address whose first four bytes are `a`'s, zeros after: what an
/// IPv4 rank's entry holds.
fn same_bits(a: Ipv4Addr) -> Ipv6Addr {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&a.octets());
    Ipv6Addr::from(b)
}

fn hex(b: &[u8]) -> String {
    b.iter().take(96).map(|x| format!("{x:02x}")).collect()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn xdp_fuzz_million_mutated_datagrams() {
    require_root();
    let soak = std::env::var("AGGBOX_SOAK").is_ok_and(|v| v == "1");
    let total = env_u64("AGGBOX_FUZZ_INPUTS").unwrap_or(if soak { 20_000_000 } else { 1_000_000 });
    let seed_val = env_u64("AGGBOX_FUZZ_SEED").unwrap_or(0xA66B_0C5E);
    let threads = 4u64;
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let n = total / threads + u64::from(t < total % threads);
            std::thread::spawn(move || worker(t as usize, seed_val, n))
        })
        .collect();
    let reports: Vec<Report> = handles.into_iter().map(|h| h.join().expect("fuzz worker panicked")).collect();
    let elapsed = start.elapsed();
    let mut by_label: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut inputs, mut errors, mut results, mut genuine, mut valid_mutants, mut resets) = (0, 0, 0, 0, 0, 0);
    for r in &reports {
        inputs += r.inputs;
        errors += r.run_errors;
        results += r.results;
        genuine += r.genuine_results;
        valid_mutants += r.valid_mutants;
        resets += r.resets;
        for (l, n) in &r.by_label {
            *by_label.entry(l).or_default() += n;
        }
    }
    eprintln!(
        "xdp fuzz: seed {seed_val:#x}, {inputs} inputs in {:.1} s ({:.0}/s), {errors} shorter than Ethernet (rejected by test_run), \
         {results} RESULTs ({genuine} from genuine traffic only), {valid_mutants} mutants were valid contributions, {resets} job resets",
        elapsed.as_secs_f64(),
        inputs as f64 / elapsed.as_secs_f64()
    );
    for (l, n) in &by_label {
        eprintln!("  {l:<28} {n:>10}");
    }
    assert!(inputs >= total);
    assert!(genuine > 100, "valid traffic interleaved with garbage must still complete");
    // every interesting class must have been reached
    for r in DropReason::ALL {
        if matches!(r, DropReason::MissedTailCall) {
            assert_eq!(by_label.get(r.label()).copied().unwrap_or(0), 0, "no missed tail calls");
            continue;
        }
        if matches!(r, DropReason::SlotBusy) {
            // One datagram at a time: a fast slot's lock is never found
            // held unless some path forgot to give it back (tests/bpf_fast.rs
            // holds one on purpose).
            assert_eq!(by_label.get(r.label()).copied().unwrap_or(0), 0, "no fast slot left locked");
            continue;
        }
        if matches!(r, DropReason::TooLarge) {
            // AGGBOX_MAX_ELEMS (16384) is above what any IPv4 or IPv6
            // datagram can carry (16370, 16375 elements), so no frame can
            // reach it (docs/JUMBO.md).
            assert_eq!(by_label.get(r.label()).copied().unwrap_or(0), 0, "too_large is unreachable by a real frame");
            continue;
        }
        assert!(by_label.get(r.label()).copied().unwrap_or(0) > 0, "fuzzer never reached drop reason {}", r.label());
    }
    for o in [Outcome::NotAggbox, Outcome::Accepted, Outcome::Result, Outcome::OtherAggbox, Outcome::UserspaceUnavailable] {
        assert!(by_label.get(o.label()).copied().unwrap_or(0) > 0, "fuzzer never reached outcome {}", o.label());
    }
}

// ---------------------------------------------------------------------------
// TC programs.
// ---------------------------------------------------------------------------

#[test]
fn tc_fuzz_mutated_datagrams() {
    use aggbox::kernel::tc::{self, TcPlane, TcProgram, TC_ACT_OK};
    use crate::testbed::{in_netns, Testbed, TestbedConfig};
    use std::net::SocketAddrV4;

    require_root();
    let soak = std::env::var("AGGBOX_SOAK").is_ok_and(|v| v == "1");
    let total = env_u64("AGGBOX_FUZZ_TC_INPUTS").unwrap_or(if soak { 1_000_000 } else { 40_000 });
    let tb = Testbed::up(TestbedConfig {
        hosts: 2,
        static_neigh: true,
        ..Default::default()
    })
    .expect("testbed");
    let plane = TcPlane::load().unwrap_or_else(|e| panic!("loading the TC programs failed: {e:#?}"));
    let (h0, h1) = (tb.host(0), tb.host(1));
    const GROUP: u16 = 9;
    plane
        .set_group(GROUP, &[SocketAddrV4::new(h1.addr, 7200), SocketAddrV4::new(h1.addr, 7201)])
        .expect("set_group");
    plane
        .set_forwarding(GROUP, 7200, &[SocketAddrV4::new(h1.addr, 7300)])
        .expect("set_forwarding");
    let start = Instant::now();
    let mut rng = Rng::new(env_u64("AGGBOX_FUZZ_SEED").unwrap_or(0xA66B_0C5E) ^ 0x7c);
    let stats = in_netns(&h0.netns, || {
        let eth0 = tc::ifindex("eth0").expect("eth0");
        let before = plane.stats().expect("stats");
        let mut runs = 0u64;
        let mut unknown_group_checked = 0u64;
        let mut errors = 0u64;
        for i in 0..total {
            let group = rng.pick(&[GROUP, GROUP, GROUP, 10, 0, 0xffff]);
            let mut d = Vec::new();
            d.extend_from_slice(&abi::MAGIC_BCAST.to_be_bytes());
            let r = rng.next() as u32;
            d.extend_from_slice(&(rng.pick(&[0u32, 1, 2, 3, u32::MAX, 1 << 31, r])).to_be_bytes());
            d.extend_from_slice(&(i as u32).to_be_bytes());
            d.extend_from_slice(&group.to_be_bytes());
            d.push(rng.pick(&[0u8, 1, 2, 0x80, 0xff]));
            d.push(rng.pick(&[0u8, 1, 7, 8, 254, 255]));
            d.extend((0..rng.pick(&[0usize, 1, 7, 100, 1400])).map(|_| rng.next() as u8));
            let v = Valid {
                agg: Agg::new(0, 0, 0, vec![]),
                src: h0.addr.into(),
                dport: rng.pick(&[7200u16, 7999, 7000]),
            };
            let mut f = to_frame(&v);
            f.dst = rng.pick(&[h1.addr, h0.addr, Ipv4Addr::new(10, 77, 0, 200)]).into();
            f.payload = d;
            // reuse the XDP mutator's byte-level and structural edits on the frame
            let mut b = f.build();
            b[0..6].copy_from_slice(&h1.mac);
            b[6..12].copy_from_slice(&h0.mac);
            let mutated = rng.chance(2, 3);
            if mutated {
                let edits = 1 + rng.below(3);
                for _ in 0..edits {
                    let len = b.len();
                    match rng.below(6) {
                        0 => {
                            let i = rng.below(len as u64) as usize;
                            b[i] ^= 1 << rng.below(8);
                        }
                        1 => {
                            let cut = rng.below(len as u64 + 1) as usize;
                            b.truncate(cut.max(14));
                        }
                        2 => b.extend((0..1 + rng.below(32)).map(|_| rng.next() as u8)),
                        3 if len > 42 => {
                            // UDP length
                            let l = rng.pick(&[0u16, 7, 8, 23, 24, 0xffff, (len - 34) as u16 + 1]);
                            b[38..40].copy_from_slice(&l.to_be_bytes());
                        }
                        4 if len > 34 => b[14] = 0x40 | rng.below(16) as u8, // IHL
                        _ if len > 34 => {
                            let fr = rng.pick(&[0x2000u16, 0x0001, 0x3fff]);
                            b[20..22].copy_from_slice(&fr.to_be_bytes());
                        }
                        _ => {}
                    }
                }
            }
            let b_group_unknown = !mutated
                && b.len() >= 42 + 16
                && b[12..14] == [0x08, 0x00]
                && b[14] == 0x45
                && be32(&b, 42) == abi::MAGIC_BCAST
                && ![GROUP].contains(&be16(&b, 54));
            let prog = if rng.chance(1, 2) { TcProgram::Egress } else { TcProgram::Ingress };
            match plane.test_run(prog, &b, eth0, 0) {
                Ok(run) => {
                    runs += 1;
                    if b_group_unknown {
                        assert_eq!(run.verdict, TC_ACT_OK, "input {i}: a group not configured here passes");
                        assert_eq!(run.data, b, "input {i}: a group not configured here passes untouched");
                        unknown_group_checked += 1;
                    }
                }
                Err(_) => errors += 1,
            }
        }
        let after = plane.stats().expect("stats");
        (runs, errors, unknown_group_checked, after.datagrams() - before.datagrams(), after)
    })
    .expect("netns");
    let (runs, errors, unknown, counted, after) = stats;
    eprintln!(
        "tc fuzz: {runs} runs ({errors} test_run errors) in {:.1} s; {unknown} unknown-group datagrams passed untouched",
        start.elapsed().as_secs_f64()
    );
    for s in abi::BcastStat::ALL {
        let n = after.packets(s);
        if n > 0 {
            eprintln!("  {:<20} {n:>10}", s.label());
        }
    }
    assert_eq!(counted, runs, "per-datagram TC counters add up to the datagrams run");
    assert!(unknown > 0);
    drop(plane);
    tb.down().expect("testbed down");
}
