//! What the programs' maps share on the user-space side, written once: the
//! names under which `aggbox attach` pins them (so that `aggbox status`, the
//! metrics endpoint and the tests open them from another process), pinning,
//! per-CPU values summed over CPUs, and the walks over a map's entries.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use libbpf_rs::{MapCore, MapFlags, MapHandle, Object};
use plain::Plain;

use crate::wire::abi;

/// Names of the pinned maps (the BPF objects' own map names), which
/// [`pin_object_maps`] uses as file names; defined in the wire layer, where
/// the runtime reads them too.
pub use crate::wire::map_names as names;

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

/// Every entry of hash map `map` as plain `(key, value)` structs, the one
/// walk over a map's keys: an entry deleted during the walk, or whose key
/// or value is too short for `K` / `V` (which a matching map never
/// returns), is left out.
pub fn entries<K: Plain + Default, V: Plain + Default>(map: &impl MapCore) -> libbpf_rs::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for raw in map.keys() {
        let Some(key) = abi::from_bytes::<K>(&raw) else { continue };
        if let Some(value) = map.lookup(&raw, MapFlags::ANY)?.and_then(|v| abi::from_bytes::<V>(&v)) {
            out.push((key, value));
        }
    }
    Ok(out)
}

/// Every entry of per-CPU hash map `map` as `(key, value summed over
/// CPUs)`, left out as in [`entries`].
pub fn percpu_entries<K: Plain + Default, V: PerCpuSum>(map: &impl MapCore) -> libbpf_rs::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for raw in map.keys() {
        let Some(key) = abi::from_bytes::<K>(&raw) else { continue };
        if let Some(value) = lookup_percpu_sum(map, &raw)? {
            out.push((key, value));
        }
    }
    Ok(out)
}

/// Delete every entry of hash map `map` whose key (a `K`) `pick` chooses;
/// one deleted meanwhile is fine ([`delete_if_present`]).
pub fn delete_where<K: Plain + Default>(map: &impl MapCore, pick: impl Fn(&K) -> bool) -> libbpf_rs::Result<()> {
    // The keys first: deleting while walking would restart the walk.
    let keys: Vec<Vec<u8>> = map.keys().filter(|k| abi::from_bytes::<K>(k).is_some_and(|k| pick(&k))).collect();
    for k in keys {
        delete_if_present(map, &k)?;
    }
    Ok(())
}

/// Up to `limit` keys of the map behind `fd` (a descriptor without a
/// libbpf map object: the user-space path's duplicated ones), in the
/// kernel's order; the walk ends at the last key or at an error.
pub fn raw_keys<K: Plain + Default>(fd: BorrowedFd<'_>, limit: usize) -> Vec<K> {
    let mut out: Vec<K> = Vec::new();
    let mut next = K::default();
    while out.len() < limit {
        let prev: *const std::ffi::c_void = match out.last() {
            None => std::ptr::null(),
            Some(key) => (key as *const K).cast(),
        };
        // SAFETY: prev is null or a live key; next is a live key buffer,
        // both of the map's key size (K is the map's key struct).
        let rc = unsafe { libbpf_sys::bpf_map_get_next_key(fd.as_raw_fd(), prev, (&mut next as *mut K).cast()) };
        if rc != 0 {
            break;
        }
        out.push(std::mem::take(&mut next));
    }
    out
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
/// bpffs); the object's internal maps (`.bss`, `.rodata`, `.data`) and the
/// maps named in `skip` (another object's, handed to this one at load and
/// pinned with that one) are skipped. The XDP objects' and the TC
/// object's names do not collide (TC's are `bcast_*`), so all pin into one
/// directory.
pub fn pin_object_maps(object: &Object, dir: &Path, skip: &[&str]) -> Result<(), PinError> {
    for map in object.maps() {
        let name = map.name().to_string_lossy().into_owned();
        let internal = name.starts_with('.') || name.contains(".bss") || name.contains(".rodata") || name.contains(".data");
        if internal || skip.contains(&name.as_str()) {
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
/// Bytes of values written per `BPF_MAP_UPDATE_BATCH` call, at most (ring
/// data values are up to 64 KiB each).
const RESET_BATCH_BYTES: usize = 4 << 20;

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
                if map.key_size() != 4 {
                    return Err(unsupported("array with a key that is not 4 bytes"));
                }
                zero_array_range(&map, 0, map.max_entries()).map_err(fail)?;
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

/// Zero entries `first .. first + count` of an array map (4-byte keys), a
/// batch of at most [`RESET_BATCH`] entries and [`RESET_BATCH_BYTES`] a
/// syscall.
pub fn zero_array_range(map: &impl MapCore, first: u32, count: u32) -> libbpf_rs::Result<()> {
    let value_size = map.value_size() as usize;
    let batch = RESET_BATCH.min((RESET_BATCH_BYTES / value_size.max(1)).max(1) as u32).min(count.max(1));
    let zeros = vec![0u8; value_size * batch as usize];
    let end = first.saturating_add(count);
    let mut next = first;
    while next < end {
        let n = batch.min(end - next);
        let keys: Vec<u8> = (next..next + n).flat_map(u32::to_ne_bytes).collect();
        map.update_batch(&keys, &zeros[..value_size * n as usize], n, MapFlags::ANY, MapFlags::ANY)?;
        next += n;
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
