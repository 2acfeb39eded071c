//! The I/O driver: the one place a communicator touches its socket and the
//! clock. It owns the socket ([`Net`]), a waker (new requests, closing) and
//! the state machine ([`Engine`]), and drives the machine: every datagram
//! that arrives goes to [`Engine::handle`], whatever is due goes out through
//! [`Engine::poll_transmit`], and it sleeps in `ppoll` until the next
//! datagram, request or [`Engine::poll_timeout`].
//!
//! The driver sits in a [`Core`], a mutex with one owner at a time, and two
//! threads take turns owning it:
//!
//! - the **caller's thread**, for a blocking call issued while no other call
//!   is queued or running ([`Core::queued`] is 0): it locks the driver, runs
//!   the call's rounds itself (sends, sleeps in `ppoll` on the socket alone
//!   with the engine's timeout, handles what arrives and what the timers
//!   fire), flushes what is due and unlocks. No hand-off to another thread,
//!   so a one-datagram call costs one wake-up (its result's) instead of
//!   three or four;
//! - the **progress thread** ([`run`]) the rest of the time: it runs the
//!   queued requests (`Work` calls, stripes, blocking calls issued while
//!   others were in flight) in issue order, and between calls serves the
//!   socket (re-acknowledges late retransmissions, answers the timers). It
//!   sleeps *without* the lock, in `ppoll` on an epoll set of the socket
//!   and the waker, so a caller never waits for it to wake; a caller turns
//!   the socket's events off in that set for its call, so the call's
//!   datagrams do not wake it (see [`Driver`]'s `epoll`). If it wakes while
//!   a caller owns the driver it waits on the lock, then serves what is
//!   left.
//!
//! Both run the same [`Engine`] through the same code ([`Calls`] over this
//! driver): nothing the progress thread did between calls is lost to a
//! caller, and nothing a caller's call armed (a delayed ACK, a
//! retransmission timer) is lost to the progress thread: when a caller
//! unlocks and the engine's next timer is earlier than the progress
//! thread's sleep, or a request was queued meanwhile, it writes the waker.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::runtime::calls::{Calls, Request, RoundDriver};
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
/// The longest a closing worker answers its peers (`Driver::linger`).
const LINGER_MAX: Duration = Duration::from_secs(1);

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
    /// Set while a caller's thread owns the driver: its waits leave the
    /// waker to the progress thread.
    on_caller: bool,
    /// How long a caller's wait polls before it sleeps
    /// ([`crate::runtime::CommConfig::caller_spin`]).
    caller_spin: Duration,
    /// What the progress thread sleeps on: an epoll set of the socket and
    /// the waker (level-triggered). A caller that takes the driver turns
    /// the socket's events off in it for the call, so the call's datagrams
    /// wake the caller only (not also the progress thread, which would find
    /// the lock taken and sleep again: two context switches a call), and
    /// back on at the end (which wakes the progress thread if a datagram is
    /// waiting by then).
    epoll: OwnedFd,
}

/// The driver behind its lock, and the requests queued for the progress
/// thread (see the module docs).
pub(crate) struct Core {
    driver: Mutex<Driver>,
    /// Requests submitted to the progress thread and not finished yet; a
    /// caller runs its call itself only when this is 0.
    pub(crate) queued: AtomicUsize,
    /// When the progress thread's current sleep ends, in nanoseconds since
    /// `epoch` (0: it is not sleeping). Outside the lock: a caller reads it
    /// to decide whether to write the waker, whoever holds the driver.
    bg_until: AtomicU64,
    /// The engine's next timer ([`Engine::poll_timeout`]) as the last
    /// caller left it, in nanoseconds since `epoch` (0: none): what the
    /// progress thread sleeps until when a caller holds the driver.
    timer: AtomicU64,
    epoch: Instant,
    /// The waker's receiving end, for the progress thread to drain without
    /// the lock (a clone of the driver's).
    waker: Option<UnixDatagram>,
    /// The driver's epoll set (owned by the driver, which lives as long).
    epoll: RawFd,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("queued", &self.queued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Core {
    /// A core around `driver`.
    pub(crate) fn new(driver: Driver) -> Core {
        let waker = driver.waker.try_clone().ok();
        let epoll = driver.epoll.as_raw_fd();
        Core {
            driver: Mutex::new(driver),
            queued: AtomicUsize::new(0),
            bg_until: AtomicU64::new(0),
            timer: AtomicU64::new(0),
            epoch: Instant::now(),
            waker,
            epoll,
        }
    }

    /// `t` in nanoseconds since `epoch`, at least 1 (0 means none).
    fn nanos(&self, t: Instant) -> u64 {
        (t.saturating_duration_since(self.epoch).as_nanos() as u64).max(1)
    }

    fn instant(&self, nanos: u64) -> Option<Instant> {
        (nanos != 0).then(|| self.epoch + Duration::from_nanos(nanos))
    }

    fn lock(&self) -> MutexGuard<'_, Driver> {
        self.driver.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `call` on the calling thread if no other call is queued or
    /// running (see the module docs); `None`: the caller must queue it.
    /// `waker` is the progress thread's waker (written when it must
    /// re-poll after the call).
    pub(crate) fn run_here<T>(
        &self,
        waker: &UnixDatagram,
        call: impl FnOnce(&mut Driver) -> Result<T, CommError>,
    ) -> Option<Result<T, CommError>> {
        if self.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let mut guard = self.lock();
        let d = &mut *guard;
        // The progress thread decrements `queued` only while it holds the
        // lock, after the request's last use.
        if self.queued.load(Ordering::SeqCst) != 0 {
            return None;
        }
        d.on_caller = true;
        d.socket_events(false);
        d.net.c.caller_call();
        // A panicking call still gives the socket back to the progress
        // thread before the panic goes on.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(&mut *d)));
        if r.is_ok() {
            // What the call's end made due (ACKs of the last datagrams)
            // goes out now, not when the progress thread next wakes.
            let now = Instant::now();
            d.engine.poll_transmit(now, &mut d.net);
        }
        d.socket_events(true);
        d.on_caller = false;
        let timer = d.engine.poll_timeout();
        self.timer
            .store(timer.map_or(0, |t| self.nanos(t)), Ordering::SeqCst);
        let wake = self.queued.load(Ordering::SeqCst) != 0
            || match (timer, self.instant(self.bg_until.load(Ordering::SeqCst))) {
                (Some(t), Some(until)) => t < until,
                _ => false,
            };
        drop(guard);
        if wake {
            let _ = waker.send(&[2]);
        }
        Some(r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
    }
}

impl Driver {
    /// A driver of `engine` over `net`; `waker` is readable when a request
    /// is queued or the communicator closes.
    pub(crate) fn new(
        engine: Engine,
        net: Net,
        waker: UnixDatagram,
        shared: Shared,
        caller_spin: Duration,
    ) -> io::Result<Driver> {
        // SAFETY: plain system calls; the fd is owned from here on.
        let epoll = unsafe {
            let fd = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            OwnedFd::from_raw_fd(fd)
        };
        for fd in [net.t.raw_fd(), waker.as_raw_fd()] {
            epoll_ctl(
                epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd,
                libc::EPOLLIN as u32,
            )?;
        }
        Ok(Driver {
            engine,
            net,
            waker,
            shared,
            rxbuf: vec![0u8; RECV_SLOT * RECV_BATCH],
            rxmeta: vec![RecvMeta::default(); RECV_BATCH],
            on_caller: false,
            caller_spin,
            epoll,
        })
    }

    /// Turns the socket's events in the progress thread's epoll set on or
    /// off (see [`Driver::epoll`]).
    fn socket_events(&mut self, on: bool) {
        let events = if on { libc::EPOLLIN as u32 } else { 0 };
        // Cannot fail for a registered fd; if it did, the progress thread
        // would only wake once more than needed (on) or sleep until its
        // timeout and the caller's release (off).
        let _ = epoll_ctl(
            self.epoll.as_raw_fd(),
            libc::EPOLL_CTL_MOD,
            self.net.t.raw_fd(),
            events,
        );
    }

    /// Waits until `until` for a datagram (and, unless a caller owns the
    /// driver, the waker), then drains the socket. A caller first polls for
    /// `caller_spin`.
    fn wait_and_drain(&mut self, until: Instant) {
        let fds = (
            self.net.t.raw_fd(),
            (!self.on_caller).then(|| self.waker.as_raw_fd()),
        );
        if self.on_caller {
            let polled = !self.caller_spin.is_zero()
                && spin(fds.0, (Instant::now() + self.caller_spin).min(until));
            self.net.c.caller_wait(polled);
            if polled {
                self.drain();
                return;
            }
        }
        if wait(fds, until) {
            self.drain_waker();
        }
        self.drain();
    }

    fn drain_waker(&mut self) {
        let mut b = [0u8; 64];
        while self.waker.recv(&mut b).is_ok() {}
    }

    /// Hands everything queued on the socket to the engine, in batches,
    /// sending the receivers' due ACKs between batches.
    /// A closing worker's last ACKs may be lost, and the peer that holds
    /// its RESULTs for them (an aggregator application, whose call waits
    /// for every worker's ACK of every RESULT; the node's result service)
    /// resends the RESULT to a socket nobody reads: the aggregator's last
    /// call timed out although every worker had completed it. So the
    /// worker keeps its socket for a while, as TCP's TIME_WAIT and QUIC's
    /// closing period do: every datagram that comes is handled (a resent
    /// RESULT is acknowledged again), until none has come for
    /// `Engine::linger_quiet`, or for twice the gap between the last two
    /// arrivals when that is longer (a peer's retransmission timer doubles
    /// after each timeout), [`LINGER_MAX`] at most.
    fn linger(&mut self) {
        let Some(mut quiet) = self.engine.linger_quiet() else { return };
        let start = Instant::now();
        let end = start + LINGER_MAX;
        let mut quiet_until = start + quiet;
        let mut last_arrival = start;
        self.socket_events(true);
        let epoll = self.epoll.as_raw_fd();
        loop {
            let until = quiet_until.min(end);
            if Instant::now() >= until {
                return;
            }
            wait((epoll, None), until);
            self.drain_waker();
            let taken = self.drain();
            self.engine.poll_acks(Instant::now(), &mut self.net);
            if taken > 0 {
                let now = Instant::now();
                quiet = quiet.max(2 * now.duration_since(last_arrival));
                last_arrival = now;
                quiet_until = now + quiet;
            }
        }
    }

    /// Takes what the socket holds (at most `DRAIN_MAX` datagrams) into
    /// the engine; returns how many.
    fn drain(&mut self) -> usize {
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
                        self.net.c.received(d);
                        self.engine.handle(Instant::now(), m.from, d);
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
        drained
    }
}

fn epoll_ctl(epfd: RawFd, op: libc::c_int, fd: RawFd, events: u32) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events,
        u64: fd as u64,
    };
    // SAFETY: ev is valid for the call.
    if unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Polls `fd` (the socket) without sleeping, yielding the CPU between
/// looks, until it is readable (true) or `until` (false). With other
/// threads runnable `sched_yield` lets them run; alone on its CPU the
/// caller keeps it, as an MPI rank waiting for a message does.
fn spin(fd: RawFd, until: Instant) -> bool {
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: p is valid for the call.
        if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        // SAFETY: no arguments.
        unsafe { libc::sched_yield() };
    }
}

/// Sleeps in `ppoll` until `until` or until `fds.0` (the socket) or
/// `fds.1` (the waker, if any) is readable; returns whether the waker is.
fn wait(fds: (i32, Option<i32>), until: Instant) -> bool {
    let wait = until.saturating_duration_since(Instant::now());
    let mut p = [
        libc::pollfd {
            fd: fds.0,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: fds.1.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let n = if fds.1.is_some() { 2 } else { 1 };
    let ts = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: wait.subsec_nanos() as libc::c_long,
    };
    // SAFETY: p and ts are valid for the call.
    unsafe {
        libc::ppoll(p.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null());
    }
    fds.1.is_some() && p[1].revents != 0
}

/// The progress thread: runs queued requests in issue order until the
/// communicator is dropped, serving the socket between them; sleeps without
/// the lock, so a caller can take the driver meanwhile (module docs).
pub(crate) fn run(core: Arc<Core>, rx: mpsc::Receiver<Request>) {
    loop {
        let mut guard = match core.driver.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                // A caller runs a call (see the module docs): it serves the
                // socket meanwhile, and gives the driver back with its next
                // timer in `core.timer` and, when that is earlier than this
                // sleep or a request is queued, a write to the waker.
                // Waiting on the lock instead would make every one of its
                // unlocks wake this thread, which mostly finds the lock
                // taken again by the caller's next call (a context switch a
                // call for nothing).
                wait_for_caller(&core);
                continue;
            }
        };
        let d = &mut *guard;
        match rx.try_recv() {
            Ok(req) => {
                d.net.c.progress_call();
                d.execute(req);
                core.queued.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                // The communicator closes: the ACKs still waiting (a
                // worker's deferred ACK of its last RESULT) go now, and
                // what a peer still resends is answered for a while.
                d.engine.flush_acks(&mut d.net);
                d.linger();
                return;
            }
            Err(mpsc::TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        d.engine.poll_transmit(now, &mut d.net);
        let until = d
            .engine
            .poll_timeout()
            .map_or(now + IDLE_WAIT, |t| t.min(now + IDLE_WAIT));
        core.bg_until.store(core.nanos(until), Ordering::SeqCst);
        let epoll = d.epoll.as_raw_fd();
        drop(guard);
        // The epoll set is readable when the socket (unless a caller turned
        // it off) or the waker is.
        wait((epoll, None), until);
        core.bg_until.store(0, Ordering::SeqCst);
        let Ok(mut guard) = core.driver.try_lock() else {
            // A caller took the driver meanwhile: it drains what it wakes
            // for (the loop's next turn sleeps until it is done).
            continue;
        };
        let d = &mut *guard;
        d.drain_waker();
        d.drain();
    }
}

/// The progress thread while a caller holds the driver: sleeps on the
/// epoll set (the waker; the socket's events are off during the call)
/// until the engine's next timer as the last caller left it, or until the
/// caller's waker write.
fn wait_for_caller(core: &Core) {
    let now = Instant::now();
    let idle = now + IDLE_WAIT;
    // Announce the sleep before reading the timer: a caller that ends
    // meanwhile either sees this (and writes the waker if its timer is
    // earlier) or has published its timer, read below.
    core.bg_until.store(core.nanos(idle), Ordering::SeqCst);
    // A timer that is due already is the caller's to run (its call runs
    // the engine's timers); its end wakes this thread for the next one.
    let until = core
        .instant(core.timer.load(Ordering::SeqCst))
        .filter(|&t| t > now)
        .map_or(idle, |t| t.min(idle));
    core.bg_until.store(core.nanos(until), Ordering::SeqCst);
    if let Some(w) = core.waker.as_ref() {
        wait((core.epoll, None), until);
        core.bg_until.store(0, Ordering::SeqCst);
        let mut b = [0u8; 64];
        while w.recv(&mut b).is_ok() {}
    } else {
        std::thread::sleep(until.saturating_duration_since(now));
        core.bg_until.store(0, Ordering::SeqCst);
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
