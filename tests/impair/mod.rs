//! Loss and duplication injection for netns tests (this kernel has no
//! sch_netem), shared by tests/runtime_netns.rs and tests/runtime_kernel.rs:
//! a hand-assembled TC (cls_bpf, direct-action) program that drops with
//! probability `loss`, else clones the packet to the same port's egress (a
//! duplicate) with probability `dup`.
#![allow(dead_code)]

use std::os::fd::{AsFd, FromRawFd, OwnedFd};

#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn ins(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: (src << 4) | dst, off, imm }
}

#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    pad: [u8; 128],
}

fn threshold(p: f64) -> i32 {
    (p.clamp(0.0, 0.4999) * 4_294_967_296.0) as i32
}

fn load(ifindex: u32, loss: f64, dup: f64) -> OwnedFd {
    let prog = [
        ins(0xbf, 6, 1, 0, 0),                 // r6 = r1 (skb)
        ins(0x85, 0, 0, 0, 7),                 // call get_prandom_u32
        ins(0xa5, 0, 0, 1, threshold(loss)),   // if r0 < T_loss (unsigned) goto drop
        ins(0x05, 0, 0, 2, 0),                 // goto dup
        ins(0xb7, 0, 0, 0, 2),                 // drop: r0 = TC_ACT_SHOT
        ins(0x95, 0, 0, 0, 0),                 // exit
        ins(0x85, 0, 0, 0, 7),                 // dup: call get_prandom_u32
        ins(0xa5, 0, 0, 1, threshold(dup)),    // if r0 < T_dup goto clone
        ins(0x05, 0, 0, 4, 0),                 // goto pass
        ins(0xbf, 1, 6, 0, 0),                 // clone: r1 = skb
        ins(0xb7, 2, 0, 0, ifindex as i32),    // r2 = ifindex
        ins(0xb7, 3, 0, 0, 0),                 // r3 = 0 (egress)
        ins(0x85, 0, 0, 0, 13),                // call clone_redirect
        ins(0xb7, 0, 0, 0, 0),                 // pass: r0 = TC_ACT_OK
        ins(0x95, 0, 0, 0, 0),                 // exit
    ];
    let license = b"GPL\0";
    let mut log = vec![0u8; 65536];
    let attr = ProgLoadAttr {
        prog_type: 3, // BPF_PROG_TYPE_SCHED_CLS
        insn_cnt: prog.len() as u32,
        insns: prog.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        pad: [0; 128],
    };
    // SAFETY: attr points at live buffers for the duration of the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 5 /* BPF_PROG_LOAD */, &attr as *const _ as usize, std::mem::size_of::<ProgLoadAttr>()) };
    assert!(fd >= 0, "BPF_PROG_LOAD: {} {}", std::io::Error::last_os_error(), String::from_utf8_lossy(&log).trim_end_matches('\0'));
    // SAFETY: a fresh fd we own.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// Runs in the switch namespace: replaces port's impairment.
pub fn set(port: &str, loss: f64, dup: f64) {
    let _ = std::process::Command::new("tc").args(["qdisc", "del", "dev", port, "clsact"]).output();
    if loss <= 0.0 && dup <= 0.0 {
        return;
    }
    let name = std::ffi::CString::new(port).unwrap();
    // SAFETY: valid C string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert!(ifindex > 0, "no interface {port}");
    let fd = load(ifindex, loss, dup);
    let mut b = libbpf_rs::TcHookBuilder::new(fd.as_fd());
    b.ifindex(ifindex as i32).replace(true).handle(1).priority(1);
    let mut hook = b.hook(libbpf_rs::TC_EGRESS);
    hook.create().ok();
    hook.attach().expect("attach impairment");
}
