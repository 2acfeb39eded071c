//! Socket and accounting helpers of the benchmarks: `sendmmsg` / `recvmmsg`
//! batches, socket options, per-thread and system CPU time.

use std::io;
use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// `sendmmsg` calls that found no room (EAGAIN / ENOBUFS) and yielded
/// before trying again, in this process (`AGGBOX_BENCH_COUNTERS` prints
/// its change per run: a sender held up by a full queue).
pub static SEND_RETRIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Send every datagram of `bufs` on the connected `socket` with `sendmmsg`
/// (retrying the rest after a partial send). Returns datagrams sent.
pub fn send_batch(socket: &UdpSocket, bufs: &[&[u8]]) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: zeroed mmsghdr is valid (no name, no control).
    let mut msgs: Vec<libc::mmsghdr> = (0..bufs.len())
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
    }
    let mut done = 0;
    let mut spins = 0;
    while done < msgs.len() {
        // SAFETY: msgs[done..] point at live iovecs over live buffers.
        let rc = unsafe {
            libc::sendmmsg(
                socket.as_raw_fd(),
                msgs[done..].as_mut_ptr(),
                (msgs.len() - done) as u32,
                0,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) if spins < 100_000 => {
                    spins += 1;
                    SEND_RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::thread::yield_now();
                    continue;
                }
                _ => return Err(e),
            }
        }
        done += rc as usize;
    }
    Ok(done)
}

/// A reusable `recvmmsg` batch of `n` buffers of `size` bytes.
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
    lens: Vec<usize>,
}

// SAFETY: the raw pointers point into `bufs`, owned by the batch.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    /// `n` buffers of `size` bytes.
    pub fn new(n: usize, size: usize) -> RecvBatch {
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; size]).collect();
        let iov: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: zeroed mmsghdr is valid.
        let msgs = (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
        RecvBatch {
            bufs,
            iov,
            msgs,
            lens: vec![0; n],
        }
    }

    /// Receive up to the batch size (blocking until at least one, or the
    /// socket's read timeout: then `Ok(0)`). `one` = plain `recv` of one datagram.
    pub fn recv(&mut self, socket: &UdpSocket, one: bool) -> io::Result<usize> {
        if one {
            return match socket.recv(&mut self.bufs[0]) {
                Ok(n) => {
                    self.lens[0] = n;
                    Ok(1)
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    Ok(0)
                }
                Err(e) => Err(e),
            };
        }
        for (m, v) in self.msgs.iter_mut().zip(self.iov.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
            m.msg_len = 0;
        }
        // SAFETY: msgs point at iovecs over owned buffers; MSG_WAITFORONE returns after the first.
        let rc = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                self.msgs.as_mut_ptr(),
                self.msgs.len() as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock
                | io::ErrorKind::TimedOut
                | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        for i in 0..rc as usize {
            self.lens[i] = self.msgs[i].msg_len as usize;
        }
        Ok(rc as usize)
    }

    /// Datagram `i` of the last receive.
    pub fn get(&self, i: usize) -> &[u8] {
        &self.bufs[i][..self.lens[i]]
    }
}

fn setsockopt_int(socket: &impl AsRawFd, level: i32, opt: i32, value: i32) -> io::Result<()> {
    // SAFETY: valid fd and a c_int option.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            opt,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Receive buffer of `bytes` (SO_RCVBUFFORCE: root ignores rmem_max).
pub fn set_rcvbuf(socket: &impl AsRawFd, bytes: i32) -> io::Result<()> {
    setsockopt_int(socket, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, bytes)
}

/// Send buffer of `bytes` (SO_SNDBUFFORCE).
pub fn set_sndbuf(socket: &impl AsRawFd, bytes: i32) -> io::Result<()> {
    setsockopt_int(socket, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, bytes)
}

/// Turn on SO_TIMESTAMPNS (kernel receive timestamps, CLOCK_REALTIME).
pub fn set_timestampns(socket: &impl AsRawFd) -> io::Result<()> {
    setsockopt_int(socket, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1)
}

/// A UDP socket bound to `addr` with SO_REUSEPORT (created in the calling
/// thread's namespace).
pub fn reuseport_socket(addr: std::net::SocketAddrV4) -> io::Result<UdpSocket> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd owned here.
    let sock = unsafe { <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEPORT, 1)?;
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: valid sockaddr_in.
    let rc = unsafe {
        libc::bind(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// Steer a SO_REUSEPORT group by the receiving CPU (classic BPF `ld cpu;
/// ret a`): socket i of the group gets what CPU i received, so each worker
/// thread serves one CPU's packets without sharing a queue.
pub fn reuseport_by_cpu(socket: &impl AsRawFd) -> io::Result<()> {
    const SKF_AD_OFF: u32 = 0xffff_f000;
    const SKF_AD_CPU: u32 = 36;
    let code = [
        libc::sock_filter {
            code: 0x20,
            jt: 0,
            jf: 0,
            k: SKF_AD_OFF + SKF_AD_CPU,
        }, // BPF_LD|BPF_W|BPF_ABS
        libc::sock_filter {
            code: 0x16,
            jt: 0,
            jf: 0,
            k: 0,
        }, // BPF_RET|BPF_A
    ];
    let prog = libc::sock_fprog {
        len: code.len() as u16,
        filter: code.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: valid fd and sock_fprog over a live array.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// CPU time (user + system) of the calling thread.
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CLOCK_REALTIME now, in ns.
pub fn realtime_ns() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

/// Kernel thread id of the calling thread.
pub fn gettid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::gettid() }
}

/// utime + stime of thread `tid` of this process, in clock ticks.
pub fn task_ticks(tid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    // Fields after the ")" of comm: state is field 3; utime 14, stime 15.
    let Some(rest) = text.rsplit_once(')').map(|(_, r)| r) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    get(14) + get(15)
}

/// Clock ticks per second (USER_HZ).
pub fn ticks_per_s() -> f64 {
    // SAFETY: no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// The aggregate `cpu` line of /proc/stat (ticks): user, nice, system,
/// idle, iowait, irq, softirq, steal.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStat {
    /// user + nice.
    pub user: u64,
    /// system.
    pub system: u64,
    /// idle + iowait.
    pub idle: u64,
    /// irq.
    pub irq: u64,
    /// softirq.
    pub softirq: u64,
    /// steal.
    pub steal: u64,
}

impl ProcStat {
    /// Read /proc/stat now.
    pub fn now() -> ProcStat {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let line = text.lines().next().unwrap_or("");
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let g = |i: usize| v.get(i).copied().unwrap_or(0);
        ProcStat {
            user: g(0) + g(1),
            system: g(2),
            idle: g(3) + g(4),
            irq: g(5),
            softirq: g(6),
            steal: g(7),
        }
    }

    /// `self - earlier`.
    pub fn since(&self, earlier: &ProcStat) -> ProcStat {
        ProcStat {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
            idle: self.idle.saturating_sub(earlier.idle),
            irq: self.irq.saturating_sub(earlier.irq),
            softirq: self.softirq.saturating_sub(earlier.softirq),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }

    /// All ticks.
    pub fn total(&self) -> u64 {
        self.user + self.system + self.idle + self.irq + self.softirq + self.steal
    }
}

/// Idle time of all online CPUs together (µs) from cpuidle, and how many
/// CPUs that is; `None` where a
/// CPU has no cpuidle states (then [`MachineClock`] falls back to
/// /proc/stat).
///
/// Why not /proc/stat alone: without CONFIG_IRQ_TIME_ACCOUNTING its busy
/// columns are sampled at the scheduler tick (250 Hz here), so a 2 s run on
/// 2 CPUs has ~1000 samples and its busy share moves by ~1.5 points from
/// sampling alone, more than the margin the marginal-CPU goal is judged on.
/// A cpuidle state's `time` counts from entering the state to the wake-up,
/// so interrupts and softirqs (XDP, the stack) are busy time, to the µs.
pub fn cpuidle_us() -> Option<(u64, usize)> {
    let mut total = 0u64;
    let mut cpus = 0usize;
    for entry in std::fs::read_dir("/sys/devices/system/cpu").ok()?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(n) = name.strip_prefix("cpu") else {
            continue;
        };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let online =
            std::fs::read_to_string(entry.path().join("online")).map_or(true, |t| t.trim() == "1");
        if !online {
            continue;
        }
        let states = std::fs::read_dir(entry.path().join("cpuidle")).ok()?;
        let mut any = false;
        for st in states.flatten() {
            if !st.file_name().to_string_lossy().starts_with("state") {
                continue;
            }
            let t: u64 = std::fs::read_to_string(st.path().join("time"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            total += t;
            any = true;
        }
        if !any {
            return None;
        }
        cpus += 1;
    }
    (cpus > 0).then_some((total, cpus))
}

/// A point in time for the machine's busy share over a run: the wall
/// clock, the CPUs' idle time from cpuidle (exact) and /proc/stat (the
/// softirq share, and the busy share where cpuidle is absent).
#[derive(Debug, Clone, Copy)]
pub struct MachineClock {
    at: std::time::Instant,
    idle_us: Option<(u64, usize)>,
    stat: ProcStat,
}

/// The machine over an interval: busy and softirq shares of all CPUs (0..1).
#[derive(Debug, Clone, Copy)]
pub struct MachineBusy {
    /// Busy share: 1 - idle / (CPUs × wall), idle from cpuidle; from
    /// /proc/stat where cpuidle is absent.
    pub busy: f64,
    /// Busy share from /proc/stat's tick-sampled columns (reported beside
    /// the exact one).
    pub busy_ticks: f64,
    /// Softirq share (/proc/stat, tick-sampled).
    pub softirq: f64,
    /// Whether `busy` came from cpuidle.
    pub exact: bool,
}

impl MachineClock {
    /// Now.
    pub fn now() -> MachineClock {
        MachineClock {
            at: std::time::Instant::now(),
            idle_us: cpuidle_us(),
            stat: ProcStat::now(),
        }
    }

    /// The machine between `earlier` and now.
    pub fn busy_since(earlier: &MachineClock) -> MachineBusy {
        let now = MachineClock::now();
        let stat = now.stat.since(&earlier.stat);
        let total = stat.total().max(1) as f64;
        let busy_ticks = (stat.total() - stat.idle) as f64 / total;
        let wall_us = (now.at - earlier.at).as_secs_f64() * 1e6;
        let exact = match (earlier.idle_us, now.idle_us) {
            // A CPU going on- or offline in between changes the sum: no exact figure then.
            (Some((a, ca)), Some((b, cb))) if ca == cb && b >= a && wall_us > 0.0 => {
                Some((1.0 - (b - a) as f64 / (cb as f64 * wall_us)).clamp(0.0, 1.0))
            }
            _ => None,
        };
        MachineBusy {
            busy: exact.unwrap_or(busy_ticks),
            busy_ticks,
            softirq: stat.softirq as f64 / total,
            exact: exact.is_some(),
        }
    }
}

/// Non-blocking `recvmsg` of one datagram with its SO_TIMESTAMPNS kernel
/// receive time (ns, CLOCK_REALTIME) when the socket has timestamps on.
/// `Ok(None)` when nothing is queued.
pub fn recv_timestamped(
    socket: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Option<i128>)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    // SAFETY: zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg points at live buffers.
    let rc = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        };
    }
    let mut ts = None;
    // SAFETY: walking the control buffer the kernel filled, with the libc macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let t = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::timespec);
                if t.tv_sec != 0 {
                    ts = Some(t.tv_sec as i128 * 1_000_000_000 + t.tv_nsec as i128);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Some((rc as usize, ts)))
}

/// Pin the calling thread to `cpu` (best effort).
pub fn pin_to_cpu(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data; CPU_SET within its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Wait until one of `sockets` is readable or `timeout` passes.
pub fn poll_any(sockets: &[&UdpSocket], timeout: Duration) -> io::Result<bool> {
    let mut fds: Vec<libc::pollfd> = sockets
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: valid pollfd array.
    let rc = unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            timeout.as_millis().min(i32::MAX as u128) as i32,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(rc > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// One thread spinning for the whole window keeps one CPU busy: the
    /// machine's busy share is at least ~1/CPUs whatever else runs, and the
    /// exact figure (cpuidle, where this machine has it: the benchmark VM
    /// does) agrees with /proc/stat's tick samples to within their noise. A
    /// change that read the wrong files, or the counters in the wrong unit,
    /// lands outside one bound or the other.
    #[test]
    fn busy_share_follows_a_spinning_thread() {
        let cpus = cpuidle_us()
            .map(|(_, n)| n)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            as f64;
        let stop = AtomicBool::new(false);
        let b = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            let c0 = MachineClock::now();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_millis(800) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let b = MachineClock::busy_since(&c0);
            stop.store(true, Ordering::Relaxed);
            b
        });
        assert!(
            b.busy >= 0.8 / cpus && b.busy <= 1.0,
            "busy {:.3} with one of {cpus} CPUs spinning (exact: {})",
            b.busy,
            b.exact
        );
        if cpuidle_us().is_some() {
            assert!(b.exact, "cpuidle is present, the figure must come from it");
            // ~400 tick samples on 2 CPUs: a few points of noise.
            assert!(
                (b.busy - b.busy_ticks).abs() < 0.25,
                "cpuidle says {:.3} busy, /proc/stat's ticks {:.3}",
                b.busy,
                b.busy_ticks
            );
        }
    }
}
