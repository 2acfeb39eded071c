//! Jobs on demand (docs/MPI.md, "Jobs on demand"): the communicators of
//! an MPI program get their jobs from the node's control endpoint
//! (`AGGBOX_MPI_NODE=IP[:PORT]`, `AGGBOX_TENANT`, `AGGBOX_KEY`), with no
//! node file on the ranks. MPI_COMM_WORLD's job is joined at `MPI_Init`
//! (the shim broadcasts rank 0's run key, [`aggbox_mpi_run_key`], and
//! calls [`aggbox_mpi_join`]), another communicator's at its first served
//! call ([`join`], from `aggbox_mpi_comm_job`); either way the ranks agree
//! with an MPI_MIN of "joined" and call [`aggbox_mpi_comm_joined`], which
//! keeps the session or falls back (AGGBOX_MPI_FALLBACK).

use std::ffi::c_int;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use aggbox::runtime::control::{stripe_socket, Credential, JobShape, RunCommunicator, RunJob};
use aggbox::runtime::tuner::Tuner;
use aggbox::runtime::{CommError, Collective, Quantization, StarOrRing};
use aggbox::wire::abi::Op;

use super::{
    env, env_parsed, read_common, jobs_name, report, shim, Link, Session, Settings, Shim, Source, AGGBOX_MPI_ERROR, AGGBOX_MPI_JOINED,
    AGGBOX_MPI_JOIN_FAILED, AGGBOX_MPI_NOT_SERVED, AGGBOX_MPI_OK, CALLER_SPIN, ENV_CONFIG, ENV_DATA_PORT, ENV_NODE,
};

/// Jobs on demand (docs/MPI.md, "Jobs on demand"); the credential is the
/// runtime's AGGBOX_TENANT and AGGBOX_KEY.
const ENV_DATA: &str = "AGGBOX_MPI_DATA";
const ENV_RUN: &str = "AGGBOX_MPI_RUN";
const ENV_FALLBACK: &str = "AGGBOX_MPI_FALLBACK";
const ENV_JOIN_MS: &str = "AGGBOX_MPI_JOIN_MS";
/// How long a join waits for the node's answer: longer than the node's
/// lease (10 s), within which it refuses a run whose ranks did not all
/// join, so that a rank that never came shows as the node's reason.
const DEFAULT_JOIN_MS: u64 = 30_000;
/// The longest run key AGGBOX_MPI_RUN may give (another communicator's
/// run key adds 17 characters; the shim's buffer is RUN_KEY_BYTES).
const MAX_RUN_KEY: usize = 96;

/// Whether MPI_COMM_WORLD's job comes on demand: AGGBOX_MPI_NODE without
/// AGGBOX_MPI_CONFIG.
fn on_demand() -> bool {
    env(ENV_CONFIG).is_none() && env(ENV_NODE).is_some()
}

/// Jobs on demand (docs/INTERFACE.md, "Jobs on demand").
pub(crate) struct OnDemand {
    /// The nodes' control endpoints, in stripe order (AGGBOX_MPI_NODE);
    /// each one's address is also its data plane's.
    nodes: Vec<SocketAddr>,
    credential: Credential,
    /// The run key of MPI_COMM_WORLD's job (rank 0's, broadcast); another
    /// communicator's run key is this one and its processes.
    run: String,
    /// MPI_COMM_WORLD's size.
    world: c_int,
    /// This process's data address: AGGBOX_MPI_DATA, else the local
    /// address that routes to the first node.
    data_ip: IpAddr,
    /// AGGBOX_MPI_DATA_PORT: MPI_COMM_WORLD's data port (stripe t's: plus
    /// t); free ports otherwise (and always for the other communicators'
    /// jobs).
    data_port: Option<u16>,
    join_deadline: Duration,
    /// AGGBOX_MPI_FALLBACK: what a failed join does.
    fallback: Fallback,
    /// AGGBOX_MPI_RING=demand: MPI_COMM_WORLD's run asks for a ring.
    ring: Option<super::ring::DemandRing>,
}

/// What a communicator whose job could not be had does
/// (AGGBOX_MPI_FALLBACK).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// Its calls go to PMPI (a line on stderr says why; the stats too).
    Pmpi,
    /// The job is aborted, as a failure of the file's job does.
    Abort,
}

/// A session's job on demand.
pub(crate) struct Joined {
    /// The MPI_COMM_WORLD ranks of the job's workers in its rank order:
    /// the communicators of these processes in this order share the job.
    pub(crate) members: Vec<c_int>,
    pub(crate) run: String,
    /// The job's communicator with this rank's part of the run: renewed
    /// while it lives, every call failing with `CommError::JobLost` once
    /// a renewal is refused (docs/INTERFACE.md, "A node that restarts").
    pub(crate) comm: JoinedComm,
}

/// A job on demand's communicator, beside its ring on demand when the run
/// asked for one (MPI_COMM_WORLD with AGGBOX_MPI_RING=demand).
pub(crate) enum JoinedComm {
    Star(RunCommunicator),
    WithRing(Box<StarOrRing<RunCommunicator>>),
}

impl JoinedComm {
    /// The run's communicator (the star's).
    pub(crate) fn run_comm(&self) -> &RunCommunicator {
        match self {
            JoinedComm::Star(c) => c,
            JoinedComm::WithRing(s) => s.star().expect("built with its star"),
        }
    }

    /// What runs the calls.
    pub(crate) fn collective(&self) -> &dyn Collective {
        match self {
            JoinedComm::Star(c) => c,
            JoinedComm::WithRing(s) => s.as_ref(),
        }
    }

    /// Whether a ring serves calls beside the star.
    pub(crate) fn has_ring(&self) -> bool {
        matches!(self, JoinedComm::WithRing(_))
    }

    /// Stops the communicators, then ends this rank's part of the run (its
    /// ring ends with the job).
    pub(crate) fn end(self) -> Result<(), CommError> {
        match self {
            JoinedComm::Star(c) => c.end(),
            JoinedComm::WithRing(s) => {
                let (star, ring) = s.into_parts();
                drop(ring);
                star.map_or(Ok(()), RunCommunicator::end)
            }
        }
    }
}

/// Reads what `MPI_Init` needs for jobs on demand: the nodes' control
/// endpoints, the credential, this process's data address, and the
/// variables; `run` is MPI_COMM_WORLD's run key (rank 0's).
fn read_on_demand(rank: c_int, size: c_int, run: &str) -> Result<Settings, String> {
    let nodes = parse_nodes(&env(ENV_NODE).ok_or_else(|| format!("{ENV_NODE} is not set"))?)?;
    let credential = Credential::from_env().map_err(plain)?;
    let data_ip = match env_parsed::<IpAddr>(ENV_DATA)? {
        Some(ip) => ip,
        None => route_to(nodes[0]).map_err(|e| {
            format!("no local address routes to the node {} ({e}): set {ENV_DATA} to this process's IP address", nodes[0])
        })?,
    };
    let fallback = match env(ENV_FALLBACK).as_deref() {
        None | Some("pmpi") => Fallback::Pmpi,
        Some("abort") => Fallback::Abort,
        Some(v) => return Err(format!("{ENV_FALLBACK}={v:?}: expected \"pmpi\" (default: a communicator whose job could not be had passes its calls to MPI) or \"abort\"")),
    };
    let join_deadline = Duration::from_millis(env_parsed::<u64>(ENV_JOIN_MS)?.unwrap_or(DEFAULT_JOIN_MS));
    let ring = super::ring::read_on_demand(rank)?;
    if ring.is_some() && nodes.len() != 1 {
        return Err(format!("AGGBOX_MPI_RING=demand with {} nodes in {ENV_NODE}: a run with a ring joins one node", nodes.len()));
    }
    let demand = OnDemand {
        nodes,
        credential,
        run: run.to_string(),
        world: size,
        data_ip,
        data_port: env_parsed(ENV_DATA_PORT)?,
        join_deadline,
        fallback,
        ring,
    };
    read_common(rank, Source::OnDemand(demand))
}

/// AGGBOX_MPI_NODE's control endpoints: `IPv4[:PORT]`, `[IPv6]:PORT` or
/// a bare IPv6 address (port default 7471, `[node] control`'s),
/// comma-separated, each node once, in stripe order.
fn parse_nodes(text: &str) -> Result<Vec<SocketAddr>, String> {
    let default_port = aggbox::config::DEFAULT_CONTROL.port();
    let mut nodes: Vec<SocketAddr> = Vec::new();
    for part in text.split(',').map(str::trim) {
        let bare = part.strip_prefix('[').and_then(|p| p.strip_suffix(']')).unwrap_or(part);
        let node = match bare.parse::<IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, default_port),
            Err(_) => part.parse().map_err(|_| {
                format!("{ENV_NODE}={text:?}: expected each node's control endpoint as IPv4[:PORT] or [IPv6]:PORT (port default {default_port}), comma-separated; {part:?} is not one")
            })?,
        };
        if nodes.contains(&node) {
            return Err(format!("{ENV_NODE}={text:?}: {node} is named twice; each node serves one stripe"));
        }
        nodes.push(node);
    }
    Ok(nodes)
}

/// This rank's data address for a job striped over `stripes` nodes: stripe
/// t on its port plus t ([`stripe_socket`]), the port `fixed` or the first
/// of `stripes` consecutive free ports, which the returned sockets hold
/// (bound) until the communicators bind them.
fn data_ports(ip: IpAddr, fixed: Option<u16>, stripes: usize) -> Result<(SocketAddr, Vec<UdpSocket>), String> {
    if let Some(port) = fixed {
        let data = SocketAddr::new(ip, port);
        stripe_socket(data, stripes - 1).map_err(plain)?;
        return Ok((data, Vec::new()));
    }
    const TRIES: usize = 64;
    for _ in 0..TRIES {
        let first = UdpSocket::bind((ip, 0)).map_err(|e| format!("a free UDP port on {ip} ({ENV_DATA}): {e}"))?;
        let data = first.local_addr().map_err(|e| format!("a free UDP port on {ip}: {e}"))?;
        let mut held = vec![first];
        for t in 1..stripes {
            match stripe_socket(data, t).ok().and_then(|at| UdpSocket::bind(at).ok()) {
                Some(socket) => held.push(socket),
                None => break,
            }
        }
        if held.len() == stripes {
            return Ok((data, held));
        }
    }
    Err(format!("no {stripes} consecutive free UDP ports on {ip} in {TRIES} tries (one per node)"))
}

/// A control-path error's message without the runtime's "runtime
/// configuration:" prefix (a refusal, a connection: not a configuration).
fn plain(e: aggbox::runtime::CommError) -> String {
    match e {
        aggbox::runtime::CommError::Config(m) => m,
        e => e.to_string(),
    }
}

/// The local address (of `node`'s IP version) from which this process
/// reaches `node`: a connected UDP socket's (no datagram is sent).
fn route_to(node: SocketAddr) -> std::io::Result<IpAddr> {
    let any: IpAddr = if node.is_ipv6() { Ipv6Addr::UNSPECIFIED.into() } else { Ipv4Addr::UNSPECIFIED.into() };
    let probe = UdpSocket::bind((any, 0))?;
    probe.connect(node)?;
    match probe.local_addr()? {
        a if !a.ip().is_unspecified() => Ok(a.ip()),
        other => Err(std::io::Error::other(format!("the route's source is {other}"))),
    }
}

/// Whether `members` (world ranks in a communicator's order) are
/// MPI_COMM_WORLD's processes in its order.
fn is_world(demand: &OnDemand, members: &[c_int]) -> bool {
    members.len() == demand.world as usize && members.iter().enumerate().all(|(i, &r)| r == i as c_int)
}

/// The run key of the communicator whose processes are the world ranks
/// `members` (in its rank order): MPI_COMM_WORLD's is the world's run key,
/// another's adds a hash of its processes, so that its ranks name the same
/// run without a message and two communicators of the same processes in
/// the same order share a job.
fn run_key(demand: &OnDemand, members: &[c_int]) -> String {
    let world_run = &demand.run;
    if is_world(demand, members) {
        return world_run.to_string();
    }
    // FNV-1a over the ranks, little-endian.
    let hash = members
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    format!("{world_run}.{hash:016x}")
}

/// Jobs on demand: joins the run of the communicator whose processes are
/// the world ranks `members`, this process its rank `rank`, at every node
/// in order, builds its communicator, striped over the jobs as
/// `RunCommunicator::join` stripes them (stripe t at node t, through the
/// data port plus t), and makes a first allreduce (as `open` does). Every
/// rank of the communicator calls it in the same MPI call; each node
/// creates its job when all of them have joined there.
pub(crate) fn join(settings: &Settings, demand: &OnDemand, members: &[c_int], rank: c_int, tuner: Tuner) -> Result<Session, String> {
    let size = members.len() as c_int;
    let run = run_key(demand, members);
    let world = u16::try_from(size).map_err(|_| format!("a communicator of {size} ranks"))?;
    // This job's data sockets: MPI_COMM_WORLD's on AGGBOX_MPI_DATA_PORT
    // if set, else free ports, held until just before the communicators
    // bind them (a socket per job, as with the file's jobs).
    let fixed = if is_world(demand, members) { demand.data_port } else { None };
    let (data, held) = data_ports(demand.data_ip, fixed, demand.nodes.len())?;
    // MPI_COMM_WORLD's run asks for its ring at the ranks' own nodes.
    let ring = demand.ring.as_ref().filter(|_| is_world(demand, members));
    let mut runs = Vec::with_capacity(demand.nodes.len());
    for (t, node) in demand.nodes.iter().enumerate() {
        let at = stripe_socket(data, t).map_err(plain)?;
        let credential = demand.credential.clone();
        let shape = match ring {
            Some(r) => {
                let own = r.node.unwrap_or_else(|| SocketAddr::new(demand.data_ip, node.port()));
                JobShape { vector_len: Some(r.len), ring: Some(own), ..JobShape::default() }
            }
            None => JobShape::default(),
        };
        runs.push(RunJob::join_shaped(*node, credential, &run, world, rank as u16, at, shape, demand.join_deadline).map_err(plain)?);
    }
    drop(held);
    let ids: Vec<u16> = runs.iter().map(|r| r.grant().job).collect();
    let name = jobs_name(&ids);
    let comm = RunCommunicator::from_runs(runs, |b| {
        let b = b.quantization(Quantization::Adaptive).caller_spin(CALLER_SPIN);
        match settings.deadline {
            Some(d) => b.deadline(d),
            None => b,
        }
    })
    .map_err(|e| format!("{name} (run {run}) worker {rank} at {data}: {e}"))?;
    let mut ranks = [1i32];
    match comm.allreduce(&mut ranks, Op::Sum) {
        Ok(_) if ranks[0] == size => {}
        Ok(_) => return Err(format!("{name}'s first allreduce counted {} ranks, not {size}", ranks[0])),
        Err(e) => {
            let nodes: Vec<String> = demand.nodes.iter().map(|n| n.ip().to_string()).collect();
            return Err(format!(
                "{name} (run {run})'s first allreduce failed ({e}): does {data} reach the node {} and back?",
                nodes.join(", ")
            ));
        }
    }
    let comm = match ring {
        None => JoinedComm::Star(comm),
        Some(r) => {
            let ring = comm
                .run()
                .ring(&r.pin_dir)
                .map_err(|e| format!("{name} (run {run})'s ring on demand (pins at {}): {e}", r.pin_dir.display()))?;
            let first = comm.communicator().config().clone();
            JoinedComm::WithRing(Box::new(super::ring::beside_on_demand(comm, &first, ring, r)?))
        }
    };
    Ok(Session { job: ids[0], link: Link::OnDemand(Joined { members: members.to_vec(), run, comm }), tuner, ring_calls: Default::default() })
}

/// Whether MPI_COMM_WORLD's job comes on demand (AGGBOX_MPI_NODE without
/// AGGBOX_MPI_CONFIG): then the shim's `MPI_Init` broadcasts rank 0's
/// [`aggbox_mpi_run_key`] and calls [`aggbox_mpi_join`]; otherwise
/// [`aggbox_mpi_position`].
#[no_mangle]
pub extern "C" fn aggbox_mpi_on_demand() -> c_int {
    on_demand() as c_int
}

/// Writes MPI_COMM_WORLD's run key to `out` (`len` bytes, NUL-terminated;
/// AGGBOX_MPI_RUN_KEY_BYTES in the shim), on rank 0: AGGBOX_MPI_RUN, else
/// `mpi-` and 32 random hex digits, so that every run, concurrent or
/// consecutive, gets a job of its own. AGGBOX_MPI_ERROR (reason printed)
/// when AGGBOX_MPI_RUN is too long or the buffer too small.
///
/// # Safety
/// `out` points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_run_key(out: *mut std::ffi::c_char, len: usize) -> c_int {
    let key = match env(ENV_RUN) {
        Some(k) if k.len() > MAX_RUN_KEY || k.bytes().any(|b| b == 0) => {
            report(0, "MPI_Init", format!("{ENV_RUN}: a run key of at most {MAX_RUN_KEY} bytes"));
            return AGGBOX_MPI_ERROR;
        }
        Some(k) => k,
        None => format!("mpi-{}", random_hex()),
    };
    if out.is_null() || key.len() >= len {
        report(0, "MPI_Init", "the run key's buffer is too small (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    }
    let out = std::slice::from_raw_parts_mut(out as *mut u8, len);
    out[..key.len()].copy_from_slice(key.as_bytes());
    out[key.len()] = 0;
    AGGBOX_MPI_OK
}

/// 16 random bytes in hex (the clock and the process id where
/// /dev/urandom cannot be read).
fn random_hex() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes[..8].copy_from_slice(&(t as u64).to_le_bytes());
        bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Jobs on demand, called by the shim's `MPI_Init` after `PMPI_Init` and
/// the broadcast of rank 0's run key `run`: reads the variables, joins
/// MPI_COMM_WORLD's job at the node's control endpoint, builds its
/// communicator and makes a first allreduce. AGGBOX_MPI_JOINED, or
/// AGGBOX_MPI_JOIN_FAILED (a refusal, no node, no data path: the reason
/// is kept); either way the ranks then agree and call
/// [`aggbox_mpi_comm_joined`]. AGGBOX_MPI_ERROR (reason printed) when a
/// variable is missing or wrong: the shim aborts the job.
///
/// # Safety
/// `run` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn aggbox_mpi_join(rank: c_int, size: c_int, run: *const std::ffi::c_char) -> c_int {
    if run.is_null() || size <= 0 {
        report(rank, "MPI_Init", "no run key (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    }
    let run = std::ffi::CStr::from_ptr(run).to_string_lossy().into_owned();
    let settings = match read_on_demand(rank, size, &run) {
        Ok(s) => s,
        Err(e) => {
            report(rank, "MPI_Init", e);
            return AGGBOX_MPI_ERROR;
        }
    };
    let members: Vec<c_int> = (0..size).collect();
    let Source::OnDemand(demand) = &settings.source else { unreachable!("read_on_demand") };
    let tuner = Tuner::new(settings.route, settings.trials);
    let joined = join(&settings, demand, &members, rank, tuner);
    let status = if joined.is_ok() { AGGBOX_MPI_JOINED } else { AGGBOX_MPI_JOIN_FAILED };
    *shim() = Some(Shim {
        settings,
        sessions: Vec::new(),
        pending: None,
        joining: Some((members, joined)),
        fell_back: Vec::new(),
    });
    status
}

/// Jobs on demand: ends the join that [`aggbox_mpi_join`] or
/// [`aggbox_mpi_comm_job`] made, with `all` = whether every rank of the
/// communicator joined (MPI_MIN over it). Then the session's index (0 for
/// MPI_COMM_WORLD); otherwise this rank's part of the job is ended and,
/// with AGGBOX_MPI_FALLBACK=pmpi (the default), a line says why and that
/// the communicator's calls go to PMPI: AGGBOX_MPI_NOT_SERVED; with
/// `abort`, AGGBOX_MPI_ERROR (reason printed; the shim aborts the job).
#[no_mangle]
pub extern "C" fn aggbox_mpi_comm_joined(all: c_int) -> c_int {
    let mut guard = shim();
    let Some(shim) = guard.as_mut() else {
        eprintln!("aggbox-mpi: a join's agreement before MPI_Init or after MPI_Finalize (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    };
    let rank = shim.settings.world_rank;
    let Some((members, joined)) = shim.joining.take() else {
        report(rank, "a join's agreement", "no join was made (a bug in the shim)");
        return AGGBOX_MPI_ERROR;
    };
    let world = match &shim.settings.source {
        Source::OnDemand(d) => is_world(d, &members),
        Source::File(_) => false,
    };
    let (what, comm) = if world {
        ("MPI_Init", "MPI_COMM_WORLD".to_string())
    } else {
        ("a communicator's first served call", format!("the communicator of world ranks {members:?}"))
    };
    let reason = match joined {
        Ok(session) if all != 0 => {
            shim.sessions.push(session);
            return (shim.sessions.len() - 1) as c_int;
        }
        // Ends this rank's part of the job the others could not use.
        Ok(session) => format!("{}: another rank of {comm} could not join its job", session.name()),
        Err(e) => e,
    };
    let fallback = match &shim.settings.source {
        Source::OnDemand(d) => d.fallback,
        Source::File(_) => Fallback::Abort,
    };
    match fallback {
        Fallback::Pmpi => {
            report(rank, what, format!("{reason}; {comm} falls back to PMPI ({ENV_FALLBACK}=pmpi): its calls go to MPI unchanged"));
            shim.fell_back.push((members, format!("{comm}: {reason}")));
            AGGBOX_MPI_NOT_SERVED
        }
        Fallback::Abort => {
            report(rank, what, format!("{reason} ({ENV_FALLBACK}=abort)"));
            AGGBOX_MPI_ERROR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_comma_separated_endpoints_in_stripe_order() {
        let nodes = parse_nodes("10.77.0.11:7481, 10.77.0.16").unwrap();
        assert_eq!(nodes, ["10.77.0.11:7481".parse().unwrap(), "10.77.0.16:7471".parse().unwrap()]);
        assert_eq!(parse_nodes("10.77.0.11").unwrap().len(), 1);
        for bad in ["", "10.77.0.11,", "10.77.0.11;10.77.0.16", "node:7471", "10.77.0.11:7471,10.77.0.11", "fd00::1:7471:x", "[fd00::1"] {
            assert!(parse_nodes(bad).is_err(), "{bad:?}");
        }
        // IPv6: bracketed with a port, bracketed or bare without one.
        let nodes = parse_nodes("[fd00:10:77::11]:7481, fd00:10:77::16, [fd00:10:77::17]").unwrap();
        let want: Vec<SocketAddr> =
            ["[fd00:10:77::11]:7481", "[fd00:10:77::16]:7471", "[fd00:10:77::17]:7471"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(nodes, want);
    }

    #[test]
    fn a_rank_holds_one_free_port_per_stripe_consecutive() {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let (data, held) = data_ports(ip, None, 3).unwrap();
        assert_eq!(held.len(), 3);
        for (t, socket) in held.iter().enumerate() {
            assert_eq!(socket.local_addr().unwrap(), stripe_socket(data, t).unwrap());
        }
        // A fixed port is the caller's: nothing held, but it must leave room
        // for every stripe.
        assert_eq!(data_ports(ip, Some(7700), 2).unwrap().0.port(), 7700);
        assert!(data_ports(ip, Some(65535), 2).is_err());
    }
}
