#!/usr/bin/env python3
"""One worker of tests/python_package.rs's kill -9 run on demand.

    netns_on_demand_killed.py --phase die|again --rank R --world W \
        --config IGNORED --aggregator A --control PORT --data IP:PORT \
        --tenant T --key HEX

`die`: joins run "killed", runs three exact int32 SUMs, prints its job
and "ready", then ranks 0 and 1 start one more allreduce that
ranks 2 and 3 never join (their contributions stay in the node's slots)
while 2 and 3 wait: the test kills every rank with -9 there.
`again`: joins the same run key, runs exact int32 SUMs, prints its job,
then "done".
"""

import argparse
import faulthandler
import signal
import time

import numpy as np

import aggbox
from reference import ints


def exact(comm, r, w, n, k):
    want = np.sum(np.stack([ints(q + k, n) for q in range(w)]).astype(np.int64), axis=0).astype(np.int32)
    buf = ints(r + k, n)
    comm.allreduce(buf, op="sum")
    if not np.array_equal(buf, want):
        raise AssertionError(f"int32 SUM of {n} (call {k}) differs from the reference")


def main():
    ap = argparse.ArgumentParser()
    for name in ["--rank", "--world", "--control"]:
        ap.add_argument(name, type=int, required=True)
    for name in ["--phase", "--config", "--aggregator", "--data", "--tenant", "--key"]:
        ap.add_argument(name, required=True)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r, w = a.rank, a.world
    node = f"{a.aggregator}:{a.control}"
    comm = aggbox.Communicator.connect(node, run="killed", world=w, rank=r, data=a.data, tenant=a.tenant, key=a.key, deadline=60.0)
    for k, n in enumerate([1, 363, 5_000]):
        exact(comm, r, w, n, k)
    print(f"job {comm.job}", flush=True)
    if a.phase == "die":
        print("ready", flush=True)
        if r < 2:
            comm.allreduce(ints(r, 5_000), op="sum")  # never completes
        time.sleep(120)
        raise AssertionError("not killed")
    comm.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
