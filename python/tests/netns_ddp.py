#!/usr/bin/env python3
"""One worker of tests/python_netns.rs's DDP test: the same small model
trained with DDP twice from the same seed on the same synthetic data, once
with the default Gloo allreduce and once with aggbox.torch.allreduce_hook,
over a node that runs only `aggbox attach`.

    netns_ddp.py --rank R --world W --config node.toml --aggregator A --job J \
                 --master-addr M --master-port P [--steps 40]

The hook runs with the default route policy, "measure": each size class of
the float32 buckets is tried through AggBox and through the process group,
then settled on the one the ranks measured faster. Checked:
- every float32 bucket the hook averages (through AggBox or the process
  group) is within the documented bound of the exact mean (computed beside
  it with Gloo on a copy): |result - exact| <= comm.float_error_bound(max|g|,
  mean=True) plus the two results' float32 rounding;
- the model's float64 head goes through the hook's fallback (the process
  group's allreduce); the float32 buckets through AggBox or stepped aside,
  and the two counters add up to the buckets checked; every settled class
  had its trials through both routes; the classes settle within the first
  half of the steps; a bucket of a settled class takes its settled route;
- every rank settled the same classes on the same routes with the same
  agreed times (gathered through the process group);
- after the steps, every parameter of the two runs agrees within the sum over
  the steps of lr x that per-step bound (x2 for the second-order effect of
  gradients taken at slightly different parameters) plus one float32 rounding
  of the parameter per step, and the two loss curves agree step by step and
  decrease;
- then a few steps each with the plain hook and the route policies
  "baseline" (no bucket through AggBox) and "aggbox" (every float32 bucket
  through AggBox, no trials), whose losses match the Gloo run's.

Prints JSON-ish lines; exits non-zero on a failure.
"""

import argparse
import datetime
import faulthandler
import gc
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import aggbox
import aggbox.torch as aggbox_torch
from reference import tolerance

LR = 0.05
BATCH = 32
FIXED_STEPS = 3  # steps of each fixed route policy


class SmallNet(nn.Module):
    """A small CNN (float32) with a float64 head, so that DDP makes buckets
    of both dtypes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 64)
        self.head = nn.Linear(64, 10).double()

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc(x.flatten(1)))
        return self.head(x.double())


def batch(rank, step):
    """Synthetic data: inputs of this rank and step, labelled by the channel
    with the largest mean (learnable in a few dozen steps)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    return x, x.mean(dim=(2, 3)).argmax(1)


class CheckingState(aggbox_torch.AllreduceState):
    """The hook's state plus what the check found."""

    def __init__(self, comm):
        super().__init__(comm, route="measure")
        self.step_bound = 0.0  # the largest per-element bound of this step
        self.worst_ratio = 0.0  # the largest error / bound seen
        self.checked = 0
        self.followed = 0  # buckets of a settled class that took its route


def checking_hook(state, bucket):
    """aggbox.torch.allreduce_hook, checked against the exact mean."""
    t = bucket.buffer()
    if not aggbox_torch.served_by_aggbox(t):
        return aggbox_torch.allreduce_hook(state, bucket)
    world = dist.get_world_size()
    exact = t.detach().to(torch.float64)
    dist.all_reduce(exact)
    exact /= world
    m = t.detach().abs().max().reshape(1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)

    # The route this bucket's class settled on, if it has: the bucket must take it.
    settled = {(c["dtype"], c["log2_bytes"]): c["route"] for c in state.routes()}
    route = settled.get(("float32", aggbox.Tuner.size_class(t.numel() * t.element_size())))
    before = state.aggbox_buckets
    fut = aggbox_torch.allreduce_hook(state, bucket)
    took = "aggbox" if state.aggbox_buckets > before else "baseline"
    if route is not None:
        assert took == route, f"bucket {bucket.index()}: settled {route}, took {took}"
        state.followed += 1
    if took == "aggbox":
        bound = state.comm.float_error_bound(float(m), mean=True)
    else:
        # Gloo's float32 sum: W-1 additions, each rounded by at most 2^-24
        # of a partial sum (at most W max|g|), then divided by W.
        bound = world * float(m) * 2.0**-24
    tol = tolerance(bound, exact)
    # What the two runs' averaged gradients may differ by: this bound, and
    # the float32 roundings of both results (Gloo adds in float32).
    state.step_bound = max(state.step_bound, bound + float(m) * 2.0**-22)

    def compare(fut):
        got = fut.value()
        err = (got.to(torch.float64) - exact).abs()
        ratio = float((err / tol).max())
        state.worst_ratio = max(state.worst_ratio, ratio)
        state.checked += 1
        if ratio > 1.0:
            raise AssertionError(f"bucket {bucket.index()} ({took}): error {float(err.max()):.3e} beyond the bound {bound:.3e}")
        return got

    return fut.then(compare)


def make_model():
    torch.manual_seed(1234)
    return SmallNet()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--aggregator", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    # The test harness sends SIGUSR1 to a worker past its deadline before
    # killing it: every thread's stack goes to the log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    r = a.rank
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master_addr}:{a.master_port}",
        rank=r,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=120),
    )
    comm = aggbox.Communicator.from_config(a.config, job=a.job, rank=r, aggregator=a.aggregator, deadline=30.0)

    # Small buckets: several per step, so that their order matters (DDP
    # documents the first bucket's size as this attribute).
    dist._DEFAULT_FIRST_BUCKET_BYTES = 20_000
    gloo = DDP(make_model(), bucket_cap_mb=0.05)
    agg = DDP(make_model(), bucket_cap_mb=0.05)
    state = CheckingState(comm)
    agg.register_comm_hook(state, checking_hook)
    opt_g = torch.optim.SGD(gloo.parameters(), lr=LR)
    opt_a = torch.optim.SGD(agg.parameters(), lr=LR)

    losses_g, losses_a = [], []
    drift_bound = 0.0
    trials_at = []  # trial buckets after each step
    for step in range(a.steps):
        x, y = batch(r, step)
        for model, opt, losses in [(gloo, opt_g, losses_g), (agg, opt_a, losses_a)]:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        drift_bound += LR * state.step_bound
        state.step_bound = 0.0
        trials_at.append(state.trial_buckets)

    # Each step moves the parameters by lr x the averaged gradient, which
    # differs between the runs by at most the step's bound (x2: gradients
    # taken at slightly different parameters), and rounds each parameter to
    # float32 (one ulp, at most 2^-23 |p|, between the runs).
    worst, worst_ratio = 0.0, 0.0
    for (name, pg), (_, pa) in zip(gloo.module.named_parameters(), agg.module.named_parameters()):
        pg, pa = pg.detach().double(), pa.detach().double()
        d = (pg - pa).abs()
        tol = 2 * drift_bound + a.steps * 2.0**-23 * torch.maximum(pg.abs(), pa.abs())
        worst = max(worst, float(d.max()))
        worst_ratio = max(worst_ratio, float((d / tol).max()))
    routes = state.routes()
    print(
        f"rank {r}: buckets aggbox {state.aggbox_buckets} stepped aside {state.stepped_aside_buckets} "
        f"fallback {state.fallback_buckets} (trials {state.trial_buckets}, of settled classes "
        f"{state.followed}), checked {state.checked} (worst error/bound {state.worst_ratio:.3f}); "
        "routes "
        + ", ".join(f"{c['dtype']} {c['size']}: {c['route']} ({c['aggbox_s'] * 1e3:.2f} vs {c['baseline_s'] * 1e3:.2f} ms)" for c in routes)
        + "; "
        f"parameters differ by {worst:.3e} (at most {worst_ratio:.3f} of the bound); "
        f"loss {losses_g[0]:.4f} -> gloo {losses_g[-1]:.4f}, aggbox {losses_a[-1]:.4f}",
        flush=True,
    )
    steps = a.steps
    assert state.fallback_buckets >= steps, "the float64 head went through the fallback"
    assert state.checked == state.aggbox_buckets + state.stepped_aside_buckets, (
        "every float32 bucket was checked, and went through AggBox or stepped aside"
    )
    assert state.checked > steps, "several float32 buckets a step"
    # Every rank settled the same classes on the same routes, from the same
    # agreed times.
    everyone = [None] * a.world
    dist.all_gather_object(everyone, routes)
    assert all(o == routes for o in everyone), f"ranks settled differently: {everyone}"
    assert routes, "the float32 buckets' size classes settled"
    # Each settled class had a warm-up and `trials` trials through each route.
    per_route = (state.tuner.trials + 1) * len(routes)
    assert state.aggbox_buckets >= per_route and state.stepped_aside_buckets >= per_route, (
        f"trials through both routes: aggbox {state.aggbox_buckets}, stepped aside {state.stepped_aside_buckets}"
    )
    assert state.trial_buckets >= 2 * per_route
    assert trials_at[steps // 2] == trials_at[-1], f"trials went on in the second half: {trials_at}"
    assert state.followed == state.checked - state.trial_buckets > 0, "the buckets after the trials took the settled routes"
    assert worst_ratio <= 1.0, f"parameters differ by {worst:.3e}, beyond the bound"
    for s, (lg, la) in enumerate(zip(losses_g, losses_a)):
        assert abs(lg - la) <= 1e-4 * abs(lg) + 1e-6, f"step {s}: loss gloo {lg} aggbox {la}"
    first, last = sum(losses_g[:5]) / 5, sum(losses_g[-5:]) / 5
    assert last < 0.8 * first, f"the loss went down: {first:.4f} -> {last:.4f}"
    # The hook itself, as users register it (DDP checks its annotations),
    # with the fixed route policies, for a few steps that train like Gloo's.
    fixed = {}
    for policy in ["baseline", "aggbox"]:
        model = DDP(make_model(), bucket_cap_mb=0.05)
        st = aggbox_torch.AllreduceState(comm, route=policy)
        model.register_comm_hook(st, aggbox_torch.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(FIXED_STEPS):
            x, y = batch(r, step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            lg = losses_g[step]
            assert abs(loss.item() - lg) <= 1e-4 * abs(lg) + 1e-6, f"{policy}, step {step}: loss {loss.item()}, gloo {lg}"
        fixed[policy] = model
        print(
            f"rank {r}: route {policy}: buckets aggbox {st.aggbox_buckets} stepped aside "
            f"{st.stepped_aside_buckets} fallback {st.fallback_buckets} trials {st.trial_buckets}",
            flush=True,
        )
        assert st.fallback_buckets >= FIXED_STEPS and st.trial_buckets == 0 and st.routes() == []
        if policy == "baseline":
            assert st.aggbox_buckets == 0 and st.stepped_aside_buckets > FIXED_STEPS, "no bucket through AggBox"
        else:
            assert st.stepped_aside_buckets == 0 and st.aggbox_buckets > FIXED_STEPS, "every float32 bucket through AggBox"
    # Gloo's process group is destroyed with the last DDP model that holds
    # it: at interpreter exit that can be after the peers have gone, and
    # torch 1.13's teardown then may wait forever. So every rank gets here
    # (barrier) and drops the models while all peers are still connected.
    dist.barrier()
    del gloo, agg, fixed, model, opt, opt_g, opt_a
    gc.collect()
    comm.close()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
