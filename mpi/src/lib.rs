//! The Rust half of `libaggbox_mpi_*.so` (docs/MPI.md): a C ABI over one
//! [`aggbox::runtime::Communicator`] per AggBox job of the node's file an
//! MPI process uses, or one `RunCommunicator` per communicator's run on
//! demand (its jobs at one node or striped over several: `on_demand`).
//!
//! The C shim (`mpi/aggbox_mpi.c`) intercepts the MPI calls through the PMPI
//! profiling interface and decides which ones AggBox serves (it alone can
//! read the implementation's handles); this crate reads the configuration
//! (environment variables and the node TOML), builds MPI_COMM_WORLD's
//! session at `MPI_Init` and another communicator's at its first served
//! call (the job whose workers are its processes, in its rank order, or,
//! without the TOML, a job on demand the communicator's ranks join at the
//! node's control endpoint), runs the calls, and counts what was served
//! and what passed through. The shim
//! names a session by the index these functions return. Every call returns
//! an `AGGBOX_MPI_*` status code; a failure also prints its reason to
//! stderr, prefixed `aggbox-mpi: rank R:` (R: the MPI_COMM_WORLD rank).

use std::ffi::c_int;
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use aggbox::config::Config;
use aggbox::runtime::{
    Algorithm, BackendKind, CallOptions, Collective, CommError, Communicator, CommunicatorBuilder, Elements,
    NodePosition, Participant, Quantization, Served, StarOrRing,
};
use aggbox::runtime::tuner::{self, Pick, Policy, Route, Tuner};
use aggbox::wire::abi::{Op, Round};

mod on_demand;
mod ring;
use on_demand::{join, Joined, OnDemand};

/// The call completed; the buffer holds the result.
pub const AGGBOX_MPI_OK: c_int = 0;
/// The integer result left int32 and the runtime clamped it (OVERFLOW),
/// where MPI wraps: the caller reruns the call with PMPI from its original
/// input. Every rank gets the same RESULT flags, so every rank falls back.
pub const AGGBOX_MPI_OVERFLOW: c_int = 1;
/// The call failed (message printed); MPI's default error handler on
/// MPI_COMM_WORLD is fatal, so the shim aborts the job.
pub const AGGBOX_MPI_ERROR: c_int = -1;
/// [`aggbox_mpi_comm_job`]: no job of the configuration serves the
/// communicator; its calls pass through.
pub const AGGBOX_MPI_NOT_SERVED: c_int = -2;
/// [`aggbox_mpi_comm_job`]: a job serves the communicator and its session
/// is to be opened: the ranks agree on the position and call
/// [`aggbox_mpi_comm_start`].
pub const AGGBOX_MPI_PENDING: c_int = -3;
/// Jobs on demand ([`aggbox_mpi_join`], [`aggbox_mpi_comm_job`]): this
/// rank joined the communicator's job (`JOINED`) or could not
/// (`JOIN_FAILED`, reason kept); the ranks agree with an MPI_MIN of
/// "joined" over the communicator and call [`aggbox_mpi_comm_joined`].
pub const AGGBOX_MPI_JOINED: c_int = -4;
pub const AGGBOX_MPI_JOIN_FAILED: c_int = -5;
/// The size of the shim's buffer for a run key ([`on_demand::aggbox_mpi_run_key`]).
pub const AGGBOX_MPI_RUN_KEY_BYTES: usize = 128;

/// Environment variables (docs/MPI.md has the table).
const ENV_CONFIG: &str = "AGGBOX_MPI_CONFIG";
const ENV_JOB: &str = "AGGBOX_MPI_JOB";
const ENV_NODE: &str = "AGGBOX_MPI_NODE";
const ENV_DATA_PORT: &str = "AGGBOX_MPI_DATA_PORT";
const ENV_MIN_BYTES: &str = "AGGBOX_MPI_MIN_BYTES";
const ENV_FLOAT: &str = "AGGBOX_MPI_FLOAT";
const ENV_DEADLINE_MS: &str = "AGGBOX_MPI_DEADLINE_MS";
const ENV_STATS: &str = "AGGBOX_MPI_STATS";
const ENV_ROUTE: &str = "AGGBOX_MPI_ROUTE";
const ENV_TRIALS: &str = "AGGBOX_MPI_TRIALS";
/// [`aggbox_mpi_route`]'s answer: bit 0 set = PMPI (the baseline), clear =
/// AggBox; bit 1 set = a trial the shim times and reports with
/// [`aggbox_mpi_trial`].
pub const AGGBOX_MPI_ROUTE_PMPI: c_int = 1;
pub const AGGBOX_MPI_ROUTE_TRIAL: c_int = 2;

/// How long a rank's call polls for its result before it sleeps
/// ([`aggbox::runtime::CommConfig::caller_spin`]): MPI ranks busy-wait for
/// their messages, and a one-datagram allreduce's result comes within tens
/// of microseconds, so it then costs no wake-up (docs/MPI.md "Benchmark").
/// The runtime's `AGGBOX_CALLER_SPIN_US` overrides it (0: sleep at once).
const CALLER_SPIN: Duration = Duration::from_micros(200);

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

/// What `MPI_Init` read, for every communicator of the run.
struct Settings {
    world_rank: c_int,
    /// Where the jobs come from: the node's file, or the node's control
    /// endpoint (jobs on demand).
    source: Source,
    deadline: Option<Duration>,
    min_bytes: usize,
    float: bool,
    stats: bool,
    /// AGGBOX_MPI_ROUTE and AGGBOX_MPI_TRIALS: how each session's tuner
    /// routes served calls (docs/MPI.md, "AggBox or PMPI").
    route: Policy,
    trials: u32,
}

/// How a communicator gets its job (docs/MPI.md, "Jobs from a file" and
/// "Jobs on demand").
enum Source {
    /// AGGBOX_MPI_CONFIG: `[[job]]`s of the node's file.
    File(FileJobs),
    /// AGGBOX_MPI_NODE=IP[:PORT] without AGGBOX_MPI_CONFIG: every
    /// communicator's ranks join a run at the node's control endpoint.
    OnDemand(OnDemand),
}

/// The jobs of the node's file (AGGBOX_MPI_CONFIG).
struct FileJobs {
    /// The configuration file and what it holds.
    path: String,
    config: Config,
    /// The job of MPI_COMM_WORLD and its workers: world rank r's address is
    /// `world_workers[r]`, which is how another communicator's processes
    /// are matched to a job's workers.
    world_job: u16,
    world_workers: Vec<IpAddr>,
    node: IpAddr,
    /// AGGBOX_MPI_DATA_PORT: MPI_COMM_WORLD's data port (other jobs take
    /// theirs from their result groups: one socket per job).
    data_port: Option<u16>,
    /// AGGBOX_MPI_RING: a ring beside MPI_COMM_WORLD's star.
    ring: Option<ring::RingChoice>,
}

/// One AggBox job's communicator; every MPI communicator whose processes
/// are the job's workers in the same order uses it (MPI_COMM_WORLD and its
/// duplicates share the first).
struct Session {
    /// The job (on demand: the first node's), which names the session.
    job: u16,
    link: Link,
    /// AggBox or PMPI per kind and size of call, measured on this
    /// communicator (a kind is `call * 2 + is_float`).
    tuner: Tuner,
    /// Calls the ring served (AGGBOX_MPI_RING), for the stats line.
    ring_calls: AtomicU64,
}

/// What serves a session's calls.
enum Link {
    /// A job of the node's file: its communicator.
    File(Box<Communicator>),
    /// MPI_COMM_WORLD's job of the node's file beside a ring
    /// (AGGBOX_MPI_RING): each call goes to the star or the ring.
    Chosen(Box<StarOrRing<Communicator>>),
    /// A job on demand: its `RunCommunicator`, which fails every call with
    /// `JobLost` once the node no longer serves the job, and this rank's
    /// part of the run, ended after the communicator closed.
    OnDemand(Joined),
}

impl Session {
    /// The communicator that runs the calls.
    fn collective(&self) -> &dyn Collective {
        match &self.link {
            Link::File(comm) => comm.as_ref(),
            Link::Chosen(chosen) => chosen.as_ref(),
            Link::OnDemand(joined) => joined.comm.collective(),
        }
    }

    /// Counts a call the ring served; passes `served` on.
    fn count(&self, served: Served) -> Served {
        if served.algorithm == Algorithm::Ring {
            self.ring_calls.fetch_add(1, Ordering::Relaxed);
        }
        served
    }

    /// The communicator of each stripe's job, for their counters: one but
    /// on demand over several nodes.
    fn stripes(&self) -> &[Communicator] {
        match &self.link {
            Link::File(comm) => std::slice::from_ref(comm.as_ref()),
            Link::Chosen(chosen) => chosen.star().map_or(&[], std::slice::from_ref),
            Link::OnDemand(joined) => joined.comm.run_comm().striped().stripes(),
        }
    }

    /// `job J`, or `jobs J1, J2` for one striped over several nodes.
    fn name(&self) -> String {
        let ids: Vec<u16> = self.stripes().iter().map(|c| c.config().job).collect();
        jobs_name(&ids)
    }

    /// The job on demand, if the session is one.
    fn joined(&self) -> Option<&Joined> {
        match &self.link {
            Link::File(_) | Link::Chosen(_) => None,
            Link::OnDemand(joined) => Some(joined),
        }
    }
}

/// Everything between `MPI_Init` and `MPI_Finalize`. A served call holds
/// the lock for its duration: calls are serialised (MPI requires the same
/// order of collectives on every rank anyway).
struct Shim {
    settings: Settings,
    /// Indexed by the session numbers handed to the shim; the first is
    /// MPI_COMM_WORLD's.
    sessions: Vec<Session>,
    /// The session being opened ([`aggbox_mpi_comm_job`] → the ranks agree
    /// → [`aggbox_mpi_comm_start`]).
    pending: Option<Pending>,
    /// Jobs on demand: this rank's join of a communicator's job, or why it
    /// failed, until the ranks agreed ([`aggbox_mpi_comm_joined`]).
    joining: Option<(Vec<c_int>, Result<Session, String>)>,
    /// Jobs on demand: the communicators (their processes, as `members`)
    /// that fell back to PMPI, and why (in the stats line).
    fell_back: Vec<(Vec<c_int>, String)>,
}

static SHIM: Mutex<Option<Shim>> = Mutex::new(None);

fn shim() -> std::sync::MutexGuard<'static, Option<Shim>> {
    SHIM.lock().unwrap_or_else(|e| e.into_inner())
}
/// Calls AggBox served, calls passed to PMPI unchanged, and calls whose
/// integer result overflowed and were rerun with PMPI; per entry of CALLS.
static SERVED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static PASSED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static OVERFLOWED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
/// Calls AggBox could serve that the tuner sent to PMPI (trials and
/// settled choices).
static STEPPED_ASIDE: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

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

/// A session being opened: its communicator's builder, before the ranks
/// agreed on where to start.
struct Pending {
    builder: CommunicatorBuilder,
    job: u16,
    /// This process's rank in the communicator (its worker index in the
    /// job) and the communicator's size.
    rank: c_int,
    size: c_int,
    data_port: u16,
}

/// Reads what `MPI_Init` needs of the node's file: the configuration,
/// MPI_COMM_WORLD's job (which must have `size` workers) and the
/// variables.
fn read_settings(rank: c_int, size: c_int) -> Result<Settings, String> {
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
    let node: IpAddr = env_parsed(ENV_NODE)?
        .ok_or_else(|| format!("{ENV_NODE} is not set: the IP address of the node that runs `aggbox attach` for job {}", job.id))?;
    let ring = ring::read(rank, &config, &path, &job.workers)?;
    let file = FileJobs {
        ring,
        world_job: job.id,
        world_workers: job.workers.clone(),
        node,
        data_port: env_parsed(ENV_DATA_PORT)?,
        path,
        config,
    };
    read_common(rank, Source::File(file))
}

/// The variables every source reads.
fn read_common(rank: c_int, source: Source) -> Result<Settings, String> {
    let float = match env(ENV_FLOAT).as_deref() {
        None | Some("off") => false,
        Some("quantized") => true,
        Some(v) => return Err(format!("{ENV_FLOAT}={v:?}: expected \"quantized\" (serve MPI_FLOAT MPI_SUM, not bit-exact) or \"off\"")),
    };
    let route = match env(ENV_ROUTE).as_deref() {
        None => Policy::Measure,
        Some("pmpi") => Policy::Baseline,
        Some(v @ ("measure" | "aggbox")) => Policy::parse(v).expect("listed"),
        Some(v) => return Err(format!("{ENV_ROUTE}={v:?}: expected \"measure\" (default: AggBox or PMPI per size, whichever the ranks measured faster), \"aggbox\" or \"pmpi\"")),
    };
    let trials = match env_parsed::<u32>(ENV_TRIALS)? {
        Some(0) => return Err(format!("{ENV_TRIALS}=0: each route needs at least one trial")),
        t => t.unwrap_or(tuner::DEFAULT_TRIALS),
    };
    Ok(Settings {
        world_rank: rank,
        source,
        deadline: env_parsed::<u64>(ENV_DEADLINE_MS)?.map(Duration::from_millis),
        min_bytes: env_parsed::<usize>(ENV_MIN_BYTES)?.unwrap_or(0),
        float,
        stats: env(ENV_STATS).is_some_and(|v| v != "0"),
        route,
        trials,
    })
}

/// Prepares the session of job `job` for the process that is worker `rank`
/// of `size` and asks the node where it starts.
fn prepare(settings: &Settings, file: &FileJobs, job: u16, rank: c_int, size: c_int) -> Result<(Pending, NodePosition), String> {
    let path = &file.path;
    let job = file
        .config
        .job(job)
        .ok_or_else(|| format!("no job {job} in {path}"))?;
    if job.workers.len() != size as usize {
        return Err(format!(
            "job {} of {path} has {} workers for a communicator of {size} ranks",
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
    // Each worker's data socket: this worker's member of the job's result
    // group (the RESULTs go there, so it is the socket); for MPI_COMM_WORLD's
    // job AGGBOX_MPI_DATA_PORT first. A process has a socket per job, so
    // the other jobs' ports must come from their groups.
    let me = job.workers[rank as usize];
    let group_port = job
        .result_group
        .and_then(|g| file.config.group(g))
        .and_then(|g| g.members.iter().find(|m| m.ip() == me))
        .map(|m| m.port());
    let data_port = if job.id == file.world_job {
        file.data_port.or(group_port).ok_or_else(|| {
            format!("{ENV_DATA_PORT} is not set and job {}'s result group has no member at {me}: set it to the UDP port of each worker's data socket", job.id)
        })?
    } else {
        group_port.ok_or_else(|| {
            format!("job {} of {path} serves a communicator of this process, but its result group has no member at {me}: each job a process uses needs its own data port there", job.id)
        })?
    };
    let mut builder = CommunicatorBuilder::from_config(
        &file.config,
        job.id,
        file.node,
        data_port,
        Participant::Worker(rank as u16),
    )
    .map_err(|e| e.to_string())?
    .backend(BackendKind::Kernel)
    .quantization(Quantization::Adaptive)
    .caller_spin(CALLER_SPIN);
    if let Some(d) = settings.deadline {
        builder = builder.deadline(d);
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
        data_port,
    };
    Ok((pending, position))
}

/// Builds the session prepared by [`prepare`], its first call at `round`,
/// `agg_seq` (agreed by every rank of the communicator).
fn open(p: Pending, node: IpAddr, tuner: Tuner, round: u32, agg_seq: u32, ring: Option<(&ring::RingChoice, &Config)>) -> Result<Session, String> {
    let Pending {
        builder,
        job,
        rank,
        size,
        data_port,
    } = p;
    let me = builder.config().peers[rank as usize];
    let comm = builder
        .resume(Round(round), agg_seq)
        .build()
        .map_err(|e| format!("job {job} worker {rank} at {}:{data_port}: {e}", me.ip()))?;
    // A first allreduce, so that a node that does not serve the job
    // (another configuration, a data path that does not reach it) fails
    // here with the reason, not in the middle of the program.
    let mut ranks = [1i32];
    match comm.allreduce(&mut ranks, Op::Sum) {
        Ok(_) if ranks[0] == size => {}
        Ok(_) => return Err(format!("job {job}'s first allreduce counted {} ranks, not {size}", ranks[0])),
        Err(e) => {
            return Err(format!(
                "job {job}'s first allreduce (round {round}, seq {agg_seq}) failed ({e}): is `aggbox attach` serving the job on {node} with this configuration?"
            ))
        }
    }
    let link = match ring {
        Some((choice, config)) => Link::Chosen(Box::new(ring::beside(comm, choice, config)?)),
        None => Link::File(Box::new(comm)),
    };
    Ok(Session { job, link, tuner, ring_calls: AtomicU64::new(0) })
}

/// Prints `aggbox-mpi: rank R: WHAT: MSG` in one write, so that mpirun,
/// which forwards every rank's stderr, never interleaves two ranks' lines
/// (`eprintln!` writes each formatted piece on its own).
fn report(rank: c_int, what: &str, msg: impl std::fmt::Display) {
    use std::io::Write;
    let line = format!("aggbox-mpi: rank {rank}: {what}: {msg}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Writes `at` to the shim's `position` (2 × u32: round, contribution seq).
///
/// # Safety
/// `position` is null or points to 2 writable `u32`.
unsafe fn write_position(position: *mut u32, at: &NodePosition) {
    if !position.is_null() {
        let out = std::slice::from_raw_parts_mut(position, 2);
        out[0] = at.round.0;
        out[1] = at.agg_seq;
    }
}

/// Opens the pending session at the agreed position; its index, or
/// AGGBOX_MPI_ERROR (reported as `what`).
fn start_pending(what: &str, round: u32, agg_seq: u32) -> c_int {
    let mut guard = shim();
    let Some(shim) = guard.as_mut() else {
        eprintln!("aggbox-mpi: {what}: no session is being opened (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    };
    let Some(pending) = shim.pending.take() else {
        report(shim.settings.world_rank, what, "no session is being opened (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    };
    let tuner = Tuner::new(shim.settings.route, shim.settings.trials);
    let (node, ring) = match &shim.settings.source {
        // The ring's members are MPI_COMM_WORLD's ranks: only its job (and
        // its duplicates, which share its session) gets the ring.
        Source::File(file) => (file.node, file.ring.as_ref().filter(|_| pending.job == file.world_job).map(|c| (c, &file.config))),
        Source::OnDemand(_) => {
            report(shim.settings.world_rank, what, "a position for a job on demand (a bug in the shim)");
            return AGGBOX_MPI_ERROR;
        }
    };
    match open(pending, node, tuner, round, agg_seq, ring) {
        Ok(session) => {
            shim.sessions.push(session);
            (shim.sessions.len() - 1) as c_int
        }
        Err(e) => {
            report(shim.settings.world_rank, what, e);
            AGGBOX_MPI_ERROR
        }
    }
}

/// Called first by the shim's `MPI_Init`/`MPI_Init_thread` after
/// `PMPI_Init`, with the MPI_COMM_WORLD rank and size: reads the
/// configuration and asks the node where MPI_COMM_WORLD's job starts;
/// writes the node's answer to `position` (round, contribution seq). The
/// shim then makes the ranks agree on the newest answer and calls
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
    let prepared = read_settings(rank, size).and_then(|settings| {
        let Source::File(file) = &settings.source else { unreachable!("read_settings reads the file") };
        let (pending, at) = prepare(&settings, file, file.world_job, rank, size)?;
        Ok((settings, pending, at))
    });
    match prepared {
        Ok((settings, pending, at)) => {
            write_position(position, &at);
            *shim() = Some(Shim {
                settings,
                sessions: Vec::new(),
                pending: Some(pending),
                joining: None,
                fell_back: Vec::new(),
            });
            AGGBOX_MPI_OK
        }
        Err(e) => {
            report(rank, "MPI_Init", e);
            AGGBOX_MPI_ERROR
        }
    }
}

/// Called by the shim's `MPI_Init` after [`aggbox_mpi_position`], with the
/// position every rank agreed on (the newest of their answers): builds
/// MPI_COMM_WORLD's session (index 0) there and makes a first allreduce.
/// Errors as [`aggbox_mpi_position`].
#[no_mangle]
pub extern "C" fn aggbox_mpi_start(round: u32, agg_seq: u32) -> c_int {
    match start_pending("MPI_Init", round, agg_seq) {
        0 => AGGBOX_MPI_OK,
        AGGBOX_MPI_ERROR => AGGBOX_MPI_ERROR,
        other => {
            eprintln!("aggbox-mpi: MPI_Init: MPI_COMM_WORLD's session is number {other}, not 0 (a bug in the shim)");
            AGGBOX_MPI_ERROR
        }
    }
}

/// Which session serves a communicator other than MPI_COMM_WORLD, asked
/// by the shim at the communicator's first call it could serve (by every
/// rank of it, in the same call): `world_ranks[..size]` are the
/// MPI_COMM_WORLD ranks of its processes in its rank order, `rank` this
/// process's rank in it. The job whose workers are those processes'
/// addresses (world rank r's address: worker r of MPI_COMM_WORLD's job),
/// in that order, serves it; MPI_COMM_WORLD's job first, else the first
/// such job of the configuration. Returns the session's index when it is
/// open (a communicator of the same processes used it before),
/// AGGBOX_MPI_NOT_SERVED when no job matches (or no session is open),
/// AGGBOX_MPI_PENDING with the node's answer in `position` when the
/// session is to be opened (the shim makes the ranks agree and calls
/// [`aggbox_mpi_comm_start`]), AGGBOX_MPI_ERROR with the reason printed.
///
/// # Safety
/// `world_ranks` points to `size` ints, `position` to 2 writable `u32`.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_comm_job(
    world_ranks: *const c_int,
    size: c_int,
    rank: c_int,
    position: *mut u32,
) -> c_int {
    let mut guard = shim();
    let Some(shim) = guard.as_mut() else {
        return AGGBOX_MPI_NOT_SERVED;
    };
    if world_ranks.is_null() || size <= 0 || rank < 0 || rank >= size || shim.sessions.is_empty() {
        return AGGBOX_MPI_NOT_SERVED;
    }
    let ranks = std::slice::from_raw_parts(world_ranks, size as usize);
    let settings = &shim.settings;
    let file = match &settings.source {
        Source::File(file) => file,
        Source::OnDemand(demand) => {
            // The communicator of these processes in this order has its
            // job already, or fell back already; one of a single process
            // has nothing to communicate.
            if let Some(i) = shim.sessions.iter().position(|s| s.joined().is_some_and(|j| j.members == ranks)) {
                return i as c_int;
            }
            if size == 1 || shim.fell_back.iter().any(|(m, _)| m == ranks) {
                return AGGBOX_MPI_NOT_SERVED;
            }
            let tuner = Tuner::new(settings.route, settings.trials);
            let joined = join(settings, demand, ranks, rank, tuner);
            let status = if joined.is_ok() { AGGBOX_MPI_JOINED } else { AGGBOX_MPI_JOIN_FAILED };
            shim.joining = Some((ranks.to_vec(), joined));
            return status;
        }
    };
    let Some(addrs) = ranks
        .iter()
        .map(|&r| usize::try_from(r).ok().and_then(|r| file.world_workers.get(r).copied()))
        .collect::<Option<Vec<IpAddr>>>()
    else {
        return AGGBOX_MPI_NOT_SERVED;
    };
    let job = if addrs == file.world_workers {
        Some(file.world_job)
    } else {
        file.config.jobs.iter().find(|j| j.workers == addrs).map(|j| j.id)
    };
    let Some(job) = job else {
        return AGGBOX_MPI_NOT_SERVED;
    };
    if let Some(i) = shim.sessions.iter().position(|s| s.job == job) {
        return i as c_int;
    }
    match prepare(settings, file, job, rank, size) {
        Ok((pending, at)) => {
            write_position(position, &at);
            shim.pending = Some(pending);
            AGGBOX_MPI_PENDING
        }
        Err(e) => {
            report(settings.world_rank, "a communicator's first served call", e);
            AGGBOX_MPI_ERROR
        }
    }
}

/// Opens the session [`aggbox_mpi_comm_job`] prepared, at the position its
/// communicator's ranks agreed on; its index, or AGGBOX_MPI_ERROR with the
/// reason printed.
#[no_mangle]
pub extern "C" fn aggbox_mpi_comm_start(round: u32, agg_seq: u32) -> c_int {
    start_pending("a communicator's first served call", round, agg_seq)
}

/// Called by the shim's `MPI_Finalize` before `PMPI_Finalize`: closes the
/// communicators and, when AGGBOX_MPI_STATS is set, prints the counters.
#[no_mangle]
pub extern "C" fn aggbox_mpi_finalize() {
    let shim = shim().take();
    if let Some(shim) = shim {
        let rank = shim.settings.world_rank;
        if shim.settings.stats {
            // One write, so that mpirun, which forwards every rank's stderr,
            // never splits the line.
            use std::io::Write;
            let jobs: String = shim
                .sessions
                .iter()
                .map(|s| {
                    // Per job on demand its node, per stripe its counters.
                    let joined: String = s.joined().map_or(String::new(), |j| {
                        j.comm
                            .run_comm()
                            .runs()
                            .iter()
                            .map(|run| {
                                let grant = run.grant();
                                format!("; job {} on demand (node {}, run {}, incarnation {})", grant.job, run.node(), j.run, grant.incarnation)
                            })
                            .collect()
                    });
                    let datagrams: String = s
                        .stripes()
                        .iter()
                        .map(|c| format!("; job {} datagrams {}", c.config().job, datagrams_line(c)))
                        .collect();
                    let ring = match &s.link {
                        Link::Chosen(_) => format!("; {} ring served {}", s.name(), s.ring_calls.load(Ordering::Relaxed)),
                        Link::OnDemand(j) if j.comm.has_ring() => format!("; {} ring served {}", s.name(), s.ring_calls.load(Ordering::Relaxed)),
                        _ => String::new(),
                    };
                    format!("{joined}{datagrams}{ring}; {} routes {}", s.name(), routes_line(&s.tuner))
                })
                .collect();
            let fell_back: String = shim.fell_back.iter().map(|(_, why)| format!("; fell back to PMPI: {why}")).collect();
            let line = format!("{}{jobs}{fell_back}\n", stats_line(rank));
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        // Each communicator closes, then this rank's part of its job on
        // demand ends: the node removes the job when every rank's has.
        for session in shim.sessions {
            let name = session.name();
            if let Link::OnDemand(j) = session.link {
                // RunCommunicator::end stops the communicators first.
                if let Err(e) = j.comm.end() {
                    report(rank, "MPI_Finalize", format!("ending {name} (run {}): {e}", j.run));
                }
            }
        }
    }
}

/// The communicator's datagram counters (sent and received, data and
/// ACKs), where its calls ran and how many rounds its adaptive float
/// allreduces took: what a call costs on the wire.
fn datagrams_line(comm: &Communicator) -> String {
    let (c, io) = (comm.stats(), comm.io_stats());
    format!(
        "data_sent={} retransmitted={} acks_sent={} data_received={} acks_received={} duplicates_received={} \
         calls_on_caller={} calls_on_progress_thread={} caller_waits_polled={} caller_waits_slept={} \
         float_calls_one_round={} float_calls_redone={}",
        c.data_sent,
        c.retransmitted,
        c.acks_sent,
        c.data_received,
        c.acks_received,
        c.duplicates_received,
        io.calls_on_caller,
        io.calls_on_progress_thread,
        io.caller_waits_polled,
        io.caller_waits_slept,
        c.float_calls_one_round,
        c.float_calls_redone
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
        "aggbox-mpi: rank {rank}: served {}; passed through {}; overflowed (rerun with PMPI) {}; stepped aside to PMPI {}",
        list(&SERVED),
        list(&PASSED),
        list(&OVERFLOWED),
        list(&STEPPED_ASIDE)
    )
}

/// A session's settled routes: `MPI_Allreduce int32 from 64 KiB: pmpi
/// (aggbox 812.0 µs vs pmpi 301.5 µs)`, comma-separated; what each trial
/// pair measured on the slowest rank.
fn routes_line(tuner: &Tuner) -> String {
    let routes: Vec<String> = tuner
        .choices()
        .iter()
        .map(|c| {
            let (call, float) = kind_parts(c.kind);
            let dtype = match (call, float) {
                (CALL_BCAST, _) => "bytes",
                (_, true) => "float32",
                (_, false) => "int32",
            };
            format!(
                "{} {dtype} from {}: {} (aggbox {:.1} µs vs pmpi {:.1} µs)",
                CALLS[call],
                tuner::class_name(c.log2_bytes),
                route_name(c.route),
                c.times_us[0],
                c.times_us[1]
            )
        })
        .collect();
    if routes.is_empty() {
        "none settled".to_string()
    } else {
        routes.join(", ")
    }
}

fn route_name(route: Route) -> &'static str {
    match route {
        Route::AggBox => "aggbox",
        Route::Baseline => "pmpi",
    }
}

/// The tuner's kind of a call: its CALLS index and whether it is float32
/// (a float call pays quantization and costs differently).
fn kind_of(call: usize, is_float: bool) -> u32 {
    call as u32 * 2 + is_float as u32
}

fn kind_parts(kind: u32) -> (usize, bool) {
    ((kind / 2) as usize, kind % 2 == 1)
}

/// Runs `f` on session `session`'s tuner; None (reported) when there is no
/// such session.
fn with_tuner<T>(session: c_int, what: &str, f: impl FnOnce(&mut Tuner) -> T) -> Option<T> {
    let mut guard = shim();
    let shim = guard.as_mut()?;
    let rank = shim.settings.world_rank;
    match usize::try_from(session).ok().and_then(|i| shim.sessions.get_mut(i)) {
        Some(s) => Some(f(&mut s.tuner)),
        None => {
            report(rank, what, format!("no session {session} (a bug in the shim)"));
            None
        }
    }
}

/// The route of a call AggBox can serve on session `session` (`call` as
/// for the counters, `is_float` for MPI_FLOAT, `bytes` its size): 0 =
/// AggBox, or AGGBOX_MPI_ROUTE_PMPI, either with AGGBOX_MPI_ROUTE_TRIAL
/// when the shim must time the call and report it to [`aggbox_mpi_trial`].
/// Every rank gets the same answer for the same call (docs/MPI.md, "AggBox
/// or PMPI"). A call routed to PMPI is counted as stepped aside.
#[no_mangle]
pub extern "C" fn aggbox_mpi_route(session: c_int, call: c_int, is_float: c_int, bytes: usize) -> c_int {
    let call = call_index(call);
    let pick = with_tuner(session, CALLS[call], |t| t.pick(kind_of(call, is_float != 0), bytes))
        .unwrap_or(Pick::Settled(Route::AggBox));
    let route = match pick.route() {
        Route::AggBox => 0,
        Route::Baseline => {
            STEPPED_ASIDE[call].fetch_add(1, Ordering::Relaxed);
            AGGBOX_MPI_ROUTE_PMPI
        }
    };
    match pick {
        Pick::Trial(_) => route | AGGBOX_MPI_ROUTE_TRIAL,
        Pick::Settled(_) => route,
    }
}

/// A trial call [`aggbox_mpi_route`] routed took `seconds`. Returns 1 when
/// it was its class's last trial: then `times` (2 doubles) holds this
/// rank's fastest AggBox and PMPI trial in µs, and the shim reduces them
/// with MPI_MAX over the communicator and calls [`aggbox_mpi_settle`] with
/// the result. Returns 0 otherwise.
///
/// # Safety
/// `times` points to 2 writable doubles.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_trial(
    session: c_int,
    call: c_int,
    is_float: c_int,
    bytes: usize,
    route: c_int,
    seconds: f64,
    times: *mut f64,
) -> c_int {
    let call = call_index(call);
    let route = if route & AGGBOX_MPI_ROUTE_PMPI != 0 { Route::Baseline } else { Route::AggBox };
    let took = Duration::from_secs_f64(seconds.max(0.0));
    let settle = with_tuner(session, CALLS[call], |t| t.record(kind_of(call, is_float != 0), bytes, route, took)).flatten();
    match settle {
        Some(s) if !times.is_null() => {
            std::slice::from_raw_parts_mut(times, 2).copy_from_slice(&s.times_us);
            1
        }
        _ => 0,
    }
}

/// Settles the class of a call with the times every rank agreed on
/// (MPI_MAX of [`aggbox_mpi_trial`]'s), so that AggBox serves its later
/// calls only where it was faster.
///
/// # Safety
/// `agreed` points to 2 doubles.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_settle(session: c_int, call: c_int, is_float: c_int, bytes: usize, agreed: *const f64) {
    if agreed.is_null() {
        return;
    }
    let call = call_index(call);
    let agreed = std::slice::from_raw_parts(agreed, 2);
    with_tuner(session, CALLS[call], |t| t.settle(kind_of(call, is_float != 0), bytes, [agreed[0], agreed[1]]));
}

/// The shim counts a call it passed to PMPI unchanged (`call`: 0 allreduce,
/// 1 reduce, 2 bcast).
#[no_mangle]
pub extern "C" fn aggbox_mpi_count_passed(call: c_int) {
    PASSED[call_index(call)].fetch_add(1, Ordering::Relaxed);
}

/// Whether a call of `bytes` bytes is served: the MPI session is open and
/// the size reaches AGGBOX_MPI_MIN_BYTES. Every rank passes the same count
/// and datatype to a collective, so every rank decides the same.
#[no_mangle]
pub extern "C" fn aggbox_mpi_serves(bytes: usize) -> c_int {
    shim()
        .as_ref()
        .is_some_and(|s| !s.sessions.is_empty() && bytes >= s.settings.min_bytes) as c_int
}

/// Whether MPI_FLOAT MPI_SUM is served (AGGBOX_MPI_FLOAT=quantized).
#[no_mangle]
pub extern "C" fn aggbox_mpi_serves_float() -> c_int {
    shim().as_ref().is_some_and(|s| s.settings.float) as c_int
}

/// `job J`, or `jobs J1, J2, ...` in stripe order.
fn jobs_name(ids: &[u16]) -> String {
    match ids {
        [one] => format!("job {one}"),
        _ => format!("jobs {}", ids.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// A served call's error as its line says it. A job on demand that the
/// node no longer serves (`CommError::JobLost`: the node restarted, or the
/// lease ran out) fails every call at once, naming the node and saying to
/// join the run again; for an MPI program that is a new run (the job is
/// aborted, as after any failed call: docs/MPI.md).
fn call_error(e: CommError) -> String {
    match e {
        CommError::JobLost(why) => format!("{why} (for this MPI program: run it again; its MPI_Init joins new jobs)"),
        e => e.to_string(),
    }
}

/// Runs `f` on session `session`; counts it as served under `call` when it
/// returns AGGBOX_MPI_OK, as overflowed under AGGBOX_MPI_OVERFLOW.
fn served(
    session: c_int,
    call: usize,
    what: &str,
    f: impl FnOnce(&Session) -> Result<bool, String>,
) -> c_int {
    let guard = shim();
    let status = match guard.as_ref() {
        None => {
            eprintln!("aggbox-mpi: {what} before MPI_Init or after MPI_Finalize");
            AGGBOX_MPI_ERROR
        }
        Some(shim) => match usize::try_from(session).ok().and_then(|i| shim.sessions.get(i)) {
            None => {
                report(shim.settings.world_rank, what, format!("no session {session} (a bug in the shim)"));
                AGGBOX_MPI_ERROR
            }
            Some(s) => match f(s) {
                Ok(false) => AGGBOX_MPI_OK,
                Ok(true) => AGGBOX_MPI_OVERFLOW,
                Err(e) => {
                    report(shim.settings.world_rank, what, format!("{}: {e}", s.name()));
                    AGGBOX_MPI_ERROR
                }
            },
        },
    };
    match status {
        AGGBOX_MPI_OK => SERVED[call].fetch_add(1, Ordering::Relaxed),
        AGGBOX_MPI_OVERFLOW => OVERFLOWED[call].fetch_add(1, Ordering::Relaxed),
        _ => 0,
    };
    status
}

/// In-place int32 allreduce of `buf[..len]` on session `session` with the
/// AggBox op `op` (`aggbox::wire::abi::Op` numbering, include/aggbox/ops.def:
/// one whose row names an MPI op, [`Op::mpi_name`]). `call` is what the
/// shim counts it as (0 allreduce, 1 reduce: MPI_Reduce is an allreduce
/// whose result only the root keeps, since a node-served job has no
/// consumer but the workers).
///
/// # Safety
/// `buf` points to `len` writable int32 values.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_allreduce_i32(
    session: c_int,
    buf: *mut i32,
    len: usize,
    op: c_int,
    call: c_int,
) -> c_int {
    let buf = slice_mut(buf, len);
    let call = call_index(call);
    served(session, call, CALLS[call], |s| {
        let op = match u8::try_from(op).ok().and_then(Op::from_u8) {
            Some(op) if op.mpi_name().is_some() => op,
            _ => {
                return Err(format!(
                    "op {op} is not one the shim maps (a bug in the shim)"
                ))
            }
        };
        s.collective()
            .allreduce_elements(Elements::I32(buf), op, CallOptions::default())
            .map(|served| s.count(served).clamped)
            .map_err(call_error)
    })
}

/// In-place float32 SUM allreduce on session `session` through
/// quantization (opt-in, AGGBOX_MPI_FLOAT=quantized; the result is within
/// the quantization bound of MPI's, not bit-identical). `call` as for the
/// int32 one.
///
/// # Safety
/// `buf` points to `len` writable float32 values.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_allreduce_f32(
    session: c_int,
    buf: *mut f32,
    len: usize,
    call: c_int,
) -> c_int {
    let buf = slice_mut(buf, len);
    let call = call_index(call);
    served(session, call, CALLS[call], |s| {
        s.collective()
            .allreduce_elements(Elements::F32(buf), Op::Sum, CallOptions::default())
            .map(|served| s.count(served).clamped)
            .map_err(call_error)
    })
}

/// Broadcast of `buf[..len]` bytes on session `session` from the
/// communicator's rank `root` (AggBox worker `root` of its job) to the
/// other ranks.
///
/// # Safety
/// `buf` points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_bcast(session: c_int, buf: *mut u8, len: usize, root: c_int) -> c_int {
    let buf = slice_mut(buf, len);
    served(session, CALL_BCAST, CALLS[CALL_BCAST], |s| {
        let root = u16::try_from(root).map_err(|_| format!("root {root} is not a rank"))?;
        s.collective()
            .broadcast_bytes(buf, Participant::Worker(root), CallOptions::default())
            .map(|_| false)
            .map_err(call_error)
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
