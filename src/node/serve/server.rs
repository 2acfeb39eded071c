//! The serving thread ([`ResultServer`]): one UDP socket per served job,
//! read, polled and answered; the counters published.

use std::collections::HashMap;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use libbpf_rs::MapCore;

use crate::kernel::xdp::KernelMaps;
use crate::wire::abi;

use super::reload::{apply_change, ServedChange};
use super::service::{ResultService, ServiceStats};

/// The thread that serves every `consumer = "node"` job of a node, one UDP
/// socket each on its `result_port`; stopped and joined on drop. Jobs are
/// added and removed while it runs ([`ResultServer::apply`], a reload).
pub struct ResultServer {
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) stats: Arc<Mutex<HashMap<u16, ServiceStats>>>,
    pub(super) changes: mpsc::Sender<(ServedChange, mpsc::Sender<()>)>,
    /// Wakes the serving thread from its poll for a change: a job on
    /// demand is served as soon as it is created, not at the next idle
    /// timeout.
    pub(super) waker: std::os::unix::net::UnixDatagram,
}

impl std::fmt::Debug for ResultServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultServer").finish_non_exhaustive()
    }
}

/// A function returning the counters of every served job (for the metrics
/// endpoint, which runs on its own thread).
pub type ResultStatsFn = Arc<dyn Fn() -> HashMap<u16, ServiceStats> + Send + Sync>;

impl ResultServer {
    /// The counters of every served job, as of the last poll.
    pub fn stats(&self) -> HashMap<u16, ServiceStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// [`ResultServer::stats`] as a `Send + Sync` function.
    pub fn stats_fn(&self) -> ResultStatsFn {
        let stats = self.stats.clone();
        Arc::new(move || stats.lock().map(|s| s.clone()).unwrap_or_default())
    }

    /// Remove and add served jobs between two polls of the serving thread;
    /// returns once it has. The other jobs' windows are untouched.
    pub fn apply(&self, change: ServedChange) -> Result<()> {
        let (done, applied) = mpsc::channel();
        self.changes.send((change, done)).map_err(|_| anyhow!("the result service has stopped"))?;
        // A full socket buffer already holds a wake-up.
        let _ = self.waker.send(&[1]);
        applied
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow!("the result service did not take the change within 5 s"))
    }
}

impl Drop for ResultServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// While datagrams keep coming, the serving thread reads its sockets once
/// every READ_EVERY instead of waking for each (it polls the sockets again
/// once a read finds nothing). For jobs without a `parent` the service is
/// off the calls' path: the TC program delivers every RESULT, and the
/// service only holds them for resends (after an RTO of at least 2 ms) and
/// acknowledges on the kernel's behalf (deferred, docs/PROTOCOL.md
/// "Implicit acknowledgement of RESULTs"). Woken once a call, it took ~10
/// µs of CPU a one-datagram call on the development VM, at the moment the
/// call's ranks wake for their RESULTs. The 64 MiB socket buffer holds what
/// comes meanwhile. A tree job's service sends the node's contribution
/// upstream when its RESULT comes (on the calls' path): with one, every
/// datagram is read at once.
pub(super) const READ_EVERY: Duration = Duration::from_micros(500);

/// Longest wait in `poll(2)`, so that a stop is seen.
pub(super) const IDLE_WAIT: Duration = Duration::from_millis(50);

pub(super) fn serve(
    jobs: &mut Vec<(UdpSocket, ResultService)>,
    changes: &mpsc::Receiver<(ServedChange, mpsc::Sender<()>)>,
    woken: &std::os::unix::net::UnixDatagram,
    stop: &AtomicBool,
    stats: &Mutex<HashMap<u16, ServiceStats>>,
    pinned: &libbpf_rs::MapHandle,
    maps: &KernelMaps,
) {
    let mut buf = vec![0u8; 65536];
    let mut out = Vec::new();
    // Zeros at once, so the counters exist from the start.
    publish(jobs, stats, pinned);
    let mut published = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let mut drained = [0u8; 64];
        while woken.recv(&mut drained).is_ok() {}
        while let Ok((change, done)) = changes.try_recv() {
            apply_change(jobs, change, stats, pinned);
            publish(jobs, stats, pinned);
            let _ = done.send(());
        }
        let now = Instant::now();
        let mut wake = now + IDLE_WAIT;
        let mut taken = 0usize;
        for (socket, service) in jobs.iter_mut() {
            // Everything queued now, then what is due.
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                service.handle(Instant::now(), from, &buf[..n], &mut out);
                // Before the reply to a position query is sent.
                if let Some(after) = service.take_release() {
                    let released = maps.release_rounds_after(service.job, after);
                    service.released(released);
                }
                taken += 1;
            }
            if let Some(at) = service.poll(Instant::now(), &mut out) {
                wake = wake.min(at);
            }
            for t in out.drain(..) {
                let _ = socket.send_to(&t.datagram, t.to);
            }
        }
        // The counters go out every PUBLISH_EVERY, not at every wake-up (a
        // bpf syscall each, and this thread wakes per burst of RESULTs).
        if published.elapsed() >= PUBLISH_EVERY {
            published = Instant::now();
            publish(jobs, stats, pinned);
        }
        if taken > 0 && jobs.iter().all(|(_, s)| s.upstream.is_none()) {
            // Datagrams keep coming: read again after READ_EVERY rather than
            // at the next one (see READ_EVERY).
            let pause = READ_EVERY.min(wake.saturating_duration_since(Instant::now()));
            std::thread::sleep(pause);
            continue;
        }
        let mut fds: Vec<libc::pollfd> = jobs
            .iter()
            .map(|(s, _)| s.as_raw_fd())
            .chain([woken.as_raw_fd()])
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let timeout = wake.saturating_duration_since(Instant::now()).as_millis().min(IDLE_WAIT.as_millis()) as libc::c_int;
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout.max(1)) };
    }
    publish(jobs, stats, pinned);
}

/// How often the serving thread publishes its counters (metrics, status).
pub(super) const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// Hand the counters to the metrics endpoint and the pinned map.
pub(super) fn publish(jobs: &[(UdpSocket, ResultService)], stats: &Mutex<HashMap<u16, ServiceStats>>, pinned: &libbpf_rs::MapHandle) {
    if let Ok(mut s) = stats.lock() {
        for (_, service) in jobs {
            let now = service.stats();
            if s.insert(service.job, now) != Some(now) {
                let key = u32::from(service.job);
                let _ = pinned.update(&key.to_ne_bytes(), abi::as_bytes(&now), libbpf_rs::MapFlags::ANY);
            }
        }
    }
}
