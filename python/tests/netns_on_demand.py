#!/usr/bin/env python3
"""One worker of tests/python_package.rs's run on demand: the node's file
names no job for it; the worker brings its own through the node's control
endpoint with a credential, and needs nothing but the node's address.

    netns_on_demand.py --rank R --world W --config IGNORED --aggregator A \
        --control PORT --data IP:PORT --tenant T --key HEX

A refused join with a wrong key; a tree whose root cannot be reached
refused (and a tree missing a key refused by the binding); int32 SUM and float32 mean allreduces
equal to the reference; then (the test runs it under 1 % loss and
duplication on every link) 250 int32 SUMs and 250 float32 SUMs of 1 to
5,000 elements, each exact (float32 within the documented bound), then
"done".
"""

import argparse
import faulthandler
import signal

import numpy as np

import aggbox
from reference import ints


def main():
    ap = argparse.ArgumentParser()
    for name in ["--rank", "--world", "--control"]:
        ap.add_argument(name, type=int, required=True)
    for name in ["--config", "--aggregator", "--data", "--tenant", "--key"]:
        ap.add_argument(name, required=True)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r, w = a.rank, a.world
    node = f"{a.aggregator}:{a.control}"
    try:
        aggbox.Communicator.connect(node, run="py", world=w, rank=r, data=a.data, tenant=a.tenant, key="00" * 32)
        raise AssertionError("a wrong key was accepted")
    except aggbox.AggBoxError as e:
        if "bad_mac" not in str(e):
            raise
        print("ok: a wrong key is refused (bad_mac)", flush=True)
    # A tree whose root nobody serves: this node, the leaf, joins it for
    # the run and refuses every rank, naming the root.
    nowhere = f"{a.aggregator}:{a.control + 1}"
    tree = dict(root=nowhere, leaf=0, leaves=1, workers=w)
    try:
        aggbox.Communicator.connect(node, run="py-tree", world=w, rank=r, data=a.data, tenant=a.tenant, key=a.key, tree=tree)
        raise AssertionError("a tree whose root cannot be reached was served")
    except aggbox.AggBoxError as e:
        if "unavailable" not in str(e) or nowhere not in str(e):
            raise
        print("ok: a tree whose root cannot be reached is refused", flush=True)
    try:
        aggbox.Communicator.connect(node, run="py-tree", world=w, rank=r, data=a.data, tenant=a.tenant, key=a.key, tree=dict(root=nowhere, leaf=0))
        raise AssertionError("a tree without leaves was accepted")
    except ValueError as e:
        if "leaves" not in str(e):
            raise
    comm = aggbox.Communicator.connect(node, run="py", world=w, rank=r, data=a.data, tenant=a.tenant, key=a.key)
    for n in [1, 10_007]:
        want = np.sum(np.stack([ints(q, n) for q in range(w)]).astype(np.int64), axis=0).astype(np.int32)
        buf = ints(r, n)
        comm.allreduce(buf, op="sum")
        if not np.array_equal(buf, want):
            raise AssertionError(f"int32 allreduce of {n} differs from the reference")
        x = np.full(n, float(r + 1), dtype=np.float32)
        comm.allreduce(x, op="mean")
        if not np.allclose(x, (w + 1) / 2, rtol=1e-5):
            raise AssertionError(f"float32 mean of {n}: {x[:2]}")
        print(f"ok: int32 sum and float32 mean of {n} on job {comm.job}", flush=True)
    sizes = [1, 362, 363, 5_000]
    for k in range(250):
        n = sizes[k % len(sizes)]
        inputs = [ints(q + k, n) for q in range(w)]
        want = np.sum(np.stack(inputs).astype(np.int64), axis=0).astype(np.int32)
        buf = inputs[r].copy()
        comm.allreduce(buf, op="sum")
        if not np.array_equal(buf, want):
            raise AssertionError(f"int32 call {k} of {n} differs from the reference")
        xs = [x.astype(np.float32) / np.float32(10_000) for x in inputs]
        want_f = np.sum(np.stack(xs).astype(np.float64), axis=0)
        x = xs[r].copy()
        comm.allreduce(x, op="sum")
        bound = comm.float_error_bound(1.0) + np.abs(want_f) * 2.0**-23
        if not np.all(np.abs(x - want_f) <= bound):
            raise AssertionError(f"float32 call {k} of {n}: off by {np.max(np.abs(x - want_f))}")
    print("ok: 500 allreduces exact", flush=True)
    comm.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
