//! The hand-off decision of the XDP program through BPF_PROG_TEST_RUN, with
//! an AF_XDP socket registered in the `xsks` map (bound to a veth queue in a
//! private testbed namespace): the verdict is XDP_REDIRECT exactly when a
//! socket is registered for the frame's RX queue (0 in BPF_PROG_TEST_RUN),
//! counted as `to_userspace` and in `handoff_stats` by reason; without a
//! socket the kernel's fallback (pass / drop) is kept.
//!
//! Needs root: `sudo -E cargo test --test bpf_handoff`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod bpf_common;

use std::fs::File;
use std::net::Ipv4Addr;

use aggbox::wire::abi::{self, DropReason, HandoffReason, Outcome, SlotKey};
use aggbox::kernel::xdp::{XdpPlane, XdpJob};
use crate::testbed::{Testbed, TestbedConfig};
use aggbox::kernel::xsk::{XskConfig, XskSocket};
use bpf_common::*;
use nix::sched::{setns, CloneFlags};

const XDP_REDIRECT: u32 = 4;
const R0: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 11);
const R1: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 12);

fn job(id: u16, slots: u32, flags: u32) -> XdpJob {
    job_in(Family::V4, id, slots, flags)
}

fn job_in(fam: Family, id: u16, slots: u32, flags: u32) -> XdpJob {
    XdpJob {
        id,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: vec![fam.addr(R0), fam.addr(R1)],
        weights: vec![],
        vector_len: 0,
        slots,
        flags,
        result_group: None,
        window: 0,
        frag_elems: 0,
    }
}

/// A testbed host whose eth0 queue 0 carries an AF_XDP socket; the calling
/// thread joins its namespace.
fn with_socket() -> (Testbed, XskSocket) {
    require_root();
    let tb = Testbed::up(TestbedConfig {
        hosts: 1,
        ..Default::default()
    })
    .expect("testbed");
    let ns = File::open(format!("/var/run/netns/{}", tb.host(0).netns)).expect("netns");
    setns(&ns, CloneFlags::CLONE_NEWNET).expect("setns (this thread only)");
    // SAFETY: NUL-terminated literal.
    let ifindex = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) };
    assert!(ifindex > 0);
    let cfg = XskConfig {
        frames: 64,
        frame_size: 2048,
        rx_size: 64,
    };
    let sock = XskSocket::open(ifindex, 0, cfg).expect("AF_XDP socket on eth0 queue 0");
    (tb, sock)
}

fn run(dp: &XdpPlane, src: impl Into<std::net::IpAddr>, a: &Agg) -> (u32, Vec<(&'static str, u64, u64)>) {
    let payload = a.bytes();
    let before = dp.stats().unwrap();
    let (verdict, _) = dp.test_run(&Frame::udp(src, payload).build()).expect("test_run");
    (verdict, deltas(&before, &dp.stats().unwrap()))
}

fn to_us(a: &Agg) -> Vec<(&'static str, u64, u64)> {
    vec![(Outcome::ToUserspace.label(), 1, a.bytes().len() as u64)]
}

fn handoffs(dp: &XdpPlane, reason: HandoffReason) -> u64 {
    dp.handoff_stats().unwrap()[reason.label()].packets
}

#[test]
fn ops_float_and_userspace_only_are_redirected() {
    ops_float_and_userspace_only_are_redirected_in(Family::V4);
}

/// The same hand-off for IPv6 contributions of a job of IPv6 ranks.
#[test]
fn ops_float_and_userspace_only_are_redirected_over_ipv6() {
    ops_float_and_userspace_only_are_redirected_in(Family::V6);
}

fn ops_float_and_userspace_only_are_redirected_in(fam: Family) {
    let (_tb, sock) = with_socket();
    let dp = load();
    dp.set_job(1, &job_in(fam, 1, 0, 0)).unwrap();
    dp.set_job(2, &job_in(fam, 2, 0, abi::JOB_F_USERSPACE_ONLY)).unwrap();

    let prod = Agg::new(1, 0, abi::Op::Prod as u8, vec![1, 2, 3]);
    let mut float = Agg::new(1, 0, abi::Op::Sum as u8, vec![0x3f80_0000]);
    float.flags = abi::AGG_F_FLOAT32;
    let us_only = Agg::new(2, 0, abi::Op::Sum as u8, vec![5]);

    // No socket registered: today's behaviour, counted apart.
    for a in [&prod, &float, &us_only] {
        let (v, d) = run(&dp, fam.addr(R0), a);
        assert_eq!(v, XDP_PASS);
        assert_eq!(d, vec![(Outcome::UserspaceUnavailable.label(), 1, a.bytes().len() as u64)]);
    }
    assert_eq!(dp.stats().unwrap().outcome(Outcome::ToUserspace).packets, 0);

    dp.register_xsk(0, sock.fd()).expect("register the socket");
    for (a, reason) in [
        (&prod, HandoffReason::Op),
        (&float, HandoffReason::Float32),
        (&us_only, HandoffReason::UserspaceOnly),
    ] {
        let (v, d) = run(&dp, fam.addr(R0), a);
        assert_eq!(v, XDP_REDIRECT, "{reason:?}");
        assert_eq!(d, to_us(a), "{reason:?}");
        assert_eq!(handoffs(&dp, reason), 1, "{reason:?}");
    }
    // Invalid datagrams are still dropped by the kernel, never handed over.
    let (v, d) = run(&dp, fam.addr(R1), &prod);
    assert_eq!(v, XDP_DROP);
    assert_eq!(d[0].0, DropReason::SourceMismatch.label());
    // A kernel op of a normal job stays in the kernel.
    let (v, d) = run(&dp, fam.addr(R0), &Agg::new(1, 0, abi::Op::Sum as u8, vec![5]));
    assert_eq!(v, XDP_DROP);
    assert_eq!(d[0].0, Outcome::Accepted.label());

    dp.unregister_xsk(0).unwrap();
    let (v, _) = run(&dp, fam.addr(R0), &prod);
    assert_eq!(v, XDP_PASS, "socket gone: back to the fallback");

    // Per job: only the redirected datagrams count as handed to user space
    // (the passed ones without a socket are global only).
    let j1 = dp.job_stats(1).unwrap().expect("job 1 counters");
    assert_eq!((j1.handed_to_userspace, j1.dropped, j1.accepted), (2, 1, 1), "{j1:?}");
    let sum = |v: &[&Agg]| v.iter().map(|a| a.bytes().len() as u64).sum::<u64>();
    assert_eq!(j1.bytes, sum(&[&prod, &float, &prod]) + 28, "{j1:?}");
    let j2 = dp.job_stats(2).unwrap().expect("job 2 counters");
    assert_eq!((j2.handed_to_userspace, j2.datagrams(), j2.bytes), (1, 1, sum(&[&us_only])), "{j2:?}");
}

#[test]
fn xsk_limit_keeps_longer_frames_on_the_fallback() {
    // Sockets without multi-buffer AF_XDP (kernels before 6.6) would lose a
    // frame longer than one UMEM frame in the redirect: with `xsk_limits`
    // set, such a frame keeps the fallback as if no socket were registered.
    let (_tb, sock) = with_socket();
    let dp = load();
    dp.set_job(1, &job(1, 0, 0)).unwrap();
    dp.register_xsk(0, sock.fd()).unwrap();
    let prod = Agg::new(1, 0, abi::Op::Prod as u8, vec![1, 2, 3]);
    let len = Frame::udp(R0, prod.bytes()).build().len() as u32;

    for (limit, redirected) in [(0, true), (len, true), (len - 1, false), (1, false), (0, true)] {
        dp.set_xsk_limit(limit).unwrap();
        let (v, d) = run(&dp, R0, &prod);
        if redirected {
            assert_eq!(v, XDP_REDIRECT, "limit {limit}, frame {len}");
            assert_eq!(d, to_us(&prod), "limit {limit}");
        } else {
            assert_eq!(v, XDP_PASS, "limit {limit}, frame {len}: not redirected");
            assert_eq!(
                d,
                vec![(Outcome::UserspaceUnavailable.label(), 1, prod.bytes().len() as u64)],
                "limit {limit}"
            );
        }
    }
    assert_eq!(handoffs(&dp, HandoffReason::Op), 3, "only the redirected ones count");
    // The socket's own limit: none with multi-buffer, else one UMEM frame.
    assert_eq!(sock.max_frame(), (!sock.multi_buffer()).then_some(2048 - abi::XSK_RX_HEADROOM));
    dp.unregister_xsk(0).unwrap();
}

#[test]
fn pool_exhaustion_hands_new_slots_over_and_keeps_fragments_whole() {
    let (_tb, sock) = with_socket();
    let dp = load();
    // The hash-map path's slot_owner records are what this test checks.
    dp.set_job(1, &job(1, 1, abi::JOB_F_NO_FAST)).unwrap();
    let frag = |rank: u16, frag_off: u32| {
        let mut a = Agg::new(1, rank, abi::Op::Sum as u8, vec![10 + rank as i32; 4]);
        a.frag_off = frag_off;
        a
    };
    let key = |frag_off: u32| SlotKey {
        job: 1,
        pad: 0,
        round: 1,
        frag_off,
    };
    let maps = dp.kernel_maps().unwrap();

    // Without a socket: the second slot is dropped (today's behaviour).
    let (v, d) = run(&dp, R0, &frag(0, 0));
    assert_eq!((v, d[0].0), (XDP_DROP, Outcome::Accepted.label()));
    assert_eq!(maps.slot_owner(&key(0)), Some(abi::OWNER_KERNEL));
    let (v, d) = run(&dp, R0, &frag(0, 4));
    assert_eq!((v, d[0].0), (XDP_DROP, DropReason::SlotPoolFull.label()));
    assert_eq!(maps.slot_owner(&key(4)), None, "no decision recorded without a socket");

    dp.register_xsk(0, sock.fd()).unwrap();
    // Pool full: the new slot goes to user space and is recorded so.
    let (v, d) = run(&dp, R0, &frag(0, 4));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(d, to_us(&frag(0, 4)));
    assert_eq!(maps.slot_owner(&key(4)), Some(abi::OWNER_USERSPACE));
    assert_eq!(handoffs(&dp, HandoffReason::PoolFull), 1);

    // The kernel slot completes in the kernel (RESULT), releasing its record.
    let (v, d) = run(&dp, R1, &frag(1, 0));
    assert_eq!((v, d[0].0), (XDP_PASS, Outcome::Result.label()));
    assert_eq!(maps.slot_owner(&key(0)), None);
    assert_eq!(dp.job_state(1).unwrap().unwrap().active_slots, 0);

    // Pool free again, but fragment 4 belongs to user space: it stays there.
    let (v, d) = run(&dp, R1, &frag(1, 4));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(d, to_us(&frag(1, 4)));
    assert_eq!(handoffs(&dp, HandoffReason::Owned), 1);
    assert_eq!(dp.slots_in_use(), 0, "no kernel slot for fragment 4");

    // User space completes it: completed marker, then the record goes; a
    // late retransmission is recognised by the kernel.
    maps.mark_completed(&key(4)).unwrap();
    maps.delete_slot_owner(&key(4));
    let (v, d) = run(&dp, R1, &frag(1, 4));
    assert_eq!((v, d[0].0), (XDP_DROP, DropReason::Retransmission.label()));

    // A new fragment gets a kernel slot again.
    let (v, d) = run(&dp, R0, &frag(0, 8));
    assert_eq!((v, d[0].0), (XDP_DROP, Outcome::Accepted.label()));
    assert_eq!(maps.slot_owner(&key(8)), Some(abi::OWNER_KERNEL));
}

#[test]
fn overload_flag_sends_new_slots_only_to_user_space() {
    let (_tb, sock) = with_socket();
    let dp = load();
    dp.set_job(1, &job(1, 100, 0)).unwrap();
    dp.register_xsk(0, sock.fd()).unwrap();
    let maps = dp.kernel_maps().unwrap();
    let frag = |rank: u16, frag_off: u32| {
        let mut a = Agg::new(1, rank, abi::Op::Max as u8, vec![rank as i32; 2]);
        a.frag_off = frag_off;
        a
    };

    let (v, _) = run(&dp, R0, &frag(0, 0));
    assert_eq!(v, XDP_DROP, "kernel slot");
    maps.set_job_handoff(
        1,
        &abi::JobHandoff {
            flags: abi::HANDOFF_F_OVERLOAD,
            ..Default::default()
        },
    )
    .unwrap();
    // New slot while in overload: user space.
    let (v, d) = run(&dp, R0, &frag(0, 2));
    assert_eq!((v, d), (XDP_REDIRECT, to_us(&frag(0, 2))));
    assert_eq!(handoffs(&dp, HandoffReason::Overload), 1);
    // The existing kernel slot still completes in the kernel.
    let (v, d) = run(&dp, R1, &frag(1, 0));
    assert_eq!((v, d[0].0), (XDP_PASS, Outcome::Result.label()));

    // Overload cleared: new slots are kernel slots again, owned ones stay.
    maps.set_job_handoff(1, &abi::JobHandoff::default()).unwrap();
    let (v, _) = run(&dp, R1, &frag(1, 2));
    assert_eq!(v, XDP_REDIRECT, "fragment 2 is user space's");
    let (v, d) = run(&dp, R0, &frag(0, 4));
    assert_eq!((v, d[0].0), (XDP_DROP, Outcome::Accepted.label()));

    // User space's newest completed round makes old rounds stale in the kernel.
    maps.set_job_handoff(
        1,
        &abi::JobHandoff {
            flags: 0,
            newest_round: 1 + abi::ROUND_WINDOW + 1,
            completed: 1,
            pad: 0,
        },
    )
    .unwrap();
    let (v, d) = run(&dp, R0, &frag(0, 6));
    assert_eq!((v, d[0].0), (XDP_DROP, DropReason::StaleRound.label()));
}

#[test]
fn removing_a_job_clears_its_ownership_records() {
    let (_tb, sock) = with_socket();
    let dp = load();
    // The hash-map path's slot_owner records are what this test checks.
    dp.set_job(1, &job(1, 1, abi::JOB_F_NO_FAST)).unwrap();
    dp.register_xsk(0, sock.fd()).unwrap();
    for frag_off in [0u32, 1, 2] {
        let mut a = Agg::new(1, 0, abi::Op::Sum as u8, vec![1]);
        a.frag_off = frag_off;
        run(&dp, R0, &a);
    }
    assert_eq!(dp.slot_owners_in_use(), 3);
    dp.remove_job(1).unwrap();
    assert_eq!(dp.slot_owners_in_use(), 0);
}
