#!/usr/bin/env python3
"""One rank of the Gloo-path comparison (`make bench-python`,
python/examples/backend_testbed.sh --script): float32 allreduce (SUM) from
4 B to --max-bytes (×4 a step) on an "aggbox" group with route "gloo"
(every call AggBox could serve goes to Gloo: the backend's own Gloo path)
and on a plain Gloo group, in the same processes, interleaved call by call:
each pair of calls is one on each group, the order alternating pair by
pair, back to back with no barrier (as a training loop issues them). Every
call is timed on every rank; the JSON keeps rank 0's times, raw.

Per size it prints the median and the 10th/90th percentile of each path,
the ratio of the medians, the median of the pairs' ratios (each call over
its neighbour on the other group: what load that comes and goes does to
both cancels) with its quartiles, and the spread of the ratio of the
medians over the run: the pairs cut into --blocks consecutive blocks, the
lowest and highest ratio of a block's medians. The group's counters must show every call of the route
"gloo" group stepped aside (so the path timed is the one meant).

    bench_gloo_path.py --rank R --world W --master-addr A [--max-bytes N] [--quick] [--json FILE]
"""

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist

import aggbox.torch as at


def sizes(max_bytes):
    n = 4
    while n <= max_bytes:
        yield n
        n *= 4


def pairs_for(nbytes, quick):
    """Pairs per size: enough for a median that moves by less than the
    ratios it is to show, within about a minute for the whole sweep."""
    n = 300 if nbytes <= 64 << 10 else 100 if nbytes <= 1 << 20 else 30 if nbytes <= 4 << 20 else 15
    return max(10, n // 3) if quick else n


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, default=29710)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a third of the pairs")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=120))
    plain = dist.distributed_c10d._get_default_group()
    agg = dist.new_group(list(range(a.world)), backend="aggbox", pg_options=at.Options(route="gloo"))
    assert isinstance(agg, at.ProcessGroupAggBox) and agg.route == "gloo", agg
    load = os.getloadavg()
    rows = []
    for nbytes in sizes(a.max_bytes):
        t = torch.full((nbytes // 4,), 0.5)
        groups = {"aggbox": agg, "gloo": plain}
        for g in groups.values():
            for _ in range(3):  # warm-up
                dist.all_reduce(t, group=g)
        times = {k: [] for k in groups}
        pairs = pairs_for(nbytes, a.quick)
        for i in range(pairs):
            for k in (("aggbox", "gloo") if i % 2 == 0 else ("gloo", "aggbox")):
                t0 = time.perf_counter()
                dist.all_reduce(t, group=groups[k])
                times[k].append(time.perf_counter() - t0)
        ta, tg = times["aggbox"], times["gloo"]
        per = max(1, pairs // a.blocks)
        paired = [x / y for x, y in zip(ta, tg)]
        blocks = [statistics.median(ta[b:b + per]) / statistics.median(tg[b:b + per]) for b in range(0, pairs - per + 1, per)]
        row = {
            "bytes": nbytes,
            "pairs": pairs,
            "aggbox_median_s": statistics.median(ta),
            "gloo_median_s": statistics.median(tg),
            "aggbox_p10_s": pct(ta, 0.1),
            "aggbox_p90_s": pct(ta, 0.9),
            "gloo_p10_s": pct(tg, 0.1),
            "gloo_p90_s": pct(tg, 0.9),
            "ratio": statistics.median(ta) / statistics.median(tg),
            "pair_ratio_median": statistics.median(paired),
            "pair_ratio_p25": pct(paired, 0.25),
            "pair_ratio_p75": pct(paired, 0.75),
            "ratio_blocks_min": min(blocks),
            "ratio_blocks_max": max(blocks),
            "aggbox_s": [round(x, 7) for x in ta],
            "gloo_s": [round(x, 7) for x in tg],
        }
        rows.append(row)
        if a.rank == 0:
            print(f"{nbytes:>9} B  route gloo {row['aggbox_median_s'] * 1e3:8.3f} ms [{row['aggbox_p10_s'] * 1e3:.3f}, "
                  f"{row['aggbox_p90_s'] * 1e3:.3f}]  plain Gloo {row['gloo_median_s'] * 1e3:8.3f} ms [{row['gloo_p10_s'] * 1e3:.3f}, "
                  f"{row['gloo_p90_s'] * 1e3:.3f}]  ratio {row['ratio']:.3f} (blocks {min(blocks):.3f}..{max(blocks):.3f})  "
                  f"pairs {row['pair_ratio_median']:.3f} [{row['pair_ratio_p25']:.3f}, {row['pair_ratio_p75']:.3f}]", flush=True)
    served = agg.stats()
    calls = sum(3 + r["pairs"] for r in rows)
    assert served == {("allreduce", "stepped_aside"): calls}, f"the route gloo group served {served}, not {calls} stepped aside"
    if a.rank == 0:
        print(f"served: {sorted(served.items())}; load average at the start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({
                    "what": "float32 allreduce SUM: the aggbox group with route gloo against a plain Gloo group, interleaved call by call",
                    "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "loadavg_at_start": load},
                    "world": a.world,
                    "torch": torch.__version__,
                    "rows": rows,
                }, f)
                f.write("\n")
    dist.destroy_process_group(agg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
