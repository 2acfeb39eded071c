//! How rounds line up across participants when one misses a call or calls
//! late, and what a reduction's result says about overflow, on the
//! simulated network with the fake clock.

use std::sync::Arc;
use std::time::Duration;

use super::{builder, expected_sum, input, Ended, Engine, Sim, Sink, Src, WORKERS};
use crate::runtime::engine::{CallOptions, Participant, RawF32};
use crate::runtime::transport::Counters;
use crate::runtime::error::Peer;
use crate::wire::abi::{Op, Round};

const AGG: usize = WORKERS as usize;

/// Rank 2 misses an allreduce: the others fail at the deadline and move
/// on to round 1; a replacement for rank 2, built with the survivors'
/// position (`resume`), lines up with them, and the next two allreduces
/// give everyone the sum.
#[test]
fn a_replacement_resumed_at_the_survivors_position_completes_the_next_calls() {
    let mut sim = Sim::new();
    let len = 3000; // 9 fragments
    let opts = CallOptions::deadline(Duration::from_millis(500));
    for i in [0, 1, AGG] {
        sim.start_reduce(i, true, len, opts);
    }
    sim.run(Duration::from_secs(5));
    for i in [0, 1, AGG] {
        let Ended::Failed(e) = sim.ended(i) else {
            panic!("participant {i}: {:?}", sim.ended(i));
        };
        let missing = if i == AGG {
            Peer::Rank(2)
        } else {
            Peer::Aggregator
        };
        assert_eq!(e.timeout().expect("a timeout").missing, vec![missing]);
        assert_eq!(sim.nodes[i].engine.position(), (Round(1), 9), "participant {i}");
    }
    assert_eq!(
        sim.nodes[2].engine.position(),
        (Round(0), 0),
        "rank 2 never called"
    );

    let (round, seq) = sim.nodes[0].engine.position();
    let cfg = builder(Participant::Worker(2))
        .resume(round, seq)
        .config()
        .clone();
    let counters = Arc::new(Counters::default());
    // A new broadcast session, as the driver's random base gives one.
    sim.nodes[2].engine = Engine::new(cfg, counters.clone(), 9 << 20, sim.now);
    sim.nodes[2].counters = counters;

    for len in [len, 10] {
        for i in 0..=AGG {
            sim.start_reduce(i, true, len, CallOptions::default());
        }
        let limit = sim.now - sim.start + Duration::from_secs(5);
        sim.run(limit);
        for i in 0..=AGG {
            match sim.ended(i) {
                Ended::Values(v) => assert_eq!(v, &expected_sum(len), "participant {i}"),
                other => panic!("participant {i}, len {len}: {other:?}"),
            }
        }
    }
    for i in 0..=AGG {
        assert_eq!(
            sim.nodes[i].engine.position(),
            (Round(3), 9 + 9 + 1),
            "participant {i}"
        );
    }
}

/// The aggregator gives up on round 0 of a reduce (rank 2 silent) and moves
/// to round 1; rank 2 then makes its round-0 call. Its contributions are
/// of a round the aggregator abandoned: acknowledged (so rank 2 stops
/// sending them and its call ends) and dropped, not added to round 1,
/// whose sum is of round 1's contributions alone.
#[test]
fn a_late_contribution_to_an_abandoned_round_is_acknowledged_and_not_added_to_the_next() {
    let mut sim = Sim::new();
    let len = 1000; // 3 fragments
    let deadline = Duration::from_millis(100);
    for i in [0, 1, AGG] {
        sim.start_reduce(i, false, len, CallOptions::deadline(deadline));
    }
    sim.run(Duration::from_secs(5));
    assert!(matches!(sim.ended(0), Ended::Contributed));
    assert!(matches!(sim.ended(1), Ended::Contributed));
    let Ended::Failed(e) = sim.ended(AGG) else {
        panic!("the aggregator: {:?}", sim.ended(AGG));
    };
    assert_eq!(e.timeout().expect("a timeout").missing, vec![Peer::Rank(2)]);
    assert_eq!(sim.ended_at(AGG), deadline);

    // Rank 2's late round-0 call, with values that would show anywhere.
    let late = vec![1_000_000; len];
    let opts = CallOptions::default();
    sim.start_reduce_from(2, false, Op::Sum, Src::I32(late), None, opts);
    let limit = sim.now - sim.start + Duration::from_secs(5);
    sim.run(limit);
    assert!(
        matches!(sim.ended(2), Ended::Contributed),
        "acknowledged: {:?}",
        sim.ended(2)
    );
    assert!(sim.log.iter().all(|d| !d.resend), "nothing resent");
    for i in 0..=AGG {
        assert_eq!(sim.nodes[i].engine.position(), (Round(1), 3), "participant {i}");
    }

    for i in 0..=AGG {
        sim.start_reduce(i, false, len, CallOptions::default());
    }
    let limit = sim.now - sim.start + Duration::from_secs(5);
    sim.run(limit);
    match sim.ended(AGG) {
        Ended::Values(v) => assert_eq!(v, &expected_sum(len), "round 1's contributions alone"),
        other => panic!("the aggregator: {other:?}"),
    }
}

/// A sum beyond int32 is clamped and flagged OVERFLOW, and the flag
/// reaches every participant with the result (an allreduce: the
/// aggregator's own result and each worker's forwarded copy); a sum that
/// fits is not flagged.
#[test]
fn an_int_sum_beyond_int32_is_clamped_and_flagged_to_every_participant() {
    let mut sim = Sim::new();
    let len = 1000; // 3 fragments; the last element is in the last one
    for i in 0..=AGG {
        let src = if i == AGG {
            Src::Len(len)
        } else {
            let mut v = input(i as u16, len);
            v[len - 1] = 1_000_000_000;
            Src::I32(v)
        };
        sim.start_reduce_from(i, true, Op::Sum, src, None, CallOptions::default());
    }
    sim.run(Duration::from_secs(5));
    let mut want = expected_sum(len);
    want[len - 1] = i32::MAX;
    for i in 0..=AGG {
        match sim.ended(i) {
            Ended::Values(v) => assert_eq!(v, &want, "participant {i}"),
            other => panic!("participant {i}: {other:?}"),
        }
        assert!(sim.nodes[i].overflow, "participant {i}: flagged");
    }

    for i in 0..=AGG {
        sim.start_reduce(i, true, len, CallOptions::default());
    }
    let limit = sim.now - sim.start + Duration::from_secs(5);
    sim.run(limit);
    for i in 0..=AGG {
        assert!(matches!(sim.ended(i), Ended::Values(_)), "participant {i}");
        assert!(!sim.nodes[i].overflow, "participant {i}: the sum fits");
    }
}

/// A float allreduce at the fixed scale 1e8 where rank 0's last value
/// (30) clamps when quantized (3e9 > 2^31 − 1) and the others' (−10) do
/// not: the sum of the quantized values fits int32 (2^31 − 1 − 2e9) but is
/// wrong (1.47 instead of 10), so nothing but the OVERFLOW flag rank 0 puts
/// on that fragment tells. The aggregator carries it into the result:
/// every participant's result is flagged. With 10 instead of 30 nothing
/// clamps, nothing is flagged, and every worker's floats are the sum.
#[test]
fn a_clamped_float_contribution_flags_every_participants_result_though_the_sum_fits() {
    let len = 1000;
    let scale = 1e8;
    for (last, clamped) in [(30.0f32, true), (10.0, false)] {
        let mut sim = Sim::new();
        // The workers' floats: contributions, and (allreduce) where their
        // results are written, as a blocking float call lends them.
        let mut xs: Vec<Vec<f32>> = (0..WORKERS)
            .map(|r| {
                let mut x = vec![0.25f32; len];
                x[len - 1] = if r == 0 { last } else { -10.0 };
                x
            })
            .collect();
        for (r, x) in xs.iter_mut().enumerate() {
            let raw = RawF32::of(x);
            let src = Src::F32 { x: raw, scale };
            let sink = Sink::F32 {
                out: raw,
                div: scale,
            };
            sim.start_reduce_from(r, true, Op::Sum, src, Some(sink), CallOptions::default());
        }
        let opts = CallOptions::default();
        sim.start_reduce_from(AGG, true, Op::Sum, Src::Len(len), None, opts);
        sim.run(Duration::from_secs(5));

        let last_sum = if clamped {
            i32::MAX - 2_000_000_000
        } else {
            -1_000_000_000
        };
        match sim.ended(AGG) {
            Ended::Values(v) => {
                assert!(v[..len - 1].iter().all(|&q| q == 75_000_000), "0.75 at 1e8");
                assert_eq!(v[len - 1], last_sum, "last {last}");
            }
            other => panic!("the aggregator: {other:?}"),
        }
        for i in 0..=AGG {
            if i < AGG {
                assert!(matches!(sim.ended(i), Ended::Written), "worker {i}");
            }
            assert_eq!(
                sim.nodes[i].overflow, clamped,
                "participant {i}, last {last}"
            );
        }
        for (r, x) in xs.iter().enumerate() {
            assert!(x[..len - 1].iter().all(|&v| v == 0.75), "worker {r}");
            let want = (last_sum as f64 / scale) as f32;
            assert_eq!(x[len - 1], want, "worker {r}, last {last}");
        }
    }
}
