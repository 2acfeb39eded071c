//! A two-level tree of aggregators served by the nodes alone (issue #22):
//! every node runs only `aggbox attach`, every job is `consumer = "node"`.
//!
//! Host 0 is the root node: job ROOT_JOB, whose workers are the two leaf
//! nodes, its `result_group` the leaves' result sockets. Hosts 1 and 2 are
//! the leaf nodes: job LEAF_JOB over their own workers, `result_group` the
//! workers' sockets, `parent` the root's job (its `result_port` included).
//! Hosts 3.. are the workers (`CommunicatorBuilder::from_config` with their
//! leaf's configuration, kernel backend): leaf l's worker r is global rank
//! l·W + r. A leaf's service sends its partial RESULT upstream and resends
//! it until the root acknowledges; the root's RESULT comes back to the leaf
//! services, which deliver it to their workers and resend what a worker
//! misses (docs/PROTOCOL.md, "Trees served by the node").
//!
//! Datagrams are dropped and duplicated on every switch port (nodes and
//! workers); the injector's counters must show it, the services' counters
//! the upstream resends and the RESULT resends. int32 results equal the
//! reference reducer over all workers; float32 means are the same on every
//! worker and within the quantization bound (the leaves'
//! `parent.tree_workers` is the tree's workers, the mean's divisor).
//! An adaptive float allreduce over the tree takes one round when the
//! workers guess the agreed scale: its checks count the tree's workers.
//! Killing a leaf's or the root's `aggbox attach` (kill -9, SIGTERM) mid-call makes
//! every call complete exactly or fail within its deadline naming the
//! aggregator; after the daemon starts again the next calls complete.
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --test node_tree`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

#[path = "../src/testing/impair/mod.rs"]
mod impair;
mod live_attach;
mod common_runtime;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use aggbox::runtime::Collective;
use aggbox::config::Config;
use aggbox::runtime::fragment::elements_per_fragment;
use aggbox::runtime::{BackendKind, Communicator, CommunicatorBuilder, Participant, Quantization};
use aggbox::wire::abi::Op;
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const ROOT_JOB: u16 = 20;
const ROOT_PORT: u16 = 7500;
const ROOT_RESULT_PORT: u16 = 7501;
const ROOT_GROUP: u16 = 5;
const LEAF_JOB: u16 = 11;
const LEAF_PORT: u16 = 7600;
const LEAF_RESULT_PORT: u16 = 7601;
const LEAF_GROUP: u16 = 4;
const DATA_PORT: u16 = 7700;
const METRICS_PORT: u16 = 9472;
const LEAVES: usize = 2;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/node_tree.rs needs root (network namespaces, XDP, TC): `sudo -E cargo test --test node_tree`"
    );
}

struct Tree {
    // Field order: communicators first, then the attachments, then the testbed.
    injector: impair::Injector,
    /// Leaf l's workers, rank order.
    workers: Vec<Vec<Communicator>>,
    /// Root, then the leaves.
    nodes: Vec<LiveAttach>,
    tb: Testbed,
}

fn quoted(addrs: &[String]) -> String {
    addrs.iter().map(|a| format!("\"{a}\"")).collect::<Vec<_>>().join(", ")
}

impl Tree {
    fn up(tag: &str, per_leaf: usize) -> Tree {
        Tree::up_with(tag, per_leaf, Duration::from_secs(30))
    }

    /// A tree whose workers' calls have `deadline`.
    fn up_with(tag: &str, per_leaf: usize, deadline: Duration) -> Tree {
        Tree::up_tuned(tag, per_leaf, deadline, |b| b)
    }

    /// A tree whose workers' calls have `deadline`, `tune` setting the rest
    /// of each worker's builder.
    fn up_tuned(tag: &str, per_leaf: usize, deadline: Duration, tune: impl Fn(CommunicatorBuilder) -> CommunicatorBuilder) -> Tree {
        let tb = Testbed::up(TestbedConfig { hosts: 1 + LEAVES + LEAVES * per_leaf, ..Default::default() }).expect("testbed");
        let root = tb.host(0).addr;
        let leaves: Vec<Ipv4Addr> = (1..=LEAVES).map(|l| tb.host(l).addr).collect();
        let node = format!("[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nack_mode = \"group\"\n\n");
        let root_text = format!(
            "{node}[[job]]\nid = {ROOT_JOB}\nport = {ROOT_PORT}\nworkers = [{}]\nresult_port = {ROOT_RESULT_PORT}\nresult_group = {ROOT_GROUP}\nconsumer = \"node\"\n\n[[group]]\nid = {ROOT_GROUP}\nmembers = [{}]\n",
            quoted(&leaves.iter().map(|a| a.to_string()).collect::<Vec<_>>()),
            quoted(&leaves.iter().map(|a| format!("{a}:{LEAF_RESULT_PORT}")).collect::<Vec<_>>()),
        );
        let mut nodes = vec![LiveAttach::start(&tb.host(0).netns, &format!("{tag}-root"), &root_text, &[])];
        let mut workers = Vec::new();
        for (l, &leaf) in leaves.iter().enumerate() {
            let hosts: Vec<usize> = (0..per_leaf).map(|r| 1 + LEAVES + l * per_leaf + r).collect();
            let addrs: Vec<String> = hosts.iter().map(|&h| tb.host(h).addr.to_string()).collect();
            let text = format!(
                "{node}[[job]]\nid = {LEAF_JOB}\nport = {LEAF_PORT}\nworkers = [{}]\nresult_port = {LEAF_RESULT_PORT}\nresult_group = {LEAF_GROUP}\nconsumer = \"node\"\nparent = {{ addr = \"{root}\", port = {ROOT_PORT}, job = {ROOT_JOB}, rank = {l}, result_port = {ROOT_RESULT_PORT}, tree_workers = {} }}\n\n[[group]]\nid = {LEAF_GROUP}\nmembers = [{}]\n",
                quoted(&addrs),
                LEAVES * per_leaf,
                quoted(&addrs.iter().map(|a| format!("{a}:{DATA_PORT}")).collect::<Vec<_>>()),
            );
            nodes.push(LiveAttach::start(&tb.host(1 + l).netns, &format!("{tag}-leaf{l}"), &text, &[]));
            let config = Config::parse(&text, "node_tree").expect("leaf config");
            workers.push(
                hosts
                    .iter()
                    .enumerate()
                    .map(|(r, &h)| {
                        let b = tune(
                            CommunicatorBuilder::from_config(&config, LEAF_JOB, leaf, DATA_PORT, Participant::Worker(r as u16))
                                .expect("from_config")
                                .backend(BackendKind::Kernel)
                                .deadline(deadline),
                        );
                        tb.in_host(h, move || b.build()).expect("netns").expect("build")
                    })
                    .collect(),
            );
        }
        Tree { injector: impair::Injector::new(), workers, nodes, tb }
    }

    /// Every worker, with its global rank.
    fn all(&self) -> impl Iterator<Item = (usize, &Communicator)> {
        let per = self.workers[0].len();
        self.workers.iter().enumerate().flat_map(move |(l, ws)| ws.iter().enumerate().map(move |(r, c)| (l * per + r, c)))
    }

    fn nworkers(&self) -> usize {
        self.workers.iter().map(Vec::len).sum()
    }

    /// Loss `loss` and duplication `dup` on every switch port.
    fn impair(&self, loss: f64, dup: f64) {
        for h in 0..self.tb.len() {
            self.impair_host(h, loss, dup);
        }
    }

    /// Loss `loss` and duplication `dup` on host `h`'s switch port.
    fn impair_host(&self, h: usize, loss: f64, dup: f64) {
        let port = self.tb.switch_port(h);
        let injector = &self.injector;
        testbed::in_netns(&self.tb.switch_netns(), move || injector.set(&port, loss, dup))
            .expect("switch netns")
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Result-service counter `name` of node `n` (0 root, 1.. leaves) for
    /// its job, from its `/metrics`.
    fn counter(&self, n: usize, name: &str) -> u64 {
        let job = if n == 0 { ROOT_JOB } else { LEAF_JOB };
        let text = testbed::in_netns(&self.tb.host(n).netns, || {
            let mut stream = TcpStream::connect(("127.0.0.1", METRICS_PORT)).expect("connect to /metrics");
            stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("request");
            let mut text = String::new();
            stream.read_to_string(&mut text).expect("read /metrics");
            text
        })
        .expect("node netns");
        let prefix = format!("aggbox_result_service_{name}_total{{");
        text.lines()
            .find(|l| l.starts_with(&prefix) && l.contains(&format!("aggbox_job=\"{job}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or_else(|| panic!("node {n}: no {prefix}..aggbox_job=\"{job}\"}} in /metrics:\n{text}"))
    }

    /// Counter `name` summed over the leaves.
    fn leaves_counter(&self, name: &str) -> u64 {
        (1..=LEAVES).map(|n| self.counter(n, name)).sum()
    }
}

fn input(rank: usize, len: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7 + rank * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

/// Every worker of the tree allreduces its vector at once; each gets the
/// reference over all of them.
fn allreduce(tree: &Tree, op: Op, len: usize) {
    let inputs: Vec<Vec<i32>> = (0..tree.nworkers()).map(|r| input(r, len)).collect();
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
    let want = reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec();
    std::thread::scope(|s| {
        let handles: Vec<_> = tree
            .all()
            .map(|(g, c)| {
                s.spawn(move || {
                    let mut v = input(g, len);
                    c.allreduce(&mut v, op).unwrap_or_else(|e| panic!("worker {g}: allreduce {op:?} of {len}: {e}"));
                    (g, v)
                })
            })
            .collect();
        for h in handles {
            let (g, got) = h.join().expect("worker thread");
            assert!(got == want, "worker {g}: allreduce {op:?} of {len} differs from the reference over the tree");
        }
    });
}

/// Every worker allreduces floats (the sum over the tree, or with `mean`
/// the mean over the tree: the leaves' `parent.tree_workers` is the tree's
/// workers); each gets the same, close result.
fn allreduce_f32(tree: &Tree, len: usize, mean: bool) {
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = tree
            .all()
            .map(|(g, c)| {
                s.spawn(move || {
                    let mut v: Vec<f32> = (0..len).map(|i| (i as f32 * 0.25 + g as f32) * 1e-5).collect();
                    c.allreduce(&mut v, if mean { Op::Avg } else { Op::Sum }).unwrap_or_else(|e| panic!("worker {g}: allreduce_f32: {e}"));
                    v
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    });
    let w = tree.nworkers() as f32;
    for (i, x) in results[0].iter().enumerate() {
        // The sum of (i/4 + g)·1e-5 over the W global ranks (at most 0.8
        // for 16 workers and 20,000 elements: it fits int32 at the fixed
        // scale 1e8, which errs by 0.5e-8 a value); f32 keeps ~7 digits.
        // The mean divides both by W (a leaf's own workers would give twice
        // the mean of 2 leaves).
        let d = if mean { w } else { 1.0 };
        let want = (w * i as f32 * 0.25 + w * (w - 1.0) / 2.0) * 1e-5 / d;
        assert!((x - want).abs() <= w * 0.5e-8 / d + want.abs() * 1e-6, "element {i}{}: {x} vs {want}", if mean { " (mean)" } else { "" });
    }
    assert!(results.iter().all(|r| r == &results[0]), "every worker of the tree has the same floats");
}

/// Without loss: exact, every fragment went upstream once and came back
/// once; then under `loss` and `dup` on every link (repeated, at most 10
/// times, until loss, duplication, upstream resends and RESULT resends all
/// happened), still exact.
fn tree(tag: &str, per_leaf: usize, loss: f64, dup: f64) {
    require_root();
    let tree = Tree::up(tag, per_leaf);
    let len = 20_000;
    allreduce(&tree, Op::Sum, len);
    allreduce_f32(&tree, len, false);
    allreduce_f32(&tree, len, true);
    allreduce(&tree, Op::Max, 1);
    // Each leaf sent each fragment upstream once and took the root's
    // RESULT of it once; the root took one RESULT per fragment (the
    // services publish every 50 ms: wait for them, 5 s at most).
    let per = elements_per_fragment(tree.workers[0][0].config().mtu);
    let fragments = (3 * len.div_ceil(per) + 1) as u64;
    let counts = || {
        (tree.leaves_counter("upstream_sent"), tree.leaves_counter("parent_results"), tree.counter(0, "results"))
    };
    let want = (LEAVES as u64 * fragments, LEAVES as u64 * fragments, fragments);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counts() != want && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(counts(), want, "{tag}: (contributions the leaves sent upstream, root RESULTs they took, RESULTs the root took)");
    let st = tree.nodes[1].status();
    let served = st.served.get(&LEAF_JOB).expect("aggbox status shows the leaf's served job");
    assert!(served.upstream_sent > 0 && served.parent_results > 0, "{served:?}");
    assert!(aggbox::node::format_status(&st).contains("upstream_resent"), "status shows the tree counters");
    if loss == 0.0 {
        // Not asserted: a leaf resends a contribution whose fragment waits
        // for a slower sibling past its RTO (the root acknowledges only
        // completed fragments), as a kernel-backend worker does.
        eprintln!(
            "{tag}: without loss the leaves resent {} contributions upstream, {} RESULT copies were resent",
            tree.leaves_counter("upstream_resent"),
            tree.leaves_counter("resent") + tree.counter(0, "resent")
        );
        return;
    }

    let c0 = tree.injector.counts();
    let (up0, resent0) = (tree.leaves_counter("upstream_resent"), tree.leaves_counter("resent") + tree.counter(0, "resent"));
    tree.impair(loss, dup);
    let mut rounds = 0;
    for _ in 0..10 {
        rounds += 1;
        allreduce(&tree, Op::Sum, len);
        allreduce(&tree, Op::Min, 362 * 3 + 17);
        allreduce_f32(&tree, len, true);
        let c = tree.injector.counts() - c0;
        let up = tree.leaves_counter("upstream_resent") - up0;
        let resent = tree.leaves_counter("resent") + tree.counter(0, "resent") - resent0;
        if c.dropped > 0 && (dup == 0.0 || c.duplicated > 0) && up > 0 && resent > 0 {
            break;
        }
    }
    tree.impair(0.0, 0.0);
    // The last resends may still be published: 5 s at most.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (up, resent) = loop {
        let up = tree.leaves_counter("upstream_resent") - up0;
        let resent = tree.leaves_counter("resent") + tree.counter(0, "resent") - resent0;
        if (up > 0 && resent > 0) || std::time::Instant::now() > deadline {
            break (up, resent);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let c = tree.injector.counts() - c0;
    eprintln!("{tag}: {rounds} rounds, injector {c:?}; the leaves resent {up} contributions upstream; {resent} RESULT copies were resent");
    assert!(c.dropped > 0, "{tag}: the injector dropped nothing ({c:?})");
    assert!(dup == 0.0 || c.duplicated > 0, "{tag}: the injector duplicated nothing ({c:?})");
    assert!(up > 0, "{tag}: {} dropped, no leaf resent a contribution upstream", c.dropped);
    assert!(resent > 0, "{tag}: {} dropped, no node resent a RESULT copy", c.dropped);
    assert_eq!(tree.counter(0, "refused_results") + tree.leaves_counter("refused_results"), 0);
    assert_eq!(tree.counter(0, "refused_acks") + tree.leaves_counter("refused_acks"), 0);
    // Still exact after the loss.
    allreduce(&tree, Op::Sum, 1000);
}

#[test]
fn two_leaves_of_two_workers_without_loss() {
    tree("tree-2", 2, 0.0, 0.0);
}

/// The one-round adaptive float allreduce over a tree: the scale checks
/// count the tree's workers (`parent.tree_workers`, 4 over 2 leaves), whose
/// contributions the root adds up. Calls at one magnitude take one round,
/// a ×1000 jump two; every worker's result is the two-round result over
/// the 4 workers bit for bit.
#[test]
fn an_adaptive_float_allreduce_over_the_tree_takes_one_round() {
    require_root();
    let tree = Tree::up_tuned("tree-f32", 2, Duration::from_secs(30), |b| b.quantization(Quantization::Adaptive));
    let len = 1000;
    let input = |g: usize, k: usize, magnitude: f32| -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v = if i == 0 { 2.0 + 0.001 * g as f32 } else { ((i * 31 + k) % 401) as f32 * 0.005 - 1.0 };
                v * magnitude
            })
            .collect()
    };
    for (k, magnitude, rounds, one_round, redone) in [(0, 1.0, 1, 1, 0), (1, 1.0, 1, 2, 0), (2, 1000.0, 2, 2, 1), (3, 1000.0, 1, 3, 1)] {
        let xs: Vec<Vec<f32>> = (0..tree.nworkers()).map(|g| input(g, k, magnitude)).collect();
        let before: Vec<u32> = tree.all().map(|(_, c)| c.position().0 .0).collect();
        let results: Vec<(usize, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = tree
                .all()
                .map(|(g, c)| {
                    let mut v = xs[g].clone();
                    s.spawn(move || {
                        c.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("worker {g}: allreduce_f32: {e}"));
                        (g, v)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
        });
        let want: Vec<u32> = common_runtime::two_round_result(&xs).iter().map(|f| f.to_bits()).collect();
        for ((g, v), ((_, c), b)) in results.iter().zip(tree.all().zip(&before)) {
            assert_eq!(v.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), want, "call {k}, worker {g}: the two-round result over the tree");
            assert_eq!(c.position().0 .0 - b, rounds, "call {k}, worker {g}: rounds");
            let st = c.stats();
            assert_eq!((st.float_calls_one_round, st.float_calls_redone), (one_round, redone), "call {k}, worker {g}");
        }
    }
}


#[test]
fn two_leaves_of_two_workers_with_one_percent_loss_on_every_link() {
    tree("tree-2-1pc", 2, 0.01, 0.0);
}

#[test]
fn two_leaves_of_two_workers_with_loss_and_duplication_on_every_link() {
    tree("tree-2-loss", 2, 0.05, 0.01);
}

#[test]
fn two_leaves_of_eight_workers_with_loss_and_duplication_on_every_link() {
    tree("tree-8-loss", 8, 0.05, 0.01);
}

/// What one worker's call did while a daemon of the tree was killed: when
/// it started and ended, and its error (`None`: it completed exactly).
struct CallAtKill {
    worker: usize,
    start: Instant,
    end: Instant,
    err: Option<String>,
}

/// Every worker loops allreduce_i32 SUM of `len` (the calls in lockstep:
/// a tree is one set of calls) until node `n` (0 root, 1.. leaves) was
/// killed with kill -9 (or stopped with SIGTERM) while every worker was
/// in a call; the call in
/// flight then is the last. Each call either completes with the exact
/// vector or fails within its deadline naming the aggregator (the
/// worker's leaf), never a wrong vector. Returns every call.
fn loop_and_kill(tree: &mut Tree, n: usize, sigterm: bool, len: usize, deadline: Duration) -> (Instant, Vec<CallAtKill>) {
    let want = {
        let inputs: Vec<Vec<i32>> = (0..tree.nworkers()).map(|r| input(r, len)).collect();
        let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
        reducer::reduce(Op::Sum, &c).expect("reference").ints().expect("ints").to_vec()
    };
    let nw = tree.nworkers();
    let barrier = Barrier::new(nw);
    let killed = AtomicBool::new(false);
    let go = AtomicBool::new(true);
    let in_call = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let Tree { workers, nodes, .. } = tree;
    let per = workers[0].len();
    let node = &mut nodes[n];
    std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .iter()
            .enumerate()
            .flat_map(|(l, ws)| ws.iter().enumerate().map(move |(r, c)| (l * per + r, c)))
            .map(|(g, c)| {
                let (want, barrier, killed, go, in_call, done) = (&want, &barrier, &killed, &go, &in_call, &done);
                s.spawn(move || {
                    let mut calls = Vec::new();
                    loop {
                        // One decision for all: the barrier's leader reads
                        // whether the kill happened, everyone reads its
                        // decision after the second barrier.
                        if barrier.wait().is_leader() {
                            go.store(!killed.load(Ordering::SeqCst), Ordering::SeqCst);
                        }
                        barrier.wait();
                        if !go.load(Ordering::SeqCst) {
                            break calls;
                        }
                        let mut v = input(g, len);
                        let start = Instant::now();
                        in_call.fetch_add(1, Ordering::SeqCst);
                        let out = c.allreduce(&mut v, Op::Sum);
                        in_call.fetch_sub(1, Ordering::SeqCst);
                        let end = Instant::now();
                        assert!(end - start < deadline + Duration::from_secs(2), "worker {g}: the call outlived its deadline ({:?})", end - start);
                        let err = match out {
                            Ok(_) => {
                                assert!(&v == want, "worker {g}: a completed call returned a wrong vector");
                                None
                            }
                            Err(e) => Some(e.to_string()),
                        };
                        calls.push(CallAtKill { worker: g, start, end, err });
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        // Two rounds of calls completed, then every worker in a call: kill.
        let t0 = Instant::now();
        while !(done.load(Ordering::SeqCst) >= 2 * nw && in_call.load(Ordering::SeqCst) == nw) {
            assert!(t0.elapsed() < Duration::from_secs(60), "the workers' calls did not get going");
            std::hint::spin_loop();
        }
        // The kill's time: when the signal goes (SIGTERM's exit may take a
        // while).
        let at = Instant::now();
        if sigterm {
            node.terminate();
        } else {
            node.kill9();
        }
        killed.store(true, Ordering::SeqCst);
        let calls = handles.into_iter().flat_map(|h| h.join().expect("worker thread")).collect();
        (at, calls)
    })
}

/// The checks of a kill: some call was in flight at the kill (it started
/// before and ended after), every failed call names the aggregator.
fn check_kill(tag: &str, at: Instant, calls: &[CallAtKill]) {
    let in_flight: Vec<&CallAtKill> = calls.iter().filter(|c| c.start < at && c.end > at).collect();
    let failed = in_flight.iter().filter(|c| c.err.is_some()).count();
    eprintln!(
        "{tag}: {} calls, {} in flight at the kill: {failed} failed, {} completed exactly",
        calls.len(),
        in_flight.len(),
        in_flight.len() - failed
    );
    assert!(!in_flight.is_empty(), "{tag}: no call was in flight at the kill");
    for c in calls {
        if let Some(e) = &c.err {
            assert!(e.contains("aggregator"), "{tag}: worker {}: the error names the aggregator (its leaf): {e}", c.worker);
            assert!(c.end > at, "{tag}: worker {}: a call before the kill failed: {e}", c.worker);
        }
    }
}

/// kill -9 of a leaf's `aggbox attach` mid-call, then of the root's, then
/// SIGTERM of the other leaf's: each
/// worker's call in flight either completes exactly or fails within its
/// deadline naming its leaf (the aggregator it knows), never a wrong
/// vector, never a hang; after the killed daemon is started again, the
/// next calls complete exactly (int32 and the float mean over the tree).
#[test]
fn a_leaf_or_the_root_killed_mid_call_fails_calls_cleanly_and_a_restart_serves_again() {
    require_root();
    let deadline = Duration::from_secs(3);
    let mut tree = Tree::up_with("tree-kill", 2, deadline);
    allreduce(&tree, Op::Sum, 10_000);
    for (n, sigterm, what) in [(1, false, "leaf 0 (kill -9)"), (0, false, "the root (kill -9)"), (2, true, "leaf 1 (SIGTERM)")] {
        // Loss toward the hosts the killed node sends RESULTs to (the
        // leaves, or the leaf's workers), so that some calls need its
        // service's RESULT resends: the pinned XDP and TC programs go on
        // without the process, but drop a late retransmission of a
        // completed fragment.
        let per = tree.workers[0].len();
        let to: Vec<usize> = if n == 0 { (1..=LEAVES).collect() } else { (0..per).map(|r| 1 + LEAVES + (n - 1) * per + r).collect() };
        to.iter().for_each(|&h| tree.impair_host(h, 0.05, 0.0));
        let (at, calls) = loop_and_kill(&mut tree, n, sigterm, 100_000, deadline);
        to.iter().for_each(|&h| tree.impair_host(h, 0.0, 0.0));
        check_kill(what, at, &calls);
        tree.nodes[n].restart();
        for _ in 0..3 {
            allreduce(&tree, Op::Sum, 10_000);
            allreduce_f32(&tree, 5_000, true);
        }
    }
}
