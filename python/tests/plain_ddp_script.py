#!/usr/bin/env python3
"""A training script that knows nothing of AggBox: it imports torch only
and takes the backend's name on its command line, as PyTorch's examples do
(imagenet's --dist-backend, --dist-url, --world-size, --rank).
tests/python_package.rs runs it under `python -m aggbox.torch.run` with
`--dist-backend aggbox`, unchanged.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser(description="DDP on a synthetic regression")
    ap.add_argument("--dist-backend", default="gloo")
    ap.add_argument("--dist-url", default="env://")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1 + args.rank)
    x = torch.randn(64, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.1
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    losses = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(1))
    dist.barrier()
    print(f"rank {args.rank}: final loss {mean.item():.6f} (ranks {[round(v.item(), 4) for v in losses]})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
