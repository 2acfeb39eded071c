#!/usr/bin/env python3
"""One rank of tests/python_package.rs's fp16 compression test: DDP with
torch's own `default_hooks.fp16_compress_hook` registered, trained for
--steps SGD steps from one seed on backend "gloo" and then on "aggbox"
(route "aggbox": every allreduce through AggBox), on the same data.

The hook casts each gradient bucket to float16, divides it by W in
float16, allreduces it (SUM) and casts the result back into the bucket.
Every step, every rank's own gradient of every parameter (taken by a
tensor hook before DDP's reducer sees it) is gathered through a Gloo group
beside the run, so each rank knows the exact sum S (float64) of the ranks'
float16 values the hook reduced; the gradient DDP left in each parameter
must be within its path's bound of S:

- AggBox (float16 SUM, docs/PYTHON.md "Error bounds"): the quantization's
  bound for the ranks' largest |x| (`pg.float_error_bound`), float32's
  rounding, then float16's: ½ ulp_float16 of the result (2^-11 of it,
  2^-25 for subnormals);
- Gloo: its float16 sum, W − 1 additions each rounded to float16:
  (W − 1) · (2^-11 · Σ_r |x_r| + 2^-25).

At the end every parameter of the two runs agrees within twice the sum over
the steps of lr × (both runs' bounds of that element) plus a float32
rounding of the parameter per step (the factor 2: what the steps after the
first add by starting from parameters already that far apart; measured:
printed), the losses agree within 1e-3 relative, and the "aggbox" group's
counters show every allreduce, broadcast and allgather it served as served
by AggBox, at least one allreduce per step.

    netns_torch_fp16_hook.py --rank R --world W --master-addr A --master-port P [--steps N]
"""

import faulthandler
import signal
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import aggbox.torch as at
from reference import float_tolerance, rank_parser

LR = 0.1
LOSS_RTOL = 1e-3
F16_ROUND, F16_SUBNORMAL = 2.0**-11, 2.0**-25


def model():
    torch.manual_seed(0)
    # 285 k parameters: DDP's first bucket (1 MiB) and, from the second
    # step on, more of --bucket-cap-mb, so several buckets a step.
    return nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10))


def gloo_bound(xs):
    """Gloo's float16 sum of the ranks' float16 values `xs` (float64 numpy):
    W − 1 roundings to float16 of partial sums at most Σ|x| each."""
    return (len(xs) - 1) * (F16_ROUND * np.sum(np.abs(np.stack(xs)), axis=0) + F16_SUBNORMAL)


def train(backend, a, data, options=None):
    """`a.steps` steps of DDP with the fp16 hook on `backend`: the losses,
    the parameters, the per-element sum over the steps of lr × the path's
    bound, the worst error / bound of a step, and (for "aggbox") the
    counters' change by step."""
    dist.init_process_group(
        backend, init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank, world_size=a.world,
        timeout=timedelta(seconds=60), pg_options=options,
    )
    a.master_port += 1  # the next run's store
    pg = dist.distributed_c10d._get_default_group()
    on_aggbox = isinstance(pg, at.ProcessGroupAggBox)
    ref = dist.new_group(list(range(a.world)), backend="gloo")
    m = model()
    params = list(m.parameters())
    local = {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().clone()))
    ddp = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.25)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    x, y = data
    losses, steps = [], []
    drift = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    worst = 0.0
    before = pg.stats() if on_aggbox else {}
    for step in range(a.steps):
        i = (step * 16) % x.shape[0]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[i : i + 16]), y[i : i + 16])
        loss.backward()
        # Every rank's own gradients, exactly (float32 through Gloo's allgather).
        mine = torch.cat([local[k].reshape(-1) for k in range(len(params))])
        every = [torch.empty_like(mine) for _ in range(a.world)]
        dist.all_gather(every, mine, group=ref)
        xs = [e.to(torch.float16).div_(a.world).double().numpy() for e in every]  # what the hook reduced
        want = np.sum(np.stack(xs), axis=0)
        got = torch.cat([p.grad.reshape(-1) for p in params]).double().numpy()
        tol = float_tolerance(pg, "float16", "sum", xs, want) if on_aggbox else gloo_bound(xs)
        err = np.abs(got - want)
        if (err > tol).any():
            k = int(np.argmax(err > tol))
            raise AssertionError(f"{backend} step {step}: gradient element {k}: {got[k]!r} vs exact {want[k]!r}, error {err[k]:.3g} > bound {tol[k]:.3g}")
        worst = max(worst, float(np.max(err / np.maximum(tol, 1e-300))))
        o = 0
        for d, p in zip(drift, params):
            d += LR * torch.from_numpy(tol[o : o + p.numel()])
            o += p.numel()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ref)
        losses.append(mean.item() / a.world)
        if on_aggbox:
            now = pg.stats()
            steps.append({k: now.get(k, 0) - before.get(k, 0) for k in now if now.get(k, 0) != before.get(k, 0)})
            before = now
    served = pg.stats() if on_aggbox else None
    out = [p.detach().clone() for p in params]
    del ddp, opt
    dist.destroy_process_group()
    return losses, out, drift, worst, served, steps


def main():
    ap = rank_parser()
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(200 + a.rank)
    x = torch.randn(16 * a.steps, 32, generator=g)
    y = x[:, :10].argmax(dim=1)  # learnable: the loss falls
    gl, gp, gd, gworst, _, _ = train("gloo", a, (x, y))
    print(f"ok: gloo run, every gradient within Gloo's float16 bound of the exact sum (worst {gworst:.2f} of it)", flush=True)
    al, ap_, ad, aworst, served, steps = train("aggbox", a, (x, y), at.Options(route="aggbox"))
    print(f"ok: aggbox run, every gradient within AggBox's float16 bound of the exact sum (worst {aworst:.2f} of it)", flush=True)
    print(f"served: {sorted(served.items())}", flush=True)
    assert {path for _, path in served} == {"aggbox"}, f"a call not served by AggBox: {served}"
    for k in ("allreduce", "broadcast", "allgather"):
        assert served.get((k, "aggbox"), 0) > 0, f"no {k} served by AggBox: {served}"
    # Each step: its buckets' allreduces (after the first step DDP rebuilds
    # its buckets, broadcasting their order), every one through AggBox.
    for s, d in enumerate(steps):
        assert all(path == "aggbox" for _, path in d) and d.get(("allreduce", "aggbox"), 0) >= 1, f"step {s}: the counters moved by {d}"
    per_step = [d.get(("allreduce", "aggbox"), 0) for d in steps]
    worst_param = 0.0
    for p, q, d1, d2 in zip(ap_, gp, ad, gd):
        bound = 2 * (d1 + d2) + a.steps * 2.0**-24 * q.double().abs().reshape(-1)
        diff = (p.double() - q.double()).abs().reshape(-1)
        assert (diff <= bound).all(), f"parameters apart: {float(diff.max()):.3g} > {float(bound[diff.argmax()]):.3g}"
        worst_param = max(worst_param, float((diff / bound.clamp_min(1e-300)).max()))
    worst_loss = max(abs(p - q) / abs(q) for p, q in zip(al, gl))
    print(f"parameters apart by {max(float((p - q).abs().max()) for p, q in zip(ap_, gp)):.3g} ({worst_param:.2f} of their bound); "
          f"losses {gl[0]:.5f} -> {gl[-1]:.5f} (gloo), {al[0]:.5f} -> {al[-1]:.5f} (aggbox), {worst_loss:.3g} relative apart", flush=True)
    assert worst_loss <= LOSS_RTOL, "losses apart"
    print(f"ok: fp16_compress_hook on aggbox agrees with gloo (allreduces by step {per_step})", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
