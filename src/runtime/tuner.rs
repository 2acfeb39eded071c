//! AggBox or the application's own path, chosen per size by measurement.
//!
//! A front end that can reach both AggBox and a baseline that does the same
//! call (the MPI library: PMPI, Open MPI's own allreduce; the PyTorch hook:
//! the process group's Gloo allreduce) must not make its user slower where
//! the baseline is faster on the user's machine (docs/BENCHMARKS.md, "The
//! star's floor at MTU 1500": at MTU 1500 the star's physical limit is above
//! Open MPI's from 64 KB per worker). A [`Tuner`] decides this per *class*
//! of call: a kind the front end names (call and datatype: an int32
//! allreduce and a float32 one cost differently) and the power of two
//! below the call's size in bytes.
//!
//! A class's first `2 · (trials + 1)` calls are trials, alternating AggBox
//! and the baseline, each timed by the caller; the first of each route is a
//! warm-up whose time is not counted (Open MPI opens its TCP connections at
//! the first call that needs them, AggBox's first call of a size may find
//! cold caches). After the last one the caller hands
//! each path's fastest trial ([`Settle`]) to a MAX reduction over the ranks
//! through the baseline (a collective is as slow as its slowest rank, and
//! the ranks must agree), and passes the agreed times to
//! [`Tuner::settle`]: AggBox serves the class's later calls only if its
//! agreed time is strictly below the baseline's. The minimum of a rank's
//! trials is used because noise on a shared machine only ever adds time.
//!
//! Every rank decides alike without talking beyond that one reduction: a
//! collective's calls come in the same order with the same sizes on every
//! rank, so every rank is at the same trial of the same class at the same
//! call, and the settled choice comes from agreed numbers.

use std::collections::BTreeMap;
use std::time::Duration;

/// Which path serves a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// AggBox's runtime.
    AggBox,
    /// The front end's own implementation of the call.
    Baseline,
}

impl Route {
    /// "aggbox" or "baseline".
    pub fn name(self) -> &'static str {
        match self {
            Route::AggBox => "aggbox",
            Route::Baseline => "baseline",
        }
    }
}

/// What the tuner says for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The class is settled: take this route, untimed.
    Settled(Route),
    /// A trial: take this route, time the call and report it with
    /// [`Tuner::record`].
    Trial(Route),
}

impl Pick {
    /// The route to take.
    pub fn route(self) -> Route {
        match self {
            Pick::Settled(r) | Pick::Trial(r) => r,
        }
    }
}

/// The trials of a class are done: reduce `times_us` with MAX over the
/// ranks and pass the result to [`Tuner::settle`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settle {
    /// This rank's fastest AggBox trial and fastest baseline trial, in
    /// microseconds.
    pub times_us: [f64; 2],
}

/// How a front end wants calls routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// By measurement (the module docs).
    #[default]
    Measure,
    /// Every call through AggBox.
    AggBox,
    /// Every call through the baseline.
    Baseline,
}

impl Policy {
    /// `measure`, `aggbox` or `baseline` (also the front ends' environment
    /// values); None for anything else.
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "measure" => Some(Policy::Measure),
            "aggbox" => Some(Policy::AggBox),
            "baseline" => Some(Policy::Baseline),
            _ => None,
        }
    }
}

/// A settled class: what the ranks agreed and which route won.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The front end's kind (its own numbering).
    pub kind: u32,
    /// Calls of `[2^log2_bytes, 2^(log2_bytes+1))` bytes.
    pub log2_bytes: u32,
    /// The agreed (slowest rank's) fastest trial of AggBox and of the
    /// baseline, in microseconds.
    pub times_us: [f64; 2],
    pub route: Route,
}

/// Trials of one class so far.
#[derive(Debug, Clone, Copy)]
struct Trials {
    /// Trials taken (AggBox first, then alternating; the first two are the
    /// warm-ups).
    done: u32,
    best_us: [f64; 2],
}

#[derive(Debug, Clone, Copy)]
enum Class {
    Trying(Trials),
    /// Trials done, waiting for [`Tuner::settle`].
    Agreeing,
    Settled(Choice),
}

/// The per-class measured choice (see the module docs).
#[derive(Debug, Clone)]
pub struct Tuner {
    policy: Policy,
    trials: u32,
    classes: BTreeMap<(u32, u32), Class>,
}

/// Trials per route and class by default: three, so one slow outlier per
/// route cannot decide.
pub const DEFAULT_TRIALS: u32 = 3;

impl Tuner {
    /// A tuner with `trials` trials per route and class (at least 1).
    pub fn new(policy: Policy, trials: u32) -> Tuner {
        Tuner {
            policy,
            trials: trials.max(1),
            classes: BTreeMap::new(),
        }
    }

    /// The policy it was built with.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The class of a call of `bytes` bytes (0 counts as 1).
    pub fn log2_class(bytes: usize) -> u32 {
        usize::BITS - 1 - bytes.max(1).leading_zeros()
    }

    /// The route of a call of kind `kind` and `bytes` bytes.
    pub fn pick(&mut self, kind: u32, bytes: usize) -> Pick {
        match self.policy {
            Policy::AggBox => return Pick::Settled(Route::AggBox),
            Policy::Baseline => return Pick::Settled(Route::Baseline),
            Policy::Measure => {}
        }
        let class = self
            .classes
            .entry((kind, Tuner::log2_class(bytes)))
            .or_insert(Class::Trying(Trials {
                done: 0,
                best_us: [f64::INFINITY; 2],
            }));
        match class {
            Class::Trying(t) => Pick::Trial(if t.done % 2 == 0 { Route::AggBox } else { Route::Baseline }),
            Class::Settled(c) => Pick::Settled(c.route),
            // A caller that did not settle after the last trial: the class
            // cannot be decided alike on every rank any more, so AggBox (the
            // route the front end was asked to use) serves it.
            Class::Agreeing => Pick::Settled(Route::AggBox),
        }
    }

    /// A trial call of `route` took `took`; Some when it was the class's
    /// last trial (then the caller agrees and calls [`Tuner::settle`]).
    pub fn record(&mut self, kind: u32, bytes: usize, route: Route, took: Duration) -> Option<Settle> {
        let trials = self.trials;
        let class = self.classes.get_mut(&(kind, Tuner::log2_class(bytes)))?;
        let Class::Trying(t) = class else { return None };
        let i = match route {
            Route::AggBox => 0,
            Route::Baseline => 1,
        };
        if t.done >= 2 {
            t.best_us[i] = t.best_us[i].min(took.as_secs_f64() * 1e6);
        }
        t.done += 1;
        if t.done < 2 * (trials + 1) {
            return None;
        }
        let times_us = t.best_us;
        *class = Class::Agreeing;
        Some(Settle { times_us })
    }

    /// The ranks' MAX of [`Settle::times_us`]: settles the class and returns
    /// its route.
    pub fn settle(&mut self, kind: u32, bytes: usize, agreed_us: [f64; 2]) -> Route {
        let log2_bytes = Tuner::log2_class(bytes);
        let route = if agreed_us[0] < agreed_us[1] { Route::AggBox } else { Route::Baseline };
        self.classes.insert(
            (kind, log2_bytes),
            Class::Settled(Choice {
                kind,
                log2_bytes,
                times_us: agreed_us,
                route,
            }),
        );
        route
    }

    /// The settled classes, by kind and size.
    pub fn choices(&self) -> Vec<Choice> {
        self.classes
            .values()
            .filter_map(|c| match c {
                Class::Settled(c) => Some(*c),
                _ => None,
            })
            .collect()
    }
}

/// "4 KiB", "1 MiB", ...: the lower bound of a class, for reports.
pub fn class_name(log2_bytes: u32) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let unit = (log2_bytes / 10).min(UNITS.len() as u32 - 1);
    format!("{} {}", 1u64 << (log2_bytes - unit * 10), UNITS[unit as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    /// Runs a class's trials with AggBox taking `aggbox` µs and the baseline
    /// `baseline` µs per call; returns the route it settles on.
    fn settle_with(t: &mut Tuner, kind: u32, bytes: usize, aggbox: u64, baseline: u64) -> Route {
        loop {
            match t.pick(kind, bytes) {
                Pick::Trial(r) => {
                    let took = if r == Route::AggBox { aggbox } else { baseline };
                    if let Some(s) = t.record(kind, bytes, r, us(took)) {
                        return t.settle(kind, bytes, s.times_us);
                    }
                }
                Pick::Settled(r) => return r,
            }
        }
    }

    #[test]
    fn trials_alternate_and_the_faster_route_wins() {
        let mut t = Tuner::new(Policy::Measure, 3);
        let mut routes = Vec::new();
        for i in 0..8 {
            let Pick::Trial(r) = t.pick(0, 4096) else { panic!("call {i} is a trial") };
            routes.push(r);
            let done = t.record(0, 4096, r, us(if r == Route::AggBox { 50 } else { 80 }));
            assert_eq!(done.is_some(), i == 7);
        }
        assert_eq!(routes, [Route::AggBox, Route::Baseline].repeat(4));
        assert_eq!(t.settle(0, 4096, [50.0, 80.0]), Route::AggBox);
        assert_eq!(t.pick(0, 4096), Pick::Settled(Route::AggBox));
        // Same class: 4096..8191 bytes.
        assert_eq!(t.pick(0, 8191), Pick::Settled(Route::AggBox));
        // Another size class and another kind start their own trials.
        assert_eq!(t.pick(0, 8192), Pick::Trial(Route::AggBox));
        assert_eq!(t.pick(1, 4096), Pick::Trial(Route::AggBox));
    }

    #[test]
    fn a_slower_aggbox_steps_aside_and_a_tie_goes_to_the_baseline() {
        let mut t = Tuner::new(Policy::Measure, 2);
        assert_eq!(settle_with(&mut t, 0, 1 << 20, 9000, 3000), Route::Baseline);
        assert_eq!(t.pick(0, 1 << 20), Pick::Settled(Route::Baseline));
        assert_eq!(settle_with(&mut t, 0, 64, 40, 40), Route::Baseline);
        assert_eq!(settle_with(&mut t, 0, 1 << 10, 39, 40), Route::AggBox);
        let c = t.choices();
        assert_eq!(c.len(), 3);
        assert_eq!((c[0].log2_bytes, c[0].route), (6, Route::Baseline));
        assert_eq!((c[1].log2_bytes, c[1].route), (10, Route::AggBox));
        assert_eq!((c[2].log2_bytes, c[2].times_us, c[2].route), (20, [9000.0, 3000.0], Route::Baseline));
    }

    /// A rank's fastest trial after the warm-ups is what it reports: a
    /// fast warm-up does not count, one slow outlier does not decide.
    #[test]
    fn each_route_reports_its_fastest_trial_after_the_warm_up() {
        let mut t = Tuner::new(Policy::Measure, 3);
        let times = [
            (Route::AggBox, 1),
            (Route::Baseline, 1),
            (Route::AggBox, 500),
            (Route::Baseline, 60),
            (Route::AggBox, 40),
            (Route::Baseline, 70),
            (Route::AggBox, 45),
            (Route::Baseline, 65),
        ];
        let mut settle = None;
        for (r, took) in times {
            assert_eq!(t.pick(3, 100), Pick::Trial(r));
            settle = t.record(3, 100, r, us(took));
        }
        assert_eq!(settle, Some(Settle { times_us: [40.0, 60.0] }));
    }

    /// The settled route follows the agreed numbers, not this rank's own.
    #[test]
    fn the_agreed_times_decide() {
        let mut t = Tuner::new(Policy::Measure, 1);
        for r in [Route::AggBox, Route::Baseline] {
            assert_eq!(t.pick(0, 10), Pick::Trial(r));
            assert!(t.record(0, 10, r, us(1)).is_none(), "a warm-up");
        }
        assert_eq!(t.pick(0, 10), Pick::Trial(Route::AggBox));
        assert!(t.record(0, 10, Route::AggBox, us(10)).is_none());
        assert_eq!(t.pick(0, 10), Pick::Trial(Route::Baseline));
        assert_eq!(t.record(0, 10, Route::Baseline, us(100)), Some(Settle { times_us: [10.0, 100.0] }));
        // Another rank's AggBox trial was slow: the MAX says baseline.
        assert_eq!(t.settle(0, 10, [200.0, 100.0]), Route::Baseline);
        assert_eq!(t.pick(0, 10), Pick::Settled(Route::Baseline));
    }

    #[test]
    fn fixed_policies_never_trial() {
        let mut a = Tuner::new(Policy::AggBox, 3);
        let mut b = Tuner::new(Policy::Baseline, 3);
        for bytes in [1, 4096, 1 << 24] {
            assert_eq!(a.pick(0, bytes), Pick::Settled(Route::AggBox));
            assert_eq!(b.pick(0, bytes), Pick::Settled(Route::Baseline));
        }
        assert!(a.choices().is_empty());
        assert_eq!(Policy::parse("measure"), Some(Policy::Measure));
        assert_eq!(Policy::parse("pmpi"), None);
    }

    #[test]
    fn classes_are_powers_of_two_and_named_by_their_lower_bound() {
        assert_eq!(Tuner::log2_class(0), 0);
        assert_eq!(Tuner::log2_class(1), 0);
        assert_eq!(Tuner::log2_class(4), 2);
        assert_eq!(Tuner::log2_class(1 << 20), 20);
        assert_eq!(Tuner::log2_class((1 << 20) + 1), 20);
        assert_eq!(class_name(2), "4 B");
        assert_eq!(class_name(16), "64 KiB");
        assert_eq!(class_name(24), "16 MiB");
    }
}
