#!/usr/bin/env python3
"""Plots of `aggbox-bench` results: python3 scripts/plot.py RESULTS_DIR.

Reads the JSON files the benchmark writes and saves one PNG per experiment
next to them. Missing files are skipped (an experiment that did not run).
`python3 scripts/plot.py mpi DIR` plots scripts/mpi_bench.sh's CSVs in DIR;
a DIR with `aggbox-bench soak`'s soak_resources.csv gets soak_resources.png.
Needs python3-matplotlib (`make bench` installs it).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(d, name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def save(fig, d, name):
    fig.tight_layout()
    fig.savefig(os.path.join(d, name), dpi=120)
    plt.close(fig)
    print("plot:", os.path.join(d, name))


def err(s):
    """(median, [below, above]) from a Summary with min/max."""
    return s["median"], [s["median"] - s["min"], s["max"] - s["median"]]


def agg(d):
    pts = load(d, "agg_throughput.json")
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"kernel": "AggBox XDP", "plain": "plain UDP", "tuned": "tuned UDP (recvmmsg)", "drop": "XDP count-and-drop ceiling"}
    for mode in ["kernel", "plain", "tuned", "drop"]:
        ps = [p for p in pts if p["mode"] == mode and p["elems_per_s"]["n"] > 0]
        if not ps:
            continue
        x = [p["total_mb"] for p in ps]
        y = [p["elems_per_s"]["median"] / 1e6 for p in ps]
        lo = [(p["elems_per_s"]["median"] - p["elems_per_s"]["min"]) / 1e6 for p in ps]
        hi = [(p["elems_per_s"]["max"] - p["elems_per_s"]["median"]) / 1e6 for p in ps]
        ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=labels[mode],
                    linestyle="--" if mode == "drop" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total data from 4 senders (MB)")
    ax.set_ylabel("aggregated elements/s (millions)")
    ax.set_title("Aggregation throughput (median, min-max)")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, d, "agg_throughput.png")


def bcast(d):
    pts = load(d, "bcast_latency.json")
    if not pts:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = {"aggbox_tc": "AggBox TC", "per_dest_sendto": "per-destination sendto"}
    colors = {"aggbox_tc": "tab:blue", "per_dest_sendto": "tab:orange"}
    for mode in ["aggbox_tc", "per_dest_sendto"]:
        ps = sorted([p for p in pts if p["mode"] == mode and p["payload"] == 1472], key=lambda p: p["receivers"])
        if ps:
            x = [p["receivers"] for p in ps]
            axes[0].plot(x, [p["latency_us"]["mean"] for p in ps], marker="o", color=colors[mode], label=names[mode] + " mean")
            axes[0].plot(x, [p["latency_us"]["p99"] for p in ps], marker="x", color=colors[mode], linestyle="--", label=names[mode] + " p99")
        ps = sorted([p for p in pts if p["mode"] == mode and p["receivers"] == 9], key=lambda p: p["payload"])
        if ps:
            x = [p["payload"] for p in ps]
            axes[1].plot(x, [p["latency_us"]["mean"] for p in ps], marker="o", color=colors[mode], label=names[mode] + " mean")
            axes[1].plot(x, [p["latency_us"]["p99"] for p in ps], marker="x", color=colors[mode], linestyle="--", label=names[mode] + " p99")
    axes[0].set_xlabel("receivers (1472-byte payload)")
    axes[1].set_xlabel("UDP payload bytes (9 receivers)")
    for ax in axes:
        ax.set_ylabel("root send -> last receiver (µs)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Broadcast latency")
    save(fig, d, "bcast_latency.png")


def cpu(d):
    pts = load(d, "cpu_usage.json")
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, label, color in [("kernel", "AggBox XDP", "tab:blue"), ("plain", "plain UDP", "tab:orange")]:
        ps = sorted([p for p in pts if p["mode"] == mode], key=lambda p: p["senders"])
        if ps:
            ax.plot([p["senders"] for p in ps], [p["agg_cpu_pct"]["median"] for p in ps], marker="o", color=color, label=label + " (aggregator)")
            ax.plot([p["senders"] for p in ps], [p["sys_busy_pct"]["median"] for p in ps], marker="x", color=color, linestyle=":", label=label + " (whole VM)")
    ax.set_xlabel("senders")
    ax.set_ylabel("CPU (% of one CPU / of the VM)")
    ax.set_title("Aggregator CPU usage at a fixed per-sender rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, d, "cpu_usage.png")


def simple_modes(d, name, out, xkey, ykey, xlabel, ylabel, title, logx=False, logy=False):
    pts = load(d, name)
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    modes = sorted(set(p["mode"] for p in pts))
    groups = sorted(set(p.get("group", "") for p in pts))
    for g in groups:
        for mode in modes:
            ps = sorted([p for p in pts if p["mode"] == mode and p.get("group", "") == g], key=lambda p: p[xkey])
            if not ps:
                continue
            y = [p[ykey]["median"] for p in ps]
            lo = [p[ykey]["median"] - p[ykey]["min"] for p in ps]
            hi = [p[ykey]["max"] - p[ykey]["median"] for p in ps]
            ax.errorbar([p[xkey] for p in ps], y, yerr=[lo, hi], marker="o", capsize=3,
                        label=(f"{g} " if g else "") + mode)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, d, out)


def training(d):
    t = load(d, "ps_training.json")
    if not t:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"loss_f32": "-", "loss_quantized": "--", "loss_aggbox": ":"}
    for k, label in [("loss_f32", "f32 allreduce (in process)"), ("loss_quantized", "quantized int32 allreduce (in process)"),
                     ("loss_aggbox", "quantized allreduce over AggBox XDP (runtime, 4 namespaces)")]:
        if t.get(k):
            ax.plot(range(len(t[k])), t[k], label=label, linestyle=styles[k], linewidth=2 if k == "loss_aggbox" else 1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Logistic regression, data-parallel workers")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, d, "ps_training.png")


def model(d):
    m = load(d, "scale_model.json")
    if not m:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for curve in m["curves"]:
        ax.plot(curve["workers"], [t * 1e3 for t in curve["time_s"]], label=f"fan-in {curve['fanin']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted aggregation time (ms)")
    ax.set_title(m.get("title", "Scale model"), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, d, "scale_model.png")


def large(d):
    """`aggbox-bench large`: elements/s per backend and MTU, one panel per size."""
    out = load(d, os.path.join("large", "large.json"))
    if not out or not out.get("points"):
        return
    pts = [p for p in out["points"] if p["ok"]]
    if not pts:
        return
    sizes = sorted(set(p["elements"] for p in out["points"]))
    mtus = sorted(set(p["mtu"] for p in out["points"]))
    striped = sorted(set(p["backend"] for p in out["points"] if "-x" in p["backend"]))
    backends = [b for b in ["floor", "kernel", "kernel-node", "socket", "ring", "sharded", "gloo", "openmpi", "kernel-f32", "ring-f32",
                                "sharded-f32", "gloo-f32", "openmpi-f32"] + striped
                if any(p["backend"] == b for p in out["points"])]
    labels = {"floor": "the star's floor (no runtime, no reliability)", "kernel": "AggBox kernel backend (XDP + TC result group)", "kernel-node": "AggBox kernel backend, node-served",
              "socket": "AggBox socket backend", "ring": "AggBox ring (XDP on every member)", "gloo": "torch.distributed Gloo",
              "kernel-f32": "AggBox kernel backend, float32 (adaptive quantization)", "ring-f32": "AggBox ring, float32",
              "sharded": "AggBox sharded star (each worker's node reduces 1/n)", "sharded-f32": "AggBox sharded star, float32",
              "gloo-f32": "Gloo, float32", "openmpi": "Open MPI (MPI_Allreduce, TCP)", "openmpi-f32": "Open MPI, float32"}
    for b in striped:
        base, s = b.split("-x")
        labels[b] = f"AggBox {base} backend, {s} stripes (a job and a thread each)"
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    colors = {b: f"C{i}" for i, b in enumerate(backends)}
    for ax, n in zip(axes[0], sizes):
        # Only the backends measured at this size (the striped points have the largest only).
        here = [b for b in backends if any(p["backend"] == b and p["elements"] == n for p in out["points"])]
        width = 0.8 / max(1, len(here))
        for i, b in enumerate(here):
            xs, ys, lo, hi = [], [], [], []
            for j, m in enumerate(mtus):
                p = next((p for p in pts if p["backend"] == b and p["mtu"] == m and p["elements"] == n), None)
                if p is None:
                    if any(q["backend"] == b and q["mtu"] == m and q["elements"] == n for q in out["points"]):
                        ax.annotate("failed", (j + (i - (len(here) - 1) / 2) * width, 0.02),
                                    xycoords=("data", "axes fraction"), rotation=90, ha="center", va="bottom",
                                    fontsize=8, color="tab:red")
                    continue
                e = p["elems_per_s"]
                xs.append(j + (i - (len(here) - 1) / 2) * width)
                ys.append(e["median"] / 1e6)
                lo.append((e["median"] - e["min"]) / 1e6)
                hi.append((e["max"] - e["median"]) / 1e6)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=labels[b], color=colors[b])
        ax.set_xticks(range(len(mtus)))
        ax.set_xticklabels([str(m) for m in mtus])
        ax.set_xlabel("MTU (bytes)")
        ax.set_ylabel("elements/s per vector (millions)")
        ax.set_title(f"all-reduce of {n:,} elements, {out.get('workers', 4)} workers")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    g = out.get("goal")
    if g:
        fig.suptitle(f"Large frames (median, min-max); kernel vs Gloo at {g['elements']:,}: {g['ratio_best']:.2f}x "
                     f"(goal 2x {'met' if g['met'] else 'not met'})", fontsize=10)
    save(fig, d, os.path.join("large", "large.png"))


def edge(d):
    """`aggbox-bench edge`: each pass over the vector as a multiple of memcpy."""
    e = load(d, "edge.json")
    if not e or not e.get("passes"):
        return
    names = []
    for p in e["passes"]:
        if p["name"] not in names:
            names.append(p["name"])
    pers = sorted(set(p["per_datagram"] for p in e["passes"] if p["per_datagram"]))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(pers))
    whole = [(j, p["vs_memcpy"]) for j, n in enumerate(names) for p in e["passes"]
             if p["name"] == n and p["per_datagram"] == 0]
    if whole:
        ax.bar([j for j, _ in whole], [y for _, y in whole], width, color="tab:gray", label="whole vector")
    for i, per in enumerate(pers):
        xs, ys = [], []
        for j, n in enumerate(names):
            p = next((p for p in e["passes"] if p["name"] == n and p["per_datagram"] == per), None)
            if p is None:
                continue
            xs.append(j + (i - (len(pers) - 1) / 2) * width)
            ys.append(p["vs_memcpy"])
        ax.bar(xs, ys, width, label=f"{per} elements/datagram")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("throughput / memcpy's")
    ax.set_title(f"Runtime passes over {e['elements']:,} elements (memcpy {e['memcpy_gb_per_s']:.1f} GB/s)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    save(fig, d, "edge.png")


def ondemand(d):
    """`aggbox-bench ondemand`: create to first allreduce per world size, the
    node's time per change (its histogram's buckets), and a job on demand
    over the static job per block (latency and XDP time per contribution)."""
    o = load(d, "ondemand.json")
    if not o:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    worlds = sorted(set(t["workers"] for t in o["create_trials"]))
    data = [[t["total_ms"] for t in o["create_trials"] if t["workers"] == w] for w in worlds]
    if data and all(data):
        ax.boxplot(data, whis=(0, 100))
        ax.set_xticks(range(1, len(worlds) + 1))
        ax.set_xticklabels([str(w) for w in worlds])
    ax.axhline(50, color="tab:red", ls="--", lw=0.8, label="goal 50 ms")
    ax.set_xlabel("workers")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Create to first allreduce (min-max)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    ax = axes[1]
    cd = o["create_destroy"]
    b = [(le, n) for le, n in cd["apply_buckets"]]
    labels = ["+Inf" if le is None or le > 1e9 else f"{le:g}" for le, _ in b]
    ax.bar(range(len(b)), [n for _, n in b], color="tab:blue")
    ax.set_xticks(range(len(b)))
    ax.set_xticklabels(labels, rotation=60, fontsize=7)
    ax.set_xlabel("bucket upper bound (ms)")
    ax.set_ylabel("changes")
    ax.set_title(f"Node: apply one change, {cd['cycles']} runs (mean {cd['apply_mean_ms']:.2f} ms)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    phases = o["static_vs_dynamic"]["phases"]
    sizes = sorted(set(p["elements"] for p in phases))
    for i, n in enumerate(sizes):
        blocks = sorted(set(p["block"] for p in phases if p["elements"] == n))
        lat, xdp = [], []
        for blk in blocks:
            ph = {p["job"]: p for p in phases if p["elements"] == n and p["block"] == blk}
            if "static" in ph and "dynamic" in ph:
                lat.append(ph["dynamic"]["median_us"] / ph["static"]["median_us"])
                xdp.append((ph["dynamic"]["xdp_ns"] / ph["dynamic"]["contributions"])
                           / (ph["static"]["xdp_ns"] / ph["static"]["contributions"]))
        ax.scatter([2 * i - 0.15] * len(lat), lat, s=12, color="tab:blue", label="latency" if i == 0 else None)
        ax.scatter([2 * i + 0.15] * len(xdp), xdp, s=12, color="tab:orange", label="XDP ns / contribution" if i == 0 else None)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks([2 * i for i in range(len(sizes))])
    ax.set_xticklabels([f"{n:,} elements" for n in sizes])
    ax.set_ylabel("dynamic / static, per block")
    ax.set_title("Job on demand vs static job", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    save(fig, d, "ondemand.png")


def mpi(d):
    """`scripts/mpi_bench.sh`: latency (log-log) and bandwidth of MPI_Allreduce
    and MPI_Bcast per size, plain MPI against libaggbox_mpi (every call
    through AggBox, and routed per size as measured), one line each per rank
    count; DIR/mpi.png."""
    import csv
    tables = []
    for name, title in [("mpi_allreduce.csv", "MPI_Allreduce int32 SUM"), ("mpi_bcast.csv", "MPI_Bcast from rank 0")]:
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p) as f:
                rows = list(csv.DictReader(f))
            if rows:
                tables.append((title, rows))
    if not tables:
        return
    fig, axes = plt.subplots(len(tables), 2, figsize=(11, 4.2 * len(tables)), squeeze=False)
    for (title, rows), (lat, bw) in zip(tables, axes):
        for impl, ranks in sorted(set((r["mpi"], int(r["ranks"])) for r in rows), key=lambda k: k[1]):
            rs = sorted([r for r in rows if r["mpi"] == impl and int(r["ranks"]) == ranks], key=lambda r: int(r["size_bytes"]))
            x = [int(r["size_bytes"]) for r in rs]
            sides = [("plain", f"plain {impl}", "tab:orange"), ("aggbox", "AggBox", "tab:blue")]
            if rs and "routed_avg_us" in rs[0]:
                sides.append(("routed", "AggBox or PMPI, measured", "tab:green"))
            for side, label, color in sides:
                style = "-" if ranks == min(int(r["ranks"]) for r in rows) else "--"
                y = [float(r[f"{side}_avg_us"]) for r in rs]
                lo = [y_ - float(r[f"{side}_min_us"]) for y_, r in zip(y, rs)]
                hi = [float(r[f"{side}_max_us"]) - y_ for y_, r in zip(y, rs)]
                lat.errorbar(x, y, yerr=[lo, hi], marker="o", ms=3, capsize=2, color=color, linestyle=style,
                             label=f"{label}, {ranks} ranks")
                bw.plot(x, [float(r[f"{side}_mb_per_s"]) for r in rs], marker="o", ms=3, color=color,
                        linestyle=style, label=f"{label}, {ranks} ranks")
        lat.set_xscale("log", base=2)
        lat.set_yscale("log")
        lat.set_ylabel("µs per call (mean over ranks, min-max)")
        lat.set_title(f"{title}: latency", fontsize=10)
        bw.set_xscale("log", base=2)
        bw.set_yscale("log")
        bw.set_ylabel("MB/s (bytes / mean time)")
        bw.set_title(f"{title}: bandwidth", fontsize=10)
        for ax in (lat, bw):
            ax.set_xlabel("message size (bytes)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save(fig, d, "mpi.png")


def soak(d):
    """The soak's resource counts over time (soak_resources.csv), one panel
    each, node h0 and the ring nodes, with the schedule's kills, restarts and
    reloads (soak_events.csv) as vertical lines."""
    import csv
    p = os.path.join(d, "soak_resources.csv")
    if not os.path.exists(p):
        return
    with open(p) as f:
        rows = list(csv.DictReader(f))
    events = []
    pe = os.path.join(d, "soak_events.csv")
    if os.path.exists(pe):
        with open(pe) as f:
            events = list(csv.DictReader(f))

    def num(r, k):
        try:
            return float(r[k])
        except (ValueError, KeyError):
            return float("nan")

    nodes = sorted({r["node"] for r in rows})
    panels = [
        ("rss_mib", "resident memory (MiB)"),
        ("fds", "open descriptors"),
        ("pins", "pins under the pin root"),
        ("udp_ports", "UDP ports held"),
        ("slots", "h0 kernel slots in use"),
        ("loss", "injector: datagrams (cumulative)"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.1 * len(panels)), sharex=True)
    style = {"kill_node": ("red", "-"), "restart_node": ("green", ":"), "reload": ("blue", "--"),
             "kill_worker": ("orange", ":"), "ring_reset": ("purple", "-.")}
    for ax, (key, label) in zip(axes, panels):
        if key == "slots":
            rs = [r for r in rows if r["node"] == "h0"]
            t = [num(r, "t_s") / 60 for r in rs]
            for col, name in [("slots_star", "star"), ("slots_served", "served"), ("slots_spare", "spare"), ("blocks", "blocks")]:
                ax.plot(t, [num(r, col) for r in rs], label=name, lw=1)
        elif key == "loss":
            rs = [r for r in rows if r["node"] == "h0"]
            t = [num(r, "t_s") / 60 for r in rs]
            ax.plot(t, [num(r, "dropped") for r in rs], label="dropped", lw=1)
            ax.plot(t, [num(r, "duplicated") for r in rs], label="duplicated", lw=1)
        else:
            for n in nodes:
                rs = [r for r in rows if r["node"] == n]
                t = [num(r, "t_s") / 60 for r in rs]
                if key == "udp_ports":
                    y = [len([x for x in r["udp_ports"].split(";") if x]) if r["fds"] != "-1" else float("nan") for r in rs]
                else:
                    y = [num(r, key) if r["fds"] != "-1" or key == "pins" else float("nan") for r in rs]
                ax.plot(t, y, label=n, lw=1)
        for e in events:
            if e["kind"] in style:
                c, ls = style[e["kind"]]
                ax.axvline(num(e, "t_s") / 60, color=c, linestyle=ls, lw=0.6, alpha=0.6)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=4)
    axes[-1].set_xlabel("minutes (red: node h0 kill -9, green: restart, blue: reload, orange: worker kill, purple: ring reset)",
                        fontsize=8)
    axes[0].set_title("AggBox production soak: resources over time")
    save(fig, d, "soak_resources.png")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "mpi":
        mpi(sys.argv[2])
        return
    d = sys.argv[1] if len(sys.argv) > 1 else "results"
    agg(d)
    bcast(d)
    cpu(d)
    simple_modes(d, "gemm.json", "gemm.png", "n", "secs", "matrix size N", "time per operation (s)", "Aggregate 4 matrices + GEMM", logx=True, logy=True)
    simple_modes(d, "ps.json", "ps.png", "workers", "secs", "workers", "aggregation time (s)", "Parameter server gradient aggregation")
    simple_modes(d, "wordcount.json", "wordcount.png", "mappers", "words_per_s", "mappers", "words/s", "MapReduce word count")
    simple_modes(d, "bcast_apps.json", "bcast_apps.png", "size", "bcast_us", "input size", "broadcast latency per step (µs)", "Broadcast applications", logx=True)
    training(d)
    model(d)
    large(d)
    edge(d)
    ondemand(d)
    soak(d)


if __name__ == "__main__":
    main()
