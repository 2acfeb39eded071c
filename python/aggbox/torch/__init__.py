"""AggBox for PyTorch: the DDP communication hook (``aggbox.torch.hook``,
re-exported here unchanged for its users)::

    comm = aggbox.Communicator.from_config(path, job=11, rank=rank, aggregator=node)
    ddp.register_comm_hook(aggbox.torch.AllreduceState(comm), aggbox.torch.allreduce_hook)
"""

from .hook import ENV_ROUTE, ENV_TRIALS, AllreduceState, allreduce_hook, served_by_aggbox

__all__ = ["AllreduceState", "allreduce_hook", "served_by_aggbox", "ENV_ROUTE", "ENV_TRIALS"]
