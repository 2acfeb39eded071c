"""The ``torch.distributed`` backend "aggbox": a process group that serves
collectives through AggBox (a job on demand at the node, docs/PYTHON.md
"The torch.distributed backend") and everything else through an internal
Gloo group on the same store.

    import aggbox.torch                      # registers the backend
    dist.init_process_group("aggbox", ...)   # AGGBOX_NODE, AGGBOX_TENANT, AGGBOX_KEY

One process group is one AggBox communicator (one job on demand, its run key
made fresh by rank 0 and shared through the store) and one Gloo group. The
collectives run in the order the ranks issued them (the same on every rank,
as both transports need), on one thread per process group, so a call with
``async_op=True`` returns at once and its work object completes when that
thread has done it; but a call that goes to Gloo and needs nothing done
after Gloo's call is issued to Gloo at once from the caller's thread, and
Gloo's own work returned, while no call is queued on or running on that
thread (the next call queued there waits for it first): such a call costs
Gloo's call and a few microseconds of Python. Point-to-point calls (send,
recv) go to Gloo at once always: they need not be issued in the same order
everywhere, and a receive waiting on that thread would hold up the
collectives its sender must first pass.

Which call is served how (``ProcessGroupAggBox.stats()`` counts them by
``(collective, "aggbox" | "stepped_aside" | "gloo")``) is in the table of
docs/PYTHON.md. A call AggBox can serve goes by the group's route policy
(``Options.route``, else AGGBOX_TORCH_ROUTE, else "measure"): "measure"
times AggBox and Gloo on the first calls of each collective, dtype, op and
size class (``aggbox.Tuner``) and then takes the one the ranks measured
faster; "aggbox" and "gloo" take that one always. The trials and the ranks'
agreement (a MAX allreduce of the times on the Gloo group) run on the
group's thread in call order, so every rank takes the same route for the
same call and issues the same calls in the same order.
"""

import atexit
import collections
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed in 1.13

from .. import DEFAULT_TUNER_TRIALS, AggBoxError, Communicator, Tuner
from .hook import ENV_ROUTE, ENV_TRIALS

__all__ = ["BACKEND", "ROUTES", "Options", "ProcessGroupAggBox", "stats", "process_stats", "register"]

BACKEND = "aggbox"

# Environment variables the backend reads when the Options object does not say.
ENV_NODE = "AGGBOX_NODE"
ENV_DATA = "AGGBOX_DATA"
ENV_DEADLINE = "AGGBOX_TORCH_DEADLINE"
ENV_STATS = "AGGBOX_TORCH_STATS"
# A job of the node's file instead of one on demand, with a ring beside its
# star (docs/PYTHON.md, "A node file's job and the ring").
ENV_CONFIG = "AGGBOX_TORCH_CONFIG"
ENV_JOB = "AGGBOX_TORCH_JOB"
ENV_RING = "AGGBOX_TORCH_RING"
ENV_PIN_DIR = "AGGBOX_TORCH_PIN_DIR"
ENV_RING_THRESHOLD = "AGGBOX_TORCH_RING_THRESHOLD"

# The route policies (Options.route, AGGBOX_TORCH_ROUTE), and the Tuner's
# name of each; "baseline" is the DDP hook's name of "gloo" (the two share
# the variable).
ROUTES = ("measure", "aggbox", "gloo")
_TUNER_POLICY = {"measure": "measure", "aggbox": "aggbox", "gloo": "baseline", "baseline": "baseline"}
# A served call's path when the route sent it to Gloo.
STEPPED_ASIDE = "stepped_aside"

# The node's control port when AGGBOX_NODE names only an address
# (`[node] control`'s default).
DEFAULT_CONTROL_PORT = 7471

# How often each rank bumps its counter in the store, and how long a check
# watches the counters before it calls a rank dead.
HEARTBEAT_S = 0.5
LIVENESS_WATCH_S = 1.6

_INT32_MAX = 2**31 - 1

# Gloo works issued at once that a group holds before it looks which are
# done (they hold their tensors until then).
_DIRECT_KEPT = 4

# torch's reduce ops by the op table's names (aggbox.OPS).
_R = dist.ReduceOp
_OP_NAMES = [
    (_R.SUM, "sum"),
    (_R.AVG, "avg"),
    (_R.PRODUCT, "prod"),
    (_R.MIN, "min"),
    (_R.MAX, "max"),
    (_R.BAND, "band"),
    (_R.BOR, "bor"),
    (_R.BXOR, "bxor"),
]
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# The same by a ReduceOp's hash, which torch 1.13 makes its type's number
# (the whole op but for PREMUL_SUM's factor): a lookup that costs a tenth
# of comparing one ReduceOp, and a microsecond counts on the way to Gloo.
_OP_BY_HASH = {hash(o): name for o, name in _OP_NAMES}
if len(_OP_BY_HASH) != len(_OP_NAMES) or hash(_R.PREMUL_SUM) in _OP_BY_HASH:  # another torch: compare
    _OP_BY_HASH = None


def _op_name(op) -> Optional[str]:
    """The op table's name of a torch reduce op; None for PREMUL_SUM and
    anything newer, which Gloo decides."""
    if _OP_BY_HASH is not None:
        return _OP_BY_HASH.get(hash(op))
    for o, name in _OP_NAMES:
        if op == o:
            return name
    return None


def _dict_op(name: str):
    """torch's reduce op of an op table name."""
    return next(o for o, n in _OP_NAMES if n == name)


@dataclass
class Options:
    """What ``init_process_group("aggbox", pg_options=Options(...))`` may say
    instead of the environment. Each field left None is read from its
    variable:

    - ``node``: the node's control endpoint, "IP:PORT" or "IP" (port 7471);
      else AGGBOX_NODE (required one way or the other).
    - ``tenant``, ``key`` (hex): the credential; else AGGBOX_TENANT and
      AGGBOX_KEY.
    - ``data``: this rank's data socket, "IP" or "IP:PORT"; else AGGBOX_DATA;
      else the local address of the route to the node. The port, when not
      given, is one the kernel hands out for a socket bound to port 0,
      released just before the communicator binds it; a given port is used
      by the first process group of the process that finds it free.
    - ``deadline``: seconds an AggBox call may take before it fails; else
      AGGBOX_TORCH_DEADLINE; else the process group's timeout less the
      liveness check (``LIVENESS_WATCH_S`` + 1 s), at least 1 s.
    - ``quantization``: how floats travel (``Communicator``'s argument;
      None: adaptive, which never overflows).
    - ``join_deadline``: seconds to wait for every rank to join the run at
      the node; else the process group's timeout.
    - ``route``: which path serves the calls AggBox can serve: "measure"
      (per collective, dtype, op and size class, the one the ranks measured
      faster), "aggbox" or "gloo" (always that one; "baseline" is "gloo");
      else AGGBOX_TORCH_ROUTE; else "measure".
    - ``trials``: timed trials per path and class with "measure", after one
      warm-up each; else AGGBOX_TORCH_TRIALS; else 3.
    - ``config``, ``job``: a job of the node's file (its TOML, and the job
      whose workers are the ranks in order; a list, or "11,12" in the
      variable, stripes each vector over those jobs) instead of a job on demand;
      ``node`` is then the node's IPv4 address. Else AGGBOX_TORCH_CONFIG
      and AGGBOX_TORCH_JOB. One process group of a process uses it (the
      default group); others need jobs on demand.
    - ``ring``, ``pin_dir``, ``ring_threshold``: with ``config``, a
      ``[[ring]]`` of the file whose members are the ranks, where this
      host's ``aggbox attach`` pinned its maps (``{rank}`` is replaced by
      the rank), and the elements from which an allreduce takes the ring
      (default by MTU and ring size); else AGGBOX_TORCH_RING,
      AGGBOX_TORCH_PIN_DIR and AGGBOX_TORCH_RING_THRESHOLD. Each allreduce
      then goes to the star or the ring by size (``Communicator.from_config
      (ring=...)``).
    """

    node: Optional[str] = None
    tenant: Optional[str] = None
    key: Optional[str] = None
    data: Optional[str] = None
    deadline: Optional[float] = None
    quantization: Optional[object] = None
    join_deadline: Optional[float] = None
    route: Optional[str] = None
    trials: Optional[int] = None
    config: Optional[str] = None
    job: Optional[int] = None
    ring: Optional[int] = None
    pin_dir: Optional[str] = None
    ring_threshold: Optional[int] = None


def _route_policy(opts: Options) -> Tuple[str, int]:
    """The options' (else the environment's) route policy, by its name in
    ROUTES, and the trials; ValueError naming where a bad one came from."""
    where = "Options.route"
    route = opts.route
    if route is None:
        route, where = os.environ.get(ENV_ROUTE) or "measure", ENV_ROUTE
    route = route.strip().lower()
    if route not in _TUNER_POLICY:
        raise ValueError(f'backend "aggbox": {where}={route!r}: one of "measure", "aggbox", "gloo"')
    trials, where = opts.trials, "Options.trials"
    if trials is None:
        env = os.environ.get(ENV_TRIALS)
        where = ENV_TRIALS
        try:
            trials = int(env) if env else DEFAULT_TUNER_TRIALS
        except ValueError:
            raise ValueError(f"{ENV_TRIALS}={env!r}: a number of trials (at least 1)") from None
    if trials < 1:
        raise ValueError(f'backend "aggbox": {where}={trials}: at least 1 trial')
    return ("gloo" if route == "baseline" else route), trials


# The counters of every process group this process made, with the lock
# each is counted under (process_stats() sums them; AGGBOX_TORCH_STATS=1
# prints the sum at exit): a call counts once, in its group's counter.
_GROUP_STATS: List[Tuple[threading.Lock, collections.Counter]] = []
# Data ports this process's communicators were given from AGGBOX_DATA.
_PORTS_TAKEN: set = set()
_ENGINES: "weakref.WeakSet[_Engine]" = weakref.WeakSet()


def process_stats() -> Dict[Tuple[str, str], int]:
    """Every call of every "aggbox" process group of this process so far,
    by ``(collective, "aggbox" | "stepped_aside" | "gloo")``."""
    total: collections.Counter = collections.Counter()
    for lock, counts in list(_GROUP_STATS):
        with lock:
            total.update(counts)
    return dict(total)


def stats(group=None) -> Dict[Tuple[str, str], int]:
    """``group.stats()`` of an "aggbox" process group (None: the default)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupAggBox):
        raise TypeError(f"{pg!r} is not an aggbox process group")
    return pg.stats()


class _NotSent(Exception):
    """A call refused before anything was sent (a bad argument): it fails
    alone and leaves the process group usable."""


class _Work(dist.Work):
    """One call's work: ``wait()`` raises the call's RuntimeError,
    ``is_completed()``, ``get_future()`` (a torch.futures.Future completed
    with the call's output tensors, as Gloo's)."""

    def __init__(self, engine: "_Engine", outputs: List[torch.Tensor]) -> None:
        super().__init__()
        self._engine = engine
        self._outputs = outputs
        self._fut: torch.futures.Future = torch.futures.Future()
        self._done = threading.Event()
        self._exc: Optional[BaseException] = None
        self._consumed = False
        engine._keep(self)

    # Called on the engine's thread.
    def _finish(self, exc: Optional[BaseException] = None) -> None:
        self._exc = exc
        if exc is None:
            self._fut.set_result(self._outputs)
        else:
            self._fut.set_exception(exc)
        self._done.set()
        self._engine._release(self)

    def wait(self, timeout=None) -> bool:
        self._consumed = True
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 0)
        if not self._done.wait(seconds if seconds > 0 else None):
            raise RuntimeError(f"aggbox: wait() timed out after {seconds} s (the call goes on)")
        self._engine._release(self)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self):
        return self._exc

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self._consumed = True
        self._engine._release(self)
        return self._fut


class _Engine:
    """The process group's state without the process group (so that the
    process group can be collected, which closes this): the communicator,
    the Gloo group, the thread that runs the calls in order, the heartbeat,
    the counters."""

    def __init__(self, comm: Communicator, gloo, store, prefix: str, rank: int, size: int, run: str, node: str):
        self.comm, self.gloo, self.store, self.prefix = comm, gloo, store, prefix
        self.rank, self.size, self.run, self.node = rank, size, run, node
        self.job = comm.job
        self.stats: collections.Counter = collections.Counter()
        # Of those, the calls that were timed trials of a route.
        self.trials: collections.Counter = collections.Counter()
        # Set by a call's run when it was a trial (the calls run one at a
        # time on this engine's thread).
        self.in_trial = False
        self.clamped = 0
        self._lock = threading.Lock()
        # Works a C++ caller may still reach: torch 1.13 keeps only the C++
        # half of a Python Work it got from a Python process group, so the
        # Python half must live until the caller has waited for it or taken
        # its future, and the call is done.
        self._live: Dict[int, _Work] = {}
        # Calls queued for this engine's thread and not yet done; while
        # none is, a call the route sends to Gloo is issued to Gloo at once
        # from the caller's thread (`ProcessGroupAggBox._at_once`).
        self._pending = 0
        # The Gloo works issued at once and not yet seen done, oldest
        # first: the next call queued for the thread waits for them first.
        self._direct: List[dist.Work] = []
        self._queue: "queue.Queue" = queue.Queue()
        self._broken: Optional[str] = None
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"aggbox-pg-{rank}", daemon=True)
        self._heart = threading.Thread(target=self._beat, name=f"aggbox-heartbeat-{rank}", daemon=True)
        self._thread.start()
        self._heart.start()
        _ENGINES.add(self)
        _GROUP_STATS.append((self._lock, self.stats))

    # -- works -------------------------------------------------------------

    def _keep(self, work: _Work) -> None:
        with self._lock:
            self._live[id(work)] = work

    def _release(self, work: _Work) -> None:
        if work._consumed and work._done.is_set():
            with self._lock:
                self._live.pop(id(work), None)

    def submit(self, name: str, outputs: List[torch.Tensor], run: Callable[[], str]) -> _Work:
        """Queues `run` (which does the call and returns the path that served
        it, "aggbox", "stepped_aside" or "gloo") behind the calls before it:
        those queued, and those issued to Gloo at once before it, which the
        thread waits for first."""
        work = _Work(self, outputs)
        if self._closed:
            work._finish(RuntimeError(f"aggbox: {name} on a process group that was destroyed"))
            return work
        with self._lock:
            self._pending += 1
            after, self._direct = self._direct, []
        self._queue.put((name, run, work, after))
        return work

    def count(self, name: str, path: str) -> None:
        with self._lock:
            self.stats[(name, path)] += 1

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, run, work, after = item
            exc = self._run(name, run, after)
            with self._lock:
                self._pending -= 1
            work._finish(exc)

    def _run(self, name: str, run: Callable[[], str], after: List[dist.Work]) -> Optional[RuntimeError]:
        """One queued call, after the Gloo works issued at once before it;
        counted by its path. Its error, if it failed."""
        if self._broken is not None:
            return RuntimeError(f"aggbox: {name}: the process group failed before: {self._broken}")
        self.in_trial = False
        try:
            for w in after:
                w.wait()
            path = run()
        except _NotSent as e:
            return RuntimeError(f"aggbox: {name}: {e.__cause__ or e}")
        except BaseException as e:  # noqa: BLE001 - it goes to the work
            self._broken = self._explain(name, e)
            return RuntimeError(self._broken)
        self.count(name, path)
        if self.in_trial:
            with self._lock:
                self.trials[(name, path)] += 1
        return None

    # -- liveness ----------------------------------------------------------

    def _beat(self) -> None:
        key = f"{self.prefix}/alive/{self.rank}"
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone; the check says so
                return

    def _beats(self) -> List[int]:
        return [self.store.add(f"{self.prefix}/alive/{r}", 0) for r in range(self.size)]

    def dead_ranks(self) -> Tuple[List[int], Optional[str]]:
        """The ranks whose heartbeat did not move for LIVENESS_WATCH_S, or
        why the store could not tell."""
        try:
            before = self._beats()
            time.sleep(LIVENESS_WATCH_S)
            after = self._beats()
        except Exception as e:  # noqa: BLE001
            return [], f"the store is unreachable ({e}): rank 0, or the launcher hosting the store, is dead"
        return [r for r in range(self.size) if r != self.rank and after[r] == before[r]], None

    def _explain(self, name: str, e: BaseException) -> str:
        """The RuntimeError of a call that failed in flight: who is dead."""
        dead, store_gone = self.dead_ranks()
        if store_gone:
            who = store_gone
        elif dead:
            names = ", ".join(f"rank {r}" for r in dead)
            who = f"{names} of {self.size} stopped (no heartbeat in the store for {LIVENESS_WATCH_S} s): killed, hung or cut off"
        else:
            who = f"every rank is alive (heartbeats in the store): the node {self.node} or the network to it failed"
        return (
            f"aggbox: {name} failed on rank {self.rank} (run {self.run}, job {self.job}): {who}; "
            f"{type(e).__name__}: {e}"
        )

    # -- the end -----------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001 - closing what may be gone
            pass


@atexit.register
def _close_all() -> None:
    for engine in list(_ENGINES):
        engine.close()
    if os.environ.get(ENV_STATS):
        import sys

        rows = ", ".join(f"{c}/{p}: {n}" for (c, p), n in sorted(process_stats().items()))
        print(f"aggbox.torch: served {{{rows}}}", file=sys.stderr, flush=True)


def _node_address(opts: Options) -> str:
    node = opts.node or os.environ.get(ENV_NODE)
    if not node:
        raise ValueError(
            f'backend "aggbox": the node\'s control endpoint is unknown: set {ENV_NODE}=IP:PORT or [IPv6]:PORT '
            "(or pass pg_options=aggbox.torch.Options(node=...))"
        )
    host, port = _host_port(node)
    return _socket_text(host, int(port) if port else DEFAULT_CONTROL_PORT)


def _file_job(opts: Options, rank: int) -> Optional[dict]:
    """``Communicator.from_config``'s arguments for a job of the node's file
    (Options.config, else AGGBOX_TORCH_CONFIG), None for a job on demand;
    ValueError naming the variable for what is missing or malformed."""
    def value(field, env, convert=str):
        v = getattr(opts, field)
        if v is not None:
            return v
        raw = os.environ.get(env)
        if raw is None or raw == "":
            return None
        try:
            return convert(raw)
        except ValueError:
            raise ValueError(f'backend "aggbox": {env}={raw!r}: not a number') from None

    path = value("config", ENV_CONFIG)
    ring = value("ring", ENV_RING, int)
    pin_dir = value("pin_dir", ENV_PIN_DIR)
    threshold = value("ring_threshold", ENV_RING_THRESHOLD, int)
    if path is None:
        if ring is not None or pin_dir is not None:
            raise ValueError(f'backend "aggbox": a ring ({ENV_RING}) is one of the node file\'s: set {ENV_CONFIG} too')
        return None
    # One job, or several to stripe each vector over ("11,12").
    job = value("job", ENV_JOB, lambda v: [int(j) for j in v.split(",")] if "," in v else int(v))
    if job is None:
        raise ValueError(f'backend "aggbox": {ENV_CONFIG}={path}: set {ENV_JOB} to the job whose workers are the ranks')
    args = {"path": path, "job": job}
    if ring is not None:
        if pin_dir is None:
            raise ValueError(f'backend "aggbox": {ENV_RING}={ring} needs {ENV_PIN_DIR}: where this host\'s `aggbox attach` pinned its maps')
        args.update(ring=ring, pin_dir=pin_dir.replace("{rank}", str(rank)))
        if threshold is not None:
            args["ring_threshold"] = threshold
    return args


def _host_port(text: str) -> Tuple[str, str]:
    """ "A.B.C.D:PORT", "[IPv6]:PORT", "A.B.C.D", "[IPv6]" or a bare IPv6
    address as (address, port or "")."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if text.count(":") > 1:  # a bare IPv6 address
        return text, ""
    host, _, port = text.partition(":")
    return host, port


def _socket_text(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _data_address(opts: Options, node: str) -> str:
    """This rank's data socket: AGGBOX_DATA's (or the options') address, else
    the local address of the route to the node (of the node's IP version);
    its port, else a free one."""
    ip, port = _host_port(opts.data or os.environ.get(ENV_DATA) or "")
    if not ip:
        host, p = _host_port(node)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(p)))  # no packet: it only picks the route
            ip = s.getsockname()[0]
    if port and int(port) not in _PORTS_TAKEN:
        _PORTS_TAKEN.add(int(port))
        return _socket_text(ip, int(port))
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        return _socket_text(ip, s.getsockname()[1])


def _path_of(paths: List[str]) -> str:
    """The path of a call of several tensors: "gloo" if one could only go
    there, else "stepped_aside" if the route sent one there, else
    "aggbox"."""
    for p in ("gloo", STEPPED_ASIDE):
        if p in paths:
            return p
    return "aggbox"


# Reduce ops AggBox's allreduce serves, by dtype (docs/PYTHON.md, "What is
# served, what falls back"); the rest goes to Gloo.
_AGGBOX_OPS = {
    torch.int32: {"sum", "avg", "prod", "min", "max", "band", "bor", "bxor"},
    torch.int64: {"sum", "avg", "min", "max", "band", "bor", "bxor"},
    **{dt: {"sum", "avg", "min", "max"} for dt in _FLOATS},
}
_BITWISE = ("band", "bor", "bxor")


def _aggbox_serves(t: torch.Tensor, name: Optional[str]) -> bool:
    """Whether AggBox's allreduce serves `t` with op `name` (the route
    decides whether it does)."""
    return t.is_cpu and name in _AGGBOX_OPS.get(t.dtype, ())


def _allreduce_at_once_path(t: torch.Tensor, name: Optional[str]) -> Optional[str]:
    """The path of an allreduce of `t` with op `name` that Gloo can do all
    of, so that it can be issued to Gloo at once: "stepped_aside" where
    AggBox serves it too (if the route sends it to Gloo), "gloo" where only
    Gloo does; None where it needs a step after Gloo's call (AVG: a
    division; bfloat16: through float32) or a contiguous copy."""
    if name == "avg" or t.dtype == torch.bfloat16 or not t.is_contiguous():
        return None
    return STEPPED_ASIDE if _aggbox_serves(t, name) else "gloo"


# Bytes an element of a dtype (a dict costs less than asking the tensor).
_ELEMENT_SIZE = {
    dt: torch.empty(0, dtype=dt).element_size()
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
}

# The dtypes Gloo 1.13 moves as they are (not bfloat16, not complex).
_GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor for Gloo to move bit for bit: itself where Gloo
    knows its dtype, else its bytes as a flat uint8 view."""
    return t if t.dtype in _GLOO_DTYPES else t.reshape(-1).view(torch.uint8)


def _contiguous(t: torch.Tensor, f: Callable[[torch.Tensor], None]) -> None:
    """`f` on `t` in place, through a contiguous copy if it is not one."""
    if t.is_contiguous():
        f(t)
    else:
        c = t.contiguous()
        f(c)
        t.copy_(c)


def _words(t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`t` (contiguous) as int32 words: a view of its bytes when they are a
    whole number of words, else a zero-padded copy and the byte view to copy
    the result back into."""
    b = t.reshape(-1).view(torch.uint8)
    if b.numel() % 4 == 0:
        return b.view(torch.int32), None
    pad = torch.zeros((b.numel() + 3) // 4, dtype=torch.int32)
    pad.view(torch.uint8)[: b.numel()].copy_(b)
    return pad, b


def _order_keys(k: torch.Tensor) -> None:
    """float32 bits (as int32, in place) to int32 keys in the floats'
    order, and back (the map is its own inverse): non-negative floats keep
    their bits, negative ones get the other 31 bits flipped."""
    k.bitwise_xor_((k >> 31) & 0x7FFFFFFF)


class ProcessGroupAggBox(dist.ProcessGroup):
    """The "aggbox" backend's process group (see the module docs).

    ``stats()`` counts the calls by ``(collective, path)``: "aggbox" (served
    by AggBox), "stepped_aside" (AggBox could serve it; the route sent it to
    Gloo) or "gloo" (only Gloo serves it); ``trial_stats()`` the timed
    trials among them; ``route`` is the route policy and ``routes()`` the
    classes it settled. ``run``, ``job``, ``node`` and ``communicator`` say
    what it joined; ``gloo`` is the internal Gloo group."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, options: Optional[Options] = None):
        super().__init__(rank, size)
        opts = options or Options()
        self._rank, self._size = rank, size
        self._route_policy, trials = _route_policy(opts)
        # Used on the engine's thread only, but read by routes(): under the
        # engine's lock.
        self._tuner = Tuner(_TUNER_POLICY[self._route_policy], trials)
        # The tuner's kinds: (collective, torch dtype or None, op name or None)
        # numbered as they come.
        self._kinds: Dict[Tuple[str, Optional[torch.dtype], Optional[str]], int] = {}
        # Whether the route sends a settled kind and size (its bytes'
        # bit_length) to Gloo (`_at_once`); with route "gloo", all.
        self._to_gloo: Dict[tuple, bool] = {}
        self._all_to_gloo = self._route_policy == "gloo"
        node = _node_address(opts)
        # A fresh run per process group, even on a store used before (a
        # second init_process_group, subgroups): each group's ranks count
        # themselves into a generation of the store.
        gen = (store.add("aggbox/generation", 1) - 1) // size
        prefix = f"aggbox/{gen}"
        if rank == 0:
            run = f"torch-{secrets.token_hex(8)}"
            store.set(f"{prefix}/run", run)
        else:
            run = store.get(f"{prefix}/run").decode()
        seconds = timeout.total_seconds()
        deadline = opts.deadline
        if deadline is None and os.environ.get(ENV_DEADLINE):
            deadline = float(os.environ[ENV_DEADLINE])
        if deadline is None:
            deadline = max(1.0, seconds - LIVENESS_WATCH_S - 1.0)
        kwargs = {}
        if opts.quantization is not None:
            kwargs["quantization"] = opts.quantization
        file_job = _file_job(opts, rank)
        if file_job is not None:
            if gen != 0:
                raise ValueError(
                    f'backend "aggbox": a job of the node\'s file ({ENV_CONFIG}) serves one process group '
                    "of a process; this one is another (a subgroup or a second init_process_group): "
                    "use jobs on demand (AGGBOX_NODE with a control port, AGGBOX_TENANT, AGGBOX_KEY)"
                )
            node = node.rpartition(":")[0]  # the aggregator: the node's address
            data = None
            comm = Communicator.from_config(file_job.pop("path"), rank=rank, aggregator=node, deadline=deadline, **file_job, **kwargs)
        else:
            data = _data_address(opts, node)
            comm = Communicator.connect(
                node,
                run=run,
                world=size,
                rank=rank,
                data=data,
                tenant=opts.tenant,
                key=opts.key,
                join_deadline=opts.join_deadline or seconds,
                deadline=deadline,
                **kwargs,
            )
        try:
            gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/gloo", store), rank, size, timeout)
        except BaseException:
            comm.close()
            raise
        self.communicator = comm
        self.gloo = gloo
        self.run, self.job, self.node, self.data = run, comm.job, node, data
        self.deadline = deadline
        self._engine = _Engine(comm, gloo, store, prefix, rank, size, run, node)
        weakref.finalize(self, self._engine.close)

    # -- what it is --------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def stats(self) -> Dict[Tuple[str, str], int]:
        """Calls completed, by ``(collective, "aggbox" | "stepped_aside" |
        "gloo")`` (trials included)."""
        with self._engine._lock:
            return dict(self._engine.stats)

    def trial_stats(self) -> Dict[Tuple[str, str], int]:
        """Of ``stats()``, the calls that were timed trials of a route."""
        with self._engine._lock:
            return dict(self._engine.trials)

    @property
    def route(self) -> str:
        """The route policy: "measure", "aggbox" or "gloo"."""
        return self._route_policy

    @property
    def trials(self) -> int:
        """Timed trials per route and class (route "measure")."""
        return self._tuner.trials

    def routes(self) -> List[dict]:
        """The classes route "measure" settled: dicts with ``collective``
        ("allreduce", "reduce", "reduce_scatter", "allgather", "broadcast"),
        ``dtype`` and ``op`` (None where the bytes are all that count),
        ``size`` (the class's lower bound, "64 KiB": calls of
        [2^log2_bytes, 2^(log2_bytes+1)) bytes), ``log2_bytes``, ``route``
        ("aggbox" or "gloo") and the ranks' agreed (slowest rank's) fastest
        trial of each, ``aggbox_s`` and ``gloo_s``."""
        with self._engine._lock:
            choices = self._tuner.choices()
            names = {k: key for key, k in self._kinds.items()}
        out = []
        for c in choices:
            collective, dtype, op = names[c["kind"]]
            out.append({
                "collective": collective,
                "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                "op": op,
                "size": c["size"],
                "log2_bytes": c["log2_bytes"],
                "route": "aggbox" if c["route"] == "aggbox" else "gloo",
                "aggbox_s": c["aggbox_s"],
                "gloo_s": c["baseline_s"],
            })
        return out

    @property
    def clamped(self) -> int:
        """Served integer reductions whose result was clamped to int32."""
        return self._engine.clamped

    def float_error_bound(self, max_abs: float, mean: bool = False) -> float:
        """The quantization's bound for a float SUM (``mean``: AVG) when the
        largest |x| over the ranks is `max_abs` (``Communicator.float_error_bound``);
        the result's rounding to its dtype comes on top."""
        return self.communicator.float_error_bound(max_abs, mean)

    def close(self) -> None:
        """Ends this rank's part of the job and stops the group's threads
        (also when the group is collected, and at exit)."""
        self._engine.close()

    def __repr__(self) -> str:
        return f"<aggbox.torch.ProcessGroupAggBox rank={self._rank} size={self._size} run={self.run} job={self.job}>"

    # -- the paths ---------------------------------------------------------

    def _gloo(self, method: str, *args) -> None:
        """A Gloo call from the engine's thread, waited for."""
        try:
            work = getattr(self.gloo, method)(*args)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _NotSent(str(e)) from e
        work.wait()

    def _agg(self, t: torch.Tensor, op: str) -> None:
        """An AggBox allreduce of a contiguous int32 or float32 tensor."""
        if t.numel() == 0:
            return
        try:
            # 1-D: a view of the same memory (a 0-dim tensor has no buffer).
            clamped = self.communicator.allreduce(t.reshape(-1), op=op)
        except (TypeError, ValueError) as e:  # refused before anything was sent
            raise _NotSent(str(e)) from e
        if clamped:
            self._engine.clamped += 1

    def _at_once(self, name: str, path: str, kind: Optional[tuple], t: Optional[torch.Tensor], issue: Callable[..., dist.Work], *args):
        """Gloo's work of a call issued to Gloo now, from the caller's
        thread, or None when it must be queued for the engine's thread
        instead: when a call before it is still queued or running there
        (the route's trials and agreements issue Gloo calls there, and every
        rank must issue its Gloo calls in one order), when the group failed
        or was closed, or when the route sends the call of `kind`
        ((collective, dtype, op); None: only Gloo serves it) and the bytes of
        `t` to AggBox or times it as a trial, asked in the call's place in
        the order. `issue(*args)` starts the Gloo call and leaves nothing to do
        after it. The call is counted now, as served by `path`.

        This is every call's path to Gloo while no AggBox call is in
        flight, so it is kept short: a few microseconds of Python."""
        engine = self._engine
        with engine._lock:
            if engine._pending or engine._broken is not None or engine._closed:
                return None
            done = engine._direct
            # Those done are let go a few at a time (each look costs).
            while len(done) >= _DIRECT_KEPT and done[0].is_completed():
                try:
                    done[0].wait()
                except RuntimeError:
                    # It failed: the engine's thread waits for it before the
                    # next call and says who stopped.
                    return None
                done.pop(0)
            if kind is not None and not self._all_to_gloo:
                # A class's route, once settled, is for good: kept here.
                nbytes = t.numel() * (_ELEMENT_SIZE.get(t.dtype) or t.element_size())
                key = (kind, nbytes.bit_length())
                to_gloo = self._to_gloo.get(key)
                if to_gloo is None:
                    to, trial = self._tuner.pick(self._kinds.setdefault(kind, len(self._kinds)), nbytes)
                    if trial:
                        return None
                    to_gloo = self._to_gloo[key] = to != "aggbox"
                if not to_gloo:
                    return None
            try:
                work = issue(*args)
            except (RuntimeError, ValueError, TypeError) as e:
                raise RuntimeError(f"aggbox: {name}: {e}") from e
            done.append(work)
            engine.stats[(name, path)] += 1
        return work

    def _route(
        self,
        collective: str,
        dtype: Optional[torch.dtype],
        op: Optional[str],
        nbytes: int,
        aggbox: Callable[[], str],
        gloo: Callable[[], None],
    ) -> str:
        """A call AggBox can serve, by the route policy, on the engine's
        thread: `aggbox` (which returns the path that served it: "gloo"
        where it found it cannot after all) or `gloo`; the path.

        With "measure" the tuner names a trial or the class's settled route
        (every rank alike: the calls come in the same order with the same
        collective, dtype, op and size everywhere). A trial is timed here;
        after the class's last one the ranks reduce each route's fastest
        trial with MAX on the Gloo group, in this call's place in the
        order, and the class settles on the agreed numbers."""
        with self._engine._lock:
            kind = self._kinds.setdefault((collective, dtype, op), len(self._kinds))
            route, trial = self._tuner.pick(kind, nbytes)

        def go() -> str:
            if route == "aggbox":
                return aggbox()
            gloo()
            return STEPPED_ASIDE

        if not trial:
            return go()
        self._engine.in_trial = True
        # The ranks start the trial together (the barrier's result reaches
        # them at once), so it times the call, not how far apart the ranks
        # came to it.
        self._agg(torch.zeros(1, dtype=torch.int32), "sum")
        t0 = time.perf_counter()
        path = go()
        took = time.perf_counter() - t0
        with self._engine._lock:
            times = self._tuner.record(kind, nbytes, route, took)
        if times is not None:
            # A collective is as slow as its slowest rank, and every rank
            # must settle alike: the MAX of each route's fastest trial.
            agreed = torch.tensor(times, dtype=torch.float64)
            o = dist.AllreduceOptions()
            o.reduceOp = _R.MAX
            self._gloo("allreduce", [agreed], o)
            a, b = agreed.tolist()
            with self._engine._lock:
                self._tuner.settle(kind, nbytes, (a, b))
        return path

    def _allreduce_tensor(self, t: torch.Tensor, op, opts, collective: str = "allreduce") -> str:
        """Allreduce of one tensor in place, on the engine's thread, by the
        route where AggBox can serve it (`collective` names its class); the
        path that served it."""
        name = _op_name(op)
        agg = self._aggbox_allreduce(t, name)
        if agg is None:
            self._gloo_allreduce(t, op, opts)
            return "gloo"
        nbytes = t.numel() * t.element_size()
        return self._route(collective, t.dtype, name, nbytes, agg, lambda: self._gloo_allreduce(t, op, opts))

    def _aggbox_allreduce(self, t: torch.Tensor, name: Optional[str]) -> Optional[Callable[[], str]]:
        """AggBox's allreduce of `t` in place with op `name`, to run (it
        returns the path that served it), or None where AggBox cannot."""
        dt = t.dtype
        if not _aggbox_serves(t, name):
            return None
        if dt == torch.int32:

            def ints() -> str:
                _contiguous(t, lambda c: self._agg(c, name))
                return "aggbox"

            return ints
        if dt in _FLOATS and name in ("sum", "avg"):
            mean = "mean" if name == "avg" else "sum"

            def floats() -> str:
                if dt == torch.float32:
                    _contiguous(t, lambda c: self._agg(c, mean))
                else:
                    w = t.float()
                    self._agg(w, mean)
                    t.copy_(w)
                return "aggbox"

            return floats
        if dt in _FLOATS and name in ("max", "min"):

            def extremes() -> str:
                k = t.float() if dt != torch.float32 or not t.is_contiguous() else t
                keys = k.view(torch.int32)
                _order_keys(keys)
                self._agg(keys, name)
                _order_keys(keys)
                if k is not t:
                    t.copy_(k)
                return "aggbox"

            return extremes

        # int64, as int32 where every rank's values fit.
        def longs() -> str:
            if not self._int64_fits(t, name):
                self._gloo_allreduce(t, _dict_op(name), None)
                return "gloo"
            w = t.to(torch.int32)
            self._agg(w, name)
            t.copy_(w)
            return "aggbox"

        return longs

    def _int64_fits(self, t: torch.Tensor, name: str) -> bool:
        """Whether every rank's int64 tensor can go as int32 (one AggBox MAX
        of a flag): for a sum every |x| ≤ (2^31−1)/W, so no partial sum
        overflows; for the others every x in int32."""
        limit = _INT32_MAX // self._size if name in ("sum", "avg") else _INT32_MAX
        far = t.numel() > 0 and bool(t.max() > limit or t.min() < -limit)
        flag = torch.tensor([int(far)], dtype=torch.int32)
        self._agg(flag, "max")
        return flag.item() == 0

    def _gloo_allreduce(self, t: torch.Tensor, op, opts=None) -> None:
        """Gloo's allreduce, with what Gloo 1.13 lacks made up: AVG as a SUM
        divided (integers truncated), bfloat16 through float32."""
        name = _op_name(op)
        o = dist.AllreduceOptions()
        o.reduceOp = _R.SUM if name == "avg" else op
        work = t.float() if t.dtype == torch.bfloat16 else t
        self._gloo("allreduce", [work], o)
        if name == "avg":
            if work.is_floating_point():
                work.div_(self._size)
            else:
                work.div_(self._size, rounding_mode="trunc")
        if work is not t:
            t.copy_(work)

    # -- collectives: AggBox where it can ------------------------------------

    @staticmethod
    def _check_op(what: str, tensors, name: Optional[str]) -> None:
        """Refuses at the call what no path can do (bitwise ops, by op table
        name, on floats), as Gloo does, before anything is queued: the group
        goes on."""
        if name in _BITWISE and any(t.is_floating_point() for t in tensors):
            raise RuntimeError(f"aggbox: {what}: bitwise reduce ops need integer tensors, not {tensors[0].dtype}")

    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.AllreduceOptions()
        op = opts.reduceOp
        name = _op_name(op)
        if name in _BITWISE:
            self._check_op("allreduce", tensors, name)
        if len(tensors) == 1:
            t = tensors[0]
            path = _allreduce_at_once_path(t, name)
            if path is not None:
                kind = ("allreduce", t.dtype, name) if path is STEPPED_ASIDE else None
                work = self._at_once("allreduce", path, kind, t, self.gloo.allreduce, tensors, opts)
                if work is not None:
                    return work

        def run() -> str:
            return _path_of([self._allreduce_tensor(t, op, opts) for t in tensors])

        return self._engine.submit("allreduce", tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else _R.SUM

        def run() -> str:
            return _path_of([self._allreduce_tensor(t, op, opts) for t in tensors])

        return self._engine.submit("allreduce_coalesced", tensors, run)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        root, op = opts.rootRank, opts.reduceOp
        t = tensors[opts.rootTensor]
        name = _op_name(op)
        path = _allreduce_at_once_path(t, name) if len(tensors) == 1 else None
        if path is not None:
            o = dist.AllreduceOptions()
            o.reduceOp = op
            kind = ("reduce", t.dtype, name) if path is STEPPED_ASIDE else None
            # As below: the root reduces its tensor, the others a copy.
            work = self._at_once(
                "reduce", path, kind, t,
                lambda: self.gloo.allreduce([t if self._rank == root else t.clone()], o),
            )
            if work is not None:
                return work

        # Served as an allreduce; ranks other than the root reduce a copy,
        # so their tensor is left as it was.
        def run() -> str:
            target = t if self._rank == root else t.clone()
            return self._allreduce_tensor(target, op, opts, "reduce")

        return self._engine.submit("reduce", tensors, run)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank
        if len(tensors) == 1 and tensors[0].numel() > 0 and tensors[0].is_contiguous():
            t = tensors[0]
            work = self._at_once(
                "broadcast", STEPPED_ASIDE, ("broadcast", None, None), t,
                self.gloo.broadcast, [_as_bytes(t)], opts,
            )
            if work is not None:
                return work

        def one(t: torch.Tensor) -> str:
            def aggbox() -> str:
                _contiguous(t, lambda c: self._broadcast_bytes(c, root))
                return "aggbox"

            def gloo() -> None:
                _contiguous(t, lambda c: self._gloo_broadcast_bytes(c, root))

            return self._route("broadcast", None, None, t.numel() * t.element_size(), aggbox, gloo)

        def run() -> str:
            return _path_of([one(t) for t in tensors])

        return self._engine.submit("broadcast", tensors, run)

    def _broadcast_bytes(self, c: torch.Tensor, root: int) -> None:
        """Any dtype, bit for bit: its bytes as int32 words."""
        if c.numel() == 0:
            return
        words, back = _words(c)
        self.communicator.broadcast(words, root=root)
        if back is not None:
            back.copy_(words.view(torch.uint8)[: back.numel()])

    def _gloo_broadcast_bytes(self, c: torch.Tensor, root: int) -> None:
        """Gloo's broadcast of any dtype, bit for bit: its bytes as uint8
        (Gloo 1.13 has no bfloat16)."""
        if c.numel() == 0:
            return
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, 0
        self._gloo("broadcast", [c.reshape(-1).view(torch.uint8)], o)

    def barrier(self, opts=None):
        def run() -> str:
            self._agg(torch.zeros(1, dtype=torch.int32), "sum")
            return "aggbox"

        return self._engine.submit("barrier", [], run)

    def _gathered(self, inp: torch.Tensor) -> Tuple[List[torch.Tensor], str]:
        """Every rank's bytes of `inp` (uint8, by rank), by the route:
        AggBox (`_gather_bytes`) or Gloo's allgather of the bytes; the
        path."""
        out: List[torch.Tensor] = []

        def aggbox() -> str:
            buf, nbytes, slot = self._gather_bytes(inp)
            out[:] = [buf[r * slot : (r + 1) * slot].view(torch.uint8)[:nbytes] for r in range(self._size)]
            return "aggbox"

        def gloo() -> None:
            src = inp.contiguous().reshape(-1).view(torch.uint8)
            parts = [torch.empty_like(src) for _ in range(self._size)]
            if src.numel() > 0:
                self._gloo("allgather", [parts], [src], AllgatherOptions())
            out[:] = parts

        path = self._route("allgather", None, None, inp.numel() * inp.element_size(), aggbox, gloo)
        return out, path

    def _gather_bytes(self, inp: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
        """Every rank's bytes of `inp`: an AggBox BOR of a zeroed buffer with
        this rank's bytes in its slot (the others' are zero, so the OR is
        each slot's owner's bytes, bit for bit). The buffer, the bytes and
        the words of a slot."""
        src = inp.contiguous().reshape(-1).view(torch.uint8)
        nbytes = src.numel()
        slot = (nbytes + 3) // 4
        buf = torch.zeros(slot * self._size, dtype=torch.int32)
        mine = buf[self._rank * slot : (self._rank + 1) * slot].view(torch.uint8)
        mine[:nbytes].copy_(src)
        self._agg(buf, "bor")
        return buf, nbytes, slot

    @staticmethod
    def _put_bytes(out: torch.Tensor, raw: torch.Tensor) -> None:
        def put(c: torch.Tensor) -> None:
            c.reshape(-1).view(torch.uint8).copy_(raw)

        _contiguous(out, put)

    def _allgather_at_once(self, name: str, outs: List[torch.Tensor], inp: torch.Tensor):
        """Gloo's work of an allgather of `inp`'s bytes into `outs` (each a
        contiguous tensor of its size) issued to Gloo at once where the
        route sends it there (`_at_once`), else None."""
        if inp.numel() == 0 or not inp.is_contiguous() or not all(o.is_contiguous() for o in outs):
            return None
        return self._at_once(
            name, STEPPED_ASIDE, ("allgather", None, None), inp,
            self.gloo.allgather, [[_as_bytes(o) for o in outs]], [_as_bytes(inp)], AllgatherOptions(),
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs = output_tensors[0]
        inp = input_tensors[0]
        valid = len(outs) == self._size and all(o.dtype == inp.dtype and o.numel() == inp.numel() for o in outs)
        if valid and len(output_tensors) == 1:
            work = self._allgather_at_once("allgather", outs, inp)
            if work is not None:
                return work

        def run() -> str:
            if not valid:
                raise _NotSent(f"allgather: {self._size} outputs of the input's dtype and size are needed")
            parts, path = self._gathered(inp)
            for o, raw in zip(outs, parts):
                self._put_bytes(o, raw)
            return path

        return self._engine.submit("allgather", output_tensors, run)

    def _allgather_base(self, output, input, opts=None):
        valid = output.dtype == input.dtype and output.numel() == input.numel() * self._size
        if valid and output.is_contiguous():
            work = self._allgather_at_once("_allgather_base", list(output.reshape(-1).chunk(self._size)), input)
            if work is not None:
                return work

        def run() -> str:
            if not valid:
                raise _NotSent("_allgather_base: the output must be world size × the input, of its dtype")
            parts, path = self._gathered(input)
            self._put_bytes(output, torch.cat(parts))
            return path

        return self._engine.submit("_allgather_base", [output], run)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = opts.reduceOp
        out, ins = output_tensors[0], input_tensors[0]

        # An allreduce of the inputs laid end to end, then this rank's part.
        def run() -> str:
            if len(ins) != self._size or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
                raise _NotSent(f"reduce_scatter: {self._size} inputs of the output's dtype and size are needed")
            flat = torch.cat([i.reshape(-1) for i in ins])
            path = self._allreduce_tensor(flat, op, opts, "reduce_scatter")
            n = out.numel()
            out.copy_(flat[self._rank * n : (self._rank + 1) * n].view_as(out))
            return path

        return self._engine.submit("reduce_scatter", output_tensors, run)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = opts.reduceOp

        def run() -> str:
            n = output.numel()
            if input.numel() != n * self._size or input.dtype != output.dtype:
                raise _NotSent("_reduce_scatter_base: the input must be world size × the output, of its dtype")
            flat = input.reshape(-1).clone()
            path = self._allreduce_tensor(flat, op, opts, "reduce_scatter")
            output.copy_(flat[self._rank * n : (self._rank + 1) * n].view_as(output))
            return path

        return self._engine.submit("_reduce_scatter_base", [output], run)

    # -- collectives through Gloo, in the same order ---------------------------

    def _through_gloo(self, name: str, outputs, method: str, *args):
        work = self._at_once(name, "gloo", None, None, getattr(self.gloo, method), *args)
        if work is not None:
            return work

        def run() -> str:
            self._gloo(method, *args)
            return "gloo"

        return self._engine.submit(name, outputs, run)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._through_gloo(
            "all_to_all", [output], "alltoall_base", output, input, output_split_sizes, input_split_sizes, opts
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()

        # Gloo 1.13 has only the one-tensor form: the lists laid end to end.
        def run() -> str:
            if len({t.dtype for t in list(output_tensors) + list(input_tensors)}) > 1:
                raise _NotSent("all_to_all: tensors of one dtype")
            inp = torch.cat([t.reshape(-1) for t in input_tensors])
            out = torch.empty(sum(t.numel() for t in output_tensors), dtype=inp.dtype)
            self._gloo(
                "alltoall_base", out, inp, [t.numel() for t in output_tensors], [t.numel() for t in input_tensors], opts
            )
            for t, part in zip(output_tensors, out.split([t.numel() for t in output_tensors])):
                t.copy_(part.view_as(t))
            return "gloo"

        return self._engine.submit("all_to_all", output_tensors, run)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        outs = output_tensors[0] if output_tensors else []
        return self._through_gloo("gather", outs, "gather", output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._through_gloo("scatter", output_tensors, "scatter", output_tensors, input_tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts or AllgatherOptions()
        return self._through_gloo(
            "allgather_coalesced", [t for ol in output_lists for t in ol], "allgather_coalesced", output_lists, input_list, opts
        )

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        # Gloo's own (it names the ranks that did not arrive), once the
        # calls before it are done.
        def run() -> str:
            try:
                self.gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
            except RuntimeError as e:
                raise _NotSent(str(e)) from e
            return "gloo"

        self._engine.submit("monitored_barrier", [], run).wait()

    # Point to point: Gloo at once, from the caller's thread (module docs).
    def send(self, tensors, dst_rank, tag):
        self._engine.count("send", "gloo")
        return self.gloo.send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        self._engine.count("recv", "gloo")
        return self.gloo.recv(tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag):
        self._engine.count("recv", "gloo")
        return self.gloo.recv_anysource(tensors, tag)


def _create(backend_options, pg_options) -> ProcessGroupAggBox:
    """The creator registered with torch (extended API: pg_options may be an
    aggbox.torch.Options)."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f'backend "aggbox": pg_options must be aggbox.torch.Options, not {type(pg_options).__name__}')
    return ProcessGroupAggBox(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        pg_options,
    )


def register() -> None:
    """Registers the backend "aggbox" with torch.distributed (once; importing
    aggbox.torch does it)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True)
