//! The floor aggregator (`src/bpf/bench_floor.bpf.c`), loaded and
//! configured: the yardstick of experiment 1 and of `benches/xdp_chain.rs`
//! (which includes this file).


use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use aggbox::kernel::object::ObjectSlot;
use libbpf_rs::{MapCore, MapFlags};

/// Elements of `bench_floor`'s fragments (its `FLOOR_PER`: MTU 1500) and
/// of `bench_floor_frags`'s chunks.
pub const FLOOR_PER: u32 = 362;
/// Largest fragment `bench_floor_frags` takes (its `FLOOR_MAX_ELEMS`).
pub const FLOOR_MAX_ELEMS: u32 = 16370;
/// Slots of either program (its `FLOOR_SLOTS`); a fragment of
/// `bench_floor_frags` takes one per chunk of [`FLOOR_PER`] elements.
pub const FLOOR_SLOTS: u32 = 32768;

#[allow(clippy::all, missing_docs, dead_code)]
mod floor_skel {
    include!(concat!(env!("OUT_DIR"), "/bench_floor.skel.rs"));
}

/// The floor aggregator (`src/bpf/bench_floor.bpf.c`): the least any XDP
/// aggregator of this benchmark's traffic costs (one array slot per
/// fragment, direct packet access, one lock, the adds, the RESULT rewrite;
/// no validation, no dedup beyond a rank bitmap, SUM only). Loaded
/// configured for `workers` ranks on `port`, RESULTs to `result_port`.
pub struct Floor {
    skel: floor_skel::BenchFloorSkel<'static>,
    _object: ObjectSlot,
    /// port, result port, workers (`floor_cfg`'s first three fields).
    job: [u32; 3],
    /// Elements of a full fragment for `bench_floor_frags` (`floor_cfg.per`).
    per: std::sync::atomic::AtomicU32,
}

impl Floor {
    /// Load and configure it: slot = fragment number mod all of the floor's
    /// slots, the same for every round, until `set_index`.
    pub fn load(port: u16, result_port: u16, workers: u32) -> Result<Floor> {
        let (object, object_ref) = ObjectSlot::new();
        let open = floor_skel::BenchFloorSkelBuilder::default()
            .open(object_ref)
            .context("opening bench_floor")?;
        let skel = open.load().context("loading bench_floor")?;
        let floor = Floor {
            skel,
            _object: object,
            job: [u32::from(port), u32::from(result_port), workers],
            per: std::sync::atomic::AtomicU32::new(FLOOR_PER),
        };
        floor.set_index(0, 0)?;
        Ok(floor)
    }

    /// The slot index: slot = (round · `frags` + fragment) mod `slots`
    /// (a power of two; 0 = all of the floor's slots). The isolated loop of
    /// `benches/xdp_chain.rs` gives it the region AggBox gives the same
    /// job, so that both keep the same memory in use.
    pub fn set_index(&self, frags: u32, slots: u32) -> Result<()> {
        anyhow::ensure!(slots == 0 || slots.is_power_of_two(), "floor slots {slots}: not a power of two");
        let mask = if slots == 0 { u32::MAX } else { slots - 1 };
        let mut cfg = Vec::with_capacity(24);
        for v in [self.job[0], self.job[1], self.job[2], frags, mask, self.per.load(std::sync::atomic::Ordering::Relaxed)] {
            cfg.extend_from_slice(&v.to_ne_bytes());
        }
        self.skel
            .maps
            .floor_cfg
            .update(&0u32.to_ne_bytes(), &cfg, MapFlags::ANY)
            .context("floor_cfg")
    }

    /// The program (attach, run statistics, BPF_PROG_TEST_RUN).
    pub fn prog(&self) -> &libbpf_rs::ProgramMut<'static> {
        &self.skel.progs.bench_floor
    }

    /// The multi-buffer program for fragments of `per` elements (up to
    /// [`FLOOR_MAX_ELEMS`]; MTU 9000 and 65535): attach it instead of
    /// [`Floor::prog`], after `set_per` and before `set_index`.
    pub fn prog_frags(&self) -> &libbpf_rs::ProgramMut<'static> {
        &self.skel.progs.bench_floor_frags
    }

    /// The full fragment's elements `bench_floor_frags` indexes by (taken
    /// by the next [`Floor::set_index`]).
    pub fn set_per(&self, per: u32) -> Result<()> {
        anyhow::ensure!((1..=FLOOR_MAX_ELEMS).contains(&per), "floor fragments of {per} elements: 1..={FLOOR_MAX_ELEMS}");
        self.per.store(per, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

