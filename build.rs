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
