//! Star or ring per call (`runtime::StarOrRing`, docs/RING.md "Choosing"),
//! end to end: host 0 serves a star job (`consumer = "node"`, its TC copies
//! the RESULTs to the workers), hosts 1..=4 are the star's workers and the
//! members of a ring, each host a live `aggbox attach eth0`. Each worker's
//! application holds both communicators in one `StarOrRing`.
//!
//! Checked: calls below the threshold take the star, calls at or above it
//! the ring (shorter than the ring's vector: padded with the op's identity);
//! every result equals the reference reducer; forcing either works; a ring
//! call whose partial sums saturate is redone on the star and returns the
//! star's exact result (forcing the ring returns OVERFLOW instead).
//!
//! Needs root; fails (never skips) otherwise:
//! `sudo -E cargo test --features bench --test netns_collective`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

mod live_attach;

use std::time::Duration;

use aggbox::config::Config;
use aggbox::runtime::{Algorithm, BackendKind, Collective, CommunicatorBuilder, Participant, RingCommunicator, StarOrRing};
use aggbox::wire::abi::Op;
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 4;
const RING_LEN: u32 = 3000;
const THRESHOLD: usize = 1000;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/netns_collective.rs needs root (network namespaces, XDP): `sudo -E cargo test --features bench --test netns_collective`"
    );
}

struct Bed {
    // Field order: communicators first, then the attachments, the testbed.
    members: Vec<StarOrRing<aggbox::runtime::Communicator>>,
    _nodes: Vec<LiveAttach>,
    _tb: Testbed,
}

/// One testbed at a time: the VM has few CPUs.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn up(tag: &str) -> Bed {
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, xdp_tx: true, ..Default::default() }).expect("testbed");
    let workers: Vec<String> = (1..=WORKERS).map(|h| format!("\"{}\"", tb.host(h).addr)).collect();
    let sockets: Vec<String> = (1..=WORKERS).map(|h| format!("\"{}:7950\"", tb.host(h).addr)).collect();
    let node = "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\n\n";
    let star = format!(
        "[[job]]\nid = 9\nport = 7900\nworkers = [{}]\nresult_port = 7901\nresult_group = 9\nconsumer = \"node\"\n\n[[group]]\nid = 9\nmembers = [{}]\n\n",
        workers.join(", "),
        sockets.join(", ")
    );
    let ring = format!(
        "[[ring]]\nid = 40\nport = 7400\nmembers = [{}]\nvector_len = {RING_LEN}\nfrag_elems = 362\n",
        workers.join(", ")
    );
    let mut nodes = vec![LiveAttach::start(&tb.host(0).netns, &format!("{tag}-0"), &format!("{node}{star}"), &[])];
    for h in 1..=WORKERS {
        nodes.push(LiveAttach::start(&tb.host(h).netns, &format!("{tag}-{h}"), &format!("{node}{ring}"), &[]));
    }
    let apps = Config::parse(&format!("{node}{star}{ring}"), "netns_collective").expect("config");
    let agg = tb.host(0).addr;
    let members = (1..=WORKERS)
        .map(|h| {
            let pin_dir = aggbox::node::pin_dir(&nodes[h].pin_root, "eth0");
            let (apps, pin_dir) = (&apps, &pin_dir);
            let (star, ring) = tb
                .in_host(h, move || {
                    let star = CommunicatorBuilder::from_config(apps, 9, agg, 7950, Participant::Worker(h as u16 - 1))
                        .and_then(|b| b.backend(BackendKind::Kernel).deadline(Duration::from_secs(30)).build());
                    (star, RingCommunicator::open(apps, 40, pin_dir))
                })
                .expect("netns");
            let star = star.unwrap_or_else(|e| panic!("worker {h}: star communicator: {e}"));
            let mut ring = ring.unwrap_or_else(|e| panic!("worker {h}: ring communicator: {e}"));
            ring.set_deadline(Duration::from_secs(30));
            StarOrRing::new(Some(star), Some(ring)).expect("collective").with_ring_threshold(THRESHOLD)
        })
        .collect();
    Bed { members, _nodes: nodes, _tb: tb }
}

impl Bed {
    /// Every member reduces its input at once; returns each member's
    /// (algorithm, overflow, result).
    fn allreduce(&mut self, inputs: &[Vec<i32>], op: Op) -> Vec<(Algorithm, bool, Vec<i32>)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = self
                .members
                .iter_mut()
                .zip(inputs)
                .enumerate()
                .map(|(m, (c, input))| {
                    let mut v = input.clone();
                    s.spawn(move || {
                        let served = c.allreduce(&mut v, op).unwrap_or_else(|e| panic!("member {m}: {op:?} of {}: {e}", v.len()));
                        (served.algorithm, served.clamped, v)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("member thread")).collect()
        })
    }

    fn set_algorithm(&mut self, a: Algorithm) {
        let members = std::mem::take(&mut self.members);
        self.members = members.into_iter().map(|c| c.with_algorithm(a)).collect();
    }
}

fn inputs(len: usize, salt: usize) -> Vec<Vec<i32>> {
    (0..WORKERS)
        .map(|m| (0..len).map(|i| ((i * 13 + m * 7919 + salt * 101) % 40_001) as i32 - 20_000).collect())
        .collect()
}

fn reference(op: Op, inputs: &[Vec<i32>]) -> Vec<i32> {
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
    reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec()
}

#[test]
fn each_call_takes_the_star_or_the_ring_by_size_and_every_result_is_exact() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bed = up("size");
    let cases = [
        (1, Algorithm::Star),
        (THRESHOLD - 1, Algorithm::Star),
        (THRESHOLD, Algorithm::Ring),
        (RING_LEN as usize, Algorithm::Ring),
        (RING_LEN as usize + 1, Algorithm::Star), // longer than the ring: the star
    ];
    for (salt, &(len, want)) in cases.iter().enumerate() {
        for op in [Op::Sum, Op::Max, Op::Min] {
            let ins = inputs(len, salt);
            let expected = reference(op, &ins);
            for (m, (algorithm, overflow, got)) in bed.allreduce(&ins, op).into_iter().enumerate() {
                assert_eq!(algorithm, want, "member {m}: {len} elements of {op:?}");
                assert!(!overflow);
                assert_eq!(got, expected, "member {m}: {len} elements of {op:?} on the {algorithm:?}");
            }
        }
    }
    // Forced: the ring for a small vector, the star for a large one.
    bed.set_algorithm(Algorithm::Ring);
    let ins = inputs(5, 9);
    for (algorithm, _, got) in bed.allreduce(&ins, Op::Sum) {
        assert_eq!((algorithm, &got), (Algorithm::Ring, &reference(Op::Sum, &ins)));
    }
    bed.set_algorithm(Algorithm::Star);
    let ins = inputs(RING_LEN as usize, 10);
    for (algorithm, _, got) in bed.allreduce(&ins, Op::Sum) {
        assert_eq!((algorithm, &got), (Algorithm::Star, &reference(Op::Sum, &ins)));
    }
}

#[test]
fn a_ring_call_whose_partials_saturate_is_redone_on_the_star() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bed = up("sat");
    // Members 0 and 1 send 2e9, members 2 and 3 -2e9: the exact sum is 0,
    // but a fragment whose way starts at member 0 (or 2) has a partial of
    // ±4e9 after two members, which saturates.
    let big = 2_000_000_000;
    let ins: Vec<Vec<i32>> = (0..WORKERS).map(|m| vec![if m < 2 { big } else { -big }; RING_LEN as usize]).collect();
    for (m, (algorithm, overflow, got)) in bed.allreduce(&ins, Op::Sum).into_iter().enumerate() {
        assert_eq!(algorithm, Algorithm::Star, "member {m}: the saturated ring call is redone on the star");
        assert!(!overflow, "member {m}: the star's exact sum is in range");
        assert!(got.iter().all(|&x| x == 0), "member {m}: the exact sum");
    }
    bed.set_algorithm(Algorithm::Ring);
    for (m, (algorithm, overflow, _)) in bed.allreduce(&ins, Op::Sum).into_iter().enumerate() {
        assert_eq!(algorithm, Algorithm::Ring);
        assert!(overflow, "member {m}: forced onto the ring, the call says OVERFLOW");
    }
}
