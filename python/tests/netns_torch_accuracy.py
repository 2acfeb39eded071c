#!/usr/bin/env python3
"""One rank of tests/python_package.rs's accuracy test: DDP training of a
small MLP on scikit-learn's digits (1797 8×8 images shipped in Debian's
python3-sklearn, no download) to a target test accuracy, on backend "gloo"
and on "aggbox" (route "aggbox": every call AggBox can serve through
AggBox), from the same seeds, on the same data in the same order, for the
same number of steps, with float32, float16 and bfloat16 gradients:

- float32: DDP's own allreduce (no hook), on both backends;
- float16: torch's `default_hooks.fp16_compress_hook`, on both;
- bfloat16: torch's `default_hooks.bf16_compress_hook` on "aggbox" (a
  bfloat16 SUM, which AggBox serves; registered as `bf16_hook`, as DDP
  1.13 refuses the name without CUDA and NCCL); Gloo 1.13 has no
  bfloat16, so on "gloo" `bf16_through_float32_hook` below: the same cast
  to bfloat16 and division by W, Gloo's float32 sum of those values,
  rounded back to bfloat16 (what a Gloo user does, and what the backend's
  Gloo path does with bfloat16).

The split: a fixed permutation (seed 0) of the 1797 images, the first 600
the test set, the other 1197 the training set. Each step takes the next 16
× W images of a seeded shuffle of the training set (a new one each epoch,
the same on every rank and backend), rank r the r-th 16 of them.
SGD, lr 0.1, momentum 0.9 (the training example's momentum).

Asserted for each dtype: both runs reach TARGET test accuracy (%) after
--steps steps; their accuracies are within 0.5 points and they classify
at most 3 test images (0.5 %) differently; their final parameters are
within 10⁻⁴ of each other (‖Δ‖/‖p‖) for float32, and for float16 and
bfloat16 within twice what that compression moves Gloo's run from Gloo's
float32 run (a wrong sum the training absorbs, 10⁻³ added to every
element of every result, leaves the accuracy within 0.5 points but not
the parameters or the predictions); every rank's parameters equal every
other's bit for bit in each run (the replicas stay in sync); the
"aggbox" run's calls were all served by AggBox, at least one allreduce a
step, so a silent Gloo fallback cannot pass. Printed: each run's
accuracy, the test images the two runs classify differently, and how far
their parameters are apart after 10 steps and at the end (largest element
difference and ‖Δ‖/‖p‖), beside how far every other run ends from Gloo's
float32 run (what the gradients' own rounding does to this training).

    netns_torch_accuracy.py --rank R --world W --master-addr A --master-port P [--steps N]
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
from reference import rank_parser

TARGET = 95.0  # test accuracy every run must reach, %
MAX_APART = 0.5  # points between the two backends' accuracies
MAX_DIFFER = 3  # test images (0.5 % of them) the two backends may classify differently
F32_APART = 1e-4  # ‖Δ‖/‖p‖ of the float32 runs' final parameters
LR, MOMENTUM = 0.1, 0.9
PER_RANK = 16  # images a rank takes a step
TEST = 600  # images of the test set
EARLY = 10  # the step after which the parameters are compared too


def digits():
    """The images (N, 8, 8, scaled to [0, 1]), the labels, and the
    fixed split's training and test indices."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit(f"{e}: the digits data set is Debian's python3-sklearn (`make deps` installs it)")
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).div_(16)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    return x, y, perm[TEST:], perm[:TEST]


def model():
    """64 → 256 → 10, 19.2 k parameters (75 KiB of float32 gradients: with
    bucket_cap_mb 0.02 several buckets, allreduces, a step). An MLP, not a
    CNN: a small CNN trained the same way amplifies any rounding difference
    until the two backends' runs classify a few test images differently
    (docs/PYTHON.md, the test's entry)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def bf16_through_float32_hook(process_group, bucket):
    """bf16_compress_hook for a Gloo without bfloat16: the bucket cast to
    bfloat16 and divided by W, summed by Gloo in float32, the sum rounded
    to bfloat16 and written back into the bucket."""
    group = process_group if process_group is not None else dist.group.WORLD
    values = bucket.buffer().to(torch.bfloat16).div_(group.size()).float()
    fut = dist.all_reduce(values, group=group, async_op=True).get_future()

    def decompress(fut):
        buf = bucket.buffer()
        buf.copy_(fut.value()[0].to(torch.bfloat16))
        return buf

    return fut.then(decompress)


def bf16_hook(process_group, bucket):
    """torch's `default_hooks.bf16_compress_hook` itself: DDP 1.13 refuses
    a hook of that name unless CUDA 11 and NCCL 2.10 are there (it checks
    the name), though the hook needs only a group that reduces bfloat16."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


# Each dtype's hook on "gloo" and on "aggbox" (None: DDP's own allreduce).
HOOKS = {
    "float32": (None, None),
    "float16": (default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bfloat16": (bf16_through_float32_hook, bf16_hook),
}


def accuracy(m, x, y):
    with torch.no_grad():
        pred = m(x).argmax(dim=1)
    return 100.0 * float((pred == y).double().mean()), pred


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def train(backend, dtype, a, data):
    """--steps steps of DDP on `backend` with `dtype` gradients: the test
    accuracy and predictions, the parameters after EARLY steps and at the
    end, the last loss, and (for "aggbox") the group's counters."""
    options = at.Options(route="aggbox") if backend == "aggbox" else None
    dist.init_process_group(
        backend, init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank, world_size=a.world,
        timeout=timedelta(seconds=60), pg_options=options,
    )
    a.master_port += 1  # the next run's store
    pg = dist.distributed_c10d._get_default_group()
    on_aggbox = isinstance(pg, at.ProcessGroupAggBox)
    assert on_aggbox == (backend == "aggbox"), f"{backend}: the default group is {type(pg).__name__}"
    ref = dist.new_group(list(range(a.world)), backend="gloo")
    m = model()
    ddp = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.02)
    hook = HOOKS[dtype][1 if on_aggbox else 0]
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    x, y, train_idx, test_idx = data
    g = torch.Generator().manual_seed(1)  # the data order, the same on every rank
    batch = PER_RANK * a.world
    order = torch.empty(0, dtype=torch.long)
    before = pg.stats() if on_aggbox else {}
    early, per_step = None, []
    for step in range(a.steps):
        if len(order) < batch:
            order = torch.cat([order, train_idx[torch.randperm(len(train_idx), generator=g)]])
        idx, order = order[:batch], order[batch:]
        mine = idx[a.rank * PER_RANK : (a.rank + 1) * PER_RANK]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        if step + 1 == EARLY:
            early = flat(m)
        if on_aggbox:
            now = pg.stats()
            per_step.append({k: now.get(k, 0) - before.get(k, 0) for k in now if now.get(k, 0) != before.get(k, 0)})
            before = now
    acc, pred = accuracy(m, x[test_idx], y[test_idx])
    final = flat(m)
    # Every rank's replica is the same, bit for bit.
    every = [torch.empty_like(final) for _ in range(a.world)]
    dist.all_gather(every, final, group=ref)
    for r, e in enumerate(every):
        assert torch.equal(e, final), f"{backend} {dtype}: rank {r}'s parameters differ from rank {a.rank}'s by {float((e - final).abs().max()):.3g}"
    served = pg.stats() if on_aggbox else None
    last_loss = float(loss)
    del ddp, opt
    dist.destroy_process_group()
    return acc, pred, early, final, last_loss, served, per_step


def apart(p, q):
    d = p.double() - q.double()
    return float(d.abs().max()), float(d.norm() / q.double().norm())


def main():
    ap = rank_parser()
    ap.add_argument("--steps", type=int, default=600)
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    data = digits()
    print(f"digits: {len(data[2])} training images, {len(data[3])} test images; {a.steps} steps of {PER_RANK} × {a.world} images, "
          f"SGD lr {LR} momentum {MOMENTUM}", flush=True)
    runs = {}
    for dtype in HOOKS:
        for backend in ("gloo", "aggbox"):
            runs[backend, dtype] = train(backend, dtype, a, data)
            acc, _, _, _, last_loss, served, per_step = runs[backend, dtype]
            print(f"{backend} {dtype}: test accuracy {acc:.2f} % after {a.steps} steps (last loss {last_loss:.4f})", flush=True)
            if served is not None:
                print(f"served: {sorted(served.items())}", flush=True)
                assert {path for _, path in served} == {"aggbox"}, f"{dtype}: a call not served by AggBox: {served}"
                for s, d in enumerate(per_step):
                    assert all(path == "aggbox" for _, path in d) and d.get(("allreduce", "aggbox"), 0) >= 1, f"{dtype} step {s}: the counters moved by {d}"
    # The yardstick: how far each other run ends from Gloo's float32 run.
    gloo32 = runs["gloo", "float32"]
    yardstick = {}
    for (backend, dtype), run in runs.items():
        if (backend, dtype) != ("gloo", "float32"):
            f_max, f_rel = apart(run[3], gloo32[3])
            differ = int((run[1] != gloo32[1]).sum())
            yardstick[backend, dtype] = f_rel
            print(f"yardstick: {backend} {dtype} against gloo float32: parameters apart by {f_max:.3g} (‖Δ‖/‖p‖ {f_rel:.3g}), "
                  f"{differ} test images classified differently", flush=True)
    failed = []
    for (backend, dtype), run in runs.items():
        if run[0] < TARGET:
            failed.append(f"{backend} {dtype}: test accuracy {run[0]:.2f} % < {TARGET} % after {a.steps} steps")
    for dtype in HOOKS:
        (ga, gpred, gearly, gfinal, _, _, _), (aa, apred, aearly, afinal, _, _, _) = runs["gloo", dtype], runs["aggbox", dtype]
        differ = int((gpred != apred).sum())
        e_max, e_rel = apart(aearly, gearly)
        f_max, f_rel = apart(afinal, gfinal)
        # float32: the runs stay together; float16, bfloat16: no farther
        # apart than twice what the compression does to Gloo's own run.
        limit = F32_APART if dtype == "float32" else 2 * yardstick["gloo", dtype]
        print(f"{dtype}: accuracy aggbox {aa:.2f} % gloo {ga:.2f} % ({aa - ga:+.2f} points), {differ} of {TEST} test images classified differently; "
              f"parameters apart after {EARLY} steps by {e_max:.3g} (‖Δ‖/‖p‖ {e_rel:.3g}), after {a.steps} by {f_max:.3g} "
              f"(‖Δ‖/‖p‖ {f_rel:.3g}, bound {limit:.3g})", flush=True)
        if abs(aa - ga) > MAX_APART:
            failed.append(f"{dtype}: accuracy aggbox {aa:.2f} % against gloo {ga:.2f} %, more than {MAX_APART} points apart")
        if differ > MAX_DIFFER:
            failed.append(f"{dtype}: {differ} test images classified differently, more than {MAX_DIFFER}")
        if f_rel > limit:
            failed.append(f"{dtype}: parameters apart by ‖Δ‖/‖p‖ {f_rel:.3g} > {limit:.3g}")
    assert not failed, "; ".join(failed)
    print(f"ok: every run reached {TARGET} % and aggbox is within {MAX_APART} points of gloo for float32, float16 and bfloat16", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
