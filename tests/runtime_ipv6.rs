//! The runtime over IPv6 loopback (no root needed): the socket backend
//! (user-space aggregator) end to end through the real I/O driver on `::1`:
//! int32 reductions equal the reference exactly, float32 allreduce stays
//! within its bound, loss injected by the receive-side test hook is
//! recovered by retransmission, and a datagram carries 5 elements fewer
//! than over IPv4 at the same MTU (the IPv6 header is 20 bytes longer).

mod common_runtime;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use aggbox::runtime::{CommError, Communicator, ImpairControl, Impairment, Participant, Quantization};
use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;

const LO6: IpAddr = IpAddr::V6(Ipv6Addr::LOCALHOST);
const WORKERS: usize = 3;

/// The aggregator's port and the workers' sockets on `::1`.
fn addrs(workers: usize) -> (u16, Vec<SocketAddr>) {
    let ports: Vec<u16> = (0..=workers).map(|_| common_runtime::free_loopback_port()).collect();
    (ports[0], ports[1..].iter().map(|&p| SocketAddr::new(LO6, p)).collect())
}

/// Aggregator first, then the workers; `impair` gives participant i's hook.
fn job(mtu: usize, quantization: Quantization, impair: impl Fn(usize) -> Option<Impairment>) -> Vec<Communicator> {
    let (agg_port, peers) = addrs(WORKERS);
    std::iter::once(Participant::Aggregator)
        .chain((0..WORKERS as u16).map(Participant::Worker))
        .enumerate()
        .map(|(i, me)| {
            let mut b = Communicator::builder(17, peers.clone(), LO6, agg_port, me)
                .mtu(mtu)
                .quantization(quantization)
                .deadline(Duration::from_secs(20));
            if let Some(imp) = impair(i) {
                b = b.impairment(imp);
            }
            b.build().expect("an IPv6 communicator")
        })
        .collect()
}

#[test]
fn runtime_ipv6_socket_backend_int32_is_exact_and_f32_within_its_bound() {
    let all = job(1500, Quantization::Adaptive, |_| None);
    assert_eq!(all[1].config().elements_per_fragment(), 357, "(1500 - 40 - 8 - 24) / 4");
    let comms: Vec<&Communicator> = all.iter().collect();
    for len in [1usize, 100_000] {
        common_runtime::int_reduction(&comms, WORKERS, Op::Sum, len, true);
        common_runtime::int_reduction(&comms, WORKERS, Op::Sum, len, false);
    }
    common_runtime::int_reduction(&comms, WORKERS, Op::Max, 1000, true);

    let len = 20_000;
    let xs: Vec<Vec<f32>> =
        (0..WORKERS).map(|r| (0..len).map(|i| (i as f32 * 0.37 + r as f32).sin() * 3.0).collect()).collect();
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = all
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut x = if i == 0 { vec![0f32; len] } else { xs[i - 1].clone() };
                s.spawn(move || {
                    c.allreduce(&mut x, Op::Sum).expect("float allreduce over ::1");
                    x
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for o in &outs {
        assert_eq!(o, &outs[0], "everyone gets the same floats");
    }
    for i in 0..len {
        let exact: f64 = xs.iter().map(|x| f64::from(x[i])).sum();
        assert!((f64::from(outs[0][i]) - exact).abs() < 1e-5, "{i}: {} vs {exact}", outs[0][i]);
    }
}

/// Loss 3 % and duplication 3 % on every participant's receive path: the
/// results are exact, the hook dropped datagrams, the runtime resent.
#[test]
fn runtime_ipv6_socket_backend_recovers_injected_loss() {
    let control = ImpairControl::new(0.03, 0.03);
    let all = job(1500, Quantization::Adaptive, |i| {
        Some(Impairment { seed: 47 * 31 + i as u64, reorder_window: 8, control: control.clone() })
    });
    let comms: Vec<&Communicator> = all.iter().collect();
    for len in [1usize, 100_000] {
        common_runtime::int_reduction(&comms, WORKERS, Op::Sum, len, true);
    }
    let h = control.stats();
    assert!(h.dropped > 0, "the hook dropped nothing: {h:?}");
    let retx: u64 = all.iter().map(|c| c.stats().retransmitted).sum();
    assert!(retx > 0, "{} dropped, nothing retransmitted", h.dropped);
}

/// IPv6 datagrams carry 5 elements fewer at the same MTU, at most 16375
/// (the UDP length bounds the payload: (65535 - 8 - 24) / 4).
#[test]
fn runtime_ipv6_elements_per_datagram() {
    use aggbox::wire::proto::elements_per_fragment_in;
    assert_eq!((elements_per_fragment_in(1500, false), elements_per_fragment_in(1500, true)), (362, 357));
    assert_eq!((elements_per_fragment_in(9000, false), elements_per_fragment_in(9000, true)), (2237, 2232));
    assert_eq!(elements_per_fragment_in(65535, true), 16365);
    assert_eq!(elements_per_fragment_in(200_000, true), 16375);
}

/// A job's participants are of one family.
#[test]
fn runtime_a_job_of_mixed_families_is_refused() {
    let (agg_port, mut peers) = addrs(2);
    peers[1] = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), peers[1].port());
    match Communicator::builder(18, peers, LO6, agg_port, Participant::Aggregator).build() {
        Err(CommError::Config(m)) => assert!(m.contains("one family"), "{m}"),
        other => panic!("a mix of families should be refused, got {other:?}"),
    }
}
