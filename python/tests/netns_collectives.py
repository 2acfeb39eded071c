#!/usr/bin/env python3
"""One worker of tests/python_netns.rs: the aggbox package against a node
that runs only `aggbox attach` (node-served jobs, kernel backend), in a
worker namespace of the testbed.

    netns_collectives.py --rank R --world W --config node.toml --aggregator A \
                         --job J --mismatch-job K --striped-jobs S,T

Job J: int32 (numpy and torch) allreduce equal to the reference, float32
within the documented bound, broadcasts among the workers bit for bit, bad
buffers raising before anything is sent. Jobs S,T: one communicator striped
over both, int32 exact and float32 within the bound, broadcast. Job K: the last rank passes a
shorter buffer; every rank's call must raise within its deadline.

Prints one line per check; exits non-zero (a traceback) on the first failure.
"""

import argparse
import faulthandler
import signal
import sys
import time

import numpy as np
import torch

import aggbox
from reference import floats, ints, tolerance


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--aggregator", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--mismatch-job", type=int, required=True)
    ap.add_argument("--striped-jobs", required=True, help="comma-separated")
    a = ap.parse_args()
    # Stacks of every thread on SIGUSR1 (the harness's, before a kill).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r, w = a.rank, a.world
    torch.set_num_threads(1)

    comm = aggbox.Communicator.from_config(a.config, job=a.job, rank=r, aggregator=a.aggregator, deadline=30.0)
    check(comm.rank == r and comm.workers == w and comm.node_served, f"{comm!r}")

    n = 100_003
    for op, ref in [("sum", np.sum), ("max", np.max), ("min", np.min)]:
        want = ref(np.stack([ints(q, n) for q in range(w)]).astype(np.int64), axis=0).astype(np.int32)
        buf = ints(r, n)
        comm.allreduce(buf, op=op)
        check(np.array_equal(buf, want), f"int32 numpy allreduce {op} of {n} equals the reference")

    t = torch.from_numpy(ints(r, n))
    ptr = t.data_ptr()
    comm.allreduce(t)
    want = np.stack([ints(q, n) for q in range(w)]).astype(np.int64).sum(axis=0).astype(np.int32)
    check(np.array_equal(t.numpy(), want) and t.data_ptr() == ptr, "int32 torch allreduce sum, in place")

    m = float(max(np.abs(floats(q, n)).max() for q in range(w)))
    exact = np.stack([floats(q, n) for q in range(w)]).astype(np.float64).mean(axis=0)
    bound = comm.float_error_bound(m, mean=True)
    tol = tolerance(bound, exact)
    x = floats(r, n)
    comm.allreduce(x, op="mean")
    err = np.abs(x.astype(np.float64) - exact)
    check(bool(np.all(err <= tol)), f"float32 numpy allreduce mean: max error {err.max():.3e} <= bound {bound:.3e} + half an ulp")
    xt = torch.from_numpy(floats(r, n))
    comm.allreduce(xt, op="mean")
    check(np.array_equal(xt.numpy(), x), "float32 torch allreduce mean: the same floats as numpy")

    for root in [0, w - 1]:
        msg = (np.arange(50_001) * 1.5 - 3).astype(np.float32)
        b = msg.copy() if r == root else np.zeros_like(msg)
        comm.broadcast(b, root=root)
        check(np.array_equal(b, msg), f"float32 numpy broadcast from rank {root}")
        tmsg = torch.arange(10_000, dtype=torch.int32) * 3 - 5
        tb = tmsg.clone() if r == root else torch.zeros(10_000, dtype=torch.int32)
        comm.broadcast(tb, root=root)
        check(torch.equal(tb, tmsg), f"int32 torch broadcast from rank {root}")

    try:
        comm.broadcast(np.zeros(4, dtype=np.int32), root="aggregator")
        check(False, "a broadcast from the aggregator of a node-served job is refused")
    except aggbox.ConfigError as e:
        check("served by the node" in str(e), f"a broadcast from the aggregator is refused: {e}")

    for buf, exc, text in [
        (np.zeros(8, dtype=np.float64), TypeError, "format 'd'"),
        (torch.zeros(8, dtype=torch.float16), TypeError, "torch.float16"),
        (np.zeros(16, dtype=np.float32)[::2], ValueError, "not C-contiguous"),
        (torch.zeros(4, 4).t(), ValueError, "not C-contiguous"),
    ]:
        try:
            comm.allreduce(buf)
            check(False, f"{text}: raises")
        except exc as e:
            check(text in str(e), f"bad buffer: {type(e).__name__}: {e}")
    # Nothing of the bad calls was sent: the next call lines up everywhere.
    buf = np.full(7, r + 1, dtype=np.int32)
    comm.allreduce(buf)
    check(np.array_equal(buf, np.full(7, w * (w + 1) // 2, dtype=np.int32)), "the next allreduce after the bad buffers")
    comm.close()

    # One vector striped over two jobs at once.
    jobs = [int(j) for j in a.striped_jobs.split(",")]
    striped = aggbox.Communicator.from_config(a.config, job=jobs, rank=r, aggregator=a.aggregator, deadline=30.0)
    check(striped.jobs == jobs, f"{striped!r}")
    n = 200_001
    buf = torch.from_numpy(ints(r, n))
    striped.allreduce(buf)
    want = np.stack([ints(q, n) for q in range(w)]).astype(np.int64).sum(axis=0).astype(np.int32)
    check(np.array_equal(buf.numpy(), want), f"striped over jobs {jobs}: int32 allreduce sum equals the reference")
    m = float(max(np.abs(floats(q, n)).max() for q in range(w)))
    exact = np.stack([floats(q, n) for q in range(w)]).astype(np.float64).mean(axis=0)
    tol = tolerance(striped.float_error_bound(m, mean=True), exact)
    x = floats(r, n)
    striped.allreduce(x, op="mean")
    err = np.abs(x.astype(np.float64) - exact)
    check(bool(np.all(err <= tol)), f"striped over jobs {jobs}: float32 allreduce mean within the bound (max error {err.max():.3e})")
    msg = (np.arange(n) * 0.5).astype(np.float32)
    b = msg.copy() if r == 1 else np.zeros_like(msg)
    striped.broadcast(b, root=1)
    check(np.array_equal(b, msg), f"striped over jobs {jobs}: float32 broadcast from rank 1")
    striped.close()

    # Lengths that differ across ranks: the last rank's is shorter (its last
    # fragment has another element count than the others' at that offset).
    deadline = 3.0
    bad = aggbox.Communicator.from_config(
        a.config, job=a.mismatch_job, rank=r, aggregator=a.aggregator, deadline=deadline
    )
    n = 10_000 if r != w - 1 else 9_000
    start = time.monotonic()
    try:
        bad.allreduce(np.ones(n, dtype=np.int32))
        outcome = None
    except aggbox.AggBoxError as e:
        outcome = e
    took = time.monotonic() - start
    check(took < deadline + 3.0, f"wrong length: the call returned after {took:.1f} s (deadline {deadline} s)")
    check(isinstance(outcome, aggbox.CommTimeoutError), f"wrong length ({n} elements): {type(outcome).__name__}: {outcome}")
    bad.close()
    print("done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
