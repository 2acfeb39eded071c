//! The datagram transport under a communicator, and its test hook.
//!
//! Every datagram a communicator sends or receives goes through one
//! [`Transport`]. Production uses [`UdpTransport`] (the communicator's UDP
//! socket, nothing added). [`ImpairedTransport`] wraps any transport and, on
//! the receive side, drops, duplicates and reorders datagrams within a window,
//! deciding with a seeded pseudo-random generator — the test hook for
//! reordering and duplication, which this kernel cannot inject (no netem, and
//! a BPF program cannot delay packets). It sits *under* the I/O driver,
//! so the impaired runs exercise exactly the production code paths of
//! [`crate::wire::reliability`], fragmentation and reassembly; it is used
//! only when a builder is given an [`Impairment`].
//!
//! [`Net`] is what the I/O driver (`runtime::driver`) holds: the
//! transport plus the communicator's counters ([`CommStats`]), counted on
//! the way out and in; it is the [`crate::runtime::outbox::Transmit`] the
//! driver hands the state machine's datagrams to.
//!
//! The impairment hook is in `impaired.rs`, the counters in `stats.rs`.

use std::fmt;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::wire::abi;

mod impaired;
mod stats;

pub use impaired::{ImpairControl, ImpairCounters, ImpairStats, ImpairedTransport, Impairment};
pub use stats::{CommStats, Counters, IoStats, Refusal, RefusedStats};

pub(crate) use crate::wire::rng::Rng;

/// Most datagrams one batched system call carries ([`Transport::send_batch`],
/// [`Transport::recv_batch`]); longer batches are split.
pub const BATCH_MAX: usize = 64;

/// Bytes of one receive slot of [`Transport::recv_batch`]: the largest UDP
/// datagram fits, whatever the MTU (a slot's pages are touched only as far
/// as its datagram reaches).
pub const RECV_SLOT: usize = 65536;

/// Length and source of one datagram received by [`Transport::recv_batch`].
#[derive(Debug, Clone, Copy)]
pub struct RecvMeta {
    /// Bytes of the datagram (in its slot).
    pub len: usize,
    /// Its source.
    pub from: SocketAddr,
}

impl Default for RecvMeta {
    fn default() -> Self {
        RecvMeta {
            len: 0,
            from: SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0),
        }
    }
}

/// A datagram transport: what the I/O driver sends and receives with.
///
/// The batch methods have defaults that loop over `send_to` / `recv_from`
/// (so a wrapper such as [`ImpairedTransport`] only implements those);
/// [`UdpTransport`] implements them with `sendmmsg` / `recvmmsg`.
pub trait Transport: Send + fmt::Debug {
    /// Sends one datagram to `to` (errors count as loss).
    fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<usize>;
    /// Receives one datagram without blocking (`WouldBlock` when none).
    fn recv_from(&mut self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)>;
    /// The file descriptor to wait on for readability.
    fn raw_fd(&self) -> RawFd;

    /// Sends every datagram of `msgs` (bytes, destination), in order; returns
    /// how many the socket took (the others count as lost: a full socket
    /// buffer, an ICMP error reported on this send).
    fn send_batch(&self, msgs: &[(&[u8], SocketAddr)]) -> usize {
        msgs.iter()
            .filter(|(b, to)| self.send_to(b, *to).is_ok())
            .count()
    }

    /// Receives up to `meta.len()` datagrams without blocking, datagram `k`
    /// into `buf[k * slot..(k + 1) * slot]` with its length and source in
    /// `meta[k]`; returns how many (`WouldBlock` when none).
    fn recv_batch(
        &mut self,
        buf: &mut [u8],
        slot: usize,
        meta: &mut [RecvMeta],
    ) -> io::Result<usize> {
        let n = meta.len().min(buf.len() / slot.max(1));
        let mut got = 0;
        while got < n {
            match self.recv_from(&mut buf[got * slot..(got + 1) * slot]) {
                Ok((len, from)) => {
                    meta[got] = RecvMeta { len, from };
                    got += 1;
                }
                Err(e) if got == 0 => return Err(e),
                Err(_) => break,
            }
        }
        Ok(got)
    }

    /// [`Transport::send_batch`] with runs of consecutive datagrams to one
    /// destination and of one length (the last of a run may be shorter)
    /// sent as UDP GSO super-datagrams (`UDP_SEGMENT`: at most 64 datagrams
    /// and 65507 bytes each), which the kernel segments after the stack:
    /// one pass through UDP/IP (and, on a veth, the bridge) per run instead
    /// of per datagram. Only for paths that keep datagrams apart to their
    /// receiver: no TC program that parses them on the way (a TC broadcast
    /// group), no generic-mode XDP aggregator. The default (and a socket
    /// whose kernel refuses GSO) sends them one by one.
    fn send_batch_gso(&self, msgs: &[(&[u8], SocketAddr)]) -> GsoSent {
        GsoSent {
            datagrams: self.send_batch(msgs),
            ..GsoSent::default()
        }
    }

    /// Sends `buf` as datagrams of `segment` bytes (the last may be shorter)
    /// to `to`; [`UdpTransport`] hands it to the kernel as one UDP GSO
    /// super-datagram (`UDP_SEGMENT`), segmented after the stack. Returns the
    /// bytes sent. Not used on the kernel backend's contribution path (see
    /// `docs/RUNTIME.md`, "Batched I/O and what XDP sees").
    fn send_segments(&self, buf: &[u8], segment: usize, to: SocketAddr) -> io::Result<usize> {
        let mut sent = 0;
        for c in buf.chunks(segment.max(1)) {
            sent += self.send_to(c, to)?;
        }
        Ok(sent)
    }
}

/// What one [`Transport::send_batch_gso`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GsoSent {
    /// Datagrams the socket took (super-datagrams counted by their
    /// segments).
    pub datagrams: usize,
    /// UDP GSO super-datagrams among the sends (2 datagrams or more each).
    pub super_datagrams: usize,
    /// Datagrams inside them.
    pub segments: usize,
}

/// The production transport: a non-blocking UDP socket, batches through
/// `sendmmsg` / `recvmmsg`.
#[derive(Debug)]
pub struct UdpTransport {
    socket: UdpSocket,
    /// Set once the kernel refused a UDP GSO send on this socket (no
    /// checksum offload on the route's device, `SO_NO_CHECK`, a kernel
    /// before 4.18): [`Transport::send_batch_gso`] then sends one by one.
    gso_refused: AtomicBool,
}

impl UdpTransport {
    /// A transport over `socket` (non-blocking).
    pub fn new(socket: UdpSocket) -> UdpTransport {
        UdpTransport {
            socket,
            gso_refused: AtomicBool::new(false),
        }
    }

    /// The socket.
    pub fn socket(&self) -> &UdpSocket {
        &self.socket
    }

    /// Whether the kernel refused UDP GSO on this socket (sends since are
    /// single datagrams).
    pub fn gso_refused(&self) -> bool {
        self.gso_refused.load(Ordering::Relaxed)
    }
}

/// Errors with which the kernel refuses a UDP GSO send as such (not the
/// datagram): the socket falls back to single datagrams for good.
fn refuses_gso(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
    )
}

/// A socket address as the kernel takes it, IPv4 (`sockaddr_in`) or IPv6
/// (`sockaddr_in6`), in storage that holds either; with its length.
#[derive(Clone, Copy)]
#[repr(C)]
union RawAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl RawAddr {
    /// All zero (family 0), as `recvmmsg` fills it.
    fn zeroed() -> RawAddr {
        // SAFETY: plain C structs, all-zero is valid.
        unsafe { std::mem::zeroed() }
    }

    fn ptr(&mut self) -> *mut libc::c_void {
        self as *mut RawAddr as *mut libc::c_void
    }

    /// The room `recvmmsg` may fill: either family.
    const SIZE: libc::socklen_t = std::mem::size_of::<RawAddr>() as libc::socklen_t;
}

/// `a` as the kernel takes it, and its length.
fn sockaddr_of(a: SocketAddr) -> (RawAddr, libc::socklen_t) {
    match a {
        SocketAddr::V4(a) => (
            RawAddr {
                v4: libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                    sin_zero: [0; 8],
                },
            },
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        ),
        SocketAddr::V6(a) => (
            RawAddr {
                v6: libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                    sin6_scope_id: a.scope_id(),
                },
            },
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        ),
    }
}

/// The address the kernel wrote (an IPv4-mapped IPv6 source, which a
/// dual-stack socket reports for IPv4 traffic, as the IPv4 address it is).
fn addr_of(sa: &RawAddr) -> SocketAddr {
    // SAFETY: both members start with the family; each is read only when
    // the family says it is the one written.
    unsafe {
        if sa.v6.sin6_family == libc::AF_INET6 as libc::sa_family_t {
            let ip = std::net::Ipv6Addr::from(sa.v6.sin6_addr.s6_addr);
            let port = u16::from_be(sa.v6.sin6_port);
            match ip.to_ipv4_mapped() {
                Some(v4) => SocketAddr::new(v4.into(), port),
                None => SocketAddr::V6(std::net::SocketAddrV6::new(ip, port, u32::from_be(sa.v6.sin6_flowinfo), sa.v6.sin6_scope_id)),
            }
        } else {
            SocketAddr::new(std::net::Ipv4Addr::from(u32::from_be(sa.v4.sin_addr.s_addr)).into(), u16::from_be(sa.v4.sin_port))
        }
    }
}

/// `UDP_SEGMENT` (linux/udp.h), the UDP GSO segment size option / cmsg.
pub const UDP_SEGMENT: libc::c_int = 103;

/// Largest UDP payload of one IPv4 datagram (65535 − 20 − 8), also the
/// most one UDP GSO send carries (over IPv6 too: the kernel bounds a GSO
/// send's payload by the UDP length field, 65535 − 8, and this keeps one
/// bound for both families).
pub const UDP_MAX_PAYLOAD: usize = 65507;

/// Most segments of one UDP GSO send (`UDP_MAX_SEGMENTS`).
pub const UDP_MAX_SEGMENTS: usize = 64;

impl Transport for UdpTransport {
    fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<usize> {
        self.socket.send_to(buf, to)
    }
    fn recv_from(&mut self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        self.socket.recv_from(buf)
    }
    fn raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    fn send_batch(&self, msgs: &[(&[u8], SocketAddr)]) -> usize {
        let mut total = 0;
        for chunk in msgs.chunks(BATCH_MAX) {
            // SAFETY (zeroed): plain C structs, all-zero is valid.
            let mut addrs: [(RawAddr, libc::socklen_t); BATCH_MAX] = [(RawAddr::zeroed(), 0); BATCH_MAX];
            let mut iovs: [libc::iovec; BATCH_MAX] = unsafe { std::mem::zeroed() };
            let mut hdrs: [libc::mmsghdr; BATCH_MAX] = unsafe { std::mem::zeroed() };
            for (k, (b, to)) in chunk.iter().enumerate() {
                addrs[k] = sockaddr_of(*to);
                iovs[k] = libc::iovec {
                    iov_base: b.as_ptr() as *mut libc::c_void,
                    iov_len: b.len(),
                };
            }
            for k in 0..chunk.len() {
                hdrs[k].msg_hdr.msg_name = addrs[k].0.ptr();
                hdrs[k].msg_hdr.msg_namelen = addrs[k].1;
                hdrs[k].msg_hdr.msg_iov = &mut iovs[k];
                hdrs[k].msg_hdr.msg_iovlen = 1;
            }
            let mut off = 0;
            while off < chunk.len() {
                // SAFETY: hdrs[off..len] point at live iovecs / addresses whose
                // buffers (`chunk`'s slices) outlive the call.
                let r = unsafe {
                    libc::sendmmsg(
                        self.socket.as_raw_fd(),
                        hdrs.as_mut_ptr().add(off),
                        (chunk.len() - off) as libc::c_uint,
                        0,
                    )
                };
                if r > 0 {
                    off += r as usize;
                    total += r as usize;
                } else {
                    // The datagram at `off` failed (e.g. ENOBUFS, or an ICMP
                    // error reported here): count it lost and go on.
                    if r < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    off += 1;
                }
            }
        }
        total
    }

    fn send_batch_gso(&self, msgs: &[(&[u8], SocketAddr)]) -> GsoSent {
        let mut out = GsoSent::default();
        let mut i = 0;
        while i < msgs.len() {
            if self.gso_refused() {
                out.datagrams += self.send_batch(&msgs[i..]);
                return out;
            }
            // One sendmmsg: up to BATCH_MAX datagrams in up to BATCH_MAX
            // messages, each a run (GSO when 2 or more).
            // SAFETY (zeroed): plain C structs, all-zero is valid.
            let mut addrs: [(RawAddr, libc::socklen_t); BATCH_MAX] = [(RawAddr::zeroed(), 0); BATCH_MAX];
            let mut iovs: [libc::iovec; BATCH_MAX] = unsafe { std::mem::zeroed() };
            let mut hdrs: [libc::mmsghdr; BATCH_MAX] = unsafe { std::mem::zeroed() };
            let mut control = [[0u64; 4]; BATCH_MAX]; // 32 bytes each, >= CMSG_SPACE(2)
            let mut runs = [(0usize, 0usize); BATCH_MAX]; // (first message, datagrams)
            let mut nruns = 0;
            let mut ndgrams = 0;
            while i < msgs.len() && ndgrams < BATCH_MAX {
                let (first, to) = msgs[i];
                let size = first.len();
                let (mut n, mut bytes) = (0, 0);
                while i + n < msgs.len() && ndgrams + n < BATCH_MAX && n < UDP_MAX_SEGMENTS {
                    let (b, t) = msgs[i + n];
                    if t != to || b.len() > size || bytes + b.len() > UDP_MAX_PAYLOAD {
                        break;
                    }
                    iovs[ndgrams + n] = libc::iovec {
                        iov_base: b.as_ptr() as *mut libc::c_void,
                        iov_len: b.len(),
                    };
                    bytes += b.len();
                    n += 1;
                    if b.len() < size {
                        break; // a shorter datagram ends the run
                    }
                }
                addrs[nruns] = sockaddr_of(to);
                let h = &mut hdrs[nruns].msg_hdr;
                h.msg_name = addrs[nruns].0.ptr();
                h.msg_namelen = addrs[nruns].1;
                h.msg_iov = &mut iovs[ndgrams];
                h.msg_iovlen = n as _;
                if n > 1 {
                    h.msg_control = control[nruns].as_mut_ptr() as *mut libc::c_void;
                    // SAFETY: CMSG_SPACE / CMSG_LEN are size computations; the
                    // control buffer holds one cmsg of a u16.
                    unsafe {
                        h.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) as _;
                        let c = libc::CMSG_FIRSTHDR(h);
                        (*c).cmsg_level = libc::SOL_UDP;
                        (*c).cmsg_type = UDP_SEGMENT;
                        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, size as u16);
                    }
                }
                runs[nruns] = (i, n);
                nruns += 1;
                ndgrams += n;
                i += n;
            }
            let mut off = 0;
            let mut retried = false;
            while off < nruns {
                // SAFETY: hdrs[off..nruns] point at live iovecs, addresses
                // and control buffers; the iovecs at `msgs`' slices.
                let r = unsafe {
                    libc::sendmmsg(self.socket.as_raw_fd(), hdrs.as_mut_ptr().add(off), (nruns - off) as libc::c_uint, 0)
                };
                if r > 0 {
                    for &(_, n) in &runs[off..off + r as usize] {
                        out.datagrams += n;
                        if n > 1 {
                            out.super_datagrams += 1;
                            out.segments += n;
                        }
                    }
                    off += r as usize;
                    retried = false;
                    continue;
                }
                let err = io::Error::last_os_error();
                let (first, n) = runs[off];
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if n > 1 && refuses_gso(&err) {
                    // Not this run's fault: send it and the rest one by one.
                    self.gso_refused.store(true, Ordering::Relaxed);
                    out.datagrams += self.send_batch(&msgs[first..i]);
                    break;
                }
                if !retried {
                    // A pending error of an earlier datagram (ICMP) is
                    // reported, and cleared, by this call: try the run once more.
                    retried = true;
                    continue;
                }
                off += 1; // lost (e.g. ENOBUFS): recovered by retransmission
                retried = false;
            }
        }
        out
    }

    fn recv_batch(
        &mut self,
        buf: &mut [u8],
        slot: usize,
        meta: &mut [RecvMeta],
    ) -> io::Result<usize> {
        let n = meta.len().min(buf.len() / slot.max(1)).min(BATCH_MAX);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY (zeroed): plain C structs, all-zero is valid.
        let mut addrs: [RawAddr; BATCH_MAX] = [RawAddr::zeroed(); BATCH_MAX];
        let mut iovs: [libc::iovec; BATCH_MAX] = unsafe { std::mem::zeroed() };
        let mut hdrs: [libc::mmsghdr; BATCH_MAX] = unsafe { std::mem::zeroed() };
        let base = buf.as_mut_ptr();
        for (k, iov) in iovs.iter_mut().enumerate().take(n) {
            // SAFETY: k * slot + slot <= buf.len().
            *iov = libc::iovec {
                iov_base: unsafe { base.add(k * slot) } as *mut libc::c_void,
                iov_len: slot,
            };
        }
        for k in 0..n {
            hdrs[k].msg_hdr.msg_name = addrs[k].ptr();
            hdrs[k].msg_hdr.msg_namelen = RawAddr::SIZE;
            hdrs[k].msg_hdr.msg_iov = &mut iovs[k];
            hdrs[k].msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: every header points at a live slot of `buf` and an address.
        let r = unsafe {
            libc::recvmmsg(
                self.socket.as_raw_fd(),
                hdrs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = r as usize;
        for k in 0..r {
            meta[k] = RecvMeta {
                len: (hdrs[k].msg_len as usize).min(slot),
                from: addr_of(&addrs[k]),
            };
        }
        Ok(r)
    }

    fn send_segments(&self, buf: &[u8], segment: usize, to: SocketAddr) -> io::Result<usize> {
        let segment = segment.clamp(1, u16::MAX as usize);
        let mut sent = 0;
        // One super-datagram: at most 64 segments and one IPv4 datagram's
        // payload (65507 bytes) in all.
        let per_send = (UDP_MAX_PAYLOAD / segment).clamp(1, UDP_MAX_SEGMENTS);
        for chunk in buf.chunks(segment * per_send) {
            if chunk.len() <= segment {
                sent += self.socket.send_to(chunk, to)?;
                continue;
            }
            let (mut addr, addr_len) = sockaddr_of(to);
            let mut iov = libc::iovec {
                iov_base: chunk.as_ptr() as *mut libc::c_void,
                iov_len: chunk.len(),
            };
            // SAFETY: CMSG_SPACE is a pure size computation.
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
            let mut control = [0u64; 4]; // 32 bytes, aligned, >= CMSG_SPACE(2)
                                         // SAFETY: zeroed msghdr is valid; fields set below.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_name = addr.ptr();
            msg.msg_namelen = addr_len;
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            // SAFETY: the control buffer holds one cmsg of a u16.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_UDP;
                (*c).cmsg_type = UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, segment as u16);
            }
            // SAFETY: msg points at live buffers for the call.
            let r = unsafe { libc::sendmsg(self.socket.as_raw_fd(), &msg, 0) };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            sent += r as usize;
        }
        Ok(sent)
    }
}


fn is_ack(bytes: &[u8]) -> bool {
    bytes.len() >= 4
        && u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == abi::MAGIC_ACK
}

/// The I/O driver's view of the network: a transport and the counters.
#[derive(Debug)]
pub struct Net {
    /// The transport.
    pub t: Box<dyn Transport>,
    /// The counters (shared with the [`crate::runtime::Communicator`]).
    pub c: Arc<Counters>,
}

impl Net {
    /// Sends a first transmission (data or ACK); a failed send is a lost
    /// datagram, recovered by retransmission.
    pub fn tx(&self, to: SocketAddr, bytes: &[u8]) {
        if is_ack(bytes) {
            self.c.acks_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            self.c.data_sent.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self.t.send_to(bytes, to);
    }

    /// Sends first transmissions of data datagrams in one batch
    /// ([`Transport::send_batch`]: one `sendmmsg` per 64 on a UDP socket).
    pub fn tx_batch(&self, msgs: &[(&[u8], SocketAddr)]) {
        self.count_batch(msgs);
        let _ = self.t.send_batch(msgs);
    }

    /// [`Net::tx_batch`] through [`Transport::send_batch_gso`].
    pub fn tx_batch_gso(&self, msgs: &[(&[u8], SocketAddr)]) {
        self.count_batch(msgs);
        let sent = self.t.send_batch_gso(msgs);
        self.c.gso_sends.fetch_add(sent.super_datagrams as u64, Ordering::Relaxed);
        self.c.gso_segments.fetch_add(sent.segments as u64, Ordering::Relaxed);
    }

    fn count_batch(&self, msgs: &[(&[u8], SocketAddr)]) {
        let acks = msgs.iter().filter(|(b, _)| is_ack(b)).count() as u64;
        self.c.acks_sent.fetch_add(acks, Ordering::Relaxed);
        self.c
            .data_sent
            .fetch_add(msgs.len() as u64 - acks, Ordering::Relaxed);
        self.c.batches.fetch_add(1, Ordering::Relaxed);
        self.c
            .batched
            .fetch_add(msgs.len() as u64, Ordering::Relaxed);
    }

    /// Sends a retransmission of a data datagram.
    pub fn retx(&self, to: SocketAddr, bytes: &[u8]) {
        self.c.retransmitted.fetch_add(1, Ordering::Relaxed);
        self.tx(to, bytes);
    }
}

impl crate::runtime::outbox::Transmit for Net {
    fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
        self.tx(to, datagram);
    }

    fn resend(&mut self, to: SocketAddr, datagram: &[u8]) {
        self.retx(to, datagram);
    }

    fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddr)], gso: bool) {
        if gso {
            self.tx_batch_gso(datagrams);
        } else {
            self.tx_batch(datagrams);
        }
    }
}
