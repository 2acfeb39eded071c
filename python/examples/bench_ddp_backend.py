#!/usr/bin/env python3
"""One rank of the DDP step-time comparison on the backend "aggbox"
(`make bench-python`, python/examples/backend_testbed.sh --script this):
for each model, two copies from one seed are trained side by side in the
same processes, one by DDP on the "aggbox" default group, as an unmodified
script that names the backend would, the other by DDP on a Gloo group
(dist.new_group(backend="gloo")), their steps interleaved (aggbox, gloo,
aggbox, ...) so that both see the same load. Each model gets an "aggbox"
group of its own (dist.new_group(backend="aggbox"), so no model inherits
another's settled routes), which runs its route policy
(AGGBOX_TORCH_ROUTE, default "measure"): the first --settle steps of each
copy are not timed while the group's trials settle each bucket class on
AggBox or Gloo. A model is a torchvision name or `mlp` (a
multilayer perceptron of 10.5 M parameters: 3·32·32 → 512, 32 layers of
512 → 512 (1 MiB of float32 weights each), → 1000: many small parameters
and little computation for their gradients, so its steps are mostly
communication), optionally `:bN` for DDP's bucket_cap_mb=N
(default 25), e.g. resnet18:b1 or mlp:b1 for a model of many 1 MiB
buckets.

Prints per model the median step (forward, backward with DDP's
allreduces, optimizer step; a barrier before each) of both, their ratio,
the settled routes, how the group served its calls, the final losses and
the largest parameter difference; --json writes them (rank 0).

    bench_ddp_backend.py --rank R --world W --master-addr A
        [--models resnet18,resnet34,resnet18:b1] [--steps 10] [--settle 10]
        [--batch 8] [--image 32] [--json FILE]
"""

import argparse
import copy
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

import aggbox.torch  # noqa: F401 - registers the backend

SEED = 1234


def synthetic_batch(rank, step, batch, image):
    """This rank's inputs of `step` and labels that depend on them, so that
    the loss can go down (as python/examples/train_ddp.py)."""
    g = torch.Generator().manual_seed(100_000 * rank + step)
    x = torch.randn(batch, 3, image, image, generator=g)
    half = image // 2
    quadrant = (x[:, :, :half].mean(dim=(1, 2, 3)) > x[:, :, half:].mean(dim=(1, 2, 3))).long()
    y = x.mean(dim=(2, 3)).argmax(1) * 2 + quadrant
    return x, y


def parse_model(spec):
    name, _, cap = spec.partition(":b")
    return name, float(cap) if cap else 25.0


class Copy:
    """One of the two trained copies: its DDP model, optimizer, losses and
    step times."""

    def __init__(self, model, group, cap, lr):
        self.ddp = DDP(model, process_group=group, bucket_cap_mb=cap)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=lr, momentum=0.9)
        self.losses, self.times = [], []

    def step(self, x, y, barrier_group):
        dist.barrier(group=barrier_group)
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = F.cross_entropy(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())


def make_model(name, image):
    if name == "mlp":
        layers = [torch.nn.Flatten(), torch.nn.Linear(3 * image * image, 512), torch.nn.ReLU()]
        for _ in range(32):
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(512, 1000))
    return torchvision.models.__dict__[name]()


def run_model(spec, gloo, a):
    name, cap = parse_model(spec)
    torch.manual_seed(SEED)
    model = make_model(name, a.image)
    pg = dist.new_group(list(range(a.world)), backend="aggbox")
    before = dict(pg.stats())
    copies = {
        "aggbox": Copy(model, pg, cap, a.lr),
        "gloo": Copy(copy.deepcopy(model), gloo, cap, a.lr),
    }
    for step in range(a.settle + a.steps):
        x, y = synthetic_batch(a.rank, step, a.batch, a.image)
        for label in ["aggbox", "gloo"]:
            copies[label].step(x, y, gloo)
        if a.rank == 0:
            print(
                f"{spec} step {step:3d}{' (settling)' if step < a.settle else ''}: "
                + "  ".join(f"{k} {c.times[-1] * 1e3:7.1f} ms loss {c.losses[-1]:.4f}" for k, c in copies.items()),
                flush=True,
            )
    served = {f"{k[0]}:{k[1]}": v - before.get(k, 0) for k, v in pg.stats().items() if v != before.get(k, 0)}
    step_s = {k: statistics.median(c.times[a.settle :]) for k, c in copies.items()}
    spread = {k: [min(c.times[a.settle :]), max(c.times[a.settle :])] for k, c in copies.items()}
    diff = max(
        float((pa.detach() - pg_.detach()).abs().max())
        for pa, pg_ in zip(copies["aggbox"].ddp.parameters(), copies["gloo"].ddp.parameters())
    )
    # DDP allreduces each bucket once a step: the group's allreduce calls
    # over the steps are the model's buckets.
    allreduces = sum(v for k, v in served.items() if k.startswith("allreduce:"))
    return {
        "model": spec,
        "torchvision": name,
        "bucket_cap_mb": cap,
        "parameters": sum(p.numel() for p in model.parameters()),
        "buckets": allreduces / (a.settle + a.steps),
        "workers": a.world,
        "settle_steps": a.settle,
        "steps": a.steps,
        "batch": a.batch,
        "image": a.image,
        "step_s": step_s,
        "step_s_min_max": spread,
        "ratio": step_s["aggbox"] / step_s["gloo"],
        "served": served,
        "routes": [r for r in pg.routes() if r["collective"] == "allreduce"],
        "route": pg.route,
        "final_loss": {k: c.losses[-1] for k, c in copies.items()},
        "max_param_diff": diff,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, default=29700)
    ap.add_argument("--models", default="resnet18,resnet34,resnet18:b1")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each copy")
    ap.add_argument("--settle", type=int, default=10, help="untimed first steps of each copy (the route's trials)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("aggbox", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=300))
    gloo = dist.new_group(list(range(a.world)), backend="gloo")
    results = []
    for spec in a.models.split(","):
        r = run_model(spec, gloo, a)
        results.append(r)
        if a.rank == 0:
            routes = ", ".join(
                f"{c['dtype']} {c['size']}: {c['route']} ({c['aggbox_s'] * 1e3:.1f} vs {c['gloo_s'] * 1e3:.1f} ms)" for c in r["routes"]
            )
            print(
                f"{spec} ({r['parameters'] / 1e6:.1f} M parameters, bucket cap {r['bucket_cap_mb']:g} MB, {a.world} workers): "
                f"step {r['step_s']['aggbox'] * 1e3:.0f} ms aggbox, {r['step_s']['gloo'] * 1e3:.0f} ms gloo, "
                f"aggbox/gloo {r['ratio']:.2f}; served {r['served']}; routes {routes or 'none'}; "
                f"final loss {r['final_loss']['aggbox']:.4f} vs {r['final_loss']['gloo']:.4f}, "
                f"parameters at most {r['max_param_diff']:.2e} apart",
                flush=True,
            )
    if a.rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump({"world": a.world, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
