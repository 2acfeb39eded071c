//! The dataplane loader: opens and loads the AggBox XDP skeleton, attaches it
//! to an interface, writes job configuration into its maps and reads its
//! counters back.
//!
//! Map layout (see `src/bpf/aggbox_xdp.bpf.c` and `docs/DATAPLANE.md`):
//!
//! | map     | key                       | value                  | written by |
//! |---------|---------------------------|------------------------|------------|
//! | `ports` (array) | `u32` UDP port    | [`abi::Port`]          | control plane |
//! | `job_index` (array) | `u32` job id  | `u32` 1 + dense index, 0 = none | control plane |
//! | `jobs` (array) | `u32` dense index  | [`abi::Job`]           | control plane |
//! | `ranks` (array) | `u32` dense · 256 + rank | [`abi::Rank`]   | control plane |
//! | `stats` | `u32` outcome index       | [`abi::Stat`] per CPU  | XDP |
//! | `job_state` (array) | `u32` dense index | [`abi::JobState`]  | control plane zeroes, XDP updates |
//! | `job_round`, `job_paths` (arrays) | `u32` dense index | BPF-only (`src/bpf/slot.h`) | XDP; control plane zeroes |
//! | `fast_slots` (array) | `u32` slot index | BPF-only fast slot (`src/bpf/slot.h`) | XDP; control plane zeroes a region |
//! | `fast_stats` | `u32` `abi::FAST_*`  | `u64` per CPU          | XDP |
//! | `slots` | [`abi::SlotKey`]          | slot header (BPF-only, `src/bpf/slot.h`) | XDP |
//! | `blocks` | (SlotKey, chunk index)   | one chunk of s64 accumulators (BPF-only) | XDP |
//! | `completed` | [`abi::SlotKey`]      | `u32` marker (LRU)     | XDP |
//! | `progs` | `u32` `abi::CALL_*`       | program fd             | control plane, once at load |
//! | `scratch`, `slot_init` | `u32` 0    | per-CPU scratch        | XDP |
//! | `xsks`  | `u32` RX queue            | AF_XDP socket fd (XSKMAP) | user-space path |
//! | `xsk_limits` | `u32` 0              | `u32` longest frame redirected (0 = any) | user-space path |
//! | `slot_owner` | [`abi::SlotKey`]     | [`abi::SlotOwner`]     | XDP decides, the completing path deletes |
//! | `job_handoff` (array) | `u32` dense index | [`abi::JobHandoff`] | user-space path |
//! | `handoff_stats` | `u32` reason      | [`abi::Stat`] per CPU  | XDP |
//! | `job_stats` (per-CPU array) | `u32` dense index | [`abi::JobStats`] | control plane zeroes, XDP counts |
//!
//! Errors inside this module are typed ([`XdpError`]); callers at the
//! edges may wrap them in `anyhow`.

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject};

use crate::wire::abi::{self, Round};
use crate::kernel::maps::{self, names, Counter};

#[allow(clippy::all, missing_docs, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/aggbox_xdp.skel.rs"));
}
use skel::{AggboxXdpSkel, AggboxXdpSkelBuilder};

/// Errors of the dataplane loader.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    /// Opening, loading or verifying the BPF object failed.
    #[error("loading the XDP program: {0}")]
    Load(#[source] libbpf_rs::Error),
    /// A map operation failed.
    #[error("map `{map}`: {source}")]
    Map {
        /// Name of the map.
        map: &'static str,
        /// The libbpf error.
        #[source]
        source: libbpf_rs::Error,
    },
    /// Attaching the XDP program to the interface failed in every mode tried.
    #[error("attaching XDP to ifindex {ifindex}: {source}")]
    Attach {
        /// Interface index.
        ifindex: u32,
        /// Last OS error.
        #[source]
        source: std::io::Error,
    },
    /// The chain override ([`CHAIN_ENV`]) names no chain.
    #[error("choosing the XDP chain: {0}")]
    Chain(String),
    /// A job configuration was rejected before touching any map.
    #[error("job {job}: {reason}")]
    InvalidJob {
        /// Job id.
        job: u16,
        /// What is wrong.
        reason: String,
    },
    /// BPF_PROG_TEST_RUN failed.
    #[error("BPF_PROG_TEST_RUN: {0}")]
    TestRun(#[source] libbpf_rs::Error),
    /// A fast slot stayed locked through every try of the control plane.
    #[error("fast slot {index}: its lock stayed held through {FAST_DISCARD_TRIES} tries")]
    FastSlotBusy {
        /// Index in `fast_slots`.
        index: u32,
    },
    /// Pinning failed.
    #[error(transparent)]
    Pin(#[from] maps::PinError),
    /// [`XdpPlane::reset`] could not return a map to its state at load.
    #[error(transparent)]
    Reset(#[from] maps::ResetError),
}

/// Result type of this module.
pub type Result<T, E = XdpError> = std::result::Result<T, E>;

/// How the XDP program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// Driver (native) mode, `XDP_FLAGS_DRV_MODE`.
    Native,
    /// Generic (skb) mode, `XDP_FLAGS_SKB_MODE`: works everywhere, slower.
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Native => libbpf_sys::XDP_FLAGS_DRV_MODE,
            XdpMode::Generic => libbpf_sys::XDP_FLAGS_SKB_MODE,
        }
    }
}

/// A BPF link holding the XDP program on an interface; detaches when dropped
/// (unless pinned).
#[derive(Debug)]
pub struct XdpLink {
    fd: OwnedFd,
    ifindex: u32,
    mode: XdpMode,
}

impl XdpLink {
    /// The mode the program ended up attached in.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }

    /// Interface index the link is attached to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Pin the link to a bpffs path so it outlives this process.
    pub fn pin(&self, path: &Path) -> Result<()> {
        Ok(maps::pin(self.fd.as_fd(), path)?)
    }

    /// Detach now (same as dropping the link, but explicit).
    pub fn detach(self) -> Result<()> {
        // SAFETY: plain syscall wrapper on a link fd we own.
        let rc = unsafe { libbpf_sys::bpf_link_detach(self.fd.as_raw_fd()) };
        if rc < 0 {
            return Err(XdpError::Attach {
                ifindex: self.ifindex,
                source: std::io::Error::from_raw_os_error(-rc),
            });
        }
        Ok(())
    }
}

impl AsFd for XdpLink {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One aggregation job as the control plane configures it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XdpJob {
    /// Job id (the AGG1 `job` field).
    pub id: u16,
    /// UDP port the contributions arrive on.
    pub port: u16,
    /// Local UDP port RESULT datagrams are delivered to.
    pub result_port: u16,
    /// IPv4 source address of each rank; rank i sends from `ranks[i]`.
    /// Its length is the number of workers (1..=[`abi::MAX_RANKS`]).
    pub ranks: Vec<Ipv4Addr>,
    /// Weight of each rank for SUM/AVG; empty means all 1. Each weight must
    /// satisfy `|w| <= abi::MAX_WEIGHT` and the sum must be positive.
    pub weights: Vec<i32>,
    /// Vector length; `frag_off + count` beyond it is rejected. 0 = unbounded.
    pub vector_len: u32,
    /// Bound on outstanding slots of this job; 0 = the build's maximum.
    pub slots: u32,
    /// `abi::JOB_F_*` flags.
    pub flags: u32,
    /// Broadcast group RESULTs also go to, if any.
    pub result_group: Option<u16>,
    /// Rounds older than the newest completed round minus `window` are
    /// stale; 0 = the build's default (`abi::ROUND_WINDOW`).
    pub window: u32,
    /// Elements of a full fragment as the job's senders cut them (their
    /// path MTU's, `(MTU - 52) / 4`); 0 = unknown. The fast slots index a
    /// round in steps of it ([`fast_granule`]): a fragment of fewer
    /// elements may share its fast slot with its neighbour, and that one
    /// takes the hash-map chain (same results, more work).
    pub frag_elems: u32,
}

/// Elements of a round that share one fast-slot index for a job whose
/// senders cut fragments of `frag_elems` elements (0 = unknown): that size
/// where a fast slot holds it, so consecutive fragments take consecutive
/// slots; otherwise [`abi::FAST_GRANULE`], which gives every fragment of
/// 256..=[`abi::FAST_ELEMS`] elements its own.
pub fn fast_granule(frag_elems: u32) -> u16 {
    if (1..=abi::FAST_ELEMS).contains(&frag_elems) {
        frag_elems as u16
    } else {
        abi::FAST_GRANULE as u16
    }
}

impl XdpJob {
    /// The weight of each rank (defaults applied).
    pub fn effective_weights(&self) -> Vec<i32> {
        if self.weights.is_empty() {
            vec![1; self.ranks.len()]
        } else {
            self.weights.clone()
        }
    }

    pub(crate) fn validate(&self) -> Result<abi::Job> {
        let bad = |reason: String| XdpError::InvalidJob {
            job: self.id,
            reason,
        };
        let workers = self.ranks.len();
        if workers == 0 || workers > abi::MAX_RANKS as usize {
            return Err(bad(format!(
                "{workers} ranks; a job has 1..={} ranks",
                abi::MAX_RANKS
            )));
        }
        if !self.weights.is_empty() && self.weights.len() != workers {
            return Err(bad(format!(
                "{} weights for {workers} ranks",
                self.weights.len()
            )));
        }
        let weights = self.effective_weights();
        if let Some(w) = weights
            .iter()
            .find(|w| w.unsigned_abs() > abi::MAX_WEIGHT as u32)
        {
            return Err(bad(format!(
                "weight {w} outside -{max}..={max}",
                max = abi::MAX_WEIGHT
            )));
        }
        let sum: i64 = weights.iter().map(|&w| i64::from(w)).sum();
        if sum <= 0 {
            return Err(bad(format!(
                "weights sum to {sum}; the AVG divisor must be positive"
            )));
        }
        if self.port == 0 {
            return Err(bad("port 0".to_string()));
        }
        Ok(abi::Job {
            port: self.port,
            result_port: self.result_port,
            workers: workers as u16,
            result_group: self.result_group.unwrap_or(abi::NO_GROUP),
            vector_len: self.vector_len,
            slots: self.slots,
            flags: self.flags,
            weight_sum: sum as u32,
            window: self.window,
            fast_base: 0,
            fast_slots: 0,
            id: self.id,
            fast_granule: fast_granule(self.frag_elems),
            fast_stride: 0,
        })
    }
}

/// Snapshot of the `stats` map, summed over CPUs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Counters of the non-drop outcomes, keyed by their label.
    pub outcomes: BTreeMap<&'static str, Counter>,
    /// Counters of the drop reasons, keyed by their label.
    pub drops: BTreeMap<&'static str, Counter>,
}

impl Stats {
    /// Counter of one outcome.
    pub fn outcome(&self, outcome: abi::Outcome) -> Counter {
        self.outcomes
            .get(outcome.label())
            .copied()
            .unwrap_or_default()
    }

    /// Counter of one drop reason.
    pub fn drop(&self, reason: abi::DropReason) -> Counter {
        self.drops.get(reason.label()).copied().unwrap_or_default()
    }

    /// Packets of every drop reason together.
    pub fn dropped_packets(&self) -> u64 {
        self.drops.values().map(|c| c.packets).sum()
    }

    /// Packets of every outcome and drop reason together.
    pub fn total_packets(&self) -> u64 {
        self.outcomes.values().map(|c| c.packets).sum::<u64>() + self.dropped_packets()
    }
}

/// Which build of the XDP tail-call chain a [`XdpPlane`] runs. The object
/// carries both (`src/bpf/aggbox_xdp.bpf.c`, docs/JUMBO.md "Kernels without
/// multi-buffer XDP"); only the chosen one is loaded, since a prog array
/// holds programs of one frags flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chain {
    /// Multi-buffer (`xdp.frags`): frames of any size up to 64 KB, payload
    /// through `bpf_xdp_load_bytes`/`store_bytes`, `bpf_loop`. Kernel 5.18+.
    Frags,
    /// Single-buffer frames only (the MTU-bounded mode): direct packet
    /// access, bounded loops, one chunk per program run, datagrams of up to
    /// [`abi::LINEAR_MAX_ELEMS`] elements. Uses only helpers of 5.15.
    Linear,
}

/// Environment variable that overrides [`Chain::detect`] (`frags` or
/// `linear`): to run the linear chain on a kernel that has both.
pub const CHAIN_ENV: &str = "AGGBOX_XDP_CHAIN";

impl Chain {
    /// The chain this kernel can run: [`Chain::Frags`] when XDP programs may
    /// call `bpf_loop`, `bpf_xdp_get_buff_len`, `bpf_xdp_load_bytes` and
    /// `bpf_xdp_store_bytes` (probed with libbpf), else [`Chain::Linear`].
    /// [`CHAIN_ENV`] overrides the probe.
    pub fn detect() -> std::result::Result<Chain, String> {
        if let Some(v) = std::env::var_os(CHAIN_ENV) {
            return match v.to_str() {
                Some("frags") => Ok(Chain::Frags),
                Some("linear") => Ok(Chain::Linear),
                _ => Err(format!("{CHAIN_ENV}={v:?}: expected `frags` or `linear`")),
            };
        }
        let helpers = [
            libbpf_sys::BPF_FUNC_loop,
            libbpf_sys::BPF_FUNC_xdp_get_buff_len,
            libbpf_sys::BPF_FUNC_xdp_load_bytes,
            libbpf_sys::BPF_FUNC_xdp_store_bytes,
        ];
        // SAFETY: plain probe call; a null opts pointer is allowed (libbpf docs).
        let has = |id| unsafe { libbpf_sys::libbpf_probe_bpf_helper(libbpf_sys::BPF_PROG_TYPE_XDP, id, std::ptr::null()) } == 1;
        Ok(if helpers.into_iter().all(has) { Chain::Frags } else { Chain::Linear })
    }

    /// `frags` or `linear`.
    pub fn label(self) -> &'static str {
        match self {
            Chain::Frags => "frags",
            Chain::Linear => "linear",
        }
    }

    /// Largest `count` this chain aggregates (larger datagrams are dropped
    /// as `too_large`).
    pub fn max_elems(self) -> u32 {
        match self {
            Chain::Frags => abi::MAX_ELEMS,
            Chain::Linear => abi::LINEAR_MAX_ELEMS,
        }
    }

    /// Largest interface MTU whose datagrams this chain aggregates whole:
    /// IPv4 + UDP + AGG1 header + `max_elems` elements (capped at 65535).
    pub fn max_mtu(self) -> u32 {
        (20 + 8 + abi::AGG_HDR_LEN as u32 + 4 * self.max_elems()).min(65535)
    }
}

/// How the ring maps are sized when the object loads (docs/RING.md): the
/// fragment size of the node's rings and their fragments together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSizing {
    /// Elements per fragment (`[[ring]] frag_elems`, one for the node).
    pub frag_elems: u32,
    /// `ring_data` / `ring_done` entries: two buffers of fragments a ring
    /// (`RingJob::index`), all rings together.
    pub fragments: u32,
}

impl Default for RingSizing {
    /// No ring: one entry of the default fragment size.
    fn default() -> Self {
        RingSizing {
            frag_elems: crate::config::DEFAULT_RING_FRAG_ELEMS,
            fragments: 1,
        }
    }
}

impl RingSizing {
    /// The sizes the configuration's rings need, and each ring's `base`
    /// (index of its fragment 0 in even rounds) in file order.
    pub fn of(rings: &[crate::config::RingConfig]) -> (RingSizing, Vec<u32>) {
        let mut sizing = RingSizing::default();
        let mut bases = Vec::with_capacity(rings.len());
        let mut next = 0u32;
        for r in rings {
            sizing.frag_elems = r.frag_elems;
            bases.push(next);
            next = next.saturating_add(r.frags().saturating_mul(2));
        }
        sizing.fragments = next.max(1);
        (sizing, bases)
    }
}

/// The loaded AggBox XDP object: programs and maps.
pub struct XdpPlane {
    // Field order matters: the skeleton borrows `_object` and must drop first.
    skel: AggboxXdpSkel<'static>,
    _object: Box<MaybeUninit<OpenObject>>,
    chain: Chain,
}

impl std::fmt::Debug for XdpPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpPlane").finish_non_exhaustive()
    }
}

impl XdpPlane {
    /// Open and load (verify) the XDP skeleton with the chain this kernel
    /// runs ([`Chain::detect`]). Needs root (CAP_BPF).
    pub fn load() -> Result<Self> {
        Self::load_chain(Chain::detect().map_err(XdpError::Chain)?)
    }

    /// Open and load the XDP skeleton with one build of the chain.
    pub fn load_chain(chain: Chain) -> Result<Self> {
        Self::load_chain_with(chain, RingSizing::default())
    }

    /// [`XdpPlane::load_chain`] with the ring maps sized for the
    /// configuration's rings (docs/RING.md: their size is fixed at load).
    pub fn load_chain_with(chain: Chain, rings: RingSizing) -> Result<Self> {
        let mut object: Box<MaybeUninit<OpenObject>> = Box::new(MaybeUninit::uninit());
        // SAFETY: the box's heap allocation never moves and lives as long as
        // `XdpPlane`, whose field order drops the skeleton before the box;
        // no other reference to the allocation is ever created.
        let object_ref: &'static mut MaybeUninit<OpenObject> =
            unsafe { &mut *(object.as_mut() as *mut MaybeUninit<OpenObject>) };
        let mut open = AggboxXdpSkelBuilder::default()
            .open(object_ref)
            .map_err(XdpError::Load)?;
        let frags = chain == Chain::Frags;
        let p = &mut open.progs;
        for (prog, load) in [
            (&mut p.aggbox_xdp, frags),
            (&mut p.aggbox_slot, frags),
            (&mut p.aggbox_add, frags),
            (&mut p.aggbox_result, frags),
            (&mut p.aggbox_xdp_linear, !frags),
            (&mut p.aggbox_slot_linear, !frags),
            (&mut p.aggbox_add_linear, !frags),
            (&mut p.aggbox_result_linear, !frags),
            (&mut p.aggbox_ring, frags),
            (&mut p.aggbox_ring_linear, !frags),
        ] {
            prog.set_autoload(load);
        }
        let ring_map = |source| XdpError::Map {
            map: names::RING_DATA,
            source,
        };
        open.maps
            .ring_data
            .set_value_size(4 * rings.frag_elems)
            .map_err(ring_map)?;
        open.maps
            .ring_data
            .set_max_entries(rings.fragments.max(1))
            .map_err(ring_map)?;
        open.maps
            .ring_done
            .set_max_entries(rings.fragments.max(1))
            .map_err(|source| XdpError::Map {
                map: names::RING_DONE,
                source,
            })?;
        if let Some(rodata) = open.maps.rodata_data.as_deref_mut() {
            rodata.ring_frag_elems = rings.frag_elems;
        }
        let skel = open.load().map_err(XdpError::Load)?;
        let dataplane = XdpPlane {
            skel,
            _object: object,
            chain,
        };
        dataplane.fill_prog_arrays()?;
        dataplane.fill_block_pool()?;
        Ok(dataplane)
    }

    /// Return the plane to its state right after load (no jobs, rings or
    /// slots, zero counters, a full block pool, the chain's tail calls in
    /// place) without verifying the programs again: a load costs the
    /// verifier's seconds, about a minute under emulation (docs/MATRIX.md),
    /// and the BPF tests reuse loaded planes through this
    /// (`tests/bpf_common`). Nothing may run the programs meanwhile: the
    /// plane must not be attached.
    pub fn reset(&self) -> Result<()> {
        use libbpf_rs::skel::Skel;
        maps::reset_object_maps(self.skel.object())?;
        self.fill_prog_arrays()?;
        self.fill_block_pool()
    }

    /// Put every index of the `blocks` array into the `free_blocks` stack
    /// (the one place that does it, before any program runs): the XDP
    /// programs take a slot's blocks from it and give them back.
    fn fill_block_pool(&self) -> Result<()> {
        let stack = &self.skel.maps.free_blocks;
        for index in 0..abi::MAX_BLOCKS {
            stack
                .update(&[], &index.to_ne_bytes(), MapFlags::ANY)
                .map_err(|source| XdpError::Map {
                    map: names::FREE_BLOCKS,
                    source,
                })?;
        }
        Ok(())
    }

    /// Fill the tail-call program array `progs` (the one place that does
    /// it): index `abi::CALL_*` -> the chain's programs.
    fn fill_prog_arrays(&self) -> Result<()> {
        let [entry, slot, add, result, ring] = self.chain_programs();
        let chain = [
            (abi::CALL_SLOT, slot.1),
            (abi::CALL_ADD, add.1),
            (abi::CALL_RESULT, result.1),
            (abi::CALL_ENTRY, entry.1),
            (abi::CALL_RING, ring.1),
        ];
        debug_assert_eq!(chain.len() as u32, abi::CALL_MAX);
        for (index, fd) in chain {
            self.chain_prog_array()
                .update(
                    &index.to_ne_bytes(),
                    &(fd as u32).to_ne_bytes(),
                    MapFlags::ANY,
                )
                .map_err(|source| XdpError::Map {
                    map: names::PROGS,
                    source,
                })?;
        }
        Ok(())
    }

    /// Remove program `index` (`abi::CALL_*`) from the tail-call array.
    /// Fault injection for tests: every datagram reaching that stage is then
    /// dropped and counted as `missed_tail_call`.
    pub fn unset_tail_call(&self, index: u32) -> Result<()> {
        delete_ignore_missing(self.chain_prog_array(), names::PROGS, &index.to_ne_bytes())
    }

    /// Attach the XDP entry program to `ifindex` with a BPF link. In
    /// [`XdpMode::Native`] a driver without native XDP falls back to generic
    /// mode; the second value then carries a warning to show the operator.
    pub fn attach_xdp(&self, ifindex: u32, mode: XdpMode) -> Result<(XdpLink, Option<String>)> {
        match self.link_xdp(ifindex, mode) {
            Ok(link) => Ok((link, None)),
            Err(native_err) if mode == XdpMode::Native => {
                let link = self
                    .link_xdp(ifindex, XdpMode::Generic)
                    .map_err(|source| XdpError::Attach { ifindex, source })?;
                let warning = format!("native XDP unavailable on ifindex {ifindex} ({native_err}); attached in generic mode");
                Ok((link, Some(warning)))
            }
            Err(source) => Err(XdpError::Attach { ifindex, source }),
        }
    }

    fn link_xdp(&self, ifindex: u32, mode: XdpMode) -> std::io::Result<XdpLink> {
        let prog_fd = self.xdp_prog_fd().as_raw_fd();
        // SAFETY: zeroed opts are valid; sz set as libbpf requires.
        let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _;
        opts.flags = mode.flags();
        // SAFETY: valid program fd, opts initialised above.
        let fd = unsafe {
            libbpf_sys::bpf_link_create(prog_fd, ifindex as i32, libbpf_sys::BPF_XDP, &opts)
        };
        if fd < 0 {
            return Err(std::io::Error::from_raw_os_error(-fd));
        }
        // SAFETY: the kernel just returned this fd to us; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(XdpLink { fd, ifindex, mode })
    }

    /// Configure (or reconfigure) job `id`: writes its ranks, the job and its
    /// port. `id` must equal `job.id`.
    pub fn set_job(&self, id: u16, job: &XdpJob) -> Result<()> {
        if id != job.id {
            return Err(XdpError::InvalidJob {
                job: id,
                reason: format!("config carries id {}", job.id),
            });
        }
        let mut value = job.validate()?;
        value.id = id;
        let old = self.job(id)?;
        let dense = match self.job_index(id)? {
            Some(dense) => dense,
            None => self.free_job_index().ok_or_else(|| XdpError::InvalidJob {
                job: id,
                reason: format!("{} jobs are configured already (the most a node serves)", abi::MAX_JOBS),
            })?,
        };
        (value.fast_base, value.fast_slots, value.fast_stride, value.fast_granule) = self.fast_region(id, &value, old.as_ref())?;
        // The old membership (address and weight of each rank), to tell a
        // membership change from a reconfiguration that keeps it.
        let old_ranks: Vec<Option<abi::Rank>> = match &old {
            Some(o) => (0..o.workers).map(|rank| self.rank(id, rank)).collect::<Result<_>>()?,
            None => Vec::new(),
        };
        if old.is_none() {
            // A new job starts from zero state and counters at its index
            // (a reconfigured job keeps its slots and counters).
            self.zero_job_entries(dense)?;
        }

        // Ranks first, so that the job never points at missing ranks.
        for (rank, (addr, weight)) in job.ranks.iter().zip(job.effective_weights()).enumerate() {
            let rval = abi::Rank {
                addr: u32::from_ne_bytes(addr.octets()),
                weight,
            };
            self.write_rank(dense, rank as u16, &rval)?;
        }
        update_array(&self.skel.maps.jobs, names::JOBS, dense, &value)?;
        // Published last: a datagram finds the index only once its job,
        // ranks and state are in place.
        update_array(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id), &(dense + 1))?;

        match old {
            Some(old) if old.port == value.port => {}
            Some(old) => {
                self.port_add(value.port, 1)?;
                self.port_add(old.port, -1)?;
            }
            None => self.port_add(value.port, 1)?,
        }
        if let Some(old) = old {
            for rank in value.workers..old.workers {
                self.write_rank(dense, rank, &abi::Rank::default())?;
            }
            let new_ranks: Vec<Option<abi::Rank>> = job
                .ranks
                .iter()
                .zip(job.effective_weights())
                .map(|(addr, weight)| {
                    Some(abi::Rank {
                        addr: u32::from_ne_bytes(addr.octets()),
                        weight,
                    })
                })
                .collect();
            if new_ranks != old_ranks {
                // Membership changed: the rounds in flight hold contributions
                // (and rank bits, and a worker count) of the old membership.
                // Release them, so that none of it can complete or be mixed
                // into a round of the new membership.
                self.discard_job_slots(id)?;
                if old.fast_slots == value.fast_slots && old.fast_base == value.fast_base {
                    self.discard_fast_slots(id, value.fast_base, value.fast_slots)?;
                }
            }
        }
        Ok(())
    }

    /// Job `id`'s dense index (its entry in `jobs`, `ranks`, `job_state`,
    /// `job_handoff`, `job_stats`), if configured.
    fn job_index(&self, id: u16) -> Result<Option<u32>> {
        Ok(lookup_array::<u32>(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id))?
            .filter(|&v| v != 0 && v <= abi::MAX_JOBS)
            .map(|v| v - 1))
    }

    /// The first dense index no configured job holds.
    fn free_job_index(&self) -> Option<u32> {
        let used: Vec<u32> = self.jobs().unwrap_or_default().into_iter().map(|(dense, _)| dense).collect();
        (0..abi::MAX_JOBS).find(|d| !used.contains(d))
    }

    /// Every configured job as (dense index, job), in dense order.
    pub fn jobs(&self) -> Result<Vec<(u32, abi::Job)>> {
        let mut out = Vec::new();
        for dense in 0..abi::MAX_JOBS {
            if let Some(job) = lookup_array::<abi::Job>(&self.skel.maps.jobs, names::JOBS, dense)? {
                if job.workers != 0 {
                    out.push((dense, job));
                }
            }
        }
        Ok(out)
    }

    fn write_rank(&self, dense: u32, rank: u16, value: &abi::Rank) -> Result<()> {
        update_array(&self.skel.maps.ranks, names::RANKS, dense * abi::MAX_RANKS + u32::from(rank), value)
    }

    /// Zero the state, user-space hand-off state, path flags and counters at
    /// `dense`.
    fn zero_job_entries(&self, dense: u32) -> Result<()> {
        update_array(&self.skel.maps.job_state, names::JOB_STATE, dense, &abi::JobState::default())?;
        update_array(&self.skel.maps.job_handoff, names::JOB_HANDOFF, dense, &abi::JobHandoff::default())?;
        update_array(&self.skel.maps.job_paths, names::JOB_PATHS, dense, &0u32)?;
        let zero_round = vec![0u8; self.skel.maps.job_round.value_size() as usize];
        self.skel
            .maps
            .job_round
            .update(&dense.to_ne_bytes(), &zero_round, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: names::JOB_ROUND,
                source,
            })?;
        let map = &self.skel.maps.job_stats;
        let ncpu = libbpf_rs::num_possible_cpus().map_err(|source| XdpError::Map {
            map: names::JOB_STATS,
            source,
        })?;
        let zero = abi::JobStats::default();
        let values: Vec<Vec<u8>> = (0..ncpu).map(|_| abi::as_bytes(&zero).to_vec()).collect();
        map.update_percpu(&dense.to_ne_bytes(), &values, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: names::JOB_STATS,
                source,
            })
    }

    /// Job `id`'s counters (`job_stats`) summed over CPUs; `None` when the
    /// job is not configured.
    pub fn job_stats(&self, id: u16) -> Result<Option<abi::JobStats>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        maps::lookup_percpu_sum(&self.skel.maps.job_stats, &dense.to_ne_bytes()).map_err(|source| XdpError::Map {
            map: names::JOB_STATS,
            source,
        })
    }

    /// Configure ring `dense` (docs/RING.md): its members' addresses
    /// (weights in `job`), its job entry, a zeroed control block, then its
    /// id and port, so a datagram never finds a port whose entries are not
    /// the ring's. The ring's fragments `job.base ..` must exist in
    /// ring_data ([`RingSizing`]).
    pub fn set_ring(&self, dense: u32, job: &abi::RingJob, members: &[std::net::Ipv4Addr]) -> Result<()> {
        if dense >= abi::MAX_RINGS || members.len() != usize::from(job.members) || members.len() > abi::MAX_RANKS as usize {
            return Err(XdpError::Map {
                map: names::RING_JOBS,
                source: libbpf_rs::Error::from(std::io::Error::from(std::io::ErrorKind::InvalidInput)),
            });
        }
        for (i, addr) in members.iter().enumerate() {
            let rank = abi::Rank {
                addr: u32::from(*addr).to_be(),
                weight: 0,
            };
            update_array(&self.skel.maps.ring_members, names::RING_MEMBERS, dense * abi::MAX_RANKS + i as u32, &rank)?;
        }
        update_array(&self.skel.maps.ring_jobs, names::RING_JOBS, dense, job)?;
        update_array(&self.skel.maps.ring_ctrl, names::RING_CTRL, dense, &abi::RingCtrl::default())?;
        update_array(&self.skel.maps.ring_index, names::RING_INDEX, u32::from(job.id), &(dense + 1))?;
        update_array(&self.skel.maps.ring_ports, names::RING_PORTS, u32::from(job.port), &(dense + 1))
    }

    /// Handles of the ring memory maps (`ring_data`, `ring_done`,
    /// `ring_ctrl`), for the node's ring service and tests in this process.
    pub fn ring_memory_maps(&self) -> Result<[libbpf_rs::MapHandle; 3]> {
        let handle = |map: &libbpf_rs::Map<'static>, name: &'static str| {
            libbpf_rs::MapHandle::try_from(map).map_err(|source| XdpError::Map { map: name, source })
        };
        Ok([
            handle(&self.skel.maps.ring_data, names::RING_DATA)?,
            handle(&self.skel.maps.ring_done, names::RING_DONE)?,
            handle(&self.skel.maps.ring_ctrl, names::RING_CTRL)?,
        ])
    }

    /// Put a resolved next hop for ring `dense` into the program's cache, as
    /// if `bpf_fib_lookup` had just answered (it is used for a second):
    /// lets BPF_PROG_TEST_RUN tests, whose frames have no route, see the
    /// forwarded datagram.
    pub fn set_ring_next_hop(&self, dense: u32, dmac: [u8; 6], smac: [u8; 6], ifindex: u32) -> Result<()> {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid clock id and out pointer. bpf_ktime_get_ns is CLOCK_MONOTONIC.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        let mut value = Vec::with_capacity(24);
        value.extend_from_slice(&dmac);
        value.extend_from_slice(&smac);
        value.extend_from_slice(&ifindex.to_ne_bytes());
        value.extend_from_slice(&now.to_ne_bytes());
        self.skel
            .maps
            .ring_nexthop
            .update(&dense.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "ring_nexthop",
                source,
            })
    }

    /// Ring `dense`'s counters summed over CPUs (`abi::RingStat` indexes).
    pub fn ring_stats(&self, dense: u32) -> Result<abi::RingStats> {
        Ok(maps::lookup_percpu_sum(&self.skel.maps.ring_stats, &dense.to_ne_bytes())
            .map_err(|source| XdpError::Map {
                map: names::RING_STATS,
                source,
            })?
            .unwrap_or_default())
    }

    fn rank(&self, id: u16, rank: u16) -> Result<Option<abi::Rank>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        lookup_array(&self.skel.maps.ranks, names::RANKS, dense * abi::MAX_RANKS + u32::from(rank))
    }

    /// Release every kernel slot of job `id` that is not completing (with
    /// `aggbox_reclaim`, so `active_slots` stays exact); returns how many.
    pub fn discard_job_slots(&self, id: u16) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut n = 0;
        for key in maps.slot_keys().into_iter().filter(|k| k.job == id) {
            if maps.reclaim_slot(&key)? == Reclaim::Reclaimed {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Remove job `id` (no-op if unknown).
    pub fn remove_job(&self, id: u16) -> Result<()> {
        let (Some(old), Some(dense)) = (self.job(id)?, self.job_index(id)?) else {
            return Ok(());
        };
        // Unpublished first: from here on its datagrams are unknown_job.
        update_array(&self.skel.maps.job_index, names::JOB_INDEX, u32::from(id), &0u32)?;
        // Its hash-map slots (released by the kernel, so blocks go back to
        // the pool) while job_state still counts them, then the rest.
        self.clear_job_slots(id)?;
        update_array(&self.skel.maps.jobs, names::JOBS, dense, &abi::Job::default())?;
        for rank in 0..old.workers {
            self.write_rank(dense, rank, &abi::Rank::default())?;
        }
        self.port_add(old.port, -1)?;
        self.zero_job_entries(dense)?;
        // Its fast slots: nothing of the job may outlive it there.
        if old.fast_slots > 0 {
            self.zero_fast_slots(u32::from(old.fast_base), u32::from(old.fast_slots))?;
        }
        Ok(())
    }

    /// The job as written in the `jobs` array, if configured.
    pub fn job(&self, id: u16) -> Result<Option<abi::Job>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        Ok(lookup_array::<abi::Job>(&self.skel.maps.jobs, names::JOBS, dense)?.filter(|j| j.workers != 0 && j.id == id))
    }

    fn port_add(&self, port: u16, delta: i64) -> Result<()> {
        let map = &self.skel.maps.ports;
        let cur = lookup_array::<abi::Port>(map, names::PORTS, u32::from(port))?
            .map(|p| i64::from(p.jobs))
            .unwrap_or(0);
        let value = abi::Port {
            jobs: (cur + delta).max(0) as u32,
        };
        update_array(map, names::PORTS, u32::from(port), &value)
    }

    /// Drop the kernel's slots of a removed job: its hash-map slots (and
    /// their blocks) and its completed markers and ownership records.
    fn clear_job_slots(&self, id: u16) -> Result<()> {
        // The kernel releases the job's slots (and gives their blocks back
        // to the pool, which only the XDP programs do); a slot that is
        // completing is deleted by its completer. The loop below deletes
        // what is left by key.
        self.discard_job_slots(id)?;
        for (map, name) in [
            (&self.skel.maps.slots, names::SLOTS),
            (&self.skel.maps.completed, names::COMPLETED),
            (&self.skel.maps.slot_owner, names::SLOT_OWNER),
        ] {
            let keys: Vec<Vec<u8>> = map
                .keys()
                .filter(|k| abi::from_bytes::<abi::SlotKey>(k).is_some_and(|k| k.job == id))
                .collect();
            for k in keys {
                delete_ignore_missing(map, name, &k)?;
            }
        }
        Ok(())
    }

    /// The kernel's runtime state of job `id` (slots in use, newest
    /// completed round, completions, next RESULT seq).
    pub fn job_state(&self, id: u16) -> Result<Option<abi::JobState>> {
        let Some(dense) = self.job_index(id)? else {
            return Ok(None);
        };
        lookup_array(&self.skel.maps.job_state, names::JOB_STATE, dense)
    }

    /// The fast-slot region job `id` gets (docs/DATAPLANE.md "Fast slots"):
    /// a reconfigured job keeps its region; a new one gets the first free,
    /// aligned region of the largest power of two at or above its slot
    /// bound (at most FAST_JOB_SLOTS) that fits, zeroed before the job
    /// points at it; (0, 0) when none is free or the job never aggregates
    /// in the kernel (user space only, or JOB_F_NO_FAST). Returns base,
    /// size, stride and granule (`job.fast_granule` for a new job).
    fn fast_region(&self, id: u16, job: &abi::Job, old: Option<&abi::Job>) -> Result<(u16, u16, u32, u16)> {
        // Rounds of a job with a vector length whose fragments a region
        // holds at once without collisions (workers of one job are within a
        // round or two of each other; a fragment that collides still takes
        // the chain, with every rule of that path).
        const FAST_ROUNDS_IN_FLIGHT: u32 = 8;
        if job.flags & (abi::JOB_F_USERSPACE_ONLY | abi::JOB_F_NO_FAST) != 0 {
            if let Some(old) = old.filter(|o| o.fast_slots > 0) {
                // Giving the region up: release what is in flight there.
                self.discard_fast_slots(id, old.fast_base, old.fast_slots)?;
            }
            return Ok((0, 0, 0, job.fast_granule));
        }
        let limit = if job.slots == 0 { abi::MAX_SLOTS } else { job.slots };
        // A fragment of granule..=FAST_ELEMS elements covers one or two
        // granules of its round's index sequence (one when the granule is
        // the job's fragment size): a region of the next power of two above
        // the bound holds the bound's fragments without collisions.
        let mut want = abi::FAST_JOB_SLOTS.min(limit.max(1).next_power_of_two());
        let stride = job.vector_len.div_ceil(u32::from(job.fast_granule));
        if stride > 0 {
            // With a vector length no more than what FAST_ROUNDS_IN_FLIGHT
            // rounds index, and what the window guarantee needs (a slot
            // remembers 18 fragments: 18 · size ≥ (window + 1) · stride):
            // a job of small vectors then cycles over a few hot slots, not
            // 4096 cold ones, and leaves the pool to other jobs.
            let window = if job.window == 0 { abi::ROUND_WINDOW } else { job.window };
            let rounds = FAST_ROUNDS_IN_FLIGHT.max((window + 1).div_ceil(18));
            want = want.min(rounds.saturating_mul(stride).next_power_of_two());
        }
        if let Some(old) = old {
            // A reconfigured job keeps its region and index function (and
            // the fragments in flight there): both were set when the job
            // was added, so a fragment's index never changes.
            return Ok((old.fast_base, old.fast_slots, old.fast_stride, old.fast_granule));
        }
        let mut taken: Vec<(u32, u32)> = Vec::new();
        for (_, other) in self.jobs()? {
            if other.id != id && other.fast_slots > 0 {
                let base = u32::from(other.fast_base);
                taken.push((base, base + u32::from(other.fast_slots)));
            }
        }
        let mut size = want;
        while size >= 1 {
            let mut base = 0;
            while base + size <= abi::FAST_SLOTS {
                if taken.iter().all(|&(lo, hi)| base + size <= lo || base >= hi) {
                    self.zero_fast_slots(base, size)?;
                    return Ok((base as u16, size as u16, stride, job.fast_granule));
                }
                base += size;
            }
            size /= 2;
        }
        Ok((0, 0, 0, job.fast_granule))
    }

    /// Zero fast slots `base..base + n`, lock word included. Only slots
    /// of no job are zeroed: a region before a job points at it, and a
    /// removed job's region after its job was unpublished (an XDP run
    /// that saw the job before that holds a slot for well under a
    /// millisecond, and a region is zeroed again before its next job).
    fn zero_fast_slots(&self, base: u32, n: u32) -> Result<()> {
        let map = &self.skel.maps.fast_slots;
        let zero = vec![0u8; map.value_size() as usize];
        for index in base..base + n {
            map.update(&index.to_ne_bytes(), &zero, MapFlags::ANY)
                .map_err(|source| XdpError::Map {
                    map: names::FAST_SLOTS,
                    source,
                })?;
        }
        Ok(())
    }

    /// Release job `id`'s fast slots in `base..base + n` with the
    /// `aggbox_fast_discard` program (which gives `active_slots` back
    /// atomically); returns how many held an unfinished fragment.
    pub fn discard_fast_slots(&self, id: u16, base: u16, n: u16) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut released = 0;
        for index in u32::from(base)..u32::from(base) + u32::from(n) {
            if maps.discard_fast_slot(id, index, None)? {
                released += 1;
            }
        }
        Ok(released)
    }

    /// Fast slots holding an unfinished fragment (CLAIMING, ACTIVE or
    /// RESULTING: the `state` field at offset 4 of `struct
    /// aggbox_fast_slot`), all jobs.
    pub fn fast_slots_in_use(&self) -> usize {
        let map = &self.skel.maps.fast_slots;
        (0..abi::FAST_SLOTS)
            .filter(|index| {
                map.lookup(&index.to_ne_bytes(), MapFlags::ANY)
                    .ok()
                    .flatten()
                    .is_some_and(|v| {
                        let state = u16::from_ne_bytes([v[4], v[5]]);
                        (1..=3).contains(&state)
                    })
            })
            .count()
    }

    /// What the fast slots did, summed over CPUs, indexed by
    /// `abi::FAST_*` (joined, taken, busy, aborted, evicted).
    pub fn fast_stats(&self) -> Result<[u64; abi::FAST_STAT_MAX as usize]> {
        let mut out = [0u64; abi::FAST_STAT_MAX as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = maps::percpu_array_sum(&self.skel.maps.fast_stats, i as u32).map_err(|source| XdpError::Map {
                map: names::FAST_STATS,
                source,
            })?;
        }
        Ok(out)
    }

    /// Number of open fragments whose path is decided (all jobs): the
    /// `slot_owner` records of the hash-map path plus the unfinished fast
    /// slots (whose index is their decision), for tests and status.
    pub fn slot_owners_in_use(&self) -> usize {
        self.skel.maps.slot_owner.keys().count() + self.fast_slots_in_use()
    }

    /// Number of unfinished slots (all jobs, hash-map and fast), for tests
    /// and status.
    pub fn slots_in_use(&self) -> usize {
        self.skel.maps.slots.keys().count() + self.fast_slots_in_use()
    }

    /// Number of pool blocks (chunks of `abi::CHUNK_ELEMS` accumulators)
    /// that slots hold (all jobs; the kernel's `blocks_used` counter), for
    /// tests: a slot of `count` elements holds `ceil(count / CHUNK_ELEMS)`
    /// of them (docs/JUMBO.md).
    pub fn blocks_in_use(&self) -> Result<usize> {
        let used: Option<u64> = lookup_plain(&self.skel.maps.blocks_used, names::BLOCKS_USED, &0u32)?;
        Ok(used.unwrap_or(0) as usize)
    }

    /// Read the `stats` map and sum every counter over CPUs.
    pub fn stats(&self) -> Result<Stats> {
        let map = &self.skel.maps.stats;
        let mut stats = Stats::default();
        let read = |idx: u32| -> Result<Counter> {
            let sum: abi::Stat = maps::percpu_array_sum(map, idx).map_err(|source| XdpError::Map {
                map: names::STATS,
                source,
            })?;
            Ok(Counter::from(sum))
        };
        for outcome in abi::Outcome::ALL {
            stats
                .outcomes
                .insert(outcome.label(), read(outcome as u32)?);
        }
        for reason in abi::DropReason::ALL {
            stats
                .drops
                .insert(reason.label(), read(reason.stats_index())?);
        }
        Ok(stats)
    }

    /// Datagrams redirected to user space, by [`abi::HandoffReason`] label,
    /// summed over CPUs (their sum equals the `to_userspace` outcome).
    pub fn handoff_stats(&self) -> Result<BTreeMap<&'static str, Counter>> {
        let map = &self.skel.maps.handoff_stats;
        let mut out = BTreeMap::new();
        for reason in abi::HandoffReason::ALL {
            let sum: abi::Stat = maps::percpu_array_sum(map, reason as u32).map_err(|source| XdpError::Map {
                map: names::HANDOFF_STATS,
                source,
            })?;
            out.insert(reason.label(), Counter::from(sum));
        }
        Ok(out)
    }

    /// Register the AF_XDP socket `xsk_fd` (bound to this interface's RX
    /// queue `queue`) in the `xsks` XSKMAP: from now on what the kernel
    /// hands to user space from that queue is redirected to it.
    pub fn register_xsk(&self, queue: u32, xsk_fd: RawFd) -> Result<()> {
        self.kernel_maps()?.register_xsk(queue, xsk_fd)
    }

    /// Set the longest frame (bytes) the XDP program redirects to the
    /// `xsks` sockets (`xsk_limits`; 0 = no limit). A longer frame keeps the
    /// fallback, as with no socket registered (docs/JUMBO.md).
    pub fn set_xsk_limit(&self, limit: u32) -> Result<()> {
        self.kernel_maps()?.set_xsk_limit(limit)
    }

    /// Remove queue `queue`'s socket from the `xsks` map (no-op if none).
    pub fn unregister_xsk(&self, queue: u32) -> Result<()> {
        delete_ignore_missing(&self.skel.maps.xsks, names::XSKS, &queue.to_ne_bytes())
    }

    /// Duplicated descriptors of the maps the user-space path shares with
    /// the XDP program (`Send + Sync`, usable from its threads).
    pub fn kernel_maps(&self) -> Result<KernelMaps> {
        let maps = &self.skel.maps;
        let dup = |fd: std::os::fd::BorrowedFd<'_>, map: &'static str| {
            fd.try_clone_to_owned().map_err(|e| XdpError::Map {
                map,
                source: libbpf_rs::Error::from(e),
            })
        };
        Ok(KernelMaps {
            xsks: dup(maps.xsks.as_fd(), names::XSKS)?,
            xsk_limits: dup(maps.xsk_limits.as_fd(), names::XSK_LIMITS)?,
            slot_owner: dup(maps.slot_owner.as_fd(), names::SLOT_OWNER)?,
            completed: dup(maps.completed.as_fd(), names::COMPLETED)?,
            job_state: dup(maps.job_state.as_fd(), names::JOB_STATE)?,
            job_handoff: dup(maps.job_handoff.as_fd(), names::JOB_HANDOFF)?,
            job_index: dup(maps.job_index.as_fd(), names::JOB_INDEX)?,
            jobs: dup(maps.jobs.as_fd(), names::JOBS)?,
            fast_slots: dup(maps.fast_slots.as_fd(), names::FAST_SLOTS)?,
            fast_slot_size: maps.fast_slots.value_size() as usize,
            fast_view: FastSlotView::map(maps.fast_slots.as_fd(), maps.fast_slots.value_size() as usize, abi::FAST_SLOTS),
            fast_discard: self
                .skel
                .progs
                .aggbox_fast_discard
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
            slots: dup(maps.slots.as_fd(), names::SLOTS)?,
            reclaim: self
                .skel
                .progs
                .aggbox_reclaim
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        })
    }

    /// Release the kernel slot `key` with the `aggbox_reclaim` program (see
    /// [`Reclaim`]); `active_slots` of its job is given back atomically by
    /// the kernel.
    pub fn reclaim_slot(&self, key: &abi::SlotKey) -> Result<Reclaim> {
        self.kernel_maps()?.reclaim_slot(key)
    }

    /// Release every kernel slot whose round is stale (older than its job's
    /// newest completed round, of either path, minus the job's window):
    /// such a slot can never complete, since the stale-round rule drops all
    /// later contributions to it. Returns how many were released. The
    /// node's upkeep (src/node/upkeep.rs) calls the same thing periodically.
    pub fn reclaim_stale_slots(&self) -> Result<usize> {
        let maps = self.kernel_maps()?;
        let mut windows = BTreeMap::new();
        for (_, job) in self.jobs()? {
            windows.insert(job.id, job.window);
        }
        Ok(maps.reclaim_stale_slots(|job| windows.get(&job).copied()))
    }

    /// Run the XDP entry program once on `frame` with BPF_PROG_TEST_RUN;
    /// returns the XDP verdict and the frame as the program left it.
    pub fn test_run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.test_runner()?.run(frame)
    }

    /// A handle that runs the XDP entry program with BPF_PROG_TEST_RUN and
    /// can be sent to other threads (each may pin itself to a CPU).
    pub fn test_runner(&self) -> Result<TestRunner> {
        let fd = self
            .xdp_prog_fd()
            .try_clone_to_owned()
            .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?;
        Ok(TestRunner { fd })
    }

    /// Id, size, verifier cost and run statistics of every program of the
    /// chain (what `bpftool prog show` prints).
    pub fn programs(&self) -> Result<Vec<ProgramFacts>> {
        let mut out = Vec::new();
        for (name, fd) in self.chain_programs() {
            // SAFETY: zeroed info is valid; no output arrays are requested.
            let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
            // SAFETY: valid fd, info/len describe a live buffer.
            let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd, &mut info, &mut len) };
            if rc < 0 {
                let err = std::io::Error::from_raw_os_error(-rc);
                return Err(XdpError::Load(libbpf_rs::Error::from(err)));
            }
            out.push(ProgramFacts {
                name,
                id: info.id,
                xlated_insns: info.xlated_prog_len / 8,
                verified_insns: info.verified_insns,
                run_cnt: info.run_cnt,
                run_time_ns: info.run_time_ns,
            });
        }
        Ok(out)
    }

    /// File descriptor of the XDP entry program (of the loaded chain).
    pub fn xdp_prog_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self.chain {
            Chain::Frags => self.skel.progs.aggbox_xdp.as_fd(),
            Chain::Linear => self.skel.progs.aggbox_xdp_linear.as_fd(),
        }
    }

    /// The build of the chain this dataplane loaded.
    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// Name and fd of the loaded chain's programs: entry, slot, add, result.
    fn chain_programs(&self) -> [(&'static str, RawFd); 5] {
        self.chain_program_refs().map(|(name, prog)| (name, prog.as_fd().as_raw_fd()))
    }

    /// The tail-call array of the loaded chain (`progs` or `progs_linear`).
    fn chain_prog_array(&self) -> &libbpf_rs::Map<'static> {
        match self.chain {
            Chain::Frags => &self.skel.maps.progs,
            Chain::Linear => &self.skel.maps.progs_linear,
        }
    }

    /// The loaded chain's programs by name (the one place that maps a
    /// [`Chain`] to its programs after load).
    fn chain_program_refs(&self) -> [(&'static str, &libbpf_rs::Program<'static>); 5] {
        let p = &self.skel.progs;
        match self.chain {
            Chain::Frags => [
                ("aggbox_xdp", &p.aggbox_xdp),
                ("aggbox_slot", &p.aggbox_slot),
                ("aggbox_add", &p.aggbox_add),
                ("aggbox_result", &p.aggbox_result),
                ("aggbox_ring", &p.aggbox_ring),
            ],
            Chain::Linear => [
                ("aggbox_xdp_linear", &p.aggbox_xdp_linear),
                ("aggbox_slot_linear", &p.aggbox_slot_linear),
                ("aggbox_add_linear", &p.aggbox_add_linear),
                ("aggbox_result_linear", &p.aggbox_result_linear),
                ("aggbox_ring_linear", &p.aggbox_ring_linear),
            ],
        }
    }

    /// The BPF helpers (ids of `enum bpf_func_id`) each loaded program of
    /// the chain, and `aggbox_reclaim`, calls, from the instructions libbpf
    /// loaded (subprograms and callbacks appended): what a kernel must offer
    /// to load them. A helper call is `BPF_JMP | BPF_CALL` with src_reg 0
    /// and the id in imm (src_reg 1 calls a subprogram, 2 a kfunc).
    pub fn helper_ids(&self) -> Vec<(&'static str, Vec<u32>)> {
        const BPF_JMP_CALL: u8 = 0x05 | 0x80;
        let reclaim = ("aggbox_reclaim", self.skel.progs.aggbox_reclaim.insns());
        self.chain_program_refs()
            .map(|(name, prog)| (name, prog.insns()))
            .into_iter()
            .chain([reclaim])
            .map(|(name, insns)| {
                let mut ids: Vec<u32> = insns
                    .iter()
                    .filter(|i| i.code == BPF_JMP_CALL && i.src_reg() == 0)
                    .map(|i| i.imm as u32)
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                (name, ids)
            })
            .collect()
    }
}

/// Kernel facts about one loaded program of the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramFacts {
    /// Program name (`aggbox_xdp`, `aggbox_slot`, `aggbox_add`, `aggbox_result`).
    pub name: &'static str,
    /// Kernel program id.
    pub id: u32,
    /// Instructions after the verifier's rewrites (xlated).
    pub xlated_insns: u32,
    /// Instructions the verifier processed to accept the program.
    pub verified_insns: u32,
    /// Runs so far (needs `kernel.bpf_stats_enabled=1`).
    pub run_cnt: u64,
    /// Total run time in ns (needs `kernel.bpf_stats_enabled=1`).
    pub run_time_ns: u64,
}

/// A duplicated descriptor of the XDP entry program for BPF_PROG_TEST_RUN
/// (`Send + Sync`; the dataplane's maps stay shared with it).
#[derive(Debug)]
pub struct TestRunner {
    fd: OwnedFd,
}

impl TestRunner {
    /// A runner of any loaded XDP program (benchmarks compare others with
    /// AggBox's: the floor aggregator, count-and-drop).
    pub fn for_program(prog: &libbpf_rs::ProgramMut<'_>) -> Result<TestRunner> {
        TestRunner::for_fd(prog.as_fd())
    }

    /// A runner of the XDP program behind `prog` (one loaded without a
    /// skeleton, e.g. a test's hand-assembled probe).
    pub fn for_fd(prog: std::os::fd::BorrowedFd<'_>) -> Result<TestRunner> {
        let fd = prog
            .try_clone_to_owned()
            .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?;
        Ok(TestRunner { fd })
    }
}

impl TestRunner {
    /// Run the program once on `frame`; returns the verdict and output frame.
    pub fn run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.run_timed(frame).map(|(verdict, out, _)| (verdict, out))
    }

    /// [`TestRunner::run`] plus the kernel's measured run time of the whole
    /// chain in nanoseconds (BPF_PROG_TEST_RUN's `duration`, which excludes
    /// the copies in and out): what `benches/xdp_chain.rs` reports.
    pub fn run_timed(&self, frame: &[u8]) -> Result<(u32, Vec<u8>, u32)> {
        self.test_run(frame, 1)
    }

    /// BPF_PROG_TEST_RUN of `frame`, `repeat` times on the same buffer:
    /// verdict, output frame and mean run time (ns) of the runs.
    fn test_run(&self, frame: &[u8], repeat: u32) -> Result<(u32, Vec<u8>, u32)> {
        let mut out = vec![0u8; frame.len() + 256];
        // SAFETY: zeroed opts are valid; sz set; buffers outlive the call.
        let mut opts: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        opts.data_in = frame.as_ptr().cast();
        opts.data_size_in = frame.len() as u32;
        opts.data_out = out.as_mut_ptr().cast();
        opts.data_size_out = out.len() as u32;
        opts.repeat = repeat as i32;
        // SAFETY: valid program fd and opts pointing at live buffers.
        let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(self.fd.as_raw_fd(), &mut opts) };
        if rc < 0 {
            let err = std::io::Error::from_raw_os_error(-rc);
            return Err(XdpError::TestRun(libbpf_rs::Error::from(err)));
        }
        out.truncate(opts.data_size_out as usize);
        Ok((opts.retval, out, opts.duration))
    }

    /// Mean run time (ns) of `repeat` runs of the program on one `frame`
    /// (BPF_PROG_TEST_RUN with `repeat`: one buffer, so each run sees
    /// what the run before left in it; benches/xdp_chain.rs's feeder
    /// rewrites it into the next contribution).
    pub fn run_repeated(&self, frame: &[u8], repeat: u32) -> Result<u32> {
        self.test_run(frame, repeat).map(|(_, _, ns)| ns)
    }
}

/// The `fast_slots` array mapped read-only (`BPF_F_MMAPABLE`): the
/// stale-slot scan reads a slot's 12-byte header from memory, where a
/// lookup would copy the whole 3 KB value out through a syscall (4096
/// lookups per scan of the largest region, every 100 ms: several % of a
/// CPU under load).
struct FastSlotView {
    base: *const u8,
    len: usize,
    stride: usize,
    entries: u32,
}

// SAFETY: a read-only shared mapping, read with volatile loads only.
unsafe impl Send for FastSlotView {}
// SAFETY: as above; nothing is written through it.
unsafe impl Sync for FastSlotView {}

impl FastSlotView {
    fn map(fd: std::os::fd::BorrowedFd<'_>, value_size: usize, entries: u32) -> Option<Self> {
        // An mmapable array lays its values out from offset 0, each
        // rounded up to 8 bytes, the whole rounded up to a page.
        let stride = value_size.div_ceil(8) * 8;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        let len = (stride * entries as usize).div_ceil(page) * page;
        // SAFETY: a fresh shared read-only mapping of a map fd; checked below.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if base == libc::MAP_FAILED {
            return None;
        }
        Some(FastSlotView {
            base: base.cast::<u8>().cast_const(),
            len,
            stride,
            entries,
        })
    }

    fn header(&self, index: u32) -> Option<(u16, u16, u32)> {
        if index >= self.entries {
            return None;
        }
        // SAFETY: index < entries, so the 12 bytes lie inside the mapping;
        // the offsets are those of struct aggbox_fast_slot (naturally
        // aligned: every value starts at a multiple of 8).
        unsafe {
            let at = self.base.add(index as usize * self.stride);
            Some((
                std::ptr::read_volatile(at.add(4).cast::<u16>()),
                std::ptr::read_volatile(at.add(6).cast::<u16>()),
                std::ptr::read_volatile(at.add(8).cast::<u32>()),
            ))
        }
    }
}

impl std::fmt::Debug for FastSlotView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastSlotView").field("entries", &self.entries).field("stride", &self.stride).finish()
    }
}

impl Drop for FastSlotView {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`.
        unsafe {
            libc::munmap(self.base.cast_mut().cast(), self.len);
        }
    }
}

/// The maps the user-space path shares with the XDP program, as duplicated
/// descriptors (`Send + Sync`): see [`XdpPlane::kernel_maps`]. The one
/// owner of the user-space side of the hand-off protocol (docs/USERSPACE.md):
/// sockets and their limit (`xsks`, `xsk_limits`), who owns a fragment
/// (`slot_owner`), completion ([`KernelMaps::release_completed`]: `completed`,
/// then `slot_owner`, then `job_handoff`), overload (`job_handoff`), and the
/// reclaim of kernel slots of stale rounds.
#[derive(Debug)]
pub struct KernelMaps {
    xsks: OwnedFd,
    xsk_limits: OwnedFd,
    slot_owner: OwnedFd,
    completed: OwnedFd,
    job_state: OwnedFd,
    job_handoff: OwnedFd,
    job_index: OwnedFd,
    jobs: OwnedFd,
    fast_slots: OwnedFd,
    fast_slot_size: usize,
    /// `fast_slots` mapped read-only (None where mmap failed: the scan then
    /// copies each value out with a syscall).
    fast_view: Option<FastSlotView>,
    fast_discard: OwnedFd,
    slots: OwnedFd,
    reclaim: OwnedFd,
}

fn raw_lookup<K: plain::Plain, V: plain::Plain + Default>(fd: &OwnedFd, key: &K) -> Option<V> {
    let mut value = V::default();
    // SAFETY: key/value point at live plain structs of the map's sizes.
    let rc = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            fd.as_raw_fd(),
            (key as *const K).cast(),
            (&mut value as *mut V).cast(),
        )
    };
    (rc == 0).then_some(value)
}

fn raw_update<K: plain::Plain, V: plain::Plain>(
    fd: &OwnedFd,
    map: &'static str,
    key: &K,
    value: &V,
    flags: u64,
) -> Result<()> {
    // SAFETY: key/value point at live plain structs of the map's sizes.
    let rc = unsafe {
        libbpf_sys::bpf_map_update_elem(
            fd.as_raw_fd(),
            (key as *const K).cast(),
            (value as *const V).cast(),
            flags,
        )
    };
    if rc < 0 {
        return Err(XdpError::Map {
            map,
            source: libbpf_rs::Error::from(std::io::Error::from_raw_os_error(-rc)),
        });
    }
    Ok(())
}

fn raw_delete<K: plain::Plain>(fd: &OwnedFd, key: &K) {
    // SAFETY: key points at a live plain struct of the map's key size.
    // ENOENT (already gone) is the only expected failure and is fine.
    unsafe {
        libbpf_sys::bpf_map_delete_elem(fd.as_raw_fd(), (key as *const K).cast());
    }
}

/// What [`XdpPlane::reclaim_slot`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaim {
    /// The slot was poisoned, deleted and its reservation given back.
    Reclaimed,
    /// No such slot (completed or reclaimed meanwhile).
    Absent,
    /// All its contributions are done: it is completing; left alone.
    Busy,
}

impl KernelMaps {
    /// Release kernel slot `key` (see [`XdpPlane::reclaim_slot`]).
    pub fn reclaim_slot(&self, key: &abi::SlotKey) -> Result<Reclaim> {
        let mut frame = [0u8; 14 + std::mem::size_of::<abi::SlotKey>()];
        frame[14..].copy_from_slice(abi::as_bytes(key));
        let runner = TestRunner {
            fd: self
                .reclaim
                .try_clone()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        };
        let (verdict, _) = runner.run(&frame)?;
        Ok(match verdict {
            2 => Reclaim::Reclaimed,
            1 => Reclaim::Absent,
            _ => Reclaim::Busy,
        })
    }

    /// Every key of the kernel's slot pool.
    pub fn slot_keys(&self) -> Vec<abi::SlotKey> {
        let mut out = Vec::new();
        let mut key = abi::SlotKey::default();
        let mut first = true;
        loop {
            let mut next = abi::SlotKey::default();
            let prev: *const std::ffi::c_void = if first {
                std::ptr::null()
            } else {
                (&key as *const abi::SlotKey).cast()
            };
            // SAFETY: prev is null or a live key; next is a live key buffer.
            let rc = unsafe {
                libbpf_sys::bpf_map_get_next_key(self.slots.as_raw_fd(), prev, (&mut next as *mut abi::SlotKey).cast())
            };
            if rc != 0 || out.len() > abi::MAX_SLOTS as usize {
                break;
            }
            first = false;
            key = next;
            out.push(key);
        }
        out
    }

    /// Every configured job's round window (`jobs` array; 0: the build
    /// default), for [`KernelMaps::reclaim_stale_slots`].
    pub fn job_windows(&self) -> BTreeMap<u16, u32> {
        (0..abi::MAX_JOBS)
            .filter_map(|dense| raw_lookup::<u32, abi::Job>(&self.jobs, &dense))
            .filter(|job| job.workers != 0)
            .map(|job| (job.id, job.window))
            .collect()
    }

    /// Release every kernel slot of a stale round. `window(job)` is the
    /// job's configured window (`None`: job unknown, its slots are left to
    /// `remove_job`; 0: the build default). A round is stale
    /// ([`Round::is_stale`], the rule the XDP program drops by) behind
    /// either path's newest completed round.
    pub fn reclaim_stale_slots(&self, window: impl Fn(u16) -> Option<u32>) -> usize {
        // Per job: its two paths' newest completed rounds and its window
        // (`None`: a job `window` does not know).
        type Newest = Option<(Option<Round>, Option<Round>, u32)>;
        let mut newest: BTreeMap<u16, Newest> = BTreeMap::new();
        self.release_open_slots(|job, round| {
            let entry = *newest.entry(job).or_insert_with(|| {
                let w = window(job)?;
                let (k, u) = self.newest_rounds(job);
                Some((k, u, w))
            });
            entry.is_some_and(|(k, u, w)| round.is_stale(k, w) || round.is_stale(u, w))
        })
    }

    /// Release every unfinished slot of job `id` whose round is after
    /// `newest` (every one with `None`): what an earlier run of the job
    /// left when its calls failed, before a new run starts after `newest`
    /// (the node's answer to a position query, src/node/serve.rs). Returns
    /// how many were released.
    pub fn release_rounds_after(&self, id: u16, newest: Option<Round>) -> usize {
        self.release_open_slots(|job, round| job == id && newest.is_none_or(|n| round.is_after(n)))
    }

    /// Release the unfinished kernel slots, hash-map and fast, whose (job,
    /// round) `pick` chooses; the kernel checks under each slot's lock that
    /// it still holds that round. Returns how many were released.
    fn release_open_slots(&self, mut pick: impl FnMut(u16, Round) -> bool) -> usize {
        let mut released = 0;
        for key in self.slot_keys() {
            if pick(key.job, Round(key.round)) && matches!(self.reclaim_slot(&key), Ok(Reclaim::Reclaimed)) {
                released += 1;
            }
        }
        // The fast slots (docs/DATAPLANE.md "Fast slots") of every job with
        // a region.
        for dense in 0..abi::MAX_JOBS {
            let Some(job) = raw_lookup::<u32, abi::Job>(&self.jobs, &dense) else { continue };
            if job.workers == 0 || job.fast_slots == 0 {
                continue;
            }
            let base = u32::from(job.fast_base);
            for index in base..base + u32::from(job.fast_slots) {
                let Some((state, slot_job, round)) = self.fast_slot_header(index) else { continue };
                // CLAIMING too: a take-over its taker could not undo (the
                // slot's lock busy past its bound) is undone here.
                if (state == FAST_ACTIVE || state == FAST_CLAIMING)
                    && slot_job == job.id
                    && pick(job.id, Round(round))
                    && matches!(self.discard_fast_slot(job.id, index, Some(round)), Ok(true))
                {
                    released += 1;
                }
            }
        }
        released
    }

    /// (state, job, round) of fast slot `index`: the first fields of
    /// `struct aggbox_fast_slot` after its 4-byte lock (src/bpf/slot.h).
    /// Read from the mapping (a racy snapshot, as a lookup's is: the kernel
    /// checks again under the slot's lock before it releases anything).
    fn fast_slot_header(&self, index: u32) -> Option<(u16, u16, u32)> {
        if let Some(view) = &self.fast_view {
            return view.header(index);
        }
        let value = self.fast_slot_value(index)?;
        Some((
            u16::from_ne_bytes([value[4], value[5]]),
            u16::from_ne_bytes([value[6], value[7]]),
            u32::from_ne_bytes([value[8], value[9], value[10], value[11]]),
        ))
    }

    /// (job, round, frag_off) of the fragment fast slot `index` holds or
    /// last held (`struct aggbox_fast_slot`'s key at offsets 6, 8 and 12),
    /// None past the array: where a fragment landed, for tests of the index.
    #[doc(hidden)]
    pub fn fast_slot_fragment(&self, index: u32) -> Option<(u16, u32, u32)> {
        let v = self.fast_slot_value(index)?;
        Some((
            u16::from_ne_bytes([v[6], v[7]]),
            u32::from_ne_bytes([v[8], v[9], v[10], v[11]]),
            u32::from_ne_bytes([v[12], v[13], v[14], v[15]]),
        ))
    }

    /// Fast slot `index`'s lock word (0 free, 1 held; src/bpf/slot.h).
    pub fn fast_slot_lock(&self, index: u32) -> Option<u32> {
        self.fast_slot_value(index).map(|v| u32::from_ne_bytes([v[0], v[1], v[2], v[3]]))
    }

    /// Write fast slot `index`'s lock word, as a holder that stalls would
    /// leave it: for tests of the kernel's bounded wait (slot_busy).
    /// Nothing else writes the word from user space.
    #[doc(hidden)]
    pub fn set_fast_slot_lock(&self, index: u32, word: u32) -> Result<()> {
        let mut value = self.fast_slot_value(index).ok_or(XdpError::FastSlotBusy { index })?;
        value[..4].copy_from_slice(&word.to_ne_bytes());
        // SAFETY: key is a live u32, value a buffer of the map's value size.
        let rc = unsafe {
            libbpf_sys::bpf_map_update_elem(
                self.fast_slots.as_raw_fd(),
                (&index as *const u32).cast(),
                value.as_ptr().cast(),
                0,
            )
        };
        if rc < 0 {
            return Err(XdpError::Map {
                map: names::FAST_SLOTS,
                source: libbpf_rs::Error::from(std::io::Error::from_raw_os_error(-rc)),
            });
        }
        Ok(())
    }

    fn fast_slot_value(&self, index: u32) -> Option<Vec<u8>> {
        let mut value = vec![0u8; self.fast_slot_size];
        // SAFETY: key is a live u32, value a buffer of the map's value size.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_elem(
                self.fast_slots.as_raw_fd(),
                (&index as *const u32).cast(),
                value.as_mut_ptr().cast(),
            )
        };
        (rc == 0 && value.len() >= 12).then_some(value)
    }

    /// Release fast slot `index` of job `id` with `aggbox_fast_discard`:
    /// an unfinished fragment (its reservation given back) or a finished
    /// one; with `round`, only an unfinished fragment of that round.
    /// Returns whether an unfinished fragment was released.
    pub fn discard_fast_slot(&self, id: u16, index: u32, round: Option<u32>) -> Result<bool> {
        let mut frame = [0u8; 14 + 12];
        frame[14..16].copy_from_slice(&id.to_ne_bytes());
        frame[16..18].copy_from_slice(&u16::from(round.is_some()).to_ne_bytes());
        frame[18..22].copy_from_slice(&index.to_ne_bytes());
        frame[22..26].copy_from_slice(&round.unwrap_or(0).to_ne_bytes());
        let runner = TestRunner {
            fd: self
                .fast_discard
                .try_clone()
                .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?,
        };
        // XDP_TX: the slot's lock was busy past its bound (a holder
        // interrupted); such a wait is microseconds, so a few tries do.
        for _ in 0..FAST_DISCARD_TRIES {
            let (verdict, _) = runner.run(&frame)?;
            if verdict != XDP_TX {
                return Ok(verdict == 2);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Err(XdpError::FastSlotBusy { index })
    }

    /// Put AF_XDP socket `xsk_fd` into `xsks[queue]`.
    pub fn register_xsk(&self, queue: u32, xsk_fd: RawFd) -> Result<()> {
        raw_update(&self.xsks, names::XSKS, &queue, &(xsk_fd as u32), 0)
    }

    /// Write `xsk_limits[0]`: the longest frame redirected to the sockets
    /// (0 = no limit).
    pub fn set_xsk_limit(&self, limit: u32) -> Result<()> {
        raw_update(&self.xsk_limits, names::XSK_LIMITS, &0u32, &limit, 0)
    }

    /// Remove `xsks[queue]`.
    pub fn unregister_xsk(&self, queue: u32) {
        raw_delete(&self.xsks, &queue);
    }

    /// Which path owns slot `key` (`abi::OWNER_*`), if decided.
    pub fn slot_owner(&self, key: &abi::SlotKey) -> Option<u32> {
        raw_lookup::<_, abi::SlotOwner>(&self.slot_owner, key).map(|o| o.owner)
    }

    /// Forget who owns slot `key` (after its `completed` marker is written).
    pub fn delete_slot_owner(&self, key: &abi::SlotKey) {
        raw_delete(&self.slot_owner, key);
    }

    /// Every `slot_owner` entry.
    pub fn slot_owners(&self) -> Vec<(abi::SlotKey, u32)> {
        let mut out = Vec::new();
        let mut key = abi::SlotKey::default();
        let mut first = true;
        loop {
            let mut next = abi::SlotKey::default();
            let prev: *const std::ffi::c_void = if first {
                std::ptr::null()
            } else {
                (&key as *const abi::SlotKey).cast()
            };
            // SAFETY: prev is null or a live key; next is a live key buffer.
            let rc = unsafe {
                libbpf_sys::bpf_map_get_next_key(
                    self.slot_owner.as_raw_fd(),
                    prev,
                    (&mut next as *mut abi::SlotKey).cast(),
                )
            };
            if rc != 0 || out.len() > abi::MAX_OWNERS as usize {
                break;
            }
            first = false;
            key = next;
            if let Some(owner) = self.slot_owner(&key) {
                out.push((key, owner));
            }
        }
        out
    }

    /// Publish a fragment the user-space path completed, in the kernel's
    /// release order: the `completed` marker of `recorded` (a fragment the
    /// kernel recorded in `slot_owner`), then the deletion of that record,
    /// so that no contribution can start a new slot for it on either path;
    /// then the job's newest round (`handoff`, when it advanced). Best
    /// effort, as in the kernel: a marker that cannot be written (the LRU
    /// is full of newer ones) leaves the stale-round rule to refuse late
    /// retransmissions.
    pub fn release_completed(&self, job: u16, recorded: Option<&abi::SlotKey>, handoff: Option<&abi::JobHandoff>) {
        if let Some(key) = recorded {
            let _ = self.mark_completed(key);
            self.delete_slot_owner(key);
        }
        if let Some(handoff) = handoff {
            let _ = self.set_job_handoff(job, handoff);
        }
    }

    /// Write the kernel's completed marker for `key`, so a late
    /// retransmission is never aggregated again by either path.
    pub fn mark_completed(&self, key: &abi::SlotKey) -> Result<()> {
        raw_update(&self.completed, names::COMPLETED, key, &1u32, 0)
    }

    /// Whether the kernel's completed marker for `key` exists.
    pub fn is_completed(&self, key: &abi::SlotKey) -> bool {
        raw_lookup::<_, u32>(&self.completed, key).is_some()
    }

    /// The kernel's runtime state of job `id`.
    pub fn job_state(&self, id: u16) -> Option<abi::JobState> {
        raw_lookup(&self.job_state, &self.dense(id)?)
    }

    /// Job `id`'s dense index (`job_index`), if configured.
    fn dense(&self, id: u16) -> Option<u32> {
        raw_lookup::<u32, u32>(&self.job_index, &u32::from(id))
            .filter(|&v| v != 0 && v <= abi::MAX_JOBS)
            .map(|v| v - 1)
    }

    /// The user-space path's state of job `id` as the kernel sees it.
    pub fn job_handoff(&self, id: u16) -> Option<abi::JobHandoff> {
        raw_lookup(&self.job_handoff, &self.dense(id)?)
    }

    /// The newest round job `id` completed in the kernel and in user space
    /// (`None`: none yet on that path), what [`Round::is_stale`] measures
    /// a slot's round against.
    fn newest_rounds(&self, id: u16) -> (Option<Round>, Option<Round>) {
        let kernel = self.job_state(id).filter(|s| s.completed != 0).map(|s| Round(s.newest_round));
        let user = self.job_handoff(id).filter(|h| h.completed != 0).map(|h| Round(h.newest_round));
        (kernel, user)
    }

    /// Write the user-space path's state of job `id` (an error when the job
    /// is not configured).
    pub fn set_job_handoff(&self, id: u16, value: &abi::JobHandoff) -> Result<()> {
        let dense = self.dense(id).ok_or(XdpError::InvalidJob {
            job: id,
            reason: "not configured".to_string(),
        })?;
        raw_update(&self.job_handoff, names::JOB_HANDOFF, &dense, value, 0)
    }

    /// Reset job `id`'s user-space state (overload off).
    pub fn delete_job_handoff(&self, id: u16) {
        if let Some(dense) = self.dense(id) {
            let _ = raw_update(&self.job_handoff, names::JOB_HANDOFF, &dense, &abi::JobHandoff::default(), 0);
        }
    }
}

/// Every configured job of a pinned `jobs` array (what `aggbox status` and
/// the metrics read from another process) as (dense index, job): the dense
/// index is the key of the job's entries in `ranks` (times
/// `abi::MAX_RANKS`, plus the rank), `job_state` and `job_stats`.
pub fn pinned_jobs(jobs: &libbpf_rs::MapHandle) -> Result<Vec<(u32, abi::Job)>> {
    let mut out = Vec::new();
    for dense in 0..abi::MAX_JOBS {
        if let Some(job) = lookup_array::<abi::Job>(jobs, names::JOBS, dense)? {
            if job.workers != 0 {
                out.push((dense, job));
            }
        }
    }
    Ok(out)
}

/// `enum aggbox_fast_state` FAST_CLAIMING (src/bpf/slot.h): a fast slot
/// taken for a fragment whose taker is still checking the other paths.
const FAST_CLAIMING: u16 = 1;

/// `enum aggbox_fast_state` FAST_ACTIVE (src/bpf/slot.h): a fast slot
/// holding an unfinished fragment that contributions are added to.
const FAST_ACTIVE: u16 = 2;

/// The verdict of `aggbox_fast_discard` for a slot whose lock stayed held
/// past the kernel's spin bound.
const XDP_TX: u32 = 3;

/// Tries of `aggbox_fast_discard` on a busy slot, 1 ms apart.
const FAST_DISCARD_TRIES: u32 = 100;

/// Look `key` up in `map` and read the value as `V` (`None` when absent).
fn lookup_plain<K: plain::Plain, V: plain::Plain + Default, M: MapCore>(map: &M, name: &'static str, key: &K) -> Result<Option<V>> {
    let raw = map
        .lookup(abi::as_bytes(key), MapFlags::ANY)
        .map_err(|source| XdpError::Map { map: name, source })?;
    Ok(raw.and_then(|bytes| abi::from_bytes::<V>(&bytes)))
}

/// Entry `index` of an array map (a plain struct), `None` only if the index
/// is past the array.
fn lookup_array<V: plain::Plain + Default>(map: &impl MapCore, name: &'static str, index: u32) -> Result<Option<V>> {
    lookup_plain(map, name, &index)
}

/// Write entry `index` of an array map.
fn update_array<V: plain::Plain>(map: &impl MapCore, name: &'static str, index: u32, value: &V) -> Result<()> {
    map.update(&index.to_ne_bytes(), abi::as_bytes(value), MapFlags::ANY)
        .map_err(|source| XdpError::Map { map: name, source })
}

fn delete_ignore_missing<M: MapCore>(map: &M, name: &'static str, key: &[u8]) -> Result<()> {
    maps::delete_if_present(map, key).map_err(|source| XdpError::Map { map: name, source })
}

// Pinning of the object's maps, used by `node::attach` so that `aggbox status`
// and `aggbox detach` can reach the maps from another process.
impl XdpPlane {
    /// Pin every map of the object as `dir/<map name>` (`dir` must be on a
    /// bpffs and exist). Internal maps (`.bss`, `.rodata`, ...) are skipped.
    pub fn pin_maps(&self, dir: &Path) -> Result<()> {
        use libbpf_rs::skel::Skel;
        Ok(maps::pin_object_maps(self.skel.object(), dir)?)
    }
}
