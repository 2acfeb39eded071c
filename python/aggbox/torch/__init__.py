"""AggBox for PyTorch: the ``torch.distributed`` backend "aggbox", and the
DDP communication hook.

**The backend.** Importing this package registers it::

    import aggbox.torch
    dist.init_process_group("aggbox", init_method=..., rank=r, world_size=w)

with the node's control endpoint in AGGBOX_NODE and the credential in
AGGBOX_TENANT and AGGBOX_KEY (or ``pg_options=aggbox.torch.Options(...)``).
Each process group joins a job on demand at the node (a fresh run key from
rank 0, through the process group's store) and an internal Gloo group on
the same store; a collective AggBox can serve goes through AggBox or Gloo,
whichever the ranks measured faster for its kind, dtype and size (the
route, ``AGGBOX_TORCH_ROUTE``: measure, aggbox or gloo), the others through
Gloo, each call counted by how it was served (``ProcessGroupAggBox.stats()``). An
unmodified script that takes a backend name runs on it through the
launcher, ``python -m aggbox.torch.run script.py --dist-backend aggbox``.
docs/PYTHON.md, "The torch.distributed backend", is the reference
(``aggbox.torch.backend``).

**The hook** (``aggbox.torch.hook``, unchanged for its users)::

    comm = aggbox.Communicator.from_config(path, job=11, rank=rank, aggregator=node)
    ddp.register_comm_hook(aggbox.torch.AllreduceState(comm), aggbox.torch.allreduce_hook)
"""

from .backend import BACKEND, Options, ProcessGroupAggBox, process_stats, register, stats
from .hook import ENV_ROUTE, ENV_TRIALS, AllreduceState, allreduce_hook, served_by_aggbox

__all__ = [
    "AllreduceState",
    "allreduce_hook",
    "served_by_aggbox",
    "ENV_ROUTE",
    "ENV_TRIALS",
    "BACKEND",
    "Options",
    "ProcessGroupAggBox",
    "process_stats",
    "register",
    "stats",
]

register()
