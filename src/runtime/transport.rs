//! The datagram transport under a communicator, and its test hook.
//!
//! Every datagram a communicator sends or receives goes through one
//! [`Transport`]. Production uses [`UdpTransport`] (the communicator's UDP
//! socket, nothing added). [`ImpairedTransport`] wraps any transport and, on
//! the receive side, drops, duplicates and reorders datagrams within a window,
//! deciding with a seeded pseudo-random generator — the test hook for
//! reordering and duplication, which this kernel cannot inject (no netem, and
//! a BPF program cannot delay packets). It sits *under* the progress engine,
//! so the impaired runs exercise exactly the production code paths of
//! [`crate::runtime::reliability`], fragmentation and reassembly; it is used
//! only when a builder is given an [`Impairment`].
//!
//! [`Net`] is what the engine holds: the transport plus the communicator's
//! counters ([`CommStats`]), counted on the way out and in.

use std::fmt;
use std::io;
use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::abi;

/// A datagram transport: what the progress engine sends and receives with.
pub trait Transport: Send + fmt::Debug {
    /// Sends one datagram to `to` (errors count as loss).
    fn send_to(&self, buf: &[u8], to: SocketAddrV4) -> io::Result<usize>;
    /// Receives one datagram without blocking (`WouldBlock` when none).
    fn recv_from(&mut self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)>;
    /// The file descriptor to wait on for readability.
    fn raw_fd(&self) -> RawFd;
}

/// The production transport: a non-blocking UDP socket, unchanged.
#[derive(Debug)]
pub struct UdpTransport(pub UdpSocket);

impl Transport for UdpTransport {
    fn send_to(&self, buf: &[u8], to: SocketAddrV4) -> io::Result<usize> {
        self.0.send_to(buf, to)
    }
    fn recv_from(&mut self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        self.0.recv_from(buf)
    }
    fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Shared, changeable impairment probabilities (parts per million), so a test
/// or benchmark can change them while communicators run (e.g. a loss burst),
/// and the counters of what the impaired transports did.
#[derive(Debug, Clone, Default)]
pub struct ImpairControl {
    loss_ppm: Arc<AtomicU64>,
    dup_ppm: Arc<AtomicU64>,
    counters: Arc<ImpairCounters>,
}

impl ImpairControl {
    /// A control with probabilities `loss` and `duplicate` (0..=1).
    pub fn new(loss: f64, duplicate: f64) -> ImpairControl {
        let c = ImpairControl::default();
        c.set(loss, duplicate);
        c
    }

    /// Sets the drop and duplication probabilities per received datagram.
    pub fn set(&self, loss: f64, duplicate: f64) {
        self.loss_ppm.store((loss.clamp(0.0, 1.0) * 1e6) as u64, Ordering::Relaxed);
        self.dup_ppm.store((duplicate.clamp(0.0, 1.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn get(&self) -> (u64, u64) {
        (self.loss_ppm.load(Ordering::Relaxed), self.dup_ppm.load(Ordering::Relaxed))
    }

    /// What every transport using this control did so far.
    pub fn stats(&self) -> ImpairStats {
        self.counters.snapshot()
    }
}

/// Test hook: how an [`ImpairedTransport`] distorts what a communicator
/// receives (see the module docs).
#[derive(Debug, Clone)]
pub struct Impairment {
    /// Seed of the decisions (each communicator should get its own).
    pub seed: u64,
    /// Datagrams held and released in random order: 1 = no reordering; a
    /// datagram can be overtaken by up to `reorder_window - 1` others held
    /// with it (and more when it is drawn late).
    pub reorder_window: usize,
    /// Drop / duplicate probabilities, changeable at run time.
    pub control: ImpairControl,
}

impl Impairment {
    /// Reordering within `window`, loss and duplication probabilities, seed.
    pub fn new(seed: u64, reorder_window: usize, loss: f64, duplicate: f64) -> Impairment {
        Impairment { seed, reorder_window: reorder_window.max(1), control: ImpairControl::new(loss, duplicate) }
    }
}

/// What an [`ImpairedTransport`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImpairStats {
    /// Datagrams read from the inner transport.
    pub received: u64,
    /// Dropped.
    pub dropped: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Delivered before a datagram that arrived earlier.
    pub reordered: u64,
}

/// SplitMix64: small, seeded, good enough for test decisions.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn chance_ppm(&mut self, ppm: u64) -> bool {
        ppm > 0 && self.next() % 1_000_000 < ppm
    }
}

/// A receive-side impairment wrapper (see the module docs): each datagram
/// read from the inner transport is dropped, or kept (plus, maybe, a
/// duplicate) among up to `reorder_window` held datagrams; each
/// `recv_from` returns a held datagram drawn at random once the window is
/// full or the inner transport has nothing more.
#[derive(Debug)]
pub struct ImpairedTransport<T: Transport> {
    inner: T,
    cfg: Impairment,
    rng: Rng,
    /// (arrival number, bytes, source).
    held: Vec<(u64, Vec<u8>, SocketAddr)>,
    pool: Vec<Vec<u8>>,
    arrivals: u64,
    stats: Arc<ImpairCounters>,
}


/// Shared counters of an [`ImpairedTransport`].
#[derive(Debug, Default)]
pub struct ImpairCounters {
    received: AtomicU64,
    dropped: AtomicU64,
    duplicated: AtomicU64,
    reordered: AtomicU64,
}

impl ImpairCounters {
    /// A snapshot.
    pub fn snapshot(&self) -> ImpairStats {
        ImpairStats {
            received: self.received.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            duplicated: self.duplicated.load(Ordering::Relaxed),
            reordered: self.reordered.load(Ordering::Relaxed),
        }
    }
}

impl<T: Transport> ImpairedTransport<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, cfg: Impairment) -> ImpairedTransport<T> {
        ImpairedTransport {
            inner,
            rng: Rng(cfg.seed ^ 0x5eed_0000_a66b_0c5e),
            held: Vec::new(),
            pool: Vec::new(),
            arrivals: 0,
            stats: cfg.control.counters.clone(),
            cfg,
        }
    }

    /// The counters (those of its [`ImpairControl`]).
    pub fn counters(&self) -> Arc<ImpairCounters> {
        self.stats.clone()
    }

    fn hold(&mut self, bytes: &[u8], from: SocketAddr) {
        let mut b = self.pool.pop().unwrap_or_default();
        b.clear();
        b.extend_from_slice(bytes);
        self.held.push((self.arrivals, b, from));
        self.arrivals += 1;
    }
}

impl<T: Transport> Transport for ImpairedTransport<T> {
    fn send_to(&self, buf: &[u8], to: SocketAddrV4) -> io::Result<usize> {
        self.inner.send_to(buf, to)
    }

    fn recv_from(&mut self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        let window = self.cfg.reorder_window.max(1);
        let mut tmp = self.pool.pop().unwrap_or_default();
        tmp.resize(buf.len().max(65536), 0);
        let mut err = None;
        while self.held.len() < window {
            match self.inner.recv_from(&mut tmp) {
                Ok((n, from)) => {
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                    let (loss, dup) = self.cfg.control.get();
                    if self.rng.chance_ppm(loss) {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let copy = self.rng.chance_ppm(dup);
                    self.hold(&tmp[..n], from);
                    if copy {
                        self.stats.duplicated.fetch_add(1, Ordering::Relaxed);
                        self.hold(&tmp[..n], from);
                    }
                }
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        self.pool.push(tmp);
        if self.held.is_empty() {
            return Err(err.unwrap_or_else(|| io::ErrorKind::WouldBlock.into()));
        }
        let i = (self.rng.next() % self.held.len() as u64) as usize;
        let (arrival, bytes, from) = self.held.swap_remove(i);
        if self.held.iter().any(|h| h.0 < arrival) {
            self.stats.reordered.fetch_add(1, Ordering::Relaxed);
        }
        let n = bytes.len().min(buf.len());
        buf[..n].copy_from_slice(&bytes[..n]);
        self.pool.push(bytes);
        Ok((n, from))
    }

    fn raw_fd(&self) -> RawFd {
        self.inner.raw_fd()
    }
}

/// Counters of one communicator, see [`crate::runtime::Communicator::stats`].
///
/// Datagrams are counted where they cross the transport, so one broadcast
/// fragment sent to three receivers by the socket path counts 3, and once
/// when the TC program makes the copies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Data datagrams (`AGG1`, `AGB1`) handed to the transport, first
    /// transmissions and retransmissions.
    pub data_sent: u64,
    /// Of those, retransmissions (timeouts and selective ACK holes).
    pub retransmitted: u64,
    /// `AGK1` datagrams sent.
    pub acks_sent: u64,
    /// Data datagrams received (duplicates included).
    pub data_received: u64,
    /// `AGK1` datagrams received.
    pub acks_received: u64,
    /// Received data datagrams that were duplicates (not delivered again).
    pub duplicates_received: u64,
    /// Payload bytes delivered to this participant's calls (broadcast data
    /// and reduction results, each byte once).
    pub bytes_delivered: u64,
}

/// Shared atomic counters behind [`CommStats`].
#[derive(Debug, Default)]
pub struct Counters {
    data_sent: AtomicU64,
    retransmitted: AtomicU64,
    acks_sent: AtomicU64,
    data_received: AtomicU64,
    acks_received: AtomicU64,
    duplicates_received: AtomicU64,
    bytes_delivered: AtomicU64,
}

impl Counters {
    /// A snapshot.
    pub fn snapshot(&self) -> CommStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CommStats {
            data_sent: l(&self.data_sent),
            retransmitted: l(&self.retransmitted),
            acks_sent: l(&self.acks_sent),
            data_received: l(&self.data_received),
            acks_received: l(&self.acks_received),
            duplicates_received: l(&self.duplicates_received),
            bytes_delivered: l(&self.bytes_delivered),
        }
    }

    /// One duplicate data datagram received.
    pub fn duplicate(&self) {
        self.duplicates_received.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` payload bytes delivered.
    pub fn delivered(&self, n: usize) {
        self.bytes_delivered.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts one received datagram by its magic.
    pub fn received(&self, bytes: &[u8]) {
        if is_ack(bytes) {
            self.acks_received.fetch_add(1, Ordering::Relaxed);
        } else {
            self.data_received.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn is_ack(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == abi::MAGIC_ACK
}

/// The engine's view of the network: a transport and the counters.
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
    pub fn tx(&self, to: SocketAddrV4, bytes: &[u8]) {
        if is_ack(bytes) {
            self.c.acks_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            self.c.data_sent.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self.t.send_to(bytes, to);
    }

    /// Sends a retransmission of a data datagram.
    pub fn retx(&self, to: SocketAddrV4, bytes: &[u8]) {
        self.c.retransmitted.fetch_add(1, Ordering::Relaxed);
        self.tx(to, bytes);
    }
}
