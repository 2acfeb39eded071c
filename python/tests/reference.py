"""What the Python tests compare with: every rank's inputs (so a rank
knows every other's without communication) and the tolerance of a float32
result."""

import argparse

import numpy as np


def ints(rank, n):
    """Rank `rank`'s int32 input (the formula of tests/node_served.rs)."""
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 1_000_003) % 20_001 - 10_000).astype(np.int32)


def floats(rank, n):
    """Rank `rank`'s float32 input: gradient-like, normal(0, 0.01)."""
    return np.random.default_rng(100 + rank).normal(0.0, 0.01, n).astype(np.float32)


def tolerance(bound, exact):
    """What a float32 result may differ from `exact` by (numpy or torch):
    the quantization `bound` (Communicator.float_error_bound), then one
    rounding to float32 (half an ulp of the result, at most 2^-24 of it, and
    the result is within `bound` of `exact`), with 2^-20 of slack for
    float64's own rounding of this sum."""
    return (bound + (abs(exact) + bound) * 2.0**-24) * (1 + 2.0**-20)


def rank_parser():
    """The arguments of every torch-backend rank script (tests/python_package.rs
    passes them): this rank, the world size and the process group's store."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    return ap
