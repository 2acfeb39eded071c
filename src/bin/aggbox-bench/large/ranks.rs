//! What the baselines outside this process share (Gloo, Open MPI): their
//! rank processes, and their output read, timed and checked.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::{progress, Csv};

use super::{worker_count, CallTime, Point};
use super::report::{csv_row, report_point};

/// Kill (by pid) and reap the children that still run.
pub(super) fn kill_children(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// A child's stdout and stderr (piped), read to the end in threads: a full
/// pipe would stop the child.
pub(super) fn read_output(child: &mut Child) -> std::thread::JoinHandle<(String, String)> {
    let out = child.stdout.take();
    let err = child.stderr.take();
    std::thread::spawn(move || {
        let mut o = String::new();
        let mut e = String::new();
        let eh = err.map(|mut s| {
            std::thread::spawn(move || {
                let mut e = String::new();
                let _ = s.read_to_string(&mut e);
                e
            })
        });
        if let Some(mut s) = out {
            let _ = s.read_to_string(&mut o);
        }
        if let Some(h) = eh {
            e = h.join().unwrap_or_default();
        }
        (o, e)
    })
}

/// Wait until every child has exited (true) or `limit` has passed (false,
/// the children left running; `what` names them in the message).
pub(super) fn wait_children(children: &mut [Child], limit: Duration, what: &str) -> bool {
    let t0 = Instant::now();
    loop {
        let done = children
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))));
        if done {
            return true;
        }
        if t0.elapsed() > limit {
            progress(format!(
                "large: {what} did not finish in {:.0} s; stopping pids {:?}",
                limit.as_secs_f64(),
                children.iter().map(|c| c.id()).collect::<Vec<_>>()
            ));
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A failed point of `name` at `mtu` for every size (the backend could
/// not run: `error` says why), reported.
pub(super) fn failed_points(name: &str, mtu: u32, sizes: &[u64], error: &str) -> Vec<Point> {
    let pts: Vec<Point> = sizes.iter().map(|&n| Point::new(name, mtu, n, &[], Some(error.to_string()))).collect();
    pts.iter().for_each(report_point);
    pts
}

/// The calls of an all-reduce run outside this process (Gloo, Open MPI),
/// as each rank reported them: `[rank][size index][call]`, a call being
/// `{"t0", "t1", "wrong", "sum"}` (CLOCK_MONOTONIC seconds around the call,
/// mismatched elements, the int64 sum of the result).
pub(super) type RankCalls = Vec<Vec<Vec<serde_json::Value>>>;

/// The points of an outside run (`what`: its name in messages) from its
/// ranks' calls: every call's result checked (no wrong element on any rank,
/// every rank's sum the known one; a rank missing is a failure), the time
/// of a call = latest t1 − earliest t0 over the ranks (as for the runtime's
/// calls); the rows go to `csv`. `problems`: what the run itself reported,
/// kept with a point's failure (and shown when every point passed).
#[allow(clippy::too_many_arguments)]
pub(super) fn checked_points(
    name: &str,
    what: &str,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    calls: &RankCalls,
    problems: &[String],
) -> Vec<Point> {
    let mut points = Vec::new();
    for (si, &n) in sizes.iter().enumerate() {
        let base = &bases[&n];
        let base_sum: i64 = base.iter().map(|&x| x as i64).sum();
        let mut times = Vec::new();
        let mut err: Option<String> = None;
        for k in 0..reps + 1 {
            let mut t0s = Vec::new();
            let mut t1s = Vec::new();
            for r in 0..worker_count() {
                let call = calls.get(r).and_then(|c| c.get(si)).and_then(|c| c.get(k));
                let Some(call) = call else {
                    err.get_or_insert_with(|| format!("rank {r}: no result for call {k}"));
                    continue;
                };
                let wrong = call
                    .get("wrong")
                    .and_then(|x| x.as_u64())
                    .unwrap_or(u64::MAX);
                let sum = call.get("sum").and_then(|x| x.as_i64());
                let want = base_sum + (worker_count() * k) as i64 * n as i64;
                if wrong != 0 {
                    err.get_or_insert_with(|| {
                        format!("rank {r} call {k}: {wrong} of {n} elements wrong")
                    });
                }
                if sum != Some(want) {
                    err.get_or_insert_with(|| {
                        format!("rank {r} call {k}: result sums to {sum:?}, expected {want}")
                    });
                }
                match (
                    call.get("t0").and_then(|x| x.as_f64()),
                    call.get("t1").and_then(|x| x.as_f64()),
                ) {
                    (Some(a), Some(b)) => {
                        t0s.push(a);
                        t1s.push(b);
                    }
                    _ => {
                        err.get_or_insert_with(|| format!("rank {r} call {k}: no times"));
                    }
                }
            }
            if err.is_some() {
                break;
            }
            let s = t0s.iter().copied().fold(f64::INFINITY, f64::min);
            let e = t1s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            times.push(CallTime {
                all: e - s,
                workers: e - s,
            });
        }
        if err.is_some() && !problems.is_empty() {
            err = Some(format!(
                "{}; {}",
                problems.join("; "),
                err.unwrap_or_default()
            ));
        }
        let p = match err {
            None => {
                for (k, t) in times.iter().enumerate() {
                    csv_row(csv, name, mtu, n, k, t.all, t.workers, true);
                }
                Point::new(name, mtu, n, &times, None)
            }
            Some(e) => Point::new(name, mtu, n, &[], Some(e)),
        };
        report_point(&p);
        points.push(p);
    }
    if points.iter().all(|p| p.ok) && !problems.is_empty() {
        // Every point measured and checked, but a rank said something went
        // wrong afterwards (e.g. at teardown): keep it visible.
        progress(format!(
            "large: {what} at MTU {mtu}: {}",
            problems.join("; ")
        ));
    }
    points
}
