//! The I/O driver: the one place a communicator touches its socket and the
//! clock. It runs on the communicator's progress thread, owns the socket
//! ([`Net`]), a waker (new requests, closing) and the state machine
//! ([`Engine`]), and drives the machine: every datagram that arrives goes to
//! [`Engine::handle`], whatever is due goes out through
//! [`Engine::poll_transmit`], and it sleeps in `ppoll` until the next
//! datagram, request or [`Engine::poll_timeout`]. Calls run in issue order
//! ([`Calls`]); between calls it keeps serving the socket.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::runtime::calls::{Calls, RoundDriver};
use crate::runtime::comm::Request;
use crate::runtime::engine::Engine;
use crate::runtime::transport::{Net, RecvMeta, RECV_SLOT};
use crate::runtime::CommError;

/// Datagrams per receive batch (`recvmmsg`), each in a [`RECV_SLOT`] slot.
const RECV_BATCH: usize = 32;

/// Most datagrams handled in one drain before the driver polls the state
/// machine again (its timers, new data).
const DRAIN_MAX: usize = 4096;

/// Longest sleep between calls (so a closed request channel is noticed).
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// What the communicator shares with its progress thread.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Set when the communicator is dropped: the call in progress ends.
    pub(crate) closing: Arc<AtomicBool>,
    /// The engine's position after the last round: its next round and
    /// contribution seq (see [`crate::runtime::Communicator::position`]).
    pub(crate) round: Arc<AtomicU32>,
    pub(crate) agg_seq: Arc<AtomicU32>,
}

/// The I/O driver of one communicator (see the module docs).
pub(crate) struct Driver {
    engine: Engine,
    net: Net,
    waker: UnixDatagram,
    shared: Shared,
    rxbuf: Vec<u8>,
    rxmeta: Vec<RecvMeta>,
}

impl Driver {
    /// A driver of `engine` over `net`; `waker` is readable when a request
    /// is queued or the communicator closes.
    pub(crate) fn new(engine: Engine, net: Net, waker: UnixDatagram, shared: Shared) -> Driver {
        Driver {
            engine,
            net,
            waker,
            shared,
            rxbuf: vec![0u8; RECV_SLOT * RECV_BATCH],
            rxmeta: vec![RecvMeta::default(); RECV_BATCH],
        }
    }

    /// The progress thread: runs requests in issue order until the
    /// communicator is dropped, serving the socket between them.
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            match rx.try_recv() {
                Ok(req) => self.execute(req),
                Err(mpsc::TryRecvError::Disconnected) => return,
                Err(mpsc::TryRecvError::Empty) => {
                    let now = Instant::now();
                    self.engine.poll_transmit(now, &mut self.net);
                    let until = self
                        .engine
                        .poll_timeout()
                        .map_or(now + IDLE_WAIT, |t| t.min(now + IDLE_WAIT));
                    self.wait_and_drain(until);
                }
            }
        }
    }

    /// Waits for a datagram (or a new request) until `until`, then hands
    /// everything queued on the socket to the engine, in batches, sending
    /// the receivers' due ACKs between batches.
    fn wait_and_drain(&mut self, until: Instant) {
        let wait = until.saturating_duration_since(Instant::now());
        let mut fds = [
            libc::pollfd {
                fd: self.net.t.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.waker.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: fds and ts are valid for the call.
        unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &ts,
                std::ptr::null(),
            );
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 64];
            while self.waker.recv(&mut b).is_ok() {}
        }
        let mut drained = 0;
        while drained < DRAIN_MAX {
            match self
                .net
                .t
                .recv_batch(&mut self.rxbuf, RECV_SLOT, &mut self.rxmeta)
            {
                Ok(0) => break,
                Ok(n) => {
                    self.net.c.recv_batch(n);
                    drained += n;
                    for (k, m) in self.rxmeta[..n].iter().enumerate() {
                        let d = &self.rxbuf[k * RECV_SLOT..k * RECV_SLOT + m.len];
                        if let std::net::SocketAddr::V4(from) = m.from {
                            self.net.c.received(d);
                            self.engine.handle(Instant::now(), from, d);
                        }
                    }
                    if n < self.rxmeta.len() {
                        break; // the socket is empty
                    }
                    self.engine.poll_acks(Instant::now(), &mut self.net);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => break, // e.g. ICMP port unreachable reported on a later recv
            }
        }
    }
}

impl RoundDriver for Driver {
    fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn run_round(&mut self) -> Result<(), CommError> {
        loop {
            let now = Instant::now();
            self.engine.poll_transmit(now, &mut self.net);
            if let Some(outcome) = self.engine.round_outcome(now) {
                return outcome;
            }
            if self.shared.closing.load(Ordering::SeqCst) {
                return Err(CommError::Closed);
            }
            let until = self.engine.poll_timeout().unwrap_or(now + IDLE_WAIT);
            self.wait_and_drain(until);
        }
    }

    fn round_ended(&mut self) {
        let (round, agg_seq) = self.engine.position();
        self.shared.round.store(round.0, Ordering::SeqCst);
        self.shared.agg_seq.store(agg_seq, Ordering::SeqCst);
    }
}

/// A random first seq for a participant's broadcasts, a multiple of the
/// ACK group size `g` (see [`Engine::new`]): a restarted participant's
/// receivers see a new session.
pub(crate) fn random_group_base(g: u32) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ ((std::process::id() as u64) << 32) ^ (&t as *const u64 as u64);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let seq = x as u32;
    seq - seq % g.max(1)
}
