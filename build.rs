//! Builds one libbpf-rs skeleton per `src/bpf/*.bpf.c` into `$OUT_DIR`.
//!
//! The programs compile against the vendored `src/bpf/vmlinux/vmlinux.h`, so
//! the build does not depend on the build host's kernel, and against the
//! shared ABI headers in `include/`. libbpf-cargo only tracks the `.bpf.c`
//! files it is given, so every header is listed for `rerun-if-changed` here.
//!
//! The evaluation's yardsticks, `src/bpf/bench_*.bpf.c`, are built only with
//! the `bench` feature (Cargo.toml): only `aggbox-bench` and
//! `benches/xdp_chain.rs`, which require it, load them.
//!
//! It also turns the op table, `include/aggbox/ops.def`, into the Rust `Op`
//! (`$OUT_DIR/ops.rs`, included by `src/wire/abi.rs`): the C side reads the
//! same rows with X-macros.

use std::env;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};

use libbpf_cargo::SkeletonBuilder;

fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_with_extension(&path, ext));
        } else if path.to_string_lossy().ends_with(ext) {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let bpf_dir = manifest_dir.join("src/bpf");
    let include_dir = manifest_dir.join("include");
    let vmlinux_dir = bpf_dir.join("vmlinux");

    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    println!("cargo:rerun-if-changed={}", include_dir.display());
    for header in files_with_extension(&bpf_dir, ".h").into_iter().chain(files_with_extension(&include_dir, ".h")) {
        println!("cargo:rerun-if-changed={}", header.display());
    }

    let ops_def = include_dir.join("aggbox/ops.def");
    println!("cargo:rerun-if-changed={}", ops_def.display());
    let table = fs::read_to_string(&ops_def).unwrap_or_else(|err| panic!("reading {}: {err}", ops_def.display()));
    fs::write(out_dir.join("ops.rs"), ops_rs(&parse_ops(&table))).expect("writing ops.rs");

    let bench = env::var_os("CARGO_FEATURE_BENCH").is_some();
    let sources = files_with_extension(&bpf_dir, ".bpf.c");
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
        let stem = source
            .file_name()
            .and_then(OsStr::to_str)
            .and_then(|name| name.strip_suffix(".bpf.c"))
            .expect("source names end in .bpf.c");
        if stem.starts_with("bench_") && !bench {
            continue;
        }
        let skeleton = out_dir.join(format!("{stem}.skel.rs"));
        let clang = env::var("BPF_CLANG").unwrap_or_else(|_| "clang".to_string());
        SkeletonBuilder::new()
            .source(source)
            .clang(&clang)
            .clang_args([
                OsStr::new("-I"),
                vmlinux_dir.as_os_str(),
                OsStr::new("-I"),
                include_dir.as_os_str(),
                OsStr::new("-I"),
                bpf_dir.as_os_str(),
                // v3: 32-bit jumps and BPF atomics (fetch_add, cmpxchg).
                OsStr::new("-mcpu=v3"),
                OsStr::new("-Wall"),
                OsStr::new("-Werror"),
            ])
            .build_and_generate(&skeleton)
            .unwrap_or_else(|err| panic!("building BPF skeleton for {}: {err:#}", source.display()));
    }
}

/// One row of `include/aggbox/ops.def`.
struct OpRow {
    number: u8,
    /// `SUM`
    upper: String,
    /// `sum`
    name: String,
    identity: String,
    combine: String,
    finish: String,
    floats: bool,
    kernel: bool,
    ring: bool,
    /// `MPI_SUM`, `None` for `MPI_OP_NULL`.
    mpi: Option<String>,
}

/// The arguments of `AGGBOX_OP(...)`, split at the commas outside parentheses.
fn split_args(args: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut depth = 0;
    for ch in args.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(String::new());
                continue;
            }
            _ => {}
        }
        out.last_mut().expect("one at least").push(ch);
    }
    out.into_iter().map(|a| a.trim().to_string()).collect()
}

fn flag(row: &str, value: &str) -> bool {
    match value {
        "0" => false,
        "1" => true,
        _ => panic!("ops.def: {row}: a 0/1 column holds {value:?}"),
    }
}

/// The table's rows; panics (failing the build) on a malformed one, a gap
/// or a repeat in the numbers, a repeated name.
fn parse_ops(table: &str) -> Vec<OpRow> {
    let mut rows: Vec<OpRow> = Vec::new();
    for line in table.lines() {
        let Some(rest) = line.trim().strip_prefix("AGGBOX_OP(") else {
            continue;
        };
        let args = rest.strip_suffix(')').unwrap_or_else(|| panic!("ops.def: {line}: no closing parenthesis"));
        let a = split_args(args);
        assert_eq!(a.len(), 10, "ops.def: {line}: 10 columns");
        let row = OpRow {
            number: a[0].parse().unwrap_or_else(|_| panic!("ops.def: {line}: number")),
            upper: a[1].clone(),
            name: a[2].trim_matches('"').to_string(),
            identity: a[3].clone(),
            combine: a[4].clone(),
            finish: a[5].clone(),
            floats: flag(line, &a[6]),
            kernel: flag(line, &a[7]),
            ring: flag(line, &a[8]),
            mpi: (a[9] != "MPI_OP_NULL").then(|| a[9].clone()),
        };
        assert_eq!(row.number as usize, rows.len(), "ops.def: {line}: numbers run 0, 1, 2, ... in order");
        assert!(row.name.eq_ignore_ascii_case(&row.upper), "ops.def: {line}: name is NAME in lower case");
        assert!(!rows.iter().any(|r| r.name == row.name), "ops.def: {line}: name repeated");
        rows.push(row);
    }
    assert!(!rows.is_empty() && rows.len() <= 32, "ops.def: 1..=32 ops (the C masks are 32-bit)");
    rows
}

/// `SUM` -> `Sum`.
fn variant(upper: &str) -> String {
    let lower = upper.to_ascii_lowercase();
    let mut c = lower.chars();
    c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
}

/// The Rust `Op` of the rows.
fn ops_rs(rows: &[OpRow]) -> String {
    let n = rows.len();
    let arms = |f: &dyn Fn(&OpRow) -> String| -> String {
        rows.iter().map(|r| format!("            Op::{} => {},\n", variant(&r.upper), f(r))).collect()
    };
    let variants: String = rows
        .iter()
        .map(|r| format!("    /// `AGGBOX_OP_{}`: \"{}\".\n    {} = {},\n", r.upper, r.name, variant(&r.upper), r.number))
        .collect();
    let all: String = rows.iter().map(|r| format!("Op::{}, ", variant(&r.upper))).collect();
    let names: String = rows.iter().map(|r| format!("\"{}\", ", r.name)).collect();
    format!(
        r#"// Generated by build.rs from include/aggbox/ops.def: edit the table, not this.

/// `enum aggbox_op`: the AGG1 ops, one per row of `include/aggbox/ops.def`.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {{
{variants}}}

/// The words the table's expressions are written in, as `src/bpf/ops.h`
/// defines them for BPF: int64, wrapping, except that `mul` saturates (BPF
/// multiplies only a weight by an element, which cannot overflow; PROD in
/// user space must keep its sign and stay out of the int32 range).
#[allow(dead_code)]
mod ops_vocabulary {{
    pub const I32_MIN: i64 = i32::MIN as i64;
    pub const I32_MAX: i64 = i32::MAX as i64;
    #[inline(always)]
    pub fn add(x: i64, y: i64) -> i64 {{
        x.wrapping_add(y)
    }}
    #[inline(always)]
    pub fn mul(x: i64, y: i64) -> i64 {{
        x.saturating_mul(y)
    }}
    #[inline(always)]
    pub fn nz(x: i64) -> i64 {{
        (x != 0) as i64
    }}
    #[inline(always)]
    pub fn max(x: i64, y: i64) -> i64 {{
        x.max(y)
    }}
    #[inline(always)]
    pub fn min(x: i64, y: i64) -> i64 {{
        x.min(y)
    }}
    #[inline(always)]
    pub fn and(x: i64, y: i64) -> i64 {{
        x & y
    }}
    #[inline(always)]
    pub fn or(x: i64, y: i64) -> i64 {{
        x | y
    }}
    #[inline(always)]
    pub fn xor(x: i64, y: i64) -> i64 {{
        x ^ y
    }}
    /// Toward zero; a weight sum of 0 divides by 1.
    #[inline(always)]
    pub fn div(r: i64, ws: i64) -> i64 {{
        if ws == 0 {{
            r
        }} else {{
            r.wrapping_div(ws)
        }}
    }}
}}

impl Op {{
    /// Every op, in wire-number order.
    pub const ALL: [Op; {n}] = [{all}];

    /// The names [`Op::from_name`] takes (lower case), in wire-number order.
    pub const NAMES: [&'static str; {n}] = [{names}];

    /// The op of wire value `v`.
    pub fn from_u8(v: u8) -> Option<Op> {{
        Op::ALL.get(v as usize).copied()
    }}

    /// Upper case, as logs and docs print it: `SUM`.
    pub fn name(self) -> &'static str {{
        match self {{
{upper}        }}
    }}

    /// The op named `name` (any case).
    pub fn from_name(name: &str) -> Option<Op> {{
        Op::ALL.iter().copied().find(|op| op.name().eq_ignore_ascii_case(name))
    }}

    /// [`Op::NAMES`] joined by ", ", for an error that lists the valid names.
    pub fn names_list() -> String {{
        Op::NAMES.join(", ")
    }}

    /// The int32 that leaves every element unchanged under [`Op::combine`]
    /// (padding, an empty accumulator).
    pub fn identity(self) -> i32 {{
        use ops_vocabulary::*;
        let v: i64 = match self {{
{identity}        }};
        v as i32
    }}

    /// Accumulator `a` combined with element `v` of a sender of weight `w`
    /// (weights scale SUM and AVG only), in int64 as the BPF programs do.
    #[inline]
    pub fn combine(self, a: i64, v: i32, w: i32) -> i64 {{
        use ops_vocabulary::*;
        let (v, w) = (v as i64, w as i64);
        match self {{
{combine}        }}
    }}

    /// The result of accumulator `r` with weight sum `ws`, before the clamp
    /// to int32 (AVG divides, toward zero).
    #[inline]
    pub fn finish(self, r: i64, ws: i64) -> i64 {{
        use ops_vocabulary::*;
        match self {{
{finish}        }}
    }}

    /// Valid on FLOAT32 payloads.
    pub fn valid_on_floats(self) -> bool {{
        match self {{
{floats}        }}
    }}

    /// The XDP program aggregates it itself (integer payloads only).
    pub fn runs_in_kernel(self) -> bool {{
        match self {{
{kernel}        }}
    }}

    /// The ring program (docs/RING.md) combines it hop by hop.
    pub fn runs_in_ring(self) -> bool {{
        match self {{
{ring}        }}
    }}

    /// The MPI op it serves (`MPI_SUM`), if any.
    pub fn mpi_name(self) -> Option<&'static str> {{
        match self {{
{mpi}        }}
    }}
}}
"#,
        upper = arms(&|r| format!("\"{}\"", r.upper)),
        identity = arms(&|r| r.identity.clone()),
        combine = arms(&|r| r.combine.clone()),
        finish = arms(&|r| r.finish.clone()),
        floats = arms(&|r| r.floats.to_string()),
        kernel = arms(&|r| r.kernel.to_string()),
        ring = arms(&|r| r.ring.to_string()),
        mpi = arms(&|r| r.mpi.as_ref().map_or("None".to_string(), |m| format!("Some(\"{m}\")"))),
    )
}
