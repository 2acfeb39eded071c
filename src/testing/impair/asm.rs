//! eBPF programs assembled by hand, for test instruments too small to be
//! worth a C build: the loss/duplication injector (src/testing/impair/mod.rs) and
//! the tail-call budget probe of tests/bpf_jumbo.rs. Jumps name labels; the
//! offsets are resolved by [`Asm::finish`].
#![allow(dead_code)]

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

/// `struct bpf_insn`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}
const _: () = assert!(std::mem::size_of::<Insn>() == 8);

const fn ins(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: (src << 4) | dst, off, imm }
}

/// `BPF_FUNC_*` ids used here.
pub const MAP_LOOKUP_ELEM: i32 = 1;
pub const GET_PRANDOM_U32: i32 = 7;
pub const TAIL_CALL: i32 = 12;
pub const CLONE_REDIRECT: i32 = 13;

/// Conditional jump opcodes (`BPF_JMP | BPF_K | op`).
pub const JEQ_IMM: u8 = 0x15;
pub const JNE_IMM: u8 = 0x55;
/// Unsigned `<`.
pub const JLT_IMM: u8 = 0xa5;

/// An instruction list with labels.
#[derive(Default)]
pub struct Asm {
    insns: Vec<Insn>,
    labels: HashMap<&'static str, usize>,
    fixups: Vec<(usize, &'static str)>,
}

impl Asm {
    pub fn new() -> Asm {
        Asm::default()
    }

    fn push(&mut self, i: Insn) -> &mut Asm {
        self.insns.push(i);
        self
    }

    /// `dst = src` (64 bit).
    pub fn mov(&mut self, dst: u8, src: u8) -> &mut Asm {
        self.push(ins(0xbf, dst, src, 0, 0))
    }

    /// `dst = imm` (64 bit, sign-extended).
    pub fn mov_imm(&mut self, dst: u8, imm: i32) -> &mut Asm {
        self.push(ins(0xb7, dst, 0, 0, imm))
    }

    /// `dst += imm` (64 bit).
    pub fn add_imm(&mut self, dst: u8, imm: i32) -> &mut Asm {
        self.push(ins(0x07, dst, 0, 0, imm))
    }

    /// `dst = *(u64 *)(src + off)`.
    pub fn load_u64(&mut self, dst: u8, src: u8, off: i16) -> &mut Asm {
        self.push(ins(0x79, dst, src, off, 0))
    }

    /// `*(u64 *)(dst + off) = src`.
    pub fn store_u64(&mut self, dst: u8, off: i16, src: u8) -> &mut Asm {
        self.push(ins(0x7b, dst, src, off, 0))
    }

    /// `*(u32 *)(dst + off) = imm`.
    pub fn store_imm_u32(&mut self, dst: u8, off: i16, imm: i32) -> &mut Asm {
        self.push(ins(0x62, dst, 0, off, imm))
    }

    /// `lock *(u64 *)(dst + off) += src`.
    pub fn atomic_add_u64(&mut self, dst: u8, off: i16, src: u8) -> &mut Asm {
        self.push(ins(0xdb, dst, src, off, 0))
    }

    /// `dst = map` (`BPF_LD | BPF_IMM | BPF_DW`, `BPF_PSEUDO_MAP_FD`).
    pub fn load_map_fd(&mut self, dst: u8, fd: i32) -> &mut Asm {
        self.push(ins(0x18, dst, 1, 0, fd));
        self.push(ins(0, 0, 0, 0, 0))
    }

    /// Call helper `id`.
    pub fn call(&mut self, id: i32) -> &mut Asm {
        self.push(ins(0x85, 0, 0, 0, id))
    }

    pub fn exit(&mut self) -> &mut Asm {
        self.push(ins(0x95, 0, 0, 0, 0))
    }

    /// `if dst <op> imm goto label`.
    pub fn jump_if(&mut self, code: u8, dst: u8, imm: i32, label: &'static str) -> &mut Asm {
        self.fixups.push((self.insns.len(), label));
        self.push(ins(code, dst, 0, 0, imm))
    }

    /// `goto label`.
    pub fn goto(&mut self, label: &'static str) -> &mut Asm {
        self.fixups.push((self.insns.len(), label));
        self.push(ins(0x05, 0, 0, 0, 0))
    }

    /// The next instruction is `label`.
    pub fn label(&mut self, label: &'static str) -> &mut Asm {
        let prev = self.labels.insert(label, self.insns.len());
        assert!(prev.is_none(), "label {label} defined twice");
        self
    }

    /// The instructions, jump offsets resolved.
    pub fn finish(&mut self) -> Vec<Insn> {
        let mut out = self.insns.clone();
        for &(at, label) in &self.fixups {
            let to = *self.labels.get(label).unwrap_or_else(|| panic!("no label {label}"));
            out[at].off = (to as i64 - at as i64 - 1) as i16;
        }
        out
    }
}

/// Load `insns` as a program of `prog_type` (`BPF_PROG_TYPE_*`) with
/// `expected_attach_type` and `prog_flags`; the verifier's log is in the error.
pub fn load(name: &str, prog_type: u32, expected_attach_type: u32, prog_flags: u32, insns: &[Insn]) -> Result<OwnedFd> {
    let mut log = vec![0u8; 1 << 16];
    // SAFETY: zeroed opts are valid; sz set; the log buffer outlives the call.
    let mut opts: libbpf_sys::bpf_prog_load_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<libbpf_sys::bpf_prog_load_opts>() as _;
    opts.expected_attach_type = expected_attach_type;
    opts.prog_flags = prog_flags;
    opts.log_buf = log.as_mut_ptr().cast();
    opts.log_size = log.len() as u32;
    opts.log_level = 1;
    let cname = std::ffi::CString::new(name).context("program name")?;
    // SAFETY: Insn has struct bpf_insn's layout (8 bytes, same fields); every
    // pointer is to a live buffer for the duration of the call.
    let fd = unsafe {
        libbpf_sys::bpf_prog_load(
            prog_type,
            cname.as_ptr(),
            c"GPL".as_ptr(),
            insns.as_ptr().cast(),
            insns.len() as _,
            &mut opts,
        )
    };
    if fd < 0 {
        bail!(
            "BPF_PROG_LOAD of {name}: {}\n{}",
            std::io::Error::from_raw_os_error(-fd),
            String::from_utf8_lossy(&log).trim_end_matches('\0')
        );
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
