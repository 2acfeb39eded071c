//! The bpffs that holds the pins: mounted when missing, and the hints for
//! pins another mount namespace hides.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// `statfs` magic of a bpffs mount.
pub(super) const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where bpffs is mounted by convention (and where `ensure_bpffs` mounts one).
pub(super) const SYS_FS_BPF: &str = "/sys/fs/bpf";

/// Make sure `pin_root` is on a bpffs, mounting one at /sys/fs/bpf when the
/// root is under it and nothing is mounted there yet (the usual case on a
/// fresh host and inside `ip netns exec`). Returns whether it mounted one.
pub fn ensure_bpffs(pin_root: &Path) -> Result<bool> {
    let sys_fs_bpf = Path::new(SYS_FS_BPF);
    let mut mounted = false;
    if pin_root.starts_with(sys_fs_bpf) && !is_bpffs(sys_fs_bpf) {
        fs::create_dir_all(sys_fs_bpf).ok();
        nix::mount::mount(Some("bpf"), sys_fs_bpf, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
            .context("aggbox: mounting bpffs on /sys/fs/bpf")?;
        mounted = true;
    }
    fs::create_dir_all(pin_root).with_context(|| format!("aggbox: creating {}", pin_root.display()))?;
    if !is_bpffs(pin_root) {
        bail!("aggbox: {} is not on a bpffs (mount -t bpf bpf DIR)", pin_root.display());
    }
    Ok(mounted)
}

/// Whether this process runs in a mount namespace other than PID 1's, as
/// every command started by `ip netns exec` does (it unshares the mount
/// namespace to remount /sys for the network namespace). Where PID 1's
/// namespace cannot be read (a sandbox or container may hide it), the
/// parent's is compared instead: `ip netns exec` execs the command, so its
/// parent is the shell or supervisor that ran `ip`. `None` when neither can
/// be read.
pub fn in_private_mount_namespace() -> Option<bool> {
    let own = fs::read_link("/proc/self/ns/mnt").ok()?;
    let parent = format!("/proc/{}/ns/mnt", std::os::unix::process::parent_id());
    ["/proc/1/ns/mnt", parent.as_str()]
        .iter()
        .find_map(|other| fs::read_link(other).ok())
        .map(|other| other != own)
}

/// The warning `attach` prints after mounting a bpffs on /sys/fs/bpf in a
/// private mount namespace: that mount, and so every pin under `pin_root`,
/// exists only in this process's namespace, so other `ip netns exec`
/// commands (`aggbox status`, `aggbox detach`) see nothing, and the attachment
/// ends with the process even after `kill -9` (the pins are what outlive it).
pub fn private_bpffs_warning(pin_root: &Path) -> String {
    format!(
        "mounted a bpffs on {SYS_FS_BPF} in this process's own mount namespace (as under `ip netns exec`, which remounts /sys for each command): \
         the pins under {} are invisible to other processes, so `aggbox status` and `aggbox detach` run by another `ip netns exec` will say \"not attached\", \
         and the attachment ends with this process; to share the pins, mount a bpffs outside /sys once from the host \
         (mkdir -p /run/aggbox/bpf && mount -t bpf bpf /run/aggbox/bpf) and give every aggbox command --pin-root /run/aggbox/bpf/NETNS (see README, \"Network namespaces\")",
        pin_root.display()
    )
}

/// A hint for `status` and `detach` when nothing is found under `pin_root`
/// because no bpffs is mounted where it would be in this mount namespace
/// (a fresh /sys under `ip netns exec`): the attach may well be running, with
/// its pins in its own namespace.
pub fn hidden_pins_hint(pin_root: &Path) -> Option<String> {
    let sys_fs_bpf = Path::new(SYS_FS_BPF);
    if !pin_root.starts_with(sys_fs_bpf) || is_bpffs(sys_fs_bpf) {
        return None;
    }
    Some(format!(
        "no bpffs is mounted on {SYS_FS_BPF} in this mount namespace (as under `ip netns exec`): an `aggbox attach` started the same way keeps its pins in its own namespace, out of sight here; attach, status and detach need a shared --pin-root (see README, \"Network namespaces\")"
    ))
}

// `f_type`'s width differs between architectures: the cast is needed on some.
#[allow(clippy::unnecessary_cast)]
pub(super) fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type().0 as i64 == BPF_FS_MAGIC)
        .unwrap_or(false)
}
