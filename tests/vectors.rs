//! Runs every case of the normative vector files through a slot-level model
//! of the aggregator built on `aggbox::wire::proto` and `aggbox::wire::reducer`.
//!
//! A missing or unreadable vector file fails the test: the vectors are the
//! contract, silently skipping them would hide a broken checkout.

#[path = "common/model.rs"]
mod model;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, Op};
use aggbox::wire::proto;
use model::{Aggregator, JobConfig, Verdict};
use serde::Deserialize;

const VECTORS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/spec/vectors");

#[derive(Debug, Deserialize)]
struct VectorFile {
    protocol: String,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    job: Job,
    op: String,
    round: u32,
    datagrams: Vec<Datagram>,
    results: Vec<Expected>,
}

#[derive(Debug, Deserialize)]
struct Job {
    id: u16,
    workers: u16,
    rank_ips: Vec<String>,
    #[serde(default)]
    weights: Option<Vec<i32>>,
    #[serde(default)]
    vector_len: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct Datagram {
    src: String,
    hex: String,
    accept: bool,
    #[serde(default)]
    why: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Expected {
    frag_off: u32,
    flags: u8,
    hex: String,
}

fn load(file: &str) -> VectorFile {
    let path = format!("{VECTORS_DIR}/{file}");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("vector file {path} is required and could not be read: {e}"));
    let vf: VectorFile = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("vector file {path} does not parse: {e}"));
    assert_eq!(vf.protocol, "AggBox v1", "{path}: unexpected protocol");
    assert!(!vf.cases.is_empty(), "{path} has no cases");
    vf
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd-length hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("bad hex digit"))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The vector files' `why` strings, mapped onto the kernel's drop reasons.
fn why_reason(why: &str) -> Option<DropReason> {
    let table = [
        ("retransmission", DropReason::Retransmission),
        ("rank out of range", DropReason::RankOutOfRange),
        ("unknown job", DropReason::UnknownJob),
        (
            "source address does not match rank",
            DropReason::SourceMismatch,
        ),
        ("zero count", DropReason::ZeroCount),
        ("reserved flag bit set", DropReason::ReservedFlag),
        ("invalid op", DropReason::InvalidOp),
        ("count smaller than datagram", DropReason::CountTooSmall),
        ("count larger than datagram", DropReason::CountTooLarge),
        ("truncated header", DropReason::TruncatedHeader),
    ];
    table
        .iter()
        .find(|(s, _)| *s == why)
        .map(|(_, r)| *r)
        // Future strings spelled like the metric labels still map.
        .or_else(|| {
            DropReason::ALL
                .iter()
                .copied()
                .find(|r| r.label() == why.replace(' ', "_"))
        })
}

/// Runs one case, returning every mismatch found (empty = pass).
fn run_case(case: &Case) -> Vec<String> {
    let mut errs = Vec::new();
    let Some(op) = Op::from_name(&case.op) else {
        return vec![format!("unknown op name {:?}", case.op)];
    };
    let workers = case.job.workers as usize;
    let job = JobConfig {
        id: case.job.id,
        workers: case.job.workers,
        rank_ips: case
            .job
            .rank_ips
            .iter()
            .map(|s| s.parse().expect("rank ip"))
            .collect(),
        weights: case.job.weights.clone().unwrap_or_else(|| vec![1; workers]),
        vector_len: case.job.vector_len.unwrap_or(0),
    };
    let mut agg = Aggregator::new(job);
    let mut results: Vec<Vec<u8>> = Vec::new();
    for (i, d) in case.datagrams.iter().enumerate() {
        let src: Ipv4Addr = d.src.parse().expect("src ip");
        let verdict = agg.receive(src, &unhex(&d.hex));
        match (&verdict, d.accept) {
            (Verdict::Accepted, true) => {}
            (Verdict::Completed(r), true) => results.push(r.clone()),
            (Verdict::Rejected(r), true) => errs.push(format!(
                "datagram {i}: expected accept, model rejected: {r:?}"
            )),
            (Verdict::Accepted | Verdict::Completed(_), false) => errs.push(format!(
                "datagram {i}: expected reject ({:?}), model accepted",
                d.why
            )),
            (Verdict::Rejected(r), false) => {
                let Some(why) = d.why.as_deref() else {
                    errs.push(format!("datagram {i}: reject without a why"));
                    continue;
                };
                match why_reason(why) {
                    None => errs.push(format!(
                        "datagram {i}: why {why:?} maps to no drop reason (extend why_reason)"
                    )),
                    Some(want) if r.drop_reason() != Some(want) => errs.push(format!(
                        "datagram {i}: why {why:?} ({want:?}) but model said {r:?}"
                    )),
                    Some(_) => {}
                }
            }
        }
    }

    // Results: compare by frag_off (the vector order is by frag_off; the
    // completion order follows datagram arrival).
    let mut got: BTreeMap<u32, (u8, Vec<u8>)> = BTreeMap::new();
    for r in &results {
        let hdr = match proto::decode_agg_header(r) {
            Ok(h) => h,
            Err(e) => {
                errs.push(format!("emitted RESULT does not decode: {e}"));
                continue;
            }
        };
        if hdr.job != case.job.id
            || hdr.rank != abi::RESULT_RANK
            || hdr.round != aggbox::wire::abi::Round(case.round)
            || hdr.op != op
        {
            errs.push(format!("RESULT header fields wrong: {hdr:?}"));
        }
        if got
            .insert(hdr.frag_off, (hdr.flags, r[abi::AGG_HDR_LEN..].to_vec()))
            .is_some()
        {
            errs.push(format!("slot frag_off {} completed twice", hdr.frag_off));
        }
    }
    if got.len() != case.results.len() {
        errs.push(format!(
            "{} results emitted, {} expected",
            got.len(),
            case.results.len()
        ));
    }
    for e in &case.results {
        match got.get(&e.frag_off) {
            None => errs.push(format!("no RESULT for frag_off {}", e.frag_off)),
            Some((flags, payload)) => {
                if *flags != e.flags {
                    errs.push(format!(
                        "frag_off {}: flags {flags:#04x}, expected {:#04x}",
                        e.frag_off, e.flags
                    ));
                }
                let want = unhex(&e.hex);
                if *payload != want {
                    let first = payload
                        .chunks(4)
                        .zip(want.chunks(4))
                        .position(|(a, b)| a != b);
                    errs.push(format!(
                        "frag_off {}: payload differs ({} vs {} bytes, first differing element {:?}: got {} want {})",
                        e.frag_off,
                        payload.len(),
                        want.len(),
                        first,
                        first.map(|k| hex(&payload[4 * k..4 * k + 4])).unwrap_or_default(),
                        first.map(|k| hex(&want[4 * k..4 * k + 4])).unwrap_or_default(),
                    ));
                }
            }
        }
    }
    errs
}

fn run_file(file: &str) {
    let vf = load(file);
    let mut failures = Vec::new();
    for case in &vf.cases {
        let errs = run_case(case);
        if !errs.is_empty() {
            failures.push(format!("case {}:\n    {}", case.name, errs.join("\n    ")));
        }
    }
    assert!(
        failures.is_empty(),
        "{file}: {} of {} cases failed:\n{}",
        failures.len(),
        vf.cases.len(),
        failures.join("\n")
    );
    eprintln!("{file}: {} cases passed", vf.cases.len());
}

#[test]
fn aggregation_vectors_kernel_ops() {
    run_file("aggregation.json");
}

#[test]
fn aggregation_vectors_userspace_ops() {
    run_file("aggregation-userspace.json");
}

/// Every `why` in the files maps onto a drop reason, and every rejected
/// datagram has one: an unmapped string would otherwise only show up when a
/// case happens to reject differently.
#[test]
fn every_why_string_is_known() {
    for file in ["aggregation.json", "aggregation-userspace.json"] {
        for case in load(file).cases {
            for (i, d) in case.datagrams.iter().enumerate() {
                if d.accept {
                    assert!(
                        d.why.is_none(),
                        "{file} {} datagram {i}: accepted with a why",
                        case.name
                    );
                } else {
                    let why = d.why.as_deref().unwrap_or_else(|| {
                        panic!("{file} {} datagram {i}: reject without why", case.name)
                    });
                    assert!(why_reason(why).is_some(), "{file}: unknown why {why:?}");
                }
            }
        }
    }
}

/// Decode errors found in the files carry exactly the drop reason the `why`
/// names, independent of the model's ordering of the later checks.
#[test]
fn decode_errors_match_why() {
    for file in ["aggregation.json", "aggregation-userspace.json"] {
        for case in load(file).cases {
            for (i, d) in case.datagrams.iter().enumerate() {
                let want = d.why.as_deref().and_then(why_reason);
                match proto::decode_agg_header(&unhex(&d.hex)) {
                    Ok(_) => {
                        if let Some(w) = want {
                            assert!(
                                !matches!(
                                    w,
                                    DropReason::TruncatedHeader
                                        | DropReason::InvalidOp
                                        | DropReason::ReservedFlag
                                        | DropReason::ZeroCount
                                        | DropReason::CountTooLarge
                                        | DropReason::CountTooSmall
                                ),
                                "{file} {} datagram {i}: decodes but why is {w:?}",
                                case.name
                            );
                        }
                    }
                    Err(e) => assert_eq!(
                        e.drop_reason(),
                        want,
                        "{file} {} datagram {i}: {e}",
                        case.name
                    ),
                }
            }
        }
    }
}
