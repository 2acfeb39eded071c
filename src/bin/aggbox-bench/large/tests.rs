//! Tests of the driver's inputs, checks and gate, and of reading the
//! baselines' output.

use super::openmpi::openmpi_calls;
use super::ranks::checked_points;
use super::*;

#[test]
fn inputs_and_expected_sum_match_the_python_formula() {
    let n = 5000;
    let base = expected_base(n);
    for i in [0usize, 1, 1000, 2000, 2001, 4999] {
        let want: i32 = (0..worker_count())
            .map(|r| ((i + 1000 * r) % 2001) as i32 - 1000)
            .sum();
        assert_eq!(base[i], want, "element {i}");
    }
    let mut v = vec![0; n];
    fill_input(&mut v, 3, 7);
    assert_eq!(v[10], ((10 + 3000) % 2001) - 1000 + 7);
    let mut sum = base.clone();
    sum.iter_mut().for_each(|x| *x += 4 * 2);
    assert_eq!(mismatches(&sum, &base, 2), (0, None));
    sum[17] += 1;
    assert_eq!(mismatches(&sum, &base, 2), (1, Some(17)));
}

#[test]
fn openmpi_output_is_timed_and_checked_as_gloos() {
    let n = 10u64;
    let base = expected_base(n as usize);
    let base_sum: i64 = base.iter().map(|&x| x as i64).sum();
    let w = worker_count();
    let sum = |k: usize| base_sum + (w * k) as i64 * n as i64;
    // Rank r starts call k at 10 + k + r/100 s and returns at 10.5 + k − r/100.
    let line = |k: usize, sum: i64| -> String {
        let ranks: Vec<String> = (0..w)
            .map(|r| {
                let (t0, t1) = (
                    10.0 + k as f64 + 0.01 * r as f64,
                    10.5 + k as f64 - 0.01 * r as f64,
                );
                format!(r#"{{"t0": {t0}, "t1": {t1}, "wrong": 0, "sum": {sum}}}"#)
            })
            .collect();
        format!(
            r#"{{"elements": {n}, "k": {k}, "warmup": {}, "ranks": [{}]}}"#,
            k == 0,
            ranks.join(", ")
        )
    };
    let header = format!(r#"{{"mpi": "Open MPI v4.1.4", "world": {w}, "dtype": "int32"}}"#);
    let bases = BTreeMap::from([(n, base)]);
    let point = |out: &str| {
        let mut problems = Vec::new();
        let calls = openmpi_calls(out, &[n], 2, &mut problems);
        let mut csv = Csv::new(&["unused"]);
        checked_points(
            "openmpi",
            "Open MPI",
            1500,
            &[n],
            2,
            &bases,
            &mut csv,
            &calls,
            &problems,
        )
        .remove(0)
    };
    let good = point(
        &[
            header.clone(),
            "not JSON".into(),
            line(0, sum(0)),
            line(1, sum(1)),
            line(2, sum(2)),
        ]
        .join("\n"),
    );
    assert!(good.ok, "{:?}", good.error);
    assert!((good.secs.median - 0.5).abs() < 1e-9, "{:?}", good.secs);
    let wrong = point(
        &[
            header.clone(),
            line(0, sum(0)),
            line(1, sum(1)),
            line(2, sum(2) + 1),
        ]
        .join("\n"),
    );
    assert!(
        wrong
            .error
            .as_deref()
            .is_some_and(|e| e.contains("sums to")),
        "{:?}",
        wrong.error
    );
    let missing = point(&[header, line(0, sum(0)), line(1, sum(1))].join("\n"));
    assert!(
        missing
            .error
            .as_deref()
            .is_some_and(|e| e.contains("no result for call 2")),
        "{:?}",
        missing.error
    );
}

#[test]
fn largest_mtu_and_slots() {
    assert_eq!(largest_aggbox_mtu(), 65_535);
    assert_eq!(proto::elements_per_datagram(65_535), 16_370);
    assert!(proto::elements_per_datagram(65_535) as u32 <= abi::MAX_ELEMS);
    assert_eq!(slots_for_mtu(1500), 4096);
    assert_eq!(slots_for_mtu(9000), 910);
    assert_eq!(slots_for_mtu(65_535), 128);
}

#[test]
fn gate_breaks() {
    let g = Gate::new(2);
    std::thread::scope(|s| {
        let h = s.spawn(|| g.wait());
        std::thread::sleep(Duration::from_millis(20));
        g.abort();
        assert!(!h.join().unwrap());
    });
    let g = Gate::new(2);
    std::thread::scope(|s| {
        let h = s.spawn(|| g.wait() && g.wait());
        assert!(g.wait() && g.wait());
        assert!(h.join().unwrap());
    });
}
