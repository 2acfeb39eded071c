"""Type stubs of the extension module (python/src/lib.rs)."""

from os import PathLike
from types import TracebackType
from typing import Literal, Sequence, TypedDict, Union


# A C-contiguous, writable int32 or float32 buffer: numpy.ndarray, a CPU
# torch.Tensor, array.array("i"/"f"), memoryview, ...
BufferLike = object
Root = Union[int, Literal["aggregator"]]
Quantization = Union[Literal["adaptive", "fixed", "fixed-or-adaptive"], float]
Route = Literal["aggbox", "baseline"]
Policy = Literal["measure", "aggbox", "baseline"]
# The ops of include/aggbox/ops.def (tests/ops_agree.rs checks this list
# against the table), and "mean" (avg; on float32, "sum" or "mean" only).
OpName = Literal["sum", "count", "max", "min", "avg", "prod", "band", "bor", "bxor", "land", "lor", "mean"]

OPS: list[str]
"""The op names of the table, in wire-number order (no "mean")."""
DEFAULT_FIXED_SCALE: float
DEFAULT_TUNER_TRIALS: int

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
        ring: int | None = None,
        pin_dir: str | PathLike[str] | None = None,
        algorithm: Literal["auto", "star", "ring"] = "auto",
        ring_threshold: int | None = None,
    ) -> Communicator: ...
    @staticmethod
    def connect(
        node: str | list[str],
        *,
        run: str,
        world: int,
        rank: int,
        data: str,
        tenant: str | None = None,
        key: str | None = None,
        vector_len: int | None = None,
        join_deadline: float = 60.0,
        deadline: float = 10.0,
        quantization: Quantization | None = None,
        mtu: int = 0,
        tree: dict[str, str | int] | None = None,
        ring: dict[str, str | int] | None = None,
    ) -> Communicator: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def served(self) -> dict[str, int]: ...
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
    def allreduce(self, buf: BufferLike, op: OpName = "sum") -> bool: ...
    def reduce(self, buf: BufferLike, op: OpName = "sum") -> bool: ...
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

class TunerChoice(TypedDict):
    """A settled class of `Tuner.choices()`."""

    kind: int
    log2_bytes: int
    """Calls of [2**log2_bytes, 2**(log2_bytes + 1)) bytes."""
    size: str
    """The class's lower bound: "64 KiB"."""
    route: Route
    aggbox_s: float
    """The ranks' agreed (slowest rank's) fastest AggBox trial, seconds."""
    baseline_s: float
    """The same for the baseline."""

class Tuner:
    """AggBox or a baseline per kind and size class, by measurement
    (aggbox::runtime::tuner; docs/PYTHON.md)."""

    def __init__(self, policy: Policy = "measure", trials: int = 3) -> None: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def trials(self) -> int: ...
    def pick(self, kind: int, nbytes: int) -> tuple[Route, bool]:
        """(route, whether the call is a trial to time and `record`)."""
    def record(self, kind: int, nbytes: int, route: Route, seconds: float) -> tuple[float, float] | None:
        """After the class's last trial: this rank's fastest (aggbox, baseline) seconds."""
    def settle(self, kind: int, nbytes: int, agreed: tuple[float, float]) -> Route:
        """Settles the class with the ranks' MAX of `record`'s times."""
    def choices(self) -> list[TunerChoice]: ...
    @staticmethod
    def size_class(nbytes: int) -> int:
        """log2 of the power of two at or below `nbytes` (0 counts as 1)."""
