//! MPI_COMM_WORLD's allreduces through the ring as well as the star
//! (docs/MPI.md, "The ring"): with `AGGBOX_MPI_RING`, a `[[ring]]` of the
//! node file whose members are MPI_COMM_WORLD's ranks in order, or with
//! `AGGBOX_MPI_RING=demand` a ring on demand at the ranks' own nodes
//! (jobs on demand, AGGBOX_MPI_NODE), each call goes to the star or the
//! ring by its size and op (`runtime::StarOrRing`), as Python's
//! `from_config(ring=...)` and `connect(ring=...)` do.

use std::ffi::c_int;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use aggbox::config::Config;
use aggbox::runtime::{Algorithm, Collective, Communicator, RingCommunicator, StarOrRing};

use super::{env, env_parsed};

const ENV_RING: &str = "AGGBOX_MPI_RING";
const ENV_PIN_DIR: &str = "AGGBOX_MPI_PIN_DIR";
const ENV_ALGORITHM: &str = "AGGBOX_MPI_ALGORITHM";
const ENV_RING_THRESHOLD: &str = "AGGBOX_MPI_RING_THRESHOLD";
const ENV_RING_NODE: &str = "AGGBOX_MPI_RING_NODE";
const ENV_RING_LEN: &str = "AGGBOX_MPI_RING_LEN";
/// AGGBOX_MPI_RING's value that asks for a ring on demand.
const ON_DEMAND: &str = "demand";

/// What the ring variables asked for.
pub(crate) struct RingChoice {
    /// The `[[ring]]` id.
    id: u16,
    /// Where this host's `aggbox attach` pinned its maps, `{rank}`
    /// replaced by the world rank.
    pin_dir: PathBuf,
    algorithm: Algorithm,
    /// Elements from which `auto` takes the ring (default: by MTU and
    /// ring size, `runtime::collective::default_ring_threshold`).
    threshold: Option<usize>,
}

/// A ring on demand (AGGBOX_MPI_RING=demand): MPI_COMM_WORLD's run asks
/// the node for a ring of its ranks at their own nodes (docs/INTERFACE.md,
/// "Rings on demand").
pub(crate) struct DemandRing {
    /// This rank's own node's control endpoint (AGGBOX_MPI_RING_NODE), or
    /// none: this process's data address on the first node's control port.
    pub(crate) node: Option<SocketAddr>,
    /// The ring's length in elements (AGGBOX_MPI_RING_LEN): larger calls
    /// take the star.
    pub(crate) len: u32,
    pub(crate) pin_dir: PathBuf,
    algorithm: Algorithm,
    threshold: Option<usize>,
}

/// Fails when a variable of the ring is set without AGGBOX_MPI_RING.
fn none_without_ring() -> Result<(), String> {
    for other in [ENV_PIN_DIR, ENV_ALGORITHM, ENV_RING_THRESHOLD, ENV_RING_NODE, ENV_RING_LEN] {
        if env(other).is_some() {
            return Err(format!("{other} is set without {ENV_RING}"));
        }
    }
    Ok(())
}

/// AGGBOX_MPI_PIN_DIR (`{rank}` replaced), AGGBOX_MPI_ALGORITHM and
/// AGGBOX_MPI_RING_THRESHOLD, for the ring `what`.
fn choice_vars(rank: c_int, what: &str) -> Result<(PathBuf, Algorithm, Option<usize>), String> {
    let pin_dir = env(ENV_PIN_DIR).ok_or_else(|| {
        format!("{ENV_RING}={what} needs {ENV_PIN_DIR}: where this host's `aggbox attach` pinned its maps (e.g. /sys/fs/bpf/aggbox/eth0; `{{rank}}` is replaced by the world rank)")
    })?;
    let algorithm = match env(ENV_ALGORITHM).as_deref() {
        None | Some("auto") => Algorithm::Auto,
        Some("star") => Algorithm::Star,
        Some("ring") => Algorithm::Ring,
        Some(v) => return Err(format!("{ENV_ALGORITHM}={v:?}: one of auto, star, ring")),
    };
    Ok((PathBuf::from(pin_dir.replace("{rank}", &rank.to_string())), algorithm, env_parsed(ENV_RING_THRESHOLD)?))
}

/// The ring variables of world rank `rank` for jobs on demand: `None`
/// without AGGBOX_MPI_RING; an error naming the variable for anything else
/// that is wrong (a ring id: the file's rings need AGGBOX_MPI_CONFIG).
pub(crate) fn read_on_demand(rank: c_int) -> Result<Option<DemandRing>, String> {
    match env(ENV_RING).as_deref() {
        None => none_without_ring().map(|()| None),
        Some(ON_DEMAND) => {
            let (pin_dir, algorithm, threshold) = choice_vars(rank, ON_DEMAND)?;
            let len = match env_parsed::<u32>(ENV_RING_LEN)? {
                Some(n) if n >= 1 => n,
                _ => return Err(format!("{ENV_RING}={ON_DEMAND} needs {ENV_RING_LEN}: the ring's length in elements (at least 1; its memory on every rank's node; larger calls take the star)")),
            };
            let node = match env(ENV_RING_NODE) {
                None => None,
                Some(v) => Some(v.parse().map_err(|_| format!("{ENV_RING_NODE}={v:?}: this rank's own node's control endpoint as IPv4:PORT or [IPv6]:PORT"))?),
            };
            Ok(Some(DemandRing { node, len, pin_dir, algorithm, threshold }))
        }
        Some(v) => Err(format!("{ENV_RING}={v:?}: with jobs on demand (AGGBOX_MPI_NODE) a ring comes on demand too: {ENV_RING}={ON_DEMAND}")),
    }
}

/// The ring variables of world rank `rank`, checked against `config`
/// (`path`): `None` without AGGBOX_MPI_RING; an error naming the variable
/// for anything else that is wrong.
pub(crate) fn read(rank: c_int, config: &Config, path: &str, world: &[IpAddr]) -> Result<Option<RingChoice>, String> {
    let Some(id) = env_parsed::<u16>(ENV_RING)? else {
        none_without_ring()?;
        return Ok(None);
    };
    let ring = config
        .ring(id)
        .ok_or_else(|| format!("{ENV_RING}={id}: no [[ring]] {id} in {path}"))?;
    if ring.members != world {
        return Err(format!(
            "{ENV_RING}={id}: the ring's members must be MPI_COMM_WORLD's ranks in order (job workers {world:?}), not {:?}",
            ring.members
        ));
    }
    let (pin_dir, algorithm, threshold) = choice_vars(rank, &id.to_string())?;
    Ok(Some(RingChoice { id, pin_dir, algorithm, threshold }))
}

/// The star of MPI_COMM_WORLD's job beside the chosen ring.
pub(crate) fn beside(star: Communicator, choice: &RingChoice, config: &Config) -> Result<StarOrRing<Communicator>, String> {
    let ring = RingCommunicator::open(config, choice.id, &choice.pin_dir)
        .map_err(|e| format!("ring {} (pins at {}): {e}", choice.id, choice.pin_dir.display()))?;
    let config = star.config().clone();
    with_ring(star, &config, ring, choice.algorithm, choice.threshold)
}

/// The star of MPI_COMM_WORLD's job on demand (`first`: its first stripe's
/// communicator's settings) beside its ring on demand.
pub(crate) fn beside_on_demand<S: Collective>(
    star: S,
    first: &aggbox::runtime::CommConfig,
    ring: RingCommunicator,
    choice: &DemandRing,
) -> Result<StarOrRing<S>, String> {
    with_ring(star, first, ring, choice.algorithm, choice.threshold)
}

fn with_ring<S: Collective>(
    star: S,
    first: &aggbox::runtime::CommConfig,
    mut ring: RingCommunicator,
    algorithm: Algorithm,
    threshold: Option<usize>,
) -> Result<StarOrRing<S>, String> {
    ring.set_deadline(first.deadline);
    ring.set_quantization(first.quantization);
    let mut chosen = StarOrRing::of(Some(star), Some(ring), Some(first.mtu)).map_err(|e| e.to_string())?.with_algorithm(algorithm);
    if let Some(n) = threshold {
        chosen = chosen.with_ring_threshold(n);
    }
    Ok(chosen)
}
