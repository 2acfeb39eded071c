//! Lifecycle churn of the `aggbox` binary (docs/ROBUSTNESS.md), driven like
//! tests/cli_lifecycle.rs in a testbed namespace with a private pin root and
//! a config with a `[[job]]` and a `[[group]]` (so XDP, the TC programs and
//! the user-space path are all attached):
//!
//! - attach / SIGINT-detach N times (CI: 100, as the issue asks; ~0.63 s a cycle in a debug
//!   build; `AGGBOX_CHURN_CYCLES=N`; soak: `AGGBOX_SOAK=1` runs 1000), each
//!   cycle timed;
//! - `kill -9` then a new attach over the stale pins, several times, then
//!   `aggbox detach`;
//! - SIGINT while a sender thread blasts contributions at the job port, and
//!   `aggbox detach` (force) while the daemon runs under traffic;
//!
//! and after everything: every program and link id seen attached in any
//! cycle is freed, and so is every map of those programs (map ids are only
//! *walked*, never opened, and only once everything has finished: opening a
//! prog_array by id during teardown leaks it, see cli_lifecycle.rs), no XDP
//! on eth0 or lo, no clsact qdisc and no filters on eth0, the pin root is
//! empty, and the interface passes normal UDP and AGG1 traffic to a socket.
//!
//! Needs root: `sudo -E cargo test --test churn -- --nocapture`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_netns;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::testbed::{Testbed, TestbedConfig};
use common_netns::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_aggbox");
const PORT: u16 = 7000;

struct Bed {
    work: TempDir,
    pins: Bpffs,
    tb: Testbed,
    config: PathBuf,
}

impl Bed {
    fn up() -> Bed {
        require_root();
        let tb = Testbed::up(TestbedConfig {
            hosts: 2,
            static_neigh: true,
            ..Default::default()
        })
        .expect("testbed");
        let work = TempDir::new("churn-work");
        let h1 = tb.host(1).addr;
        let text = format!(
            "[node]\nmetrics = \"off\"\n\n[[job]]\nid = 7\nport = {PORT}\nworkers = [\"{h1}\"]\nresult_port = 7001\nvector_len = 1000\n\n\
             [[group]]\nid = 3\nmembers = [\"{h1}:7200\"]\n"
        );
        let config = work.file("churn.toml");
        std::fs::write(&config, text).expect("config");
        Bed {
            work,
            pins: Bpffs::mount("churn-pins").expect("mounting a private bpffs"),
            tb,
            config,
        }
    }

    fn ns(&self) -> String {
        self.tb.host(0).netns
    }

    fn pin_root(&self) -> &str {
        self.pins.path.to_str().expect("utf-8")
    }

    fn spawn_attach(&self, name: &str) -> Daemon {
        let out = self.work.file(&format!("{name}.out"));
        let err = self.work.file(&format!("{name}.err"));
        let args = [BIN, "attach", "eth0", "--pin-root", self.pin_root(), "--config", self.config.to_str().unwrap()];
        let child = self
            .tb
            .command_in(0, &args)
            .expect("command")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout"))
            .stderr(std::fs::File::create(&err).expect("stderr"))
            .spawn()
            .expect("spawn aggbox attach");
        Daemon { child: Some(child), out, err }
    }

    fn attach(&self, name: &str) -> Daemon {
        let mut d = self.spawn_attach(name);
        d.wait_attached();
        d
    }

    fn detach_cli(&self) {
        let out = self.tb.run_in(0, &[BIN, "detach", "eth0", "--pin-root", self.pin_root()]).expect("aggbox detach");
        assert!(out.status.success(), "aggbox detach: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Program ids this attachment runs: XDP on eth0 (and lo), TC filters.
    fn attached_progs(&self) -> BTreeSet<u64> {
        let ns = self.ns();
        let mut ids = BTreeSet::new();
        for iface in ["eth0", "lo"] {
            let text = link_show(&ns, iface);
            if let Some(at) = text.find("prog/xdp id ") {
                if let Some(id) = text[at + 12..].split_whitespace().next().and_then(|s| s.parse().ok()) {
                    ids.insert(id);
                }
            }
        }
        for dir in ["egress", "ingress"] {
            let text = self.tc(&["filter", "show", "dev", "eth0", dir]);
            for part in text.split(" id ").skip(1) {
                if let Some(id) = part.split_whitespace().next().and_then(|s| s.parse().ok()) {
                    ids.insert(id);
                }
            }
        }
        ids
    }

    fn tc(&self, args: &[&str]) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.ns(), "tc"]).args(args).output().expect("tc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Everything is back to normal on the interface and in the pin root.
    fn assert_interface_clean(&self) {
        let ns = self.ns();
        assert!(!has_xdp(&ns, "eth0"), "no XDP on eth0:\n{}", link_show(&ns, "eth0"));
        assert!(!has_xdp(&ns, "lo"), "no XDP on lo");
        let q = self.tc(&["qdisc", "show", "dev", "eth0"]);
        assert!(!q.contains("clsact"), "clsact qdisc left on eth0:\n{q}");
        for dir in ["egress", "ingress"] {
            let f = self.tc(&["filter", "show", "dev", "eth0", dir]);
            assert!(f.trim().is_empty(), "{dir} filters left on eth0:\n{f}");
        }
        assert_eq!(dir_entries(&self.pins.path), Vec::<String>::new(), "pin root empty");
    }

    /// Plain UDP and an AGG1 datagram reach a normal socket on host 0.
    fn assert_udp_passes(&self) {
        let rx = self.tb.in_host(0, || UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PORT))).expect("netns").expect("bind");
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let h1 = self.tb.host(1);
        let tx = bind_in(&self.tb, 1, h1.addr);
        let to = SocketAddrV4::new(self.tb.host(0).addr, PORT);
        let agg1 = contribution(0, 1);
        for payload in [&b"plain udp after churn"[..], &agg1[..]] {
            tx.send_to(payload, to).expect("send");
            let mut buf = [0u8; 2048];
            let (n, from) = rx.recv_from(&mut buf).unwrap_or_else(|e| panic!("UDP after churn did not arrive: {e}"));
            assert_eq!((&buf[..n], from.ip()), (payload, std::net::IpAddr::V4(h1.addr)));
        }
    }
}

fn contribution(seq: u32, round: u32) -> Vec<u8> {
    let hdr = aggbox::wire::proto::AggHeader {
        job: 7,
        rank: 0,
        seq,
        round: aggbox::wire::abi::Round(round),
        frag_off: 0,
        op: aggbox::wire::abi::Op::Sum,
        flags: 0,
        count: 100,
    };
    let mut b = Vec::new();
    aggbox::wire::proto::encode_agg_into(&hdr, &[1; 100], &mut b).expect("encode");
    b
}

struct Daemon {
    child: Option<Child>,
    out: PathBuf,
    err: PathBuf,
}

impl Daemon {
    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }
    fn read(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap_or_default()
    }
    fn wait_attached(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !Daemon::read(&self.out).contains("aggbox: attached to eth0") {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("attach exited ({st}):\n{}", Daemon::read(&self.err));
            }
            assert!(Instant::now() < deadline, "attach did not come up:\n{}", Daemon::read(&self.err));
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.pid()), sig).expect("kill");
    }
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return st;
            }
            assert!(Instant::now() < deadline, "attach did not exit:\n{}", Daemon::read(&self.err));
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn walk(next_id: unsafe extern "C" fn(u32, *mut u32) -> libc::c_int) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    let mut id = 0u32;
    loop {
        let mut next = 0u32;
        // SAFETY: plain syscall wrapper writing one u32.
        if unsafe { next_id(id, &mut next) } != 0 {
            return out;
        }
        out.insert(u64::from(next));
        id = next;
    }
}

/// Map ids and link-or-not of program `id` (opening a program is harmless).
fn prog_maps(id: u64) -> Option<BTreeSet<u64>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id as u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut maps = vec![0u32; 64];
    // SAFETY: zeroed info is valid; map_ids points at a live buffer.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = maps.len() as u32;
    info.map_ids = maps.as_mut_ptr() as u64;
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: valid fd and buffer.
    if unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) } != 0 {
        return None;
    }
    let n = (info.nr_map_ids as usize).min(maps.len());
    Some(maps[..n].iter().map(|&m| u64::from(m)).collect())
}

fn link_prog(id: u64) -> Option<u64> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_link_get_fd_by_id(id as u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed info is valid.
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: valid fd and buffer.
    if unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) } != 0 {
        return None;
    }
    Some(u64::from(info.prog_id))
}

/// What the attachments made, collected while they were attached.
#[derive(Default, Debug)]
struct Seen {
    progs: BTreeSet<u64>,
    maps: BTreeSet<u64>,
    links: BTreeSet<u64>,
}

impl Seen {
    fn record(&mut self, bed: &Bed) {
        let progs = bed.attached_progs();
        assert!(progs.len() >= 3, "XDP entry + TC egress + ingress attached: {progs:?}");
        for &p in &progs {
            if let Some(maps) = prog_maps(p) {
                self.maps.extend(maps);
            }
        }
        // Links of the attached programs (XDP links on eth0 and maybe lo).
        for l in walk(libbpf_sys::bpf_link_get_next_id) {
            if link_prog(l).is_some_and(|p| progs.contains(&p)) {
                self.links.insert(l);
            }
        }
        self.progs.extend(progs);
    }

    fn assert_gone(&self) {
        let alive = || {
            (
                &walk(libbpf_sys::bpf_prog_get_next_id) & &self.progs,
                &walk(libbpf_sys::bpf_map_get_next_id) & &self.maps,
                &walk(libbpf_sys::bpf_link_get_next_id) & &self.links,
            )
        };
        wait_until(Duration::from_secs(15), || {
            let (p, m, l) = alive();
            p.is_empty() && m.is_empty() && l.is_empty()
        });
        let (p, m, l) = alive();
        assert!(
            p.is_empty() && m.is_empty() && l.is_empty(),
            "leaked after churn: programs {p:?}, maps {m:?}, links {l:?} (of {} programs, {} maps, {} links seen)",
            self.progs.len(),
            self.maps.len(),
            self.links.len()
        );
    }
}

fn cycles() -> usize {
    if let Some(n) = std::env::var("AGGBOX_CHURN_CYCLES").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    if std::env::var("AGGBOX_SOAK").is_ok_and(|v| v == "1") {
        1000
    } else {
        100
    }
}

#[test]
fn attach_detach_churn_kill9_and_detach_under_traffic_leak_nothing() {
    let bed = Bed::up();
    let mut seen = Seen::default();
    let t_all = Instant::now();

    // 1. attach / SIGINT N times.
    let n = cycles();
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let mut d = bed.attach(&format!("cycle{}", i % 4));
        let up = t.elapsed();
        if i % 10 == 0 {
            seen.record(&bed);
        } else {
            seen.progs.extend(bed.attached_progs());
        }
        d.signal(Signal::SIGINT);
        let st = d.wait_exit();
        assert!(st.success(), "cycle {i}: SIGINT exit {st}: {}", Daemon::read(&d.err));
        times.push((up, t.elapsed()));
        assert!(!has_xdp(&bed.ns(), "eth0"), "cycle {i}: detached");
    }
    let mut totals: Vec<Duration> = times.iter().map(|t| t.1).collect();
    totals.sort();
    let ups: Vec<Duration> = {
        let mut v: Vec<Duration> = times.iter().map(|t| t.0).collect();
        v.sort();
        v
    };
    if n > 0 {
        eprintln!(
            "churn: {n} attach/detach cycles in {:.1} s; cycle p50 {:?} p90 {:?} max {:?}; attach p50 {:?}",
            t_all.elapsed().as_secs_f64(),
            totals[n / 2],
            totals[n * 9 / 10],
            totals[n - 1],
            ups[n / 2]
        );
    }
    bed.assert_interface_clean();

    // 2. kill -9, then attach over the stale pins (3 times), then detach.
    let mut d = bed.attach("k0");
    seen.record(&bed);
    for i in 1..=3 {
        d.signal(Signal::SIGKILL);
        d.wait_exit();
        assert!(has_xdp(&bed.ns(), "eth0"), "still attached after kill -9");
        d = bed.attach(&format!("k{i}"));
        assert!(Daemon::read(&d.err).contains("replaced stale AggBox state"), "stale state replaced: {}", Daemon::read(&d.err));
        seen.record(&bed);
    }
    d.signal(Signal::SIGKILL);
    d.wait_exit();
    bed.detach_cli();
    bed.assert_interface_clean();

    // 3. SIGINT while a sender blasts contributions; then a forced
    //    `aggbox detach` while the daemon runs under traffic.
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let tx = bind_in(&bed.tb, 1, bed.tb.host(1).addr);
    let to = SocketAddrV4::new(bed.tb.host(0).addr, PORT);
    std::thread::scope(|s| {
        let (tx, stop, sent) = (&tx, &stop, &sent);
        s.spawn(move || {
            let mut seq = 0u32;
            while !stop.load(Ordering::Relaxed) {
                seq = seq.wrapping_add(1);
                // rounds advance: slots complete (1 worker) and results flow
                let _ = tx.send_to(&contribution(seq, seq), to);
                sent.fetch_add(1, Ordering::Relaxed);
            }
        });
        for i in 0..5 {
            let mut d = bed.attach(&format!("t{i}"));
            seen.record(&bed);
            std::thread::sleep(Duration::from_millis(100));
            if i % 2 == 0 {
                d.signal(Signal::SIGINT);
                let st = d.wait_exit();
                assert!(st.success(), "SIGINT under traffic: {st}: {}", Daemon::read(&d.err));
            } else {
                // Force-detach from outside while the daemon serves traffic,
                // then stop the daemon: it must exit cleanly too.
                bed.detach_cli();
                assert!(!has_xdp(&bed.ns(), "eth0"), "detach under traffic removed XDP");
                d.signal(Signal::SIGINT);
                let st = d.wait_exit();
                assert!(st.code().is_some(), "daemon exits after an external detach: {st}: {}", Daemon::read(&d.err));
            }
            bed.assert_interface_clean();
        }
        stop.store(true, Ordering::Relaxed);
    });
    eprintln!("churn: {} contributions sent during the traffic phase", sent.load(Ordering::Relaxed));

    // 4. Nothing leaked; the interface is normal.
    bed.assert_interface_clean();
    seen.assert_gone();
    bed.assert_udp_passes();
    eprintln!(
        "churn: {} programs, {} maps, {} links seen attached, all freed; total {:.1} s",
        seen.progs.len(),
        seen.maps.len(),
        seen.links.len(),
        t_all.elapsed().as_secs_f64()
    );
}
