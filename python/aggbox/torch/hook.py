"""A PyTorch DDP communication hook that averages gradients through AggBox,
or through the process group where that is faster.

    import aggbox, aggbox.torch
    comm = aggbox.Communicator.from_config(path, job=11, rank=rank, aggregator=node)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(aggbox.torch.AllreduceState(comm), aggbox.torch.allreduce_hook)

DDP calls the hook once per gradient bucket (a flat tensor, ``bucket.buffer()``)
and waits for the future it returns before the optimizer step. The hook
(torch 1.13 API, ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``):

- float32 buckets on the CPU: one AggBox allreduce with op "mean" in place on
  the bucket (quantized; error bound ``comm.float_error_bound(max|g|, mean=True)``
  per element, docs/PYTHON.md). The runtime fragments a bucket of any size
  itself, so a bucket is one call; a communicator built over several jobs
  (``from_config(job=[11, 12])``) stripes each bucket over them.
- int32 buckets on the CPU: AggBox allreduce with op "avg" (the runtime's
  integer mean, truncated toward zero). DDP itself only has floating-point
  gradients; this is for hooks used on other tensors.
- anything else (float16, bfloat16, float64, int64, ..., and tensors not on the
  CPU): the fallback, the process group's own allreduce divided by its size,
  which is what DDP does without a hook (integers: truncated toward zero).

AggBox or the process group: the buckets AggBox could serve (the first two
kinds) are routed by the state's route policy (``AllreduceState(route=...)``,
else the environment variable AGGBOX_TORCH_ROUTE): "measure" (the default)
times both on the first buckets of each dtype and size class and then takes
the one the ranks measured faster (``aggbox.Tuner``, the runtime's
``tuner``: the slowest rank's fastest trial of each decides), "aggbox"
takes AggBox always, "baseline" the process group's allreduce always. A
bucket routed to the process group is reduced as the fallback is ("stepped
aside"), exactly as DDP does without a hook.

The AggBox calls run on one background thread per state, in the order DDP
hands out the buckets (the same on every rank, as AggBox requires), with the
GIL released, so the backward pass goes on while a bucket is reduced. A
process group allreduce is started at once on the caller's thread; its wait
and division run on the state's thread, so no Python runs on the process
group's own threads. A trial bucket is reduced alone: the hook waits for the
buckets before it, times the trial on the state's thread, and waits for it;
after a class's last trial it agrees with the other ranks (a MAX allreduce of
the times on the process group) before it returns. So every process group
call the hook makes is issued from DDP's thread in bucket order, and every
rank is at the same trial of the same class at the same bucket.
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import DEFAULT_TUNER_TRIALS, Communicator, Tuner

__all__ = ["AllreduceState", "allreduce_hook", "served_by_aggbox", "ENV_ROUTE", "ENV_TRIALS"]

# The route policy and the number of trials when AllreduceState is not told.
ENV_ROUTE = "AGGBOX_TORCH_ROUTE"
ENV_TRIALS = "AGGBOX_TORCH_TRIALS"

# The tuner's kinds: one per dtype AggBox serves (they cost differently).
_KINDS = {torch.float32: 0, torch.int32: 1}
_KIND_NAMES = {0: "float32", 1: "int32"}


def served_by_aggbox(tensor: torch.Tensor) -> bool:
    """Whether `allreduce_hook` can reduce `tensor` through AggBox (a CPU
    float32 or int32 tensor) rather than only through the process group."""
    return tensor.device.type == "cpu" and tensor.dtype in _KINDS


class AllreduceState:
    """The hook's state: the communicator, the process group of the fallback
    and of the baseline route (None: the default group), the route policy
    ("measure", "aggbox" or "baseline"; None: $AGGBOX_TORCH_ROUTE, else
    "measure"; "gloo" is "baseline"), the trials per route and size class (None:
    $AGGBOX_TORCH_TRIALS, else 3), and counters of what went where:

    - ``aggbox_buckets``: buckets reduced through AggBox (trials included);
    - ``stepped_aside_buckets``: buckets AggBox could serve that the route
      sent to the process group (trials included);
    - ``fallback_buckets``: buckets AggBox cannot serve (other dtypes, not
      on the CPU), through the process group;
    - ``trial_buckets``: of the first two, the timed trials.

    ``routes()`` lists the settled classes."""

    def __init__(
        self,
        comm: Communicator,
        process_group: Optional[dist.ProcessGroup] = None,
        route: Optional[str] = None,
        trials: Optional[int] = None,
    ) -> None:
        self.comm = comm
        self.process_group = process_group
        if route is None:
            route = os.environ.get(ENV_ROUTE) or "measure"
        if trials is None:
            env = os.environ.get(ENV_TRIALS)
            try:
                trials = int(env) if env else DEFAULT_TUNER_TRIALS
            except ValueError:
                raise ValueError(f"{ENV_TRIALS}={env!r}: a number of trials (at least 1)") from None
        # "gloo": the backend's name of the baseline (the two share
        # AGGBOX_TORCH_ROUTE). Raises ValueError for an unknown policy or
        # no trials.
        self.tuner = Tuner("baseline" if route == "gloo" else route, trials)
        # One thread: AggBox calls must be issued in the same order on every
        # rank, and DDP hands the buckets out in bucket order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggbox-ddp")
        self._lock = threading.Lock()
        self.aggbox_buckets = 0
        self.stepped_aside_buckets = 0
        self.fallback_buckets = 0
        self.trial_buckets = 0

    @property
    def route(self) -> str:
        """The route policy: "measure", "aggbox" or "baseline"."""
        return self.tuner.policy

    def routes(self) -> list[dict]:
        """The settled classes (route "measure"), by dtype and size: dicts
        with ``dtype`` ("float32", "int32"), ``size`` (the class's lower
        bound, "64 KiB": buckets of [2^log2_bytes, 2^(log2_bytes+1)) bytes),
        ``log2_bytes``, ``route`` ("aggbox" or "baseline") and the ranks'
        agreed fastest trial of each, ``aggbox_s`` and ``baseline_s``."""
        with self._lock:
            choices = self.tuner.choices()
        out = []
        for c in choices:
            kind = c.pop("kind")
            out.append({"dtype": _KIND_NAMES.get(kind, str(kind)), **c})
        return out

    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _count(self, counter: str, trial: bool = False) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            if trial:
                self.trial_buckets += 1

    def _aggbox(self, tensor: torch.Tensor) -> Callable[[], None]:
        """The AggBox mean of `tensor`, in place, to run on the state's thread."""
        op = "mean" if tensor.dtype == torch.float32 else "avg"

        def reduce() -> None:
            self.comm.allreduce(tensor, op=op)

        return reduce

    def _baseline(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Starts the process group's allreduce of `tensor` now; returns its
        wait and division, to run on the state's thread."""
        group = self._group()
        world = dist.get_world_size(group)
        work = dist.all_reduce(tensor, group=group, async_op=True)

        # Waited for and divided on the state's thread, not in a callback
        # (`get_future().then(...)`): such a callback runs Python on the
        # process group's worker thread, which then needs the GIL, and
        # torch 1.13 joins that thread, holding the GIL, when the last DDP
        # model goes: a process that drops its model as the callback still
        # finishes never exits.
        def reduce() -> None:
            work.wait()
            if tensor.is_floating_point():
                tensor.div_(world)
            else:
                # An integer mean in place: truncated, as the runtime's int AVG is.
                tensor.div_(world, rounding_mode="trunc")

        return reduce

    def _submit(self, fut: torch.futures.Future, tensor: torch.Tensor, reduce: Callable[[], None]) -> None:
        """Runs `reduce` on the state's thread, after the buckets before it;
        completes `fut` with `tensor` or the exception."""

        def run() -> None:
            try:
                reduce()
            except BaseException as e:  # noqa: BLE001 - DDP re-raises it from fut.wait()
                fut.set_exception(e)
            else:
                fut.set_result(tensor)

        self._executor.submit(run)

    def _trial(self, fut: torch.futures.Future, tensor: torch.Tensor, kind: int, nbytes: int, route: str) -> None:
        """A timed trial of `route` for `tensor`, on the state's thread once
        the buckets before it are done, waited for here; after the class's
        last trial the ranks agree on its route."""

        def timed() -> float:
            # A baseline trial's allreduce starts here, on the state's
            # thread, while the caller waits: the hook issues nothing else
            # meanwhile, so the process group sees its calls in bucket order.
            t0 = time.perf_counter()
            if route == "aggbox":
                self._aggbox(tensor)()
            else:
                self._baseline(tensor)()
            return time.perf_counter() - t0

        try:
            took = self._executor.submit(timed).result()
        except BaseException as e:  # noqa: BLE001 - DDP re-raises it from fut.wait()
            fut.set_exception(e)
            return
        fut.set_result(tensor)
        with self._lock:
            times = self.tuner.record(kind, nbytes, route, took)
        if times is None:
            return
        # A collective is as slow as its slowest rank, and every rank must
        # settle alike: the MAX of each route's fastest trial over the ranks.
        agreed = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group())
        a, b = agreed.tolist()
        with self._lock:
            self.tuner.settle(kind, nbytes, (a, b))

    def __getstate__(self):
        raise TypeError("aggbox.torch.AllreduceState holds a live communicator and cannot be pickled")


# DDP checks these annotations (exactly dist.GradBucket and
# torch.futures.Future[torch.Tensor]), hence no `from __future__ import annotations`.
def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` over the workers: CPU float32/int32 buckets through
    AggBox or the process group, as the state's route says; other buckets
    through the process group (see the module docs)."""
    tensor = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if not served_by_aggbox(tensor):
        state._count("fallback_buckets")
        state._submit(fut, tensor, state._baseline(tensor))
        return fut
    kind = _KINDS[tensor.dtype]
    nbytes = tensor.numel() * tensor.element_size()
    with state._lock:
        route, trial = state.tuner.pick(kind, nbytes)
    state._count("aggbox_buckets" if route == "aggbox" else "stepped_aside_buckets", trial)
    if trial:
        state._trial(fut, tensor, kind, nbytes, route)
    elif route == "aggbox":
        state._submit(fut, tensor, state._aggbox(tensor))
    else:
        state._submit(fut, tensor, state._baseline(tensor))
    return fut
