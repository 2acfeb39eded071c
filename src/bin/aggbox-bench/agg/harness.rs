//! The harness the aggregation experiments share: the testbed's senders
//! and their pacing, one run of a workload against an aggregator, and
//! what it measured.

use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject};
use serde::Serialize;

use crate::net::{self, RecvBatch};
use crate::floor::Floor;
use crate::{progress, PrivateBpffs};
use aggbox::config::Config;
use aggbox::kernel::maps;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::wire::proto;
use crate::testbed::{in_netns, Testbed, TestbedConfig};

use super::{
    drop_skel, prog_id, Mode, Workload, BATCH, JOB, JOB_PORT, JOB_SLOTS, JOB_VECTOR_LEN, PER,
    RESEND_BUDGET, RESULT_PORT, STALL, STALL_MAX, WINDOW_WAIT, WINDOW_WAITS,
};
use super::aggregators::{build, Aggregator};

/// Completion state shared by senders and the aggregator of one run.
pub(super) struct Shared {
    pub(super) frags: u64,
    /// Time base of `t_first` / `t_last`.
    pub(super) epoch: Instant,
    /// ns after `epoch` when the first sender started (min over senders).
    pub(super) t_first: AtomicU64,
    /// ns after `epoch` when the last fragment completed (drop: the last sender finished).
    pub(super) t_last: AtomicU64,
    pub(super) done: Vec<AtomicU64>,
    pub(super) completed: AtomicU64,
    pub(super) wrong: AtomicU64,
    pub(super) stop: AtomicBool,
}

impl Shared {
    pub(super) fn new(frags: u64) -> Shared {
        Shared {
            frags,
            epoch: Instant::now(),
            t_first: AtomicU64::new(u64::MAX),
            t_last: AtomicU64::new(0),
            done: (0..frags.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            completed: AtomicU64::new(0),
            wrong: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        }
    }
    pub(super) fn is_done(&self, k: u64) -> bool {
        self.done[(k / 64) as usize].load(Ordering::Relaxed) & (1 << (k % 64)) != 0
    }
    /// Mark fragment k complete; true the first time.
    pub(super) fn mark(&self, k: u64) -> bool {
        if k >= self.frags {
            return false;
        }
        let bit = 1u64 << (k % 64);
        let old = self.done[(k / 64) as usize].fetch_or(bit, Ordering::AcqRel);
        if old & bit == 0 {
            if self.completed.fetch_add(1, Ordering::AcqRel) + 1 == self.frags {
                self.t_last
                    .fetch_max(self.epoch.elapsed().as_nanos() as u64, Ordering::AcqRel);
            }
            true
        } else {
            false
        }
    }
    pub(super) fn finished(&self) -> bool {
        self.completed.load(Ordering::Acquire) >= self.frags || self.stop.load(Ordering::Relaxed)
    }
}

/// Parameters of one run.
#[derive(Debug, Clone, Copy)]
pub struct RunSpec {
    /// Round number (distinct per run of one attachment).
    pub round: u32,
    /// Fragments a sender may be ahead of its oldest incomplete one (0 = unpaced).
    pub window: u64,
    /// Give up after this long.
    pub deadline: Duration,
    /// Datagrams per second per sender (None = as fast as possible).
    pub rate_per_sender: Option<f64>,
}

/// Outcome of one run.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RunResult {
    /// Aggregator.
    pub mode: String,
    /// Senders.
    pub senders: usize,
    /// Elements per sender.
    pub elements_per_sender: u64,
    /// Bytes of all contributions' payloads together.
    pub total_bytes: u64,
    /// Fragments (per sender).
    pub fragments: u64,
    /// Seconds from the start barrier to the last completed fragment
    /// (drop: to the last datagram sent + drain).
    pub secs: f64,
    /// Aggregated elements per second: senders × elements / secs ("ops/s").
    pub elems_per_s: f64,
    /// Contributions sent (first copies).
    pub sent: u64,
    /// Contributions resent after a stall.
    pub resent: u64,
    /// Fragments whose result was wrong.
    pub wrong: u64,
    /// Fragments completed.
    pub completed: u64,
    /// Whether every fragment completed with the right result.
    pub ok: bool,
    /// Contributions the drop program counted (drop mode).
    pub dropped_counted: u64,
    /// Δ run time of the XDP programs (ns), summed over the chain (bpf_stats).
    pub xdp_run_ns: u64,
    /// Δ runs of the XDP entry program.
    pub xdp_runs: u64,
    /// Per-program (name, Δruns, Δns).
    pub xdp_programs: Vec<(String, u64, u64)>,
    /// CPU seconds of the aggregator's user-space threads.
    pub agg_thread_cpu_s: f64,
    /// Busy fraction of all CPUs over the run (0..1), from cpuidle's idle
    /// time (exact; [`net::MachineClock`]), /proc/stat where cpuidle is absent.
    pub sys_busy: f64,
    /// The same from /proc/stat's tick-sampled columns.
    pub sys_busy_ticks: f64,
    /// Whether `sys_busy` is the exact (cpuidle) figure.
    pub sys_busy_exact: bool,
    /// /proc/stat Δ: softirq fraction of all CPUs.
    pub sys_softirq: f64,
    /// Error text when not ok.
    pub error: Option<String>,
}

/// A testbed with one aggregator host and `senders` sender hosts.
pub struct Harness {
    /// The testbed.
    pub tb: Testbed,
    /// Sender sockets (rank r = host r+1), connected to host0:JOB_PORT.
    pub senders: Vec<UdpSocket>,
    pub(super) bpffs: PrivateBpffs,
}

impl Harness {
    /// Build the testbed (static neighbours) and the sender sockets.
    pub fn new(senders: usize) -> Result<Harness> {
        let tb = Testbed::up(TestbedConfig {
            hosts: senders + 1,
            static_neigh: true,
            ..Default::default()
        })?;
        // A queue in front of the aggregator's port. With an XDP program on
        // host 0's veth, the switch hands it frames through a 256-entry ring
        // (NAPI mode) instead of the 1000-entry backlog a socket receiver
        // gets; with the port's default noqueue a burst of the senders'
        // sendmmsg batches overflowed that ring and the frame was dropped
        // (the port's TX `dropped`), so every XDP mode lost a few datagrams
        // per run that the plain aggregator did not, each a 50 ms stall and
        // a resend. With a qdisc the veth stops its queue when the ring is
        // full (backpressure, kernels from 6.16) and the frame waits there.
        let port = tb.switch_port(0);
        let qdisc = std::process::Command::new("ip")
            .args(["netns", "exec", &tb.switch_netns(), "tc", "qdisc", "replace", "dev", &port, "root", "pfifo", "limit", "10000"])
            .output()
            .context("running tc")?;
        if !qdisc.status.success() {
            bail!("tc qdisc on the aggregator's switch port {port}: {}", String::from_utf8_lossy(&qdisc.stderr).trim());
        }
        let agg = tb.host(0).addr;
        let mut socks = Vec::new();
        for r in 0..senders {
            let h = tb.host(r + 1);
            let s = in_netns(&h.netns, || -> std::io::Result<UdpSocket> {
                let s = UdpSocket::bind(SocketAddrV4::new(h.addr, 0))?;
                s.connect(SocketAddrV4::new(agg, JOB_PORT))?;
                Ok(s)
            })??;
            net::set_sndbuf(&s, 4 << 20)?;
            socks.push(s);
        }
        Ok(Harness {
            tb,
            senders: socks,
            bpffs: PrivateBpffs::mount("agg")?,
        })
    }

    /// Sender addresses (rank order).
    pub fn worker_addrs(&self) -> Vec<Ipv4Addr> {
        (0..self.senders.len())
            .map(|r| self.tb.host(r + 1).addr)
            .collect()
    }

    /// Config text of the benchmark job.
    pub fn config_text(&self) -> String {
        let workers: Vec<String> = self
            .worker_addrs()
            .iter()
            .map(|a| format!("\"{a}\""))
            .collect();
        format!(
            "[node]\nmetrics = \"off\"\n\n[[job]]\nid = {JOB}\nport = {JOB_PORT}\nresult_port = {RESULT_PORT}\nworkers = [{}]\nslots = {JOB_SLOTS}\nvector_len = {JOB_VECTOR_LEN}\nwindow = 4\n",
            workers.join(", ")
        )
    }

    /// Run `f` with the aggregator of `mode` in place on host 0; `f` gets an
    /// [`Aggregator`] to run workloads with. Attach/detach happens here.
    pub fn with_mode<T>(
        &self,
        mode: Mode,
        f: impl FnOnce(&mut Aggregator<'_>) -> Result<T> + Send,
    ) -> Result<T>
    where
        T: Send,
    {
        let netns = self.tb.host(0).netns.clone();
        let text = self.config_text();
        let pins = self.bpffs.path.clone();
        in_netns(&netns, || -> Result<T> {
            match mode {
                Mode::Kernel => {
                    let config = Config::parse(&text, "bench.toml")
                        .map_err(|e| anyhow!("bench config: {e}"))?;
                    let att = node::attach("eth0", &config, None, &pins, XdpMode::Native)?;
                    for w in &att.warnings {
                        progress(format!("  attach warning: {w}"));
                    }
                    let rx =
                        UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, RESULT_PORT))?;
                    net::set_rcvbuf(&rx, 128 << 20)?;
                    rx.set_read_timeout(Some(Duration::from_millis(10)))?;
                    let mut a = Aggregator {
                        h: self,
                        mode,
                        rx: vec![rx],
                        att: Some(&att),
                        drop: None,
                        floor: None,
                    };
                    let out = f(&mut a);
                    drop(a);
                    att.detach()?;
                    out
                }
                Mode::Plain | Mode::Tuned => {
                    let n = if mode == Mode::Plain { 1 } else { 2 };
                    let mut rx = Vec::new();
                    for _ in 0..n {
                        let s = net::reuseport_socket(SocketAddrV4::new(
                            Ipv4Addr::UNSPECIFIED,
                            JOB_PORT,
                        ))?;
                        net::set_rcvbuf(&s, 128 << 20)?;
                        s.set_read_timeout(Some(Duration::from_millis(10)))?;
                        rx.push(s);
                    }
                    if mode == Mode::Tuned {
                        net::reuseport_by_cpu(&rx[0])?;
                    }
                    let mut a = Aggregator {
                        h: self,
                        mode,
                        rx,
                        att: None,
                        drop: None,
                        floor: None,
                    };
                    f(&mut a)
                }
                Mode::Floor => {
                    // Slot index = fragment number (the pacing window keeps
                    // far fewer than its 8192 slots in flight), every round.
                    let floor = Floor::load(JOB_PORT, RESULT_PORT, self.senders.len() as u32)?;
                    let ifindex = node::ifindex("eth0")?;
                    let link = floor
                        .prog()
                        .attach_xdp(ifindex as i32)
                        .context("attaching bench_floor")?;
                    let rx =
                        UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, RESULT_PORT))?;
                    net::set_rcvbuf(&rx, 128 << 20)?;
                    rx.set_read_timeout(Some(Duration::from_millis(10)))?;
                    let prog_id = {
                        use std::os::fd::AsFd;
                        prog_id(floor.prog().as_fd())
                    };
                    let mut a = Aggregator {
                        h: self,
                        mode,
                        rx: vec![rx],
                        att: None,
                        drop: None,
                        floor: Some(prog_id),
                    };
                    let out = f(&mut a);
                    drop(a);
                    drop(link);
                    out
                }
                Mode::Drop => {
                    let mut obj = MaybeUninit::<OpenObject>::uninit();
                    let open = drop_skel::BenchDropSkelBuilder::default()
                        .open(&mut obj)
                        .context("opening bench_drop")?;
                    let skel = open.load().context("loading bench_drop")?;
                    skel.maps
                        .bench_cfg
                        .update(
                            &0u32.to_ne_bytes(),
                            &u32::from(JOB_PORT).to_ne_bytes(),
                            MapFlags::ANY,
                        )
                        .context("bench_cfg")?;
                    let ifindex = node::ifindex("eth0")?;
                    let link = skel
                        .progs
                        .bench_drop
                        .attach_xdp(ifindex as i32)
                        .context("attaching bench_drop")?;
                    let counts = &skel.maps.bench_counts;
                    let read = move || -> u64 { maps::percpu_array_sum::<u64>(counts, 0).unwrap_or(0) };
                    let prog_id = {
                        use std::os::fd::AsFd;
                        prog_id(skel.progs.bench_drop.as_fd())
                    };
                    let mut a = Aggregator {
                        h: self,
                        mode,
                        rx: vec![],
                        att: None,
                        drop: Some((Box::new(read), prog_id)),
                        floor: None,
                    };
                    let out = f(&mut a);
                    drop(a);
                    drop(link);
                    out
                }
            }
        })?
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn sender(
    sock: &UdpSocket,
    rank: u16,
    w: &dyn Workload,
    shared: &Shared,
    window: u64,
    spec: RunSpec,
    barrier: &Barrier,
    sent: &AtomicU64,
    resent: &AtomicU64,
) -> Result<()> {
    let elements = w.elements();
    let frags = shared.frags;
    let mut bufs: Vec<Vec<u8>> = (0..BATCH).map(|_| Vec::with_capacity(1500)).collect();
    let mut seq = 0u32;
    let mut next = 0u64;
    let mut scan_low = 0u64;
    // The oldest fragment not known complete: the window's base.
    let mut window_low = 0u64;
    let mut last_completed = 0u64;
    let mut last_progress = Instant::now();
    let mut stall = STALL;
    barrier.wait();
    let start = Instant::now();
    shared
        .t_first
        .fetch_min((start - shared.epoch).as_nanos() as u64, Ordering::AcqRel);
    // Resend this rank's contributions to incomplete fragments in [scan_low, upto).
    let resend =
        |scan_low: &mut u64, upto: u64, bufs: &mut Vec<Vec<u8>>, seq: &mut u32| -> Result<()> {
            while *scan_low < upto && shared.is_done(*scan_low) {
                *scan_low += 1;
            }
            let mut k = *scan_low;
            let mut n = 0;
            let mut budget = RESEND_BUDGET;
            while k < upto && budget > 0 {
                if !shared.is_done(k) {
                    build(w, rank, spec.round, k, frags, elements, *seq, &mut bufs[n]);
                    *seq = seq.wrapping_add(1);
                    n += 1;
                    budget -= 1;
                    if n == BATCH {
                        let refs: Vec<&[u8]> = bufs[..n].iter().map(|b| b.as_slice()).collect();
                        net::send_batch(sock, &refs)?;
                        resent.fetch_add(n as u64, Ordering::Relaxed);
                        n = 0;
                    }
                }
                k += 1;
            }
            if n > 0 {
                let refs: Vec<&[u8]> = bufs[..n].iter().map(|b| b.as_slice()).collect();
                net::send_batch(sock, &refs)?;
                resent.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(())
        };
    while next < frags {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        if window > 0 {
            let c = shared.completed.load(Ordering::Acquire);
            if c != last_completed {
                last_completed = c;
                last_progress = Instant::now();
                stall = STALL;
            }
            while window_low < next && shared.is_done(window_low) {
                window_low += 1;
            }
            if next + BATCH as u64 > window_low + window && next + 1 > window_low + window / 2 {
                if last_progress.elapsed() > stall {
                    resend(&mut scan_low, next, &mut bufs, &mut seq)?;
                    last_progress = Instant::now();
                    stall = (stall * 2).min(STALL_MAX);
                }
                WINDOW_WAITS.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(WINDOW_WAIT);
                continue;
            }
        }
        if let Some(rate) = spec.rate_per_sender {
            let due = start + Duration::from_secs_f64(next as f64 / rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep((due - now).min(Duration::from_millis(5)));
                continue;
            }
        }
        let n = (frags - next).min(BATCH as u64) as usize;
        for (i, b) in bufs.iter_mut().take(n).enumerate() {
            build(
                w,
                rank,
                spec.round,
                next + i as u64,
                frags,
                elements,
                seq,
                b,
            );
            seq = seq.wrapping_add(1);
        }
        let refs: Vec<&[u8]> = bufs[..n].iter().map(|b| b.as_slice()).collect();
        net::send_batch(sock, &refs)?;
        sent.fetch_add(n as u64, Ordering::Relaxed);
        next += n as u64;
    }
    if window == 0 {
        shared
            .t_last
            .fetch_max(shared.epoch.elapsed().as_nanos() as u64, Ordering::AcqRel);
        return Ok(());
    }
    // Tail: resend what stalls until everything completed or the run stops.
    last_progress = Instant::now();
    while !shared.finished() {
        let c = shared.completed.load(Ordering::Acquire);
        if c != last_completed {
            last_completed = c;
            last_progress = Instant::now();
            stall = STALL;
        }
        if last_progress.elapsed() > stall {
            resend(&mut scan_low, frags, &mut bufs, &mut seq)?;
            last_progress = Instant::now();
            stall = (stall * 2).min(STALL_MAX);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

pub(super) fn collect_results(sock: &UdpSocket, w: &dyn Workload, shared: &Shared, round: u32) -> Result<()> {
    let mut batch = RecvBatch::new(64, 2048);
    while !shared.finished() {
        let n = batch.recv(sock, false)?;
        for i in 0..n {
            let Ok((hdr, be)) = proto::split_agg(batch.get(i)) else {
                continue;
            };
            if hdr.job != JOB || hdr.round != aggbox::wire::abi::Round(round) || !hdr.is_result() {
                continue;
            }
            let k = u64::from(hdr.frag_off) / PER as u64;
            if shared.is_done(k) {
                continue;
            }
            if w.check(k, be) {
                shared.mark(k);
            } else {
                shared.wrong.fetch_add(1, Ordering::Relaxed);
                shared.mark(k);
            }
        }
    }
    Ok(())
}
