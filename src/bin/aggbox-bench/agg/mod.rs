//! Experiment 1: aggregation throughput, and the harness the other
//! aggregation experiments reuse.
//!
//! Testbed: host 0 is the aggregator, hosts 1..=S the senders (one rank
//! each). Every sender thread owns a UDP socket in its host's namespace,
//! connected to `host0:JOB_PORT`, and sends its vector as AGG1 contributions
//! (full-MTU fragments of 362 int32) in `sendmmsg` batches of 32.
//!
//! Aggregators compared in the same run (same senders, same pacing):
//! - `kernel`: AggBox (`node::attach` on host 0's eth0, native XDP); the
//!   application is a `recvmmsg` socket on the job's `result_port`.
//! - `plain`: the plain user-space UDP aggregator: one socket, one `recv`
//!   per datagram, `reducer::Accumulator` per fragment.
//! - `tuned`: `recvmmsg` batches of 64 on 2 `SO_REUSEPORT` sockets (steered
//!   by receiving CPU) with one thread each, a sharded slot table.
//! - `drop`: the ceiling, `src/bpf/bench_drop.bpf.c` counting and dropping
//!   every contribution in XDP (no pacing: the senders go flat out).
//! - `floor`: the least an XDP aggregator of this traffic costs,
//!   `src/bpf/bench_floor.bpf.c` ([`Floor`]): an array slot per fragment,
//!   direct packet access, one lock, the adds, the RESULT rewrite, nothing
//!   else; its RESULTs are received and checked like AggBox's.
//!
//! Pacing (slot pool): a sender may be at most `window` fragments ahead of
//! its oldest incomplete fragment (a sliding window), which bounds the
//! fragments in progress (kernel slots) by `window` < the job's 4096 slots
//! even while a lost contribution holds one fragment back. When no
//! fragment completes for 50 ms (a datagram lost in a full queue), every
//! sender resends its oldest incomplete fragments (with back-off); the aggregators deduplicate, and resends are
//! counted. A sender whose window is full sleeps ([`WINDOW_WAIT`]). Every result is checked against the reference values (sums of
//! `tools::pattern_value`), in every mode.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject};
use serde::Serialize;

use super::net::{self, RecvBatch};
use crate::floor::Floor;
use super::{
    progress, summarize, thousands, BenchOptions, Context_, Csv, PrivateBpffs, Section, Summary,
};
use aggbox::wire::abi::{self, Op};
use aggbox::config::Config;
use aggbox::kernel::maps;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::wire::reducer::Accumulator;
use crate::testbed::{in_netns, Testbed, TestbedConfig};
use aggbox::node::tools;

#[allow(clippy::all, missing_docs, dead_code)]
mod drop_skel {
    include!(concat!(env!("OUT_DIR"), "/bench_drop.skel.rs"));
}

/// Job id of the benchmark job.
pub const JOB: u16 = 1;
/// Contribution port.
pub const JOB_PORT: u16 = 7000;
/// RESULT port of the kernel path.
pub const RESULT_PORT: u16 = 7001;
/// Elements per full-MTU (1500) contribution.
pub const PER: usize = 362;
/// Datagrams per `sendmmsg`.
pub const BATCH: usize = 32;
/// The project's goal for AggBox's XDP time per contribution against the
/// floor aggregator's (docs/BENCHMARKS.md).
const FLOOR_GOAL: f64 = 1.3;
/// Slots of the benchmark's kernel job (`slots` of its `[[job]]`).
pub const JOB_SLOTS: u32 = 4096;
/// `vector_len` of the benchmark's kernel job: the elements of the largest
/// workload (512 MB of int32), as an operator configures a job whose vector
/// length is known (the fast slots then index by round and offset,
/// docs/DATAPLANE.md).
pub const JOB_VECTOR_LEN: u32 = 512 << 18;
/// Repetitions of the full run (docs/BENCHMARKS.md: the floor's own XDP time
/// moves by a third between repetitions; the goals are medians).
pub const AGG_REPS: usize = 7;

/// Fragments a sender may have in flight, counted from its oldest incomplete
/// fragment (a sliding window, as the runtime's send windows are): 8192
/// datagrams over all senders (2048 each for 4), below the job's 4096 slots,
/// so that a fragment whose contribution was lost never shares its fast slot
/// with one sent after it (docs/DATAPLANE.md, "Regions").
pub fn window_for(senders: usize) -> u64 {
    (8192 / senders.max(1) as u64).clamp(64, 2048)
}

/// How long a sender whose window is full sleeps before it looks again.
/// Sleeping, not spinning: on this 2-CPU machine the senders share the
/// CPUs with the work that frees their windows (the slowest sender's sends,
/// whose softirq runs the XDP programs; the RESULT receiver; a user-space
/// aggregator), and 3 senders spinning through `sched_yield` behind the
/// slowest took ~10 % of the machine's samples in the 512 MB runs; in the
/// paced runs a wait behind a lost contribution (up to the 50 ms resend
/// timeout) was charged to that run's busy share. The window spans ~30 ms
/// of sending at the fastest rates measured, so 100 µs keeps it full.
const WINDOW_WAIT: Duration = Duration::from_micros(100);

/// Times a sender found its window full and waited, in this process
/// (`AGGBOX_BENCH_COUNTERS` prints its change per run).
static WINDOW_WAITS: AtomicU64 = AtomicU64::new(0);

/// Distinct payload blocks per rank (fragment k carries block k % NBLK).
const NBLK: u64 = 61;
/// No fragment completed for this long: the oldest incomplete ones are
/// resent (at most RESEND_BUDGET per sender), and the timeout doubles (up to
/// STALL_MAX) until fragments complete again, so a slow aggregator is not
/// buried under resends of datagrams that are only queued.
const STALL: Duration = Duration::from_millis(50);
const STALL_MAX: Duration = Duration::from_millis(800);
const RESEND_BUDGET: u64 = 256;

/// Aggregator under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// AggBox XDP.
    Kernel,
    /// One recv per datagram, reducer::Accumulator.
    Plain,
    /// recvmmsg + SO_REUSEPORT threads.
    Tuned,
    /// XDP count-and-drop ceiling.
    Drop,
    /// The floor aggregator ([`Floor`]).
    Floor,
}

impl Mode {
    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kernel => "kernel",
            Mode::Plain => "plain",
            Mode::Tuned => "tuned",
            Mode::Drop => "drop",
            Mode::Floor => "floor",
        }
    }
}

/// What the senders send and what the result must be.
pub trait Workload: Sync {
    /// Elements per sender.
    fn elements(&self) -> u64;
    /// Append rank `rank`'s payload of fragment `frag` (`count` elements) as big-endian int32.
    fn payload(&self, rank: u16, frag: u64, count: usize, out: &mut Vec<u8>);
    /// Whether a reduced fragment is right (big-endian int32); may store it.
    fn check(&self, frag: u64, result_be: &[u8]) -> bool;
}

/// The throughput workload: fragment k of rank r carries block k % 61 of
/// `tools::pattern_vector(r, ..)`; results are checked in full.
pub struct Pattern {
    elements: u64,
    blocks: Vec<Vec<Vec<u8>>>,
    expected: Vec<Vec<u8>>,
}

impl Pattern {
    /// `senders` ranks of `elements` each.
    pub fn new(senders: usize, elements: u64) -> Pattern {
        let blocks: Vec<Vec<Vec<u8>>> = (0..senders)
            .map(|r| {
                (0..NBLK)
                    .map(|b| {
                        let v: Vec<i32> = (0..PER)
                            .map(|i| tools::pattern_value(r as u16, (b as usize * PER + i) as u32))
                            .collect();
                        let mut out = Vec::with_capacity(4 * PER);
                        proto::write_i32_be(&v, &mut out);
                        out
                    })
                    .collect()
            })
            .collect();
        let expected = (0..NBLK)
            .map(|b| {
                let v: Vec<i32> = (0..PER)
                    .map(|i| {
                        (0..senders)
                            .map(|r| tools::pattern_value(r as u16, (b as usize * PER + i) as u32))
                            .sum()
                    })
                    .collect();
                let mut out = Vec::with_capacity(4 * PER);
                proto::write_i32_be(&v, &mut out);
                out
            })
            .collect();
        Pattern {
            elements,
            blocks,
            expected,
        }
    }
}

impl Workload for Pattern {
    fn elements(&self) -> u64 {
        self.elements
    }
    fn payload(&self, rank: u16, frag: u64, count: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.blocks[rank as usize][(frag % NBLK) as usize][..4 * count]);
    }
    fn check(&self, frag: u64, result_be: &[u8]) -> bool {
        let e = &self.expected[(frag % NBLK) as usize];
        result_be.len() <= e.len() && result_be == &e[..result_be.len()]
    }
}

/// Completion state shared by senders and the aggregator of one run.
struct Shared {
    frags: u64,
    /// Time base of `t_first` / `t_last`.
    epoch: Instant,
    /// ns after `epoch` when the first sender started (min over senders).
    t_first: AtomicU64,
    /// ns after `epoch` when the last fragment completed (drop: the last sender finished).
    t_last: AtomicU64,
    done: Vec<AtomicU64>,
    completed: AtomicU64,
    wrong: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    fn new(frags: u64) -> Shared {
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
    fn is_done(&self, k: u64) -> bool {
        self.done[(k / 64) as usize].load(Ordering::Relaxed) & (1 << (k % 64)) != 0
    }
    /// Mark fragment k complete; true the first time.
    fn mark(&self, k: u64) -> bool {
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
    fn finished(&self) -> bool {
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
    bpffs: PrivateBpffs,
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

/// The kernel's id of a loaded program (0 if it cannot be read).
pub(super) fn prog_id(fd: std::os::fd::BorrowedFd<'_>) -> u32 {
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed info is valid; no arrays requested.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: valid fd and buffer.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc < 0 {
        0
    } else {
        info.id
    }
}

type DropReader<'a> = (Box<dyn Fn() -> u64 + 'a>, u32);

/// An aggregator in place on host 0 (see [`Harness::with_mode`]).
pub struct Aggregator<'a> {
    h: &'a Harness,
    /// Mode.
    pub mode: Mode,
    rx: Vec<UdpSocket>,
    /// The AggBox attachment (kernel mode).
    pub att: Option<&'a node::Attachment>,
    drop: Option<DropReader<'a>>,
    /// The floor program's id (floor mode).
    floor: Option<u32>,
}

fn prog_stats(a: &Aggregator<'_>) -> Vec<(String, u64, u64)> {
    if let Some(att) = a.att {
        return att
            .xdp
            .programs()
            .map(|v| {
                v.into_iter()
                    .map(|p| (p.name.to_string(), p.run_cnt, p.run_time_ns))
                    .collect()
            })
            .unwrap_or_default();
    }
    if let Some((_, id)) = &a.drop {
        if let Ok((cnt, ns, _)) = aggbox::node::metrics::program_run_stats(*id) {
            return vec![("bench_drop".into(), cnt, ns)];
        }
    }
    if let Some(id) = a.floor {
        if let Ok((cnt, ns, _)) = aggbox::node::metrics::program_run_stats(id) {
            return vec![("bench_floor".into(), cnt, ns)];
        }
    }
    vec![]
}

/// `AGGBOX_BENCH_PERF=<dir>`: a whole-machine `perf record -a -g` around
/// each run's window (senders, softirq, the aggregator's threads, nothing
/// of program loading or the testbed), one file per run,
/// `<dir>/<mode>-<round>.data`, to compare where the machine's time goes
/// per mode (docs/BENCHMARKS.md). It costs CPU: runs recorded this way are
/// for profiles, not for the figures.
struct PerfWindow {
    child: std::process::Child,
    path: std::path::PathBuf,
}

impl PerfWindow {
    fn start(mode: Mode, round: u32) -> Result<Option<PerfWindow>> {
        let Some(dir) = std::env::var_os("AGGBOX_BENCH_PERF") else { return Ok(None) };
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("AGGBOX_BENCH_PERF: creating {}", dir.display()))?;
        let path = dir.join(format!("{}-{round}.data", mode.name()));
        let child = std::process::Command::new("perf")
            .args(["record", "-a", "-g", "-F", "999", "-q", "-o"])
            .arg(&path)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("AGGBOX_BENCH_PERF: starting perf record (is perf installed?)")?;
        // perf opens its events in the first tens of milliseconds; the run
        // must not begin before it samples.
        std::thread::sleep(Duration::from_millis(400));
        Ok(Some(PerfWindow { child, path }))
    }

    /// SIGINT: perf writes its buffers and the header, then exits.
    fn interrupt_and_wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: signals the perf child this process started and has not reaped.
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        self.child.wait()
    }

    fn stop(mut self) -> Result<()> {
        let status = self.interrupt_and_wait().context("waiting for perf record")?;
        if !self.path.exists() {
            bail!("AGGBOX_BENCH_PERF: perf record wrote no {} ({status})", self.path.display());
        }
        progress(format!("  perf: {}", self.path.display()));
        Ok(())
    }
}

impl Drop for PerfWindow {
    /// A run that failed half-way leaves no perf behind.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.interrupt_and_wait();
        }
    }
}

impl Aggregator<'_> {
    /// [`Aggregator::run`]; with `AGGBOX_BENCH_COUNTERS` set, an AggBox run
    /// also prints the change of its fast-slot counters and its node
    /// counters (drop reasons among them) over the run.
    pub fn run_counted(&mut self, w: &dyn Workload, spec: RunSpec) -> RunResult {
        let on = std::env::var_os("AGGBOX_BENCH_COUNTERS").is_some();
        let counters = self.att.filter(|_| on);
        let fast_before = counters.and_then(|att| att.xdp.fast_stats().ok());
        let waits_before = (WINDOW_WAITS.load(Ordering::Relaxed), net::SEND_RETRIES.load(Ordering::Relaxed));
        let r = self.run(w, spec);
        if on {
            progress(format!(
                "  {} senders' waits: window full {}, send queue full {}; resent {}",
                self.mode.name(),
                WINDOW_WAITS.load(Ordering::Relaxed) - waits_before.0,
                net::SEND_RETRIES.load(Ordering::Relaxed) - waits_before.1,
                r.resent
            ));
        }
        if let (Some(att), Some(before)) = (counters, fast_before) {
            if let Ok(after) = att.xdp.fast_stats() {
                let d: Vec<String> = abi::FAST_STAT_LABELS
                    .iter()
                    .zip(after.iter().zip(before.iter()))
                    .map(|(l, (a, b))| format!("{l}={}", a - b))
                    .collect();
                progress(format!(
                    "  fast slots: {}; counters: {}",
                    d.join(" "),
                    kernel_counters(att).unwrap_or_default()
                ));
            }
        }
        r
    }

    /// Run one workload through this aggregator.
    pub fn run(&mut self, w: &dyn Workload, spec: RunSpec) -> RunResult {
        match self.run_inner(w, spec) {
            Ok(r) => r,
            Err(e) => RunResult {
                mode: self.mode.name().into(),
                error: Some(format!("{e:#}")),
                ..Default::default()
            },
        }
    }

    fn run_inner(&mut self, w: &dyn Workload, spec: RunSpec) -> Result<RunResult> {
        let senders = self.h.senders.len();
        let elements = w.elements();
        let frags = elements.div_ceil(PER as u64);
        let shared = Shared::new(frags);
        let barrier = Barrier::new(senders + self.rx.len().max(1) + 1);
        let mode = self.mode;
        let window = if mode == Mode::Drop { 0 } else { spec.window };
        let drop_before = self.drop.as_ref().map(|(f, _)| f()).unwrap_or(0);
        let prog_before = prog_stats(self);
        // Drain anything queued from an earlier run.
        for s in &self.rx {
            s.set_nonblocking(true)?;
            let mut b = [0u8; 2048];
            while s.recv(&mut b).is_ok() {}
            s.set_nonblocking(false)?;
        }
        let sent = AtomicU64::new(0);
        let resent = AtomicU64::new(0);
        let agg_cpu = Mutex::new(0f64);
        let tables: Vec<Mutex<HashMap<u64, (Accumulator, u64)>>> =
            (0..64).map(|_| Mutex::new(HashMap::new())).collect();
        let all_ranks: u64 = if senders >= 64 {
            u64::MAX
        } else {
            (1u64 << senders) - 1
        };
        let stat0;
        let t0;
        let mut t_end = None;
        let perf = PerfWindow::start(mode, spec.round)?;
        {
            let shared = &shared;
            let barrier = &barrier;
            let sent = &sent;
            let resent = &resent;
            let agg_cpu = &agg_cpu;
            let tables = &tables;
            let rx = &self.rx;
            let (s0, start, end) = std::thread::scope(
                |scope| -> Result<(net::MachineClock, Instant, Option<Instant>)> {
                    let mut handles = Vec::new();
                    for (r, sock) in self.h.senders.iter().enumerate() {
                        handles.push(scope.spawn(move || {
                            sender(
                                sock, r as u16, w, shared, window, spec, barrier, sent, resent,
                            )
                        }));
                    }
                    let mut agg_handles = Vec::new();
                    if mode == Mode::Drop {
                        agg_handles.push(scope.spawn(move || -> Result<()> {
                            barrier.wait();
                            Ok(())
                        }));
                    }
                    for (i, sock) in rx.iter().enumerate() {
                        let one = mode == Mode::Plain;
                        agg_handles.push(scope.spawn(move || -> Result<()> {
                            barrier.wait();
                            let c0 = net::thread_cpu_time();
                            let r = match mode {
                                Mode::Kernel | Mode::Floor => collect_results(sock, w, shared, spec.round),
                                _ => user_aggregate(
                                    sock, one, w, shared, spec.round, tables, all_ranks, i,
                                ),
                            };
                            *agg_cpu.lock().unwrap_or_else(|e| e.into_inner()) +=
                                (net::thread_cpu_time() - c0).as_secs_f64();
                            r
                        }));
                    }
                    let s0 = net::MachineClock::now();
                    barrier.wait();
                    let start = Instant::now();
                    let deadline = start + spec.deadline;
                    let mut end = None;
                    if mode != Mode::Drop {
                        while !shared.finished() {
                            if Instant::now() > deadline {
                                shared.stop.store(true, Ordering::Relaxed);
                                break;
                            }
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        if shared.completed.load(Ordering::Acquire) >= frags {
                            end = Some(Instant::now());
                        }
                        shared.stop.store(true, Ordering::Relaxed);
                    }
                    let mut errs = Vec::new();
                    for h in handles {
                        match h.join() {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => errs.push(format!("{e:#}")),
                            Err(_) => errs.push("sender panicked".into()),
                        }
                    }
                    if mode == Mode::Drop {
                        end = Some(Instant::now());
                        shared.stop.store(true, Ordering::Relaxed);
                    }
                    for h in agg_handles {
                        match h.join() {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => errs.push(format!("{e:#}")),
                            Err(_) => errs.push("aggregator panicked".into()),
                        }
                    }
                    if !errs.is_empty() {
                        bail!("{}", errs.join("; "));
                    }
                    Ok((s0, start, end))
                },
            )?;
            stat0 = s0;
            t0 = start;
            t_end = t_end.or(end);
        }
        let machine = net::MachineClock::busy_since(&stat0);
        if let Some(p) = perf {
            p.stop()?;
        }
        if mode == Mode::Drop {
            std::thread::sleep(Duration::from_millis(20));
        }
        let prog_after = prog_stats(self);
        let mut xdp_programs = Vec::new();
        let (mut run_ns, mut runs) = (0u64, 0u64);
        for (i, (name, cnt, ns)) in prog_after.iter().enumerate() {
            let (c0, n0) = prog_before.get(i).map(|p| (p.1, p.2)).unwrap_or((0, 0));
            let (dc, dn) = (cnt.saturating_sub(c0), ns.saturating_sub(n0));
            run_ns += dn;
            if i == 0 {
                runs = dc;
            }
            xdp_programs.push((name.clone(), dc, dn));
        }
        let agg_thread_cpu_s = *agg_cpu.lock().unwrap_or_else(|e| e.into_inner());
        let dropped = self
            .drop
            .as_ref()
            .map(|(f, _)| f())
            .unwrap_or(0)
            .saturating_sub(drop_before);
        let completed = shared.completed.load(Ordering::Acquire);
        let wrong = shared.wrong.load(Ordering::Acquire);
        let ok = if mode == Mode::Drop {
            t_end.is_some()
        } else {
            completed == frags && wrong == 0
        };
        // Precise span: first sender start → last completion (or last send).
        let (tf, tl) = (
            shared.t_first.load(Ordering::Acquire),
            shared.t_last.load(Ordering::Acquire),
        );
        let secs = match t_end {
            Some(_) if tf != u64::MAX && tl > tf => (tl - tf) as f64 / 1e9,
            Some(e) => (e - t0).as_secs_f64(),
            None => f64::NAN,
        };
        let elems = if mode == Mode::Drop {
            dropped as f64 * PER as f64
        } else {
            (senders as u64 * elements) as f64
        };
        let error = if ok {
            None
        } else {
            Some(format!(
                "completed {completed} of {frags} fragments, {wrong} wrong (deadline {:?})",
                spec.deadline
            ))
        };
        Ok(RunResult {
            mode: mode.name().into(),
            senders,
            elements_per_sender: elements,
            total_bytes: senders as u64 * elements * 4,
            fragments: frags,
            secs,
            elems_per_s: elems / secs,
            sent: sent.load(Ordering::Relaxed),
            resent: resent.load(Ordering::Relaxed),
            wrong,
            completed,
            ok,
            dropped_counted: dropped,
            xdp_run_ns: run_ns,
            xdp_runs: runs,
            xdp_programs,
            agg_thread_cpu_s,
            sys_busy: machine.busy,
            sys_busy_ticks: machine.busy_ticks,
            sys_busy_exact: machine.exact,
            sys_softirq: machine.softirq,
            error,
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn build(
    w: &dyn Workload,
    rank: u16,
    round: u32,
    frag: u64,
    frags: u64,
    elements: u64,
    seq: u32,
    out: &mut Vec<u8>,
) {
    let off = frag * PER as u64;
    let count = (elements - off).min(PER as u64) as usize;
    let hdr = AggHeader {
        job: JOB,
        rank,
        seq,
        round: aggbox::wire::abi::Round(round),
        frag_off: off as u32,
        op: Op::Sum,
        flags: if frag + 1 == frags {
            abi::AGG_F_LAST_FRAGMENT
        } else {
            0
        },
        count: count as u16,
    };
    out.clear();
    out.extend_from_slice(&proto::agg_header_bytes(&hdr));
    w.payload(rank, frag, count, out);
}

#[allow(clippy::too_many_arguments)]
fn sender(
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

fn collect_results(sock: &UdpSocket, w: &dyn Workload, shared: &Shared, round: u32) -> Result<()> {
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

#[allow(clippy::too_many_arguments)]
fn user_aggregate(
    sock: &UdpSocket,
    one: bool,
    w: &dyn Workload,
    shared: &Shared,
    round: u32,
    tables: &[Mutex<HashMap<u64, (Accumulator, u64)>>],
    all_ranks: u64,
    _worker: usize,
) -> Result<()> {
    let mut batch = RecvBatch::new(if one { 1 } else { 64 }, 2048);
    let mut free: Vec<Accumulator> = Vec::new();
    let mut out = Vec::with_capacity(4 * PER);
    while !shared.finished() {
        let n = batch.recv(sock, one)?;
        for i in 0..n {
            let Ok((hdr, be)) = proto::split_agg(batch.get(i)) else {
                continue;
            };
            if hdr.job != JOB || hdr.round != aggbox::wire::abi::Round(round) || hdr.is_result() || hdr.rank >= 64 {
                continue;
            }
            let k = u64::from(hdr.frag_off) / PER as u64;
            if shared.is_done(k) {
                continue; // late resend of a completed fragment
            }
            let bit = 1u64 << hdr.rank;
            let mut table = tables[(k % tables.len() as u64) as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let entry = match table.entry(k) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let acc = match free.pop() {
                        Some(mut a) => {
                            a.reset(hdr.op, hdr.count as usize, false)?;
                            a
                        }
                        None => Accumulator::new(hdr.op, hdr.count as usize, false)?,
                    };
                    v.insert((acc, 0))
                }
            };
            if entry.1 & bit != 0 {
                continue; // duplicate
            }
            entry.0.add_be_bytes(be, 1)?;
            entry.1 |= bit;
            if entry.1 == all_ranks {
                let Some((acc, _)) = table.remove(&k) else {
                    continue;
                };
                drop(table);
                let result = acc.finish()?;
                out.clear();
                result.write_be(&mut out);
                if !w.check(k, &out) {
                    shared.wrong.fetch_add(1, Ordering::Relaxed);
                }
                shared.mark(k);
                free.push(acc);
            }
        }
    }
    for t in tables {
        t.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
    Ok(())
}

/// One row of the throughput table.
#[derive(Debug, Clone, Serialize)]
struct Point {
    mode: String,
    total_mb: u64,
    runs: Vec<RunResult>,
    elems_per_s: Summary,
    xdp_ns_per_contribution: Option<Summary>,
}

/// Experiment 1.
pub fn run(opts: &BenchOptions, ctx: &mut Context_) -> Result<Section> {
    let senders = 4;
    // AGGBOX_AGG_SIZES / AGGBOX_AGG_MODES narrow a run (to profile one
    // mode; docs/BENCHMARKS.md, experiment 1).
    let env_names = super::env_names;
    let sizes_mb: Vec<u64> = if let Some(list) = env_names("AGGBOX_AGG_SIZES") {
        list.iter()
            .map(|x| x.parse().with_context(|| format!("AGGBOX_AGG_SIZES: {x:?} is not a size in MB")))
            .collect::<Result<_>>()?
    } else if opts.quick {
        vec![1, 8]
    } else {
        vec![8, 32, 128, 512]
    };
    if let Some(mb) = sizes_mb.iter().find(|&&mb| mb << 18 > u64::from(JOB_VECTOR_LEN)) {
        bail!("agg: {mb} MB is beyond the job's vector_len of {JOB_VECTOR_LEN} elements");
    }
    // Short (~10 s a repetition) and the ratio to the floor is a goal that
    // this VM's drift between repetitions exceeds: more repetitions.
    let reps = opts.reps_or(AGG_REPS);
    let all = [Mode::Drop, Mode::Floor, Mode::Kernel, Mode::Plain, Mode::Tuned];
    let modes: Vec<Mode> = match env_names("AGGBOX_AGG_MODES") {
        Some(names) => {
            for n in &names {
                if !all.iter().any(|m| m.name() == n) {
                    bail!("AGGBOX_AGG_MODES: unknown mode {n:?} (drop, floor, kernel, plain, tuned)");
                }
            }
            all.into_iter().filter(|m| names.iter().any(|n| n == m.name())).collect()
        }
        None => all.to_vec(),
    };
    let _stats = aggbox::node::metrics::enable_bpf_stats()?;
    progress(format!(
        "agg: testbed 1 aggregator + {senders} senders; sizes {sizes_mb:?} MB total; {reps} reps; modes {} (order rotated per repetition)",
        modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
    ));
    let h = Harness::new(senders)?;
    let mut runs: Vec<(Mode, u64, RunResult)> = Vec::new();
    let mut round = 1u32;
    for rep in 0..reps {
        // Each mode takes each place in the order as often as another: a
        // drift within a repetition favours none.
        for i in 0..modes.len() {
            let mode = modes[(i + rep) % modes.len()];
            let res = h.with_mode(mode, |a| -> Result<Vec<(u64, RunResult)>> {
                let mut out = Vec::new();
                for &mb in &sizes_mb {
                    let elements = mb * (1 << 20) / 4 / senders as u64;
                    let wl = Pattern::new(senders, elements);
                    let spec = RunSpec {
                        round,
                        window: window_for(senders),
                        deadline: Duration::from_secs(60 + mb / 2),
                        rate_per_sender: None,
                    };
                    round += 1;
                    let r = a.run_counted(&wl, spec);
                    progress(format!(
                        "agg rep {}/{reps} {:6} {:4} MB: {:>14} elements/s in {:.3}s{}{}{}",
                        rep + 1,
                        mode.name(),
                        mb,
                        thousands(r.elems_per_s),
                        r.secs,
                        if r.resent > 0 {
                            format!(", {} resent", r.resent)
                        } else {
                            String::new()
                        },
                        if r.xdp_runs > 0 {
                            format!(
                                ", XDP {:.0} ns/run",
                                r.xdp_run_ns as f64 / r.xdp_runs as f64
                            )
                        } else {
                            String::new()
                        },
                        r.error
                            .as_deref()
                            .map(|e| format!(" ERROR {e}"))
                            .unwrap_or_default()
                    ));
                    out.push((mb, r));
                }
                Ok(out)
            })?;
            runs.extend(res.into_iter().map(|(mb, r)| (mode, mb, r)));
        }
    }
    // Section 1b: the same aggregation through aggbox::runtime.
    let rt_elems: usize = if opts.quick { 100_000 } else { 4 << 20 };
    let mut rt: Vec<(&str, std::result::Result<Vec<f64>, String>)> = Vec::new();
    for (name, kernel) in [("socket", false), ("kernel", true)] {
        progress(format!(
            "agg: runtime reduce_i32 of {rt_elems} elements x {senders} workers, {name} backend"
        ));
        let r = runtime_reduce(&h, kernel, rt_elems, reps).map_err(|e| format!("{e:#}"));
        match &r {
            Ok(t) => progress(format!(
                "agg: runtime {name} backend: median {:.3} s per call",
                summarize(t).median
            )),
            Err(e) => progress(format!("agg: runtime {name} backend FAILED: {e}")),
        }
        rt.push((name, r));
    }
    drop(h);
    let failed: Vec<String> = runs
        .iter()
        .filter(|(_, _, r)| !r.ok)
        .map(|(m, mb, r)| {
            format!(
                "{} {mb} MB: {}",
                m.name(),
                r.error.clone().unwrap_or_default()
            )
        })
        .collect();

    // Table.
    let mut points = Vec::new();
    let mut csv = Csv::new(&[
        "mode",
        "total_mb",
        "rep",
        "senders",
        "elements_per_sender",
        "secs",
        "elems_per_s",
        "sent",
        "resent",
        "wrong",
        "ok",
        "xdp_runs",
        "xdp_run_ns",
        "xdp_ns_per_run",
        "agg_thread_cpu_s",
        "sys_busy",
        "sys_busy_ticks",
        "sys_softirq",
    ]);
    for &mode in &modes {
        for &mb in &sizes_mb {
            let rs: Vec<RunResult> = runs
                .iter()
                .filter(|(m, s, _)| *m == mode && *s == mb)
                .map(|(_, _, r)| r.clone())
                .collect();
            for (i, r) in rs.iter().enumerate() {
                csv.row(vec![
                    mode.name().into(),
                    mb.to_string(),
                    i.to_string(),
                    r.senders.to_string(),
                    r.elements_per_sender.to_string(),
                    format!("{:.6}", r.secs),
                    format!("{:.0}", r.elems_per_s),
                    r.sent.to_string(),
                    r.resent.to_string(),
                    r.wrong.to_string(),
                    r.ok.to_string(),
                    r.xdp_runs.to_string(),
                    r.xdp_run_ns.to_string(),
                    format!(
                        "{:.1}",
                        if r.xdp_runs > 0 {
                            r.xdp_run_ns as f64 / r.xdp_runs as f64
                        } else {
                            f64::NAN
                        }
                    ),
                    format!("{:.4}", r.agg_thread_cpu_s),
                    format!("{:.4}", r.sys_busy),
                    format!("{:.4}", r.sys_busy_ticks),
                    format!("{:.4}", r.sys_softirq),
                ]);
            }
            let eps = summarize(
                &rs.iter()
                    .filter(|r| r.ok)
                    .map(|r| r.elems_per_s)
                    .collect::<Vec<_>>(),
            );
            let xdp = if matches!(mode, Mode::Kernel | Mode::Drop | Mode::Floor) {
                Some(summarize(
                    &rs.iter()
                        .filter(|r| r.xdp_runs > 0)
                        .map(|r| r.xdp_run_ns as f64 / r.xdp_runs as f64)
                        .collect::<Vec<_>>(),
                ))
            } else {
                None
            };
            points.push(Point {
                mode: mode.name().into(),
                total_mb: mb,
                runs: rs,
                elems_per_s: eps,
                xdp_ns_per_contribution: xdp,
            });
        }
    }
    csv.write(&opts.out_dir.join("agg_throughput.csv"))?;
    super::write_json(&opts.out_dir.join("agg_throughput.json"), &points)?;

    let get = |mode: Mode, mb: u64| {
        points
            .iter()
            .find(|p| p.mode == mode.name() && p.total_mb == mb)
    };
    let largest = *sizes_mb.last().unwrap_or(&8);
    let mut md = String::new();
    let _ = writeln!(md, "## 1. Aggregation throughput ({senders} senders)\n");
    let _ = writeln!(
        md,
        "Aggregated elements per second (\"ops/s\" = {senders} × elements per sender / time from the start to the last reduced fragment at the application), \
         int32 SUM, full-MTU contributions ({PER} elements), sendmmsg batches of {BATCH}, senders at most {} fragments ahead of their oldest incomplete fragment \
         (the kernel job has {JOB_SLOTS} slots). Every reduced fragment is checked against the reference values in every mode. \
         Median over {reps} runs, [min – max].\n",
        window_for(senders),
    );
    let _ = writeln!(md, "| total data | AggBox XDP | floor (minimal XDP aggregator) | plain UDP (recv/datagram) | tuned UDP (recvmmsg, 2 REUSEPORT threads) | XDP count-and-drop ceiling | AggBox / floor | AggBox / plain | AggBox / tuned | AggBox / ceiling |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    let fmt = |p: Option<&Point>| {
        p.map(|p| {
            format!(
                "{} [{} – {}]",
                thousands(p.elems_per_s.median),
                thousands(p.elems_per_s.min),
                thousands(p.elems_per_s.max)
            )
        })
        .unwrap_or_else(|| "–".into())
    };
    let med = |p: Option<&Point>| p.map(|p| p.elems_per_s.median).unwrap_or(f64::NAN);
    for &mb in &sizes_mb {
        let (k, f, p, t, d) = (
            get(Mode::Kernel, mb),
            get(Mode::Floor, mb),
            get(Mode::Plain, mb),
            get(Mode::Tuned, mb),
            get(Mode::Drop, mb),
        );
        let _ = writeln!(
            md,
            "| {mb} MB | {} | {} | {} | {} | {} | {:.2}× | {:.2}× | {:.2}× | {:.0} % |",
            fmt(k),
            fmt(f),
            fmt(p),
            fmt(t),
            fmt(d),
            med(k) / med(f),
            med(k) / med(p),
            med(k) / med(t),
            100.0 * med(k) / med(d)
        );
    }
    let k = get(Mode::Kernel, largest);
    let p = get(Mode::Plain, largest);
    let ratio = med(k) / med(p);
    let _ = writeln!(
        md,
        "\n**Paper (Fig. 7, 512 MB, 4 senders; quoted):** AggBox 212,288,843 ops/s vs socket baseline 54,025,990 ops/s = **3.9×**. \
         **Ours ({largest} MB, measured):** AggBox {} vs plain {} = **{ratio:.2}×** (tuned: {:.2}×; the floor aggregator: {:.2}× plain).\n",
        thousands(med(k)),
        thousands(med(p)),
        med(k) / med(get(Mode::Tuned, largest)),
        med(get(Mode::Floor, largest)) / med(p)
    );
    let xdp = k.and_then(|p| p.xdp_ns_per_contribution);
    let dropns = get(Mode::Drop, largest).and_then(|p| p.xdp_ns_per_contribution);
    let floorns = get(Mode::Floor, largest).and_then(|p| p.xdp_ns_per_contribution);
    if let Some(x) = xdp {
        let progs: Vec<String> = k
            .and_then(|p| p.runs.first())
            .map(|r| {
                r.xdp_programs
                    .iter()
                    .map(|(n, c, ns)| format!("{n}: {c} runs, {ns} ns"))
                    .collect()
            })
            .unwrap_or_default();
        let f = floorns.map(|f| f.median).unwrap_or(f64::NAN);
        // The same repetition's runs of AggBox and the floor, minutes
        // apart at most: their ratio, of which the median.
        let ns_of = |mode: Mode| -> Vec<f64> {
            get(mode, largest)
                .map(|p| {
                    p.runs
                        .iter()
                        .map(|r| r.xdp_run_ns as f64 / r.xdp_runs.max(1) as f64)
                        .collect()
                })
                .unwrap_or_default()
        };
        let paired: Vec<f64> = ns_of(Mode::Kernel)
            .iter()
            .zip(ns_of(Mode::Floor))
            .map(|(k, f)| k / f)
            .collect();
        let pr = summarize(&paired);
        let _ = writeln!(
            md,
            "**XDP run time per full-MTU contribution under this traffic** (bpf_stats: Δ run time summed over AggBox's programs / Δ runs of \
             the entry program, {largest} MB runs): AggBox median **{:.0} ns** [min {:.0} – max {:.0}], the floor aggregator **{f:.0} ns** \
             [min {:.0} – max {:.0}], count-and-drop {:.0} ns: AggBox is **{:.2}×** the floor; per repetition (AggBox over the floor of the same \
             repetition) median {:.2}× [min {:.2} – max {:.2}] (the project's goal, not a measurement: ≤ {FLOOR_GOAL}×; {}). Tail-called programs run inside the entry program's \
             accounting, so their own counters stay 0 (first run: {}).\n",
            x.median,
            x.min,
            x.max,
            floorns.map(|f| f.min).unwrap_or(f64::NAN),
            floorns.map(|f| f.max).unwrap_or(f64::NAN),
            dropns.map(|d| d.median).unwrap_or(f64::NAN),
            x.median / f,
            pr.median,
            pr.min,
            pr.max,
            if x.median / f <= FLOOR_GOAL { "met" } else { "NOT met" },
            progs.join("; "),
        );
        ctx.xdp_ns_per_contribution = Some(x.median);
    }
    ctx.kernel_elems_per_s = Some(med(k));
    let d = med(get(Mode::Drop, largest));
    // Aggregator CPU per contribution: XDP run time + the application's
    // threads (kernel, floor), the aggregator threads (user space; their
    // softirq receive work is not in this number, so it flatters the
    // baselines).
    let cpu_per = |mode: Mode| -> f64 {
        let rs: Vec<f64> = get(mode, largest)
            .map(|p| {
                p.runs
                    .iter()
                    .filter(|r| r.ok)
                    .map(|r| {
                        let contributions = (r.sent + r.resent).max(1) as f64;
                        (r.xdp_run_ns as f64 / 1e9 + r.agg_thread_cpu_s) / contributions * 1e9
                    })
                    .collect()
            })
            .unwrap_or_default();
        summarize(&rs).median
    };
    let _ = writeln!(md, "Aggregator CPU per contribution ({largest} MB, median): AggBox {:.0} ns, floor {:.0} ns (XDP run time + the application thread receiving RESULTs), \
        plain {:.0} ns, tuned {:.0} ns (aggregator threads only: the kernel's UDP receive work for them runs in softirq and is not included, which flatters the baselines).\n",
        cpu_per(Mode::Kernel), cpu_per(Mode::Floor), cpu_per(Mode::Plain), cpu_per(Mode::Tuned));
    let _ = writeln!(
        md,
        "**Reading the numbers.** Senders, bridge and aggregator share this VM's CPUs: the count-and-drop ceiling (the same senders into an \
         XDP program that only parses and drops) is {} elements/s ({} contributions/s), and AggBox reaches {:.0} % of it, the floor \
         aggregator {:.0} %. The floor (src/bpf/bench_floor.bpf.c) does only the work no XDP aggregator of this traffic can avoid (one array \
         slot per fragment, direct packet access, one lock, the adds, the RESULT rewrite), so AggBox's distance to it is the price of \
         validation, exactly-once completion, bounds, hand-off and counters (docs/DATAPLANE.md, \"Fast slots\"; the per-step profile is \
         `cargo bench --features bench --bench xdp_chain`).\n",
        thousands(d),
        thousands(d / PER as f64),
        100.0 * med(k) / d,
        100.0 * med(get(Mode::Floor, largest)) / d,
    );
    let _ = writeln!(md, "### 1b. The same through `aggbox::runtime` (Communicator::reduce_i32, 4 workers + aggregator application)\n");
    let _ = writeln!(md, "One SUM reduction of {rt_elems} int32 per worker, with the runtime's reliability (seq, ACKs, window 256); median [min – max] over {reps} calls.\n");
    let _ = writeln!(
        md,
        "| backend | s per call | elements/s | status |\n|---|---|---|---|"
    );
    let mut rt_json = Vec::new();
    for (name, r) in &rt {
        match r {
            Ok(t) => {
                let s = summarize(t);
                let _ = writeln!(
                    md,
                    "| {name} | {:.3} [{:.3} – {:.3}] | {} | ok, every element checked |",
                    s.median,
                    s.min,
                    s.max,
                    thousands((senders * rt_elems) as f64 / s.median)
                );
                rt_json.push(serde_json::json!({"backend": name, "secs": t, "elements_per_worker": rt_elems}));
            }
            Err(e) => {
                let _ = writeln!(md, "| {name} | – | – | **FAILED**: `{e}` |");
                rt_json.push(serde_json::json!({"backend": name, "error": e, "elements_per_worker": rt_elems}));
            }
        }
    }
    super::write_json(&opts.out_dir.join("agg_runtime.json"), &rt_json)?;
    let _ = writeln!(md);
    let _ = writeln!(md, "Plot: `agg_throughput.png`. Raw: `agg_throughput.csv`, `agg_throughput.json`, `agg_runtime.json`.\n");
    if !failed.is_empty() {
        let _ = writeln!(md, "**Failed runs:** {}\n", failed.join("; "));
    }
    let headline = vec![
        format!("agg {largest} MB: kernel {} plain {} tuned {} drop {} elements/s; kernel/plain {ratio:.2}x", thousands(med(k)), thousands(med(p)), thousands(med(get(Mode::Tuned, largest))), thousands(d)),
        format!("XDP ns/contribution: {:.0}", xdp.map(|x| x.median).unwrap_or(f64::NAN)),
    ];
    let rt_failed: Vec<String> = rt
        .iter()
        .filter_map(|(n, r)| {
            r.as_ref()
                .err()
                .map(|e| format!("runtime {n} backend: {e}"))
        })
        .collect();
    let _ = std::fs::write(
        opts.out_dir.join("agg_summary.txt"),
        format!("{}\n", headline.join("\n")),
    );
    // A wrong or incomplete reduction fails the experiment in the full run
    // as in --quick (the section keeps its table; `aggbox-bench` exits
    // non-zero at the end).
    if !failed.is_empty() || !rt_failed.is_empty() {
        let summary = format!(
            "correctness: {}",
            failed.iter().chain(&rt_failed).cloned().collect::<Vec<_>>().join("; ")
        );
        return Err(super::large::Failed { markdown: md, summary }.into());
    }
    Ok(Section {
        name: "agg".into(),
        markdown: md,
        headline,
    })
}

/// Data port of the runtime workers' sockets (section 1b).
pub const RT_DATA_PORT: u16 = 7100;

/// Section 1b: one `reduce_i32` (SUM) of `elements` per worker through
/// `aggbox::runtime` (4 workers + the aggregator application, each its own
/// `Communicator` in its namespace), socket backend vs kernel backend (XDP
/// attached on host 0). Returns seconds per call and whether the result
/// matched, per repetition; an error names the failing call.
pub fn runtime_reduce(h: &Harness, kernel: bool, elements: usize, reps: usize) -> Result<Vec<f64>> {
    with_runtime(h, kernel, None, |aggc, workers| {
        let senders = workers.len();
        let backend = if kernel { "Kernel" } else { "Socket" };
        let inputs: Vec<Vec<i32>> = (0..senders)
            .map(|r| tools::pattern_vector(r as u16, elements as u32))
            .collect();
        let want: Vec<i32> = (0..elements)
            .map(|i| inputs.iter().map(|v| v[i]).sum())
            .collect();
        let mut times = Vec::new();
        for rep in 0..reps {
            let t0 = Instant::now();
            let (agg_out, errs) = std::thread::scope(|s| {
                let hs: Vec<_> = workers
                    .iter()
                    .zip(&inputs)
                    .map(|(c, v)| {
                        s.spawn(move || {
                            let mut v = v.clone();
                            c.reduce_i32(&mut v, Op::Sum).map(|_| ())
                        })
                    })
                    .collect();
                let mut out = vec![0i32; elements];
                let r = aggc.reduce_i32(&mut out, Op::Sum);
                let errs: Vec<String> = hs
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, h)| match h.join() {
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => Some(format!("worker {i}: {e}")),
                        Err(_) => Some(format!("worker {i} panicked")),
                    })
                    .collect();
                (r.map(|_| out), errs)
            });
            let secs = t0.elapsed().as_secs_f64();
            let out = agg_out.map_err(|e| anyhow!("{backend} backend, rep {rep}: aggregator reduce_i32 failed: {e}; workers: {errs:?}"))?;
            if !errs.is_empty() {
                bail!("{backend} backend, rep {rep}: {}", errs.join("; "));
            }
            let wrong = out.iter().zip(&want).filter(|(a, b)| a != b).count();
            if wrong > 0 {
                bail!("{backend} backend, rep {rep}: {wrong} of {elements} elements differ from the reference sum");
            }
            times.push(secs);
        }
        Ok(times)
    })
}

/// Build the runtime communicators of [`Harness`]'s job (4 workers = the
/// sender hosts, each on `RT_DATA_PORT`; the aggregator application on host
/// 0), with AggBox attached on host 0 for the kernel backend, run `f`, and
/// detach. `quantization` sets the float quantization (default: runtime's).
pub fn with_runtime<T>(
    h: &Harness,
    kernel: bool,
    quantization: Option<aggbox::runtime::Quantization>,
    f: impl FnOnce(&aggbox::runtime::Communicator, &[aggbox::runtime::Communicator]) -> Result<T>,
) -> Result<T> {
    use aggbox::runtime::{BackendKind, Communicator, Participant};
    let senders = h.senders.len();
    let agg = h.tb.host(0);
    let peers: Vec<SocketAddrV4> = h
        .worker_addrs()
        .iter()
        .map(|a| SocketAddrV4::new(*a, RT_DATA_PORT))
        .collect();
    let backend = if kernel {
        BackendKind::Kernel
    } else {
        BackendKind::Socket
    };
    let build = |me: Participant, netns: &str| -> Result<Communicator> {
        let peers = peers.clone();
        in_netns(netns, move || {
            let mut b = Communicator::builder(JOB, peers, agg.addr, JOB_PORT, me)
                .backend(backend)
                .result_port(RESULT_PORT)
                .deadline(Duration::from_secs(60));
            if let Some(q) = quantization {
                b = b.quantization(q);
            }
            b.build()
                .map_err(|e| anyhow!("building the {me:?} communicator ({backend:?} backend): {e}"))
        })?
    };
    let text = h.config_text();
    let pins = h.bpffs.path.clone();
    let att = if kernel {
        Some(in_netns(&agg.netns, || -> Result<node::Attachment> {
            let config =
                Config::parse(&text, "bench.toml").map_err(|e| anyhow!("bench config: {e}"))?;
            node::attach("eth0", &config, None, &pins, XdpMode::Native)
        })??)
    } else {
        None
    };
    let result = (|| -> Result<T> {
        let aggc = build(Participant::Aggregator, &agg.netns)?;
        let workers: Vec<Communicator> = (0..senders)
            .map(|r| build(Participant::Worker(r as u16), &h.tb.host(r + 1).netns))
            .collect::<Result<_>>()?;
        f(&aggc, &workers)
    })();
    if let Some(att) = att {
        // A failure against the live XDP program: say what the kernel saw.
        let result = result.map_err(|e| match kernel_counters(&att) {
            Some(c) => e.context(format!("XDP counters at the failure: {c}")),
            None => e,
        });
        att.detach()?;
        return result;
    }
    result
}

/// Non-zero XDP outcome / drop / hand-off counters of an attachment, one line.
pub fn kernel_counters(att: &node::Attachment) -> Option<String> {
    let s = att.xdp.stats().ok()?;
    let mut parts: Vec<String> = s
        .outcomes
        .iter()
        .filter(|(_, c)| c.packets > 0)
        .map(|(k, c)| format!("{k}={}", c.packets))
        .collect();
    parts.extend(
        s.drops
            .iter()
            .filter(|(_, c)| c.packets > 0)
            .map(|(k, c)| format!("drop:{k}={}", c.packets)),
    );
    if let Ok(h) = att.xdp.handoff_stats() {
        parts.extend(
            h.iter()
                .filter(|(_, c)| c.packets > 0)
                .map(|(k, c)| format!("handoff:{k}={}", c.packets)),
        );
    }
    Some(parts.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_expected_is_the_sum_of_the_payloads() {
        let p = Pattern::new(4, 10_000);
        for k in [0u64, 1, 60, 61, 27] {
            let mut sum = vec![0i32; PER];
            for r in 0..4u16 {
                let mut be = Vec::new();
                p.payload(r, k, PER, &mut be);
                let mut v = vec![0i32; PER];
                proto::read_i32_be(&be, &mut v);
                for i in 0..PER {
                    sum[i] += v[i];
                }
            }
            let mut be = Vec::new();
            proto::write_i32_be(&sum[..100], &mut be);
            assert!(p.check(k, &be), "fragment {k} (prefix)");
            be[5] ^= 0x10;
            assert!(!p.check(k, &be));
        }
    }

    #[test]
    fn completion_bitset_counts_once() {
        let s = Shared::new(130);
        assert!(s.mark(0));
        assert!(!s.mark(0));
        assert!(s.mark(129));
        assert!(!s.mark(130), "out of range");
        assert!(s.is_done(129) && !s.is_done(64));
        assert_eq!(s.completed.load(Ordering::Relaxed), 2);
    }
}
