//! The Rust half of `libaggbox_mpi_*.so` (docs/MPI.md): a C ABI over one
//! [`aggbox::runtime::Communicator`] per MPI process.
//!
//! The C shim (`mpi/aggbox_mpi.c`) intercepts the MPI calls through the PMPI
//! profiling interface and decides which ones AggBox serves (it alone can
//! read the implementation's handles); this crate reads the configuration
//! (environment variables and the node TOML), builds the communicator at
//! `MPI_Init`, runs the calls, and counts what was served and what passed
//! through. Every call returns an `AGGBOX_MPI_*` status code; a failure also
//! prints its reason to stderr, prefixed `aggbox-mpi: rank R:`.

use std::ffi::c_int;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use aggbox::config::Config;
use aggbox::runtime::{
    BackendKind, Communicator, CommunicatorBuilder, NodePosition, Participant, Quantization,
};
use aggbox::wire::abi::{Op, Round};

/// The call completed; the buffer holds the result.
pub const AGGBOX_MPI_OK: c_int = 0;
/// The integer result left int32 and the runtime clamped it (OVERFLOW),
/// where MPI wraps: the caller reruns the call with PMPI from its original
/// input. Every rank gets the same RESULT flags, so every rank falls back.
pub const AGGBOX_MPI_OVERFLOW: c_int = 1;
/// The call failed (message printed); MPI's default error handler on
/// MPI_COMM_WORLD is fatal, so the shim aborts the job.
pub const AGGBOX_MPI_ERROR: c_int = -1;

/// Environment variables (docs/MPI.md has the table).
const ENV_CONFIG: &str = "AGGBOX_MPI_CONFIG";
const ENV_JOB: &str = "AGGBOX_MPI_JOB";
const ENV_NODE: &str = "AGGBOX_MPI_NODE";
const ENV_DATA_PORT: &str = "AGGBOX_MPI_DATA_PORT";
const ENV_MIN_BYTES: &str = "AGGBOX_MPI_MIN_BYTES";
const ENV_FLOAT: &str = "AGGBOX_MPI_FLOAT";
const ENV_DEADLINE_MS: &str = "AGGBOX_MPI_DEADLINE_MS";
const ENV_STATS: &str = "AGGBOX_MPI_STATS";

/// Which intercepted call a counter is for: the shim passes the index
/// (`CALL_ALLREDUCE` 0, `CALL_REDUCE` 1, `CALL_BCAST` 2 in aggbox_mpi.c).
const CALLS: [&str; 3] = ["MPI_Allreduce", "MPI_Reduce", "MPI_Bcast"];
const CALL_BCAST: usize = 2;

/// The counter index of the shim's `call` (an unknown one counts as
/// MPI_Allreduce rather than being lost).
fn call_index(call: c_int) -> usize {
    usize::try_from(call)
        .ok()
        .filter(|&c| c < CALLS.len())
        .unwrap_or(0)
}

/// What `MPI_Init` set up; `None` before it and after `MPI_Finalize`.
struct Session {
    comm: Communicator,
    rank: c_int,
    min_bytes: usize,
    float: bool,
    stats: bool,
}

static SESSION: Mutex<Option<Session>> = Mutex::new(None);
/// Calls AggBox served, calls passed to PMPI unchanged, and calls whose
/// integer result overflowed and were rerun with PMPI; per entry of CALLS.
static SERVED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static PASSED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static OVERFLOWED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn env_parsed<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String> {
    env(name)
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| format!("{name}={v:?} is not a valid value"))
        })
        .transpose()
}

/// What `aggbox_mpi_position` prepared for `aggbox_mpi_start`: the
/// communicator's builder, before the ranks agreed on where to start.
struct Pending {
    builder: CommunicatorBuilder,
    job: u16,
    rank: c_int,
    size: c_int,
    node: Ipv4Addr,
    data_port: u16,
    min_bytes: usize,
    float: bool,
}

static PENDING: Mutex<Option<Pending>> = Mutex::new(None);

/// Reads the configuration of MPI_COMM_WORLD rank `rank` of `size` and
/// asks the node where this run starts.
fn prepare(rank: c_int, size: c_int) -> Result<(Pending, NodePosition), String> {
    let path = env(ENV_CONFIG).ok_or_else(|| {
        format!("{ENV_CONFIG} is not set: it names the node configuration (TOML) whose job serves MPI_COMM_WORLD")
    })?;
    let config = Config::load(Path::new(&path)).map_err(|e| format!("{ENV_CONFIG}={path}: {e}"))?;
    let job = match env_parsed::<u16>(ENV_JOB)? {
        Some(id) => config
            .job(id)
            .ok_or_else(|| format!("{ENV_JOB}={id}: no such job in {path}"))?,
        None => match config.jobs.as_slice() {
            [only] => only,
            jobs => {
                return Err(format!(
                    "{path} has {} jobs: set {ENV_JOB} to the one that serves MPI_COMM_WORLD",
                    jobs.len()
                ))
            }
        },
    };
    if job.workers.len() != size as usize {
        return Err(format!(
            "MPI_COMM_WORLD has {size} ranks but job {} of {path} has {} workers: MPI rank r is worker r, so the two must match",
            job.id,
            job.workers.len()
        ));
    }
    if job.weights.iter().any(|&w| w != 1) {
        // SUM is Σ w·v on the node; MPI's is Σ v.
        return Err(format!(
            "job {} of {path} has weights other than 1; MPI_SUM would not be MPI's sum",
            job.id
        ));
    }
    let node: Ipv4Addr = env_parsed(ENV_NODE)?
        .ok_or_else(|| format!("{ENV_NODE} is not set: the IPv4 address of the node that runs `aggbox attach` for job {}", job.id))?;
    // Each worker's data socket: the variable, or this worker's member of
    // the job's result group (the RESULTs go there, so it is the socket).
    let me = job.workers[rank as usize];
    let group_port = job
        .result_group
        .and_then(|g| config.group(g))
        .and_then(|g| g.members.iter().find(|m| *m.ip() == me))
        .map(|m| m.port());
    let data_port: u16 = env_parsed(ENV_DATA_PORT)?.or(group_port).ok_or_else(|| {
        format!("{ENV_DATA_PORT} is not set and job {}'s result group has no member at {me}: set it to the UDP port of each worker's data socket", job.id)
    })?;
    let min_bytes = env_parsed::<usize>(ENV_MIN_BYTES)?.unwrap_or(0);
    let float = match env(ENV_FLOAT).as_deref() {
        None | Some("off") => false,
        Some("quantized") => true,
        Some(v) => return Err(format!("{ENV_FLOAT}={v:?}: expected \"quantized\" (serve MPI_FLOAT MPI_SUM, not bit-exact) or \"off\"")),
    };
    let mut builder = CommunicatorBuilder::from_config(
        &config,
        job.id,
        node,
        data_port,
        Participant::Worker(rank as u16),
    )
    .map_err(|e| e.to_string())?
    .backend(BackendKind::Kernel)
    .quantization(Quantization::Adaptive);
    if let Some(ms) = env_parsed::<u64>(ENV_DEADLINE_MS)? {
        builder = builder.deadline(Duration::from_millis(ms));
    }
    // Where this run starts: after every round an earlier run on the same
    // running node used (docs/MPI.md, "Consecutive runs on one node").
    let position = builder
        .node_position(builder.config().deadline)
        .map_err(|e| e.to_string())?;
    let pending = Pending {
        builder,
        job: job.id,
        rank,
        size,
        node,
        data_port,
        min_bytes,
        float,
    };
    Ok((pending, position))
}

/// Builds the session prepared by [`prepare`], its first call at `round`,
/// `agg_seq` (agreed by every rank).
fn open(p: Pending, round: u32, agg_seq: u32) -> Result<Session, String> {
    let Pending {
        builder,
        job,
        rank,
        size,
        node,
        data_port,
        min_bytes,
        float,
    } = p;
    let me = builder.config().peers[rank as usize];
    let comm = builder
        .resume(Round(round), agg_seq)
        .build()
        .map_err(|e| format!("job {job} worker {rank} at {}:{data_port}: {e}", me.ip()))?;
    // A first allreduce at MPI_Init, so that a node that does not serve the
    // job (another configuration, a data path that does not reach it)
    // fails here with the reason, not in the middle of the program.
    let mut ranks = [1i32];
    match comm.allreduce_i32(&mut ranks, Op::Sum) {
        Ok(_) if ranks[0] == size => {}
        Ok(_) => return Err(format!("job {job}'s first allreduce counted {} ranks, not {size}", ranks[0])),
        Err(e) => {
            return Err(format!(
                "job {job}'s first allreduce (round {round}, seq {agg_seq}) failed ({e}): is `aggbox attach` serving the job on {node} with this configuration?"
            ))
        }
    }
    Ok(Session {
        comm,
        rank,
        min_bytes,
        float,
        stats: env(ENV_STATS).is_some_and(|v| v != "0"),
    })
}

/// Prints `aggbox-mpi: rank R: WHAT: MSG` in one write, so that mpirun,
/// which forwards every rank's stderr, never interleaves two ranks' lines
/// (`eprintln!` writes each formatted piece on its own).
fn report(rank: c_int, what: &str, msg: impl std::fmt::Display) {
    use std::io::Write;
    let line = format!("aggbox-mpi: rank {rank}: {what}: {msg}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Called first by the shim's `MPI_Init`/`MPI_Init_thread` after
/// `PMPI_Init`, with the MPI_COMM_WORLD rank and size: reads the
/// configuration and asks the node where this run starts; writes the
/// node's answer to `position` (round, contribution seq). The shim then
/// makes the ranks agree on the newest answer and calls
/// [`aggbox_mpi_start`] with it. On an error (configuration, world size ≠
/// workers, a socket, no answer from the node) it prints why and returns
/// AGGBOX_MPI_ERROR; the shim then aborts the job.
///
/// # Safety
/// `position` points to 2 writable `u32`.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_position(
    rank: c_int,
    size: c_int,
    position: *mut u32,
) -> c_int {
    match prepare(rank, size) {
        Ok((pending, at)) => {
            if !position.is_null() {
                let out = std::slice::from_raw_parts_mut(position, 2);
                out[0] = at.round.0;
                out[1] = at.agg_seq;
            }
            *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(pending);
            AGGBOX_MPI_OK
        }
        Err(e) => {
            report(rank, "MPI_Init", e);
            AGGBOX_MPI_ERROR
        }
    }
}

/// Called by the shim's `MPI_Init` after [`aggbox_mpi_position`], with the
/// position every rank agreed on (the newest of their answers): builds the
/// communicator there and makes a first allreduce. Errors as
/// [`aggbox_mpi_position`].
#[no_mangle]
pub extern "C" fn aggbox_mpi_start(round: u32, agg_seq: u32) -> c_int {
    let Some(pending) = PENDING.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        eprintln!("aggbox-mpi: MPI_Init: aggbox_mpi_start without aggbox_mpi_position (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    };
    let rank = pending.rank;
    match open(pending, round, agg_seq) {
        Ok(s) => {
            *SESSION.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
            AGGBOX_MPI_OK
        }
        Err(e) => {
            report(rank, "MPI_Init", e);
            AGGBOX_MPI_ERROR
        }
    }
}

/// Called by the shim's `MPI_Finalize` before `PMPI_Finalize`: closes the
/// communicator and, when AGGBOX_MPI_STATS is set, prints the counters.
#[no_mangle]
pub extern "C" fn aggbox_mpi_finalize() {
    let session = SESSION.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(s) = session {
        if s.stats {
            // One write, so that mpirun, which forwards every rank's stderr,
            // never splits the line.
            use std::io::Write;
            let line = format!(
                "{}; datagrams {}\n",
                stats_line(s.rank),
                datagrams_line(&s.comm)
            );
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// The communicator's datagram counters (sent and received, data and
/// ACKs) and where its calls ran: what a call costs on the wire.
fn datagrams_line(comm: &Communicator) -> String {
    let (c, io) = (comm.stats(), comm.io_stats());
    format!(
        "data_sent={} retransmitted={} acks_sent={} data_received={} acks_received={} duplicates_received={} \
         calls_on_caller={} calls_on_progress_thread={}",
        c.data_sent,
        c.retransmitted,
        c.acks_sent,
        c.data_received,
        c.acks_received,
        c.duplicates_received,
        io.calls_on_caller,
        io.calls_on_progress_thread
    )
}

fn stats_line(rank: c_int) -> String {
    let list = |counters: &[AtomicU64; 3]| {
        CALLS
            .iter()
            .zip(counters)
            .map(|(name, c)| format!("{name}={}", c.load(Ordering::Relaxed)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    format!(
        "aggbox-mpi: rank {rank}: served {}; passed through {}; overflowed (rerun with PMPI) {}",
        list(&SERVED),
        list(&PASSED),
        list(&OVERFLOWED)
    )
}

/// The shim counts a call it passed to PMPI unchanged (`call`: 0 allreduce,
/// 1 reduce, 2 bcast).
#[no_mangle]
pub extern "C" fn aggbox_mpi_count_passed(call: c_int) {
    PASSED[call_index(call)].fetch_add(1, Ordering::Relaxed);
}

/// Whether a call of `bytes` bytes is served: a session is open and the size
/// reaches AGGBOX_MPI_MIN_BYTES. Every rank passes the same count and
/// datatype to a collective, so every rank decides the same.
#[no_mangle]
pub extern "C" fn aggbox_mpi_serves(bytes: usize) -> c_int {
    with_session(|s| (bytes >= s.min_bytes) as c_int).unwrap_or(0)
}

/// Whether MPI_FLOAT MPI_SUM is served (AGGBOX_MPI_FLOAT=quantized).
#[no_mangle]
pub extern "C" fn aggbox_mpi_serves_float() -> c_int {
    with_session(|s| s.float as c_int).unwrap_or(0)
}

fn with_session<T>(f: impl FnOnce(&Session) -> T) -> Option<T> {
    SESSION
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map(f)
}

/// Runs `f` on the open session; counts it as served under `call` when it
/// returns AGGBOX_MPI_OK, as overflowed under AGGBOX_MPI_OVERFLOW.
fn served(call: usize, what: &str, f: impl FnOnce(&Session) -> Result<bool, String>) -> c_int {
    let status = with_session(|s| match f(s) {
        Ok(false) => AGGBOX_MPI_OK,
        Ok(true) => AGGBOX_MPI_OVERFLOW,
        Err(e) => {
            report(s.rank, what, e);
            AGGBOX_MPI_ERROR
        }
    })
    .unwrap_or_else(|| {
        eprintln!("aggbox-mpi: {what} before MPI_Init or after MPI_Finalize");
        AGGBOX_MPI_ERROR
    });
    match status {
        AGGBOX_MPI_OK => SERVED[call].fetch_add(1, Ordering::Relaxed),
        AGGBOX_MPI_OVERFLOW => OVERFLOWED[call].fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
    status
}

/// In-place int32 allreduce of `buf[..len]` with the AggBox op `op`
/// (`aggbox::wire::abi::Op` numbering: SUM 0, MAX 2, MIN 3, PROD 5, BAND
/// 6, BOR 7, BXOR 8). `call` is what the shim counts it as (0 allreduce,
/// 1 reduce: MPI_Reduce is an allreduce whose result only the root keeps,
/// since a node-served job has no consumer but the workers).
///
/// # Safety
/// `buf` points to `len` writable int32 values.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_allreduce_i32(
    buf: *mut i32,
    len: usize,
    op: c_int,
    call: c_int,
) -> c_int {
    let buf = slice_mut(buf, len);
    let call = call_index(call);
    served(call, CALLS[call], |s| {
        let op = match u8::try_from(op).ok().and_then(Op::from_u8) {
            Some(op @ (Op::Sum | Op::Max | Op::Min | Op::Prod | Op::Band | Op::Bor | Op::Bxor)) => {
                op
            }
            _ => {
                return Err(format!(
                    "op {op} is not one the shim maps (a bug in the shim)"
                ))
            }
        };
        s.comm.allreduce_i32(buf, op).map_err(|e| e.to_string())
    })
}

/// In-place float32 SUM allreduce through quantization (opt-in,
/// AGGBOX_MPI_FLOAT=quantized; the result is within the quantization bound
/// of MPI's, not bit-identical). `call` as for the int32 one.
///
/// # Safety
/// `buf` points to `len` writable float32 values.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_allreduce_f32(buf: *mut f32, len: usize, call: c_int) -> c_int {
    let buf = slice_mut(buf, len);
    let call = call_index(call);
    served(call, CALLS[call], |s| {
        s.comm
            .allreduce_f32(buf, false)
            .map(|()| false)
            .map_err(|e| e.to_string())
    })
}

/// Broadcast of `buf[..len]` bytes from MPI_COMM_WORLD rank `root` (AggBox
/// worker `root`) to the other ranks.
///
/// # Safety
/// `buf` points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_bcast(buf: *mut u8, len: usize, root: c_int) -> c_int {
    let buf = slice_mut(buf, len);
    served(CALL_BCAST, CALLS[CALL_BCAST], |s| {
        let root = u16::try_from(root).map_err(|_| format!("root {root} is not a rank"))?;
        s.comm
            .broadcast(buf, Participant::Worker(root))
            .map(|()| false)
            .map_err(|e| e.to_string())
    })
}

/// # Safety
/// `ptr` points to `len` writable values (or `len` is 0).
unsafe fn slice_mut<'a, T>(ptr: *mut T, len: usize) -> &'a mut [T] {
    if len == 0 || ptr.is_null() {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(ptr, len)
    }
}
