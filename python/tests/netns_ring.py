#!/usr/bin/env python3
"""One worker of tests/python_package.rs's star-or-ring run: a node-served
job (the star, on host 0) beside a `[[ring]]` of the same workers that each
worker's own host serves, chosen per call by size.

    netns_ring.py --rank R --world W --config node.toml --aggregator A \
        --job J --ring ID --pin-dir DIR --ring-len N --threshold T
    netns_ring.py --rank R --world W --config node.toml --aggregator A \
        --control PORT --data IP:PORT --tenant T --key K \
        --pin-dir DIR --ring-len N --threshold T

The second form is a run on demand with a ring (docs/INTERFACE.md, "Rings
on demand"): `connect(ring=...)` at the aggregator's control endpoint,
naming this host's own node (its address, the same port) and its pins.

Int32 SUM and MAX allreduces below the threshold (the star) and from it up
to the ring's length (the ring), a float32 mean on the ring, a forced ring
call of one element, each equal to the reference; `served` must count
every call on the algorithm the sizes say. Then "done".
"""

import argparse
import faulthandler
import signal

import numpy as np

import aggbox
from reference import ints


def main():
    ap = argparse.ArgumentParser()
    for name in ["--rank", "--world", "--ring-len", "--threshold"]:
        ap.add_argument(name, type=int, required=True)
    for name in ["--job", "--ring", "--control"]:
        ap.add_argument(name, type=int)
    for name in ["--config", "--aggregator", "--pin-dir"]:
        ap.add_argument(name, required=True)
    for name in ["--data", "--tenant", "--key"]:
        ap.add_argument(name)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r, w = a.rank, a.world
    if a.control is not None:
        own = a.data.split(":")[0] + f":{a.control}"
        comm = aggbox.Communicator.connect(
            f"{a.aggregator}:{a.control}", run="ring-on-demand", world=w, rank=r, data=a.data,
            tenant=a.tenant, key=a.key, vector_len=a.ring_len, deadline=20.0,
            ring=dict(node=own, pins=a.pin_dir, threshold=a.threshold))
    else:
        kw = dict(job=a.job, rank=r, aggregator=a.aggregator, deadline=20.0, ring=a.ring, pin_dir=a.pin_dir)
        comm = aggbox.Communicator.from_config(a.config, ring_threshold=a.threshold, **kw)
    want_star, want_ring = 0, 0
    for n in [a.threshold - 1, a.threshold, a.ring_len]:
        for op, ref in [("sum", np.sum), ("max", np.max)]:
            want = ref(np.stack([ints(q, n) for q in range(w)]).astype(np.int64), axis=0).astype(np.int32)
            buf = ints(r, n)
            comm.allreduce(buf, op=op)
            if not np.array_equal(buf, want):
                raise AssertionError(f"int32 allreduce {op} of {n} differs from the reference")
            if n >= a.threshold:
                want_ring += 1
            else:
                want_star += 1
            print(f"ok: int32 allreduce {op} of {n} equals the reference", flush=True)
    x = np.full(a.ring_len, float(r + 1), dtype=np.float32)
    comm.allreduce(x, op="avg")
    mean = (w + 1) / 2
    if not np.allclose(x, mean, rtol=1e-5):
        raise AssertionError(f"float32 mean on the ring: {x[:4]}, not {mean}")
    want_ring += 1
    print("ok: float32 mean on the ring", flush=True)
    served = comm.served
    if served != {"star": want_star, "ring": want_ring}:
        raise AssertionError(f"served {served}, want star {want_star} ring {want_ring}")
    print(f"ok: served star {served['star']} ring {served['ring']}", flush=True)
    comm.close()
    if a.control is not None:
        print("ok: the ring on demand", flush=True)
        print("done", flush=True)
        return
    forced = aggbox.Communicator.from_config(a.config, algorithm="ring", **kw)
    one = np.array([r + 1], dtype=np.int32)
    forced.allreduce(one, op="sum")
    if one[0] != w * (w + 1) // 2 or forced.served != {"star": 0, "ring": 1}:
        raise AssertionError(f"forced ring call of one element: {one[0]}, served {forced.served}")
    print("ok: a forced ring call of one element", flush=True)
    forced.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
