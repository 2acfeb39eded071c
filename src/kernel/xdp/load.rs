//! Loading the XDP objects: which build of the tail-call chain runs, how the
//! ring maps are sized, the plane that owns programs and maps (the
//! aggregation chain's object and the ring program's, `ring.rs`), its reset
//! to the state at load, the facts the kernel keeps about each program, and
//! pinning of their maps.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use crate::kernel::object::ObjectSlot;
use libbpf_rs::{MapCore, MapFlags};

use crate::kernel::maps::{self, names};
use crate::wire::abi;

use super::ring::RingObject;
use super::skel::{AggboxXdpSkel, AggboxXdpSkelBuilder};
use super::{delete_ignore_missing, Result, XdpError};

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
/// fragment size of the node's rings and the entries reserved for them
/// ([`super::RingPool`] places the rings in them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSizing {
    /// Elements per fragment (`[[ring]] frag_elems`, one for the node).
    pub frag_elems: u32,
    /// `ring_data` / `ring_done` entries the rings may use: two buffers of
    /// fragments a ring (`RingJob::index`), all rings and the pool
    /// together; 0: none.
    pub fragments: u32,
}

impl Default for RingSizing {
    /// No ring: nothing reserved, fragments of the default size.
    fn default() -> Self {
        RingSizing {
            frag_elems: crate::config::DEFAULT_RING_FRAG_ELEMS,
            fragments: 0,
        }
    }
}

impl RingSizing {
    /// `max_entries` of `ring_data` and `ring_done`: the reserved entries,
    /// or one unused entry when none are (a map cannot be empty).
    pub fn map_entries(&self) -> u32 {
        self.fragments.max(1)
    }

    /// The entries reserved in a loaded `ring_data` of `max_entries`: the
    /// inverse of [`RingSizing::map_entries`] (a ring takes at least two,
    /// so a lone entry is the unused one).
    pub fn reserved_in(max_entries: u32) -> u32 {
        if max_entries < 2 {
            0
        } else {
            max_entries
        }
    }
}

/// The loaded AggBox XDP object: programs and maps.
pub struct XdpPlane {
    /// `fast_slots` mapped writable, made at the first region reset (None:
    /// it could not be mapped; regions are then zeroed through the syscall).
    pub(super) fast_writer: std::sync::OnceLock<Option<super::fast_view::FastSlotWriter>>,
    /// The ring program's object, tail-called at `abi::CALL_RING`.
    pub(super) ring: RingObject,
    // Field order matters: the skeleton borrows `_object` and must drop first.
    pub(super) skel: AggboxXdpSkel<'static>,
    _object: ObjectSlot,
    pub(super) chain: Chain,
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
        let (object, object_ref) = ObjectSlot::new();
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
        ] {
            prog.set_autoload(load);
        }
        let skel = open.load().map_err(XdpError::Load)?;
        let ring = RingObject::load(chain, rings, skel.maps.ring_ports.as_fd())?;
        let dataplane = XdpPlane {
            fast_writer: std::sync::OnceLock::new(),
            ring,
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
        maps::reset_object_maps(self.ring.skel.object())?;
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
        let ring = self.ring.program(self.chain);
        match self.chain {
            Chain::Frags => [
                ("aggbox_xdp", &p.aggbox_xdp),
                ("aggbox_slot", &p.aggbox_slot),
                ("aggbox_add", &p.aggbox_add),
                ("aggbox_result", &p.aggbox_result),
                ring,
            ],
            Chain::Linear => [
                ("aggbox_xdp_linear", &p.aggbox_xdp_linear),
                ("aggbox_slot_linear", &p.aggbox_slot_linear),
                ("aggbox_add_linear", &p.aggbox_add_linear),
                ("aggbox_result_linear", &p.aggbox_result_linear),
                ring,
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

// Pinning of the object's maps, used by `node::attach` so that `aggbox status`
// and `aggbox detach` can reach the maps from another process.
impl XdpPlane {
    /// Pin every map of the aggregation chain's and the ring program's
    /// objects as `dir/<map name>` (`dir` must be on a bpffs and exist).
    /// Internal maps (`.bss`, `.rodata`, ...) are skipped, and the map the
    /// two objects share (`ring_ports`) is pinned once.
    pub fn pin_maps(&self, dir: &Path) -> Result<()> {
        use libbpf_rs::skel::Skel;
        maps::pin_object_maps(self.skel.object(), dir, &[])?;
        Ok(maps::pin_object_maps(self.ring.skel.object(), dir, RingObject::SHARED_MAPS)?)
    }
}
