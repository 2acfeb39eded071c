//! MPI_COMM_WORLD's allreduces through the ring as well as the star
//! (docs/MPI.md, "The ring"): with `AGGBOX_MPI_RING`, a `[[ring]]` of the
//! node file whose members are MPI_COMM_WORLD's ranks in order, each call
//! goes to the star or the ring by its size and op
//! (`runtime::StarOrRing`), as Python's `from_config(ring=...)` does.

use std::ffi::c_int;
use std::path::PathBuf;

use aggbox::config::Config;
use aggbox::runtime::{Algorithm, Communicator, RingCommunicator, StarOrRing};

use super::{env, env_parsed};

const ENV_RING: &str = "AGGBOX_MPI_RING";
const ENV_PIN_DIR: &str = "AGGBOX_MPI_PIN_DIR";
const ENV_ALGORITHM: &str = "AGGBOX_MPI_ALGORITHM";
const ENV_RING_THRESHOLD: &str = "AGGBOX_MPI_RING_THRESHOLD";

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

/// The ring variables of world rank `rank`, checked against `config`
/// (`path`): `None` without AGGBOX_MPI_RING; an error naming the variable
/// for anything else that is wrong.
pub(crate) fn read(rank: c_int, config: &Config, path: &str, world: &[std::net::Ipv4Addr]) -> Result<Option<RingChoice>, String> {
    let Some(id) = env_parsed::<u16>(ENV_RING)? else {
        for other in [ENV_PIN_DIR, ENV_ALGORITHM, ENV_RING_THRESHOLD] {
            if env(other).is_some() {
                return Err(format!("{other} is set without {ENV_RING}"));
            }
        }
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
    let pin_dir = env(ENV_PIN_DIR).ok_or_else(|| {
        format!("{ENV_RING}={id} needs {ENV_PIN_DIR}: where this host's `aggbox attach` pinned its maps (e.g. /sys/fs/bpf/aggbox/eth0; `{{rank}}` is replaced by the world rank)")
    })?;
    let algorithm = match env(ENV_ALGORITHM).as_deref() {
        None | Some("auto") => Algorithm::Auto,
        Some("star") => Algorithm::Star,
        Some("ring") => Algorithm::Ring,
        Some(v) => return Err(format!("{ENV_ALGORITHM}={v:?}: one of auto, star, ring")),
    };
    Ok(Some(RingChoice {
        id,
        pin_dir: PathBuf::from(pin_dir.replace("{rank}", &rank.to_string())),
        algorithm,
        threshold: env_parsed(ENV_RING_THRESHOLD)?,
    }))
}

/// The star of MPI_COMM_WORLD's job beside the chosen ring.
pub(crate) fn beside(star: Communicator, choice: &RingChoice, config: &Config) -> Result<StarOrRing<Communicator>, String> {
    let mut ring = RingCommunicator::open(config, choice.id, &choice.pin_dir)
        .map_err(|e| format!("ring {} (pins at {}): {e}", choice.id, choice.pin_dir.display()))?;
    ring.set_deadline(star.config().deadline);
    ring.set_quantization(star.config().quantization);
    let mtu = star.config().mtu;
    let mut chosen = StarOrRing::of(Some(star), Some(ring), Some(mtu))
        .map_err(|e| e.to_string())?
        .with_algorithm(choice.algorithm);
    if let Some(n) = choice.threshold {
        chosen = chosen.with_ring_threshold(n);
    }
    Ok(chosen)
}
