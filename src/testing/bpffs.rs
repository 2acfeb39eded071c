//! A private bpffs for pins of attachments made inside testbed namespaces:
//! shared by the evaluation (`aggbox-bench`) and the tests, which include
//! this file with `#[path]`; never part of the library.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// A bpffs mounted on a fresh directory under /tmp (pins of attachments made
/// inside testbed namespaces), unmounted and removed on drop.
#[derive(Debug)]
pub struct PrivateBpffs {
    /// Mount point.
    pub path: PathBuf,
}

impl PrivateBpffs {
    /// Mount one.
    pub fn mount(tag: &str) -> Result<PrivateBpffs> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = PathBuf::from(format!(
            "/tmp/aggbox-bpffs-{tag}-{}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        nix::mount::mount(
            Some("bpf"),
            &path,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("mounting bpffs on {}", path.display()))?;
        Ok(PrivateBpffs { path })
    }
}

/// Unmounts every [`PrivateBpffs`] this process mounted (for a signal
/// handler, where their destructors will not run).
pub fn unmount_all_of_this_process() {
    let mine = "aggbox-bpffs-";
    let pid = format!("-{}-", std::process::id());
    let Ok(dir) = std::fs::read_dir("/tmp") else { return };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(mine) && name.contains(&pid) {
            let _ = nix::mount::umount2(&entry.path(), nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.path);
    }
}

