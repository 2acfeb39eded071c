#!/usr/bin/env python3
"""Where the XDP aggregation program spends its time, by source line.

`bpftool prog profile` needs hardware counters, which VMs rarely have, and
`perf annotate` of BPF programs needs a perf built with libopcodes. This
needs neither: it samples with perf's cpu-clock while the isolated
benchmark (benches/xdp_chain.rs, XDP_CHAIN_PROFILE=1: 362-element SUM
contributions only, then the floor aggregator) runs, reads the loaded
program's JIT line table (BPF_OBJ_GET_INFO_BY_FD: jited_ksyms,
jited_line_info, line_info) while it is loaded, and maps every sample inside
a function of the program to the source line the verifier's line info
names (`bpftool prog dump xlated linum` supplies the text).

    sudo scripts/xdp_line_profile.py [FRAGMENTS] [--top N]
    sudo scripts/xdp_line_profile.py --loop [TIMES] [--top N]
    sudo scripts/xdp_line_profile.py --live [--top N]

--loop samples the benchmark's warm loops instead (XDP_CHAIN_PROFILE=loop:
one test run of 40,000 distinct contributions through the feeder, src/bpf/
bench_feed.bpf.c, for AggBox and the floor, TIMES times; the feeder's own
samples show as "BPF feed_frags").

--live samples the whole machine (every CPU) while `aggbox-bench agg --reps 1`
runs its live traffic: 4 senders in namespaces, every mode (count-and-drop,
the floor, AggBox, the user-space aggregators) over the same 8 + 32 + 128 +
512 MB, so each XDP aggregator sees the same contributions and its sample
count is its share of the machine. Needs target/release/aggbox-bench
(`cargo build --release --features bench`); takes ~5 minutes.

Prints samples per function of aggbox_xdp, the floor aggregator's samples
(bpf_spin_lock keeps interrupts off, so cpu-clock samples of its critical
section land on the unlock that re-enables them: its function plus
__bpf_spin_unlock_irqrestore) and the N hottest source lines. Sampling
skid moves a sample to the instruction after a slow one (a cache miss shows
on the line after the load). Needs root, perf and bpftool.
"""

import argparse
import bisect
import collections
import ctypes
import glob
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

NR_BPF = 321  # x86_64
BPF_PROG_GET_NEXT_ID = 11
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
INFO_LEN = 232  # struct bpf_prog_info up to attach_btf_id

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, 128)
    r = libc.syscall(NR_BPF, cmd, buf, 128)
    if r < 0:
        raise OSError(ctypes.get_errno(), f"bpf command {cmd}")
    return r, buf.raw


def prog_ids():
    pid = 0
    while True:
        try:
            _, raw = bpf(BPF_PROG_GET_NEXT_ID, struct.pack("III", pid, 0, 0))
        except OSError:
            return
        pid = struct.unpack_from("I", raw, 4)[0]
        yield pid


def prog_info(fd, fields=()):
    b = ctypes.create_string_buffer(INFO_LEN)
    for off, fmt, val in fields:
        struct.pack_into(fmt, b, off, val)
    bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("IIQ", fd, INFO_LEN, ctypes.addressof(b)))
    return b.raw


def line_table(prog_id):
    """[(ksym address, length)] per function and [(jited address, insn)] per line."""
    fd, _ = bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("III", prog_id, 0, 0))
    try:
        raw = prog_info(fd)
        g = lambda off, fmt="I": struct.unpack_from(fmt, raw, off)[0]
        nks, nfl, nli, njli, lrs = g(104), g(108), g(148), g(168), g(172)
        ks = (ctypes.c_uint64 * nks)()
        fl = (ctypes.c_uint32 * nfl)()
        li = ctypes.create_string_buffer(max(1, nli * lrs))
        jli = (ctypes.c_uint64 * njli)()
        prog_info(fd, [(104, "I", nks), (108, "I", nfl), (112, "Q", ctypes.addressof(ks)),
                       (120, "Q", ctypes.addressof(fl)), (148, "I", nli), (152, "Q", ctypes.addressof(li)),
                       (160, "Q", ctypes.addressof(jli)), (168, "I", njli), (172, "I", lrs), (176, "I", 8)])
    finally:
        os.close(fd)
    funcs = [(ks[i], fl[i]) for i in range(nks)]
    lines = sorted((jli[i], struct.unpack_from("I", li.raw, i * lrs)[0]) for i in range(njli))
    return funcs, lines


def xlated_lines(prog_id):
    """Function names in order, and insn index -> 'file:line text'."""
    out = subprocess.run(["bpftool", "prog", "dump", "xlated", "id", str(prog_id), "linum"],
                         check=True, capture_output=True, text=True).stdout
    names, text, cur = [], {}, "?"
    for line in out.splitlines():
        m = re.match(r"^\S.*?(\w+)\(.*\):$", line)
        if m and not line.startswith(";"):
            names.append(m.group(1))
        elif line.startswith(";"):
            f = re.search(r"file:\S*/([^/\s]+) line_num:(\d+)", line)
            src = line[1:line.rfind("[")].strip() if "[" in line else line[1:].strip()
            cur = f"{f.group(1)}:{f.group(2)}  {src}" if f else src
        else:
            m = re.match(r"\s*(\d+):", line)
            if m:
                text[int(m.group(1))] = cur
    return names, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fragments", nargs="?", type=int, default=40000)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--loop", action="store_true", help="sample the warm loops (FRAGMENTS = how many times)")
    ap.add_argument("--live", action="store_true", help="sample every CPU during `aggbox-bench agg --reps 1`")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/perf.data"
        if args.live:
            bench = f"{root}/target/release/aggbox-bench"
            if not os.access(bench, os.X_OK):
                sys.exit(f"xdp_line_profile: {bench} is missing (cargo build --release --features bench)")
            # Every CPU: the XDP programs run in the softirqs of whichever
            # CPU the senders' veth transmits on.
            cmd = ["perf", "record", "-q", "-a", "-e", "cpu-clock", "-F", "4000", "-o", data, "--",
                   bench, "agg", "--reps", "1", "--no-plot", "--out", f"{tmp}/results"]
            env = dict(os.environ)
        else:
            subprocess.run(["cargo", "bench", "--features", "bench", "--bench", "xdp_chain", "--no-run"], cwd=root,
                           check=True, capture_output=True)
            bench = max((p for p in glob.glob(f"{root}/target/release/deps/xdp_chain-*") if not p.endswith(".d")),
                        key=os.path.getmtime)
            cmd = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "20000", "-o", data, "--", bench,
                   str(args.fragments)]
            env = {**os.environ, "XDP_CHAIN_PROFILE": "loop" if args.loop else "1"}
        before = set(prog_ids())
        run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        table = None
        while run.poll() is None and table is None:
            for pid in set(prog_ids()) - before:
                try:
                    names, text = xlated_lines(pid)
                except subprocess.CalledProcessError:
                    continue
                if names and names[0] == "aggbox_xdp" and "fast_join" in names:
                    table = (pid, names, text, *line_table(pid))
                    break
            time.sleep(0.05)
        report, _ = run.communicate()
        if run.returncode != 0 or table is None:
            sys.exit("xdp_line_profile: the benchmark failed or its aggbox_xdp program was not seen loaded")
        print(report, end="")
        _, names, text, funcs, lines = table
        samples = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym,symoff"], check=True,
                                 capture_output=True, text=True).stdout
    addrs = [a for a, _ in lines]
    by_func, by_line, other = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for row in samples.splitlines():
        if not row.strip():
            continue
        total += 1
        s = row.split()[-1]
        m = re.match(r"bpf_prog_[0-9a-f]+_(\w+)\+0x([0-9a-f]+)$", s)
        if not m:
            if s.startswith("__bpf_spin_unlock_irqrestore"):
                other["__bpf_spin_unlock_irqrestore (the floor's locked section)"] += 1
            continue
        name, off = m.group(1), int(m.group(2), 16)
        if name not in names:
            other[f"BPF {name}"] += 1
            continue
        by_func[name] += 1
        base = funcs[names.index(name)][0]
        i = bisect.bisect_right(addrs, base + off) - 1
        by_line[(name, text.get(lines[i][1], "?") if i >= 0 else "?")] += 1
    agg = sum(by_func.values())
    print(f"\n{total} samples; aggbox_xdp and its functions {agg}")
    for name, n in by_func.most_common():
        print(f"  {n:7d} {100 * n / max(agg, 1):5.1f} %  {name}")
    print("other BPF and the floor:")
    for name, n in other.most_common(6):
        print(f"  {n:7d}  {name}")
    floor = other["BPF bench_floor"] + other["__bpf_spin_unlock_irqrestore (the floor's locked section)"]
    if floor:
        print(f"aggbox_xdp / the floor (samples): {agg / floor:.2f}x")
    print(f"hottest source lines of aggbox_xdp (% of its samples):")
    for (name, src), n in by_line.most_common(args.top):
        print(f"  {n:7d} {100 * n / max(agg, 1):5.1f} %  {name:16} {src[:110]}")


if __name__ == "__main__":
    main()
