//! The aggregators a run compares: AggBox XDP, the user-space ones, the
//! drop ceiling and the floor, each set up on the aggregator's host, with
//! the kernel's view of its programs' cost.

use std::collections::HashMap;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::net::{self, RecvBatch};
use crate::progress;
use aggbox::wire::abi::{self, Op};
use aggbox::node;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::wire::reducer::Accumulator;

use super::{kernel_counters, Harness, Mode, RunResult, RunSpec, Workload, JOB, PER, WINDOW_WAITS};
use super::harness::{collect_results, sender, Shared};

/// The kernel's id of a loaded program (0 if it cannot be read).
pub(crate) fn prog_id(fd: std::os::fd::BorrowedFd<'_>) -> u32 {
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

pub(super) type DropReader<'a> = (Box<dyn Fn() -> u64 + 'a>, u32);

/// An aggregator in place on host 0 (see [`Harness::with_mode`]).
pub struct Aggregator<'a> {
    pub(super) h: &'a Harness,
    /// Mode.
    pub mode: Mode,
    pub(super) rx: Vec<UdpSocket>,
    /// The AggBox attachment (kernel mode).
    pub att: Option<&'a node::Attachment>,
    pub(super) drop: Option<DropReader<'a>>,
    /// The floor program's id (floor mode).
    pub(super) floor: Option<u32>,
}

pub(super) fn prog_stats(a: &Aggregator<'_>) -> Vec<(String, u64, u64)> {
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
pub(super) struct PerfWindow {
    pub(super) child: std::process::Child,
    pub(super) path: std::path::PathBuf,
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
pub(super) fn build(
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
pub(super) fn user_aggregate(
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
