#!/usr/bin/env python3
"""One rank of the backend sweep (`make bench-python`,
python/examples/backend_testbed.sh): allreduce (SUM) of float32 and
bfloat16 vectors from 4 B to --max-bytes on the backend "aggbox" and on
Gloo, interleaved size by size in the same processes (a Gloo group made
with dist.new_group beside the "aggbox" default group). bfloat16 on Gloo
is what a Gloo user does (Gloo 1.13 refuses it): cast to float32, reduce,
cast back. The "aggbox" group runs with its route policy (AGGBOX_TORCH_ROUTE,
default "measure"): before a size is timed its class's trials are run
(2 · (trials + 1) calls), so the timed calls take the settled route. Prints
per dtype and size the median of the timed calls after a warm-up, the
ratio and the route; --json writes them (rank 0).

    bench_backend.py --rank R --world W --master-addr A [--max-bytes N] [--json FILE]
"""

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import aggbox.torch  # noqa: F401 - registers the backend


def sizes(max_bytes):
    n = 4
    while n < max_bytes:
        yield n
        n *= 16 if n < 1 << 20 else 4
    yield max_bytes


def timed(call, reps):
    call()  # warm-up
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, default=29700)
    ap.add_argument("--max-bytes", type=int, default=100_000_000)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("aggbox", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=120))
    gloo = dist.new_group(list(range(a.world)), backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    settle = 2 * (pg.trials + 1) if pg.route == "measure" else 0
    rows = []
    for dtype in [torch.float32, torch.bfloat16]:
        for nbytes in sizes(a.max_bytes):
            n = max(1, nbytes // (4 if dtype == torch.float32 else 2))
            t = torch.full((n,), 0.5, dtype=dtype)
            reps = 9 if nbytes < 1 << 20 else 3

            def agg():
                dist.all_reduce(t)

            def glo():
                if dtype == torch.bfloat16:
                    w = t.float()
                    dist.all_reduce(w, group=gloo)
                    t.copy_(w)
                else:
                    dist.all_reduce(t, group=gloo)

            for _ in range(settle):
                agg()
            ta, tg = timed(agg, reps), timed(glo, reps)
            nb = n * t.element_size()
            row = {"dtype": str(dtype).replace("torch.", ""), "bytes": nb, "aggbox_s": ta, "gloo_s": tg, "ratio": ta / tg, "route": pg.route}
            for r in pg.routes():
                if r["collective"] == "allreduce" and r["dtype"] == row["dtype"] and r["log2_bytes"] == nb.bit_length() - 1:
                    # The class's settled route and its agreed trial times.
                    row.update(route=r["route"], trial_aggbox_s=r["aggbox_s"], trial_gloo_s=r["gloo_s"])
            rows.append(row)
            if a.rank == 0:
                trials = f"  (trials {row['trial_aggbox_s'] * 1e3:.3f} vs {row['trial_gloo_s'] * 1e3:.3f} ms)" if "trial_gloo_s" in row else ""
                print(f"{row['dtype']:9} {nb:>11} B  aggbox {ta * 1e3:9.3f} ms  gloo {tg * 1e3:9.3f} ms  aggbox/gloo {ta / tg:6.2f}  route {row['route']}{trials}", flush=True)
    served = pg.stats()
    if a.rank == 0:
        print(f"served: {sorted(served.items())}", flush=True)
        print(f"settled: {[(r['dtype'], r['size'], r['route']) for r in pg.routes()]}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": a.world, "route": pg.route, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
