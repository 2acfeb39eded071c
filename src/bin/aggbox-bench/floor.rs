//! The floor aggregator (`src/bpf/bench_floor.bpf.c`), loaded and
//! configured: the yardstick of experiment 1 and of `benches/xdp_chain.rs`
//! (which includes this file).

use std::mem::MaybeUninit;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject};

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
    _object: Box<MaybeUninit<OpenObject>>,
}

impl Floor {
    /// Load and configure it (`frags`: fragments per round, the slot-index
    /// stride between rounds; 0 = every round uses the same slots).
    pub fn load(port: u16, result_port: u16, workers: u32, frags: u32) -> Result<Floor> {
        let mut object: Box<MaybeUninit<OpenObject>> = Box::new(MaybeUninit::uninit());
        // SAFETY: the box's allocation never moves and outlives the
        // skeleton (field order drops the skeleton first).
        let object_ref: &'static mut MaybeUninit<OpenObject> =
            unsafe { &mut *(object.as_mut() as *mut MaybeUninit<OpenObject>) };
        let open = floor_skel::BenchFloorSkelBuilder::default()
            .open(object_ref)
            .context("opening bench_floor")?;
        let skel = open.load().context("loading bench_floor")?;
        let mut cfg = Vec::with_capacity(16);
        for v in [u32::from(port), u32::from(result_port), workers, frags] {
            cfg.extend_from_slice(&v.to_ne_bytes());
        }
        skel.maps
            .floor_cfg
            .update(&0u32.to_ne_bytes(), &cfg, MapFlags::ANY)
            .context("floor_cfg")?;
        Ok(Floor { skel, _object: object })
    }

    /// The program (attach, run statistics, BPF_PROG_TEST_RUN).
    pub fn prog(&self) -> &libbpf_rs::ProgramMut<'static> {
        &self.skel.progs.bench_floor
    }
}

