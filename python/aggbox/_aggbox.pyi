"""Type stubs of the extension module (python/src/lib.rs)."""

from os import PathLike
from types import TracebackType
from typing import Literal, Sequence, Union


# A C-contiguous, writable int32 or float32 buffer: numpy.ndarray, a CPU
# torch.Tensor, array.array("i"/"f"), memoryview, ...
BufferLike = object
Root = Union[int, Literal["aggregator"]]
Quantization = Union[Literal["adaptive", "fixed", "fixed-or-adaptive"], float]

DEFAULT_FIXED_SCALE: float

class AggBoxError(Exception):
    """An AggBox call failed; the message is the runtime's."""

class CommTimeoutError(AggBoxError):
    """A call reached its deadline."""

    missing: list[str]
    """Who did not answer ("rank 2", "aggregator"); empty when the kernel backend cannot tell."""
    round: int
    """The call's round."""

class QuantizationOverflowError(AggBoxError):
    """A float sum overflowed int32 at the fixed quantization scale."""

class ConfigError(AggBoxError):
    """The configuration or the arguments of a communicator are invalid."""

class CommClosedError(AggBoxError):
    """The communicator was closed (or its progress thread is gone)."""

def adaptive_quantization_scale(max_abs: float, workers: int) -> float:
    """The adaptive scale for `workers` ranks whose largest |x| is `max_abs`."""

class Communicator:
    """One participant of an AggBox job."""

    def __init__(
        self,
        job: int,
        peers: list[str],
        aggregator: str,
        port: int,
        rank: int | None,
        *,
        backend: Literal["socket", "kernel"] = "socket",
        result_port: int = 0,
        deadline: float = 10.0,
        quantization: Quantization | None = None,
        mtu: int = 0,
    ) -> None: ...
    @staticmethod
    def from_config(
        path: str | PathLike[str],
        *,
        job: int | Sequence[int],
        rank: int | None,
        aggregator: str,
        data_port: int | None = None,
        backend: Literal["kernel", "socket"] = "kernel",
        deadline: float = 10.0,
        quantization: Quantization | None = None,
        mtu: int = 0,
    ) -> Communicator: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def workers(self) -> int: ...
    @property
    def job(self) -> int: ...
    @property
    def jobs(self) -> list[int]: ...
    @property
    def mtu(self) -> int: ...
    @property
    def node_served(self) -> bool: ...
    def allreduce(self, buf: BufferLike, op: str = "sum") -> bool: ...
    def reduce(self, buf: BufferLike, op: str = "sum") -> bool: ...
    def broadcast(self, buf: BufferLike, root: Root | None = None) -> None: ...
    def float_error_bound(self, max_abs: float, mean: bool = False) -> float: ...
    def close(self) -> None: ...
    def __enter__(self) -> Communicator: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
