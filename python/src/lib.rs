//! `aggbox._aggbox`: the AggBox runtime ([`aggbox::runtime::Communicator`],
//! or [`StripedCommunicator`] over several jobs) as a Python extension
//! module. The Python package around it (`aggbox/`) re-exports it and adds
//! the DDP hook; every collective is the runtime's own call, on the caller's
//! memory (docs/PYTHON.md). `Tuner` is the runtime's per-size choice between
//! AggBox and a baseline ([`aggbox::runtime::tuner`]), for the hook.
//!
//! Buffers come through the buffer protocol ([`PyBuffer`]): numpy arrays,
//! `array.array`, `memoryview`s, anything that exports C-contiguous,
//! writable int32 or float32 memory, and CPU torch tensors through their
//! numpy view (`exporter`). The runtime reads and writes that memory in
//! place while the GIL is released (`py.allow_threads`): no copy into
//! Python objects, and other Python threads (a DDP backward pass) go on
//! meanwhile.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Duration;

use aggbox::config::Config;
use aggbox::runtime::quantize::{adaptive_scale, DEFAULT_SCALE};
use aggbox::runtime::tuner::{self, Pick, Policy, Route, Tuner, DEFAULT_TRIALS};
use aggbox::runtime::api::broadcast_elements;
use aggbox::runtime::control::{Credential, JobShape, RunCommunicator, RunJob, TreeParent};
use aggbox::runtime::{
    Algorithm, BackendKind, CallOptions, Collective, CommError, CommStats, Communicator,
    CommunicatorBuilder, Elements, Participant, Peer, Quantization, RingCommunicator, Served,
    StarOrRing, StripedCommunicator, WireElement,
};
use aggbox::wire::abi::Op;
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(
    _aggbox,
    AggBoxError,
    PyException,
    "An AggBox call failed; the message is the runtime's."
);
create_exception!(
    _aggbox,
    CommTimeoutError,
    AggBoxError,
    "A call reached its deadline. `missing` names who did not answer (\"rank 2\", \"aggregator\"; empty when the kernel backend cannot tell), `round` is the call's round."
);
create_exception!(
    _aggbox,
    QuantizationOverflowError,
    AggBoxError,
    "A float sum overflowed int32 at the fixed quantization scale (use quantization=\"adaptive\")."
);
create_exception!(
    _aggbox,
    ConfigError,
    AggBoxError,
    "The configuration or the arguments of a communicator are invalid."
);
create_exception!(
    _aggbox,
    CommClosedError,
    AggBoxError,
    "The communicator was closed (or its progress thread is gone)."
);

/// The runtime's error as the Python exception of its kind, with the
/// runtime's message (a timeout also carries `missing` and `round`).
fn to_py_err(py: Python<'_>, e: CommError) -> PyErr {
    let msg = e.to_string();
    match e {
        CommError::Timeout(info) => {
            let err = CommTimeoutError::new_err(msg);
            let value = err.value(py);
            let missing: Vec<String> = info.missing.iter().map(Peer::to_string).collect();
            // Attributes on a fresh exception object cannot fail to be set.
            let _ = value.setattr("missing", missing);
            let _ = value.setattr("round", info.round.0);
            err
        }
        CommError::Overflow { .. } => QuantizationOverflowError::new_err(msg),
        CommError::Config(_) => ConfigError::new_err(msg),
        CommError::Closed => CommClosedError::new_err(msg),
        CommError::Io(_) | CommError::Position(_) | CommError::JobLost(_) => AggBoxError::new_err(msg),
    }
}

fn parse_backend(name: &str) -> PyResult<BackendKind> {
    match name {
        "kernel" => Ok(BackendKind::Kernel),
        "socket" => Ok(BackendKind::Socket),
        other => Err(PyValueError::new_err(format!(
            "backend '{other}': \"kernel\" or \"socket\""
        ))),
    }
}

/// `"adaptive"`, `"fixed"` (the runtime's default scale), `"fixed-or-adaptive"`,
/// or a number: a fixed scale.
fn parse_quantization(q: &Bound<'_, PyAny>) -> PyResult<Quantization> {
    if let Ok(scale) = q.extract::<f64>() {
        return Ok(Quantization::Fixed(scale));
    }
    match q.extract::<String>()?.as_str() {
        "adaptive" => Ok(Quantization::Adaptive),
        "fixed" => Ok(Quantization::Fixed(DEFAULT_SCALE)),
        "fixed-or-adaptive" => Ok(Quantization::FixedOrAdaptive(DEFAULT_SCALE)),
        other => Err(PyValueError::new_err(format!(
            "quantization '{other}': \"adaptive\", \"fixed\", \"fixed-or-adaptive\" or a scale (float)"
        ))),
    }
}

fn parse_ip(what: &str, s: &str) -> PyResult<IpAddr> {
    s.parse()
        .map_err(|_| PyValueError::new_err(format!("{what} '{s}' is not an IP address (IPv4 A.B.C.D or IPv6)")))
}

/// `rank` (0..workers) is a worker, `None` the aggregator's application.
fn participant(rank: Option<u16>) -> Participant {
    rank.map_or(Participant::Aggregator, Participant::Worker)
}

/// A broadcast root: a rank, or `"aggregator"`.
fn parse_root(root: &Bound<'_, PyAny>) -> PyResult<Participant> {
    if let Ok(r) = root.extract::<u16>() {
        return Ok(Participant::Worker(r));
    }
    match root.extract::<String>().ok().as_deref() {
        Some("aggregator") => Ok(Participant::Aggregator),
        _ => Err(PyValueError::new_err(format!(
            "root {root}: a worker rank (int) or \"aggregator\""
        ))),
    }
}

fn deadline(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "deadline {seconds} s: a positive number of seconds"
            ))
        })
}

/// A caller's buffer, checked: writable, C-contiguous, int32 or float32.
enum Buffer {
    I32(PyBuffer<i32>),
    F32(PyBuffer<f32>),
}

/// The caller's memory, lent to the runtime while the GIL is released.
/// The exported buffer (kept alive by the `PyBuffer` the caller holds)
/// pins it: numpy refuses to resize or free an array with exports.
struct Lent<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the pointer is used by the one thread that runs the call, while
// the caller's `PyBuffer` keeps the memory exported and alive.
unsafe impl<T> Send for Lent<T> {}

impl<T> Lent<T> {
    /// SAFETY: no other Rust reference to the memory may be alive; Python
    /// code that writes the buffer meanwhile races with the call, as it
    /// would with any GIL-releasing extension (documented).
    unsafe fn slice(&mut self) -> &mut [T] {
        if self.len == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

impl Buffer {
    /// The buffer of `obj` (a CPU torch.Tensor through its numpy view, which
    /// shares its memory), checked.
    fn of(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        let exporter = exporter(obj)?;
        let buf = if let Ok(b) = PyBuffer::<i32>::get(&exporter) {
            check(what, obj, b.readonly(), b.is_c_contiguous())?;
            Buffer::I32(b)
        } else if let Ok(b) = PyBuffer::<f32>::get(&exporter) {
            check(what, obj, b.readonly(), b.is_c_contiguous())?;
            Buffer::F32(b)
        } else {
            return Err(PyTypeError::new_err(format!(
                "{what}: {} is not an int32 or float32 buffer{}",
                type_name(obj),
                describe_buffer(obj, &exporter)
            )));
        };
        Ok(buf)
    }
}

/// The object whose buffer holds `obj`'s elements: `obj` itself, or for a
/// torch.Tensor (which has no buffer protocol) `obj.detach().numpy()`, a
/// numpy array on the tensor's memory (torch raises for a tensor that is not
/// on the CPU). torch is looked up only if the caller imported it.
fn exporter<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let torch = py
        .import("sys")?
        .getattr("modules")?
        .call_method1("get", ("torch",))?;
    if !torch.is_none() && obj.is_instance(&torch.getattr("Tensor")?)? {
        return obj.call_method0("detach")?.call_method0("numpy");
    }
    Ok(obj.clone())
}

fn lend<T: pyo3::buffer::Element>(b: &PyBuffer<T>) -> Lent<T> {
    Lent {
        ptr: b.buf_ptr() as *mut T,
        len: b.item_count(),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// What `obj`'s elements are, for an error: ` (torch.float64)` for a
/// tensor, ` (format 'd', 8-byte items)` for a buffer of another type, ` (it
/// does not support the buffer protocol)` otherwise.
fn describe_buffer(obj: &Bound<'_, PyAny>, exporter: &Bound<'_, PyAny>) -> String {
    if !obj.is(exporter) {
        if let Ok(dtype) = obj.getattr("dtype").and_then(|d| d.str()) {
            return format!(" ({dtype})");
        }
    }
    let py = obj.py();
    match py
        .import("builtins")
        .and_then(|b| b.getattr("memoryview"))
        .and_then(|mv| mv.call1((exporter,)))
    {
        Ok(view) => {
            let format: String = view
                .getattr("format")
                .and_then(|f| f.extract())
                .unwrap_or_default();
            let size: usize = view
                .getattr("itemsize")
                .and_then(|f| f.extract())
                .unwrap_or_default();
            let _ = view.call_method0("release");
            format!(" (format '{format}', {size}-byte items)")
        }
        Err(_) => " (it does not support the buffer protocol)".into(),
    }
}

fn check(what: &str, obj: &Bound<'_, PyAny>, readonly: bool, contiguous: bool) -> PyResult<()> {
    if readonly {
        return Err(PyValueError::new_err(format!(
            "{what}: the {} is read-only; the call writes its result into the buffer",
            type_name(obj)
        )));
    }
    if !contiguous {
        return Err(PyValueError::new_err(format!(
            "{what}: the {} is not C-contiguous; pass a contiguous copy (numpy.ascontiguousarray, Tensor.contiguous)",
            type_name(obj)
        )));
    }
    Ok(())
}

/// Float ops: SUM, or the mean (SUM divided by the number of workers).
fn float_mean(what: &str, op: &str) -> PyResult<bool> {
    match op.to_ascii_lowercase().as_str() {
        "sum" => Ok(false),
        "mean" | "avg" => Ok(true),
        _ => Err(PyValueError::new_err(format!(
            "{what}: op '{op}' on float32: \"sum\" or \"mean\" (quantized floats add only)"
        ))),
    }
}

fn int_op(what: &str, op: &str) -> PyResult<Op> {
    let name = if op.eq_ignore_ascii_case("mean") {
        "avg"
    } else {
        op
    };
    Op::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "{what}: op '{op}': one of {} (or mean: avg)",
            Op::names_list()
        ))
    })
}

/// The runtime object behind a Python `Communicator`: one job, or each
/// vector striped over several jobs at once (`from_config(job=[...])`,
/// [`StripedCommunicator`]), or either as the star beside a ring, chosen
/// per call (`from_config(ring=...)`, [`StarOrRing`]).
enum Comm {
    One(Communicator),
    Striped(StripedCommunicator),
    Chosen(Box<StarOrRing<Comm>>),
    /// A job on demand (`connect`): the communicator, then the run's job,
    /// ended once the communicator has stopped (field order).
    OnDemand(Box<OnDemand>),
}

type OnDemand = RunCommunicator;

impl Comm {
    /// The communicator (the first stripe's): participant, workers, options.
    fn first(&self) -> &Communicator {
        match self {
            Comm::One(c) => c,
            Comm::Striped(s) => &s.stripes()[0],
            Comm::Chosen(s) => s.star().expect("from_config builds the star").first(),
            Comm::OnDemand(d) => d.communicator(),
        }
    }

    fn jobs(&self) -> Vec<u16> {
        match self {
            Comm::One(c) => vec![c.config().job],
            Comm::Striped(s) => s.stripes().iter().map(|c| c.config().job).collect(),
            Comm::Chosen(s) => s.star().expect("from_config builds the star").jobs(),
            Comm::OnDemand(d) => d.runs().iter().map(|r| r.grant().job).collect(),
        }
    }

    /// The calls, whichever algorithm serves them.
    fn collective(&self) -> &dyn Collective {
        match self {
            Comm::One(c) => c,
            Comm::Striped(s) => s,
            Comm::Chosen(s) => s.as_ref(),
            Comm::OnDemand(d) => d.as_ref(),
        }
    }

    /// An allreduce (`all`) or a reduce of `data` with `op`; whether an
    /// element was clamped.
    fn reduce(&self, data: Elements<'_>, all: bool, op: Op) -> Result<Served, CommError> {
        let (c, opts) = (self.collective(), CallOptions::default());
        if all {
            c.allreduce_elements(data, op, opts)
        } else {
            c.reduce_elements(data, op, opts)
        }
    }

    /// A broadcast of int32 or float32 elements (big-endian on the wire).
    fn broadcast<T: WireElement>(&self, buf: &mut [T], root: Participant) -> Result<(), CommError> {
        broadcast_elements(self.collective(), buf, root, CallOptions::default()).map(drop)
    }
}

/// The star of a [`StarOrRing`] is a [`Comm`] itself (one job or striped).
impl Collective for Comm {
    fn participant(&self) -> Participant {
        self.collective().participant()
    }
    fn workers(&self) -> u16 {
        self.collective().workers()
    }
    fn stats(&self) -> CommStats {
        self.collective().stats()
    }
    fn lost(&self) -> Option<String> {
        self.collective().lost()
    }
    fn allreduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.collective().allreduce_elements(data, op, opts)
    }
    fn reduce_elements(&self, data: Elements<'_>, op: Op, opts: CallOptions) -> Result<Served, CommError> {
        self.collective().reduce_elements(data, op, opts)
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: Participant, opts: CallOptions) -> Result<Served, CommError> {
        self.collective().broadcast_bytes(buf, root, opts)
    }
}

/// One participant of an AggBox job: allreduce, reduce and broadcast of
/// int32 and float32 buffers in place, with the GIL released
/// (docs/PYTHON.md). Built with `Communicator.from_config(...)` from the
/// node's configuration, or `Communicator(...)` with everything explicit.
///
/// Communicator(job, peers, aggregator, port, rank, ...): job `job` whose
/// workers' data sockets are `peers` ("IP:PORT", rank r at peers[r]), the
/// aggregator node at `aggregator`, the job's contribution port `port`;
/// `rank` is this worker's rank, or None for the aggregator's application.
/// `backend`: "socket" (user-space aggregator) or "kernel" (the node's XDP
/// aggregator; needs `result_port`). `deadline`: seconds a call may take.
/// `quantization`: how float32 travels, "adaptive" (default; never
/// overflows), "fixed" (scale 1e8), "fixed-or-adaptive", or a fixed scale.
/// `mtu`: 0 discovers the path MTU.
#[pyclass(module = "aggbox._aggbox", name = "Communicator", frozen)]
struct PyCommunicator {
    // `None` once closed. Calls hold the read lock (several may be queued at
    // once: the runtime runs them in issue order), `close` the write lock;
    // both are taken with the GIL released, so a call finishing never waits
    // for a thread that holds the GIL while it waits for the lock.
    inner: RwLock<Option<Comm>>,
    /// Reductions served by the star and by the ring (`served` getter).
    served: [AtomicU64; 2],
}

impl PyCommunicator {
    fn wrap(
        py: Python<'_>,
        build: impl FnOnce() -> Result<Comm, CommError> + Send,
    ) -> PyResult<PyCommunicator> {
        let comm = py.allow_threads(build).map_err(|e| to_py_err(py, e))?;
        Ok(PyCommunicator {
            inner: RwLock::new(Some(comm)),
            served: Default::default(),
        })
    }

    /// Runs `f` on the communicator with the GIL released.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Comm) -> Result<T, CommError> + Send,
    ) -> PyResult<T> {
        py.allow_threads(|| {
            let guard = self.inner.read().unwrap_or_else(|p| p.into_inner());
            match guard.as_ref() {
                Some(c) => f(c),
                None => Err(CommError::Closed),
            }
        })
        .map_err(|e| to_py_err(py, e))
    }

    fn with<T>(&self, f: impl FnOnce(&Communicator) -> T) -> PyResult<T> {
        self.with_comm(|c| f(c.first()))
    }

    fn with_comm<T>(&self, f: impl FnOnce(&Comm) -> T) -> PyResult<T> {
        let guard = self.inner.read().unwrap_or_else(|p| p.into_inner());
        guard
            .as_ref()
            .map(f)
            .ok_or_else(|| CommClosedError::new_err("communicator closed"))
    }

    /// Counts a reduction by the algorithm that served it; whether an
    /// element was clamped.
    fn count(&self, served: Served) -> bool {
        let i = usize::from(served.algorithm == Algorithm::Ring);
        self.served[i].fetch_add(1, Ordering::Relaxed);
        served.clamped
    }

    fn reduce(
        &self,
        py: Python<'_>,
        what: &str,
        buf: &Bound<'_, PyAny>,
        op: &str,
        all: bool,
    ) -> PyResult<bool> {
        match Buffer::of(what, buf)? {
            Buffer::I32(b) => {
                let op = int_op(what, op)?;
                let mut lent = lend(&b);
                // SAFETY: see `Lent`; `b` outlives the call.
                let out = self.call(py, move |c| c.reduce(Elements::I32(unsafe { lent.slice() }), all, op));
                b.release(py);
                out.map(|s| self.count(s))
            }
            Buffer::F32(b) => {
                let mean = float_mean(what, op)?;
                let mut lent = lend(&b);
                // SAFETY: see `Lent`; `b` outlives the call.
                let op = if mean { Op::Avg } else { Op::Sum };
                let out = self.call(py, move |c| c.reduce(Elements::F32(unsafe { lent.slice() }), all, op));
                b.release(py);
                out.map(|s| self.count(s))
            }
        }
    }
}

/// `connect(tree=...)`'s dict as the join's parent.
fn tree_parent(tree: &Bound<'_, PyDict>) -> PyResult<TreeParent> {
    let item = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        tree.get_item(k)?.ok_or_else(|| PyValueError::new_err(format!("tree: no {k:?} (give root, leaf, leaves and workers)")))
    };
    for k in tree.keys() {
        let k: String = k.extract()?;
        if !["root", "leaf", "leaves", "workers"].contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!("tree: unknown key {k:?} (root, leaf, leaves, workers)")));
        }
    }
    let root: String = item("root")?.extract()?;
    Ok(TreeParent {
        node: root.parse().map_err(|_| PyValueError::new_err(format!("tree root {root:?}: the root node's control endpoint as IP:PORT")))?,
        leaf: item("leaf")?.extract()?,
        leaves: item("leaves")?.extract()?,
        tree_workers: item("workers")?.extract()?,
    })
}

/// `connect(ring=...)`: this rank's own node's control endpoint, its pin
/// directory and the ring threshold (elements), if given.
fn ring_member(ring: &Bound<'_, PyDict>) -> PyResult<(SocketAddr, PathBuf, Option<usize>)> {
    for k in ring.keys() {
        let k: String = k.extract()?;
        if !["node", "pins", "threshold"].contains(&k.as_str()) {
            return Err(PyValueError::new_err(format!("ring: unknown key {k:?} (node, pins, threshold)")));
        }
    }
    let item = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ring.get_item(k)?.ok_or_else(|| PyValueError::new_err(format!("ring: no {k:?} (give node and pins)")))
    };
    let node: String = item("node")?.extract()?;
    let node = node.parse().map_err(|_| PyValueError::new_err(format!("ring node {node:?}: this rank's own node's control endpoint as IP:PORT")))?;
    let pins: PathBuf = item("pins")?.extract()?;
    let threshold = ring.get_item("threshold")?.map(|t| t.extract()).transpose()?;
    Ok((node, pins, threshold))
}

#[pymethods]
impl PyCommunicator {
    /// See the class's docs.
    #[new]
    #[pyo3(signature = (job, peers, aggregator, port, rank, *, backend = "socket", result_port = 0, deadline = 10.0, quantization = None, mtu = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: u16,
        peers: Vec<String>,
        aggregator: &str,
        port: u16,
        rank: Option<u16>,
        backend: &str,
        result_port: u16,
        deadline: f64,
        quantization: Option<&Bound<'_, PyAny>>,
        mtu: usize,
    ) -> PyResult<PyCommunicator> {
        let peers = peers
            .iter()
            .map(|p| {
                p.parse::<SocketAddr>()
                    .map_err(|_| PyValueError::new_err(format!("peer '{p}' is not IPv4:PORT or [IPv6]:PORT")))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let aggregator = parse_ip("aggregator", aggregator)?;
        let b = Communicator::builder(job, peers, aggregator, port, participant(rank))
            .backend(parse_backend(backend)?)
            .result_port(result_port);
        let b = Tuning::new(deadline, quantization, mtu)?.apply(b);
        Self::wrap(py, move || b.build().map(Comm::One))
    }

    /// The participant `rank` (None: the aggregator's application) of job
    /// `job` of the node configuration at `path` (the TOML `aggbox attach`
    /// reads), with the node at `aggregator`. The worker's data port defaults
    /// to its member entry in the (first) job's `result_group`. Raises
    /// ConfigError with the file, line and key of a bad configuration.
    /// `job` may be a list of jobs: each vector is then striped over them,
    /// a part per job at once (the runtime's StripedCommunicator), and this
    /// participant's data socket of job t is on `data_port + t`.
    /// `ring`: a `[[ring]]` id of the same workers, served by this host's
    /// node (its maps pinned under `pin_dir`, e.g. /sys/fs/bpf/aggbox/eth0):
    /// each allreduce then goes to the star or the ring by its size
    /// (`algorithm`: "auto" (default), "star" or "ring"; `ring_threshold`:
    /// the size in elements from which "auto" takes the ring, default by
    /// MTU and ring size).
    #[staticmethod]
    #[pyo3(signature = (path, *, job, rank, aggregator, data_port = None, backend = "kernel", deadline = 10.0, quantization = None, mtu = 0, ring = None, pin_dir = None, algorithm = "auto", ring_threshold = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_config(
        py: Python<'_>,
        path: PathBuf,
        job: &Bound<'_, PyAny>,
        rank: Option<u16>,
        aggregator: &str,
        data_port: Option<u16>,
        backend: &str,
        deadline: f64,
        quantization: Option<&Bound<'_, PyAny>>,
        mtu: usize,
        ring: Option<u16>,
        pin_dir: Option<PathBuf>,
        algorithm: &str,
        ring_threshold: Option<usize>,
    ) -> PyResult<PyCommunicator> {
        let algorithm = match algorithm {
            "auto" => Algorithm::Auto,
            "star" => Algorithm::Star,
            "ring" => Algorithm::Ring,
            other => {
                return Err(PyValueError::new_err(format!(
                    "algorithm '{other}': one of auto, star, ring"
                )))
            }
        };
        let ring = match (ring, pin_dir) {
            (None, None) => None,
            (Some(id), Some(dir)) => Some((id, dir)),
            (Some(id), None) => {
                return Err(PyValueError::new_err(format!(
                    "ring {id}: pin_dir is needed too (where this host's `aggbox attach` pinned its maps, e.g. /sys/fs/bpf/aggbox/eth0)"
                )))
            }
            (None, Some(_)) => return Err(PyValueError::new_err("pin_dir without ring")),
        };
        let config = Config::load(&path).map_err(|e| ConfigError::new_err(e.to_string()))?;
        let aggregator = parse_ip("aggregator", aggregator)?;
        let jobs: Vec<u16> = match job.extract::<u16>() {
            Ok(j) => vec![j],
            Err(_) => job.extract().map_err(|_| {
                PyTypeError::new_err(format!("job {job}: a job id (int) or a list of job ids"))
            })?,
        };
        let first = *jobs
            .first()
            .ok_or_else(|| PyValueError::new_err("job: an empty list of jobs"))?;
        let data_port = match data_port {
            Some(p) => p,
            None => group_data_port(&config, first, rank)?,
        };
        let backend = parse_backend(backend)?;
        let tuning = Tuning::new(deadline, quantization, mtu)?;
        let me = participant(rank);
        let single = match jobs[..] {
            [job] => Some(
                tuning.apply(
                    CommunicatorBuilder::from_config(&config, job, aggregator, data_port, me)
                        .map_err(|e| to_py_err(py, e))?
                        .backend(backend),
                ),
            ),
            _ => None,
        };
        Self::wrap(py, move || {
            let star = match single {
                Some(b) => b.build().map(Comm::One)?,
                None => StripedCommunicator::from_config(&config, &jobs, aggregator, data_port, me, |b| {
                    tuning.apply(b.backend(backend))
                })
                .map(Comm::Striped)?,
            };
            let Some((id, dir)) = ring else { return Ok(star) };
            let mut ring = RingCommunicator::open(&config, id, &dir)?;
            ring.set_deadline(tuning.deadline);
            ring.set_quantization(tuning.quantization);
            let mtu = star.first().config().mtu;
            let mut chosen = StarOrRing::of(Some(star), Some(ring), Some(mtu))?.with_algorithm(algorithm);
            if let Some(n) = ring_threshold {
                chosen = chosen.with_ring_threshold(n);
            }
            Ok(Comm::Chosen(Box::new(chosen)))
        })
    }

    /// Joins rank `rank` of run `run` (a key every rank of the run shares)
    /// of `world` ranks at the node's control endpoint `node`
    /// ("IP:PORT"), this rank's data socket `data` ("IP:PORT"); returns once
    /// every rank has joined and the node serves the run's job (jobs on
    /// demand: no node file on the workers). `node` may be a list of
    /// several nodes' endpoints (the same on every rank, in the same
    /// order): each vector is then striped over the run's job at each,
    /// stripe t through the data port plus t. The credential is `tenant`
    /// and `key` (hex), else AGGBOX_TENANT and AGGBOX_KEY. The job is
    /// renewed while the communicator lives and ended for this rank by
    /// `close()`. Raises AggBoxError with the node's reason when refused.
    /// `tree` makes `node` (one endpoint) a leaf of a tree of nodes
    /// (docs/INTERFACE.md, "Trees on demand"): a dict with `root` (the
    /// root node's control endpoint "IP:PORT"), `leaf` (this leaf's index),
    /// `leaves` and `workers` (the tree's); `world` and `rank` then count
    /// this leaf's workers. `ring` asks for a ring of the run's ranks at
    /// their own nodes besides the job (docs/INTERFACE.md, "Rings on
    /// demand"; `vector_len` required): a dict with `node` (this rank's own
    /// node's control endpoint "IP:PORT"), `pins` (that node's pin
    /// directory) and optionally `threshold` (calls of at least this many
    /// elements take the ring); call it in that node's network namespace.
    #[staticmethod]
    #[pyo3(signature = (node, *, run, world, rank, data, tenant = None, key = None, vector_len = None, join_deadline = 60.0, deadline = 10.0, quantization = None, mtu = 0, tree = None, ring = None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        run: String,
        world: u16,
        rank: u16,
        data: &str,
        tenant: Option<String>,
        key: Option<String>,
        vector_len: Option<u32>,
        join_deadline: f64,
        deadline: f64,
        quantization: Option<&Bound<'_, PyAny>>,
        mtu: usize,
        tree: Option<&Bound<'_, PyDict>>,
        ring: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyCommunicator> {
        let parent = tree.map(tree_parent).transpose()?;
        let ring = ring.map(ring_member).transpose()?;
        let nodes: Vec<String> = match node.extract::<String>() {
            Ok(one) => vec![one],
            Err(_) => node.extract().map_err(|_| PyValueError::new_err("node: a control endpoint \"IP:PORT\" or a list of them"))?,
        };
        let nodes = nodes
            .iter()
            .map(|n| n.parse().map_err(|_| PyValueError::new_err(format!("node {n:?}: the control endpoint as IP:PORT"))))
            .collect::<PyResult<Vec<std::net::SocketAddr>>>()?;
        let data: SocketAddr = data
            .parse()
            .map_err(|_| PyValueError::new_err(format!("data {data:?}: this rank's data socket as IP:PORT")))?;
        let credential = match (tenant, key) {
            (Some(tenant), Some(key)) => Credential::from_hex(&tenant, &key).map_err(|e| to_py_err(py, e))?,
            (None, None) => Credential::from_env().map_err(|e| to_py_err(py, e))?,
            _ => return Err(PyValueError::new_err("give both tenant and key, or neither (AGGBOX_TENANT, AGGBOX_KEY)")),
        };
        let join_deadline = self::deadline(join_deadline)?;
        let tuning = Tuning::new(deadline, quantization, mtu)?;
        if parent.is_some() && nodes.len() != 1 {
            return Err(PyValueError::new_err("tree: a leaf joins one node (its own), not a list"));
        }
        if ring.is_some() && (nodes.len() != 1 || parent.is_some()) {
            return Err(PyValueError::new_err("ring: a run with a ring joins one node, not a list, and is not a tree"));
        }
        Self::wrap(py, move || {
            if let Some((own, pins, threshold)) = ring {
                let shape = JobShape { vector_len, ring: Some(own), ..JobShape::default() };
                let run = RunJob::join_shaped(nodes[0], credential, &run, world, rank, data, shape, join_deadline)?;
                let mut ring = run.ring(&pins)?;
                ring.set_deadline(tuning.deadline);
                ring.set_quantization(tuning.quantization);
                let comm = RunCommunicator::from_runs(vec![run], |b| tuning.apply(b))?;
                let mtu = comm.communicator().config().mtu;
                let mut chosen = StarOrRing::of(Some(Comm::OnDemand(Box::new(comm))), Some(ring), Some(mtu))?;
                if let Some(n) = threshold {
                    chosen = chosen.with_ring_threshold(n);
                }
                return Ok(Comm::Chosen(Box::new(chosen)));
            }
            let comm = match parent {
                None => RunCommunicator::join(&nodes, credential, &run, world, rank, data, vector_len, join_deadline, |b| tuning.apply(b))?,
                Some(parent) => {
                    let shape = JobShape { vector_len, parent: Some(parent), ..JobShape::default() };
                    RunJob::join_shaped(nodes[0], credential, &run, world, rank, data, shape, join_deadline)?.communicator(|b| tuning.apply(b))?
                }
            };
            Ok(Comm::OnDemand(Box::new(comm)))
        })
    }

    /// This worker's rank; `None` for the aggregator.
    #[getter]
    fn rank(&self) -> PyResult<Option<u16>> {
        self.with(|c| c.rank())
    }

    /// Number of workers of the job.
    #[getter]
    fn workers(&self) -> PyResult<u16> {
        self.with(|c| c.workers())
    }

    /// The job id (the first stripe's when striped).
    #[getter]
    fn job(&self) -> PyResult<u16> {
        self.with(|c| c.config().job)
    }

    /// The job ids: one, or the stripes' in order.
    #[getter]
    fn jobs(&self) -> PyResult<Vec<u16>> {
        self.with_comm(Comm::jobs)
    }

    /// Reductions this communicator made, by the algorithm that served
    /// them: `{"star": n, "ring": m}` (the ring only with `from_config(ring=...)`).
    #[getter]
    fn served(&self) -> std::collections::HashMap<&'static str, u64> {
        [("star", &self.served[0]), ("ring", &self.served[1])]
            .into_iter()
            .map(|(k, v)| (k, v.load(Ordering::Relaxed)))
            .collect()
    }

    /// The path MTU the fragments are sized for.
    #[getter]
    fn mtu(&self) -> PyResult<usize> {
        self.with(|c| c.config().mtu)
    }

    /// Whether the job is served by the node (`consumer = "node"`).
    #[getter]
    fn node_served(&self) -> PyResult<bool> {
        self.with(|c| c.config().node_served)
    }

    /// Allreduce in place: every worker's `buf` (C-contiguous, writable,
    /// int32 or float32: numpy array, CPU torch.Tensor, any buffer) gets the
    /// reduction over every worker's `buf`; all must have the same length.
    /// int32: `op` is a name of the op table (sum, count, max, min, avg,
    /// prod, band, bor, bxor, land, lor; "mean" is avg), exact; returns True
    /// if an element was clamped to int32.
    /// float32: `op` is "sum" or "mean", quantized to int32 on the way
    /// (error bound: float_error_bound); returns False.
    #[pyo3(signature = (buf, op = "sum"))]
    fn allreduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<bool> {
        self.reduce(py, "allreduce", buf, op, true)
    }

    /// Reduce to the aggregator: a worker's `buf` is its contribution (left
    /// unchanged); the aggregator's application gets the result in its `buf`.
    /// Same buffers and ops as allreduce.
    #[pyo3(name = "reduce", signature = (buf, op = "sum"))]
    fn reduce_to_aggregator(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<bool> {
        self.reduce(py, "reduce", buf, op, false)
    }

    /// Broadcast in place from `root` (a worker rank, default 0, or
    /// "aggregator"): every other participant's `buf` (same length, int32 or
    /// float32) is overwritten with the root's. Values travel bit for bit.
    #[pyo3(signature = (buf, root = None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let root = match root {
            Some(r) => parse_root(r)?,
            None => Participant::Worker(0),
        };
        match Buffer::of("broadcast", buf)? {
            Buffer::I32(b) => {
                let mut lent = lend(&b);
                // SAFETY: see `Lent`; `b` outlives the call.
                let out = self.call(py, move |c| c.broadcast(unsafe { lent.slice() }, root));
                b.release(py);
                out
            }
            Buffer::F32(b) => {
                let mut lent = lend(&b);
                // SAFETY: see `Lent`; `b` outlives the call.
                let out = self.call(py, move |c| c.broadcast(unsafe { lent.slice() }, root));
                b.release(py);
                out
            }
        }
    }

    /// The largest absolute error of one float32 element of a SUM (or,
    /// `mean`, a mean) when the largest |x| over every rank's input is
    /// `max_abs`, from the quantization alone: each of the W workers rounds
    /// x·S to an integer (at most 1/2 off), so a SUM errs by at most
    /// W/(2S) and a mean by 1/(2S). S is the fixed scale, or the adaptive
    /// one the workers agree on for `max_abs` (for "fixed-or-adaptive" the
    /// larger of the two bounds). The result is then rounded once to
    /// float32 (half an ulp of the result on top).
    #[pyo3(signature = (max_abs, mean = false))]
    fn float_error_bound(&self, max_abs: f32, mean: bool) -> PyResult<f64> {
        self.with(|c| {
            let w = c.workers();
            let per_scale = |s: f64| if mean { 0.5 / s } else { 0.5 * w as f64 / s };
            match c.config().quantization {
                Quantization::Fixed(s) => per_scale(s),
                Quantization::Adaptive => per_scale(adaptive_scale(max_abs, w)),
                Quantization::FixedOrAdaptive(s) => {
                    per_scale(s).max(per_scale(adaptive_scale(max_abs, w)))
                }
            }
        })
    }

    /// Stops the communicator's thread and closes its socket (also when it
    /// is garbage-collected); later calls raise CommClosedError.
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| {
            let mut guard = self.inner.write().unwrap_or_else(|p| p.into_inner());
            guard.take();
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the communicator at the end of a `with` block.
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        self.with_comm(|comm| {
            let c = comm.first();
            let me = match c.rank() {
                Some(r) => format!("rank={r}"),
                None => "aggregator".into(),
            };
            let jobs = comm.jobs();
            let job = match &jobs[..] {
                [one] => format!("job={one}"),
                all => format!("jobs={all:?}"),
            };
            format!(
                "<aggbox.Communicator {job} {me} workers={} backend={:?} mtu={}>",
                c.workers(),
                c.config().backend,
                c.config().mtu
            )
        })
        .unwrap_or_else(|_| "<aggbox.Communicator closed>".into())
    }
}

/// The options every constructor takes, checked.
#[derive(Clone, Copy)]
struct Tuning {
    deadline: Duration,
    quantization: Quantization,
    mtu: usize,
}

impl Tuning {
    /// The package's default quantization is adaptive (docs/PYTHON.md):
    /// gradients and other Python data have no known range.
    fn new(
        deadline_s: f64,
        quantization: Option<&Bound<'_, PyAny>>,
        mtu: usize,
    ) -> PyResult<Tuning> {
        Ok(Tuning {
            deadline: deadline(deadline_s)?,
            quantization: match quantization {
                Some(q) => parse_quantization(q)?,
                None => Quantization::Adaptive,
            },
            mtu,
        })
    }

    fn apply(self, b: CommunicatorBuilder) -> CommunicatorBuilder {
        b.deadline(self.deadline)
            .quantization(self.quantization)
            .mtu(self.mtu)
    }
}

/// A worker's data port when the configuration does not say it in so many
/// words: the port of its address in the job's `result_group` (where the
/// node sends it the results).
fn group_data_port(config: &Config, job: u16, rank: Option<u16>) -> PyResult<u16> {
    let need = || {
        ConfigError::new_err(format!(
            "job {job}: pass data_port= (the configuration has no result_group member for this participant)"
        ))
    };
    let j = config
        .job(job)
        .ok_or_else(|| ConfigError::new_err(format!("no job {job} in the configuration")))?;
    let addr = rank
        .and_then(|r| j.workers.get(r as usize))
        .ok_or_else(need)?;
    let group = j
        .result_group
        .and_then(|g| config.group(g))
        .ok_or_else(need)?;
    group
        .members
        .iter()
        .find(|m| m.ip() == *addr)
        .map(|m| m.port())
        .ok_or_else(need)
}

fn parse_route(what: &str, name: &str) -> PyResult<Route> {
    match name {
        "aggbox" => Ok(Route::AggBox),
        "baseline" => Ok(Route::Baseline),
        other => Err(PyValueError::new_err(format!(
            "{what}: route '{other}': \"aggbox\" or \"baseline\""
        ))),
    }
}

fn policy_name(policy: Policy) -> &'static str {
    match policy {
        Policy::Measure => "measure",
        Policy::AggBox => "aggbox",
        Policy::Baseline => "baseline",
    }
}

/// A time in seconds as microseconds (the tuner's unit): finite, >= 0.
fn micros(what: &str, seconds: f64) -> PyResult<f64> {
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(seconds * 1e6)
    } else {
        Err(PyValueError::new_err(format!(
            "{what}: {seconds} s: a finite, non-negative number of seconds"
        )))
    }
}

/// AggBox or the front end's baseline, per kind and size class, by
/// measurement: `aggbox::runtime::tuner::Tuner` (docs/PYTHON.md, "AggBox
/// or the process group"). `aggbox.torch.AllreduceState` uses one; any
/// front end with a baseline of the same call can.
///
/// Tuner(policy="measure", trials=3): `policy` "measure" (per class, the
/// route the ranks measured faster), "aggbox" or "baseline" (every call
/// that way, no trials); `trials` timed trials per route and class after
/// one warm-up each (at least 1).
///
/// A class is a `kind` the caller numbers (a call and its dtype) and the
/// power of two at or below the call's size in bytes. Its first
/// 2·(trials+1) calls are trials alternating "aggbox" and "baseline"
/// (`pick` says so); the caller times each and passes the time to
/// `record`, which after the last one returns this rank's fastest time of
/// each route; the caller reduces those with MAX over the ranks (through
/// the baseline) and passes the result to `settle`. Every rank must make
/// the same calls in the same order, so all are at the same trial of the
/// same class at once and settle alike.
#[pyclass(module = "aggbox._aggbox", name = "Tuner")]
struct PyTuner {
    inner: Tuner,
    trials: u32,
}

#[pymethods]
impl PyTuner {
    /// See the class's docs.
    #[new]
    #[pyo3(signature = (policy = "measure", trials = DEFAULT_TRIALS))]
    fn new(policy: &str, trials: u32) -> PyResult<PyTuner> {
        let p = Policy::parse(policy).ok_or_else(|| {
            PyValueError::new_err(format!(
                "policy '{policy}': \"measure\", \"aggbox\" or \"baseline\""
            ))
        })?;
        if trials == 0 {
            return Err(PyValueError::new_err(
                "trials 0: each route needs at least one trial",
            ));
        }
        Ok(PyTuner {
            inner: Tuner::new(p, trials),
            trials,
        })
    }

    /// "measure", "aggbox" or "baseline".
    #[getter]
    fn policy(&self) -> &'static str {
        policy_name(self.inner.policy())
    }

    /// Timed trials per route and class (after one warm-up each).
    #[getter]
    fn trials(&self) -> u32 {
        self.trials
    }

    /// The route of a call of kind `kind` and `nbytes` bytes: ("aggbox" or
    /// "baseline", trial). A trial must be timed and passed to `record`.
    fn pick(&mut self, kind: u32, nbytes: usize) -> (&'static str, bool) {
        match self.inner.pick(kind, nbytes) {
            Pick::Trial(r) => (r.name(), true),
            Pick::Settled(r) => (r.name(), false),
        }
    }

    /// A trial of `route` took `seconds`. After the class's last trial:
    /// (fastest "aggbox" trial, fastest "baseline" trial) of this rank in
    /// seconds, to be reduced with MAX over the ranks and passed to
    /// `settle`; None before it (and for a call that was no trial).
    fn record(
        &mut self,
        kind: u32,
        nbytes: usize,
        route: &str,
        seconds: f64,
    ) -> PyResult<Option<(f64, f64)>> {
        let route = parse_route("record", route)?;
        let took = Duration::from_secs_f64(micros("record", seconds)? / 1e6);
        Ok(self
            .inner
            .record(kind, nbytes, route, took)
            .map(|s| (s.times_us[0] / 1e6, s.times_us[1] / 1e6)))
    }

    /// Settles the class with the ranks' agreed (MAX) times `agreed` =
    /// (aggbox seconds, baseline seconds): "aggbox" if its time is strictly
    /// below the baseline's, else "baseline". Returns the route.
    fn settle(&mut self, kind: u32, nbytes: usize, agreed: (f64, f64)) -> PyResult<&'static str> {
        let us = [micros("settle", agreed.0)?, micros("settle", agreed.1)?];
        Ok(self.inner.settle(kind, nbytes, us).name())
    }

    /// The settled classes by kind and size: dicts with `kind`,
    /// `log2_bytes` (calls of [2^log2_bytes, 2^(log2_bytes+1)) bytes),
    /// `size` ("64 KiB": the class's lower bound), `route`, and the agreed
    /// `aggbox_s` and `baseline_s`.
    fn choices<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .choices()
            .into_iter()
            .map(|c| {
                let d = PyDict::new(py);
                d.set_item("kind", c.kind)?;
                d.set_item("log2_bytes", c.log2_bytes)?;
                d.set_item("size", tuner::class_name(c.log2_bytes))?;
                d.set_item("route", c.route.name())?;
                d.set_item("aggbox_s", c.times_us[0] / 1e6)?;
                d.set_item("baseline_s", c.times_us[1] / 1e6)?;
                Ok(d)
            })
            .collect()
    }

    /// The size class of a call of `nbytes` bytes: the power of two at or
    /// below it (0 counts as 1).
    #[staticmethod]
    fn size_class(nbytes: usize) -> u32 {
        Tuner::log2_class(nbytes)
    }

    fn __repr__(&self) -> String {
        format!(
            "<aggbox.Tuner policy={} trials={} settled={}>",
            self.policy(),
            self.trials,
            self.inner.choices().len()
        )
    }
}

/// The adaptive quantization scale the runtime picks for `workers` ranks
/// whose inputs' largest |x| is `max_abs` (a power of two).
#[pyfunction]
fn adaptive_quantization_scale(max_abs: f32, workers: u16) -> f64 {
    adaptive_scale(max_abs, workers)
}

#[pymodule]
fn _aggbox(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyCommunicator>()?;
    m.add_class::<PyTuner>()?;
    m.add_function(wrap_pyfunction!(adaptive_quantization_scale, m)?)?;
    m.add("AggBoxError", py.get_type::<AggBoxError>())?;
    m.add("CommTimeoutError", py.get_type::<CommTimeoutError>())?;
    m.add(
        "QuantizationOverflowError",
        py.get_type::<QuantizationOverflowError>(),
    )?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CommClosedError", py.get_type::<CommClosedError>())?;
    m.add("OPS", Op::NAMES.to_vec())?;
    m.add("DEFAULT_FIXED_SCALE", DEFAULT_SCALE)?;
    m.add("DEFAULT_TUNER_TRIALS", DEFAULT_TRIALS)?;
    Ok(())
}
