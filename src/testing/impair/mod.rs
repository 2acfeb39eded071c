//! Loss and duplication injection for the netns tests and the evaluation
//! (this kernel has no sch_netem), included with `#[path]` by
//! tests/runtime_netns.rs, tests/runtime_kernel.rs, tests/node_served.rs and
//! `aggbox-bench` (never part of the library):
//! a hand-assembled TC (cls_bpf, direct-action) program on a switch port's
//! egress that drops with probability `loss`, else clones the packet to the
//! same port's egress (a duplicate) with probability `dup`, and counts what
//! it did in an array map, so a test can assert that the impairment was
//! really applied ([`Injector::counts`]). It sees skbs: a UDP GSO batch
//! crosses the switch as one and is dropped or duplicated whole.
//!
//! Every failure (no such port, the program does not load, the clsact qdisc
//! or the filter cannot be made or removed) is an error naming the port:
//! a test must never run "under loss" that was not applied.
#![allow(dead_code)]

pub mod asm;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use libbpf_rs::MapCore;

use asm::{Asm, CLONE_REDIRECT, GET_PRANDOM_U32, JEQ_IMM, JLT_IMM, JNE_IMM, MAP_LOOKUP_ELEM};

/// Index of the injector's `counts` array map.
const DROPPED: u32 = 0;
const DUPLICATED: u32 = 1;
/// `bpf_clone_redirect` failed: the duplicate was not made.
const CLONE_FAILED: u32 = 2;
const COUNTERS: u32 = 3;

/// What the injector programs did, summed over every program an
/// [`Injector`] attached.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub dropped: u64,
    pub duplicated: u64,
    pub clone_failed: u64,
}

aggbox::fieldwise! {
    impl Add::add, Sub::sub for Counts { dropped, duplicated, clone_failed }
}

/// The injectors of one testbed. Keeps every counter map it created (a
/// replaced program's map stays readable), so [`Injector::counts`] only
/// grows.
#[derive(Default)]
pub struct Injector {
    maps: Mutex<Vec<libbpf_rs::MapHandle>>,
}

fn threshold(p: f64) -> i32 {
    (p.clamp(0.0, 0.4999) * 4_294_967_296.0) as i32
}

/// The injector program for `ifindex`, counting into `counts`.
fn program(ifindex: u32, loss: f64, dup: f64, counts: i32) -> Vec<asm::Insn> {
    let mut a = Asm::new();
    a.mov(6, 1) // r6 = skb
        .call(GET_PRANDOM_U32)
        .jump_if(JLT_IMM, 0, threshold(loss), "drop")
        .call(GET_PRANDOM_U32)
        .jump_if(JLT_IMM, 0, threshold(dup), "clone")
        .mov_imm(0, 0) // TC_ACT_OK
        .exit();
    a.label("drop")
        .mov_imm(7, 2) // TC_ACT_SHOT
        .store_imm_u32(10, -4, DROPPED as i32)
        .goto("count");
    a.label("clone")
        .mov(1, 6)
        .mov_imm(2, ifindex as i32)
        .mov_imm(3, 0) // egress
        .call(CLONE_REDIRECT)
        .mov_imm(7, 0) // TC_ACT_OK: the original goes on
        .store_imm_u32(10, -4, DUPLICATED as i32)
        .jump_if(JEQ_IMM, 0, 0, "count")
        .store_imm_u32(10, -4, CLONE_FAILED as i32);
    a.label("count")
        .mov(2, 10)
        .add_imm(2, -4)
        .load_map_fd(1, counts)
        .call(MAP_LOOKUP_ELEM)
        .jump_if(JNE_IMM, 0, 0, "add")
        .mov(0, 7)
        .exit();
    a.label("add").mov_imm(1, 1).atomic_add_u64(0, 0, 1).mov(0, 7).exit();
    a.finish()
}

/// Remove any clsact qdisc (and with it any injector) from `port`.
fn clear(port: &str) -> Result<()> {
    let out = std::process::Command::new("tc")
        .args(["qdisc", "del", "dev", port, "clsact"])
        .output()
        .context("running tc (iproute2)")?;
    let err = String::from_utf8_lossy(&out.stderr);
    // None there is fine; anything else leaves an impairment in place.
    if !out.status.success() && !err.contains("Cannot find specified qdisc") && !err.contains("Invalid handle") {
        bail!("removing the impairment from {port}: tc qdisc del: {}", err.trim());
    }
    Ok(())
}

impl Injector {
    pub fn new() -> Injector {
        Injector::default()
    }

    /// Runs in the switch namespace: replaces `port`'s impairment (none
    /// when `loss` and `dup` are both 0).
    pub fn set(&self, port: &str, loss: f64, dup: f64) -> Result<()> {
        clear(port)?;
        if loss <= 0.0 && dup <= 0.0 {
            return Ok(());
        }
        let name = std::ffi::CString::new(port).context("port name")?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            bail!("impairing {port}: no such interface ({})", std::io::Error::last_os_error());
        }
        // SAFETY: zeroed opts with sz set are libbpf's defaults.
        let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
        let counts = libbpf_rs::MapHandle::create(libbpf_rs::MapType::Array, Some("impair_counts"), 4, 8, COUNTERS, &opts)
            .with_context(|| format!("impairing {port}: creating the counter map"))?;
        let insns = program(ifindex, loss, dup, counts.as_fd().as_raw_fd());
        let fd: OwnedFd = asm::load("impair", libbpf_sys::BPF_PROG_TYPE_SCHED_CLS, 0, 0, &insns)
            .with_context(|| format!("impairing {port}: loading the injector"))?;
        let mut b = libbpf_rs::TcHookBuilder::new(fd.as_fd());
        b.ifindex(ifindex as i32).replace(true).handle(1).priority(1);
        let mut hook = b.hook(libbpf_rs::TC_EGRESS);
        hook.create().with_context(|| format!("impairing {port}: creating the clsact qdisc"))?;
        hook.attach()
            .with_context(|| format!("impairing {port}: attaching the injector (loss {loss}, dup {dup}) to egress"))?;
        self.maps.lock().unwrap().push(counts);
        Ok(())
    }

    /// What every injector attached so far did.
    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for m in self.maps.lock().unwrap().iter() {
            let get = |k: u32| -> u64 {
                let v = m.lookup(&k.to_ne_bytes(), libbpf_rs::MapFlags::ANY).expect("reading the injector's counters");
                u64::from_ne_bytes(v.expect("array entry").as_slice().try_into().expect("u64 counter"))
            };
            c.dropped += get(DROPPED);
            c.duplicated += get(DUPLICATED);
            c.clone_failed += get(CLONE_FAILED);
        }
        c
    }
}
