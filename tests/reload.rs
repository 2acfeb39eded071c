//! Reloading a live node's config (`aggbox reload eth0`, SIGHUP to `aggbox
//! attach`) while one job's calls run: that job is never disturbed.
//!
//! Host 0 runs `aggbox attach eth0` with two node-served jobs, A and B;
//! hosts 1..=3 are the workers of both. While every worker allreduces job
//! A's vectors in a loop (each result checked against the reference), the
//! test rewrites the config file and reloads it:
//! 1. B removed, C added: C's allreduce completes exactly; B's result port
//!    is free again and B's contributions pass the XDP program untouched;
//! 2. C changed (its round window): C's allreduce completes again;
//! 3. a `[node]` change, a `[[ring]]` on a node that reserved no ring
//!    memory (`[node] ring_pool`), and a file that does not parse are
//!    refused with the key (and line), or the ring and its numbers, named,
//!    and change nothing.
//!
//! Job A's calls went on across every reload, each exact, none failed, and
//! its kernel counters were never reset.
//!
//! Needs root; fails (never skips) otherwise: `sudo -E cargo test --test reload`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use aggbox::runtime::Collective;
use aggbox::config::Config;
use aggbox::runtime::{BackendKind, Communicator, CommunicatorBuilder, Participant};
use aggbox::wire::abi::{Op, Round};
use aggbox::wire::proto::{self, AggHeader};
use aggbox::wire::reducer;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 3;
const A: u16 = 11;
const B: u16 = 12;
const C: u16 = 13;
const METRICS_PORT: u16 = 9481;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/reload.rs needs root (network namespaces, XDP, TC): `sudo -E cargo test --test reload`"
    );
}

/// A node-served job `id` (port 7000 + 10·(id − 10), result port one above,
/// group `id`, worker data ports 7700 + 10·(id − 10)) with round window
/// `window`.
fn job_text(id: u16, workers: &[Ipv4Addr], window: u32) -> String {
    let port = 7000 + 10 * (id - 10);
    let data = 7700 + 10 * (id - 10);
    let list = |f: &dyn Fn(&Ipv4Addr) -> String| workers.iter().map(f).collect::<Vec<_>>().join(", ");
    format!(
        "[[job]]\nid = {id}\nport = {port}\nworkers = [{}]\nresult_port = {}\nresult_group = {id}\nwindow = {window}\nconsumer = \"node\"\n\n[[group]]\nid = {id}\nmembers = [{}]\n\n",
        list(&|w| format!("\"{w}\"")),
        port + 1,
        list(&|w| format!("\"{w}:{data}\"")),
    )
}

fn config_text(node: &str, jobs: &[(u16, u32)], workers: &[Ipv4Addr]) -> String {
    let mut text = format!("[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\n{node}\n");
    for &(id, window) in jobs {
        text += &job_text(id, workers, window);
    }
    text
}

fn input(rank: usize, len: usize, salt: usize) -> Vec<i32> {
    (0..len).map(|i| ((i * 7 + rank * 1_000_003 + salt * 13) % 20_001) as i32 - 10_000).collect()
}

fn reference(len: usize, salt: usize) -> Vec<i32> {
    let inputs: Vec<Vec<i32>> = (0..WORKERS).map(|r| input(r, len, salt)).collect();
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
    reducer::reduce(Op::Sum, &c).expect("reference").ints().expect("ints").to_vec()
}

/// The communicators of job `id` (from `text`), one per worker host.
fn communicators(tb: &Testbed, text: &str, id: u16, deadline: Duration) -> Vec<Communicator> {
    let config = Config::parse(text, "reload").expect("config");
    let data = 7700 + 10 * (id - 10);
    (0..WORKERS)
        .map(|r| {
            let b = CommunicatorBuilder::from_config(&config, id, tb.host(0).addr, data, Participant::Worker(r as u16))
                .expect("from_config")
                .backend(BackendKind::Kernel)
                .deadline(deadline);
            tb.in_host(r + 1, move || b.build()).expect("netns").expect("build")
        })
        .collect()
}

/// One allreduce of `len` elements on every communicator at once; every
/// result must equal the reference.
fn allreduce_all(comms: &[Communicator], len: usize, salt: usize, what: &str) {
    let want = reference(len, salt);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let mut v = input(r, len, salt);
                    c.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("{what}: worker {r}: {e}"));
                    v
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            assert!(h.join().expect("worker") == want, "{what}: worker {r} differs from the reference");
        }
    });
}

/// `aggbox reload eth0` in the node's namespace: (success, stdout + stderr).
fn reload(tb: &Testbed, attach: &LiveAttach) -> (bool, String) {
    let out = Command::new("ip")
        .args(["netns", "exec", &tb.host(0).netns, env!("CARGO_BIN_EXE_aggbox"), "reload", "eth0", "--pin-root"])
        .arg(&attach.pin_root)
        .output()
        .expect("run aggbox reload");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn job_ids(attach: &LiveAttach) -> Vec<u16> {
    let mut ids: Vec<u16> = attach.status().jobs.iter().map(|j| j.id).collect();
    ids.sort();
    ids
}

/// Contributions job `id` has taken in the kernel so far (absorbed or completing).
fn kernel_contributions(attach: &LiveAttach, id: u16) -> u64 {
    let status = attach.status();
    let job = status.jobs.iter().find(|j| j.id == id).unwrap_or_else(|| panic!("job {id} in status"));
    let c = job.counters.expect("job counters");
    c.accepted + c.results
}

/// Rank 0's contribution to job B, round 1, one fragment of 4 elements.
fn b_contribution() -> Vec<u8> {
    let hdr = AggHeader {
        job: B,
        rank: 0,
        seq: 1,
        round: Round(1),
        frag_off: 0,
        op: Op::Sum,
        flags: aggbox::wire::abi::AGG_F_LAST_FRAGMENT,
        count: 4,
    };
    let mut d = Vec::new();
    proto::write_agg_header(&hdr, &mut d);
    proto::write_i32_be(&[1, 2, 3, 4], &mut d);
    d
}

#[test]
fn reloading_jobs_does_not_disturb_another_jobs_calls() {
    require_root();
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let workers: Vec<Ipv4Addr> = (1..=WORKERS).map(|h| tb.host(h).addr).collect();
    let v1 = config_text("", &[(A, 4), (B, 4)], &workers);
    let attach = LiveAttach::start(&tb.host(0).netns, "reload", &v1, &[]);
    let config_path = attach.pin_root.with_extension("toml");
    let a = communicators(&tb, &v1, A, Duration::from_secs(20));
    let b = communicators(&tb, &v1, B, Duration::from_secs(1));
    allreduce_all(&b, 5000, 1, "job B before the reloads");

    let stop = AtomicBool::new(false);
    let a_calls = AtomicU64::new(0);
    /// Ends job A's loop also when an assertion below fails (the scope
    /// waits for its threads before it lets the panic out).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop_on_panic = StopOnDrop(&stop);
        // Job A: every worker allreduces in a loop until the reloads are done.
        let a_loop = s.spawn(|| {
            let mut salt = 100;
            while !stop.load(Ordering::Relaxed) {
                allreduce_all(&a, 20_000, salt, "job A during the reloads");
                a_calls.fetch_add(1, Ordering::Relaxed);
                salt += 1;
            }
        });
        let wait_for_a = |after: u64| {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while a_calls.load(Ordering::Relaxed) < after + 2 {
                assert!(!a_loop.is_finished(), "job A's loop ended (a call failed)");
                assert!(std::time::Instant::now() < deadline, "job A made no progress");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        wait_for_a(0);
        // Job A's kernel and result-service counters, sampled around every
        // reload: a job left alone is never reset, so they only grow.
        let mut a_seen = (0u64, 0u64);
        let mut a_grows = |attach: &LiveAttach, when: &str| {
            let status = attach.status();
            let served = status.served.get(&A).copied().unwrap_or_else(|| panic!("{when}: job A served"));
            let now = (kernel_contributions(attach, A), served.results);
            assert!(now.0 >= a_seen.0 && now.1 >= a_seen.1, "{when}: job A's counters went from {a_seen:?} to {now:?}");
            a_seen = now;
        };
        a_grows(&attach, "before the reloads");

        // 1. B removed, C added.
        let v2 = config_text("", &[(A, 4), (C, 4)], &workers);
        std::fs::write(&config_path, &v2).expect("write v2");
        let calls = a_calls.load(Ordering::Relaxed);
        let (ok, out) = reload(&tb, &attach);
        assert!(ok, "reload v2: {out}");
        a_grows(&attach, "after reload v2");
        assert!(out.contains("added: 13;") && out.contains("removed: 12;") && out.contains("unchanged: 11;"), "{out}");
        assert_eq!(job_ids(&attach), vec![A, C]);
        let c = communicators(&tb, &v2, C, Duration::from_secs(10));
        allreduce_all(&c, 5000, 2, "job C after it was added");
        // B's result port is the service's no more; B's datagrams are unknown.
        testbed::in_netns(&tb.host(0).netns, || UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7021)))
            .expect("netns")
            .expect("job B's result port is free after its removal");
        // B's port is no aggregation port any more: a contribution of B
        // passes the XDP program to the stack untouched.
        let sink = testbed::in_netns(&tb.host(0).netns, || UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7020)))
            .expect("netns")
            .expect("bind job B's old port");
        sink.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let contribution = b_contribution();
        let node = tb.host(0).addr;
        testbed::in_netns(&tb.host(1).netns, || {
            let s = UdpSocket::bind(SocketAddrV4::new(workers[0], 0)).expect("bind rank 0");
            s.send_to(&contribution, SocketAddrV4::new(node, 7020)).expect("send")
        })
        .expect("netns");
        let mut buf = [0u8; 2048];
        let (n, _) = sink.recv_from(&mut buf).expect("job B's contribution reaches the stack");
        assert_eq!(&buf[..n], &contribution[..], "passed untouched");
        let mut v = input(0, 100, 3);
        b[0].allreduce(&mut v, Op::Sum).expect_err("job B is gone");
        wait_for_a(calls);

        // 2. C changed: a wider round window.
        let v3 = config_text("", &[(A, 4), (C, 8)], &workers);
        std::fs::write(&config_path, &v3).expect("write v3");
        let calls = a_calls.load(Ordering::Relaxed);
        let (ok, out) = reload(&tb, &attach);
        assert!(ok, "reload v3: {out}");
        a_grows(&attach, "after reload v3");
        assert!(out.contains("changed: 13;") && out.contains("unchanged: 11;"), "{out}");
        allreduce_all(&c, 5000, 4, "job C after its change");
        wait_for_a(calls);

        // 3. Refused: a [node] change, then a file that does not parse.
        let v4 = config_text("ack_group = 64", &[(A, 4), (C, 8)], &workers);
        std::fs::write(&config_path, &v4).expect("write v4");
        let (ok, out) = reload(&tb, &attach);
        assert!(!ok, "a [node] change must be refused: {out}");
        assert!(out.contains("[node] ack_group changed") && out.contains("nothing was changed"), "{out}");
        // A ring on a node that reserved no ring memory at attach: refused
        // with the numbers; and the reservation is the attach's.
        let ring = format!("[[ring]]\nid = 50\nport = 7500\nmembers = [\"{}\", \"{}\"]\nvector_len = 1000\n", tb.host(0).addr, workers[0]);
        std::fs::write(&config_path, format!("{v3}{ring}")).expect("write v3 with a ring");
        let (ok, out) = reload(&tb, &attach);
        assert!(!ok, "a ring beyond the ring memory must be refused: {out}");
        assert!(
            out.contains(&config_path.display().to_string())
                && out.contains("ring 50 (ring[0]) asks 1086 elements (3 fragments of 362) but the ring pool has 0 free")
                && out.contains("nothing was changed"),
            "names file, ring and numbers: {out}"
        );
        assert!(attach.status().rings.is_empty(), "no ring was written");
        std::fs::write(&config_path, config_text("ring_pool = 100000", &[(A, 4), (C, 8)], &workers)).expect("write v3 with a pool");
        let (ok, out) = reload(&tb, &attach);
        assert!(!ok && out.contains("[node] ring_pool changed") && out.contains("restart `aggbox attach`"), "{out}");
        let v5 = v3.replace("window = 8", "window = \"wide\"");
        std::fs::write(&config_path, &v5).expect("write v5");
        let (ok, out) = reload(&tb, &attach);
        assert!(!ok, "a bad file must be refused: {out}");
        assert!(out.contains("window") && out.contains(&config_path.display().to_string()), "names file and key: {out}");
        assert_eq!(job_ids(&attach), vec![A, C], "a refused reload changes nothing");
        let status = attach.status();
        assert_eq!(status.attach.reloads, 6);
        assert!(!status.attach.last_reload.expect("last reload").ok);
        allreduce_all(&c, 5000, 5, "job C after the refused reloads");
        let calls = a_calls.load(Ordering::Relaxed);
        wait_for_a(calls);

        stop.store(true, Ordering::Relaxed);
        a_loop.join().expect("job A's calls never failed");
        a_grows(&attach, "at the end");
        assert!(a_seen.0 > 0 && a_seen.1 > 0, "job A was counted: {a_seen:?}");
    });
    let total = a_calls.load(Ordering::Relaxed);
    assert!(total >= 8, "job A's calls ran across the reloads: {total}");
}
