//! The ring service's protocol with no kernel and no network: every member
//! a [`RingService`] over heap memory, a simulated network between them
//! that drops, duplicates and reorders, and a fake clock; plus one run of
//! the real I/O loop over loopback addresses.

use super::*;
use crate::wire::reducer;

use crate::wire::rng::Rng;

/// True with probability `p`.
fn chance(rng: &mut Rng, p: f64) -> bool {
    rng.chance_ppm((p * 1e6) as u64)
}

const RING: u16 = 40;
const PORT: u16 = 7400;
/// Where the ring sits in each member's memory (not 0, to catch base bugs).
const BASE: u32 = 3;
const DENSE: u32 = 2;

fn member_addr(m: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1 + m as u8))
}

/// Member `m`'s address in a ring of IPv6 members.
fn member_addr6(m: usize) -> IpAddr {
    IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1 + m as u16))
}

struct Sim {
    services: Vec<RingService>,
    memories: Vec<Arc<RingMemory>>,
    layout: RingLayout,
    now: Instant,
    /// The members' addresses.
    addrs: Vec<IpAddr>,
    /// In flight: (receiving member, from, bytes).
    net: Vec<(usize, SocketAddr, Vec<u8>)>,
    rng: Rng,
    loss: f64,
    dup: f64,
    dropped: u64,
    duplicated: u64,
    /// Fragments the calls' rounds cover (`ring_ctrl.round_frags`, 0: all).
    round_frags: u32,
    /// Member 0's job (where a round's buffer is: the same on every member).
    job: RingJob,
    /// The round of the last call.
    last_round: Round,
}

impl Sim {
    fn new(members: usize, frag_elems: u32, vector_len: u32, weights: Vec<i32>, window: usize) -> Sim {
        Sim::with_addrs((0..members).map(member_addr).collect(), frag_elems, vector_len, weights, window)
    }

    /// A ring of the members at `addrs`.
    fn with_addrs(addrs: Vec<IpAddr>, frag_elems: u32, vector_len: u32, weights: Vec<i32>, window: usize) -> Sim {
        let members = addrs.len();
        let layout = RingLayout { members: members as u16, me: 0, frag_elems, vector_len };
        let frags = layout.frags();
        let weight_sum: i32 = weights.iter().sum();
        let v4 = |a: IpAddr| match a {
            IpAddr::V4(a) => u32::from(a).to_be(),
            IpAddr::V6(_) => 0,
        };
        let mut services = Vec::new();
        let mut memories = Vec::new();
        let mut first_job = None;
        for m in 0..members {
            let memory = Arc::new(RingMemory::heap(frag_elems, BASE + 2 * frags + 2));
            let job = RingJob {
                id: RING,
                port: PORT,
                members: members as u16,
                me: m as u16,
                frag_elems,
                frags,
                vector_len,
                base: BASE,
                weight_sum: weight_sum as u32,
                weight: weights[m],
                self_addr: v4(addrs[m]),
                next_addr: v4(addrs[(m + 1) % members]),
            };
            services.push(RingService::new(DENSE, job, addrs.clone(), memory.clone()).expect("service").with_window(window));
            memories.push(memory);
            first_job.get_or_insert(job);
        }
        Sim {
            services,
            memories,
            layout,
            now: Instant::now(),
            addrs,
            net: Vec::new(),
            rng: Rng(0x1234_5678_9abc_def1),
            loss: 0.0,
            dup: 0.0,
            dropped: 0,
            duplicated: 0,
            round_frags: 0,
            job: first_job.expect("a ring has members"),
            last_round: Round(0),
        }
    }

    fn send(&mut self, from: usize, out: Vec<Transmit>) {
        for t in out {
            let to = (0..self.services.len()).find(|&m| self.addrs[m] == t.to.ip()).expect("to a member");
            if chance(&mut self.rng, self.loss) {
                self.dropped += 1;
                continue;
            }
            if chance(&mut self.rng, self.dup) {
                self.duplicated += 1;
                self.net.push((to, SocketAddr::new(self.addrs[from], PORT), t.bytes.clone()));
            }
            self.net.push((to, SocketAddr::new(self.addrs[from], PORT), t.bytes));
        }
    }

    /// What one member's runtime does for a call: input in place, the
    /// round made ready, a KICK.
    fn call(&mut self, m: usize, round: Round, op: Op, input: &[i32]) {
        let base = self.job.round_base(round);
        self.memories[m].begin_round(DENSE, round, op, self.round_frags, |mem| mem.write_vector(base, input));
        self.last_round = round;
        let kick = RingHeader { ring: RING, kind: RingKind::Kick, flags: 0, round, frag: 0, hops: 0, count: 0, sender: 0, op };
        let mut out = Vec::new();
        self.services[m].handle(self.now, SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 40000), kick.encode().to_vec(), &mut out);
        self.send(m, out);
    }

    fn done(&self, m: usize, round: Round) -> bool {
        let ctrl = self.memories[m].ctrl(DENSE);
        let covered = if self.round_frags == 0 { self.layout.frags() } else { self.round_frags };
        ctrl.finals_round.load(Ordering::Acquire) == round.0 && ctrl.finals.load(Ordering::Acquire) == covered
    }

    /// Deliver in a shuffled order, poll on a fake clock, until every
    /// member has round `round` (or `steps` run out).
    fn run(&mut self, round: Round, steps: usize) -> bool {
        self.run_until(steps, |sim| (0..sim.services.len()).all(|m| sim.done(m, round)), |_, _| false)
    }

    /// As `run`, until `done`, losing the datagrams `lose` picks (by
    /// receiving member and bytes).
    fn run_until(&mut self, steps: usize, done: impl Fn(&Sim) -> bool, lose: impl Fn(usize, &[u8]) -> bool) -> bool {
        for _ in 0..steps {
            if done(self) {
                return true;
            }
            if self.net.is_empty() {
                self.now += Duration::from_millis(1);
            } else {
                // Take a random one of the first few: reordering.
                let i = (self.rng.next() as usize) % self.net.len().min(8);
                let (to, from, bytes) = self.net.remove(i);
                if lose(to, &bytes) {
                    self.dropped += 1;
                    continue;
                }
                let mut out = Vec::new();
                self.services[to].handle(self.now, from, bytes, &mut out);
                self.send(to, out);
            }
            for m in 0..self.services.len() {
                let mut out = Vec::new();
                self.services[m].poll(self.now, &mut out);
                self.send(m, out);
            }
        }
        false
    }

    fn result(&self, m: usize) -> Vec<i32> {
        let mut v = vec![0; self.layout.vector_len as usize];
        self.memories[m].read_vector(self.job.round_base(self.last_round), &mut v);
        v
    }

    fn totals(&self) -> RingServiceStats {
        let mut t = RingServiceStats::default();
        for s in &self.services {
            let x = s.stats();
            t.nacks_sent += x.nacks_sent;
            t.resends += x.resends;
            t.early_held += x.early_held;
            t.duplicates += x.duplicates;
            t.refused += x.refused;
            t.saturated += x.saturated;
        }
        t
    }
}

fn input(m: usize, len: usize, round: u32) -> Vec<i32> {
    (0..len).map(|i| ((i * 31 + m * 1_000_003 + round as usize * 7) % 20_001) as i32 - 10_000).collect()
}

fn star(op: Op, inputs: &[Vec<i32>], weights: &[i32]) -> Vec<i32> {
    let c: Vec<(&[i32], i32)> = inputs.iter().map(Vec::as_slice).zip(weights.iter().copied()).collect();
    reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec()
}

/// Rounds of every op over `members`, each member calling at once (the
/// order of their calls shuffled, so some PARTIALs arrive early).
fn rounds(members: usize, frag_elems: u32, len: u32, weights: Vec<i32>, loss: f64, dup: f64, window: usize) -> Sim {
    let mut sim = Sim::new(members, frag_elems, len, weights.clone(), window);
    sim.loss = loss;
    sim.dup = dup;
    for (k, op) in [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg].into_iter().enumerate() {
        let round = Round(1 + k as u32);
        let inputs: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, round.0)).collect();
        let want = star(op, &inputs, &weights);
        let mut order: Vec<usize> = (0..members).collect();
        order.rotate_left(k % members);
        for (i, &m) in order.iter().enumerate() {
            sim.call(m, round, op, &inputs[m]);
            if i == 0 {
                // Let the first member's PARTIALs run ahead of the others.
                for _ in 0..20 {
                    sim.run(round, 1);
                }
            }
        }
        assert!(sim.run(round, 2_000_000), "{op:?} round {round}: not every member completed (loss {loss}, dup {dup})");
        for m in 0..members {
            assert_eq!(sim.result(m), want, "member {m}, {op:?}, round {round}");
            for f in 0..sim.layout.frags() {
                assert!(sim.memories[m].has_result(sim.job.index(round, f), round), "member {m} fragment {f}");
            }
        }
    }
    sim
}

#[test]
fn every_op_round_trips_without_loss() {
    for members in [2, 3, 4, 7] {
        let sim = rounds(members, 4, 37, vec![1; members], 0.0, 0.0, DEFAULT_WINDOW);
        let t = sim.totals();
        // NACKs may go out while the first member waits for the others
        // (its finals do not move): they are not repair, nothing is refused.
        assert_eq!(t.refused, 0, "{members}: {t:?}");
        assert!(t.early_held > 0 || members == 2, "{members}: some PARTIALs came early ({t:?})");
    }
}

#[test]
fn weights_apply_and_avg_divides_by_their_sum() {
    rounds(4, 6, 50, vec![1, 2, 3, 5], 0.0, 0.0, DEFAULT_WINDOW);
}

#[test]
fn one_element_and_short_last_fragment() {
    rounds(3, 8, 1, vec![1; 3], 0.0, 0.0, DEFAULT_WINDOW);
    rounds(5, 8, 8, vec![1; 5], 0.0, 0.0, DEFAULT_WINDOW);
    rounds(4, 8, 8 * 9 + 3, vec![1; 4], 0.0, 0.0, DEFAULT_WINDOW);
}

#[test]
fn loss_and_duplication_are_repaired() {
    for (loss, dup) in [(0.01, 0.01), (0.05, 0.05), (0.2, 0.1)] {
        let sim = rounds(5, 4, 203, vec![1, 1, 2, 1, 3], loss, dup, 8);
        let t = sim.totals();
        assert!(sim.dropped > 0 && sim.duplicated > 0, "the network dropped {} and duplicated {}", sim.dropped, sim.duplicated);
        assert!(t.nacks_sent > 0 && t.resends > 0, "loss {loss}: {t:?}");
        assert!(t.duplicates > 0, "dup {dup}: {t:?}");
    }
}

/// A FINAL lost on its way to one member, whose NACK reaches the
/// completing member only after that member's application started the
/// next call: the answer still carries the first call's result (the next
/// call's input goes to the other buffer), not the next call's input.
#[test]
fn a_final_resent_after_its_completer_moved_on_carries_the_result() {
    let members = 3;
    let (frag_elems, len) = (4u32, 12u32);
    let mut sim = Sim::new(members, frag_elems, len, vec![1; members], DEFAULT_WINDOW);
    // Fragment 0: origin 0, completed by member 2, whose FINAL goes to 0
    // and from 0 to member 1 (the last hop).
    assert_eq!((sim.layout.origin(0), sim.layout.completer(0)), (0, 2));
    let (r1, r2) = (Round(1), Round(2));
    let first: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, r1.0)).collect();
    for (m, v) in first.iter().enumerate() {
        sim.call(m, r1, Op::Sum, v);
    }
    let final_of_0_to_1 = |to: usize, bytes: &[u8]| {
        to == 1 && RingHeader::decode(bytes).is_ok_and(|(h, _)| h.kind == RingKind::Final && h.frag == 0)
    };
    assert!(
        sim.run_until(2_000_000, |sim| sim.done(0, r1) && sim.done(2, r1) && sim.dropped > 0, final_of_0_to_1),
        "members 0 and 2 complete round 1"
    );
    // (and any resend of it still on its way is lost too)
    sim.net.retain(|(to, _, bytes)| !final_of_0_to_1(*to, bytes));
    assert!(!sim.done(1, r1), "member 1 lacks fragment 0's FINAL");
    // Members 0 and 2 start the next call: its input is written.
    let second: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, r2.0)).collect();
    for m in [0, 2] {
        sim.call(m, r2, Op::Sum, &second[m]);
    }
    // Member 1's NACK is answered by member 2 from round 1's buffer.
    assert!(sim.run_until(2_000_000, |sim| sim.done(1, r1), |_, _| false), "member 1 completes round 1");
    let mut got = vec![0; len as usize];
    sim.memories[1].read_vector(sim.job.round_base(r1), &mut got);
    assert_eq!(got, star(Op::Sum, &first, &[1; 3]), "member 1's result of round 1");
    assert!(sim.totals().resends > 0, "the FINAL was resent");
    // And the second call completes on every member.
    sim.call(1, r2, Op::Sum, &second[1]);
    assert!(sim.run(r2, 2_000_000));
    for m in 0..members {
        assert_eq!(sim.result(m), star(Op::Sum, &second, &[1; 3]), "member {m}, round 2");
    }
}

#[test]
fn saturation_is_flagged_on_every_member() {
    let members = 3;
    let mut sim = Sim::new(members, 2, 3, vec![1; members], DEFAULT_WINDOW);
    let round = Round(1);
    for m in 0..members {
        sim.call(m, round, Op::Sum, &[i32::MAX, 1, -1]);
    }
    assert!(sim.run(round, 100_000));
    for m in 0..members {
        assert_eq!(sim.result(m), vec![i32::MAX, 3, -3]);
    }
    // Fragment 0 saturated: every member stored it flagged.
    assert_eq!(sim.totals().saturated, members as u64);
}

#[test]
fn forged_and_foreign_datagrams_are_refused() {
    let mut sim = Sim::new(3, 4, 8, vec![1; 3], DEFAULT_WINDOW);
    let round = Round(1);
    sim.call(1, round, Op::Sum, &[1; 8]);
    // A PARTIAL of fragment 0 (origin 0) hops 1 for member 1, but from
    // member 2's address.
    let hdr = RingHeader { ring: RING, kind: RingKind::Partial, flags: 0, round, frag: 0, hops: 1, count: 4, sender: 0, op: Op::Sum };
    let mut d = hdr.encode().to_vec();
    d.extend_from_slice(&[0u8; 16]);
    let mut out = Vec::new();
    sim.services[1].handle(sim.now, SocketAddr::new(member_addr(2), PORT), d.clone(), &mut out);
    // Another ring's id, and a KICK from the network.
    let mut other = d.clone();
    other[4..6].copy_from_slice(&41u16.to_be_bytes());
    sim.services[1].handle(sim.now, SocketAddr::new(member_addr(0), PORT), other, &mut out);
    let kick = RingHeader { kind: RingKind::Kick, frag: 0, hops: 0, count: 0, ..hdr };
    sim.services[1].handle(sim.now, SocketAddr::new(member_addr(0), PORT), kick.encode().to_vec(), &mut out);
    assert_eq!(sim.services[1].stats().refused, 3);
    // The genuine one is added to and sent on to member 2.
    sim.services[1].handle(sim.now, SocketAddr::new(member_addr(0), PORT), d, &mut out);
    assert_eq!(sim.services[1].stats().user_hops, 1);
    assert!(out.iter().any(|t| t.to.ip() == member_addr(2)));
}

/// A ring of IPv6 members: every op exact under loss and duplication, and
/// a datagram is a member's only from its IPv6 address: not from the
/// IPv4-mapped form of an IPv4 address, nor from an IPv4 address.
#[test]
fn a_ring_of_ipv6_members_is_exact_under_loss_and_checks_senders_by_address() {
    let members = 4;
    let addrs: Vec<IpAddr> = (0..members).map(member_addr6).collect();
    let mut sim = Sim::with_addrs(addrs.clone(), 5, 37, vec![1; members], DEFAULT_WINDOW);
    sim.loss = 0.05;
    sim.dup = 0.02;
    for (i, op) in [Op::Sum, Op::Max, Op::Min, Op::Count, Op::Avg].into_iter().enumerate() {
        let round = Round(1 + i as u32);
        let inputs: Vec<Vec<i32>> = (0..members).map(|m| input(m, 37, round.0)).collect();
        for (m, v) in inputs.iter().enumerate() {
            sim.call(m, round, op, v);
        }
        assert!(sim.run(round, 200_000), "{op:?} round {round}");
        for m in 0..members {
            assert_eq!(sim.result(m), star(op, &inputs, &vec![1; members]), "{op:?} at member {m}");
        }
    }
    assert!(sim.dropped > 0, "the simulated network lost datagrams");
    assert!(sim.totals().nacks_sent > 0, "losses were repaired by NACKs");

    // Refused: member 0's PARTIAL to member 1 from anything but member 0's
    // IPv6 address; the genuine one goes on to member 2's IPv6 address.
    let round = Round(10);
    sim.loss = 0.0;
    sim.dup = 0.0;
    sim.call(1, round, Op::Sum, &[1; 37]);
    let hdr = RingHeader { ring: RING, kind: RingKind::Partial, flags: 0, round, frag: 0, hops: 1, count: 5, sender: 0, op: Op::Sum };
    let mut d = hdr.encode().to_vec();
    d.extend_from_slice(&[0u8; 20]);
    let before = sim.services[1].stats().refused;
    let mut out = Vec::new();
    let mapped = IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped());
    for from in [member_addr(0), mapped, member_addr6(2)] {
        sim.services[1].handle(sim.now, SocketAddr::new(from, PORT), d.clone(), &mut out);
    }
    assert_eq!(sim.services[1].stats().refused, before + 3);
    sim.services[1].handle(sim.now, SocketAddr::new(addrs[0], PORT), d, &mut out);
    assert!(out.iter().any(|t| t.to == SocketAddr::new(addrs[2], PORT)), "sent on to member 2: {:?}", out.iter().map(|t| t.to).collect::<Vec<_>>());
}

/// A ring whose members mix IPv4 and IPv6 addresses is refused.
#[test]
fn a_ring_mixing_ip_versions_is_refused() {
    let addrs = vec![member_addr(0), member_addr6(1)];
    let memory = Arc::new(RingMemory::heap(4, 16));
    let job = RingJob { id: RING, port: PORT, members: 2, me: 0, frag_elems: 4, frags: 2, vector_len: 8, base: 0, weight_sum: 2, weight: 1, self_addr: 0, next_addr: 0 };
    let err = RingService::new(0, job, addrs, memory).expect_err("a mixed ring");
    assert!(format!("{err:#}").contains("mix IPv4 and IPv6"), "{err:#}");
}

#[test]
fn a_member_restarting_its_rounds_continues_from_ready_round() {
    // Rounds need not start at 1: the runtime starts at ready_round + 1.
    let mut sim = Sim::new(3, 4, 10, vec![1; 3], DEFAULT_WINDOW);
    for round in [Round(u32::MAX - 2), Round(u32::MAX - 1)] {
        let inputs: Vec<Vec<i32>> = (0..3).map(|m| input(m, 10, round.0)).collect();
        for (m, v) in inputs.iter().enumerate() {
            sim.call(m, round, Op::Sum, v);
        }
        assert!(sim.run(round, 100_000), "round {round}");
        assert_eq!(sim.result(0), star(Op::Sum, &inputs, &[1; 3]));
    }
}

/// The real loop: three services on 127.0.0.{1,2,3}, one port, heap
/// memory, each "runtime" a thread making its round ready and KICKing.
#[test]
fn the_server_loop_runs_a_ring_over_loopback() {
    let members = 3usize;
    let addrs: Vec<IpAddr> = (0..members).map(|m| IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + m as u8))).collect();
    // A free port on all three addresses.
    let (port, sockets) = (20000..30000u16)
        .find_map(|p| {
            let s: Result<Vec<UdpSocket>> = addrs.iter().map(|&a| bind_ring_socket(a, p)).collect();
            s.ok().map(|s| (p, s))
        })
        .expect("a free port");
    let (frag_elems, len) = (6u32, 100u32);
    let frags = len.div_ceil(frag_elems);
    let mut memories = Vec::new();
    let mut servers = Vec::new();
    for (m, socket) in sockets.into_iter().enumerate() {
        let memory = Arc::new(RingMemory::heap(frag_elems, 2 * frags));
        let job = RingJob {
            id: RING,
            port,
            members: members as u16,
            me: m as u16,
            frag_elems,
            frags,
            vector_len: len,
            base: 0,
            weight_sum: members as u32,
            weight: 1,
            self_addr: 0,
            next_addr: 0,
        };
        let service = RingService::new(0, job, addrs.clone(), memory.clone()).expect("service");
        servers.push(RingServer::start(vec![(vec![socket], service)], None).expect("server"));
        memories.push((memory, job));
    }
    let inputs: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, 1)).collect();
    let want = star(Op::Sum, &inputs, &[1; 3]);
    let round = Round(1);
    for (m, (memory, job)) in memories.iter().enumerate() {
        memory.begin_round(0, round, Op::Sum, 0, |mem| mem.write_vector(job.round_base(round), &inputs[m]));
        let kick = RingHeader { ring: RING, kind: RingKind::Kick, flags: 0, round, frag: 0, hops: 0, count: 0, sender: 0, op: Op::Sum };
        // The KICK comes from 127.0.0.1 whichever member it is for.
        let s = UdpSocket::bind("127.0.0.1:0").expect("kick socket");
        s.send_to(&kick.encode(), SocketAddr::new(addrs[m], port)).expect("kick");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for (memory, job) in &memories {
        while memory.ctrl(0).finals.load(Ordering::Acquire) < frags {
            assert!(Instant::now() < deadline, "the ring did not complete in 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut got = vec![0; len as usize];
        memory.read_vector(job.round_base(round), &mut got);
        assert_eq!(got, want);
    }
    drop(servers);
}

/// The default window holds about WINDOW_BYTES of datagrams: 4 of the
/// largest fragments, every fragment of a short one up to DEFAULT_WINDOW.
#[test]
fn default_window_counts_bytes() {
    use super::{default_window, WINDOW_BYTES};
    assert_eq!(default_window(16_370), 4);
    assert_eq!(default_window(2_242), WINDOW_BYTES / (abi::RING_HDR_LEN + 4 * 2_242));
    assert_eq!(default_window(2), DEFAULT_WINDOW);
    assert_eq!(default_window(1 << 20), 2, "never below two in flight");
    for elems in [2u32, 362, 2_242, 16_370] {
        let w = default_window(elems);
        assert!(w == DEFAULT_WINDOW || w * (abi::RING_HDR_LEN + 4 * elems as usize) <= WINDOW_BYTES, "{elems}: {w}");
    }
}

/// A round covering the first fragments only (the runtime's agreement on
/// a float scale): those complete on every member under loss, the others
/// are neither sent nor NACKed, and a whole round after it is exact.
#[test]
fn a_round_of_the_first_fragments_covers_only_them() {
    let (members, frag_elems, len) = (4usize, 4u32, 4 * 9 + 1);
    let mut sim = Sim::new(members, frag_elems, len, vec![1; members], DEFAULT_WINDOW);
    sim.loss = 0.05;
    sim.dup = 0.05;
    for (round, covered) in [(Round(1), 1u32), (Round(2), 3)] {
        sim.round_frags = covered;
        let inputs: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, round.0)).collect();
        let want = star(Op::Max, &inputs, &[1; 4]);
        for (m, input) in inputs.iter().enumerate() {
            sim.call(m, round, Op::Max, input);
        }
        assert!(sim.run(round, 2_000_000), "round {round} of {covered} fragments did not complete");
        for m in 0..members {
            let got = sim.result(m);
            for f in 0..sim.layout.frags() {
                let stored = sim.memories[m].has_result(sim.job.index(round, f), round);
                assert_eq!(stored, f < covered, "member {m} fragment {f} of a round of {covered}");
                let r = f as usize * frag_elems as usize..(f as usize * frag_elems as usize + frag_elems as usize).min(len as usize);
                if f < covered {
                    assert_eq!(got[r.clone()], want[r], "member {m} fragment {f}");
                }
            }
        }
    }
    assert!(sim.dropped > 0, "the loss was applied");
    // Originals: fragment 0 (member 0's) in round 1; fragments 0..3 (one
    // each of members 0, 1, 2) in round 2; never a fragment beyond.
    let originals: Vec<u64> = sim.services.iter().map(|s| s.stats().originals_sent).collect();
    assert!(originals[0] >= 2 && originals[1] >= 1 && originals[2] >= 1 && originals[3] == 0, "originals {originals:?}");
    sim.round_frags = 0;
    let round = Round(3);
    let inputs: Vec<Vec<i32>> = (0..members).map(|m| input(m, len as usize, round.0)).collect();
    for (m, input) in inputs.iter().enumerate() {
        sim.call(m, round, Op::Sum, input);
    }
    assert!(sim.run(round, 2_000_000), "the whole round after the short ones");
    let want = star(Op::Sum, &inputs, &[1; 4]);
    for m in 0..members {
        assert_eq!(sim.result(m), want, "member {m}, whole round");
    }
}

/// The first wait before a NACK follows the ring's cycle time (srtt +
/// 4 · rttvar) within NACK_AFTER and CYCLE_WAIT_MAX.
#[test]
fn the_nack_wait_follows_the_cycle_time() {
    use super::{CycleTime, CYCLE_WAIT_MAX, NACK_AFTER};
    let mut c = CycleTime::default();
    assert_eq!(c.nack_after(), NACK_AFTER, "no sample yet");
    for _ in 0..50 {
        c.sample(Duration::from_micros(300));
    }
    assert_eq!(c.nack_after(), NACK_AFTER, "a fast ring waits the least");
    for k in 0..50 {
        c.sample(Duration::from_millis(1 + k % 2));
    }
    let w = c.nack_after();
    assert!(w > NACK_AFTER && w < CYCLE_WAIT_MAX, "cycles of 1 and 2 ms: {w:?}");
    for _ in 0..50 {
        c.sample(Duration::from_millis(30));
    }
    assert_eq!(c.nack_after(), CYCLE_WAIT_MAX, "a slow ring waits at most CYCLE_WAIT_MAX");
}
