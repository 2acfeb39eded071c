//! The user-space path end to end in network namespaces: real UDP
//! contributions sent from testbed hosts to an aggregator whose XDP program
//! hands datagrams over through AF_XDP to `aggbox::kernel::afxdp`, RESULTs read
//! from a plain UDP socket on the job's result port.
//!
//! - every spec case of `aggregation-userspace.json`, replayed from its
//!   source addresses: RESULT payloads and flags byte for byte, exactly one
//!   per fragment, retransmissions dropped;
//! - PROD/BAND/BOR/BXOR and FLOAT32 SUM/AVG/MAX/MIN/COUNT/PROD with weights
//!   and several fragments against the reference reducer;
//! - a job with `slots = 2` under load: the pool overflows to user space,
//!   every fragment exact, exactly one RESULT each;
//! - the overload hand-off (pool above the threshold for longer than the
//!   hold time) and a `userspace_only` job.
//!
//! Needs root: `sudo -E cargo test --test netns_userspace`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::wire::abi::{self, DropReason, HandoffReason, Op, Outcome};
use aggbox::config::{Config, JobConfig};
use aggbox::kernel::xdp::{XdpPlane, XdpLink, XdpMode};
use aggbox::node::xdp_job;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::wire::reducer;
use crate::testbed::{in_netns, Testbed, TestbedConfig};
use aggbox::kernel::afxdp::{slot_bytes, Refusal, UserspaceOptions, UserspacePath};
use nix::sched::{setns, CloneFlags};

const AGG: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "netns_userspace needs root: `sudo -E cargo test --test netns_userspace`"
    );
}

/// Rank address i: 10.77.0.(11 + i), as in the spec vectors.
fn rank_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 11 + i as u8)
}

/// An aggregator (host 0, 10.77.0.1, XDP + user-space path; the test
/// thread lives in its namespace) and a sender host (host 1) owning the rank
/// addresses.
struct Bed {
    tb: Testbed,
    dp: XdpPlane,
    _link: XdpLink,
    us: Option<UserspacePath>,
}

impl Bed {
    fn up(jobs: Vec<JobConfig>, ranks: usize, opts: UserspaceOptions) -> Bed {
        require_root();
        let tb = Testbed::up(TestbedConfig {
            hosts: 2,
            first: 1,
            // Two RX queues on every veth: one AF_XDP socket per queue.
            queues: Some(2),
            ..Default::default()
        })
        .expect("testbed");
        for i in 0..ranks {
            let out = tb
                .run_in(1, &["ip", "addr", "add", &format!("{}/16", rank_addr(i)), "dev", "eth0"])
                .expect("ip addr add");
            assert!(out.status.success(), "ip addr add: {out:?}");
        }
        let ns = File::open(format!("/var/run/netns/{}", tb.host(0).netns)).expect("netns");
        setns(&ns, CloneFlags::CLONE_NEWNET).expect("setns (this thread only)");
        let dp = XdpPlane::load().expect("load");
        let config = Config {
            jobs,
            ..Default::default()
        };
        for j in &config.jobs {
            dp.set_job(j.id, &xdp_job(j, aggbox::netif::interface_mtu("eth0").expect("eth0 MTU"))).expect("set_job");
        }
        let ifindex = aggbox::node::ifindex("eth0").expect("eth0");
        let (link, _) = dp.attach_xdp(ifindex, XdpMode::Native).expect("attach");
        let us = UserspacePath::start_with("eth0", &dp, &config, opts).expect("user-space path");
        assert_eq!(us.queues(), &[0, 1], "one socket per RX queue");
        Bed {
            tb,
            dp,
            _link: link,
            us: Some(us),
        }
    }

    /// UDP sockets of ranks 0..n on the sender host.
    fn senders(&self, n: usize) -> Vec<UdpSocket> {
        let netns = self.tb.host(1).netns;
        in_netns(&netns, || {
            (0..n)
                .map(|i| UdpSocket::bind((rank_addr(i), 0)).expect("bind rank socket"))
                .collect::<Vec<_>>()
        })
        .expect("in_netns")
    }

    fn us(&self) -> &UserspacePath {
        self.us.as_ref().expect("running")
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if let Some(us) = self.us.take() {
            us.stop();
        }
    }
}

fn job(id: u16, port: u16, workers: usize) -> JobConfig {
    JobConfig {
        id,
        port,
        workers: (0..workers).map(|r| rank_addr(r).into()).collect(),
        weights: vec![1; workers],
        result_port: port + 1,
        result_group: None,
        vector_len: None,
        slots: 4096,
        parent: None,
        userspace_only: false,
        window: 4,
        userspace_slots: aggbox::config::DEFAULT_USERSPACE_SLOTS,
        userspace_slot_bytes: aggbox::config::DEFAULT_USERSPACE_SLOT_BYTES_JOB,
        consumer: aggbox::config::ResultConsumer::Application,
        frag_elems: None,
    }
}

fn result_socket(port: u16) -> UdpSocket {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).expect("result socket");
    // Bursts of hundreds of RESULTs: a receive buffer that holds them all.
    let size: libc::c_int = 16 << 20;
    // SAFETY: valid socket fd and a live c_int option value.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE");
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    s
}

/// RESULTs keyed by (round, frag_off): (header, payload, how many arrived).
type Results = BTreeMap<(u32, u32), (AggHeader, Vec<u8>, usize)>;

/// Read RESULTs until `want` distinct ones arrived (or 10 s passed), then
/// 300 ms more to catch duplicates.
fn collect(sock: &UdpSocket, want: usize) -> Results {
    let mut out = Results::new();
    let mut buf = vec![0u8; 65536];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut extra: Option<Instant> = None;
    loop {
        if out.len() >= want && extra.is_none() {
            extra = Some(Instant::now() + Duration::from_millis(300));
        }
        let now = Instant::now();
        if now > deadline || extra.is_some_and(|e| now > e) {
            break;
        }
        if let Ok((n, _)) = sock.recv_from(&mut buf) {
            let (hdr, payload) = proto::split_agg(&buf[..n]).expect("RESULT decodes");
            assert!(hdr.is_result());
            assert_eq!(hdr.rank, abi::RESULT_RANK);
            let e = out
                .entry((hdr.round.0, hdr.frag_off))
                .or_insert((hdr, payload.to_vec(), 0));
            e.2 += 1;
        }
    }
    out
}

fn send(sock: &UdpSocket, port: u16, dgram: &[u8]) {
    sock.send_to(dgram, SocketAddrV4::new(AGG, port)).expect("send");
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn spec_vectors_userspace_replayed_end_to_end() {
    let path = format!(
        "{}/../shared/spec/vectors/aggregation-userspace.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("spec vectors are required");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let cases = v["cases"].as_array().expect("cases");
    let mut jobs = Vec::new();
    let mut max_ranks = 0;
    for (i, case) in cases.iter().enumerate() {
        let j = &case["job"];
        let workers: Vec<Ipv4Addr> = j["rank_ips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().parse().unwrap())
            .collect();
        max_ranks = max_ranks.max(workers.len());
        let port = 7000 + 2 * i as u16;
        jobs.push(JobConfig {
            weights: j["weights"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_i64().unwrap() as i32)
                .collect(),
            vector_len: j["vector_len"].as_u64().map(|x| x as u32),
            workers: workers.into_iter().map(std::net::IpAddr::V4).collect(),
            ..job(j["id"].as_u64().unwrap() as u16, port, 1)
        });
    }
    for j in &jobs {
        for (i, a) in j.workers.iter().enumerate() {
            assert_eq!(*a, rank_addr(i), "vector rank addresses are 10.77.0.11 + i");
        }
    }
    let bed = Bed::up(jobs.clone(), max_ranks, UserspaceOptions::default());
    let senders = bed.senders(max_ranks);
    let mut retransmissions = 0;
    for (i, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let j = &jobs[i];
        let rx = result_socket(j.result_port);
        for d in case["datagrams"].as_array().unwrap() {
            let src: Ipv4Addr = d["src"].as_str().unwrap().parse().unwrap();
            let rank = j.workers.iter().position(|a| *a == src).unwrap();
            send(&senders[rank], j.port, &unhex(d["hex"].as_str().unwrap()));
            if d["why"].as_str() == Some("retransmission") {
                retransmissions += 1;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let want = case["results"].as_array().unwrap();
        let got = collect(&rx, want.len());
        assert_eq!(got.len(), want.len(), "{name}: number of RESULTs");
        for w in want {
            let frag_off = w["frag_off"].as_u64().unwrap() as u32;
            let (hdr, payload, n) = got
                .values()
                .find(|g| g.0.frag_off == frag_off)
                .unwrap_or_else(|| panic!("{name}: no RESULT for frag_off {frag_off}"));
            assert_eq!(*n, 1, "{name}/{frag_off}: exactly one RESULT");
            assert_eq!(hdr.flags, w["flags"].as_u64().unwrap() as u8, "{name}/{frag_off}: flags");
            assert_eq!(
                *payload,
                unhex(w["hex"].as_str().unwrap()),
                "{name}/{frag_off}: payload byte for byte"
            );
        }
    }
    let st = bed.us().stats();
    assert_eq!(st.drop(DropReason::Retransmission), retransmissions);
    let k = bed.dp.stats().unwrap();
    assert_eq!(k.outcome(Outcome::Result).packets, 0, "nothing aggregated in the kernel");
    assert_eq!(k.outcome(Outcome::UserspaceUnavailable).packets, 0);
}

/// Deterministic pseudo-random values.
fn lcg(seed: &mut u64) -> u32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

#[test]
fn every_userspace_op_matches_the_reference_reducer() {
    const WORKERS: usize = 3;
    const COUNT: u16 = 100;
    const FRAGS: u32 = 3;
    let cases: Vec<(Op, bool)> = vec![
        (Op::Prod, false),
        (Op::Band, false),
        (Op::Bor, false),
        (Op::Bxor, false),
        (Op::Land, false),
        (Op::Lor, false),
        (Op::Sum, true),
        (Op::Avg, true),
        (Op::Max, true),
        (Op::Min, true),
        (Op::Count, true),
        (Op::Prod, true),
    ];
    // Rank 1's contribution to the middle integer fragment is a clamped
    // input (OVERFLOW): the RESULT carries it, as the kernel's does.
    let clamped_input = |float: bool, f: u32, r: usize| !float && f == 1 && r == 1;
    let weights = vec![1, 2, 3];
    let jobs: Vec<JobConfig> = (0..cases.len())
        .map(|i| JobConfig {
            weights: weights.clone(),
            ..job(100 + i as u16, 7100 + 2 * i as u16, WORKERS)
        })
        .collect();
    let bed = Bed::up(jobs.clone(), WORKERS, UserspaceOptions::default());
    let senders = bed.senders(WORKERS);
    let mut seed = 7u64;
    for (i, &(op, float)) in cases.iter().enumerate() {
        let j = &jobs[i];
        let rx = result_socket(j.result_port);
        let mut want = BTreeMap::new();
        for f in 0..FRAGS {
            let frag_off = f * u32::from(COUNT);
            let mut ints: Vec<Vec<i32>> = Vec::new();
            let mut floats: Vec<Vec<f32>> = Vec::new();
            for r in 0..WORKERS {
                let hdr = AggHeader {
                    job: j.id,
                    rank: r as u16,
                    seq: f,
                    round: aggbox::wire::abi::Round(5),
                    frag_off,
                    op,
                    flags: if float { abi::AGG_F_FLOAT32 } else { 0 }
                        | if f == FRAGS - 1 { abi::AGG_F_LAST_FRAGMENT } else { 0 }
                        | if clamped_input(float, f, r) { abi::AGG_F_OVERFLOW } else { 0 },
                    count: COUNT,
                };
                let mut d = Vec::new();
                proto::write_agg_header(&hdr, &mut d);
                if float {
                    let v: Vec<f32> = (0..COUNT)
                        .map(|k| match k % 5 {
                            0 => 0.0,
                            _ => (lcg(&mut seed) % 2000) as f32 / 100.0 - 10.0,
                        })
                        .collect();
                    proto::write_f32_be(&v, &mut d);
                    floats.push(v);
                } else {
                    let v: Vec<i32> = (0..COUNT)
                        .map(|k| match (op, k) {
                            (Op::Prod, 0) => i32::MAX, // forces OVERFLOW
                            (Op::Prod, _) => (lcg(&mut seed) % 13) as i32 - 6,
                            _ => lcg(&mut seed) as i32,
                        })
                        .collect();
                    proto::write_i32_be(&v, &mut d);
                    ints.push(v);
                }
                send(&senders[r], j.port, &d);
            }
            let res = if float {
                let c: Vec<(&[f32], i32)> =
                    floats.iter().zip(&weights).map(|(v, &w)| (&v[..], w)).collect();
                reducer::reduce_f32(op, &c).unwrap()
            } else {
                let c: Vec<(&[i32], i32)> =
                    ints.iter().zip(&weights).map(|(v, &w)| (&v[..], w)).collect();
                reducer::reduce(op, &c).unwrap()
            };
            let mut payload = Vec::new();
            res.write_be(&mut payload);
            let mut flags = abi::AGG_F_RESULT | res.flags();
            if f == FRAGS - 1 {
                flags |= abi::AGG_F_LAST_FRAGMENT;
            }
            if (0..WORKERS).any(|r| clamped_input(float, f, r)) {
                flags |= abi::AGG_F_OVERFLOW;
            }
            want.insert((5u32, frag_off), (flags, payload));
        }
        let got = collect(&rx, want.len());
        assert_eq!(got.len(), want.len(), "{} float={float}: RESULTs", op.name());
        for (key, (flags, payload)) in &want {
            let (hdr, p, n) = &got[key];
            assert_eq!(*n, 1, "{} {key:?}: exactly one RESULT", op.name());
            assert_eq!((hdr.op, hdr.count, hdr.job), (op, COUNT, j.id));
            assert_eq!(hdr.flags, *flags, "{} float={float} {key:?}: flags", op.name());
            assert_eq!(p, payload, "{} float={float} {key:?}: payload", op.name());
        }
    }
    let h = bed.dp.handoff_stats().unwrap();
    assert_eq!(h[HandoffReason::Op.label()].packets, 6 * FRAGS as u64 * WORKERS as u64);
    assert_eq!(h[HandoffReason::Float32.label()].packets, 6 * FRAGS as u64 * WORKERS as u64);
    // The worker publishes its counters after it sends: the last RESULTs
    // can be read before their counts (seen on a slow TCG guest).
    let want_results = cases.len() as u64 * FRAGS as u64;
    let t0 = std::time::Instant::now();
    let mut st = bed.us().stats();
    while st.results < want_results && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(10));
        st = bed.us().stats();
    }
    assert_eq!(st.results, want_results);
    assert_eq!(st.dropped(), 0, "{:?}", st.drops);
    assert_eq!(st.latency.count, st.results);
}

/// One rank's SUM contribution to fragment `f` of `round` (of `frags`
/// fragments of `count` elements): its value depends only on (rank,
/// fragment, element), so a resend is byte-identical.
fn sum_contribution(j: &JobConfig, round: u32, frags: u32, f: u32, count: u16, r: usize) -> Vec<u8> {
    let hdr = AggHeader {
        job: j.id,
        rank: r as u16,
        seq: round * frags + f,
        round: aggbox::wire::abi::Round(round),
        frag_off: f * u32::from(count),
        op: Op::Sum,
        flags: 0,
        count,
    };
    let mut d = Vec::new();
    proto::write_agg_header(&hdr, &mut d);
    let v: Vec<i32> = (0..count).map(|k| sum_value(r, f, k)).collect();
    proto::write_i32_be(&v, &mut d);
    d
}

fn sum_value(r: usize, f: u32, k: u16) -> i32 {
    (r as i32 + 1) * 1000 + f as i32 * 7 - i32::from(k)
}

/// Sends `frags` SUM fragments of `count` elements from every rank in
/// `order`, rank by rank (so fragments pile up in the slot pool), pacing the
/// sender; returns the expected RESULT payloads.
fn send_sum_round(
    senders: &[UdpSocket],
    j: &JobConfig,
    round: u32,
    frags: u32,
    count: u16,
    order: &[usize],
) -> BTreeMap<(u32, u32), Vec<u8>> {
    let mut want = BTreeMap::new();
    for &r in order {
        want = send_sum_round_one(senders, j, round, frags, count, r, |_, _| false);
    }
    want
}

/// Packets the kernel counted as lost on the way from the sender host to
/// the aggregator's programs: TX drops of every veth on the way (the
/// sender's, and the switch's port to the aggregator, whose drops are the
/// aggregator's ring being full), the aggregator's RX drops (a failed
/// redirect) and every AF_XDP socket's drops (RX ring full, fill ring
/// empty, other); and the contributions the XDP program dropped as
/// `slot_busy` (a fast slot's holder was held up past the lock's bounded
/// spin, e.g. its vCPU descheduled: dropped for its sender to resend, by
/// design; seen twice in a fresh-clone `make test`).
fn counted_packet_losses(bed: &Bed) -> u64 {
    let read = |netns: &str, dev: &str, counter: &str| -> u64 {
        let path = format!("/sys/class/net/{dev}/statistics/{counter}");
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", netns, "cat", &path])
            .output()
            .expect("read a veth counter");
        assert!(out.status.success(), "cat {path} in {netns}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().parse().expect("counter")
    };
    let (sender, aggregator, switch) = (bed.tb.host(1).netns, bed.tb.host(0).netns, bed.tb.switch_netns());
    let xsk: u64 = bed
        .us()
        .stats()
        .xsk
        .values()
        .map(|x| x.rx_dropped + x.rx_ring_full + x.rx_fill_ring_empty)
        .sum();
    read(&sender, "eth0", "tx_dropped")
        + read(&switch, &bed.tb.switch_port(0), "tx_dropped")
        + read(&aggregator, "eth0", "rx_dropped")
        + xsk
        + bed.dp.stats().expect("kernel stats").drop(DropReason::SlotBusy).packets
}

fn check(got: &Results, want: &BTreeMap<(u32, u32), Vec<u8>>, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: distinct RESULTs");
    for (key, payload) in want {
        let (hdr, p, n) = got.get(key).unwrap_or_else(|| panic!("{what}: no RESULT {key:?}"));
        assert_eq!(*n, 1, "{what} {key:?}: exactly one RESULT");
        assert_eq!(hdr.flags, abi::AGG_F_RESULT, "{what} {key:?}: flags");
        assert_eq!(p, payload, "{what} {key:?}: payload");
    }
}

#[test]
fn tiny_slot_pool_overflows_to_userspace_exactly() {
    const WORKERS: usize = 3;
    let j = JobConfig {
        slots: 2,
        ..job(9, 7300, WORKERS)
    };
    let bed = Bed::up(vec![j.clone()], WORKERS, UserspaceOptions {
        // Keep the overload watcher out of this test: only pool exhaustion.
        overload_hold: Duration::from_secs(3600),
        ..Default::default()
    });
    let senders = bed.senders(WORKERS);
    let rx = result_socket(j.result_port);

    // Rank by rank: two fragments fit in the kernel, the rest overflow.
    let want = send_sum_round(&senders, &j, 1, 200, 64, &[0, 1, 2]);
    let got = collect(&rx, want.len());
    if got.len() != want.len() {
        eprintln!("kernel {:?}\nhandoff {:?}\nuser space {:?}", bed.dp.stats().unwrap(), bed.dp.handoff_stats().unwrap(), bed.us().stats());
    }
    check(&got, &want, "rank by rank");

    // Under load: three senders at once, interleaved, several rounds.
    const LOAD_ROUNDS: std::ops::Range<u32> = 2..5;
    const LOAD_FRAGS: u32 = 150;
    // Every run exercises the recovery below: each rank withholds its
    // contribution to a few fragments of round 3.
    let withheld = |round: u32, f: u32, r: usize| round == 3 && f % 50 == 7 + r as u32;
    let withheld_count = (0..WORKERS)
        .map(|r| (0..LOAD_FRAGS).filter(|&f| withheld(3, f, r)).count() as u64)
        .sum::<u64>();
    let losses_before = counted_packet_losses(&bed);
    let mut want = BTreeMap::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..WORKERS)
            .map(|r| {
                let (senders, j) = (&senders, &j);
                s.spawn(move || {
                    let mut w = BTreeMap::new();
                    for round in LOAD_ROUNDS {
                        w.extend(send_sum_round_one(senders, j, round, LOAD_FRAGS, 64, r, |round, f| {
                            withheld(round, f, r)
                        }));
                    }
                    w
                })
            })
            .collect();
        for h in handles {
            want.extend(h.join().unwrap());
        }
    });
    // The withheld fragments are on distinct fragments: do not wait for them.
    let mut got = collect(&rx, want.len() - withheld_count as usize);
    // Three senders and the AF_XDP worker on two vCPUs can overflow a veth
    // or AF_XDP ring (seen on a loaded CI VM). What a sender would do: resend
    // every contribution of each fragment without a RESULT. Contributions
    // that had arrived are refused as retransmissions; the others complete
    // the fragment. A contribution lost anywhere but in a counted ring drop
    // is a defect, so the losses must be covered by the kernel's counters.
    let missing: Vec<(u32, u32)> = want.keys().filter(|k| !got.contains_key(k)).copied().collect();
    let mut resent = 0u64;
    assert!(missing.len() as u64 >= withheld_count, "every withheld contribution leaves its fragment open");
    let lost = {
        let counted = counted_packet_losses(&bed) - losses_before;
        let retransmissions = |bed: &Bed| {
            bed.dp.stats().unwrap().drop(DropReason::Retransmission).packets
                + bed.us().stats().drop(DropReason::Retransmission)
        };
        let refused_before = retransmissions(&bed);
        eprintln!(
            "under load: {} of {} fragments without a RESULT ({withheld_count} contributions withheld), \
             {counted} packet(s) dropped in rings or as slot_busy\nkernel {:?}\nhandoff {:?}\nuser space {:?}",
            missing.len(),
            want.len(),
            bed.dp.stats().unwrap(),
            bed.dp.handoff_stats().unwrap(),
            bed.us().stats()
        );
        for &(round, frag_off) in &missing {
            for r in 0..WORKERS {
                let f = frag_off / 64;
                send(&senders[r], j.port, &sum_contribution(&j, round, LOAD_FRAGS, f, 64, r));
                resent += 1;
            }
        }
        for (key, (hdr, payload, n)) in collect(&rx, missing.len()) {
            got.entry(key).or_insert((hdr, payload, 0)).2 += n;
        }
        let lost = resent - (retransmissions(&bed) - refused_before);
        assert!(lost >= missing.len() as u64, "a fragment without a RESULT lost a contribution");
        assert!(
            lost <= withheld_count + counted,
            "{lost} contribution(s) lost: {withheld_count} withheld, only {counted} counted as dropped in a veth or AF_XDP ring or as slot_busy"
        );
        lost
    };
    check(&got, &want, "under load");

    let h = bed.dp.handoff_stats().unwrap();
    assert!(h[HandoffReason::PoolFull.label()].packets > 0, "{h:?}");
    assert!(h[HandoffReason::Owned.label()].packets > 0, "{h:?}");
    let k = bed.dp.stats().unwrap();
    let st = bed.us().stats();
    let total = 200 + 3 * 150;
    assert_eq!(k.outcome(Outcome::Result).packets + st.results, total, "one RESULT per fragment");
    assert!(k.outcome(Outcome::Result).packets >= 2, "the kernel served some");
    assert!(st.results > 0, "user space served some");
    assert_eq!(k.drop(DropReason::SlotPoolFull).packets, 0);
    // The only refusals: the resent contributions that had arrived.
    let refused_resends = k.drop(DropReason::Retransmission).packets + st.drop(DropReason::Retransmission);
    assert_eq!(refused_resends, resent - lost, "{:?}", st.drops);
    assert_eq!(st.dropped(), st.drop(DropReason::Retransmission), "{:?}", st.drops);
    assert_eq!(bed.dp.slots_in_use(), 0);
    assert_eq!(bed.dp.slot_owners_in_use(), 0, "every ownership record released");
}

/// One rank's share of [`send_sum_round`] (expected payloads are the same),
/// except the fragments `withhold(round, fragment)` names: those are not
/// sent (a loss no counter sees, which the caller must make up for).
fn send_sum_round_one(
    senders: &[UdpSocket],
    j: &JobConfig,
    round: u32,
    frags: u32,
    count: u16,
    rank: usize,
    withhold: impl Fn(u32, u32) -> bool,
) -> BTreeMap<(u32, u32), Vec<u8>> {
    let mut want = BTreeMap::new();
    for f in 0..frags {
        if !withhold(round, f) {
            send(&senders[rank], j.port, &sum_contribution(j, round, frags, f, count, rank));
        }
        if f % 32 == 31 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    for f in 0..frags {
        let sum: Vec<i32> = (0..count)
            .map(|k| (0..senders.len()).map(|r| sum_value(r, f, k)).sum())
            .collect();
        let mut p = Vec::new();
        proto::write_i32_be(&sum, &mut p);
        want.insert((round, f * u32::from(count)), p);
    }
    want
}

#[test]
fn overload_hands_new_slots_to_userspace_until_drained() {
    const WORKERS: usize = 2;
    let j = JobConfig {
        slots: 8,
        ..job(11, 7400, WORKERS)
    };
    let bed = Bed::up(vec![j.clone()], WORKERS, UserspaceOptions {
        overload_fraction: 0.5,
        overload_hold: Duration::from_millis(30),
        ..Default::default()
    });
    let senders = bed.senders(WORKERS);
    let rx = result_socket(j.result_port);

    // Rank 0 opens 6 fragments: the kernel holds 6 >= 4 (50 % of 8).
    let want1 = send_sum_round(&senders[..1], &j, 1, 6, 16, &[0]);
    let deadline = Instant::now() + Duration::from_secs(3);
    while bed.us().stats().jobs_in_overload != vec![11] {
        assert!(Instant::now() < deadline, "job never entered overload");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(bed.dp.job_state(11).unwrap().unwrap().active_slots, 6);
    // New fragments now go to user space although the pool has room.
    let _ = send_sum_round(&senders[..1], &j, 2, 2, 16, &[0]);
    std::thread::sleep(Duration::from_millis(50));
    let h = bed.dp.handoff_stats().unwrap();
    assert_eq!(h[HandoffReason::Overload.label()].packets, 2, "{h:?}");
    assert_eq!(bed.dp.job_state(11).unwrap().unwrap().active_slots, 6);

    // Rank 1 completes everything: each fragment on its own path, once.
    let mut want = send_sum_round(&senders, &j, 1, 6, 16, &[1]);
    want.extend(send_sum_round(&senders, &j, 2, 2, 16, &[1]));
    assert_eq!(want1.len(), 6);
    let got = collect(&rx, want.len());
    check(&got, &want, "overload");
    let k = bed.dp.stats().unwrap();
    assert_eq!(k.outcome(Outcome::Result).packets, 6);
    assert_eq!(bed.us().stats().results, 2);

    // Drained below the threshold: overload ends, new slots in the kernel.
    let deadline = Instant::now() + Duration::from_secs(3);
    while !bed.us().stats().jobs_in_overload.is_empty() {
        assert!(Instant::now() < deadline, "overload never cleared");
        std::thread::sleep(Duration::from_millis(10));
    }
    let want = send_sum_round(&senders, &j, 3, 2, 16, &[0, 1]);
    let got = collect(&rx, want.len());
    check(&got, &want, "after overload");
    assert_eq!(bed.dp.stats().unwrap().outcome(Outcome::Result).packets, 8);
    assert_eq!(bed.us().stats().overload_events, 1);
}

#[test]
fn userspace_only_job_is_served_in_userspace() {
    const WORKERS: usize = 3;
    let j = JobConfig {
        userspace_only: true,
        ..job(12, 7500, WORKERS)
    };
    let bed = Bed::up(vec![j.clone()], WORKERS, UserspaceOptions::default());
    let senders = bed.senders(WORKERS);
    let rx = result_socket(j.result_port);
    let want = send_sum_round(&senders, &j, 1, 20, 362, &[0, 1, 2]);
    let got = collect(&rx, want.len());
    check(&got, &want, "userspace_only");
    // Retransmissions of completed fragments are dropped as such.
    let _ = send_sum_round(&senders[..1], &j, 1, 2, 362, &[0]);
    std::thread::sleep(Duration::from_millis(100));
    let k = bed.dp.stats().unwrap();
    assert_eq!(k.outcome(Outcome::Result).packets, 0);
    assert_eq!(k.outcome(Outcome::ToUserspace).packets, 62);
    let h = bed.dp.handoff_stats().unwrap();
    assert_eq!(h[HandoffReason::UserspaceOnly.label()].packets, 62);
    let st = bed.us().stats();
    assert_eq!(st.results, 20);
    assert_eq!(st.drop(DropReason::Retransmission), 2);
    assert_eq!(bed.dp.slots_in_use(), 0);
}

/// One job's user-space slots are bounded by its own `userspace_slots`
/// (config): a job holding incomplete fragments past its bound gets
/// `slot_pool_full`, while another job on the same path still completes.
#[test]
fn userspace_slots_bound_is_per_job_from_config() {
    const WORKERS: usize = 2;
    let greedy = JobConfig { userspace_only: true, userspace_slots: 3, ..job(13, 7600, WORKERS) };
    let other = JobConfig { userspace_only: true, ..job(14, 7700, WORKERS) };
    let bed = Bed::up(vec![greedy.clone(), other.clone()], WORKERS, UserspaceOptions::default());
    let senders = bed.senders(WORKERS);
    // Only rank 0 of the greedy job: 5 fragments that can never complete.
    let _ = send_sum_round(&senders[..1], &greedy, 1, 5, 16, &[0]);
    std::thread::sleep(Duration::from_millis(200));
    let st = bed.us().stats();
    assert_eq!(st.drop(DropReason::SlotPoolFull), 2, "fragments past the job's bound of 3: {st:?}");
    assert_eq!(st.slots_by_job.get(&greedy.id), Some(&(3, 3)), "{st:?}");
    // The other job is not starved.
    let rx = result_socket(other.result_port);
    let want = send_sum_round(&senders, &other, 1, 10, 16, &[0, 1]);
    let got = collect(&rx, want.len());
    check(&got, &want, "other job beside a job at its user-space bound");
}

/// The job's byte bound end to end, from the config through the running
/// path: rank 0 opens more MTU-1500 fragments than 1 MiB of slot memory
/// holds; the overflow is counted `slot_bytes_job`, the job's bytes stay
/// within the bound, and once rank 1 completes the held slots the refused
/// fragments' retransmissions get slots: every fragment completes exactly once.
#[test]
fn userspace_slot_bytes_bound_from_config_refuses_then_admits_retransmissions() {
    const WORKERS: usize = 2;
    const FRAGS: u32 = 340;
    const COUNT: u16 = 362;
    const BOUND: usize = 1 << 20;
    let j = JobConfig { userspace_only: true, userspace_slot_bytes: BOUND as u64, ..job(15, 7800, WORKERS) };
    let per_slot = slot_bytes(Op::Sum, false, usize::from(COUNT), WORKERS as u64);
    let fit = BOUND / per_slot;
    assert!(fit < FRAGS as usize, "{fit} slots fit");
    let bed = Bed::up(vec![j.clone()], WORKERS, UserspaceOptions::default());
    let senders = bed.senders(WORKERS);
    let rx = result_socket(j.result_port);

    let _ = send_sum_round(&senders, &j, 1, FRAGS, COUNT, &[0]);
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut st = bed.us().stats();
    while st.accepted + st.dropped() < u64::from(FRAGS) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        st = bed.us().stats();
    }
    assert_eq!(st.refused(Refusal::JobSlotBytes), u64::from(FRAGS) - fit as u64, "drops {:?}", st.drops);
    assert_eq!(st.slot_bytes_by_job.get(&j.id), Some(&(fit * per_slot, BOUND)));
    assert_eq!(st.slots_by_job.get(&j.id).map(|s| s.0), Some(fit));

    // Rank 1: the held fragments complete (freeing their bytes), the refused
    // ones open slots; rank 0 again: those complete, the rest are
    // retransmissions.
    let _ = send_sum_round(&senders, &j, 1, FRAGS, COUNT, &[1]);
    let want = send_sum_round(&senders, &j, 1, FRAGS, COUNT, &[0]);
    let got = collect(&rx, want.len());
    check(&got, &want, "fragments past the byte bound, retransmitted");
    let st = bed.us().stats();
    assert_eq!(st.drop(DropReason::Retransmission), fit as u64, "drops {:?}", st.drops);
    assert_eq!(st.refused(Refusal::JobSlotBytes), u64::from(FRAGS) - fit as u64);
    assert_eq!(st.slot_bytes, 0);
}
