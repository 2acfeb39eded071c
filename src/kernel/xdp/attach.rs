//! Attaching the XDP entry program to an interface with a BPF link.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use crate::kernel::maps;

use super::{Result, XdpError, XdpPlane};

/// How the XDP program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// Driver (native) mode, `XDP_FLAGS_DRV_MODE`.
    Native,
    /// Generic (skb) mode, `XDP_FLAGS_SKB_MODE`: works everywhere, slower.
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Native => libbpf_sys::XDP_FLAGS_DRV_MODE,
            XdpMode::Generic => libbpf_sys::XDP_FLAGS_SKB_MODE,
        }
    }
}

/// A BPF link holding the XDP program on an interface; detaches when dropped
/// (unless pinned).
#[derive(Debug)]
pub struct XdpLink {
    fd: OwnedFd,
    ifindex: u32,
    mode: XdpMode,
}

impl XdpLink {
    /// The mode the program ended up attached in.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }

    /// Interface index the link is attached to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Pin the link to a bpffs path so it outlives this process.
    pub fn pin(&self, path: &Path) -> Result<()> {
        Ok(maps::pin(self.fd.as_fd(), path)?)
    }

    /// Detach now (same as dropping the link, but explicit).
    pub fn detach(self) -> Result<()> {
        // SAFETY: plain syscall wrapper on a link fd we own.
        let rc = unsafe { libbpf_sys::bpf_link_detach(self.fd.as_raw_fd()) };
        if rc < 0 {
            return Err(XdpError::Attach {
                ifindex: self.ifindex,
                source: std::io::Error::from_raw_os_error(-rc),
            });
        }
        Ok(())
    }
}

impl AsFd for XdpLink {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl XdpPlane {
    /// Attach the XDP entry program to `ifindex` with a BPF link. In
    /// [`XdpMode::Native`] a driver without native XDP falls back to generic
    /// mode; the second value then carries a warning to show the operator.
    pub fn attach_xdp(&self, ifindex: u32, mode: XdpMode) -> Result<(XdpLink, Option<String>)> {
        match self.link_xdp(ifindex, mode) {
            Ok(link) => Ok((link, None)),
            Err(native_err) if mode == XdpMode::Native => {
                let link = self
                    .link_xdp(ifindex, XdpMode::Generic)
                    .map_err(|source| XdpError::Attach { ifindex, source })?;
                let warning = format!("native XDP unavailable on ifindex {ifindex} ({native_err}); attached in generic mode");
                Ok((link, Some(warning)))
            }
            Err(source) => Err(XdpError::Attach { ifindex, source }),
        }
    }

    fn link_xdp(&self, ifindex: u32, mode: XdpMode) -> std::io::Result<XdpLink> {
        let prog_fd = self.xdp_prog_fd().as_raw_fd();
        // SAFETY: zeroed opts are valid; sz set as libbpf requires.
        let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _;
        opts.flags = mode.flags();
        // SAFETY: valid program fd, opts initialised above.
        let fd = unsafe {
            libbpf_sys::bpf_link_create(prog_fd, ifindex as i32, libbpf_sys::BPF_XDP, &opts)
        };
        if fd < 0 {
            return Err(std::io::Error::from_raw_os_error(-fd));
        }
        // SAFETY: the kernel just returned this fd to us; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(XdpLink { fd, ifindex, mode })
    }
}
