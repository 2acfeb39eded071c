"""The route policy of the torch backend "aggbox" (Options.route, else
AGGBOX_TORCH_ROUTE; Options.trials, else AGGBOX_TORCH_TRIALS), and the DDP
hook's reading of the same variable: no network. The policies' effect on
the calls is tested on 4 ranks by python/tests/netns_torch_backend.py.
Run by tests/python_package.rs with the other unittest files."""

import os
import unittest
from unittest import mock

import aggbox
from aggbox.torch import Options
from aggbox.torch.backend import _route_policy
from aggbox.torch.hook import AllreduceState


class RoutePolicy(unittest.TestCase):
    def test_measure_by_default_with_the_tuners_trials(self):
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop("AGGBOX_TORCH_ROUTE", None)
            os.environ.pop("AGGBOX_TORCH_TRIALS", None)
            self.assertEqual(_route_policy(Options()), ("measure", aggbox.DEFAULT_TUNER_TRIALS))

    def test_the_environment_and_the_options_which_win(self):
        with mock.patch.dict(os.environ, {"AGGBOX_TORCH_ROUTE": "gloo", "AGGBOX_TORCH_TRIALS": "5"}):
            self.assertEqual(_route_policy(Options()), ("gloo", 5))
            self.assertEqual(_route_policy(Options(route="aggbox", trials=2)), ("aggbox", 2))
            self.assertEqual(_route_policy(Options(route="Measure")), ("measure", 5))
        # The hook's name of the baseline is the backend's "gloo".
        with mock.patch.dict(os.environ, {"AGGBOX_TORCH_ROUTE": "baseline"}):
            self.assertEqual(_route_policy(Options())[0], "gloo")

    def test_bad_values_name_where_they_came_from(self):
        with mock.patch.dict(os.environ, {"AGGBOX_TORCH_ROUTE": "fastest"}):
            with self.assertRaisesRegex(ValueError, "AGGBOX_TORCH_ROUTE='fastest'"):
                _route_policy(Options())
            with self.assertRaisesRegex(ValueError, "Options.route='star'"):
                _route_policy(Options(route="star"))
        with mock.patch.dict(os.environ, {"AGGBOX_TORCH_ROUTE": "aggbox", "AGGBOX_TORCH_TRIALS": "x"}):
            with self.assertRaisesRegex(ValueError, "AGGBOX_TORCH_TRIALS='x'"):
                _route_policy(Options())
            with self.assertRaisesRegex(ValueError, "Options.trials=0"):
                _route_policy(Options(trials=0))

    def test_the_hook_takes_gloo_for_baseline(self):
        with mock.patch.dict(os.environ, {"AGGBOX_TORCH_ROUTE": "gloo"}):
            state = AllreduceState(comm=None)
            self.assertEqual(state.route, "baseline")


if __name__ == "__main__":
    unittest.main()
