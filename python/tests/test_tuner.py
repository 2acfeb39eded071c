"""aggbox.Tuner, the binding of the runtime's per-size choice between AggBox
and a baseline (aggbox::runtime::tuner), with synthetic times: no network.
Run by tests/python_package.rs with the other unittest files."""

import unittest

import aggbox


def settle_with(t, kind, nbytes, aggbox_s, baseline_s):
    """Runs a class's trials with each route taking the given seconds, as
    one rank alone (its own times are the agreed ones); returns the route it
    settles on and the routes the trials took."""
    taken = []
    while True:
        route, trial = t.pick(kind, nbytes)
        if not trial:
            return route, taken
        taken.append(route)
        times = t.record(kind, nbytes, route, aggbox_s if route == "aggbox" else baseline_s)
        if times is not None:
            return t.settle(kind, nbytes, times), taken


class TunerBinding(unittest.TestCase):
    def test_trials_alternate_then_the_faster_route_is_settled(self):
        t = aggbox.Tuner("measure", trials=3)
        self.assertEqual((t.policy, t.trials), ("measure", 3))
        route, taken = settle_with(t, 0, 4096, 50e-6, 80e-6)
        self.assertEqual(taken, ["aggbox", "baseline"] * 4, "a warm-up and 3 trials each, alternating")
        self.assertEqual(route, "aggbox")
        self.assertEqual(t.pick(0, 4096), ("aggbox", False))
        self.assertEqual(t.pick(0, 8191), ("aggbox", False), "4096..8191 bytes are one class")
        self.assertEqual(t.pick(0, 8192), ("aggbox", True), "the next size class has its own trials")
        self.assertEqual(t.pick(1, 4096), ("aggbox", True), "another kind has its own trials")

    def test_a_slower_aggbox_steps_aside_and_a_tie_goes_to_the_baseline(self):
        t = aggbox.Tuner(trials=2)
        self.assertEqual(t.trials, 2)
        self.assertEqual(settle_with(t, 0, 1 << 20, 9e-3, 3e-3)[0], "baseline")
        self.assertEqual(t.pick(0, 1 << 20), ("baseline", False))
        self.assertEqual(settle_with(t, 0, 64, 40e-6, 40e-6)[0], "baseline")
        self.assertEqual(settle_with(t, 1, 1024, 39e-6, 40e-6)[0], "aggbox")
        c = t.choices()
        self.assertEqual([(x["kind"], x["log2_bytes"], x["size"], x["route"]) for x in c],
                         [(0, 6, "64 B", "baseline"), (0, 20, "1 MiB", "baseline"), (1, 10, "1 KiB", "aggbox")])
        self.assertAlmostEqual(c[1]["aggbox_s"], 9e-3)
        self.assertAlmostEqual(c[1]["baseline_s"], 3e-3)

    def test_record_returns_each_routes_fastest_trial_after_the_warm_up(self):
        t = aggbox.Tuner(trials=3)
        seconds = [1e-6, 1e-6, 500e-6, 60e-6, 40e-6, 70e-6, 45e-6, 65e-6]
        out = None
        for i, s in enumerate(seconds):
            route, trial = t.pick(3, 100)
            self.assertTrue(trial)
            self.assertEqual(route, ["aggbox", "baseline"][i % 2])
            out = t.record(3, 100, route, s)
            self.assertEqual(out is None, i < 7)
        self.assertAlmostEqual(out[0], 40e-6)
        self.assertAlmostEqual(out[1], 60e-6)
        self.assertEqual(t.choices(), [], "not settled before settle()")
        self.assertIn("settled=0", repr(t))

    def test_the_agreed_times_decide_not_this_ranks(self):
        t = aggbox.Tuner(trials=1)
        for route, s in [("aggbox", 1e-6), ("baseline", 1e-6), ("aggbox", 10e-6), ("baseline", 100e-6)]:
            self.assertEqual(t.pick(0, 10), (route, True))
            times = t.record(0, 10, route, s)
        self.assertEqual(times, (10e-6, 100e-6))
        # Another rank's AggBox trial was slow: the MAX over the ranks says baseline.
        self.assertEqual(t.settle(0, 10, (200e-6, 100e-6)), "baseline")
        self.assertEqual(t.pick(0, 10), ("baseline", False))
        self.assertIsNone(t.record(0, 10, "baseline", 1e-6), "a settled class records nothing")

    def test_fixed_policies_never_trial(self):
        for policy in ["aggbox", "baseline"]:
            t = aggbox.Tuner(policy)
            self.assertEqual(t.trials, aggbox.DEFAULT_TUNER_TRIALS)
            for nbytes in [0, 1, 4096, 1 << 24]:
                self.assertEqual(t.pick(0, nbytes), (policy, False))
            self.assertEqual(t.choices(), [])

    def test_size_classes(self):
        self.assertEqual([aggbox.Tuner.size_class(n) for n in [0, 1, 4, 4095, 4096, (1 << 20) + 1]], [0, 0, 2, 11, 12, 20])

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "policy 'pmpi'"):
            aggbox.Tuner("pmpi")
        with self.assertRaisesRegex(ValueError, "at least one trial"):
            aggbox.Tuner(trials=0)
        t = aggbox.Tuner()
        t.pick(0, 8)
        with self.assertRaisesRegex(ValueError, "route 'gloo'"):
            t.record(0, 8, "gloo", 1e-3)
        for bad in [-1.0, float("nan"), float("inf")]:
            with self.assertRaisesRegex(ValueError, "non-negative"):
                t.record(0, 8, "aggbox", bad)
            with self.assertRaisesRegex(ValueError, "non-negative"):
                t.settle(0, 8, (bad, 1.0))


if __name__ == "__main__":
    unittest.main()
