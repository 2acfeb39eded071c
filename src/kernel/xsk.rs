//! A raw-libc AF_XDP socket (receive only), one per RX queue.
//!
//! xsk-rs pins an older libbpf-sys than libbpf-rs 0.27, so this is written
//! against `libc`'s `if_xdp.h` definitions directly: a UMEM of fixed-size
//! frames, its fill and completion rings, an RX ring, bound in copy mode
//! (`XDP_COPY`) to one `(ifindex, queue)`. The XDP program redirects frames
//! into it through the `xsks` XSKMAP (see `XdpPlane::register_xsk`).
//!
//! Every frame of the UMEM is always either in the fill ring (owned by the
//! kernel) or being read by [`XskSocket::recv`] (which hands it straight
//! back), so the fill ring can never run dry because of us.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

/// `sockaddr_xdp.sxdp_flags`: multi-buffer RX/TX (linux/if_xdp.h, 6.6+).
const XDP_USE_SG: u16 = 1 << 4;
/// `xdp_desc.options`: more descriptors of the same packet follow.
const XDP_PKT_CONTD: u32 = 1 << 0;

/// Sizes of one socket's UMEM and rings (powers of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XskConfig {
    /// Frames in the UMEM; also the fill ring's size.
    pub frames: u32,
    /// Bytes per frame (2048 or 4096; holds one MTU-1500 frame).
    pub frame_size: u32,
    /// Descriptors of the RX ring.
    pub rx_size: u32,
}

impl Default for XskConfig {
    fn default() -> Self {
        XskConfig {
            frames: 4096,
            frame_size: 2048,
            rx_size: 2048,
        }
    }
}

/// One mmapped ring (producer/consumer indexes + descriptors).
struct Ring {
    map: *mut libc::c_void,
    map_len: usize,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    desc: *mut u8,
    mask: u32,
}

impl Ring {
    /// mmap the ring at page offset `pgoff` of socket `fd`.
    fn map(
        fd: RawFd,
        off: &libc::xdp_ring_offset,
        size: u32,
        entry: usize,
        pgoff: u64,
    ) -> io::Result<Ring> {
        let map_len = off.desc as usize + size as usize * entry;
        // SAFETY: mapping a region the kernel offers for this socket; the
        // result is checked against MAP_FAILED.
        let map = unsafe {
            libc::mmap(
                ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = map.cast::<u8>();
        // SAFETY: the offsets come from XDP_MMAP_OFFSETS and lie inside the map.
        unsafe {
            Ok(Ring {
                map,
                map_len,
                producer: base.add(off.producer as usize).cast(),
                consumer: base.add(off.consumer as usize).cast(),
                desc: base.add(off.desc as usize),
                mask: size - 1,
            })
        }
    }

    fn producer(&self) -> &AtomicU32 {
        // SAFETY: points into the live mapping, aligned by the kernel.
        unsafe { &*self.producer }
    }

    fn consumer(&self) -> &AtomicU32 {
        // SAFETY: as above.
        unsafe { &*self.consumer }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe {
            libc::munmap(self.map, self.map_len);
        }
    }
}

/// Counters the kernel keeps for one AF_XDP socket (`XDP_STATISTICS`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct XskStats {
    /// Frames dropped for other reasons than a full ring.
    pub rx_dropped: u64,
    /// Frames dropped because the RX ring was full.
    pub rx_ring_full: u64,
    /// Times the fill ring was empty when a frame arrived.
    pub rx_fill_ring_empty: u64,
    /// Invalid descriptors.
    pub rx_invalid_descs: u64,
}

/// An AF_XDP socket bound to one RX queue in copy mode, receive only.
pub struct XskSocket {
    // Field order: rings are unmapped before the socket closes.
    rx: Ring,
    fill: Ring,
    _comp: Ring,
    fd: OwnedFd,
    umem: *mut libc::c_void,
    umem_len: usize,
    frame_size: u32,
    ifindex: u32,
    queue: u32,
    /// Bound with XDP_USE_SG (multi-buffer packets are reassembled).
    multi_buffer: bool,
    /// Pieces of a multi-buffer packet received so far.
    pending: Vec<u8>,
}

// SAFETY: the raw pointers refer to mappings owned by this value; it is used
// by one thread at a time (`&mut self` for every ring access).
unsafe impl Send for XskSocket {}

impl std::fmt::Debug for XskSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XskSocket")
            .field("fd", &self.fd.as_raw_fd())
            .field("ifindex", &self.ifindex)
            .field("queue", &self.queue)
            .finish()
    }
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: value is a live T of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn ctx(what: &str, err: io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("AF_XDP {what}: {err}"))
}

impl XskSocket {
    /// Create a socket with its own UMEM and bind it in copy mode to queue
    /// `queue` of interface `ifindex` (in the calling thread's network
    /// namespace).
    pub fn open(ifindex: u32, queue: u32, cfg: XskConfig) -> io::Result<XskSocket> {
        if !cfg.frames.is_power_of_two() || !cfg.rx_size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "AF_XDP ring sizes must be powers of two",
            ));
        }
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(ctx("socket", io::Error::last_os_error()));
        }
        // SAFETY: we own the fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };

        let umem_len = cfg.frames as usize * cfg.frame_size as usize;
        // SAFETY: anonymous private mapping, checked below.
        let umem = unsafe {
            libc::mmap(
                ptr::null_mut(),
                umem_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if umem == libc::MAP_FAILED {
            return Err(ctx("UMEM mmap", io::Error::last_os_error()));
        }
        let free_umem = |e: io::Error| {
            // SAFETY: unmapping the UMEM mapped above.
            unsafe { libc::munmap(umem, umem_len) };
            e
        };

        let reg = libc::xdp_umem_reg {
            addr: umem as u64,
            len: umem_len as u64,
            chunk_size: cfg.frame_size,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        let setup = || -> io::Result<()> {
            setsockopt(fd.as_raw_fd(), libc::XDP_UMEM_REG, &reg).map_err(|e| ctx("UMEM_REG", e))?;
            setsockopt(fd.as_raw_fd(), libc::XDP_UMEM_FILL_RING, &cfg.frames)
                .map_err(|e| ctx("FILL_RING", e))?;
            // The completion ring is mandatory even for a receive-only socket.
            setsockopt(fd.as_raw_fd(), libc::XDP_UMEM_COMPLETION_RING, &64u32)
                .map_err(|e| ctx("COMPLETION_RING", e))?;
            setsockopt(fd.as_raw_fd(), libc::XDP_RX_RING, &cfg.rx_size).map_err(|e| ctx("RX_RING", e))
        };
        setup().map_err(free_umem)?;

        // SAFETY: zeroed plain struct, filled by getsockopt.
        let mut off: libc::xdp_mmap_offsets = unsafe { std::mem::zeroed() };
        let mut optlen = std::mem::size_of::<libc::xdp_mmap_offsets>() as libc::socklen_t;
        // SAFETY: off/optlen describe a live buffer.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_XDP,
                libc::XDP_MMAP_OFFSETS,
                (&mut off as *mut libc::xdp_mmap_offsets).cast(),
                &mut optlen,
            )
        };
        if rc < 0 {
            return Err(free_umem(ctx("MMAP_OFFSETS", io::Error::last_os_error())));
        }

        let rings = (|| -> io::Result<(Ring, Ring, Ring)> {
            let rx = Ring::map(
                fd.as_raw_fd(),
                &off.rx,
                cfg.rx_size,
                std::mem::size_of::<libc::xdp_desc>(),
                libc::XDP_PGOFF_RX_RING as u64,
            )
            .map_err(|e| ctx("RX ring mmap", e))?;
            let fill = Ring::map(fd.as_raw_fd(), &off.fr, cfg.frames, 8, libc::XDP_UMEM_PGOFF_FILL_RING)
                .map_err(|e| ctx("fill ring mmap", e))?;
            let comp = Ring::map(fd.as_raw_fd(), &off.cr, 64, 8, libc::XDP_UMEM_PGOFF_COMPLETION_RING)
                .map_err(|e| ctx("completion ring mmap", e))?;
            Ok((rx, fill, comp))
        })();
        let (rx, fill, comp) = rings.map_err(free_umem)?;

        // Hand every frame to the kernel.
        for i in 0..cfg.frames {
            // SAFETY: index < ring size; fill descriptors are u64 addresses.
            unsafe {
                fill.desc
                    .cast::<u64>()
                    .add((i & fill.mask) as usize)
                    .write(u64::from(i) * u64::from(cfg.frame_size));
            }
        }
        fill.producer().store(cfg.frames, Ordering::Release);

        // Copy mode with multi-buffer RX (XDP_USE_SG, kernel 6.6+): frames
        // larger than one UMEM frame (jumbo MTU) are delivered in pieces;
        // without it the kernel drops them. Kernels without it refuse the
        // flag (EINVAL / EOPNOTSUPP): then bind without it.
        let mut sa = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            // AGGBOX_XSK_NO_SG (tests): bind as a kernel before 6.6 would.
            sxdp_flags: if std::env::var_os("AGGBOX_XSK_NO_SG").is_some() {
                libc::XDP_COPY
            } else {
                libc::XDP_COPY | XDP_USE_SG
            },
            sxdp_ifindex: ifindex,
            sxdp_queue_id: queue,
            sxdp_shared_umem_fd: 0,
        };
        // The kernel keeps a queue busy for a moment after its previous
        // socket closed (EBUSY): retry for up to ~3 s.
        let mut tries = 0;
        loop {
            // SAFETY: sa is a live sockaddr_xdp of the size passed.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&sa as *const libc::sockaddr_xdp).cast(),
                    std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
            let err = io::Error::last_os_error();
            if sa.sxdp_flags & XDP_USE_SG != 0
                && matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::EOPNOTSUPP))
            {
                sa.sxdp_flags &= !XDP_USE_SG;
                continue;
            }
            if err.raw_os_error() == Some(libc::EBUSY) && tries < 30 {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
            drop((rx, fill, comp));
            return Err(free_umem(ctx(
                &format!("bind to ifindex {ifindex} queue {queue}"),
                err,
            )));
        }

        Ok(XskSocket {
            rx,
            fill,
            _comp: comp,
            fd,
            umem,
            umem_len,
            frame_size: cfg.frame_size,
            ifindex,
            queue,
            multi_buffer: sa.sxdp_flags & XDP_USE_SG != 0,
            pending: Vec::new(),
        })
    }

    /// Whether the socket receives packets larger than one UMEM frame
    /// (bound with XDP_USE_SG; kernel 6.6+).
    pub fn multi_buffer(&self) -> bool {
        self.multi_buffer
    }

    /// The longest frame (bytes) this socket receives: `None` with
    /// multi-buffer, else the UMEM frame size minus its headroom (0) minus
    /// the XDP_PACKET_HEADROOM the kernel keeps (`abi::XSK_RX_HEADROOM`).
    pub fn max_frame(&self) -> Option<u32> {
        (!self.multi_buffer).then(|| self.frame_size.saturating_sub(crate::wire::abi::XSK_RX_HEADROOM).max(1))
    }

    /// The socket descriptor (to register in the XSKMAP and to poll).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The RX queue it is bound to.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// The interface it is bound to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Receive up to `max` frames, calling `f` on each (the whole Ethernet
    /// frame), and give their buffers back to the kernel. Returns how many
    /// were received. Never blocks.
    pub fn recv(&mut self, max: u32, mut f: impl FnMut(&[u8])) -> usize {
        let prod = self.rx.producer().load(Ordering::Acquire);
        let cons = self.rx.consumer().load(Ordering::Relaxed);
        let n = prod.wrapping_sub(cons).min(max);
        if n == 0 {
            return 0;
        }
        let fill_prod = self.fill.producer().load(Ordering::Relaxed);
        for i in 0..n {
            let idx = cons.wrapping_add(i) & self.rx.mask;
            // SAFETY: idx < ring size; RX descriptors are xdp_desc.
            let desc: libc::xdp_desc = unsafe {
                self.rx
                    .desc
                    .cast::<libc::xdp_desc>()
                    .add(idx as usize)
                    .read_volatile()
            };
            let addr = desc.addr as usize;
            let len = desc.len as usize;
            if addr + len <= self.umem_len {
                // SAFETY: the range lies inside the UMEM (checked), and the
                // kernel does not write this frame until it is refilled.
                let frame =
                    unsafe { std::slice::from_raw_parts(self.umem.cast::<u8>().add(addr), len) };
                // Multi-buffer (XDP_USE_SG): a packet larger than one UMEM
                // frame arrives as several descriptors, all but the last
                // flagged XDP_PKT_CONTD; reassemble it (docs/JUMBO.md).
                if desc.options & XDP_PKT_CONTD != 0 {
                    self.pending.extend_from_slice(frame);
                } else if !self.pending.is_empty() {
                    self.pending.extend_from_slice(frame);
                    f(&self.pending);
                    self.pending.clear();
                } else {
                    f(frame);
                }
            }
            let base = desc.addr & !(u64::from(self.frame_size) - 1);
            let fidx = fill_prod.wrapping_add(i) & self.fill.mask;
            // SAFETY: fidx < fill ring size; the ring has room: every frame
            // we give back is one the kernel took from it.
            unsafe {
                self.fill.desc.cast::<u64>().add(fidx as usize).write(base);
            }
        }
        self.rx.consumer().store(cons.wrapping_add(n), Ordering::Release);
        self.fill
            .producer()
            .store(fill_prod.wrapping_add(n), Ordering::Release);
        n as usize
    }

    /// The kernel's counters for this socket.
    pub fn stats(&self) -> io::Result<XskStats> {
        // SAFETY: zeroed plain struct filled by getsockopt.
        let mut st: libc::xdp_statistics = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::xdp_statistics>() as libc::socklen_t;
        // SAFETY: st/len describe a live buffer.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_XDP,
                libc::XDP_STATISTICS,
                (&mut st as *mut libc::xdp_statistics).cast(),
                &mut len,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(XskStats {
            rx_dropped: st.rx_dropped,
            rx_ring_full: st.rx_ring_full,
            rx_fill_ring_empty: st.rx_fill_ring_empty_descs,
            rx_invalid_descs: st.rx_invalid_descs,
        })
    }
}

impl Drop for XskSocket {
    fn drop(&mut self) {
        // Rings are unmapped by their own Drop after this; the UMEM must
        // outlive the socket's registration, which ends when the fd closes
        // (also after this body): unmapping the UMEM first is still safe
        // because the kernel pinned its pages at XDP_UMEM_REG.
        // SAFETY: unmapping the UMEM mapped in `open`.
        unsafe {
            libc::munmap(self.umem, self.umem_len);
        }
    }
}

/// Number of RX queues of interface `ifname` in the calling thread's network
/// namespace: ETHTOOL_GCHANNELS (rx or combined), else 1.
///
/// (`/sys/class/net/IFACE/queues` shows the namespace sysfs was mounted
/// in, not the caller's, so the ioctl is asked first.)
pub fn rx_queue_count(ifname: &str) -> u32 {
    #[repr(C)]
    #[derive(Default)]
    struct EthtoolChannels {
        cmd: u32,
        max_rx: u32,
        max_tx: u32,
        max_other: u32,
        max_combined: u32,
        rx_count: u32,
        tx_count: u32,
        other_count: u32,
        combined_count: u32,
    }
    const ETHTOOL_GCHANNELS: u32 = 0x3c;
    const SIOCETHTOOL: libc::c_ulong = 0x8946;

    let mut ch = EthtoolChannels {
        cmd: ETHTOOL_GCHANNELS,
        ..Default::default()
    };
    // SAFETY: zeroed ifreq, name copied with a terminating NUL.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(ifname.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_data = (&mut ch as *mut EthtoolChannels).cast();
    // SAFETY: plain socket(2); closed below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let mut n = 0;
    if sock >= 0 {
        // SAFETY: ifr points at ch, both live for the call.
        let rc = unsafe { libc::ioctl(sock, SIOCETHTOOL as _, &mut ifr) };
        if rc == 0 {
            n = ch.rx_count.max(ch.combined_count);
        }
        // SAFETY: closing the socket opened above.
        unsafe { libc::close(sock) };
    }
    if n == 0 {
        n = std::fs::read_dir(format!("/sys/class/net/{ifname}/queues"))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
                    .count() as u32
            })
            .unwrap_or(0);
    }
    n.clamp(1, crate::wire::abi::MAX_QUEUES)
}
