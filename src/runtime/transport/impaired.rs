//! The test hook under a communicator: [`ImpairedTransport`] drops,
//! duplicates and reorders received datagrams (see the module docs of
//! `transport`).

use std::io;
use std::net::{SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Rng, Transport};

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
        self.loss_ppm
            .store((loss.clamp(0.0, 1.0) * 1e6) as u64, Ordering::Relaxed);
        self.dup_ppm
            .store((duplicate.clamp(0.0, 1.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn get(&self) -> (u64, u64) {
        (
            self.loss_ppm.load(Ordering::Relaxed),
            self.dup_ppm.load(Ordering::Relaxed),
        )
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
        Impairment {
            seed,
            reorder_window: reorder_window.max(1),
            control: ImpairControl::new(loss, duplicate),
        }
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
    fn send_to(&self, buf: &[u8], to: SocketAddr) -> io::Result<usize> {
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
        let i = self.rng.below(self.held.len() as u64) as usize;
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
