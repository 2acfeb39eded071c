"""A PyTorch DDP communication hook that averages gradients through AggBox.

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
  CPU): the process group's own allreduce divided by its size, which is what
  DDP does without a hook (integers: truncated toward zero).

The calls run on one background thread per state, in the order DDP hands out
the buckets (the same on every rank, as AggBox requires), with the GIL
released, so the backward pass goes on while a bucket is reduced. The
fallback's allreduce is started at once; its wait and division run on the same
thread, so no Python runs on the process group's own threads.
"""

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import torch.distributed as dist

from . import Communicator

__all__ = ["AllreduceState", "allreduce_hook", "served_by_aggbox"]


def served_by_aggbox(tensor: torch.Tensor) -> bool:
    """Whether `allreduce_hook` reduces `tensor` through AggBox (a CPU float32
    or int32 tensor) rather than through the process group."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.int32)


class AllreduceState:
    """The hook's state: the communicator, the process group of the fallback
    (None: the default group) and counters of what went where."""

    def __init__(self, comm: Communicator, process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.comm = comm
        self.process_group = process_group
        # One thread: AggBox calls must be issued in the same order on every
        # rank, and DDP hands the buckets out in bucket order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggbox-ddp")
        self._lock = threading.Lock()
        self.aggbox_buckets = 0
        self.fallback_buckets = 0

    def _count(self, aggbox: bool) -> None:
        with self._lock:
            if aggbox:
                self.aggbox_buckets += 1
            else:
                self.fallback_buckets += 1

    def __getstate__(self):
        raise TypeError("aggbox.torch.AllreduceState holds a live communicator and cannot be pickled")


# DDP checks these annotations (exactly dist.GradBucket and
# torch.futures.Future[torch.Tensor]), hence no `from __future__ import annotations`.
def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket` over the workers: through AggBox for CPU float32/int32
    buckets, through the process group otherwise (see the module docs)."""
    tensor = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if served_by_aggbox(tensor):
        state._count(aggbox=True)
        op = "mean" if tensor.dtype == torch.float32 else "avg"

        def reduce() -> None:
            state.comm.allreduce(tensor, op=op)

    else:
        state._count(aggbox=False)
        group = state.process_group if state.process_group is not None else dist.group.WORLD
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

    def run() -> None:
        try:
            reduce()
        except BaseException as e:  # noqa: BLE001 - DDP re-raises it from fut.wait()
            fut.set_exception(e)
        else:
            fut.set_result(tensor)

    state._executor.submit(run)
    return fut
