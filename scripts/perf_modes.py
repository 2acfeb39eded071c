#!/usr/bin/env python3
"""Where the machine's time goes, per aggregator mode, from the whole-machine
profiles `aggbox-bench` records with AGGBOX_BENCH_PERF=<dir> (one
`<mode>-<round>.data` per run, `perf record -a -g` around the run's window).

    sudo AGGBOX_BENCH_PERF=/tmp/prof AGGBOX_CPU_PARTS=marginal \\
        target/release/aggbox-bench cpu --reps 3 --out /tmp/out
    sudo scripts/perf_modes.py /tmp/prof [--modes drop,floor,kernel] [--top 30]

Prints, per symbol, the mean samples per run of each mode and the difference
of each mode to the first one (the baseline, by default drop). The runs of
one experiment share their length and offered load, so samples per run
compare the modes' CPU time directly; idle (the CPUs halted) is one line.
This VM has no PMU: perf samples with cpu-clock, idle included, which is
what makes the idle line a busy-share check.
"""

import argparse
import collections
import os
import re
import subprocess
import sys

IDLE = re.compile(r"(idle|halt|mwait|cpuidle|poll_idle)", re.I)


def samples_by_symbol(path):
    """{symbol: samples} of one perf.data (self time, no children)."""
    out = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "--no-children", "-g", "none",
         "--sort", "dso,sym", "--percent-limit", "0", "-q", "-n"],
        capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in out.splitlines():
        # "    12.34%      5678  [kernel.kallsyms]  [k] symbol"
        m = re.match(r"\s*([\d.]+)%\s+(\d+)\s+(.*?)\s+\[(.)\]\s+(.*\S)", line)
        if not m:
            continue
        dso, sym = m.group(3), m.group(5)
        if sym.startswith("0x"):
            # no symbol: the binary or JIT region it ran in
            sym = "(" + re.sub(r"\d+", "N", dso) + ")"
        elif sym.startswith("bpf_prog_"):
            # bpf_prog_<tag>_<name>: the tag changes per load, the name does not
            sym = "bpf_prog_" + sym.split("_", 3)[-1]
        if IDLE.search(sym):
            sym = "(idle)"
        counts[sym] += int(m.group(2))
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--modes", default="drop,floor,kernel,plain,tuned",
                    help="modes in column order; the first is the baseline")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    runs = collections.defaultdict(list)
    for name in sorted(os.listdir(args.dir)):
        m = re.match(r"([a-z]+)-(\d+)\.data$", name)
        if m and m.group(1) in modes:
            runs[m.group(1)].append(samples_by_symbol(os.path.join(args.dir, name)))
    modes = [m for m in modes if runs[m]]
    if len(modes) < 2:
        sys.exit(f"{args.dir}: need runs of two modes at least (found {sorted(runs)})")
    mean = {}
    for m in modes:
        total = collections.Counter()
        for c in runs[m]:
            total.update(c)
        mean[m] = {s: v / len(runs[m]) for s, v in total.items()}
    base = modes[0]
    symbols = set().union(*(mean[m].keys() for m in modes))
    spread = lambda s: max(abs(mean[m].get(s, 0) - mean[base].get(s, 0)) for m in modes[1:])
    top = sorted(symbols, key=spread, reverse=True)[: args.top]
    print("runs: " + ", ".join(f"{m} {len(runs[m])}" for m in modes))
    print("samples per run (all CPUs; 999 Hz each):")
    header = f"{'symbol':48s}" + "".join(f"{m:>10s}" for m in modes) + "".join(f"{m + '-' + base:>16s}" for m in modes[1:])
    print(header)
    allrow = {m: sum(mean[m].values()) for m in modes}
    busy = {m: allrow[m] - mean[m].get("(idle)", 0) for m in modes}
    for label, row in (("(all samples)", allrow), ("(busy = all - idle)", busy)):
        print(f"{label:48s}" + "".join(f"{row[m]:10.0f}" for m in modes)
              + "".join(f"{row[m] - row[base]:16.0f}" for m in modes[1:]))
    for s in top:
        print(f"{s[:48]:48s}" + "".join(f"{mean[m].get(s, 0):10.0f}" for m in modes)
              + "".join(f"{mean[m].get(s, 0) - mean[base].get(s, 0):16.0f}" for m in modes[1:]))


if __name__ == "__main__":
    main()
