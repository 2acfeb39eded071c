#!/usr/bin/env python3
"""One rank of tests/python_package.rs's kill test: 4 ranks on the backend
"aggbox" with a process group timeout of --timeout seconds make a few
collectives; then rank 3 kills itself with SIGKILL (as `kill -9` would)
while the others start an allreduce: each must get a RuntimeError naming
rank 3 within the timeout, then a further call must fail at once, and the
process must exit.

    netns_torch_kill.py --rank R --world W --master-addr A --master-port P --timeout S
"""

import faulthandler
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import aggbox.torch  # noqa: F401 - registers the backend
from reference import rank_parser


def main():
    ap = rank_parser()
    ap.add_argument("--timeout", type=float, required=True)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, world, victim = a.rank, a.world, a.world - 1
    dist.init_process_group(
        "aggbox", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=a.timeout),
    )
    for _ in range(3):
        t = torch.ones(1000)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((1000,), float(world)))
    dist.barrier()
    print("ok: 3 allreduces and a barrier", flush=True)
    if rank == victim:
        print(f"rank {rank}: kill -9 of myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t = torch.ones(100_000)
        dist.all_reduce(t)
        raise AssertionError("an allreduce without rank 3 succeeded")
    except RuntimeError as e:
        took = time.monotonic() - t0
        msg = str(e)
        print(f"rank {rank}: RuntimeError after {took:.1f} s: {msg}", flush=True)
        assert f"rank {victim} " in msg, f"the error does not name rank {victim}: {msg}"
        assert took <= a.timeout, f"the error came after {took:.1f} s, beyond the timeout of {a.timeout} s"
        print(f"ok: RuntimeError naming rank {victim} after {took:.1f} s (timeout {a.timeout} s)", flush=True)
    t1 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
        raise AssertionError("a call after the failure succeeded")
    except RuntimeError as e:
        assert time.monotonic() - t1 < 1.0, "a call after the failure waited"
        print(f"ok: the next call fails at once: {str(e)[:100]}", flush=True)
    print("done", flush=True)
    # Without destroy_process_group: the exit itself must not hang on the dead peer.


if __name__ == "__main__":
    main()
