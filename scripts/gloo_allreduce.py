#!/usr/bin/env python3
"""One rank of a torch.distributed Gloo all-reduce benchmark (`aggbox-bench large`).

Run one process per worker namespace (the benchmark starts them with
`ip netns exec`), with GLOO_SOCKET_IFNAME=eth0 in the environment:

    gloo_allreduce.py --rank R --world 4 --master-addr A --master-port P \
                      --sizes 1000000,21800000 --reps 3 [--warmup 1] \
                      [--dtype int32|float32]

For every size: `warmup` untimed-for-the-report calls, then `reps` timed
calls of dist.all_reduce(SUM) on an int32 (or float32) tensor. The input of rank r in
call k (k = 0 first, warm-up included) is

    x[i] = ((i + 1000 r) mod 2001) - 1000 + k

(the same formula as src/bin/aggbox-bench/large/mod.rs), so the sum over the ranks is known
without any communication; as float32 the values and their sums are integers
below 2^24, so they are exact too. Every call's result is compared element by element
with that sum (`wrong` counts mismatched elements) and its int64 sum is
reported so the caller can check it independently. Before each call the
ranks meet in dist.barrier(); t0/t1 are CLOCK_MONOTONIC seconds (the same
clock in every process of the machine), so the caller computes the time of a
call as max(t1) - min(t0) over the ranks.

Prints one JSON object on stdout (also when something fails: "error").
Exits 0 on success, 1 on an error, 2 on a wrong result.
"""
import argparse
import json
import sys
import time
import traceback


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--sizes", required=True, help="comma-separated element counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="Gloo timeout (s)")
    ap.add_argument("--dtype", choices=["int32", "float32"], default="int32")
    a = ap.parse_args()
    out = {"rank": a.rank, "world": a.world, "dtype": a.dtype, "points": []}
    try:
        import datetime

        import torch
        import torch.distributed as dist

        out["torch"] = torch.__version__
        # Tensor arithmetic (input fill, check) on one thread: 4 ranks share
        # the machine's CPUs; Gloo's own communication threads are unaffected.
        torch.set_num_threads(1)
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{a.master_addr}:{a.master_port}",
            rank=a.rank,
            world_size=a.world,
            timeout=datetime.timedelta(seconds=a.timeout),
        )
        dt = torch.int32 if a.dtype == "int32" else torch.float32
        bad = 0
        for n in [int(s) for s in a.sizes.split(",") if s]:
            idx = torch.arange(n, dtype=torch.int64)
            base = ((idx + 1000 * a.rank) % 2001 - 1000).to(dt)
            expect = torch.zeros(n, dtype=torch.int64)
            for r in range(a.world):
                expect += (idx + 1000 * r) % 2001 - 1000
            expect = expect.to(dt)
            del idx
            t = torch.empty(n, dtype=dt)
            calls = []
            for k in range(a.warmup + a.reps):
                torch.add(base, k, out=t)
                dist.barrier()
                t0 = time.monotonic()
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
                t1 = time.monotonic()
                want = expect + a.world * k
                wrong = int((t != want).sum().item())
                bad += wrong
                calls.append({
                    "k": k,
                    "warmup": k < a.warmup,
                    "t0": t0,
                    "t1": t1,
                    "wrong": wrong,
                    "sum": int(t.to(torch.int64).sum().item()),
                })
            out["points"].append({"elements": n, "calls": calls})
            del base, expect, t
        dist.barrier()
        dist.destroy_process_group()
        print(json.dumps(out), flush=True)
        return 2 if bad else 0
    except Exception as e:  # report, never hang silently
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        print(json.dumps(out), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
