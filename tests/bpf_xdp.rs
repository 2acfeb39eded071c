//! BPF_PROG_TEST_RUN tests of the XDP aggregator (katran fixture style): a
//! table of {frame, expected verdict, expected counter deltas}, and every
//! datagram of the spec vectors run through the program; both over IPv4 and
//! over IPv6 (the same table with the IPv6 twins of its addresses, plus
//! each version's own header rules), with and without a VLAN tag.
//!
//! Needs root: run with `sudo -E cargo test --test bpf_xdp`.

mod bpf_common;

use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, Outcome};
use aggbox::kernel::xdp::XdpJob;
use bpf_common::*;

/// Which phase of the dataplane this build implements: 1 = validate and pass,
/// 2 = aggregate in the kernel (valid contributions are absorbed).
const PHASE: u8 = 2;

/// Verdict of an accepted (valid, kernel-op) contribution that does not
/// complete a slot.
fn accepted_verdict() -> u32 {
    if PHASE >= 2 {
        XDP_DROP
    } else {
        XDP_PASS
    }
}

const JOB: u16 = 7;
const JOB_US: u16 = 8;
/// A job on its own port (the port_mismatch row sends its contribution to
/// JOB's port).
const JOB_OTHER: u16 = 9;
const OTHER_PORT: u16 = 7002;

fn rank_addr(rank: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 11 + rank)
}

fn test_job() -> XdpJob {
    test_job_in(Family::V4)
}

fn test_job_in(fam: Family) -> XdpJob {
    XdpJob {
        id: JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..4).map(|r| fam.addr(rank_addr(r))).collect(),
        weights: vec![],
        vector_len: 1024,
        slots: 64,
        flags: 0,
        result_group: None,
        window: 0,
        frag_elems: 0,
    }
}

fn setup() -> TestPlane {
    setup_in(Family::V4)
}

/// JOB, JOB_US (user-space only, on JOB's port) and JOB_OTHER (its own
/// ports), their ranks of IP version `fam`.
fn setup_in(fam: Family) -> TestPlane {
    let dp = load();
    dp.set_job(JOB, &test_job_in(fam)).expect("set_job");
    let mut us = test_job_in(fam);
    us.id = JOB_US;
    us.flags = abi::JOB_F_USERSPACE_ONLY;
    dp.set_job(JOB_US, &us).expect("set_job userspace-only");
    let mut other = test_job_in(fam);
    other.id = JOB_OTHER;
    other.port = OTHER_PORT;
    other.result_port = OTHER_PORT + 1;
    dp.set_job(JOB_OTHER, &other).expect("set_job other");
    dp
}

/// What a row expects to be counted.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Outcome(Outcome),
    Drop(DropReason),
}

impl Expect {
    fn label(self) -> &'static str {
        match self {
            Expect::Outcome(o) => o.label(),
            Expect::Drop(d) => d.label(),
        }
    }
}

struct Row {
    name: &'static str,
    frame: Vec<u8>,
    verdict: u32,
    expect: Expect,
    /// UDP payload bytes counted (0 when the frame has no UDP header).
    bytes: u64,
}

fn valid() -> Agg {
    let mut a = Agg::new(JOB, 1, abi::Op::Sum as u8, vec![1, -2, 3, 4]);
    a.seq = 9;
    a.round = 3;
    a.frag_off = 8;
    a
}

/// The table's frames: from `src`'s twin of IP version `fam`, behind the
/// VLAN tag `vlan` if any.
#[derive(Clone, Copy)]
struct Enc {
    fam: Family,
    vlan: Option<u16>,
}

impl Enc {
    fn udp(self, src: Ipv4Addr, payload: Vec<u8>) -> Frame {
        let mut f = Frame::udp(self.fam.addr(src), payload);
        f.vlan = self.vlan;
        f
    }
}

fn agg_row(enc: Enc, name: &'static str, agg: &Agg, src: Ipv4Addr, verdict: u32, expect: Expect) -> Row {
    let payload = agg.bytes();
    let bytes = payload.len() as u64;
    Row {
        name,
        frame: enc.udp(src, payload).build(),
        verdict,
        expect,
        bytes,
    }
}

/// Every row of the table for frames of `enc`: the rows of both IP
/// versions, then the version's own header rules.
fn table(enc: Enc) -> Vec<Row> {
    let src = rank_addr(1);
    let mut rows = Vec::new();
    let agg_row = |name, agg: &Agg, src, verdict, expect| agg_row(enc, name, agg, src, verdict, expect);

    // Not AggBox: must reach the stack untouched.
    let mut arp = enc.udp(src, vec![]);
    arp.ethertype = 0x0806;
    rows.push(Row {
        name: "arp",
        frame: arp.build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 0,
    });
    let mut tcp = enc.udp(src, vec![0u8; 40]);
    tcp.protocol = 6;
    rows.push(Row {
        name: "tcp",
        frame: tcp.build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 0,
    });
    let mut other_port = enc.udp(src, valid().bytes());
    other_port.dport = 53;
    rows.push(Row {
        name: "udp to another port",
        frame: other_port.build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 40,
    });
    let mut bad_magic = valid().bytes();
    bad_magic[3] = b'9';
    rows.push(Row {
        name: "bad magic to job port",
        frame: enc.udp(src, bad_magic).build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 40,
    });
    rows.push(Row {
        name: "tiny udp to job port",
        frame: enc.udp(src, vec![0x41, 0x47]).build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 2,
    });
    let mut agb = abi::MAGIC_BCAST.to_be_bytes().to_vec();
    agb.extend_from_slice(&[0u8; 20]);
    rows.push(Row {
        name: "AGB1 to job port",
        frame: enc.udp(src, agb).build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::OtherAggbox),
        bytes: 24,
    });
    let mut agk = abi::MAGIC_ACK.to_be_bytes().to_vec();
    agk.extend_from_slice(&[0u8; 14]);
    rows.push(Row {
        name: "AGK1 to job port",
        frame: enc.udp(src, agk).build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::OtherAggbox),
        bytes: 18,
    });

    // Drops, in validation order. First what the IP headers may not carry.
    match enc.fam {
        Family::V4 => ipv4_rows(enc, &mut rows),
        Family::V6 => ipv6_rows(enc, &mut rows),
    }
    let truncated = valid().bytes()[..23].to_vec();
    rows.push(Row {
        name: "truncated header",
        frame: enc.udp(src, truncated).build(),
        verdict: XDP_DROP,
        expect: Expect::Drop(DropReason::TruncatedHeader),
        bytes: 23,
    });
    let mut udp_too_long = enc.udp(src, valid().bytes());
    udp_too_long.udp_len = Some(8 + 60);
    rows.push(Row {
        name: "udp len beyond frame",
        frame: udp_too_long.build(),
        verdict: XDP_DROP,
        expect: Expect::Drop(DropReason::TruncatedHeader),
        bytes: 60,
    });
    let mut a = valid();
    a.flags = 0x40;
    rows.push(agg_row(
        "reserved flag",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::ReservedFlag),
    ));
    let mut a = valid();
    a.op = abi::Op::ALL.len() as u8; // the first number no row has
    rows.push(agg_row(
        "invalid op",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::InvalidOp),
    ));
    let mut a = valid();
    a.count = 0;
    a.values.clear();
    rows.push(agg_row(
        "zero count",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::ZeroCount),
    ));
    let mut a = valid();
    a.count = 5;
    rows.push(agg_row(
        "count larger than datagram",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::CountTooLarge),
    ));
    let mut a = valid();
    a.count = 3;
    rows.push(agg_row(
        "count smaller than datagram",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::CountTooSmall),
    ));
    let mut a = valid();
    a.job = 99;
    rows.push(agg_row(
        "unknown job",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::UnknownJob),
    ));
    let mut a = valid();
    a.rank = 4;
    rows.push(agg_row(
        "rank out of range",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::RankOutOfRange),
    ));
    rows.push(agg_row(
        "source mismatch",
        &valid(),
        rank_addr(2),
        XDP_DROP,
        Expect::Drop(DropReason::SourceMismatch),
    ));
    let mut a = valid();
    a.frag_off = 1021;
    rows.push(agg_row(
        "beyond vector",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::BeyondVector),
    ));
    let mut a = valid();
    a.frag_off = u32::MAX;
    rows.push(agg_row(
        "beyond vector (u32 wrap)",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::BeyondVector),
    ));
    let mut a = valid();
    a.job = JOB_OTHER;
    rows.push(agg_row(
        "another job's contribution to this job's port",
        &a,
        src,
        XDP_DROP,
        Expect::Drop(DropReason::PortMismatch),
    ));
    let mut forged = valid();
    forged.rank = abi::RESULT_RANK;
    forged.flags = abi::AGG_F_RESULT;
    let mut f = enc.udp(src, forged.bytes());
    f.dport = RESULT_PORT;
    rows.push(Row {
        name: "a RESULT from the network to its job's result port",
        frame: f.build(),
        verdict: XDP_DROP,
        expect: Expect::Drop(DropReason::ForgedResult),
        bytes: 40,
    });

    // User-space path, no AF_XDP socket registered: passed to the stack and
    // counted as userspace_unavailable (tests/bpf_handoff.rs covers the
    // redirect with a socket).
    let mut a = valid();
    a.flags = abi::AGG_F_FLOAT32;
    rows.push(agg_row(
        "float32",
        &a,
        src,
        XDP_PASS,
        Expect::Outcome(Outcome::UserspaceUnavailable),
    ));
    let mut a = valid();
    a.op = abi::Op::Prod as u8;
    rows.push(agg_row(
        "op PROD",
        &a,
        src,
        XDP_PASS,
        Expect::Outcome(Outcome::UserspaceUnavailable),
    ));
    let mut a = valid();
    a.op = abi::Op::Bxor as u8;
    rows.push(agg_row(
        "op BXOR",
        &a,
        src,
        XDP_PASS,
        Expect::Outcome(Outcome::UserspaceUnavailable),
    ));
    let mut a = valid();
    a.op = abi::Op::Lor as u8; // the last row, not run in the kernel
    rows.push(agg_row(
        "op LOR",
        &a,
        src,
        XDP_PASS,
        Expect::Outcome(Outcome::UserspaceUnavailable),
    ));
    let mut a = valid();
    a.job = JOB_US;
    rows.push(agg_row(
        "userspace-only job",
        &a,
        src,
        XDP_PASS,
        Expect::Outcome(Outcome::UserspaceUnavailable),
    ));

    // Valid contributions, in several encapsulations.
    rows.push(agg_row(
        "valid contribution",
        &valid(),
        src,
        accepted_verdict(),
        Expect::Outcome(Outcome::Accepted),
    ));
    let mut a = valid();
    a.flags = abi::AGG_F_LAST_FRAGMENT;
    a.frag_off = 1020; // exactly reaches vector_len
    rows.push(agg_row(
        "valid last fragment at vector end",
        &a,
        src,
        accepted_verdict(),
        Expect::Outcome(Outcome::Accepted),
    ));
    let mut vlan = enc.udp(src, valid().bytes());
    vlan.vlan = Some(42);
    rows.push(Row {
        name: "valid behind a VLAN tag",
        frame: vlan.build(),
        verdict: accepted_verdict(),
        expect: Expect::Outcome(Outcome::Accepted),
        bytes: 40,
    });
    let mut padded = enc.udp(src, valid().bytes());
    padded.trailer = 18;
    rows.push(Row {
        name: "valid with trailing padding",
        frame: padded.build(),
        verdict: accepted_verdict(),
        expect: Expect::Outcome(Outcome::Accepted),
        bytes: 40,
    });
    rows
}

/// IPv4's own rows: fragments, options.
fn ipv4_rows(enc: Enc, rows: &mut Vec<Row>) {
    let src = rank_addr(1);
    let mut frag = enc.udp(src, valid().bytes());
    frag.frag = 0x2000; // MF
    rows.push(Row {
        name: "ip first fragment",
        frame: frag.build(),
        verdict: XDP_DROP,
        expect: Expect::Drop(DropReason::IpFragment),
        bytes: 40,
    });
    let mut later_frag = enc.udp(src, valid().bytes());
    later_frag.frag = 0x0010; // offset 16*8: no UDP header here
    rows.push(Row {
        name: "ip later fragment (port unknown)",
        frame: later_frag.build(),
        verdict: XDP_PASS,
        expect: Expect::Outcome(Outcome::NotAggbox),
        bytes: 0,
    });
    let mut opts = enc.udp(src, valid().bytes());
    opts.ip_options = vec![1, 1, 1, 0]; // NOP NOP NOP EOL
    rows.push(Row {
        name: "valid with IPv4 options (IHL 6)",
        frame: opts.build(),
        verdict: accepted_verdict(),
        expect: Expect::Outcome(Outcome::Accepted),
        bytes: 40,
    });
}

/// IPv6's own rows: extension headers (fragments among them) and the
/// mandatory UDP checksum.
fn ipv6_rows(enc: Enc, rows: &mut Vec<Row>) {
    let src = rank_addr(1);
    let with_ext = |ext: Vec<(u8, Vec<u8>)>| {
        let mut f = enc.udp(src, valid().bytes());
        f.ip6_ext = ext;
        f
    };
    let mut push = |name, f: Frame, verdict, expect, bytes| {
        rows.push(Row {
            name,
            frame: f.build(),
            verdict,
            expect,
            bytes,
        })
    };
    let drop = |r| Expect::Drop(r);
    let not_aggbox = Expect::Outcome(Outcome::NotAggbox);
    push(
        "ipv6 first fragment (Fragment header, M set)",
        with_ext(vec![ip6_ext(IP6_FRAGMENT, 8, 0x0001)]),
        XDP_DROP,
        drop(DropReason::IpFragment),
        40,
    );
    push(
        "ipv6 atomic fragment (Fragment header, offset 0, M clear)",
        with_ext(vec![ip6_ext(IP6_FRAGMENT, 8, 0)]),
        XDP_DROP,
        drop(DropReason::IpFragment),
        40,
    );
    push(
        "ipv6 later fragment (port unknown)",
        with_ext(vec![ip6_ext(IP6_FRAGMENT, 8, 0x0011)]), // offset 2*8, M
        XDP_PASS,
        not_aggbox,
        0,
    );
    push(
        "ipv6 hop-by-hop options then a first fragment",
        with_ext(vec![ip6_ext(IP6_HOPOPTS, 8, 0), ip6_ext(IP6_FRAGMENT, 8, 0x0001)]),
        XDP_DROP,
        drop(DropReason::IpFragment),
        40,
    );
    push(
        "ipv6 hop-by-hop options",
        with_ext(vec![ip6_ext(IP6_HOPOPTS, 8, 0)]),
        XDP_DROP,
        drop(DropReason::Ipv6ExtensionHeader),
        40,
    );
    push(
        "ipv6 destination options (16 bytes)",
        with_ext(vec![ip6_ext(IP6_DSTOPTS, 16, 0)]),
        XDP_DROP,
        drop(DropReason::Ipv6ExtensionHeader),
        40,
    );
    push(
        "ipv6 routing header",
        with_ext(vec![ip6_ext(IP6_ROUTING, 24, 0)]),
        XDP_DROP,
        drop(DropReason::Ipv6ExtensionHeader),
        40,
    );
    push(
        "ipv6 five extension headers (the most followed)",
        with_ext(vec![
            ip6_ext(IP6_HOPOPTS, 8, 0),
            ip6_ext(IP6_DSTOPTS, 8, 0),
            ip6_ext(IP6_ROUTING, 8, 0),
            ip6_ext(IP6_DSTOPTS, 8, 0),
            ip6_ext(IP6_DSTOPTS, 8, 0),
        ]),
        XDP_DROP,
        drop(DropReason::Ipv6ExtensionHeader),
        40,
    );
    push(
        "ipv6 six extension headers (not followed)",
        with_ext(vec![ip6_ext(IP6_DSTOPTS, 8, 0); 6]),
        XDP_PASS,
        not_aggbox,
        0,
    );
    push(
        "ipv6 extension headers past the parsed bound",
        with_ext(vec![ip6_ext(IP6_HOPOPTS, 80, 0)]),
        XDP_PASS,
        not_aggbox,
        0,
    );
    let mut f = enc.udp(src, valid().bytes());
    f.udp_csum = Some(0);
    push("ipv6 udp checksum 0", f, XDP_DROP, drop(DropReason::UdpZeroChecksum), 40);
    let mut f = enc.udp(src, valid().bytes());
    f.udp_csum = Some(0);
    f.dport = 53;
    push("ipv6 udp checksum 0 to another port", f, XDP_PASS, not_aggbox, 40);
    let mut f = with_ext(vec![ip6_ext(IP6_HOPOPTS, 8, 0)]);
    f.dport = 53;
    push("ipv6 hop-by-hop options to another port", f, XDP_PASS, not_aggbox, 40);
    let mut f = enc.udp(src, valid().bytes());
    f.udp_csum = Some(0x1234);
    push(
        "ipv6 wrong but nonzero udp checksum (not verified, as over IPv4)",
        f,
        accepted_verdict(),
        Expect::Outcome(Outcome::Accepted),
        40,
    );
    let mut forged = valid();
    forged.rank = abi::RESULT_RANK;
    forged.flags = abi::AGG_F_RESULT;
    let mut f = enc.udp(src, forged.bytes());
    f.dport = RESULT_PORT;
    f.ip6_ext = vec![ip6_ext(IP6_DSTOPTS, 8, 0)];
    push(
        "ipv6 forged RESULT behind destination options",
        f.clone(),
        XDP_DROP,
        drop(DropReason::ForgedResult),
        40,
    );
    f.ip6_ext = vec![ip6_ext(IP6_FRAGMENT, 8, 0x0001)];
    push("ipv6 RESULT-shaped first fragment (left to TC)", f, XDP_PASS, not_aggbox, 40);
}

#[test]
fn table_verdicts_and_counters() {
    run_table(Enc { fam: Family::V4, vlan: None });
}

#[test]
fn table_verdicts_and_counters_vlan() {
    run_table(Enc { fam: Family::V4, vlan: Some(42) });
}

/// The table over IPv6: every row of IPv4's with IPv6 frames and a job of
/// IPv6 ranks, and IPv6's own header rows; bare and behind a VLAN tag.
#[test]
fn table_verdicts_and_counters_ipv6() {
    run_table(Enc { fam: Family::V6, vlan: None });
    run_table(Enc { fam: Family::V6, vlan: Some(42) });
}

fn run_table(enc: Enc) {
    let mut failures = Vec::new();
    for row in table(enc) {
        // A fresh dataplane per row: rows never see each other's state.
        let dp = setup_in(enc.fam);
        let before = dp.stats().expect("stats");
        let (verdict, _out) = dp.test_run(&row.frame).expect("test_run");
        let after = dp.stats().expect("stats");
        let got = deltas(&before, &after);
        let want = vec![(row.expect.label(), 1u64, row.bytes)];
        if verdict != row.verdict || got != want {
            failures.push(format!(
                "{}: verdict {verdict} (want {}), counters {got:?} (want {want:?})",
                row.name, row.verdict
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{:?}: {} rows failed:\n{}",
        enc.fam,
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn not_aggbox_frames_are_untouched() {
    for fam in Family::ALL {
        let dp = setup_in(fam);
        let mut f = Frame::udp(fam.addr(rank_addr(1)), b"hello world, not aggbox".to_vec());
        f.dport = 53;
        let frame = f.build();
        let (verdict, out) = dp.test_run(&frame).expect("test_run");
        assert_eq!(verdict, XDP_PASS, "{fam:?}");
        assert_eq!(out, frame, "{fam:?}");
    }
}

#[test]
fn remove_job_stops_matching_its_port() {
    let dp = setup();
    dp.remove_job(JOB).expect("remove_job");
    // port still used by JOB_US: unknown job now
    let frame = Frame::udp(rank_addr(1), valid().bytes()).build();
    let before = dp.stats().expect("stats");
    let (verdict, _) = dp.test_run(&frame).expect("test_run");
    assert_eq!(verdict, XDP_DROP);
    assert_eq!(
        deltas(&before, &dp.stats().expect("stats")),
        vec![(DropReason::UnknownJob.label(), 1, 40)]
    );
    dp.remove_job(JOB_US).expect("remove_job");
    let before = dp.stats().expect("stats");
    let (verdict, _) = dp.test_run(&frame).expect("test_run");
    assert_eq!(verdict, XDP_PASS, "no job listens on the port any more");
    assert_eq!(
        deltas(&before, &dp.stats().expect("stats")),
        vec![(Outcome::NotAggbox.label(), 1, 40)]
    );
}

#[test]
fn set_job_rejects_bad_configs() {
    let dp = load();
    let mut j = test_job();
    j.ranks.clear();
    assert!(dp.set_job(JOB, &j).is_err(), "no ranks");
    let mut j = test_job();
    j.weights = vec![1, 2];
    assert!(dp.set_job(JOB, &j).is_err(), "weights length");
    let mut j = test_job();
    j.weights = vec![1, 1, 1, 1 << 24];
    assert!(dp.set_job(JOB, &j).is_err(), "weight too large");
    assert!(dp.set_job(JOB + 1, &test_job()).is_err(), "id mismatch");
    assert!(dp.job(JOB).expect("job").is_none(), "nothing written");
}

/// Every datagram of shared/spec/vectors/aggregation.json, in order, each
/// case on a fresh dataplane with the case's job.
#[test]
fn spec_vectors_accept_and_reject() {
    spec_vectors_in(Family::V4);
}

/// The same datagrams (UDP payloads) in IPv6 frames from the IPv6 twins of
/// their sources, to jobs of the twins of their ranks: the same verdicts.
#[test]
fn spec_vectors_accept_and_reject_over_ipv6() {
    spec_vectors_in(Family::V6);
}

fn spec_vectors_in(fam: Family) {
    let vectors = spec_vectors("aggregation.json");
    let cases = vectors["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "no cases in aggregation.json");
    let mut failures = Vec::new();
    let mut checked = 0usize;
    for case in cases {
        let name = case["name"].as_str().expect("case name");
        let dp = load();
        let job = job_from_vector_in(fam, &case["job"]);
        dp.set_job(job.id, &job)
            .unwrap_or_else(|e| panic!("{name}: set_job: {e}"));
        for (i, dgram) in case["datagrams"]
            .as_array()
            .expect("datagrams")
            .iter()
            .enumerate()
        {
            let src = fam.addr(dgram["src"].as_str().expect("src").parse().expect("src ip"));
            let payload = unhex(dgram["hex"].as_str().expect("hex"));
            let accept = dgram["accept"].as_bool().expect("accept");
            let why = dgram.get("why").and_then(|w| w.as_str());
            let reason = why.map(why_to_reason);
            if PHASE < 2 && reason == Some(DropReason::Retransmission) {
                continue; // phase-2 row: dedup needs the slots
            }
            let frame = Frame::udp(src, payload.clone()).build();
            let before = dp.stats().expect("stats");
            let (verdict, _out) = dp.test_run(&frame).expect("test_run");
            let got = deltas(&before, &dp.stats().expect("stats"));
            let ok = if accept {
                let accepted = got == vec![(Outcome::Accepted.label(), 1, payload.len() as u64)]
                    && verdict == accepted_verdict();
                let result = PHASE >= 2
                    && got == vec![(Outcome::Result.label(), 1, payload.len() as u64)]
                    && verdict == XDP_PASS;
                accepted || result
            } else {
                let reason = reason
                    .unwrap_or_else(|| panic!("{name}[{i}]: rejected datagram without `why`"));
                verdict == XDP_DROP && got == vec![(reason.label(), 1, payload.len() as u64)]
            };
            checked += 1;
            if !ok {
                failures.push(format!(
                    "{name}[{i}] accept={accept} why={why:?}: verdict {verdict}, counters {got:?}"
                ));
            }
        }
    }
    assert!(checked > 0);
    assert!(
        failures.is_empty(),
        "{} of {checked} datagrams failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
