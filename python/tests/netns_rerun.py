#!/usr/bin/env python3
"""One worker of one run in tests/python_package.rs's consecutive runs: a
new program against a node that runs only `aggbox attach` and has served
the job before (node-served, kernel backend), built the plain way.

    netns_rerun.py --rank R --world W --config node.toml --aggregator A --job J

Three int32 allreduces (sum, max, sum) equal to the reference, then "done".
A run that started at round 0 on a node that holds an earlier run's rounds
would time out here (CommTimeoutError) instead of completing.
"""

import argparse
import faulthandler
import signal

import numpy as np

import aggbox
from reference import ints


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--aggregator", required=True)
    ap.add_argument("--job", type=int, required=True)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r, w = a.rank, a.world
    comm = aggbox.Communicator.from_config(a.config, job=a.job, rank=r, aggregator=a.aggregator, deadline=10.0)
    n = 10_007
    for op, ref in [("sum", np.sum), ("max", np.max), ("sum", np.sum)]:
        want = ref(np.stack([ints(q, n) for q in range(w)]).astype(np.int64), axis=0).astype(np.int32)
        buf = ints(r, n)
        comm.allreduce(buf, op=op)
        if not np.array_equal(buf, want):
            raise AssertionError(f"int32 allreduce {op} of {n} differs from the reference")
        print(f"ok: int32 allreduce {op} of {n} equals the reference", flush=True)
    comm.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
