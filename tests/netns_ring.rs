//! Ring allreduce end to end (docs/RING.md), on network-namespace testbeds:
//! every member host runs a live `aggbox attach eth0` with the same
//! `[[ring]]` tables; each member's application is a
//! [`RingCommunicator`] opened in its host's namespace over the node's
//! pinned ring memory. The XDP ring program makes the hops it can, the
//! node's ring service the rest (round starts, early PARTIALs, NACKs and
//! their answers).
//!
//! Rings of 4, 8 and 16 members; ops SUM, COUNT, MAX, MIN and AVG with
//! weights; vectors of 1 element, one fragment, not a multiple of the
//! fragment and (4 members) several MB; loss and duplication injected on
//! every switch port (`src/testing/impair`, this kernel has no netem), the
//! injector's and the ring services' counters showing it was applied and
//! repaired. Every result equals the reference reducer
//! (src/wire/reducer.rs) over the members' inputs and weights.
//!
//! Needs root; fails (never skips) otherwise. The testbeds run one at a
//! time (a lock): `sudo -E cargo test --features bench --test netns_ring`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

#[path = "../src/testing/impair/mod.rs"]
mod impair;
mod live_attach;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use aggbox::config::Config;
use aggbox::node::ring::RingServiceStats;
use aggbox::runtime::{Quantization, RingCommunicator};
use aggbox::wire::abi::Op;
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

/// One testbed at a time: the VM has few CPUs.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const FRAG: u32 = 362;
/// Each member's /metrics, in its own namespace.
const METRICS_PORT: u16 = 9481;
const OPS: [Op; 5] = [Op::Sum, Op::Count, Op::Max, Op::Min, Op::Avg];

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/netns_ring.rs needs root (network namespaces, XDP): `sudo -E cargo test --features bench --test netns_ring`"
    );
}

/// The XDP attach mode of the members: `AGGBOX_RING_XDP_MODE` (`native`,
/// the default, or `generic`, where XDP forwards through the device's
/// transmit path).
fn xdp_mode() -> String {
    std::env::var("AGGBOX_RING_XDP_MODE").unwrap_or_else(|_| "native".into())
}

/// A ring of the test: id, port, elements.
#[derive(Debug, Clone, Copy)]
struct RingSpec {
    id: u16,
    port: u16,
    len: u32,
}

struct Bed {
    // Field order: communicators, then the injector, the attachments, the testbed.
    comms: Vec<Vec<RingCommunicator>>,
    injector: impair::Injector,
    nodes: Vec<LiveAttach>,
    tb: Testbed,
    rings: Vec<RingSpec>,
    weights: Vec<i32>,
    config: Config,
}

impl Bed {
    fn up(tag: &str, members: usize, weights: Vec<i32>, rings: Vec<RingSpec>) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: members, xdp_tx: true, ..Default::default() }).expect("testbed");
        let addrs: Vec<String> = (0..members).map(|h| format!("\"{}\"", tb.host(h).addr)).collect();
        let ws: Vec<String> = weights.iter().map(i32::to_string).collect();
        let mut text = format!("[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\n\n");
        for r in &rings {
            text += &format!(
                "[[ring]]\nid = {}\nport = {}\nmembers = [{}]\nweights = [{}]\nvector_len = {}\nfrag_elems = {FRAG}\n\n",
                r.id,
                r.port,
                addrs.join(", "),
                ws.join(", "),
                r.len
            );
        }
        let config = Config::parse(&text, "netns_ring").expect("ring config");
        let mode = xdp_mode();
        let nodes: Vec<LiveAttach> = (0..members)
            .map(|h| LiveAttach::start(&tb.host(h).netns, &format!("{tag}-{h}"), &text, &["--xdp-mode", mode.as_str()]))
            .collect();
        let comms = (0..members)
            .map(|h| {
                let pin_dir = aggbox::node::pin_dir(&nodes[h].pin_root, "eth0");
                rings
                    .iter()
                    .map(|r| {
                        let (config, pin_dir) = (&config, &pin_dir);
                        let mut c = tb
                            .in_host(h, move || RingCommunicator::open(config, r.id, pin_dir))
                            .expect("netns")
                            .unwrap_or_else(|e| panic!("member {h}: opening ring {}: {e}", r.id));
                        c.set_deadline(Duration::from_secs(60));
                        assert_eq!(c.member() as usize, h, "member index from the node's addresses");
                        c
                    })
                    .collect()
            })
            .collect();
        Bed { comms, injector: impair::Injector::new(), nodes, tb, rings, weights, config }
    }

    /// Loss `loss` and duplication `dup` on every switch port.
    fn impair(&self, loss: f64, dup: f64) {
        for h in 0..self.tb.len() {
            let port = self.tb.switch_port(h);
            let injector = &self.injector;
            testbed::in_netns(&self.tb.switch_netns(), move || injector.set(&port, loss, dup))
                .expect("switch netns")
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    }

    /// The ring services' counters, summed over the members.
    fn service_totals(&self, ring: u16) -> RingServiceStats {
        let mut t = RingServiceStats::default();
        for n in &self.nodes {
            let st = n.status();
            if let Some(s) = st.ring_service.get(&ring) {
                t.nacks_sent += s.nacks_sent;
                t.resends += s.resends;
                t.user_hops += s.user_hops;
                t.kicks += s.kicks;
                t.early_held += s.early_held;
                t.duplicates += s.duplicates;
            }
        }
        t
    }

    /// Every member's ring counters (XDP and service), for a failure's message.
    fn counters(&self, ring: u16) -> String {
        let mut out = String::new();
        for (m, n) in self.nodes.iter().enumerate() {
            let st = n.status();
            let xdp: Vec<String> =
                st.rings.get(&ring).map(|c| c.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect()).unwrap_or_default();
            let service: Vec<String> = st
                .ring_service
                .get(&ring)
                .map(|s| s.counters().iter().filter(|c| c.2 > 0).map(|(k, _, v)| format!("{k}={v}")).collect())
                .unwrap_or_default();
            out += &format!("member {m}: XDP {} | service {}\n", xdp.join(" "), service.join(" "));
        }
        out
    }

    /// Member `m`'s /metrics text.
    fn metrics(&self, m: usize) -> String {
        use std::io::{Read, Write};
        testbed::in_netns(&self.tb.host(m).netns, || {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", METRICS_PORT)).expect("connect to /metrics");
            stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("request");
            let mut text = String::new();
            stream.read_to_string(&mut text).expect("read /metrics");
            text
        })
        .expect("member netns")
    }

    /// The XDP ring program's counter `label`, summed over the members.
    fn xdp_total(&self, ring: u16, label: &str) -> u64 {
        self.nodes.iter().map(|n| n.status().rings.get(&ring).and_then(|c| c.get(label).copied()).unwrap_or(0)).sum()
    }

    /// Every member allreduces its input of ring `k` with `op` at once;
    /// each gets the reference.
    fn allreduce(&mut self, k: usize, op: Op, salt: usize) {
        let spec = self.rings[k];
        let n = self.comms.len();
        let inputs: Vec<Vec<i32>> = (0..n).map(|m| input(m, spec.len as usize, salt)).collect();
        let want = reference(op, &inputs, &self.weights);
        let started = Instant::now();
        let results: Vec<(usize, Vec<i32>, bool)> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .comms
                .iter_mut()
                .enumerate()
                .map(|(m, comms)| {
                    let mut v = inputs[m].clone();
                    let c = &mut comms[k];
                    s.spawn(move || match c.allreduce_i32(&mut v, op) {
                        Ok(out) => Ok((m, v, out.overflow)),
                        Err(e) => Err(format!("member {m}: ring {} {op:?} of {}: {e}", spec.id, spec.len)),
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("member thread")).collect::<Result<Vec<_>, String>>()
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", self.counters(spec.id)));
        for (m, got, overflow) in results {
            assert!(!overflow, "member {m}: ring {} {op:?}: OVERFLOW without saturation", spec.id);
            if got != want {
                let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                panic!(
                    "member {m}: ring {} {op:?} of {}: element {first} is {} where the reference is {}",
                    spec.id, spec.len, got[first], want[first]
                );
            }
        }
        eprintln!("ring {} ({n} members, {} elements) {op:?}: {:?}", spec.id, spec.len, started.elapsed());
    }
}

impl Bed {
    /// Every member runs `call` on its communicator of ring `k` at once.
    fn each<T: Send>(&mut self, k: usize, call: impl Fn(usize, &mut RingCommunicator) -> T + Sync) -> Vec<T> {
        let call = &call;
        std::thread::scope(|s| {
            let handles: Vec<_> =
                self.comms.iter_mut().enumerate().map(|(m, comms)| { let c = &mut comms[k]; s.spawn(move || call(m, c)) }).collect();
            handles.into_iter().map(|h| h.join().expect("member thread")).collect()
        })
    }
}

fn input(member: usize, len: usize, salt: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7 + member * 1_000_003 + salt * 31) % 20_001) as i32 - 10_000).collect()
}

/// The reference reducer over the members' inputs and weights.
fn reference(op: Op, inputs: &[Vec<i32>], weights: &[i32]) -> Vec<i32> {
    let c: Vec<(&[i32], i32)> = inputs.iter().map(Vec::as_slice).zip(weights.iter().copied()).collect();
    reducer::reduce(op, &c).expect("reference").ints().expect("ints").to_vec()
}

fn sizes_rings() -> Vec<RingSpec> {
    vec![
        RingSpec { id: 40, port: 7400, len: 1 },
        RingSpec { id: 41, port: 7401, len: FRAG },
        RingSpec { id: 42, port: 7402, len: FRAG * 7 + 5 },
    ]
}

#[test]
fn four_members_every_op_and_size_under_loss() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut rings = sizes_rings();
    // Several MB: 1 Mi elements, 4 MiB.
    rings.push(RingSpec { id: 43, port: 7403, len: 1 << 20 });
    let mut bed = Bed::up("r4", 4, vec![1, 2, 1, 3], rings);
    for (k, _) in bed.rings.clone().iter().enumerate() {
        for (i, op) in OPS.into_iter().enumerate() {
            bed.allreduce(k, op, i);
        }
    }
    // In place over the mapped buffer.
    let len = bed.rings[2].len as usize;
    let inputs: Vec<Vec<i32>> = (0..4).map(|m| input(m, len, 77)).collect();
    let want = reference(Op::Min, &inputs, &bed.weights);
    let got = bed.each(2, |m, c| {
        c.input_mut().copy_from_slice(&inputs[m]);
        c.allreduce_in_place(Op::Min).unwrap_or_else(|e| panic!("member {m}: in place: {e}"));
        c.result().to_vec()
    });
    assert!(got.iter().all(|g| *g == want), "in-place MIN differs from the reference");
    // Floats through the quantization: the weighted mean within its bound.
    let floats: Vec<Vec<f32>> = (0..4).map(|m| (0..len).map(|i| ((i * 13 + m * 7) % 1000) as f32 / 997.0 - 0.5).collect()).collect();
    let weight_sum: f64 = bed.weights.iter().map(|&w| f64::from(w)).sum();
    let got = bed.each(2, |m, c| {
        let mut v = floats[m].clone();
        c.allreduce_f32(&mut v, true).unwrap_or_else(|e| panic!("member {m}: f32: {e}"));
        v
    });
    let weights = bed.weights.clone();
    let check_mean = |got: &[Vec<f32>], what: &str| {
        for i in 0..len {
            let exact: f64 = floats.iter().zip(&weights).map(|(v, &w)| f64::from(w) * f64::from(v[i])).sum::<f64>() / weight_sum;
            for (m, g) in got.iter().enumerate() {
                assert!((f64::from(g[i]) - exact).abs() < 1e-6, "{what}: member {m} element {i}: {} vs {exact}", g[i]);
            }
        }
    };
    check_mean(&got, "fixed scale");
    // The adaptive scale (agreed by a ring MAX first), and a fixed scale so
    // large that the sum saturates, rerun at the adaptive one in lockstep.
    for q in [Quantization::Adaptive, Quantization::FixedOrAdaptive(1e9)] {
        let got = bed.each(2, |m, c| {
            c.set_quantization(q);
            let mut v = floats[m].clone();
            c.allreduce_f32(&mut v, true).unwrap_or_else(|e| panic!("member {m}: f32 {q:?}: {e}"));
            v
        });
        check_mean(&got, &format!("{q:?}"));
    }
    // Saturation: a SUM that leaves int32 says OVERFLOW on every member, the
    // values those of the ring's hop-by-hop reference.
    let len = bed.rings[1].len as usize;
    let big: Vec<Vec<i32>> = (0..4i32).map(|m| (0..len).map(|i| if i % 5 == 0 { i32::MAX - m } else { i as i32 }).collect()).collect();
    let refs: Vec<&[i32]> = big.iter().map(Vec::as_slice).collect();
    let (want, saturated) = aggbox::wire::ring::ring_reference(Op::Sum, &refs, &bed.weights);
    assert!(saturated);
    let got = bed.each(1, |m, c| {
        let mut v = big[m].clone();
        let out = c.allreduce_i32(&mut v, Op::Sum).unwrap_or_else(|e| panic!("member {m}: saturating SUM: {e}"));
        (v, out.overflow)
    });
    for (m, (v, overflow)) in got.iter().enumerate() {
        assert!(*overflow, "member {m}: a saturated SUM without OVERFLOW");
        // Every fragment of the ring has one origin, so the result is
        // ring_reference's only where it started at the same member; the
        // elements that did not saturate are exact anyway.
        for i in (0..len).filter(|i| i % 5 != 0) {
            assert_eq!(v[i], want[i], "member {m} element {i}");
        }
        assert!((0..len).filter(|i| i % 5 == 0).all(|i| v[i] == i32::MAX), "member {m}: saturated elements at i32::MAX");
    }
    // An application that restarts continues at its node's next round.
    let (config, pin_dir) = (bed.config.clone(), aggbox::node::pin_dir(&bed.nodes[2].pin_root, "eth0"));
    let before = bed.comms[2][0].round();
    let reopened = bed.tb.in_host(2, || RingCommunicator::open(&config, 40, &pin_dir)).expect("netns").expect("reopen");
    assert_eq!(reopened.round(), before, "a new communicator starts after its node's last round");
    bed.comms[2][0] = reopened;
    bed.allreduce(0, Op::Sum, 99);

    // Who made the hops: the XDP ring program, or (where it passes them on,
    // or does not run) the ring service; every result above is exact either way.
    let (xdp, user) = (bed.xdp_total(41, "added") + bed.xdp_total(41, "stored"), bed.service_totals(41).user_hops);
    eprintln!("ring 41: {xdp} hops in XDP, {user} in the ring services");
    assert!(xdp + user > 0, "nobody made a hop of ring 41");
    for (loss, dup) in [(0.01, 0.01), (0.05, 0.05)] {
        bed.impair(loss, dup);
        let before = bed.injector.counts();
        let s0 = bed.service_totals(43);
        for (k, _) in bed.rings.clone().iter().enumerate() {
            for (i, op) in [Op::Sum, Op::Max, Op::Avg].into_iter().enumerate() {
                bed.allreduce(k, op, 10 + i);
            }
        }
        let c = bed.injector.counts() - before;
        let s = bed.service_totals(43);
        eprintln!("loss {loss} dup {dup}: injector {c:?}; ring 43 services: nacks {} resends {}", s.nacks_sent - s0.nacks_sent, s.resends - s0.resends);
        assert!(c.dropped > 0 && c.duplicated > 0, "the injector dropped and duplicated ({c:?})");
        assert!(s.nacks_sent > s0.nacks_sent && s.resends > s0.resends, "the ring services repaired the loss ({s:?})");
        bed.impair(0.0, 0.0);
    }
}

#[test]
fn eight_members() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bed = Bed::up("r8", 8, vec![1, 1, 2, 1, 1, 3, 1, 1], sizes_rings());
    for k in 0..bed.rings.len() {
        for (i, op) in OPS.into_iter().enumerate() {
            bed.allreduce(k, op, i);
        }
    }
    bed.impair(0.05, 0.05);
    for k in 0..bed.rings.len() {
        bed.allreduce(k, Op::Sum, 20 + k);
    }
    assert!(bed.injector.counts().dropped > 0);
    // The counters in /metrics: every member was KICKed once per call.
    // (The service publishes its counters every 50 ms.)
    std::thread::sleep(Duration::from_millis(200));
    let text = aggbox::node::format_status(&bed.nodes[0].status());
    assert!(text.contains("ring 42 (XDP):") && text.contains("ring 42 service:"), "aggbox status:\n{text}");
    let text = bed.metrics(0);
    let calls = (OPS.len() + 1) as u64;
    for k in &bed.rings {
        let line = format!("aggbox_ring_service_kicks_total{{iface=\"eth0\",aggbox_ring=\"{}\"}} {calls}", k.id);
        assert!(text.contains(&line), "no {line:?} in /metrics:\n{text}");
        assert!(text.contains(&format!("aggbox_ring_stored_total{{iface=\"eth0\",aggbox_ring=\"{}\"}}", k.id)), "no XDP ring counters in /metrics:\n{text}");
    }
}

#[test]
fn sixteen_members_small_vectors() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rings = vec![RingSpec { id: 40, port: 7400, len: 1 }, RingSpec { id: 42, port: 7402, len: FRAG * 3 + 7 }];
    let mut bed = Bed::up("r16", 16, (0..16).map(|m: i32| 1 + m % 3).collect(), rings);
    for k in 0..bed.rings.len() {
        for (i, op) in OPS.into_iter().enumerate() {
            bed.allreduce(k, op, i);
        }
    }
    bed.impair(0.01, 0.01);
    for k in 0..bed.rings.len() {
        bed.allreduce(k, Op::Sum, 30 + k);
        bed.allreduce(k, Op::Avg, 40 + k);
    }
}
