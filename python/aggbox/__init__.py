"""AggBox collectives for Python: broadcast, reduce and allreduce of int32 and
float32 buffers through in-kernel aggregation over UDP.

Every call is the Rust runtime's own (``aggbox::runtime::Communicator``), on
the caller's memory in place (numpy arrays, CPU ``torch.Tensor``s, anything
with the buffer protocol), with the GIL released while it runs. float32
travels quantized to int32; ``Communicator.float_error_bound`` says how far a
result may be from the exact one. ``aggbox.torch`` has a PyTorch DDP
communication hook, which routes each gradient bucket through AggBox or the
process group, whichever measured faster (``aggbox.Tuner``). docs/PYTHON.md
is the reference.

    comm = aggbox.Communicator.from_config("/etc/aggbox.toml", job=11, rank=r,
                                           aggregator="10.0.0.254")
    comm.allreduce(grads, op="mean")
"""

from ._aggbox import (
    DEFAULT_FIXED_SCALE,
    DEFAULT_TUNER_TRIALS,
    OPS,
    AggBoxError,
    CommClosedError,
    CommTimeoutError,
    Communicator,
    ConfigError,
    QuantizationOverflowError,
    Tuner,
    adaptive_quantization_scale,
)

__all__ = [
    "Communicator",
    "Tuner",
    "AggBoxError",
    "CommTimeoutError",
    "QuantizationOverflowError",
    "ConfigError",
    "CommClosedError",
    "adaptive_quantization_scale",
    "DEFAULT_FIXED_SCALE",
    "DEFAULT_TUNER_TRIALS",
    "OPS",
]
