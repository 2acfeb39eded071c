//! What the programs' maps share on the user-space side, written once: the
//! names under which `aggbox attach` pins them (so that `aggbox status`, the
//! metrics endpoint and the tests open them from another process), pinning,
//! and per-CPU values summed over CPUs.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use libbpf_rs::{MapCore, MapFlags, MapHandle, Object};
use plain::Plain;

use crate::wire::abi;

/// Names of the pinned maps that other processes open by name: the BPF
/// objects' own map names (src/bpf/xdp_maps.h, src/bpf/tc_maps.h), which
/// [`pin_object_maps`] uses as file names.
pub mod names {
    /// Per-CPU counters by outcome and drop reason (`abi::Stat`).
    pub const STATS: &str = "stats";
    /// The jobs array (`abi::Job`), indexed by dense job index.
    pub const JOBS: &str = "jobs";
    /// Rank addresses and weights (`abi::Rank`), dense · MAX_RANKS + rank.
    pub const RANKS: &str = "ranks";
    /// Per-job progress (`abi::JobState`).
    pub const JOB_STATE: &str = "job_state";
    /// Per-CPU per-job counters (`abi::JobStats`).
    pub const JOB_STATS: &str = "job_stats";
    /// Pool blocks held by slots (one `u64`).
    pub const BLOCKS_USED: &str = "blocks_used";
    /// Per-CPU counters of hand-offs to user space, by reason (`abi::Stat`).
    pub const HANDOFF_STATS: &str = "handoff_stats";
    /// Per-CPU broadcast counters (`abi::Stat`), TC object.
    pub const BCAST_STATS: &str = "bcast_stats";
    /// Per-CPU per-group broadcast counters (`abi::BcastGroupStat`), TC object.
    pub const BCAST_GSTATS: &str = "bcast_gstats";
    /// Broadcast tables (`abi::GroupKey` → `abi::Group`), TC object.
    pub const BCAST_GROUPS: &str = "bcast_groups";
    /// The next-hop cache (`abi::NeighKey` → `abi::Neigh`, then a timer), TC object.
    pub const BCAST_NEIGH: &str = "bcast_neigh";
    /// Node-wide broadcast settings (`abi::BcastConfig`), TC object.
    pub const BCAST_CONFIG: &str = "bcast_config";
    /// Routes of RESULT datagrams (`abi::JobKey` → `abi::ResultRoute`), TC object.
    pub const RESULT_ROUTES: &str = "result_routes";
    /// Jobs listening on each UDP port (`abi::Port`), indexed by port.
    pub const PORTS: &str = "ports";
    /// Job id → 1 + the job's dense index (0: not configured).
    pub const JOB_INDEX: &str = "job_index";
    /// The user-space path's state of each job (`abi::JobHandoff`).
    pub const JOB_HANDOFF: &str = "job_handoff";
    /// Per job (dense index): whether the hash-map path has made a
    /// `slot_owner` record for it yet.
    pub const JOB_PATHS: &str = "job_paths";
    /// Per job (dense index): the newest round the kernel completed, on a
    /// cache line of its own for the stale-round rule.
    pub const JOB_ROUND: &str = "job_round";
    /// The tail-call program array of the multi-buffer chain.
    pub const PROGS: &str = "progs";
    /// The slot pool (`abi::SlotKey` → slot header).
    pub const SLOTS: &str = "slots";
    /// Indexes of the unused accumulator blocks (a stack).
    pub const FREE_BLOCKS: &str = "free_blocks";
    /// Markers of completed slots (`abi::SlotKey`, an LRU hash).
    pub const COMPLETED: &str = "completed";
    /// Which path serves a slot (`abi::SlotKey` → `abi::SlotOwner`).
    pub const SLOT_OWNER: &str = "slot_owner";
    /// The fast-slot regions of the jobs (docs/DATAPLANE.md "Fast slots").
    pub const FAST_SLOTS: &str = "fast_slots";
    /// Per-CPU fast-slot counters (`abi::FAST_*`).
    pub const FAST_STATS: &str = "fast_stats";
    /// Ring port → 1 + dense ring index (docs/RING.md).
    pub const RING_PORTS: &str = "ring_ports";
    /// Ring id → 1 + dense ring index.
    pub const RING_INDEX: &str = "ring_index";
    /// Per ring (dense index): `abi::RingJob`.
    pub const RING_JOBS: &str = "ring_jobs";
    /// Ring members' addresses (`abi::Rank`), dense · MAX_RANKS + member.
    pub const RING_MEMBERS: &str = "ring_members";
    /// The rings' fragments (mmapable): input, then result.
    pub const RING_DATA: &str = "ring_data";
    /// Per fragment (mmapable): `abi::RingDone`.
    pub const RING_DONE: &str = "ring_done";
    /// Per ring (mmapable): `abi::RingCtrl`.
    pub const RING_CTRL: &str = "ring_ctrl";
    /// Per-CPU per-ring counters (`abi::RingStats`).
    pub const RING_STATS: &str = "ring_stats";
    /// AF_XDP sockets by RX queue (XSKMAP).
    pub const XSKS: &str = "xsks";
    /// The longest frame redirected to an AF_XDP socket (0: no limit).
    pub const XSK_LIMITS: &str = "xsk_limits";
}

/// One counter pair of a stats map (`abi::Stat`), summed over CPUs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    /// Datagrams (or, for the broadcast's copy counters, copies).
    pub packets: u64,
    /// UDP payload bytes (0 where the event has no UDP datagram of its own).
    pub bytes: u64,
}

impl From<abi::Stat> for Counter {
    fn from(s: abi::Stat) -> Counter {
        Counter { packets: s.packets, bytes: s.bytes }
    }
}

/// A per-CPU map value: summed over CPUs to give the map's total.
pub trait PerCpuSum: Plain + Default {
    /// Add one CPU's value into this one.
    fn add_cpu(&mut self, other: &Self);
}

impl PerCpuSum for u64 {
    fn add_cpu(&mut self, other: &Self) {
        *self += other;
    }
}

impl PerCpuSum for abi::Stat {
    fn add_cpu(&mut self, other: &Self) {
        self.packets += other.packets;
        self.bytes += other.bytes;
    }
}

impl PerCpuSum for abi::RingStats {
    fn add_cpu(&mut self, other: &Self) {
        for (a, b) in self.count.iter_mut().zip(other.count.iter()) {
            *a += b;
        }
    }
}

impl PerCpuSum for abi::JobStats {
    fn add_cpu(&mut self, other: &Self) {
        self.add(other);
    }
}

impl PerCpuSum for abi::BcastGroupStat {
    fn add_cpu(&mut self, other: &Self) {
        self.datagrams += other.datagrams;
        self.copies += other.copies;
        self.neigh_misses += other.neigh_misses;
        self.bytes += other.bytes;
    }
}

/// The sum over CPUs of one per-CPU lookup's values (a value too short for
/// `V`, which a matching map never returns, counts as zero).
pub fn sum_percpu<V: PerCpuSum>(per_cpu: &[Vec<u8>]) -> V {
    let mut total = V::default();
    for raw in per_cpu {
        if let Some(v) = abi::from_bytes::<V>(raw) {
            total.add_cpu(&v);
        }
    }
    total
}

/// Entry `key` of per-CPU map `map`, summed over CPUs; `None` when absent.
pub fn lookup_percpu_sum<V: PerCpuSum>(map: &impl MapCore, key: &[u8]) -> libbpf_rs::Result<Option<V>> {
    Ok(map.lookup_percpu(key, MapFlags::ANY)?.map(|per_cpu| sum_percpu(&per_cpu)))
}

/// Entry `index` of a per-CPU array map, summed over CPUs (zero when the
/// index is past the array).
pub fn percpu_array_sum<V: PerCpuSum>(map: &impl MapCore, index: u32) -> libbpf_rs::Result<V> {
    Ok(lookup_percpu_sum(map, &index.to_ne_bytes())?.unwrap_or_default())
}

/// Open map `name` pinned in the pin directory `dir`.
pub fn open_pinned(dir: &Path, name: &str) -> libbpf_rs::Result<MapHandle> {
    MapHandle::from_pinned_path(dir.join(name))
}

/// A pin that could not be made.
#[derive(Debug, thiserror::Error)]
#[error("pinning {}: {source}", path.display())]
pub struct PinError {
    /// Where the pin was to go.
    pub path: PathBuf,
    /// What the kernel answered.
    pub source: io::Error,
}

/// Pin the BPF object behind `fd` (map, program or link) at `path`, which
/// must be on a bpffs and not exist yet.
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> Result<(), PinError> {
    let fail = |source| PinError { path: path.to_path_buf(), source };
    let cpath = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| fail(io::Error::new(io::ErrorKind::InvalidInput, "NUL in path")))?;
    // SAFETY: a valid fd and a NUL-terminated path.
    let rc = unsafe { libbpf_sys::bpf_obj_pin(fd.as_raw_fd(), cpath.as_ptr()) };
    if rc < 0 {
        return Err(fail(io::Error::from_raw_os_error(-rc)));
    }
    Ok(())
}

/// A hash map of `u32` keys and `value_size`-byte values that user space
/// creates for its own counters (the node's services), pinned as
/// `dir/name` so that `aggbox status` and the metrics read it.
pub fn create_pinned_counters(dir: &Path, name: &str, value_size: u32, max_entries: u32) -> anyhow::Result<MapHandle> {
    let opts = libbpf_sys::bpf_map_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
        ..Default::default()
    };
    let map = MapHandle::create(libbpf_rs::MapType::Hash, Some(name), 4, value_size, max_entries, &opts)
        .map_err(|e| anyhow::anyhow!("creating the {name} map: {e}"))?;
    pin(map.as_fd(), &dir.join(name))?;
    Ok(map)
}

/// Pin every map of `object` as `dir/<map name>` (`dir` must exist on a
/// bpffs); the object's internal maps (`.bss`, `.rodata`, `.data`) are
/// skipped. The XDP and TC objects' names do not collide (TC's are
/// `bcast_*`), so both pin into one directory.
pub fn pin_object_maps(object: &Object, dir: &Path) -> Result<(), PinError> {
    for map in object.maps() {
        let name = map.name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.contains(".bss") || name.contains(".rodata") || name.contains(".data") {
            continue;
        }
        pin(map.as_fd(), &dir.join(&name))?;
    }
    Ok(())
}

/// Why [`reset_object_maps`] could not return a map to its state at load.
#[derive(Debug, thiserror::Error)]
#[error("resetting map `{map}`: {source}")]
pub struct ResetError {
    /// Name of the map.
    pub map: String,
    /// What libbpf answered.
    #[source]
    pub source: libbpf_rs::Error,
}

/// Array entries written per `BPF_MAP_UPDATE_BATCH` call: bounds the zeroed
/// buffer (the largest arrays hold tens of MiB) without one syscall per entry.
const RESET_BATCH: u32 = 1024;

/// Return every map of `object` to its state right after load: hash and LRU
/// maps emptied, arrays and per-CPU arrays zeroed, stacks and queues drained,
/// program and XSK arrays cleared (their owner refills the program arrays).
/// `.rodata` and `.kconfig` are frozen and left alone; a writable global
/// section (`.bss`, `.data`) has initial values this cannot know, so an
/// object with one is refused, as is a map type not listed here.
pub fn reset_object_maps(object: &Object) -> Result<(), ResetError> {
    use libbpf_rs::MapType;
    for map in object.maps() {
        let name = map.name().to_string_lossy().into_owned();
        if name.contains(".rodata") || name.contains(".kconfig") {
            continue;
        }
        let fail = |source| ResetError { map: name.clone(), source };
        let unsupported = |what: &str| ResetError {
            map: name.clone(),
            source: libbpf_rs::Error::from(io::Error::new(io::ErrorKind::Unsupported, what.to_string())),
        };
        if name.starts_with('.') || name.contains(".bss") || name.contains(".data") {
            return Err(unsupported("writable global section: its initial values are not known here"));
        }
        match map.map_type() {
            MapType::Hash | MapType::LruHash | MapType::PercpuHash | MapType::LruPercpuHash => {
                let keys: Vec<Vec<u8>> = map.keys().collect();
                for key in keys {
                    delete_if_present(&map, &key).map_err(fail)?;
                }
            }
            MapType::Array => {
                let (key_size, value_size) = (map.key_size() as usize, map.value_size() as usize);
                if key_size != 4 {
                    return Err(unsupported("array with a key that is not 4 bytes"));
                }
                let entries = map.max_entries();
                let zeros = vec![0u8; value_size * RESET_BATCH as usize];
                let mut first = 0;
                while first < entries {
                    let count = RESET_BATCH.min(entries - first);
                    let keys: Vec<u8> = (first..first + count).flat_map(u32::to_ne_bytes).collect();
                    map.update_batch(&keys, &zeros[..value_size * count as usize], count, MapFlags::ANY, MapFlags::ANY)
                        .map_err(fail)?;
                    first += count;
                }
            }
            MapType::PercpuArray => {
                let ncpu = libbpf_rs::num_possible_cpus().map_err(fail)?;
                let zero = vec![vec![0u8; map.value_size() as usize]; ncpu];
                for index in 0..map.max_entries() {
                    map.update_percpu(&index.to_ne_bytes(), &zero, MapFlags::ANY).map_err(fail)?;
                }
            }
            MapType::Stack | MapType::Queue => while map.lookup_and_delete(&[]).map_err(fail)?.is_some() {},
            MapType::ProgArray | MapType::Xskmap => {
                for index in 0..map.max_entries() {
                    delete_if_present(&map, &index.to_ne_bytes()).map_err(fail)?;
                }
            }
            other => return Err(unsupported(&format!("map type {other:?}: no reset known"))),
        }
    }
    Ok(())
}

/// Delete `key`, which may already be gone (an LRU eviction, an empty
/// index, a job's entry removed before): the one rule for every map owner.
pub fn delete_if_present(map: &impl MapCore, key: &[u8]) -> libbpf_rs::Result<()> {
    match map.delete(key) {
        Err(e) if e.kind() == libbpf_rs::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
