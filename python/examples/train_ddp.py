#!/usr/bin/env python3
"""One worker of a DDP training run over AggBox: a torchvision model (CPU)
on synthetic data, trained from one seed three times, with DDP's default
Gloo allreduce, with aggbox.torch.allreduce_hook routing every bucket
through AggBox (route "aggbox"), and with the hook's default route policy
("routed": --route, default "measure", AggBox or the process group per
bucket size, whichever the ranks measured faster), then the time of one
allreduce of the whole gradient through Gloo and AggBox. python/examples/ddp_testbed.sh
starts one per worker namespace of a testbed whose node runs only
`aggbox attach`; any other launcher works the same way:

    train_ddp.py --rank R --world W --config node.toml --job J --aggregator A \
                 --master-addr M [--master-port 29700] [--models resnet18] \
                 [--steps 10] [--batch 8] [--image 32] [--json out.json]

Every rank prints its losses; rank 0 prints the comparison and, with --json,
writes the measurements (median time per training step after the first,
median time per gradient allreduce, final losses, largest parameter
difference between the Gloo and AggBox runs). The routed run first takes
the steps its trials need (a step with a trial bucket is a trial step; at
most --max-trial-steps) and then --steps steps: its step time is the median
of those, after the trials; the JSON also has its trial steps, counters and
settled routes.
"""

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

import aggbox
import aggbox.torch

SEED = 1234


def synthetic_batch(rank, step, batch, image):
    """This rank's inputs of `step` and labels that depend on them (the
    brightest channel, and its quadrant), so that the loss can go down."""
    g = torch.Generator().manual_seed(100_000 * rank + step)
    x = torch.randn(batch, 3, image, image, generator=g)
    half = image // 2
    quadrant = (x[:, :, :half].mean(dim=(1, 2, 3)) > x[:, :, half:].mean(dim=(1, 2, 3))).long()
    y = x.mean(dim=(2, 3)).argmax(1) * 2 + quadrant  # 6 of the model's classes
    return x, y


def train(name, hook, comm, a):
    """Trains `name` from SEED with DDP, `hook` "gloo" (DDP's default),
    "aggbox" (the hook, every bucket through AggBox) or "routed" (the hook
    with route policy a.route); returns the losses, the time of each step,
    which steps had trial buckets, the model and the hook's state."""
    torch.manual_seed(SEED)
    # torchvision's 1000 classes: ResNet-18 has 11.7 M parameters, ResNet-34 21.8 M.
    model = torchvision.models.__dict__[name]()
    ddp = DDP(model)
    state = None
    if hook != "gloo":
        state = aggbox.torch.AllreduceState(comm, route="aggbox" if hook == "aggbox" else a.route)
        ddp.register_comm_hook(state, aggbox.torch.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=0.9)
    losses, times, trial_steps = [], [], []
    step = 0
    # Every rank has the same trials at the same buckets, so every rank
    # counts the same trial steps and takes the same number of steps.
    while step - len(trial_steps) < a.steps and len(trial_steps) <= a.max_trial_steps:
        x, y = synthetic_batch(a.rank, step, a.batch, a.image)
        trials = state.trial_buckets if state is not None else 0
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        trial = state is not None and state.trial_buckets > trials
        if trial:
            trial_steps.append(step)
        if a.rank == 0:
            print(
                f"{name} {hook:6s} step {step:3d} loss {losses[-1]:.4f} ({times[-1] * 1e3:.0f} ms){' trial' if trial else ''}",
                flush=True,
            )
        step += 1
    if state is not None:
        assert state.fallback_buckets == 0, "every bucket of a float32 model can go through AggBox"
    return losses, times, trial_steps, model, state


def steady_step_s(times, trial_steps):
    """The median step after the trials (after the first step when there
    were none: its buckets are rebuilt, its caches cold)."""
    if trial_steps:
        after = times[trial_steps[-1] + 1 :]
    else:
        after = times[1:]
    return statistics.median(after or times)


def time_allreduce(comm, n, reps):
    """Median seconds of one allreduce (mean) of an n-element float32 vector
    (the whole gradient): Gloo's and AggBox's, each call after a barrier."""
    buf = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 1e-3
    out = {}
    for label in ["gloo", "aggbox"]:
        ts = []
        for _ in range(reps + 1):  # the first is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            if label == "gloo":
                dist.all_reduce(buf)
                buf.div_(dist.get_world_size())
            else:
                comm.allreduce(buf, op="mean")
            ts.append(time.perf_counter() - t0)
        out[label] = statistics.median(ts[1:])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--config", required=True, help="the node's TOML (the job must be node-served)")
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--aggregator", required=True, help="the node's address")
    ap.add_argument("--master-addr", required=True, help="rank 0's address (Gloo rendezvous)")
    ap.add_argument("--master-port", type=int, default=29700)
    ap.add_argument("--models", default="resnet18", help="comma-separated torchvision models")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--allreduce-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--route", default="measure", help='the routed run\'s policy: "measure", "aggbox" or "baseline"')
    ap.add_argument("--max-trial-steps", type=int, default=40, help="the routed run's trial steps at most")
    ap.add_argument("--json", help="rank 0 writes the measurements here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master_addr}:{a.master_port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=600),
    )
    comm = aggbox.Communicator.from_config(a.config, job=a.job, rank=a.rank, aggregator=a.aggregator, deadline=120.0)
    results = []
    for name in a.models.split(","):
        runs = {hook: train(name, hook, comm, a) for hook in ["gloo", "aggbox", "routed"]}
        params = sum(p.numel() for p in runs["gloo"][3].parameters())
        diff = max(
            float((pg.detach() - pa.detach()).abs().max())
            for pg, pa in zip(runs["gloo"][3].parameters(), runs["aggbox"][3].parameters())
        )
        allreduce = time_allreduce(comm, params, a.allreduce_reps)
        routed = runs["routed"][4]
        r = {
            "model": name,
            "parameters": params,
            "workers": a.world,
            "steps": a.steps,
            "batch": a.batch,
            "image": a.image,
            "step_s": {h: steady_step_s(runs[h][1], runs[h][2]) for h in runs},
            "allreduce_s": allreduce,
            "first_loss": runs["gloo"][0][0],
            "final_loss": {h: runs[h][0][-1] for h in runs},
            "max_param_diff": diff,
            "routed": {
                "policy": routed.route,
                "steps": len(runs["routed"][1]),
                "trial_steps": len(runs["routed"][2]),
                "trial_step_s": statistics.median([runs["routed"][1][i] for i in runs["routed"][2]] or [0.0]),
                "aggbox_buckets": routed.aggbox_buckets,
                "stepped_aside_buckets": routed.stepped_aside_buckets,
                "trial_buckets": routed.trial_buckets,
                "routes": routed.routes(),
            },
        }
        results.append(r)
        if a.rank == 0:
            routes = ", ".join(
                f"{c['size']}: {c['route']} ({c['aggbox_s'] * 1e3:.1f} vs {c['baseline_s'] * 1e3:.1f} ms)" for c in r["routed"]["routes"]
            )
            print(
                f"{name} ({params / 1e6:.1f} M parameters, {a.world} workers): "
                f"step {r['step_s']['gloo'] * 1e3:.0f} ms Gloo, {r['step_s']['aggbox'] * 1e3:.0f} ms AggBox, "
                f"{r['step_s']['routed'] * 1e3:.0f} ms routed ({routed.route}; after {r['routed']['trial_steps']} trial steps "
                f"of {r['routed']['trial_step_s'] * 1e3:.0f} ms; routes {routes or 'none'}); "
                f"gradient allreduce {allreduce['gloo'] * 1e3:.0f} ms Gloo, {allreduce['aggbox'] * 1e3:.0f} ms AggBox; "
                f"loss {r['first_loss']:.4f} -> {r['final_loss']['gloo']:.4f} Gloo, {r['final_loss']['aggbox']:.4f} AggBox, "
                f"{r['final_loss']['routed']:.4f} routed; "
                f"parameters differ by at most {diff:.2e} (Gloo, AggBox)",
                flush=True,
            )
    if a.rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
