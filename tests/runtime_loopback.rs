//! Runtime over loopback (no root needed): the socket backend end to end
//! through the real I/O driver (sockets, batched I/O, the progress thread):
//! allreduce, reduce and broadcast, non-blocking handles, float allreduce and
//! its overflow handling, a call that misses a participant, and striping.
//!
//! The protocol's logic (fragment boundaries and ops, ACK modes and
//! windows, the aggregator's slots, loss, reordering, duplication, timeouts
//! and who is named, overflow flags) is tested deterministically on the
//! state machine with a fake clock: `runtime::engine::tests`.

mod common_runtime;

use std::net::Ipv4Addr;
use std::time::Duration;

use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use aggbox::runtime::{CallOptions, CommError, Communicator, CommunicatorBuilder, Elements, Participant, Peer, Quantization, StarOrRing, StripedCommunicator};
use aggbox::node::tools::pattern_vector;

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

struct Job {
    agg: Communicator,
    workers: Vec<Communicator>,
}

fn job(n: usize, tweak: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Job {
    let (agg_port, peers) = common_runtime::loopback_job_addrs(n);
    let b = |me| tweak(Communicator::builder(7, peers.clone(), LO, agg_port, me).deadline(Duration::from_secs(10)));
    let agg = b(Participant::Aggregator).build().unwrap();
    let workers = (0..n).map(|r| b(Participant::Worker(r as u16)).build().unwrap()).collect();
    Job { agg, workers }
}

fn run_allreduce(j: &Job, op: Op, len: usize) {
    let comms: Vec<&Communicator> = std::iter::once(&j.agg).chain(&j.workers).collect();
    common_runtime::int_reduction(&comms, j.workers.len(), op, len, true);
}

/// One element, many fragments (beyond a window), and an op other than SUM.
#[test]
fn runtime_loopback_allreduce() {
    let j = job(3, |b| b);
    for len in [1usize, 100_000] {
        run_allreduce(&j, Op::Sum, len);
    }
    run_allreduce(&j, Op::Max, 1000);
}

#[test]
fn runtime_loopback_reduce_and_broadcast() {
    let j = job(3, |b| b);
    let len = 50_000;
    let want = common_runtime::expected(Op::Sum, 3, len);
    std::thread::scope(|s| {
        let a = s.spawn(|| {
            let mut out = vec![0i32; len];
            j.agg.reduce(&mut out, Op::Sum).unwrap();
            out
        });
        for (r, w) in j.workers.iter().enumerate() {
            s.spawn(move || {
                let mut v = pattern_vector(r as u16, len as u32);
                let before = v.clone();
                w.reduce(&mut v, Op::Sum).unwrap();
                assert_eq!(v, before, "a worker's buffer is its contribution");
            });
        }
        assert_eq!(a.join().unwrap(), want);
    });
    // Broadcast from a worker and from the aggregator, bytes of odd length.
    for root in [Participant::Worker(1), Participant::Aggregator] {
        let msg: Vec<u8> = (0..123_457u32).map(|i| (i * 7 + 3) as u8).collect();
        std::thread::scope(|s| {
            let all: Vec<&Communicator> = std::iter::once(&j.agg).chain(j.workers.iter()).collect();
            let hs: Vec<_> = all
                .into_iter()
                .map(|c| {
                    let msg = msg.clone();
                    s.spawn(move || {
                        let mut buf = if c.participant() == root { msg } else { vec![0u8; 123_457] };
                        c.broadcast(&mut buf, root).unwrap();
                        buf
                    })
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap(), msg);
            }
        });
    }
}

#[test]
fn runtime_loopback_nonblocking_and_f32() {
    let j = job(2, |b| b.quantization(Quantization::Adaptive));
    // Two allreduces in flight at once, completed in order.
    let len = 20_000;
    let w1: Vec<_> = (0..2).map(|r| j.workers[r].ireduce_i32(pattern_vector(r as u16, len as u32), Op::Sum, true, CallOptions::default())).collect();
    let w2: Vec<_> = (0..2).map(|r| j.workers[r].ireduce_i32(vec![r as i32 + 1; len], Op::Max, true, CallOptions::default())).collect();
    let a1 = j.agg.ireduce_i32(vec![0; len], Op::Sum, true, CallOptions::default());
    let a2 = j.agg.ireduce_i32(vec![0; len], Op::Max, true, CallOptions::default());
    // The second call is waited for first: by then the first is complete.
    let second = a2.wait().unwrap();
    assert!(a1.is_completed(), "issue order");
    let want = common_runtime::expected(Op::Sum, 2, len);
    assert_eq!(a1.wait().unwrap().values, want);
    assert_eq!(second.values, vec![2; len]);
    for w in w1 {
        assert_eq!(w.wait().unwrap().values, want);
    }
    for w in w2 {
        assert_eq!(w.wait().unwrap().values, vec![2; len]);
    }
    // Float allreduce through adaptive quantization vs f64.
    let xs: Vec<Vec<f32>> = (0..2).map(|r| (0..len).map(|i| (i as f32 * 0.37 + r as f32).sin() * 3.0).collect()).collect();
    let outs = std::thread::scope(|s| {
        let a = s.spawn(|| {
            let mut o = vec![0f32; len];
            j.agg.allreduce(&mut o, Op::Sum).unwrap();
            o
        });
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let x = xs[r].clone();
                let w = &j.workers[r];
                s.spawn(move || {
                    let mut x = x;
                    w.allreduce(&mut x, Op::Sum).unwrap();
                    x
                })
            })
            .collect();
        let mut v = vec![a.join().unwrap()];
        v.extend(hs.into_iter().map(|h| h.join().unwrap()));
        v
    });
    for o in &outs {
        assert_eq!(o, &outs[0], "everyone gets the same floats");
    }
    for i in 0..len {
        let exact = xs[0][i] as f64 + xs[1][i] as f64;
        assert!((outs[0][i] as f64 - exact).abs() < 1e-6, "{i}: {} vs {exact}", outs[0][i]);
    }
}


/// Worker r's input for call k: max |x| = (2 + 0.001 r) · magnitude.
fn float_input(r: usize, len: usize, k: usize, magnitude: f32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let v = if i == 0 { 2.0 + 0.001 * r as f32 } else { ((i * 31 + k) % 401) as f32 * 0.005 - 1.0 };
            v * magnitude
        })
        .collect()
}

/// Adaptive float allreduces through the I/O driver, 4 workers: one round
/// (the position advances by 1) when every worker guesses the agreed scale,
/// two when the magnitude jumps ×1000, then one again; striped, each stripe
/// alike. Every result is the two-round result bit for bit, on every
/// participant; the counters say which calls took one round.
#[test]
fn runtime_loopback_adaptive_allreduce_takes_one_round_when_the_scale_is_predictable() {
    let j = job(4, |b| b.quantization(Quantization::Adaptive));
    let comms: Vec<&Communicator> = std::iter::once(&j.agg).chain(&j.workers).collect();
    let len = 2000;
    for (k, magnitude, rounds, one_round, redone) in [(0, 1.0, 1, 1, 0), (1, 1.0, 1, 2, 0), (2, 1000.0, 2, 2, 1), (3, 1000.0, 1, 3, 1)] {
        let xs: Vec<Vec<f32>> = (0..4).map(|r| float_input(r, len, k, magnitude)).collect();
        let before: Vec<u32> = comms.iter().map(|c| c.position().0 .0).collect();
        let outs = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(p, c)| {
                    let mut x = if p == 0 { vec![0f32; len] } else { xs[p - 1].clone() };
                    s.spawn(move || {
                        c.allreduce(&mut x, Op::Sum).unwrap();
                        x
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        let want: Vec<u32> = common_runtime::two_round_result(&xs).iter().map(|f| f.to_bits()).collect();
        for (p, (c, o)) in comms.iter().zip(&outs).enumerate() {
            assert_eq!(o.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), want, "call {k}, participant {p}: the two-round result");
            assert_eq!(c.position().0 .0 - before[p], rounds, "call {k}, participant {p}: rounds");
            let st = c.stats();
            assert_eq!((st.float_calls_one_round, st.float_calls_redone), (one_round, redone), "call {k}, participant {p}");
        }
    }
    // Striped: each stripe guesses and checks on its own job.
    let parts = striped_job(4, 2, |b| b.quantization(Quantization::Adaptive));
    let len = 3000;
    for k in 0..2 {
        let xs: Vec<Vec<f32>> = (0..4).map(|r| float_input(r, len, k, 1.0)).collect();
        let outs = common_runtime::striped_allreduce_f32(&parts, &xs);
        let mut want = Vec::new();
        for r in aggbox::runtime::striped::stripe_bounds(len, 2) {
            let stripe: Vec<Vec<f32>> = xs.iter().map(|x| x[r.clone()].to_vec()).collect();
            want.extend(common_runtime::two_round_result(&stripe).iter().map(|f| f.to_bits()));
        }
        for (p, (c, o)) in parts.iter().zip(&outs).enumerate() {
            assert_eq!(o.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), want, "striped call {k}, participant {p}");
            let st = c.stats();
            assert_eq!(st.float_calls_one_round + st.float_calls_redone, 2 * (k as u64 + 1), "striped call {k}, participant {p}: every stripe guessed");
            if k == 1 {
                assert!(st.float_calls_one_round >= 2, "participant {p}: the second call took one round in each stripe: {st:?}");
            }
        }
    }
}

#[test]
fn runtime_loopback_fixed_scale_overflow_is_an_error() {
    let j = job(2, |b| b.quantization(Quantization::Fixed(1e8)));
    let len = 100;
    let errs = std::thread::scope(|s| {
        let a = s.spawn(|| j.agg.allreduce(&mut vec![0f32; len], Op::Sum));
        let hs: Vec<_> = j.workers.iter().map(|w| s.spawn(move || w.allreduce(&mut vec![15.0f32; len], Op::Sum))).collect();
        let mut v = vec![a.join().unwrap()];
        v.extend(hs.into_iter().map(|h| h.join().unwrap()));
        v
    });
    for e in errs {
        assert!(matches!(e, Err(CommError::Overflow { .. })), "{e:?}");
    }
    // FixedOrAdaptive reruns at a safe scale instead.
    let j = job(2, |b| b.quantization(Quantization::FixedOrAdaptive(1e8)));
    let outs = std::thread::scope(|s| {
        let a = s.spawn(|| {
            let mut o = vec![0f32; len];
            j.agg.allreduce(&mut o, Op::Sum).map(|_| o)
        });
        let hs: Vec<_> = j.workers.iter().map(|w| s.spawn(move || {
            let mut x = vec![15.0f32; len];
            w.allreduce(&mut x, Op::Sum).map(|_| x)
        })).collect();
        let mut v = vec![a.join().unwrap()];
        v.extend(hs.into_iter().map(|h| h.join().unwrap()));
        v
    });
    for o in outs {
        assert_eq!(o.unwrap(), vec![30.0f32; len]);
    }
}

/// The driver ends a call that misses a participant at its deadline with
/// the timeout error, and a replacement for the missing rank built at the
/// survivors' `position()` lines up with them. (Who is named, the partial
/// result, the exact deadline: `runtime::engine::tests`.)
#[test]
fn runtime_loopback_silent_peer_fails_at_deadline_then_next_call_works() {
    let j = job(3, |b| b);
    let len = 3000;
    let opts = CallOptions { deadline: Some(Duration::from_millis(800)), partial: false };
    // Rank 2 does not take part in this call.
    let (agg_res, w_res) = std::thread::scope(|s| {
        let a = s.spawn(|| j.agg.ireduce_i32(vec![0; len], Op::Sum, true, opts).wait());
        let hs: Vec<_> = (0..2).map(|r| {
            let w = &j.workers[r];
            s.spawn(move || w.ireduce_i32(pattern_vector(r as u16, len as u32), Op::Sum, true, opts).wait())
        }).collect();
        (a.join().unwrap(), hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>())
    });
    let e = agg_res.unwrap_err();
    let t = e.timeout().expect("timeout");
    assert!(t.missing.contains(&Peer::Rank(2)), "{e}");
    for r in w_res {
        let e = r.unwrap_err();
        assert_eq!(e.timeout().expect("timeout").missing, vec![Peer::Aggregator], "{e}");
    }
    // Rank 2 skipped a call: it is replaced by a new communicator that
    // resumes at the survivors' position (or it could call and fail itself).
    let (round, seq) = j.workers[0].position();
    let peers = j.workers.iter().map(|w| w.config().peers.clone()).next().unwrap();
    let cfg = j.workers[2].config().clone();
    let Job { agg, mut workers } = j;
    workers.pop();
    let r2 = CommunicatorBuilder::new(cfg.job, peers, cfg.aggregator, cfg.job_port, Participant::Worker(2)).resume(round, seq).build().unwrap();
    workers.push(r2);
    let j = Job { agg, workers };
    run_allreduce(&j, Op::Sum, len);
    run_allreduce(&j, Op::Sum, 10);
}


/// A striped job over loopback: `stripes` jobs of `n` workers each (the
/// socket backend), one striped communicator per participant.
fn striped_job(n: usize, stripes: usize, tweak: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Vec<StripedCommunicator> {
    let jobs: Vec<(u16, Vec<std::net::SocketAddrV4>)> = (0..stripes).map(|_| common_runtime::loopback_job_addrs(n)).collect();
    let me = |p: usize| if p == 0 { Participant::Aggregator } else { Participant::Worker(p as u16 - 1) };
    (0..=n)
        .map(|p| {
            let comms = jobs
                .iter()
                .enumerate()
                .map(|(t, (port, peers))| {
                    tweak(Communicator::builder(20 + t as u16, peers.clone(), LO, *port, me(p)).deadline(Duration::from_secs(10)))
                        .build()
                        .unwrap()
                })
                .collect();
            StripedCommunicator::new(comms).unwrap()
        })
        .collect()
}

/// Every participant's int reduction of the pattern vectors over the stripes
/// at once, checked against the reference reducer.
fn striped_int_reduction(parts: &[StripedCommunicator], op: Op, len: usize, all: bool) {
    let refs: Vec<&StripedCommunicator> = parts.iter().collect();
    common_runtime::int_reduction(&refs, parts.len() - 1, op, len, all);
}

#[test]
fn runtime_loopback_striped_reductions_equal_the_reference() {
    let parts = striped_job(3, 3, |b| b.mtu(1500).quantization(Quantization::Adaptive));
    // Fewer elements than stripes, a stripe boundary inside a fragment, many fragments.
    for len in [1usize, 2, 5000, 100_001] {
        striped_int_reduction(&parts, Op::Sum, len, true);
        striped_int_reduction(&parts, Op::Max, len, true);
        striped_int_reduction(&parts, Op::Sum, len, false);
    }
    let before: Vec<u64> = parts.iter().map(|p| p.stats().bytes_delivered).collect();
    striped_int_reduction(&parts, Op::Sum, 30_000, true);
    for (p, b) in parts.iter().zip(before) {
        assert_eq!(p.stats().bytes_delivered - b, 30_000 * 4, "each result byte once, over all stripes");
    }
    // Every stripe carried its share.
    for p in &parts {
        assert!(p.stripes().iter().all(|c| c.stats().data_sent > 0));
    }
    // Broadcasts from a worker and from the aggregator, over the stripes.
    let refs: Vec<&StripedCommunicator> = parts.iter().collect();
    for (root, len) in [(Participant::Worker(1), 2usize), (Participant::Aggregator, 100_003), (Participant::Worker(0), 5000)] {
        common_runtime::broadcast(&refs, len, root);
    }
    // Floats: each stripe agrees on its own scale; everyone gets the same floats, close to the exact sum.
    let len = 50_000;
    let xs: Vec<Vec<f32>> = (0..3).map(|r| (0..len).map(|i| ((i as f32 * 0.37 + r as f32).sin() * 3.0) * if i < len / 2 { 1.0 } else { 1e-3 }).collect()).collect();
    let outs = common_runtime::striped_allreduce_f32(&parts, &xs);
    for o in &outs {
        assert_eq!(o, &outs[0], "everyone gets the same floats");
    }
    // The last stripe holds only small values: its own scale is 1000 times finer.
    let last = aggbox::runtime::striped::stripe_bounds(len, 3)[2].clone();
    assert!(last.start > len / 2);
    for i in 0..len {
        let exact: f64 = xs.iter().map(|x| x[i] as f64).sum();
        let tol = if last.contains(&i) { 1e-9 } else { 1e-6 };
        assert!((outs[0][i] as f64 - exact).abs() < tol, "{i}: {} vs {exact}", outs[0][i]);
    }
}

#[test]
fn runtime_loopback_striped_call_waits_for_every_stripe_and_reports_the_failure() {
    let parts = striped_job(2, 2, |b| b);
    let len = 4000;
    let opts = CallOptions { deadline: Some(Duration::from_millis(600)), partial: false };
    // Worker 1 takes part in stripe 0 only: stripe 1 times out, stripe 0 completes.
    let (outs, lone) = std::thread::scope(|s| {
        let hs: Vec<_> = parts[..2]
            .iter()
            .enumerate()
            .map(|(p, c)| {
                s.spawn(move || {
                    let mut v = if p == 0 { vec![0; len] } else { pattern_vector(0, len as u32) };
                    let r = c.allreduce_with(&mut v, Op::Sum, opts);
                    (r, v)
                })
            })
            .collect();
        let lone = s.spawn(|| {
            let mut v = pattern_vector(1, len as u32);
            let r = parts[2].stripes()[0].allreduce_with(&mut v[..len / 2], Op::Sum, opts);
            (r, v)
        });
        (hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(), lone.join().unwrap())
    });
    let want = common_runtime::expected(Op::Sum, 2, len);
    lone.0.expect("worker 1's stripe 0 completes");
    assert_eq!(&lone.1[..len / 2], &want[..len / 2]);
    for (p, (r, v)) in outs.iter().enumerate() {
        let e = r.as_ref().expect_err("stripe 1 lacks worker 1");
        let t = e.timeout().unwrap_or_else(|| panic!("participant {p}: {e}"));
        let missing = if p == 0 { Peer::Rank(1) } else { Peer::Aggregator };
        assert_eq!(t.missing, vec![missing], "participant {p}: {e}");
        assert_eq!(&v[..len / 2], &want[..len / 2], "participant {p}: stripe 0 holds the result");
    }
}

#[test]
fn runtime_loopback_striped_communicator_rejects_stripes_of_one_job_or_of_different_participants_but_not_one_id_at_two_nodes() {
    let (port, peers) = common_runtime::loopback_job_addrs(2);
    let (port2, peers2) = common_runtime::loopback_job_addrs(2);
    let b = |job, peers: &Vec<std::net::SocketAddrV4>, port, me| Communicator::builder(job, peers.clone(), LO, port, me).build().unwrap();
    let e = StripedCommunicator::new(vec![b(30, &peers, port, Participant::Worker(0)), b(30, &peers2, port2, Participant::Worker(0))]).unwrap_err();
    assert!(e.to_string().contains("job 30 at 127.0.0.1 is two stripes"), "{e}");
    // The same id at two nodes is two jobs (ids of jobs on demand are each
    // node's own).
    // (Fresh data addresses: a dropped worker lingers on its socket.)
    let (port3, peers3) = common_runtime::loopback_job_addrs(2);
    let (port4, peers4) = common_runtime::loopback_job_addrs(2);
    let other_node = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let at_other = Communicator::builder(30, peers4.clone(), other_node, port4, Participant::Worker(0)).build().unwrap();
    let two_nodes = StripedCommunicator::new(vec![b(30, &peers3, port3, Participant::Worker(0)), at_other]);
    assert!(two_nodes.is_ok(), "{:?}", two_nodes.err());
    let e = StripedCommunicator::new(vec![b(31, &peers, port, Participant::Worker(0)), b(32, &peers2, port2, Participant::Worker(1))]).unwrap_err();
    assert!(e.to_string().contains("stripes of one participant"), "{e}");
    assert!(StripedCommunicator::new(vec![]).is_err());
}

/// The soak's finding (issue #42): a worker that exits right after its last
/// call sends its ACK of the last RESULT once; lost, the aggregator
/// application, whose call waits for every worker's ACK of every RESULT,
/// resent the RESULT to a closed socket and timed out although the worker
/// had completed the call. A closing worker now keeps its socket while its
/// peer still resends (`Driver::linger`). Here a scripted aggregator takes
/// the worker's contribution, sends its RESULT, ignores the ACKs that come
/// before the worker is dropped (as lost), resends the RESULT after the
/// drop began, and must get an ACK of it; without the linger the socket is
/// closed and nothing answers.
#[test]
fn a_closing_worker_acknowledges_a_result_resent_after_its_last_ack_was_lost() {
    use aggbox::wire::proto::{self, AckKind, AckMessage, AggHeader, MessageKind};
    let agg = std::net::UdpSocket::bind((LO, 0)).unwrap();
    let agg_addr = match agg.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let me = {
        let s = std::net::UdpSocket::bind((LO, 0)).unwrap();
        match s.local_addr().unwrap() {
            std::net::SocketAddr::V4(a) => a,
            _ => unreachable!(),
        }
    };
    // The kernel backend's worker: contributions to the job port, RESULTs
    // and ACKs from and to the result port (one scripted socket for both).
    let worker = Communicator::builder(7, vec![me], LO, agg_addr.port(), Participant::Worker(0))
        .backend(aggbox::runtime::BackendKind::Kernel)
        .result_port(agg_addr.port())
        .kernel_result_group(true)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let call = std::thread::spawn(move || {
        let mut v = vec![5i32; 3];
        worker.allreduce(&mut v, Op::Sum).expect("the scripted aggregator answers");
        assert_eq!(v, vec![15, 15, 15], "the RESULT's values");
        worker
    });
    agg.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 2048];
    // The contribution.
    let (hdr, from) = loop {
        let (n, from) = agg.recv_from(&mut buf).unwrap();
        if proto::classify(&buf[..n]) == Some(MessageKind::Agg) {
            break (proto::decode_agg_header(&buf[..n]).unwrap(), from);
        }
    };
    let result_hdr = AggHeader { rank: aggbox::wire::abi::RESULT_RANK, flags: hdr.flags | aggbox::wire::abi::AGG_F_RESULT, ..hdr };
    let mut result = Vec::new();
    proto::encode_agg_into(&result_hdr, &[15, 15, 15], &mut result).unwrap();
    agg.send_to(&result, from).unwrap();
    let worker = call.join().expect("worker call");
    // Whatever the worker acknowledges until it closes is "lost"; then the
    // aggregator resends while the drop is under way.
    let closing = std::thread::spawn(move || drop(worker));
    std::thread::sleep(Duration::from_millis(10));
    agg.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    while agg.recv_from(&mut buf).is_ok() {}
    agg.send_to(&result, from).unwrap();
    agg.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let acked = loop {
        match agg.recv_from(&mut buf) {
            Ok((n, f)) if f == from => match AckMessage::decode(&buf[..n]) {
                Ok(a) if a.kind == AckKind::Aggregation && a.bitmap.get(hdr.seq) => break true,
                _ => continue,
            },
            Ok(_) => continue,
            Err(_) => break false,
        }
    };
    closing.join().unwrap();
    assert!(acked, "the closing worker acknowledged the resent RESULT");
}

/// One participant's calls through `&dyn Collective`, as a binding makes
/// them: an int32 MAX allreduce, a float32 mean, a broadcast of bytes from
/// worker 0, and a float MAX, which must be refused before anything is
/// sent. Returns what the calls produced.
fn calls_through_the_trait(c: &dyn Collective, len: usize) -> (Vec<i32>, Vec<f32>, Vec<u8>) {
    let me = match c.participant() {
        Participant::Worker(r) => r as i32 + 1,
        Participant::Aggregator => 0,
    };
    let mut ints: Vec<i32> = (0..len as i32).map(|i| if me == 0 { i32::MIN } else { i * me }).collect();
    let served = c.allreduce_elements(Elements::I32(&mut ints), Op::Max, CallOptions::default()).expect("int32 MAX");
    assert!(!served.clamped);
    let mut floats = vec![me as f32; len];
    c.allreduce_elements(Elements::F32(&mut floats), Op::Avg, CallOptions::default()).expect("float32 AVG");
    let mut bytes: Vec<u8> = if c.participant() == Participant::Worker(0) {
        (0..len).map(|i| (i * 7 + 1) as u8).collect()
    } else {
        vec![0; len]
    };
    c.broadcast_bytes(&mut bytes, Participant::Worker(0), CallOptions::default()).expect("broadcast");
    let mut refused = vec![1f32; 4];
    let e = c.allreduce_elements(Elements::F32(&mut refused), Op::Max, CallOptions::default()).unwrap_err();
    assert!(matches!(&e, CommError::Config(m) if m.contains("float32")), "{e}");
    (ints, floats, bytes)
}

/// Every algorithm answers the one interface alike: the star, the striped
/// star and the star through `StarOrRing` (no ring: every call on the star)
/// give the same results through `&dyn Collective`.
#[test]
fn runtime_loopback_every_algorithm_answers_the_one_interface() {
    let (n, len) = (3usize, 5000usize);
    let want_ints: Vec<i32> = (0..len as i32).map(|i| i * n as i32).collect();
    let want_mean = (1..=n).sum::<usize>() as f32 / n as f32;
    let want_bytes: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    let check = |what: &str, parts: Vec<Box<dyn Collective>>| {
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = parts.iter().map(|c| s.spawn(move || calls_through_the_trait(c.as_ref(), len))).collect();
            hs.into_iter().map(|h| h.join().expect(what)).collect()
        });
        for (p, (ints, floats, bytes)) in got.into_iter().enumerate() {
            assert_eq!(ints, want_ints, "{what}: participant {p}: int32 MAX");
            assert!(floats.iter().all(|x| (x - want_mean).abs() < 1e-4), "{what}: participant {p}: mean {:?}", &floats[..3]);
            assert_eq!(bytes, want_bytes, "{what}: participant {p}: broadcast");
        }
    };
    let j = job(n, |b| b);
    let star: Vec<Box<dyn Collective>> =
        std::iter::once(j.agg).chain(j.workers).map(|c| Box::new(c) as Box<dyn Collective>).collect();
    check("star", star);
    let striped: Vec<Box<dyn Collective>> =
        striped_job(n, 3, |b| b).into_iter().map(|c| Box::new(c) as Box<dyn Collective>).collect();
    check("striped star", striped);
    let j = job(n, |b| b);
    let auto: Vec<Box<dyn Collective>> = std::iter::once(j.agg)
        .chain(j.workers)
        .map(|c| Box::new(StarOrRing::new(Some(c), None).expect("star alone")) as Box<dyn Collective>)
        .collect();
    check("star or ring", auto);
}
