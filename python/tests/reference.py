"""What the Python tests compare with: every rank's inputs (so a rank
knows every other's without communication), the tolerance of a float32
result and the torch backend's documented bounds of a float result."""

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


# Half the distance between neighbours of a dtype's floats relative to the
# value (its rounding), and its smallest subnormal's half.
ROUND = {"float32": (2.0**-24, 2.0**-150), "float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 2.0**-134)}


def float_tolerance(pg, dtype, op, xs, want):
    """The documented bound: the quantization's (pg.float_error_bound for the
    ranks' largest |x|), then float32's rounding, then the dtype's."""
    if op in ("max", "min"):
        return np.zeros_like(want)
    if dtype == "float64":
        return np.abs(want) * 1e-12 + 1e-12  # Gloo, in float64
    if op == "prod":
        tol = np.abs(want) * 1e-6  # Gloo's float32 product: W roundings of 2^-24
    else:
        max_abs = max(float(np.max(np.abs(x))) for x in xs)
        bound = pg.float_error_bound(np.float32(max_abs), op == "avg")
        tol = tolerance(bound, np.abs(want))
    if dtype != "float32":
        rel, sub = ROUND[dtype]
        tol = tol + (np.abs(want) + tol) * rel + sub
    return tol
