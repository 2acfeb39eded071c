//! Jumbo-frame aggregation over real UDP in a network-namespace testbed
//! (docs/JUMBO.md): every veth at MTU 9000, then at 65535 (the largest veth
//! and IPv4 MTU), AggBox attached in native mode to the aggregator's `eth0`
//! with `node::attach` (the `xdp.frags` chain: frames larger than a page
//! reach it as multi-buffer xdp_buffs), 4 sender hosts, one rank each,
//! sending with `aggbox::node::tools::contribute` at `elements_per_datagram(mtu)`
//! elements per datagram. Every RESULT element is compared with the
//! reference reducer. Datagrams the veth rings drop under the 4-sender burst
//! are resent (the aggregator deduplicates them), so the check is exact
//! without timing assumptions.
//!
//! Needs root: `sudo -E cargo test --test netns_jumbo`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_netns;

use std::net::{SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::config::Config;
use aggbox::kernel::xdp::{Chain, XdpMode};
use aggbox::node;
use aggbox::wire::proto::{self, AggHeader};
use crate::testbed::{Testbed, TestbedConfig};
use aggbox::node::tools::{self, collect_results, expected_pattern_result, pattern_vector, Contribution};
use aggbox::wire::proto::elements_per_datagram;
use common_netns::*;

const JOB: u16 = 9;
const PORT: u16 = 7400;
const RESULT_PORT: u16 = 7401;
const SENDERS: usize = 4;

/// Resend fragment `index` of rank `rank`'s pattern vector (same seq as
/// `tools::contribute` gave it: a retransmission).
fn resend(socket: &UdpSocket, to: SocketAddrV4, rank: u16, op: Op, per: usize, elements: u32, index: usize) {
    let values = pattern_vector(rank, elements);
    let chunks = values.len().div_ceil(per);
    let start = index * per;
    let chunk = &values[start..(start + per).min(values.len())];
    let hdr = AggHeader {
        job: JOB,
        rank,
        seq: 1 + index as u32,
        round: aggbox::wire::abi::Round(1),
        frag_off: start as u32,
        op,
        flags: if index + 1 == chunks { abi::AGG_F_LAST_FRAGMENT } else { 0 },
        count: chunk.len() as u16,
    };
    let mut buf = Vec::new();
    proto::encode_agg_into(&hdr, chunk, &mut buf).expect("encode");
    socket.send_to(&buf, to).expect("resend");
}

/// One reduction of `elements` elements per rank at interface MTU `mtu`;
/// returns (fragments, seconds from first send to last RESULT).
fn reduce_at_mtu(mtu: u32, elements: u32, op: Op) -> (usize, f64) {
    reduce_at_mtu_with(mtu, elements, op, true)
}

/// `strict`: no drop but retransmissions allowed (tests); the measurement
/// lets senders run ahead of the slot pool (pool_full drops, resent).
fn reduce_at_mtu_with(mtu: u32, elements: u32, op: Op, strict: bool) -> (usize, f64) {
    let chain = Chain::detect().expect("chain");
    reduce_with_chain(mtu, elements, op, strict, XdpMode::Native, chain)
}

/// [`reduce_at_mtu_with`] with the XDP mode and chain given.
fn reduce_with_chain(mtu: u32, elements: u32, op: Op, strict: bool, mode: XdpMode, chain: Chain) -> (usize, f64) {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: 1 + SENDERS, mtu, static_neigh: true, ..Default::default() })
        .unwrap_or_else(|e| panic!("building the testbed: {e}"));
    let pins = Bpffs::mount(&format!("jumbo{mtu}")).expect("mounting a private bpffs");
    let workers: Vec<_> = (1..=SENDERS).map(|h| tb.host(h).addr).collect();
    let text = config_text(&[JobSpec {
        id: JOB,
        port: PORT,
        result_port: RESULT_PORT,
        workers,
        weights: vec![],
        vector_len: Some(elements),
    }]);
    let per = elements_per_datagram(mtu as usize);
    let fragments = (elements as usize).div_ceil(per);
    let senders: Vec<UdpSocket> = (1..=SENDERS).map(|h| bind_in(&tb, h, tb.host(h).addr)).collect();
    let rx = result_socket_in(&tb.host(0).netns, RESULT_PORT);
    let to = SocketAddrV4::new(tb.host(0).addr, PORT);
    let expected = expected_pattern_result(op, SENDERS as u16, elements, &[]).expect("reducer");
    let want = expected.ints().expect("int result").to_vec();
    let netns = tb.host(0).netns;

    let (values, elapsed, stats, fallback) = tb
        .in_host(0, || {
            let config = Config::parse(&text, "jumbo.toml").unwrap_or_else(|e| panic!("config: {e}\n{text}"));
            let att = node::attach_chain("eth0", &config, None, &pins.path, mode, chain)
                .unwrap_or_else(|e| panic!("node::attach eth0 at MTU {mtu} ({mode:?}, {chain:?} chain): {e:#}"));
            assert_eq!(att.xdp.chain(), chain);
            assert_eq!(att.record.xdp_chain, chain.label());
            let want_mode = if mode == XdpMode::Native { "native" } else { "generic" };
            assert_eq!(att.record.xdp_mode, want_mode, "attached in {mode:?} mode");
            for w in &att.warnings {
                eprintln!("attach warning: {w}");
            }
            let _stats_fd = aggbox::node::metrics::enable_bpf_stats().expect("bpf stats");
            // Kernels without multi-buffer AF_XDP (before 6.6): the XDP
            // program keeps frames longer than one UMEM frame on the
            // fallback (xsk_limits): passed and counted, never redirected.
            let fallback = !op.runs_in_kernel()
                && !att.userspace.as_ref().expect("user-space path started").multi_buffer();
            if !op.runs_in_kernel() {
                eprintln!(
                    "MTU {mtu}: AF_XDP sockets {}",
                    if fallback {
                        "WITHOUT multi-buffer (kernel < 6.6): jumbo frames stay on the userspace_unavailable fallback"
                    } else {
                        "with multi-buffer (XDP_USE_SG): jumbo frames are redirected and reassembled"
                    }
                );
            }
            if fallback {
                // One datagram at a time (no veth ring overflow): each must
                // be counted by the fallback outcome.
                for f in 0..fragments {
                    for (rank, socket) in senders.iter().enumerate() {
                        resend(socket, to, rank as u16, op, per, elements, f);
                    }
                }
                let want = (fragments * SENDERS) as u64;
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut stats = att.xdp.stats().expect("stats");
                while stats.outcome(Outcome::UserspaceUnavailable).packets < want && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                    stats = att.xdp.stats().expect("stats");
                }
                att.detach().unwrap_or_else(|e| panic!("detach: {e:#}"));
                return (Vec::new(), 0.0, stats, true);
            }
            let start = Instant::now();
            std::thread::scope(|scope| {
                for (rank, socket) in senders.iter().enumerate() {
                    scope.spawn(move || {
                        let c = Contribution { job: JOB, rank: rank as u16, round: aggbox::wire::abi::Round(1), op, first_seq: 1, per_datagram: per };
                        tools::contribute(socket, to, &c, &pattern_vector(rank as u16, elements)).expect("contribute")
                    });
                }
            });
            let mut values = vec![0i32; elements as usize];
            let mut covered = vec![false; elements as usize];
            let mut elapsed = 0.0;
            for attempt in 0..20 {
                let got = collect_results(&rx, JOB, elements, Duration::from_millis(if attempt == 0 { 5000 } else { 1000 }))
                    .expect("collect");
                let mut missing = vec![false; elements as usize];
                for &(a, b) in &got.missing {
                    missing[a as usize..b as usize].iter_mut().for_each(|m| *m = true);
                }
                for i in 0..elements as usize {
                    if !missing[i] {
                        values[i] = got.values[i];
                        covered[i] = true;
                    }
                }
                if covered.iter().all(|&c| c) {
                    elapsed = start.elapsed().as_secs_f64();
                    break;
                }
                // Resend every fragment that has no RESULT yet, from every rank.
                let lost: Vec<usize> = (0..fragments).filter(|f| !covered[f * per]).collect();
                eprintln!("MTU {mtu}: attempt {attempt}: {} fragments without RESULT, resending", lost.len());
                for f in lost {
                    for (rank, socket) in senders.iter().enumerate() {
                        resend(socket, to, rank as u16, op, per, elements, f);
                    }
                }
            }
            let stats = att.xdp.stats().expect("stats");
            let programs = att.xdp.programs().expect("programs");
            let contributions = stats.outcome(Outcome::Accepted).packets + stats.outcome(Outcome::Result).packets;
            let mut chain_ns = 0;
            for p in &programs {
                chain_ns += p.run_time_ns;
                eprintln!(
                    "{:<14} verifier processed {:>6} insns, {:>7} runs, {:>8.0} ns/run",
                    p.name,
                    p.verified_insns,
                    p.run_cnt,
                    p.run_time_ns as f64 / p.run_cnt.max(1) as f64
                );
            }
            eprintln!(
                "MTU {mtu}: XDP chain time per aggregated contribution {:.0} ns ({:.2} ns/element)",
                chain_ns as f64 / contributions.max(1) as f64,
                chain_ns as f64 / (contributions.max(1) as f64 * per as f64)
            );
            assert_eq!(att.xdp.slots_in_use(), 0, "no slot left");
            assert_eq!(att.xdp.blocks_in_use().unwrap(), 0, "no block left");
            att.detach().unwrap_or_else(|e| panic!("detach: {e:#}"));
            (values, elapsed, stats, false)
        })
        .unwrap_or_else(|e| panic!("entering host 0: {e}"));

    assert!(!has_xdp(&netns, "eth0"), "detached");
    if fallback {
        eprintln!("MTU {mtu}: fallback: {stats:?}");
        assert_eq!(stats.outcome(Outcome::ToUserspace).packets, 0, "nothing redirected: {stats:?}");
        assert_eq!(
            stats.outcome(Outcome::UserspaceUnavailable).packets,
            (fragments * SENDERS) as u64,
            "every jumbo datagram counted as userspace_unavailable: {stats:?}"
        );
        for reason in DropReason::ALL {
            assert_eq!(stats.drop(reason).packets, 0, "{reason:?}: {stats:?}");
        }
        return (fragments, 0.0);
    }
    eprintln!(
        "MTU {mtu}: {fragments} fragments of {per} elements, accepted {}, result {}, retransmission {}",
        stats.outcome(Outcome::Accepted).packets,
        stats.outcome(Outcome::Result).packets,
        stats.drop(DropReason::Retransmission).packets
    );
    eprintln!(
        "MTU {mtu}: {elements} elements x {SENDERS} senders in {elapsed:.3} s: {:.1} M elements/s reduced ({:.1} M contributed/s); drops {:?}",
        elements as f64 / elapsed / 1e6,
        elements as f64 * SENDERS as f64 / elapsed / 1e6,
        stats.drops.iter().filter(|(_, c)| c.packets > 0).map(|(l, c)| (*l, c.packets)).collect::<Vec<_>>()
    );
    if op.runs_in_kernel() {
        assert_eq!(stats.outcome(Outcome::Result).packets, fragments as u64, "one RESULT per fragment");
        assert_eq!(
            stats.outcome(Outcome::Accepted).packets + stats.outcome(Outcome::Result).packets,
            (fragments * SENDERS) as u64,
            "every contribution counted once"
        );
    } else {
        // Handed over through AF_XDP (multi-buffer: XDP_USE_SG).
        assert!(
            stats.outcome(Outcome::ToUserspace).packets >= (fragments * SENDERS) as u64,
            "every contribution handed to user space: {stats:?}"
        );
    }
    for reason in DropReason::ALL {
        if reason != DropReason::Retransmission && (strict || reason != DropReason::SlotPoolFull) {
            assert_eq!(stats.drop(reason).packets, 0, "{reason:?}: {stats:?}");
        }
    }
    if let Some(first) = values.iter().zip(&want).position(|(g, w)| g != w) {
        panic!("MTU {mtu}: element {first} is {}, reducer says {}", values[first], want[first]);
    }
    (fragments, elapsed)
}

#[test]
fn mtu_9000_four_senders_exact() {
    let (fragments, secs) = reduce_at_mtu(9000, 200 * 2237, Op::Sum);
    eprintln!("MTU 9000: {fragments} fragments in {secs:.3} s");
}

#[test]
fn mtu_65535_multibuffer_four_senders_exact() {
    // 16370 elements per datagram: 65,535-byte IPv4 datagrams, 17 pages.
    let (fragments, secs) = reduce_at_mtu(65535, 30 * 16370 + 1000, Op::Max);
    eprintln!("MTU 65535: {fragments} fragments in {secs:.3} s");
}

#[test]
fn mtu_16000_avg_four_senders_exact() {
    let (fragments, secs) = reduce_at_mtu(16000, 40 * elements_per_datagram(16000) as u32, Op::Avg);
    eprintln!("MTU 16000: {fragments} fragments in {secs:.3} s");
}

#[test]
fn mtu_9000_userspace_op_through_multibuffer_af_xdp() {
    // PROD runs on the user-space path: 9 KB frames reach it through
    // AF_XDP copy mode in 2 KB UMEM frames (XDP_USE_SG, reassembled).
    let (fragments, secs) = reduce_at_mtu(9000, 20 * 2237, Op::Prod);
    eprintln!("MTU 9000 PROD (user space): {fragments} fragments in {secs:.3} s");
}

// ---- The linear chain (kernels without multi-buffer XDP, docs/JUMBO.md):
// this kernel has both chains, so these attach it explicitly. ----

#[test]
fn linear_chain_native_mtu_1500_four_senders_exact() {
    let (fragments, secs) =
        reduce_with_chain(1500, 300 * elements_per_datagram(1500) as u32 + 17, Op::Sum, true, XdpMode::Native, Chain::Linear);
    eprintln!("MTU 1500, linear chain (native): {fragments} fragments in {secs:.3} s");
}

#[test]
fn linear_chain_generic_mtu_9000_four_senders_exact() {
    // Generic XDP hands a non-frags program the skb linearised: a 9000-byte
    // frame is one buffer, 9 chunks, 9 tail calls per stage.
    let (fragments, secs) = reduce_with_chain(9000, 60 * 2237, Op::Avg, true, XdpMode::Generic, Chain::Linear);
    eprintln!("MTU 9000, linear chain (generic): {fragments} fragments in {secs:.3} s");
}

/// An aggregator host and one worker at `mtu`, a bpffs for the pins, and the
/// node config of one job of that worker.
fn one_worker_bed(mtu: u32, tag: &str) -> (Testbed, Bpffs, String) {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: 2, mtu, static_neigh: true, ..Default::default() })
        .unwrap_or_else(|e| panic!("building the testbed: {e}"));
    let pins = Bpffs::mount(tag).expect("mounting a private bpffs");
    let text = config_text(&[JobSpec {
        id: JOB,
        port: PORT,
        result_port: RESULT_PORT,
        workers: vec![tb.host(1).addr],
        weights: vec![],
        vector_len: None,
    }]);
    (tb, pins, text)
}

#[test]
fn linear_chain_refuses_an_mtu_it_cannot_aggregate() {
    let mtu = Chain::Linear.max_mtu() + 1;
    let (tb, pins, text) = one_worker_bed(mtu, "linearmtu");
    let netns = tb.host(0).netns;
    let err = tb
        .in_host(0, || {
            let config = Config::parse(&text, "linear.toml").unwrap();
            node::attach_chain("eth0", &config, None, &pins.path, XdpMode::Generic, Chain::Linear)
                .map(|_| ())
                .unwrap_err()
        })
        .unwrap();
    let msg = format!("{err:#}");
    assert!(msg.contains(&format!("MTU {mtu}")) && msg.contains("lower the MTU") && msg.contains("5.18"), "{msg}");
    assert!(!has_xdp(&netns, "eth0"), "the interface is left as it was");
    assert!(!pins.path.join("eth0").exists(), "nothing pinned");
}

#[test]
fn linear_chain_native_above_a_page_falls_back_to_generic() {
    // veth refuses a non-frags program in native mode when the peer's MTU
    // is above a page; attach then runs the linear chain in generic mode,
    // with a warning, as for any driver without native XDP.
    let (tb, pins, text) = one_worker_bed(9000, "linear9000");
    let netns = tb.host(0).netns;
    let (mode, warnings) = tb
        .in_host(0, || {
            let config = Config::parse(&text, "linear.toml").unwrap();
            let att = node::attach_chain("eth0", &config, None, &pins.path, XdpMode::Native, Chain::Linear)
                .unwrap_or_else(|e| panic!("attach: {e:#}"));
            let got = (att.record.xdp_mode.clone(), att.warnings.clone());
            att.detach().unwrap_or_else(|e| panic!("detach: {e:#}"));
            got
        })
        .unwrap();
    assert_eq!(mode, "generic", "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains("generic mode")), "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains("XDP chain: linear")), "{warnings:?}");
    assert!(!has_xdp(&netns, "eth0"), "detached");
}
