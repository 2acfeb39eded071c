//! Large frames in the runtime (docs/RUNTIME.md, "Large frames"): path MTU
//! discovery, batched I/O (sendmmsg / recvmmsg, UDP GSO) and zero-copy float
//! reductions.
//!
//! - `xdp_sees_each_datagram_of_sendto_sendmmsg_and_udp_gso` (root): which send
//!   paths keep every datagram visible to the XDP aggregator, at MTU 1500 and
//!   9000 on the netns testbed: the node's `accepted` + `result` counters
//!   against the datagrams sent, per send path. Fails if the kernel's
//!   behaviour changes (the runtime's kernel backend relies on it).
//! - `kernel_backend_at_mtu_9000_discovered` / `..._65535_discovered` (root):
//!   4 workers + aggregator with the kernel backend against a live
//!   `aggbox attach` at jumbo MTU, MTU discovered (not configured): allreduce
//!   and reduce of 1 M int32, allreduce_f32 of 1 M floats, exact against the
//!   reference; no slot-pool or block-pool exhaustion.
//! - `allreduce_f32_allocates_nothing_per_call_after_warm_up` (no root): a
//!   counting global allocator around the second call of a 1 M-element
//!   allreduce_f32 (socket backend, loopback, 4 workers + aggregator in this
//!   process).
//! - `allreduce_i32_allocates_nothing_per_call_after_warm_up` (no root): the
//!   same for the blocking `allreduce_i32` / `reduce_i32` (the caller's slice
//!   lent to the engine), results exact.
//! (The speed of quantize + encode and the other passes over the vector,
//! against memcpy, is `aggbox-bench edge`: src/bin/aggbox-bench/edge.rs.)
//!
//! The tests of this file run one at a time (`SERIAL`), so that the
//! allocation counts see only their own calls.
//!
//! `sudo -E cargo test --release --test runtime_batching -- --nocapture`

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_runtime;

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::wire::abi::{self, DropReason, Op, Outcome};
use aggbox::config::Config;
use aggbox::wire::proto::{self, AggHeader};
use aggbox::runtime::fragment::{blocks_per_fragment, elements_per_fragment, kernel_window};
use aggbox::runtime::transport::{Transport, UdpTransport};
use aggbox::runtime::{BackendKind, Communicator, CommunicatorBuilder, Participant, Quantization};
use crate::testbed::{Testbed, TestbedConfig};

mod common_netns;
mod live_attach;

// ---------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
static LARGEST: AtomicU64 = AtomicU64::new(0);
static LARGE: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        count(new);
        System.realloc(p, l, new)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

fn count(size: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(size as u64, Ordering::Relaxed);
        LARGEST.fetch_max(size as u64, Ordering::Relaxed);
        if size >= 4096 {
            LARGE.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------
// Which send paths XDP sees datagram by datagram
// ---------------------------------------------------------------------------

const VIS_JOB: u16 = 21;
const VIS_PORT: u16 = 7620;
const VIS_RESULT_PORT: u16 = 7621;
const VIS_N: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendPath {
    SendTo,
    SendMmsg,
    UdpGso,
}

/// Datagram `i` (full, `per` elements) of round `round` from rank 0.
fn vis_datagram(round: u32, i: usize, per: usize) -> Vec<u8> {
    let values: Vec<i32> = (0..per as i32).map(|k| k + i as i32).collect();
    let hdr = AggHeader {
        job: VIS_JOB,
        rank: 0,
        seq: round * 1000 + i as u32,
        round: aggbox::wire::abi::Round(round),
        frag_off: (i * per) as u32,
        op: Op::Sum,
        flags: 0,
        count: per as u16,
    };
    let mut buf = Vec::new();
    proto::encode_agg_into(&hdr, &values, &mut buf).expect("encode");
    buf
}

/// Sends VIS_N datagrams through `path`; returns how many frames of the job
/// the XDP program counted (accepted + result) and every counter that moved.
/// Packets (skbs) the sender's `eth0` transmitted so far: a UDP GSO
/// super-datagram that leaves the host unsegmented counts once.
fn tx_packets(tb: &Testbed, host: usize) -> u64 {
    let out = tb
        .run_in(host, &["ip", "-s", "-j", "link", "show", "dev", "eth0"])
        .expect("ip -s link");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    v[0]["stats64"]["tx"]["packets"]
        .as_u64()
        .expect("tx packets")
}

fn vis_send(
    att: &aggbox::node::Attachment,
    t: &UdpTransport,
    to: SocketAddr,
    path: SendPath,
    round: u32,
    per: usize,
    skbs: &dyn Fn() -> u64,
) -> (u64, u64, Vec<(String, u64)>) {
    let dgrams: Vec<Vec<u8>> = (0..VIS_N).map(|i| vis_datagram(round, i, per)).collect();
    let snapshot = || {
        let s = att.xdp.stats().expect("stats");
        let mut all: Vec<(String, u64)> = s
            .outcomes
            .iter()
            .map(|(k, c)| (format!("outcome {k}"), c.packets))
            .collect();
        all.extend(
            s.drops
                .iter()
                .map(|(k, c)| (format!("drop {k}"), c.packets)),
        );
        (
            s.outcome(Outcome::Accepted).packets + s.outcome(Outcome::Result).packets,
            all,
        )
    };
    let (before, all_before) = snapshot();
    let skbs_before = skbs();
    // Paced in bursts of at most 64 datagrams so no veth ring overflows.
    for chunk in dgrams.chunks(32) {
        match path {
            SendPath::SendTo => {
                for d in chunk {
                    t.send_to(d, to).expect("sendto");
                }
            }
            SendPath::SendMmsg => {
                let msgs: Vec<(&[u8], SocketAddr)> =
                    chunk.iter().map(|d| (d.as_slice(), to)).collect();
                assert_eq!(
                    t.send_batch(&msgs),
                    chunk.len(),
                    "sendmmsg took every datagram"
                );
            }
            SendPath::UdpGso => {
                let seg = chunk[0].len();
                let all: Vec<u8> = chunk.concat();
                let sent = t
                    .send_segments(&all, seg, to)
                    .unwrap_or_else(|e| panic!("UDP GSO send of {} x {seg}: {e}", chunk.len()));
                assert_eq!(sent, all.len());
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while snapshot().0 - before < VIS_N as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Settle: anything still in flight.
    std::thread::sleep(Duration::from_millis(50));
    let (after, all_after) = snapshot();
    let moved = all_after
        .iter()
        .zip(&all_before)
        .filter(|(a, b)| a.1 != b.1)
        .map(|(a, b)| (a.0.clone(), a.1 - b.1))
        .collect();
    (after - before, skbs() - skbs_before, moved)
}

#[test]
fn xdp_sees_each_datagram_of_sendto_sendmmsg_and_udp_gso() {
    let _g = serial();
    common_netns::require_root();
    let mut table = Vec::new();
    for mtu in [1500u32, 9000] {
        let tb = Testbed::up(TestbedConfig {
            hosts: 2,
            mtu,
            static_neigh: true,
            ..Default::default()
        })
        .expect("testbed");
        let pins = common_netns::Bpffs::mount(&format!("rtbatch{mtu}")).expect("mounting a private bpffs");
        let text = common_netns::config_text(&[common_netns::JobSpec {
            id: VIS_JOB,
            port: VIS_PORT,
            result_port: VIS_RESULT_PORT,
            workers: vec![tb.host(1).addr],
            weights: vec![],
            vector_len: None,
        }]);
        let sender = UdpTransport::new(common_netns::bind_in(&tb, 1, tb.host(1).addr));
        let to = SocketAddr::new(tb.host(0).addr.into(), VIS_PORT);
        let per = elements_per_fragment(mtu as usize);
        let rows = tb
            .in_host(0, || {
                let config = Config::parse(&text, "batching.toml").expect("config");
                let att = aggbox::node::attach("eth0", &config, None, &pins.path, aggbox::kernel::xdp::XdpMode::Native)
                    .unwrap_or_else(|e| panic!("attach at MTU {mtu}: {e:#}"));
                let mut rows = Vec::new();
                let skbs = || tx_packets(&tb, 1);
                for (round, path) in [(1u32, SendPath::SendTo), (2, SendPath::SendMmsg), (3, SendPath::UdpGso)] {
                    let (seen, sent_skbs, moved) = vis_send(&att, &sender, to, path, round, per, &skbs);
                    eprintln!(
                        "MTU {mtu} {path:?}: sent {VIS_N} datagrams of {per} elements as {sent_skbs} packets out of the sender's eth0, \
                         XDP counted {seen}; counters moved: {moved:?}"
                    );
                    rows.push((path, seen, sent_skbs, moved));
                }
                att.detach().unwrap_or_else(|e| panic!("detach: {e:#}"));
                rows
            })
            .expect("host 0");
        for (path, seen, sent_skbs, moved) in rows {
            table.push((mtu, path, seen, sent_skbs, moved));
        }
    }
    for (mtu, path, seen, sent_skbs, moved) in &table {
        if *path == SendPath::UdpGso {
            // GSO was in effect: the sender's veth carried super-datagrams
            // (fewer packets than datagrams), segmented before XDP.
            assert!(
                *sent_skbs < VIS_N as u64,
                "MTU {mtu}: UDP GSO left the sender as {sent_skbs} packets"
            );
        } else {
            assert!(
                *sent_skbs >= VIS_N as u64,
                "MTU {mtu} {path:?}: {sent_skbs} packets"
            );
        }
        // The finding (docs/RUNTIME.md, "Batched I/O and what XDP sees"):
        // every path, UDP GSO included, reaches XDP one datagram per frame.
        assert_eq!(
            *seen, VIS_N as u64,
            "MTU {mtu} {path:?}: XDP counted {seen} of {VIS_N} datagrams; counters {moved:?}"
        );
        assert!(
            !moved
                .iter()
                .any(|(k, _)| k.starts_with("drop")
                    && !k.contains(DropReason::Retransmission.label())),
            "MTU {mtu} {path:?}: drops {moved:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Kernel backend at jumbo MTU, MTU discovered
// ---------------------------------------------------------------------------

const WORKERS: usize = 4;
const JOB: u16 = 23;
const JOB_PORT: u16 = 7640;
const RESULT_PORT: u16 = 7641;
const GROUP: u16 = 5;
const DATA_PORT: u16 = 7650;

struct Bed {
    agg: Communicator,
    workers: Vec<Communicator>,
    attach: live_attach::LiveAttach,
    _tb: Testbed,
}

impl Bed {
    fn up(mtu: u32, tag: &str, q: Quantization) -> Bed {
        let tb = Testbed::up(TestbedConfig {
            hosts: WORKERS + 1,
            mtu,
            ..Default::default()
        })
        .expect("testbed");
        let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
        let list =
            |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
        let text = format!(
            "[node]\nmetrics = \"off\"\n\n[[job]]\nid = {JOB}\nport = {JOB_PORT}\nworkers = [{}]\nresult_port = {RESULT_PORT}\nresult_group = {GROUP}\n\n[[group]]\nid = {GROUP}\nmembers = [{}]\n",
            list(&|w| format!("\"{w}\"")),
            list(&|w| format!("\"{w}:{DATA_PORT}\"")),
        );
        let attach = live_attach::LiveAttach::start(&tb.host(0).netns, tag, &text, &[]);
        let config = Config::parse(&text, "runtime_batching").expect("config");
        let agg_addr = tb.host(0).addr;
        let build = |host: usize, me: Participant| {
            let b = CommunicatorBuilder::from_config(&config, JOB, agg_addr, DATA_PORT, me)
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .quantization(q)
                .deadline(Duration::from_secs(60));
            assert_eq!(b.config().mtu, 0, "MTU left to discovery");
            tb.in_host(host, move || b.build())
                .expect("netns")
                .expect("build")
        };
        let agg = build(0, Participant::Aggregator);
        let workers: Vec<Communicator> = (0..WORKERS)
            .map(|r| build(r + 1, Participant::Worker(r as u16)))
            .collect();
        for c in std::iter::once(&agg).chain(&workers) {
            assert_eq!(
                c.config().mtu,
                mtu as usize,
                "{:?}: discovered path MTU",
                c.participant()
            );
        }
        Bed {
            agg,
            workers,
            attach,
            _tb: tb,
        }
    }

    fn all(&self) -> Vec<&Communicator> {
        std::iter::once(&self.agg)
            .chain(self.workers.iter())
            .collect()
    }
}

fn int_reduction(bed: &Bed, op: Op, len: usize, all: bool) -> f64 {
    let t0 = Instant::now();
    common_runtime::int_reduction(&bed.all(), WORKERS, op, len, all);
    t0.elapsed().as_secs_f64()
}

fn float_input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7919 + rank * 104_729) % 20_001) as f32 - 10_000.0) * 1e-5)
        .collect()
}

fn float_allreduce(bed: &Bed, len: usize, mean: bool) -> f64 {
    let inputs: Vec<Vec<f32>> = (0..WORKERS).map(|r| float_input(r, len)).collect();
    let want: Vec<f64> = (0..len)
        .map(|i| {
            inputs.iter().map(|x| x[i] as f64).sum::<f64>()
                / if mean { WORKERS as f64 } else { 1.0 }
        })
        .collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let hs: Vec<_> = bed
            .all()
            .into_iter()
            .map(|c| {
                let mut v = match c.rank() {
                    Some(r) => inputs[r as usize].clone(),
                    None => vec![0f32; len],
                };
                s.spawn(move || {
                    c.allreduce(&mut v, if mean { Op::Avg } else { Op::Sum }).unwrap_or_else(|e| {
                        panic!("{:?} allreduce_f32 len {len}: {e}", c.participant())
                    });
                    (c.participant(), v)
                })
            })
            .collect();
        for h in hs {
            let (p, v) = h.join().unwrap();
            for (i, (g, w)) in v.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= 1e-6 + w.abs() * 1e-6,
                    "{p:?}: element {i} is {g}, want {w}"
                );
            }
        }
    });
    t0.elapsed().as_secs_f64()
}

fn jumbo_scenario(mtu: u32) {
    let _g = serial();
    common_netns::require_root();
    let bed = Bed::up(mtu, &format!("batch{mtu}"), Quantization::Adaptive);
    let per = elements_per_fragment(mtu as usize);
    let len: usize = std::env::var("AGGBOX_BATCHING_LEN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let datagram = proto::IP_UDP_HDR + aggbox::wire::abi::AGG_HDR_LEN + 4 * per;
    let workers = bed.workers.len();
    let reduce_window = kernel_window(256, 1024, per, workers, 1, datagram);
    let allreduce_window = kernel_window(256, 1024, per, workers, workers + 1, datagram);
    eprintln!(
        "MTU {mtu}: {per} elements per fragment, {} blocks each, kernel window {reduce_window} \
         (allreduce {allreduce_window})",
        blocks_per_fragment(per)
    );
    let before = bed.attach.status();
    let io0: Vec<_> = bed.all().iter().map(|c| c.io_stats()).collect();
    let t_all = int_reduction(&bed, Op::Sum, len, true);
    let t_red = int_reduction(&bed, Op::Sum, len, false);
    let t_f32 = float_allreduce(&bed, len, true);
    let after = bed.attach.status();
    let d = |k: &str| {
        after.outcomes.get(k).copied().unwrap_or(0) - before.outcomes.get(k).copied().unwrap_or(0)
    };
    let drops: Vec<(String, u64)> = after
        .drops
        .iter()
        .map(|(k, v)| (k.clone(), v - before.drops.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    let io: Vec<String> = bed
        .all()
        .iter()
        .zip(&io0)
        .map(|(c, b)| {
            let a = c.io_stats();
            format!(
                "{:.1} sent/batch, {:.1} recv/batch",
                (a.batched_datagrams - b.batched_datagrams) as f64
                    / (a.send_batches - b.send_batches).max(1) as f64,
                (a.received_datagrams - b.received_datagrams) as f64
                    / (a.recv_batches - b.recv_batches).max(1) as f64
            )
        })
        .collect();
    eprintln!(
        "MTU {mtu}: {len} elements x {WORKERS} workers: allreduce_i32 {t_all:.3} s ({:.1} M elements/s), reduce_i32 {t_red:.3} s, \
         allreduce_f32 (adaptive) {t_f32:.3} s; XDP result {} accepted {}; drops {drops:?}; batching {io:?}",
        len as f64 / t_all / 1e6,
        d("result"),
        d("accepted"),
    );
    let frags = len.div_ceil(per) as u64;
    assert!(
        d("result") >= 3 * frags,
        "every fragment of the 3 reductions was reduced in the kernel"
    );
    for (k, v) in &drops {
        assert!(
            k != DropReason::SlotPoolFull.label(),
            "MTU {mtu}: the window must keep the slot / block pool from running out ({k} = {v})"
        );
    }
    let _ = abi::MAX_BLOCKS;
}

#[test]
fn kernel_backend_at_mtu_9000_discovered() {
    jumbo_scenario(9000);
}

#[test]
fn kernel_backend_at_mtu_65535_discovered() {
    jumbo_scenario(65535);
}

// ---------------------------------------------------------------------------
// Zero-copy floats: no allocation per call after warm-up
// ---------------------------------------------------------------------------

fn loopback_job(workers: usize, q: Quantization) -> Vec<Communicator> {
    let lo = Ipv4Addr::LOCALHOST;
    let (agg_port, peers) = common_runtime::loopback_job_addrs(workers);
    std::iter::once(Participant::Aggregator)
        .chain((0..workers as u16).map(Participant::Worker))
        .map(|me| {
            Communicator::builder(11, peers.clone(), lo, agg_port, me)
                .quantization(q)
                .deadline(Duration::from_secs(60))
                .build()
                .expect("build")
        })
        .collect()
}

/// What the counting allocator saw during `f`.
#[derive(Debug, Clone, Copy)]
struct Counts {
    n: u64,
    bytes: u64,
    largest: u64,
    large: u64,
}

fn counted(f: impl FnOnce()) -> Counts {
    ALLOCS.store(0, Ordering::SeqCst);
    ALLOC_BYTES.store(0, Ordering::SeqCst);
    LARGEST.store(0, Ordering::SeqCst);
    LARGE.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    Counts {
        n: ALLOCS.load(Ordering::SeqCst),
        bytes: ALLOC_BYTES.load(Ordering::SeqCst),
        largest: LARGEST.load(Ordering::SeqCst),
        large: LARGE.load(Ordering::SeqCst),
    }
}

/// Elements per fragment and fragments of a `len`-element call of the job.
fn frag_shape(comms: &[Communicator], len: usize) -> (usize, u64) {
    let per = elements_per_fragment(comms[0].config().mtu);
    (per, len.div_ceil(per) as u64)
}

/// Nothing of the vector's size is allocated during a warm call: no copy
/// of the input, no int32 vector, no result vector, on any participant.
/// What remains: the scope's threads and reply channels (small); the socket
/// aggregator's slots finish into their own vectors
/// (`Accumulator::finish_ints_into`), not one new vector per fragment.
fn assert_warm(what: &str, c: Counts, per: usize, nfrags: u64) {
    eprintln!(
        "{what} ({nfrags} fragments of {per}) on {} participants: {} allocations \
         ({} of >= 4 KiB), {} bytes, largest {}",
        WORKERS + 1,
        c.n,
        c.large,
        c.bytes,
        c.largest
    );
    // One datagram: the fragment's payload plus its headers (a buffer for
    // a datagram stashed or received early may be allocated whole).
    assert!(
        c.largest <= 4 * per as u64 + 64,
        "{what}: an allocation of {} bytes (> one datagram) during a warm call",
        c.largest
    );
    // Slack for what timing decides (a datagram stashed early or received
    // for a retransmission): 8 datagrams, far below one per fragment (the
    // socket aggregator's result vector per fragment was 62 here).
    assert!(
        c.large <= 8,
        "{what}: {} allocations of >= 4 KiB during a warm call of {nfrags} fragments",
        c.large
    );
    assert!(
        c.bytes <= 8 * 4 * per as u64 + (256 << 10),
        "{what}: {} bytes allocated during a warm call",
        c.bytes
    );
}

/// `call(participant, its buffer)` on every participant at once, each on its
/// own thread; the results in participant order (a failed call panics with
/// the participant's name).
fn on_every<T: Send, R: Send>(
    comms: &[Communicator],
    bufs: &mut [Vec<T>],
    call: impl Fn(&Communicator, &mut [T]) -> Result<R, aggbox::runtime::CommError> + Sync,
) -> Vec<R> {
    let call = &call;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(bufs.iter_mut())
            .map(|(c, b)| s.spawn(move || call(c, b).unwrap_or_else(|e| panic!("{:?}: {e}", c.participant()))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn run_f32(comms: &[Communicator], bufs: &mut [Vec<f32>]) {
    on_every(comms, bufs, |c, b| c.allreduce(b, Op::Sum));
}

#[test]
fn allreduce_f32_allocates_nothing_per_call_after_warm_up() {
    let _g = serial();
    const LEN: usize = 1_000_000;
    for q in [Quantization::Fixed(1e6), Quantization::Adaptive] {
        let comms = loopback_job(WORKERS, q);
        let inputs: Vec<Vec<f32>> = (0..WORKERS).map(|r| float_input(r, LEN)).collect();
        let want: Vec<f64> = (0..LEN)
            .map(|i| inputs.iter().map(|x| x[i] as f64).sum())
            .collect();
        let fresh = |bufs: &mut Vec<Vec<f32>>| {
            bufs[0].iter_mut().for_each(|x| *x = 0.0);
            for (r, x) in inputs.iter().enumerate() {
                bufs[r + 1].copy_from_slice(x);
            }
        };
        let mut bufs: Vec<Vec<f32>> = std::iter::once(vec![0f32; LEN])
            .chain(inputs.iter().cloned())
            .collect();
        run_f32(&comms, &mut bufs); // warm-up: buffers of this size are allocated
        fresh(&mut bufs);
        let c = counted(|| run_f32(&comms, &mut bufs));
        let (per, nfrags) = frag_shape(&comms, LEN);
        for (p, b) in bufs.iter().enumerate() {
            for (i, (g, w)) in b.iter().zip(&want).enumerate() {
                let tol = if matches!(q, Quantization::Fixed(_)) {
                    4.0 / 1e6
                } else {
                    1e-6
                };
                assert!(
                    (*g as f64 - w).abs() <= tol + w.abs() * 1e-6,
                    "{q:?} participant {p}: element {i} is {g}, want {w}"
                );
            }
        }
        assert_warm(
            &format!("{q:?}: second allreduce_f32 of {LEN} floats"),
            c,
            per,
            nfrags,
        );
    }
}

/// One blocking int call on every participant (`all`: allreduce, else
/// reduce); the aggregator's flag (OVERFLOW) is returned.
fn run_i32(comms: &[Communicator], bufs: &mut [Vec<i32>], all: bool) -> bool {
    let flags = on_every(comms, bufs, |c, b| {
        if all {
            c.allreduce(b, Op::Sum)
        } else {
            c.reduce(b, Op::Sum)
        }
    });
    flags[0].clamped
}

#[test]
fn allreduce_i32_allocates_nothing_per_call_after_warm_up() {
    let _g = serial();
    const LEN: usize = 1_000_000;
    let comms = loopback_job(WORKERS, Quantization::Fixed(1.0));
    let inputs: Vec<Vec<i32>> = (0..WORKERS)
        .map(|r| {
            (0..LEN)
                .map(|i| ((i * 7919 + r * 104_729) % 2_000_001) as i32 - 1_000_000)
                .collect()
        })
        .collect();
    let want: Vec<i32> = (0..LEN)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect();
    let fresh = |bufs: &mut Vec<Vec<i32>>| {
        bufs[0].iter_mut().for_each(|x| *x = 0);
        for (r, x) in inputs.iter().enumerate() {
            bufs[r + 1].copy_from_slice(x);
        }
    };
    let mut bufs: Vec<Vec<i32>> = std::iter::once(vec![0i32; LEN])
        .chain(inputs.iter().cloned())
        .collect();
    let (per, nfrags) = frag_shape(&comms, LEN);
    for all in [true, false] {
        let name = if all { "allreduce_i32" } else { "reduce_i32" };
        fresh(&mut bufs);
        assert!(!run_i32(&comms, &mut bufs, all), "{name}: OVERFLOW"); // warm-up
        fresh(&mut bufs);
        let mut overflow = true;
        let c = counted(|| overflow = run_i32(&comms, &mut bufs, all));
        assert!(!overflow, "{name}: OVERFLOW");
        for (p, b) in bufs.iter().enumerate() {
            // reduce: workers' buffers are left unchanged.
            let want = if all || p == 0 { &want } else { &inputs[p - 1] };
            if let Some(i) = (0..LEN).find(|&i| b[i] != want[i]) {
                panic!(
                    "{name} participant {p}: element {i} is {}, want {}",
                    b[i], want[i]
                );
            }
        }
        assert_warm(&format!("second {name} of {LEN} int32"), c, per, nfrags);
    }
}

// ---------------------------------------------------------------------------
// UDP GSO on the send path (Transport::send_batch_gso)
// ---------------------------------------------------------------------------

/// Datagram `i` to destination `d`: distinct bytes, so order and boundaries
/// can be checked.
fn gso_datagram(d: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (d * 131 + i * 7 + k) as u8).collect()
}

/// Sends, through `t.send_batch_gso`, 100 datagrams of 500 bytes and one
/// of 200 to receiver A, with 3 of 500 to receiver B in between and one
/// after; checks that each receiver gets exactly its datagrams, in order.
/// (500 bytes: 101 single datagrams' truesize fit a default socket buffer.)
fn gso_batch_round_trip(t: &UdpTransport) -> aggbox::runtime::transport::GsoSent {
    let lo = Ipv4Addr::LOCALHOST;
    let rx: Vec<std::net::UdpSocket> = (0..2).map(|_| std::net::UdpSocket::bind((lo, 0)).unwrap()).collect();
    let to: Vec<SocketAddr> =
        rx.iter().map(|s| SocketAddr::new(lo.into(), s.local_addr().unwrap().port())).collect();
    let mut plan: Vec<(usize, Vec<u8>)> = Vec::new();
    for i in 0..100 {
        plan.push((0, gso_datagram(0, i, 500)));
        if i == 40 || i == 41 || i == 70 {
            plan.push((1, gso_datagram(1, i, 500)));
        }
    }
    plan.push((0, gso_datagram(0, 100, 200)));
    plan.push((1, gso_datagram(1, 101, 500)));
    let msgs: Vec<(&[u8], SocketAddr)> = plan.iter().map(|(d, b)| (b.as_slice(), to[*d])).collect();
    // Receivers read while the batch is sent.
    std::thread::scope(|scope| {
        let readers: Vec<_> = rx
            .iter()
            .enumerate()
            .map(|(d, sock)| {
                let want: Vec<&Vec<u8>> = plan.iter().filter(|(x, _)| *x == d).map(|(_, b)| b).collect();
                scope.spawn(move || {
                    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut buf = vec![0u8; 65536];
                    for (k, w) in want.iter().enumerate() {
                        let n = sock.recv(&mut buf).unwrap_or_else(|e| panic!("receiver {d}: datagram {k} missing: {e}"));
                        assert_eq!(&buf[..n], w.as_slice(), "receiver {d}: datagram {k} (boundaries and order kept)");
                    }
                })
            })
            .collect();
        let sent = t.send_batch_gso(&msgs);
        assert_eq!(sent.datagrams, plan.len(), "the socket took every datagram: {sent:?}");
        for r in readers {
            r.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
        sent
    })
}

#[test]
fn udp_gso_batches_arrive_as_the_datagrams_sent() {
    let t = UdpTransport::new(std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap());
    let sent = gso_batch_round_trip(&t);
    eprintln!("{sent:?}");
    assert!(!t.gso_refused(), "loopback takes UDP GSO");
    // Runs break at the other destination, at 64 datagrams per sendmmsg and
    // at the shorter datagram; runs of 2+ go as super-datagrams.
    assert!(sent.super_datagrams >= 3, "{sent:?}");
    assert!(sent.segments >= 95, "{sent:?}");
}

#[test]
fn udp_gso_refused_by_the_socket_falls_back_to_single_datagrams() {
    // SO_NO_CHECK: the kernel refuses UDP GSO (udp_send_skb: EINVAL), as on
    // a route without checksum offload; nothing is lost.
    let sock = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let one: libc::c_int = 1;
    // SAFETY: valid fd, option value of the size given.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SOL_SOCKET,
            libc::SO_NO_CHECK,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_NO_CHECK");
    let t = UdpTransport::new(sock);
    let sent = gso_batch_round_trip(&t);
    assert!(t.gso_refused(), "the refusal is remembered");
    assert_eq!((sent.super_datagrams, sent.segments), (0, 0), "{sent:?}");
    // Later batches go one by one from the start.
    let again = gso_batch_round_trip(&t);
    assert_eq!(again.super_datagrams, 0);
}

#[test]
fn socket_backend_sends_runs_as_udp_gso_and_the_kernel_backend_does_not() {
    let _g = serial();
    const LEN: usize = 200_000;
    let lo = Ipv4Addr::LOCALHOST;
    let (agg_port, peers) = common_runtime::loopback_job_addrs(WORKERS);
    let comms: Vec<Communicator> = std::iter::once(Participant::Aggregator)
        .chain((0..WORKERS as u16).map(Participant::Worker))
        .map(|me| {
            Communicator::builder(12, peers.clone(), lo, agg_port, me)
                .mtu(1500)
                .deadline(Duration::from_secs(60))
                .build()
                .expect("build")
        })
        .collect();
    assert!(comms.iter().all(|c| c.config().udp_gso == Some(true)), "socket backend: on by default");
    let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|r| (0..LEN).map(|i| (i as i32 % 1000) - 500 + r as i32).collect()).collect();
    let want: Vec<i32> = (0..LEN).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
    let mut bufs: Vec<Vec<i32>> = std::iter::once(vec![0i32; LEN]).chain(inputs.iter().cloned()).collect();
    assert!(!run_i32(&comms, &mut bufs, true), "OVERFLOW");
    for (p, b) in bufs.iter().enumerate() {
        assert!(b == &want, "participant {p}: wrong result");
    }
    for (p, c) in comms.iter().enumerate() {
        let io = c.io_stats();
        eprintln!("participant {p}: {io:?}");
        assert!(io.gso_super_datagrams > 0 && io.gso_segments >= 2 * io.gso_super_datagrams, "participant {p}: {io:?}");
    }
    drop(comms); // frees the addresses the kernel-backend builders bind
    // The kernel backend keeps single datagrams (measured slower with GSO,
    // docs/RUNTIME.md), and a TC group never gets GSO.
    let kernel = |gso: Option<bool>| {
        let mut b = Communicator::builder(13, peers.clone(), lo, agg_port, Participant::Worker(0))
            .backend(BackendKind::Kernel)
            .result_port(agg_port)
            .mtu(1500);
        if let Some(on) = gso {
            b = b.udp_gso(on);
        }
        b.build().expect("build").config().udp_gso
    };
    assert_eq!(kernel(None), Some(false));
    assert_eq!(kernel(Some(true)), Some(true));
}
