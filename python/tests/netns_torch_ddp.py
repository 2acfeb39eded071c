#!/usr/bin/env python3
"""One rank of tests/python_package.rs's DDP test of the backend "aggbox":
a small CNN with synchronised BatchNorm trained with DDP for --steps SGD
steps from one seed, once on backend "gloo" and once on "aggbox" (a second
init_process_group in the same process), on the same data.

torch 1.13's nn.SyncBatchNorm refuses CPU modules ("SyncBatchNorm layers
only work with GPU modules"), so the model's BatchNorm is synchronised here
the way SyncBatchNorm does it, with dist.all_reduce of the per-channel sums
in the forward pass and of the gradient sums in the backward pass, on the
default process group. DDP adds its own calls: the parameter check
(allgather), the initial broadcast, the buffers' broadcast before every
forward (broadcast_buffers) and a float32 allreduce per gradient bucket
(with the division by the world size).

The bound: each AggBox float32 SUM is within W/(2S) + ½ ulp of the exact
sum (docs/PYTHON.md), about 2^-29 of the largest |x| for 4 ranks, where
Gloo's float32 sum is within 3 roundings (2^-24 each) of it; through 50
SGD steps the runs may drift by what the training amplifies. Stated bound:
every loss within 1e-4 relative of Gloo's at the same step, every
parameter within 1e-4 absolute at the end (measured: printed).
"""

import faulthandler
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import aggbox.torch as at
from reference import rank_parser

LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


class _SyncBN(torch.autograd.Function):
    """Batch norm over every rank's batch (training), SyncBatchNorm's math."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        c = x.shape[1]
        dims = [0, 2, 3]
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), torch.tensor([float(x.numel() // c)])])
        dist.all_reduce(stats)
        count = stats[-1]
        mean = stats[:c] / count
        var = stats[c : 2 * c] / count - mean * mean
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean[None, :, None, None]) * invstd[None, :, None, None]
        ctx.save_for_backward(xhat, weight, invstd, count)
        unbiased = var * count / (count - 1)
        ctx.mark_non_differentiable(mean, unbiased)
        return xhat * weight[None, :, None, None] + bias[None, :, None, None], mean, unbiased

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xhat, weight, invstd, count = ctx.saved_tensors
        dims = [0, 2, 3]
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
        sums = local.clone()
        dist.all_reduce(sums)
        c = xhat.shape[1]
        mean_dy = sums[:c] / count
        mean_dy_xhat = sums[c:] / count
        dx = (dy - mean_dy[None, :, None, None] - xhat * mean_dy_xhat[None, :, None, None]) * (weight * invstd)[None, :, None, None]
        # This rank's share of the parameters' gradients: DDP sums them
        # over the ranks (and divides by W, as for every gradient).
        return dx, local[c:], local[:c], None


class SyncBN(nn.BatchNorm2d):
    def forward(self, x):
        if not self.training:
            return super().forward(x)
        y, mean, var = _SyncBN.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
            self.num_batches_tracked += 1
        return y


def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), SyncBN(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), SyncBN(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 10),
    )


def train(backend, a, data):
    dist.init_process_group(
        backend, init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank, world_size=a.world,
        timeout=timedelta(seconds=60),
    )
    a.master_port += 1  # the next run's store
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = data
    losses = []
    for step in range(a.steps):
        i = (step * 16) % x.shape[0]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[i : i + 16]), y[i : i + 16])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / a.world)
    pg = dist.distributed_c10d._get_default_group()
    served = pg.stats() if isinstance(pg, at.ProcessGroupAggBox) else None
    params = [p.detach().clone() for p in m.parameters()] + [b.detach().clone() for b in m.buffers() if b.is_floating_point()]
    del ddp, opt
    dist.destroy_process_group()
    return losses, params, served


def main():
    ap = rank_parser()
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(100 + a.rank)
    x = torch.randn(256, 1, 16, 16, generator=g)
    y = (x.mean(dim=(1, 2, 3)) * 40).clamp(-4.9, 4.9).add(5).long()
    gloo_losses, gloo_params, _ = train("gloo", a, (x, y))
    agg_losses, agg_params, served = train("aggbox", a, (x, y))
    print(f"losses gloo {gloo_losses[0]:.5f} -> {gloo_losses[-1]:.5f}, aggbox {agg_losses[0]:.5f} -> {agg_losses[-1]:.5f}", flush=True)
    print(f"served: {sorted(served.items())}", flush=True)
    for k in ["allreduce", "broadcast", "allgather"]:
        assert served.get((k, "aggbox"), 0) > 0, f"no {k} served by AggBox: {served}"
    assert not any(path == "gloo" for _, path in served), f"a call fell back to Gloo: {served}"
    worst_loss = max(abs(p - q) / abs(q) for p, q in zip(agg_losses, gloo_losses))
    worst_param = max(float((p - q).abs().max()) for p, q in zip(agg_params, gloo_params))
    print(f"worst loss difference {worst_loss:.3g} relative (bound {LOSS_RTOL}), parameters differ by {worst_param:.3g} (bound {PARAM_ATOL})", flush=True)
    assert worst_loss <= LOSS_RTOL, "losses apart"
    assert worst_param <= PARAM_ATOL, "parameters apart"
    assert agg_losses[-1] < 0.8 * agg_losses[0], f"no training: {agg_losses[0]} -> {agg_losses[-1]}"
    print("ok: aggbox and gloo agree", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
