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
//! (src/wire/reducer.rs) over the members' inputs and weights. Rings
//! added, removed and replaced by `aggbox reload` within the memory
//! reserved at attach (`[node] ring_pool`), while the file's own ring
//! runs on.
//!
//! Needs root; fails (never skips) otherwise. The testbeds run one at a
//! time (a lock): `sudo -E cargo test --features bench --test netns_ring`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

#[path = "../src/testing/impair/mod.rs"]
mod impair;
mod live_attach;
mod ring_entries;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
/// The largest ring fragment over IPv6 at MTU 1500 (a 40-byte header,
/// an even count).
const FRAG6: u32 = 356;
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
    /// The `[node]` keys every member's file has besides metrics and
    /// userspace_path.
    node_keys: String,
    /// The members are the hosts' IPv6 addresses (a dual-stack testbed).
    ipv6: bool,
}

impl Bed {
    fn up(tag: &str, members: usize, weights: Vec<i32>, rings: Vec<RingSpec>) -> Bed {
        Bed::up_with(tag, members, weights, rings, "")
    }

    /// [`Bed::up`] with `node_keys` in every member's `[node]` section.
    fn up_with(tag: &str, members: usize, weights: Vec<i32>, rings: Vec<RingSpec>, node_keys: &str) -> Bed {
        Bed::up_family(tag, members, weights, rings, node_keys, false)
    }

    /// [`Bed::up_with`], the members' addresses IPv6 ones with `ipv6`.
    fn up_family(tag: &str, members: usize, weights: Vec<i32>, rings: Vec<RingSpec>, node_keys: &str, ipv6: bool) -> Bed {
        let tb = Testbed::up(TestbedConfig { hosts: members, xdp_tx: true, ipv6, ..Default::default() }).expect("testbed");
        let mut bed = Bed {
            comms: Vec::new(),
            injector: impair::Injector::new(),
            nodes: Vec::new(),
            tb,
            rings,
            weights,
            config: Config::default(),
            node_keys: node_keys.to_string(),
            ipv6,
        };
        let text = bed.config_text(&bed.rings);
        bed.config = Config::parse(&text, "netns_ring").expect("ring config");
        let mode = xdp_mode();
        bed.nodes = (0..members)
            .map(|h| LiveAttach::start(&bed.tb.host(h).netns, &format!("{tag}-{h}"), &text, &["--xdp-mode", mode.as_str()]))
            .collect();
        bed.comms = (0..members).map(|h| bed.rings.iter().map(|r| bed.open(h, &bed.config, r.id)).collect()).collect();
        bed
    }

    /// Every member's config file with `rings`.
    fn config_text(&self, rings: &[RingSpec]) -> String {
        let addrs: Vec<String> = (0..self.tb.len())
            .map(|h| {
                let host = self.tb.host(h);
                if self.ipv6 {
                    format!("\"{}\"", host.addr6.expect("a dual-stack testbed"))
                } else {
                    format!("\"{}\"", host.addr)
                }
            })
            .collect();
        let frag = if self.ipv6 { FRAG6 } else { FRAG };
        let ws: Vec<String> = self.weights.iter().map(i32::to_string).collect();
        let mut text =
            format!("[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\n{}\n\n", self.node_keys);
        for r in rings {
            text += &format!(
                "[[ring]]\nid = {}\nport = {}\nmembers = [{}]\nweights = [{}]\nvector_len = {}\nfrag_elems = {frag}\n\n",
                r.id,
                r.port,
                addrs.join(", "),
                ws.join(", "),
                r.len
            );
        }
        text
    }

    /// Member `h`'s communicator of ring `id` of `config`, opened in its
    /// host's namespace over its node's pins.
    fn open(&self, h: usize, config: &Config, id: u16) -> RingCommunicator {
        let pin_dir = self.pin_dir(h);
        let pin_dir = &pin_dir;
        let mut c = self
            .tb
            .in_host(h, move || RingCommunicator::open(config, id, pin_dir))
            .expect("netns")
            .unwrap_or_else(|e| panic!("member {h}: opening ring {id}: {e}"));
        c.set_deadline(Duration::from_secs(60));
        assert_eq!(c.member() as usize, h, "member index from the node's addresses");
        c
    }

    /// Member `h`'s pin directory.
    fn pin_dir(&self, h: usize) -> std::path::PathBuf {
        aggbox::node::pin_dir(&self.nodes[h].pin_root, "eth0")
    }

    /// Every member's file rewritten with `rings` and reloaded (`aggbox
    /// reload eth0` in its namespace): each member's (success, output).
    fn reload(&self, rings: &[RingSpec]) -> Vec<(bool, String)> {
        let text = self.config_text(rings);
        self.nodes
            .iter()
            .enumerate()
            .map(|(h, node)| {
                std::fs::write(node.pin_root.with_extension("toml"), &text).expect("write the config file");
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", &self.tb.host(h).netns, env!("CARGO_BIN_EXE_aggbox"), "reload", "eth0", "--pin-root"])
                    .arg(&node.pin_root)
                    .output()
                    .expect("run aggbox reload");
                (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
            })
            .collect()
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
        let comms: Vec<&mut RingCommunicator> = self.comms.iter_mut().map(|c| &mut c[k]).collect();
        if let Err(e) = allreduce_members(comms, spec, op, salt, &self.weights) {
            panic!("{e}\n{}", self.counters(spec.id));
        }
    }
}

/// Member m allreduces its input of ring `spec` with `op` on `comms[m]`,
/// all at once; each must get the reference.
fn allreduce_members(comms: Vec<&mut RingCommunicator>, spec: RingSpec, op: Op, salt: usize, weights: &[i32]) -> Result<(), String> {
    let n = comms.len();
    let inputs: Vec<Vec<i32>> = (0..n).map(|m| input(m, spec.len as usize, salt)).collect();
    let want = reference(op, &inputs, weights);
    let started = Instant::now();
    let results: Vec<(usize, Vec<i32>, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(m, c)| {
                let mut v = inputs[m].clone();
                s.spawn(move || match c.allreduce_i32(&mut v, op) {
                    Ok(out) => Ok((m, v, out.overflow)),
                    Err(e) => Err(format!("member {m}: ring {} {op:?} of {}: {e}", spec.id, spec.len)),
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect::<Result<Vec<_>, String>>()
    })?;
    for (m, got, overflow) in results {
        if overflow {
            return Err(format!("member {m}: ring {} {op:?}: OVERFLOW without saturation", spec.id));
        }
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "member {m}: ring {} {op:?} of {}: element {first} is {} where the reference is {}",
                spec.id, spec.len, got[first], want[first]
            ));
        }
    }
    eprintln!("ring {} ({n} members, {} elements) {op:?}: {:?}", spec.id, spec.len, started.elapsed());
    Ok(())
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

/// A ring of the hosts' IPv6 addresses (a `[[ring]]` of IPv6 members):
/// every op exact at 1 element, one fragment and 7 fragments and 5, with
/// most hops made by the XDP ring program over IPv6, and under 1 % loss
/// and duplication (injected, repaired by the services' NACKs).
#[test]
fn four_members_over_ipv6_every_op_under_loss() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rings = vec![
        RingSpec { id: 50, port: 7500, len: 1 },
        RingSpec { id: 51, port: 7501, len: FRAG6 },
        RingSpec { id: 52, port: 7502, len: FRAG6 * 7 + 5 },
    ];
    let mut bed = Bed::up_family("r6", 4, vec![1, 2, 1, 3], rings, "", true);
    for k in 0..bed.rings.len() {
        for (i, op) in OPS.into_iter().enumerate() {
            bed.allreduce(k, op, i);
        }
    }
    let xdp = bed.xdp_total(52, "added") + bed.xdp_total(52, "stored");
    assert!(xdp > 0, "the XDP ring program made hops of the IPv6 ring\n{}", bed.counters(52));
    bed.impair(0.01, 0.01);
    let before = bed.injector.counts();
    for k in 0..bed.rings.len() {
        for (i, op) in [Op::Sum, Op::Max].into_iter().enumerate() {
            for round in 0..5 {
                bed.allreduce(k, op, 20 + 2 * round + i);
            }
        }
    }
    let c = bed.injector.counts() - before;
    bed.impair(0.0, 0.0);
    assert!(c.dropped > 0, "the injector dropped ({c:?})");
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

/// The `(dense index, base)` of ring `id` on member `h`'s node.
fn place(bed: &Bed, h: usize, id: u16) -> Option<(u32, u32)> {
    aggbox::wire::ring_memory::pinned_ring_job(&bed.pin_dir(h), id).ok().map(|(dense, job)| (dense, job.base))
}

#[test]
fn four_members_reload_rings_within_the_pool_while_the_files_ring_runs() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The file's ring 40: 8 fragments of 362, entries 0..16. The pool: 4000
    // elements more, 12 fragments (4344 elements), entries 16..40.
    let file_ring = RingSpec { id: 40, port: 7400, len: FRAG * 7 + 5 };
    let added = RingSpec { id: 44, port: 7404, len: 3000 }; // 9 fragments
    let other = RingSpec { id: 45, port: 7405, len: 1000 }; // 3 fragments
    let too_big = RingSpec { id: 46, port: 7406, len: 5000 }; // 14 fragments
    let mut bed = Bed::up_with("rpool", 4, vec![1, 2, 1, 3], vec![file_ring], "ring_pool = 4000");
    let weights = bed.weights.clone();
    let frag = u64::from(FRAG);
    let pool = bed.nodes[0].status().ring_pool;
    assert_eq!((pool.reserved, pool.used, pool.free), (20 * frag, 8 * frag, 12 * frag), "{pool:?}");
    let file_place: Vec<Option<(u32, u32)>> = (0..4).map(|h| place(&bed, h, 40)).collect();
    assert!(file_place.iter().all(|p| *p == Some((0, 0))), "{file_place:?}");

    // Ring 40 runs in a loop from here to the end, every call exact.
    let mut comms40: Vec<RingCommunicator> = bed.comms.iter_mut().map(|c| c.remove(0)).collect();
    let stop = AtomicBool::new(false);
    let calls = AtomicU64::new(0);
    let bed = &bed;
    std::thread::scope(|s| {
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop_on_panic = StopOnDrop(&stop);
        let (stop, calls, weights) = (&stop, &calls, &weights);
        let loop40 = s.spawn(move || {
            let mut salt = 1000;
            while !stop.load(Ordering::Relaxed) {
                allreduce_members(comms40.iter_mut().collect(), file_ring, OPS[salt % OPS.len()], salt, weights)?;
                calls.fetch_add(1, Ordering::Relaxed);
                salt += 1;
            }
            Ok::<_, String>(comms40)
        });
        // The file's ring made progress since `after` calls, in the same place.
        let ring40_goes_on = |after: u64, when: &str| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while calls.load(Ordering::Relaxed) < after + 2 {
                assert!(!loop40.is_finished(), "{when}: ring 40's loop ended (a call failed)");
                assert!(Instant::now() < deadline, "{when}: ring 40 made no progress\n{}", bed.counters(40));
                std::thread::sleep(Duration::from_millis(10));
            }
            for (h, want) in file_place.iter().enumerate() {
                assert_eq!(place(bed, h, 40), *want, "{when}: member {h}: ring 40 kept its index and base");
            }
        };
        ring40_goes_on(0, "at attach");

        // 1. Ring 44 added: it takes the pool's first entries, index 1.
        let before = calls.load(Ordering::Relaxed);
        for (h, (ok, out)) in bed.reload(&[file_ring, added]).into_iter().enumerate() {
            assert!(ok && out.contains("rings added: 44;"), "member {h}: adding ring 44: {out}");
        }
        let place44: Vec<Option<(u32, u32)>> = (0..4).map(|h| place(bed, h, 44)).collect();
        assert!(place44.iter().all(|p| *p == Some((1, 16))), "ring 44 after ring 40's 16 entries: {place44:?}");
        let status = bed.nodes[1].status();
        let pool = status.ring_pool;
        assert_eq!((pool.used, pool.free, pool.largest_free), (17 * frag, 3 * frag, 3 * frag), "{pool:?}");
        let text = aggbox::node::format_status(&status);
        assert!(text.contains("ring pool: 7240 elements reserved (fragments of 362), 6154 used, 1086 free (largest free region 1086)"), "{text}");
        let json = serde_json::to_value(&status).expect("status as JSON");
        assert_eq!((json["ring_pool"]["reserved"].as_u64(), json["ring_pool"]["free"].as_u64()), (Some(7240), Some(1086)), "{json}");
        let v2 = Config::parse(&bed.config_text(&[file_ring, added]), "v2").expect("v2");
        let mut comms44: Vec<RingCommunicator> = (0..4).map(|h| bed.open(h, &v2, 44)).collect();
        for (i, op) in OPS.into_iter().enumerate() {
            allreduce_members(comms44.iter_mut().collect(), added, op, 10 + i, weights).unwrap_or_else(|e| panic!("{e}\n{}", bed.counters(44)));
        }
        // Two more rounds: ring 44's region holds results of rounds up to 7.
        for salt in [20, 21] {
            allreduce_members(comms44.iter_mut().collect(), added, Op::Sum, salt, weights).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(comms44[0].round().0, 7);
        ring40_goes_on(before, "after ring 44 was added");
        let entries44 = ring_entries::ring_entries(&bed.pin_dir(2), 1, 44, 7404);
        assert!(entries44.port == 1 && entries44.index == 1 && entries44.job == 1 && entries44.members == 4 && entries44.stats == 1, "{entries44:?}");
        std::thread::sleep(Duration::from_millis(200)); // the service publishes every 50 ms
        assert!(bed.nodes[3].status().ring_service.get(&44).is_some_and(|s| s.kicks == 7), "ring 44's service counted its calls");

        // 2. Ring 44 removed: every entry of it goes, on every member.
        drop(comms44);
        let before = calls.load(Ordering::Relaxed);
        for (h, (ok, out)) in bed.reload(&[file_ring]).into_iter().enumerate() {
            assert!(ok && out.contains("rings added: none; changed: none; removed: 44"), "member {h}: removing ring 44: {out}");
        }
        for h in 0..4 {
            let left = ring_entries::ring_entries(&bed.pin_dir(h), 1, 44, 7404);
            assert_eq!(left.total(), 0, "member {h}: ring 44's entries left: {left:?}");
            assert_eq!(ring_entries::live_rings(&bed.pin_dir(h)), [1, 1, 1], "member {h}: ring 40's port, id and job only");
            let status = bed.nodes[h].status();
            assert!(!status.rings.contains_key(&44) && !status.ring_service.contains_key(&44), "member {h}: ring 44 in status");
            assert_eq!(status.ring_pool.used, 8 * frag, "member {h}: ring 44's memory is free again");
        }
        ring40_goes_on(before, "after ring 44 was removed");

        // 3. Ring 45, another id, port and size: first fit puts it in ring
        // 44's region, at its index, where round 1 of ring 45 would find
        // ring 44's round 6 marks (and take its FINALs for duplicates)
        // unless the region was cleared.
        let before = calls.load(Ordering::Relaxed);
        for (h, (ok, out)) in bed.reload(&[file_ring, other]).into_iter().enumerate() {
            assert!(ok && out.contains("rings added: 45;"), "member {h}: adding ring 45: {out}");
        }
        assert!((0..4).all(|h| place(bed, h, 45) == Some((1, 16))), "ring 45 reuses ring 44's index and region");
        let v3 = Config::parse(&bed.config_text(&[file_ring, other]), "v3").expect("v3");
        let mut comms45: Vec<RingCommunicator> = (0..4).map(|h| bed.open(h, &v3, 45)).collect();
        assert_eq!(comms45[0].round().0, 0, "ring 45 starts at round 1");
        for (i, op) in [Op::Sum, Op::Max, Op::Avg].into_iter().enumerate() {
            allreduce_members(comms45.iter_mut().collect(), other, op, 30 + i, weights).unwrap_or_else(|e| panic!("{e}\n{}", bed.counters(45)));
        }
        ring40_goes_on(before, "after ring 45 was added");

        // 4. Beyond the pool: refused on every member, naming the file, the
        // ring and the numbers; nothing changes.
        let free = bed.nodes[0].status().ring_pool;
        assert_eq!((free.free, free.largest_free), (9 * frag, 9 * frag), "{free:?}");
        for (h, (ok, out)) in bed.reload(&[file_ring, other, too_big]).into_iter().enumerate() {
            let file = bed.nodes[h].pin_root.with_extension("toml").display().to_string();
            assert!(!ok, "member {h}: a ring beyond the pool must be refused: {out}");
            assert!(
                out.contains(&file)
                    && out.contains("ring 46 (ring[2]) asks 5068 elements (14 fragments of 362)")
                    && out.contains(&format!("{} free", 9 * frag))
                    && out.contains("nothing was changed"),
                "member {h}: {out}"
            );
        }
        for h in 0..4 {
            assert_eq!(ring_entries::live_rings(&bed.pin_dir(h)), [2, 2, 2], "member {h}: rings 40 and 45, nothing of 46");
            assert_eq!(place(bed, h, 46), None);
            let status = bed.nodes[h].status();
            assert_eq!(status.ring_pool, free, "member {h}: the pool as before");
            assert!(!status.attach.last_reload.as_ref().expect("last reload").ok);
        }
        allreduce_members(comms45.iter_mut().collect(), other, Op::Min, 40, weights).unwrap_or_else(|e| panic!("{e}"));
        let before = calls.load(Ordering::Relaxed);
        ring40_goes_on(before, "after the refused reload");

        stop.store(true, Ordering::Relaxed);
        let comms40 = loop40.join().expect("ring 40's loop").unwrap_or_else(|e| panic!("ring 40: {e}\n{}", bed.counters(40)));
        let total = calls.load(Ordering::Relaxed);
        eprintln!("ring 40: {total} calls across the reloads, the last round {}", comms40[0].round().0);
        assert!(total >= 8, "ring 40's calls ran across the reloads: {total}");
    });
}
