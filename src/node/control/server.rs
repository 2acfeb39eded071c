//! The control endpoint's I/O: a TCP listener whose connections feed AGC1
//! frames to the [`Registry`], and a ticker that expires leases. A change
//! of the live jobs is not answered here: it goes to the node's main loop
//! as a [`Change`], which applies the new desired state to the kernel
//! first and then [`ControlServer::deliver`]s the replies, so that a rank
//! learns of its job only once the node serves it.
//!
//! Bounds: a frame of at most `wire::control::MAX_FRAME` bytes; a
//! connection silent for [`IDLE`] is closed (a rank waits for its run's
//! other joins at most a lease, far less); at most [`MAX_CONNECTIONS`]
//! connections at once (more are closed at once).

use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::wire::control::{read_frame, write_frame, Refusal, Reply};

use super::registry::{ConnId, Registry};

/// A connection that sends nothing for this long is closed.
pub const IDLE: Duration = Duration::from_secs(60);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How often leases are checked.
const TICK: Duration = Duration::from_millis(250);
/// Longest wait for a connection before the accept thread looks at its
/// stop flag (a connection wakes it at once).
const ACCEPT_WAIT: Duration = Duration::from_millis(100);

/// Waits until `listener` has a connection to accept, or `most`.
fn wait_readable(listener: &TcpListener, most: Duration) {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut fd, 1, most.as_millis() as libc::c_int) };
}

/// The live jobs changed: the replies owed once the node applied them.
#[derive(Debug)]
pub struct Change {
    pub replies: Vec<(ConnId, Reply)>,
}

/// The node's clock for the registry: ms since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The running endpoint; stops when dropped.
pub struct ControlServer {
    addr: SocketAddr,
    conns: Arc<Mutex<HashMap<ConnId, TcpStream>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer").field("addr", &self.addr).finish()
    }
}

impl ControlServer {
    /// Serves `listener` (bound by the caller, so a port in use fails the
    /// attach before the interface is touched) with `registry`; changes go
    /// to `changes`. `publish` is shown the registry at every lease tick
    /// and whenever a request changed its live jobs (`aggbox status` reads
    /// what it writes, so a job on demand names its owner from the start).
    pub fn start(
        listener: TcpListener,
        registry: Arc<Mutex<Registry>>,
        changes: Sender<Change>,
        publish: Option<Box<dyn FnMut(&Registry) + Send>>,
    ) -> std::io::Result<ControlServer> {
        // Taken with the registry's lock held, never the other way round.
        let publish: Publish = Arc::new(Mutex::new(publish));
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let conns: Arc<Mutex<HashMap<ConnId, TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicU64::new(1));
        let accept = {
            let (registry, changes, conns, stop, publish) = (registry.clone(), changes.clone(), conns.clone(), stop.clone(), publish.clone());
            let node_stop = stop.clone();
            std::thread::Builder::new().name("aggbox-control".into()).spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            if conns.lock().unwrap_or_else(|p| p.into_inner()).len() >= MAX_CONNECTIONS {
                                continue; // dropped: closed at once
                            }
                            let id = next.fetch_add(1, Ordering::Relaxed);
                            let (registry, changes, conns, publish, stop) = (registry.clone(), changes.clone(), conns.clone(), publish.clone(), node_stop.clone());
                            let _ = std::thread::Builder::new()
                                .name("aggbox-control-conn".into())
                                .spawn(move || serve_connection(id, stream, registry, changes, conns, publish, stop));
                        }
                        // Nothing to accept: wait for a connection in
                        // poll(2), at most ACCEPT_WAIT so a stop is seen.
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait_readable(&listener, ACCEPT_WAIT),
                        Err(_) => std::thread::sleep(ACCEPT_WAIT),
                    }
                }
            })?
        };
        let ticker = {
            let (stop, conns) = (stop.clone(), conns.clone());
            std::thread::Builder::new().name("aggbox-control-lease".into()).spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    let (gone, replies) = {
                        let mut registry = registry.lock().unwrap_or_else(|p| p.into_inner());
                        let expired = registry.expire(now_ms());
                        publish_to(&publish, &registry);
                        expired
                    };
                    if !gone.is_empty() {
                        let _ = changes.send(Change { replies });
                    } else {
                        deliver_to(&conns, replies);
                    }
                }
            })?
        };
        Ok(ControlServer { addr, conns, stop, threads: vec![accept, ticker] })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends each reply to its connection (one gone meanwhile is skipped).
    pub fn deliver(&self, replies: Vec<(ConnId, Reply)>) {
        deliver_to(&self.conns, replies)
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The publisher of the live jobs (`aggbox status`), shared by the lease
/// ticker and the connections.
type Publish = Arc<Mutex<Option<Box<dyn FnMut(&Registry) + Send>>>>;

/// Shows `registry` to the publisher, if there is one.
fn publish_to(publish: &Publish, registry: &Registry) {
    if let Some(p) = publish.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        p(registry);
    }
}

fn deliver_to(conns: &Mutex<HashMap<ConnId, TcpStream>>, replies: Vec<(ConnId, Reply)>) {
    let mut conns = conns.lock().unwrap_or_else(|p| p.into_inner());
    for (id, reply) in replies {
        if let Some(stream) = conns.get_mut(&id) {
            if write_frame(stream, &reply).and_then(|()| Ok(stream.flush()?)).is_err() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
                conns.remove(&id);
            }
        }
    }
}

/// One connection: frames in, replies out, until it closes or stalls.
fn serve_connection(
    id: ConnId,
    mut stream: TcpStream,
    registry: Arc<Mutex<Registry>>,
    changes: Sender<Change>,
    conns: Arc<Mutex<HashMap<ConnId, TcpStream>>>,
    publish: Publish,
    stop: Arc<AtomicBool>,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let Ok(writer) = stream.try_clone() else { return };
    conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, writer);
    let _ = stream.set_read_timeout(Some(IDLE));
    loop {
        let frame = match read_frame(&mut stream) {
            Ok(f) => f,
            Err(crate::wire::control::FrameError::TooLong(n)) => {
                let reply = Reply::Refused { reason: Refusal::Malformed, message: format!("frame of {n} bytes: at most {}", crate::wire::control::MAX_FRAME) };
                deliver_to(&conns, vec![(id, reply)]);
                break;
            }
            Err(_) => break,
        };
        let (before, replies, starts, ring_starts) = {
            let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
            let before = reg.state();
            let replies = reg.handle(now_ms(), id, &frame);
            let changed = reg.state() != before;
            if changed {
                publish_to(&publish, &reg);
            }
            (changed, replies, reg.take_upstream_starts(), reg.take_ring_starts())
        };
        // Leaves' jobs just created: each joins its tree's root.
        for start in starts {
            let publish = publish.clone();
            let shown = Box::new(move |r: &Registry| publish_to(&publish, r));
            super::upstream::spawn(start, registry.clone(), changes.clone(), stop.clone(), shown);
        }
        // Jobs with a ring just created: each installs it at its members.
        for start in ring_starts {
            let publish = publish.clone();
            let shown = Box::new(move |r: &Registry| publish_to(&publish, r));
            super::ring::spawn(start, registry.clone(), changes.clone(), stop.clone(), shown);
        }
        if before {
            if changes.send(Change { replies }).is_err() {
                break;
            }
        } else {
            deliver_to(&conns, replies);
        }
    }
    registry.lock().unwrap_or_else(|p| p.into_inner()).closed(id);
    if let Some(s) = conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}
