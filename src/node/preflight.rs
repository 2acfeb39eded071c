//! What `aggbox attach` checks before loading anything: root, BTF and the
//! kernel release against the features the programs use.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::ifindex;

/// Everything needed before loading anything: fails with one clear line.
pub fn preflight(iface: &str) -> Result<u32> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("aggbox: must run as root (CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN are needed)");
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!("aggbox: the kernel has no BTF (/sys/kernel/btf/vmlinux is missing); AggBox needs CONFIG_DEBUG_INFO_BTF=y");
    }
    let uname = nix::sys::utsname::uname().context("aggbox: reading the kernel release (uname)")?;
    check_kernel_release(&uname.release().to_string_lossy())?;
    ifindex(iface)
}

/// Kernel features AggBox's programs use, with the release that brought
/// each: the newest of them is the hard floor.
pub const KERNEL_FEATURES: &[(&str, (u32, u32))] = &[
    ("bpf_spin_lock in map values", (5, 1)),
    ("link-based XDP attach", (5, 9)),
    ("bpf_redirect_neigh", (5, 10)),
    ("BPF atomics (-mcpu=v3)", (5, 12)),
    ("bpf_timer", (5, 15)),
];

/// Features of the frags chain only ([`Chain::Frags`]); a kernel without
/// them runs the linear chain (datagrams up to [`Chain::max_mtu`]).
pub const FRAGS_CHAIN_FEATURES: &[(&str, (u32, u32))] = &[
    ("bpf_loop", (5, 17)),
    ("XDP multi-buffer (xdp.frags, bpf_xdp_load_bytes)", (5, 18)),
];

/// The oldest kernel AggBox runs on: the release of the newest of
/// [`KERNEL_FEATURES`]. README and docs/MATRIX.md state the same number.
pub const MIN_KERNEL: (u32, u32) = (5, 15);

/// The oldest kernel the kernel-version matrix (`make matrix`) tests.
pub const MIN_TESTED_KERNEL: (u32, u32) = (6, 1);

// The floor is what the feature table says, not a second number to keep in step.
const _: () = {
    let mut i = 0;
    let mut newest = (0, 0);
    while i < KERNEL_FEATURES.len() {
        let since = KERNEL_FEATURES[i].1;
        if since.0 > newest.0 || (since.0 == newest.0 && since.1 > newest.1) {
            newest = since;
        }
        i += 1;
    }
    assert!(newest.0 == MIN_KERNEL.0 && newest.1 == MIN_KERNEL.1, "MIN_KERNEL must be the newest of KERNEL_FEATURES");
};

/// `major.minor` of a kernel release string such as `6.1.0-57-cloud-amd64`.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Check the running kernel's release string (`uname -r`): see
/// [`check_kernel_version`]. A release that does not start with
/// `MAJOR.MINOR` is an error, not a skipped check: the feature test would
/// otherwise pass silently on any kernel.
pub fn check_kernel_release(release: &str) -> Result<()> {
    let Some(version) = kernel_version(release) else {
        bail!(
            "aggbox: cannot read the kernel version from the release {release:?} (expected MAJOR.MINOR..., as `uname -r` prints); AggBox needs Linux {}.{} or newer",
            MIN_KERNEL.0,
            MIN_KERNEL.1
        );
    };
    check_kernel_version(release, version)
}

/// Refuse kernels that lack a feature the programs use, naming it; kernels
/// between that floor and the oldest tested one only get a warning.
pub fn check_kernel_version(release: &str, version: (u32, u32)) -> Result<()> {
    let missing: Vec<String> = KERNEL_FEATURES
        .iter()
        .filter(|(_, since)| version < *since)
        .map(|(name, (a, b))| format!("{name} ({a}.{b})"))
        .collect();
    if !missing.is_empty() {
        bail!(
            "aggbox: kernel {release} is too old: AggBox needs Linux {}.{} or newer (missing: {}; see README, Requirements)",
            MIN_KERNEL.0,
            MIN_KERNEL.1,
            missing.join(", ")
        );
    }
    if version < MIN_TESTED_KERNEL {
        eprintln!(
            "aggbox: warning: kernel {release} has every feature AggBox uses but is older than {}.{}, the oldest kernel it is tested on",
            MIN_TESTED_KERNEL.0, MIN_TESTED_KERNEL.1
        );
    }
    Ok(())
}

#[cfg(test)]
mod kernel_version_tests {
    use super::*;

    #[test]
    fn parses_release_strings() {
        assert_eq!(kernel_version("6.1.0-57-cloud-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("6.18.44-fc-v509"), Some((6, 18)));
        assert_eq!(kernel_version("5.15.0"), Some((5, 15)));
        assert_eq!(kernel_version("garbage"), None);
    }

    #[test]
    fn old_kernels_are_refused_with_the_missing_features() {
        let err = check_kernel_version("5.14.0", (5, 14)).unwrap_err().to_string();
        assert!(err.contains("bpf_timer (5.15)"), "{err}");
        assert!(!err.contains("atomics"), "5.14 has BPF atomics: {err}");
        let err = check_kernel_version("5.10.0", (5, 10)).unwrap_err().to_string();
        assert!(err.contains("BPF atomics (-mcpu=v3) (5.12)") && err.contains("bpf_timer (5.15)"), "{err}");
        // Without bpf_loop and multi-buffer XDP the linear chain runs.
        assert!(check_kernel_version("5.15.0-91-generic", (5, 15)).is_ok());
        assert!(check_kernel_version("5.18.0", (5, 18)).is_ok());
        assert!(check_kernel_version("6.18.44", (6, 18)).is_ok());
    }

    /// The refusal names the floor the check enforces (5.15, as README and
    /// docs/MATRIX.md say), not the oldest tested kernel.
    #[test]
    fn refusal_names_the_enforced_minimum() {
        let err = check_kernel_release("5.14.21-150400").unwrap_err().to_string();
        assert_eq!(
            err,
            "aggbox: kernel 5.14.21-150400 is too old: AggBox needs Linux 5.15 or newer (missing: bpf_timer (5.15); see README, Requirements)"
        );
        assert!(!err.contains("6.1"), "{err}");
        assert!(check_kernel_release("5.15.0-91-generic").is_ok());
    }

    #[test]
    fn unparsable_release_is_an_error() {
        for release in ["", "garbage", "6", "6.x-rc1", "v6.1.0"] {
            let err = check_kernel_release(release).unwrap_err().to_string();
            assert_eq!(
                err,
                format!("aggbox: cannot read the kernel version from the release {release:?} (expected MAJOR.MINOR..., as `uname -r` prints); AggBox needs Linux 5.15 or newer")
            );
        }
    }
}
