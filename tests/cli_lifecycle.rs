//! The `aggbox` binary's attach lifecycle, driven as an operator would drive
//! it: `ip netns exec HOST aggbox attach eth0 ...` in a testbed namespace with
//! a private pin root (a bpffs mounted on a scratch directory, unmounted at the
//! end), traffic from `aggbox contribute` on the sender hosts, `aggbox listen`
//! as the application, `aggbox status`, SIGINT, `kill -9`, `aggbox detach`,
//! and the failure paths. Leaks are checked with `ip link` and `bpftool`: the
//! ids of the programs, maps and links this test's attach created must be gone
//! afterwards.
//!
//! Needs root: `sudo -E cargo test --test cli_lifecycle`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod common_netns;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use crate::testbed::{Testbed, TestbedConfig};
use common_netns::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_aggbox");
const JOB: u16 = 7;
const PORT: u16 = 7000;
const RESULT_PORT: u16 = 7001;
const ELEMENTS: u32 = 1000; // 3 fragments at MTU 1500
const UP_TIMEOUT: Duration = Duration::from_secs(20);
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// A testbed of one aggregator (host 0) and `senders` sender hosts, a private
/// pin root and a scratch directory. Field order = drop order: the scratch
/// directory and pins go before the testbed.
struct Bed {
    work: TempDir,
    pins: Bpffs,
    tb: Testbed,
}

impl Bed {
    fn up(senders: usize) -> Bed {
        require_root();
        let tb = Testbed::up(TestbedConfig {
            hosts: senders + 1,
            static_neigh: true,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("building the testbed: {e}"));
        Bed {
            work: TempDir::new("cli-work"),
            pins: Bpffs::mount("cli-pins").expect("mounting a private bpffs"),
            tb,
        }
    }

    fn agg_ns(&self) -> String {
        self.tb.host(0).netns
    }

    fn agg_addr(&self) -> Ipv4Addr {
        self.tb.host(0).addr
    }

    fn pin_root(&self) -> &str {
        self.pins.path.to_str().expect("utf-8 path")
    }

    fn iface_pins(&self) -> PathBuf {
        self.pins.path.join("eth0")
    }

    /// Write the config of job 7 with `workers` and return its path.
    fn config(&self, name: &str, workers: &[Ipv4Addr]) -> PathBuf {
        let text = config_text(&[JobSpec {
            id: JOB,
            port: PORT,
            result_port: RESULT_PORT,
            workers: workers.to_vec(),
            weights: vec![],
            vector_len: Some(ELEMENTS),
        }]);
        let path = self.work.file(name);
        std::fs::write(&path, text).expect("writing the config");
        path
    }

    /// The sender hosts' main addresses (ranks 0..).
    fn sender_addrs(&self) -> Vec<Ipv4Addr> {
        (1..self.tb.len()).map(|i| self.tb.host(i).addr).collect()
    }

    /// `aggbox ARGS` in host `host`, waited for.
    fn aggbox(&self, host: usize, args: &[&str]) -> Output {
        let mut cmd = vec![BIN];
        cmd.extend_from_slice(args);
        self.tb
            .run_in(host, &cmd)
            .unwrap_or_else(|e| panic!("running aggbox {args:?}: {e}"))
    }

    /// Start `aggbox attach eth0` in host 0 (stdout and stderr to files).
    fn spawn_attach(&self, name: &str, config: Option<&Path>) -> Daemon {
        let out = self.work.file(&format!("{name}.out"));
        let err = self.work.file(&format!("{name}.err"));
        let mut args = vec![BIN, "attach", "eth0", "--pin-root", self.pin_root()];
        let config_s;
        if let Some(c) = config {
            config_s = c.to_str().expect("utf-8 path").to_string();
            args.extend(["--config", config_s.as_str()]);
        }
        let child = self
            .tb
            .command_in(0, &args)
            .expect("command")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("starting aggbox attach: {e}"));
        Daemon {
            child: Some(child),
            out,
            err,
        }
    }

    /// Start attach and wait for `aggbox: attached to eth0` on stdout.
    fn attach(&self, name: &str, config: Option<&Path>) -> Daemon {
        let mut d = self.spawn_attach(name, config);
        d.wait_attached();
        d
    }

    /// Send job 7's test pattern from every sender (rank i = sender host i+1)
    /// with `aggbox contribute`, and check with `aggbox listen` on the
    /// aggregator that the result equals the reference reducer's.
    fn traffic_exact(&self, round: u32) {
        let senders = self.tb.len() - 1;
        let elements = ELEMENTS.to_string();
        let workers = senders.to_string();
        let mut listen_cmd = vec![
            BIN,
            "listen",
            "--port",
            "7001",
            "--job",
            "7",
            "--elements",
            &elements,
        ];
        listen_cmd.extend(["--workers", &workers, "--op", "sum", "--timeout", "10"]);
        let listen = self
            .tb
            .command_in(0, &listen_cmd)
            .expect("command")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting aggbox listen: {e}"));
        let mut listen = Reaped(Some(listen));
        let ns = self.agg_ns();
        assert!(
            wait_until(Duration::from_secs(10), || udp_port_bound(&ns, RESULT_PORT)),
            "aggbox listen did not bind UDP {RESULT_PORT}"
        );
        let to = format!("{}:{PORT}", self.agg_addr());
        let round_s = round.to_string();
        for i in 0..senders {
            let rank = i.to_string();
            let out = self.aggbox(
                i + 1,
                &[
                    "contribute",
                    "--to",
                    &to,
                    "--job",
                    "7",
                    "--rank",
                    &rank,
                    "--round",
                    &round_s,
                    "--op",
                    "sum",
                    "--elements",
                    &elements,
                ],
            );
            assert!(
                out.status.success(),
                "aggbox contribute (rank {rank}): {}",
                text(&out)
            );
        }
        let out = listen
            .0
            .take()
            .expect("child")
            .wait_with_output()
            .expect("waiting for aggbox listen");
        assert!(
            out.status.success()
                && String::from_utf8_lossy(&out.stdout)
                    .contains("elements equal the reference reducer's result"),
            "aggbox listen got the exact result: {}",
            text(&out)
        );
    }

    /// `aggbox status eth0 --json` in host 0, parsed (the one interface's object).
    fn status_json(&self) -> Value {
        let out = self.aggbox(
            0,
            &["status", "eth0", "--json", "--pin-root", self.pin_root()],
        );
        assert!(out.status.success(), "aggbox status --json: {}", text(&out));
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status --json is JSON ({e}): {}", text(&out)));
        let arr = v
            .as_array()
            .unwrap_or_else(|| panic!("status --json is an array: {v}"));
        assert_eq!(arr.len(), 1, "one interface attached: {v}");
        arr[0].clone()
    }

    /// After the attachment is gone: no pins, no XDP on eth0 or lo, the
    /// programs / maps / links it made are freed, normal UDP passes.
    fn assert_clean(&self, objects: &BpfObjects) {
        assert!(
            !self.iface_pins().exists(),
            "pins left: {:?}",
            dir_entries(&self.iface_pins())
        );
        assert_eq!(
            dir_entries(&self.pins.path),
            Vec::<String>::new(),
            "pin root empty"
        );
        let ns = self.agg_ns();
        assert!(
            !has_xdp(&ns, "eth0"),
            "no XDP left on eth0:\n{}",
            link_show(&ns, "eth0")
        );
        assert!(
            !has_xdp(&ns, "lo"),
            "no XDP left on lo:\n{}",
            link_show(&ns, "lo")
        );
        objects.assert_gone();
        self.assert_udp_passes();
    }

    /// Plain UDP and an AGG1 contribution to the job port reach a normal
    /// socket on the aggregator (the interface is back to normal).
    fn assert_udp_passes(&self) {
        let rx = self
            .tb
            .in_host(0, || {
                UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PORT))
            })
            .expect("netns")
            .expect("bind job port");
        rx.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let h1 = self.tb.host(1);
        let tx = bind_in(&self.tb, 1, h1.addr);
        let to = SocketAddrV4::new(self.agg_addr(), PORT);
        let agg1 = {
            let hdr = aggbox::wire::proto::AggHeader {
                job: JOB,
                rank: 0,
                seq: 0,
                round: aggbox::wire::abi::Round(1),
                frag_off: 0,
                op: aggbox::wire::abi::Op::Sum,
                flags: 0,
                count: 1,
            };
            let mut b = Vec::new();
            aggbox::wire::proto::encode_agg_into(&hdr, &[5], &mut b).expect("encode");
            b
        };
        for payload in [&b"plain udp after detach"[..], &agg1[..]] {
            tx.send_to(payload, to).expect("send");
            let mut buf = [0u8; 2048];
            let (n, from) = rx
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("UDP to {to} after detach did not arrive: {e}"));
            assert_eq!(
                (&buf[..n], from.ip()),
                (payload, std::net::IpAddr::V4(h1.addr)),
                "UDP passes unchanged"
            );
        }
    }
}

/// A child reaped (killed by pid, waited) when dropped.
struct Reaped(Option<Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A running `aggbox attach`; killed (SIGKILL, by pid) and reaped if dropped.
struct Daemon {
    child: Option<Child>,
    out: PathBuf,
    err: PathBuf,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn wait_attached(&mut self) {
        let deadline = Instant::now() + UP_TIMEOUT;
        loop {
            if self.stdout().contains("aggbox: attached to eth0") {
                break;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .expect("running")
                .try_wait()
                .expect("try_wait")
            {
                panic!(
                    "aggbox attach exited ({status}) before attaching:\nstdout: {}\nstderr: {}",
                    self.stdout(),
                    self.stderr()
                );
            }
            assert!(
                Instant::now() < deadline,
                "aggbox attach did not attach within {UP_TIMEOUT:?}:\nstderr: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // `ip netns exec` execs the command: the child is aggbox itself, so
        // signals sent to it reach aggbox.
        let comm =
            std::fs::read_to_string(format!("/proc/{}/comm", self.pid())).unwrap_or_default();
        assert_eq!(
            comm.trim(),
            "aggbox",
            "the attach child is the aggbox process"
        );
    }

    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.pid() as i32), sig)
            .unwrap_or_else(|e| panic!("kill -{sig} {}: {e}", self.pid()));
    }

    /// Wait for the process to exit (bounded); returns its status.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        let child = self.child.as_mut().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "aggbox attach did not exit within {EXIT_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
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

fn text(out: &Output) -> String {
    format!(
        "exit {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn udp_port_bound(netns: &str, port: u16) -> bool {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "ss", "-Hlun"])
        .output()
        .expect("ss (iproute2)");
    String::from_utf8_lossy(&out.stdout).lines().any(|l| {
        l.split_whitespace()
            .any(|f| f.ends_with(&format!(":{port}")))
    })
}

/// `bpftool -j ARGS`, parsed. Listing can fail when an object vanishes while
/// bpftool walks the ids (other tests load and free programs concurrently):
/// a few retries.
fn bpftool_json(args: &[&str]) -> Value {
    let mut last = None;
    for _ in 0..5 {
        let out = Command::new("bpftool")
            .arg("-j")
            .args(args)
            .output()
            .expect("run bpftool (it is required)");
        if out.status.success() {
            return serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|e| panic!("bpftool {args:?} JSON: {e}"));
        }
        last = Some(out);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "bpftool {args:?}: {}",
        last.map(|o| text(&o)).unwrap_or_default()
    )
}

/// Id of the XDP program attached to `iface` in `netns`, from `ip link`.
fn xdp_prog_id(netns: &str, iface: &str) -> u64 {
    let text = link_show(netns, iface);
    let at = text
        .find("prog/xdp id ")
        .unwrap_or_else(|| panic!("no XDP program on {iface}:\n{text}"));
    text[at + "prog/xdp id ".len()..]
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .expect("program id")
}

/// Ids given by a BPF_*_GET_NEXT_ID walk (opens nothing).
fn walk_ids(next_id: unsafe extern "C" fn(u32, *mut u32) -> libc::c_int) -> BTreeSet<u64> {
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

/// Every BPF program id in the system.
fn prog_ids_alive() -> BTreeSet<u64> {
    walk_ids(libbpf_sys::bpf_prog_get_next_id)
}

/// Every BPF link id in the system.
fn link_ids_alive() -> BTreeSet<u64> {
    walk_ids(libbpf_sys::bpf_link_get_next_id)
}

/// Every BPF map id in the system.
///
/// Nothing here opens a map (not `bpftool map show`, nor `bpftool prog show`,
/// which opens each program's maps to look for metadata): a prog_array opened
/// by id while its last user reference is going away has its user count
/// raised from 0 and dropped again, and the kernel's `prog_array_map_clear()`
/// then does `bpf_map_inc(); schedule_work()` a second time while the first
/// clear is still queued: `schedule_work` returns false and that reference is
/// never put, so the `progs` array leaks (kernel/bpf/arraymap.c; reproduced on
/// 6.18 by running `bpftool map show` in a loop during `aggbox attach`'s
/// SIGINT teardown: leaked 3 times out of 3). Programs and links are opened by
/// id only while this attachment holds them, which has no such race.
fn map_ids_alive() -> BTreeSet<u64> {
    walk_ids(libbpf_sys::bpf_map_get_next_id)
}

/// Name and map ids of program `id` (opening a program by id is harmless).
fn prog_info(id: u64) -> Option<(String, BTreeSet<u64>)> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id as u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel returned a fresh fd that we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    let mut maps = vec![0u32; 64];
    // SAFETY: zeroed info is valid; map_ids points at a live buffer of nr_map_ids u32s.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = maps.len() as u32;
    info.map_ids = maps.as_mut_ptr() as u64;
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: valid fd; info/len describe a live buffer.
    if unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) } != 0 {
        return None;
    }
    let n = (info.nr_map_ids as usize).min(maps.len());
    let name: String = info
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    Some((name, maps[..n].iter().map(|&m| u64::from(m)).collect()))
}

/// The program a link holds.
fn link_prog(id: u64) -> Option<u64> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_link_get_fd_by_id(id as u32) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel returned a fresh fd that we own.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    // SAFETY: zeroed info is valid.
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: valid fd; info/len describe a live buffer.
    if unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) } != 0 {
        return None;
    }
    Some(u64::from(info.prog_id))
}

/// The kernel objects one attachment made: its programs (the XDP entry
/// program and every program sharing its maps: the tail-call chain), their
/// maps plus the pinned state map, and the XDP links of those programs.
#[derive(Debug)]
struct BpfObjects {
    progs: BTreeSet<u64>,
    maps: BTreeSet<u64>,
    links: BTreeSet<u64>,
}

impl BpfObjects {
    fn of(bed: &Bed) -> BpfObjects {
        let entry = xdp_prog_id(&bed.agg_ns(), "eth0");
        let (name, mut maps) =
            prog_info(entry).unwrap_or_else(|| panic!("program {entry} of eth0 exists"));
        assert_eq!(name, "aggbox_xdp", "eth0 runs aggbox_xdp");
        let progs: BTreeSet<u64> = prog_ids_alive()
            .into_iter()
            .filter(|&id| {
                prog_info(id)
                    .is_some_and(|(n, m)| n.starts_with("aggbox_") && !m.is_disjoint(&maps))
            })
            .collect();
        assert!(
            progs.len() >= 4,
            "the entry program and its tail-call chain: {progs:?}"
        );
        // bpftool agrees (safe while the attachment holds everything).
        let shown = bpftool_json(&["prog", "show", "id", &entry.to_string()]);
        assert_eq!(
            shown.get("name").and_then(Value::as_str),
            Some("aggbox_xdp"),
            "bpftool prog show id {entry}: {shown}"
        );
        let state = bpftool_json(&[
            "map",
            "show",
            "pinned",
            bed.iface_pins().join("state").to_str().expect("utf-8"),
        ]);
        maps.insert(
            state
                .get("id")
                .and_then(Value::as_u64)
                .expect("state map id"),
        );
        let links: BTreeSet<u64> = link_ids_alive()
            .into_iter()
            .filter(|&l| link_prog(l).is_some_and(|p| progs.contains(&p)))
            .collect();
        assert!(!links.is_empty(), "the XDP link exists");
        for l in &links {
            let shown = bpftool_json(&["link", "show", "id", &l.to_string()]);
            assert_eq!(
                shown.get("type").and_then(Value::as_str),
                Some("xdp"),
                "bpftool link show id {l}: {shown}"
            );
        }
        BpfObjects { progs, maps, links }
    }

    /// Ids of these objects that still exist.
    fn alive(&self) -> (BTreeSet<u64>, BTreeSet<u64>, BTreeSet<u64>) {
        (
            &prog_ids_alive() & &self.progs,
            &map_ids_alive() & &self.maps,
            &link_ids_alive() & &self.links,
        )
    }

    /// Every program, map and link is freed (the kernel frees them
    /// asynchronously after the last reference goes: bounded wait), and
    /// bpftool finds none of them.
    fn assert_gone(&self) {
        wait_until(Duration::from_secs(10), || {
            let (p, m, l) = self.alive();
            p.is_empty() && m.is_empty() && l.is_empty()
        });
        let (p, m, l) = self.alive();
        assert!(
            p.is_empty() && m.is_empty() && l.is_empty(),
            "BPF objects of the attachment left behind: programs {p:?}, maps {m:?}, links {l:?} (of {self:?})"
        );
        for (kind, ids) in [
            ("prog", &self.progs),
            ("link", &self.links),
            ("map", &self.maps),
        ] {
            for id in ids {
                let out = Command::new("bpftool")
                    .args([kind, "show", "id", &id.to_string()])
                    .output()
                    .expect("bpftool");
                assert!(
                    !out.status.success(),
                    "bpftool {kind} show id {id} still finds it: {}",
                    text(&out)
                );
            }
        }
    }
}

fn json_u64(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = cur
            .get(*p)
            .unwrap_or_else(|| panic!("status JSON has {path:?}: {v}"));
    }
    cur.as_u64()
        .unwrap_or_else(|| panic!("{path:?} is a number: {v}"))
}

#[test]
fn attach_status_traffic_then_sigint_detaches_everything() {
    let bed = Bed::up(3);
    let config = bed.config("job.toml", &bed.sender_addrs());
    let progs_before = prog_ids_alive();
    let mut d = bed.attach("a", Some(&config));
    assert!(
        d.stdout().lines().any(|l| l == "aggbox: attached to eth0"),
        "the attach line: {}",
        d.stdout()
    );
    assert!(has_xdp(&bed.agg_ns(), "eth0"), "eth0 has XDP");
    assert!(
        !has_xdp(&bed.agg_ns(), "lo"),
        "no local worker: lo untouched"
    );
    let pinned = dir_entries(&bed.iface_pins());
    for name in ["link_xdp", "state", "jobs", "stats", "slots"] {
        assert!(
            pinned.iter().any(|p| p == name),
            "{name} pinned: {pinned:?}"
        );
    }
    let objects = BpfObjects::of(&bed);
    assert!(
        objects.progs.is_disjoint(&progs_before),
        "the attach loaded new programs"
    );

    let before = bed.status_json();
    assert_eq!(before["serving"], Value::Bool(true), "{before}");
    assert_eq!(
        json_u64(&before, &["attach", "pid"]),
        u64::from(d.pid()),
        "{before}"
    );
    assert_eq!(before["jobs"][0]["id"], Value::from(JOB), "{before}");
    assert_eq!(before["jobs"][0]["workers"], Value::from(3), "{before}");
    let accepted0 = json_u64(&before, &["outcomes", "accepted"]);
    let results0 = json_u64(&before, &["outcomes", "result"]);

    bed.traffic_exact(1);

    let after = bed.status_json();
    // 3 ranks × 3 fragments: 2 accepted and 1 completing per fragment.
    assert_eq!(
        json_u64(&after, &["outcomes", "accepted"]) - accepted0,
        6,
        "{after}"
    );
    assert_eq!(
        json_u64(&after, &["outcomes", "result"]) - results0,
        3,
        "{after}"
    );
    let human = bed.aggbox(0, &["status", "eth0", "--pin-root", bed.pin_root()]);
    let h = String::from_utf8_lossy(&human.stdout);
    assert!(human.status.success(), "status: {}", text(&human));
    assert!(
        h.contains(&format!("attached by pid {} (serving)", d.pid())),
        "human status shows the pid: {h}"
    );
    assert!(
        h.contains("job     7") && h.contains("port  7000") && h.contains("results on  7001"),
        "human status shows the job: {h}"
    );
    let accepted_line = h
        .lines()
        .find(|l| l.trim_start().starts_with("accepted"))
        .unwrap_or_else(|| panic!("accepted row: {h}"));
    assert_eq!(
        accepted_line.split_whitespace().last(),
        Some("6"),
        "human status counts the traffic: {h}"
    );

    d.signal(Signal::SIGINT);
    let status = d.wait_exit();
    assert!(
        status.success(),
        "SIGINT: exit 0, got {status}; stderr: {}",
        d.stderr()
    );
    assert!(
        d.stdout().contains("aggbox: detached from eth0"),
        "{}",
        d.stdout()
    );
    bed.assert_clean(&objects);
}

#[test]
fn kill9_then_detach_cleans_up_also_the_lo_link() {
    let bed = Bed::up(2);
    // Rank 0 runs on the aggregator host: attach also puts the program on lo.
    let mut workers = vec![bed.agg_addr()];
    workers.extend(bed.sender_addrs());
    let config = bed.config("job.toml", &workers);
    let mut d = bed.attach("a", Some(&config));
    let ns = bed.agg_ns();
    assert!(
        link_show(&ns, "lo").contains("xdpgeneric"),
        "lo has the program (generic):\n{}",
        link_show(&ns, "lo")
    );
    let objects = BpfObjects::of(&bed);
    assert_eq!(
        objects.links.len(),
        2,
        "two links: eth0 and lo: {objects:?}"
    );

    d.signal(Signal::SIGKILL);
    let status = d.wait_exit();
    assert!(!status.success(), "kill -9: {status}");
    // The pins keep everything attached after the crash.
    assert!(
        has_xdp(&ns, "eth0") && has_xdp(&ns, "lo"),
        "still attached after kill -9"
    );
    let st = bed.status_json();
    assert_eq!(
        st["serving"],
        Value::Bool(false),
        "status sees the attaching process gone: {st}"
    );
    let human = bed.aggbox(0, &["status", "eth0", "--pin-root", bed.pin_root()]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("stale"),
        "human status says stale: {}",
        text(&human)
    );

    let out = bed.aggbox(0, &["detach", "eth0", "--pin-root", bed.pin_root()]);
    assert!(out.status.success(), "aggbox detach: {}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("aggbox: detached from eth0"),
        "{}",
        text(&out)
    );
    bed.assert_clean(&objects);
    // A second detach finds nothing and still succeeds.
    let again = bed.aggbox(0, &["detach", "eth0", "--pin-root", bed.pin_root()]);
    assert!(
        again.status.success()
            && String::from_utf8_lossy(&again.stdout).contains("nothing attached"),
        "{}",
        text(&again)
    );
}

#[test]
fn kill9_then_attach_replaces_stale_state_and_works() {
    let bed = Bed::up(2);
    let config = bed.config("job.toml", &bed.sender_addrs());
    let mut first = bed.attach("first", Some(&config));
    let stale = BpfObjects::of(&bed);
    first.signal(Signal::SIGKILL);
    first.wait_exit();
    assert!(
        has_xdp(&bed.agg_ns(), "eth0"),
        "still attached after kill -9"
    );

    let mut second = bed.attach("second", Some(&config));
    assert!(
        second
            .stderr()
            .contains("warning: replaced stale AggBox state"),
        "the new attach warns that it replaced stale state: {}",
        second.stderr()
    );
    stale.assert_gone();
    let fresh = BpfObjects::of(&bed);
    assert!(
        fresh.progs.is_disjoint(&stale.progs),
        "new programs: {fresh:?} vs {stale:?}"
    );
    bed.traffic_exact(1);
    bed.traffic_exact(2);

    second.signal(Signal::SIGINT);
    assert!(
        second.wait_exit().success(),
        "SIGINT: exit 0; stderr: {}",
        second.stderr()
    );
    bed.assert_clean(&fresh);
}

#[test]
fn second_attach_fails_and_leaves_the_first_working() {
    let bed = Bed::up(2);
    let config = bed.config("job.toml", &bed.sender_addrs());
    let mut first = bed.attach("first", Some(&config));
    let objects = BpfObjects::of(&bed);

    let out = bed.aggbox(
        0,
        &[
            "attach",
            "eth0",
            "--config",
            config.to_str().expect("utf-8"),
            "--pin-root",
            bed.pin_root(),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a second attach fails: {}",
        text(&out)
    );
    assert!(
        err.contains(&format!("eth0 is already attached by pid {}", first.pid())),
        "a clear message naming the first attach's pid: {}",
        text(&out)
    );
    assert_eq!(err.trim().lines().count(), 1, "one line on stderr: {err}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("attached to"),
        "{}",
        text(&out)
    );

    // The first is untouched: same program on eth0, still serving, traffic exact.
    assert_eq!(
        BpfObjects::of(&bed).progs,
        objects.progs,
        "the first attach's programs still run"
    );
    assert_eq!(bed.status_json()["attach"]["pid"], Value::from(first.pid()));
    bed.traffic_exact(1);

    first.signal(Signal::SIGINT);
    assert!(
        first.wait_exit().success(),
        "SIGINT: exit 0; stderr: {}",
        first.stderr()
    );
    bed.assert_clean(&objects);
}

#[test]
fn bad_config_and_missing_interface_fail_cleanly() {
    let bed = Bed::up(1);
    let ns = bed.agg_ns();
    let cases = [
        // (config text, line, key)
        (
            "[node]\nmetrics = \"off\"\n\n[[job]]\nid = 7\nport = 7000\nresult_port = 7001\nworkers = [\"10.77.0.12\", \"10.77.0.300\"]\n",
            8,
            "job[0].workers[1]",
        ),
        ("[node]\nmetrics = \"off\"\n\n[[job]]\nid = 7\nprot = 7000\nresult_port = 7001\nworkers = [\"10.77.0.12\"]\n", 6, "job[0].prot"),
    ];
    for (i, (text_, line, key)) in cases.iter().enumerate() {
        let path = bed.work.file(&format!("bad{i}.toml"));
        std::fs::write(&path, text_).expect("write config");
        let p = path.to_str().expect("utf-8");
        let out = bed.aggbox(
            0,
            &[
                "attach",
                "eth0",
                "--config",
                p,
                "--pin-root",
                bed.pin_root(),
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "bad config {i} fails: {}",
            text(&out)
        );
        assert!(
            err.contains(&format!("{p}:{line}: {key}")),
            "stderr names file:line:key ({p}:{line}: {key}): {}",
            text(&out)
        );
        assert_eq!(err.trim().lines().count(), 1, "one line on stderr: {err}");
        assert!(
            !has_xdp(&ns, "eth0"),
            "bad config leaves eth0 untouched:\n{}",
            link_show(&ns, "eth0")
        );
        assert!(!bed.iface_pins().exists(), "bad config pins nothing");
    }

    let out = bed.aggbox(0, &["attach", "nosuch0", "--pin-root", bed.pin_root()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "attach to a missing interface fails: {}",
        text(&out)
    );
    assert_eq!(
        err.trim(),
        "aggbox: no such interface: nosuch0",
        "{}",
        text(&out)
    );
    assert_eq!(
        dir_entries(&bed.pins.path),
        Vec::<String>::new(),
        "nothing pinned"
    );
    assert!(!has_xdp(&ns, "eth0"));
    bed.assert_udp_passes();
}

/// Rewrite the pinned attach record's `pid` and `pid_start` (the state map
/// holds the record as NUL-padded JSON).
fn rewrite_record(bed: &Bed, pid: u32, pid_start: u64) {
    use libbpf_rs::{MapCore, MapFlags, MapHandle};
    let map = MapHandle::from_pinned_path(bed.iface_pins().join("state")).expect("pinned state map");
    let key = 0u32.to_ne_bytes();
    let raw = map
        .lookup(&key, MapFlags::ANY)
        .expect("lookup")
        .expect("record");
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    let mut record: Value = serde_json::from_slice(&raw[..end]).expect("record JSON");
    record["pid"] = Value::from(pid);
    record["pid_start"] = Value::from(pid_start);
    let mut json = serde_json::to_vec(&record).expect("JSON");
    json.resize(raw.len(), 0);
    map.update(&key, &json, MapFlags::ANY).expect("update");
}

/// Issue #21 item 6: after a crash the recorded PID may belong to another,
/// live process. The record's start time tells them apart: the same PID
/// with its real start time is a live attacher (refused), with another
/// start time it is a reused PID (the state is stale and replaced).
#[test]
fn state_of_a_reused_pid_is_replaced_not_refused() {
    let bed = Bed::up(2);
    let config = bed.config("job.toml", &bed.sender_addrs());
    let mut first = bed.attach("first", Some(&config));
    let stale = BpfObjects::of(&bed);
    first.signal(Signal::SIGKILL);
    first.wait_exit();

    // A live process standing for whoever got the crashed attach's PID.
    let stand_in = Reaped(Some(
        Command::new("sleep")
            .arg("120")
            .stdin(Stdio::null())
            .spawn()
            .expect("sleep"),
    ));
    let pid = stand_in.0.as_ref().expect("child").id();
    let start = aggbox::node::process_start_time(pid).expect("start time of the stand-in");
    let attach_args = [
        "attach",
        "eth0",
        "--config",
        config.to_str().expect("utf-8"),
        "--pin-root",
        bed.pin_root(),
    ];

    // PID and start time of a live process: a live attacher.
    rewrite_record(&bed, pid, start);
    assert_eq!(bed.status_json()["serving"], Value::Bool(true));
    let out = bed.aggbox(0, &attach_args);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr)
                .contains(&format!("eth0 is already attached by pid {pid}")),
        "the state of a live attacher is kept: {}",
        text(&out)
    );

    // The same live PID with another start time: a reused PID.
    rewrite_record(&bed, pid, start + 1);
    let st = bed.status_json();
    assert_eq!(st["serving"], Value::Bool(false), "a reused PID is not serving: {st}");
    let human = bed.aggbox(0, &["status", "eth0", "--pin-root", bed.pin_root()]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("stale"),
        "human status says stale: {}",
        text(&human)
    );
    let mut second = bed.attach("second", Some(&config));
    assert!(
        second.stderr().contains("warning: replaced stale AggBox state"),
        "the attach replaced the stale state: {}",
        second.stderr()
    );
    stale.assert_gone();
    let fresh = BpfObjects::of(&bed);
    bed.traffic_exact(1);
    second.signal(Signal::SIGINT);
    assert!(second.wait_exit().success(), "SIGINT: exit 0; stderr: {}", second.stderr());
    bed.assert_clean(&fresh);
    drop(stand_in);
}

/// `GET /metrics` on 127.0.0.1:`port` inside `netns`, the body.
fn scrape_in(bed: &Bed, port: u16) -> String {
    use std::io::{Read, Write};
    bed.tb
        .in_host(0, move || {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to /metrics");
            stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            write!(stream, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").expect("request");
            let mut response = String::new();
            stream.read_to_string(&mut response).expect("response");
            assert!(response.starts_with("HTTP/1.1 200"), "bad response: {response}");
            response
        })
        .expect("netns")
}

/// Issue #21 item 7: when the user-space (AF_XDP) path cannot start (here:
/// another AF_XDP socket holds eth0's queue 0), ops 5..8 and FLOAT32 would
/// reach the stack unaggregated. Attach fails, leaving eth0 untouched,
/// unless the config chooses `[node] userspace_path = "optional"`; then the
/// missing path shows in `aggbox status` and in `aggbox_userspace_path_up`,
/// and the node still releases stale kernel slots itself (issue #25: that
/// was the AF_XDP worker's job only).
#[test]
fn attach_fails_without_the_userspace_path_unless_optional() {
    use aggbox::kernel::xsk::{XskConfig, XskSocket};
    let bed = Bed::up(2); // two ranks: one contribution alone leaves a fragment unfinished
    let ns = bed.agg_ns();
    let blocker = bed
        .tb
        .in_host(0, || {
            let index = aggbox::node::ifindex("eth0").expect("eth0");
            XskSocket::open(index, 0, XskConfig::default())
        })
        .expect("netns")
        .expect("an AF_XDP socket on eth0 queue 0");

    let config = bed.config("job.toml", &bed.sender_addrs());
    // Spawned, not waited for: an attach that wrongly succeeds would serve
    // until signalled; it is killed (by pid) when `refused` drops.
    let mut refused = bed.spawn_attach("refused", Some(&config));
    let deadline = Instant::now() + UP_TIMEOUT;
    let status = loop {
        if let Some(status) = refused.child.as_mut().expect("child").try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            !refused.stdout().contains("attached to eth0") && Instant::now() < deadline,
            "attach went on without the user-space path: {}",
            refused.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    refused.child = None;
    let err = refused.stderr();
    assert!(!status.success(), "attach without the user-space path fails: {err}");
    assert!(
        err.contains("aggbox: the user-space path (AF_XDP) did not start")
            && err.contains("set [node] userspace_path = \"optional\" to attach without it"),
        "the failure names the path and the choice: {err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line on stderr: {err}");
    assert!(!has_xdp(&ns, "eth0"), "eth0 untouched:\n{}", link_show(&ns, "eth0"));
    assert!(!bed.iface_pins().exists(), "nothing pinned");

    const METRICS_PORT: u16 = 9437;
    // A window of 2 rounds, so that a stale round comes quickly below.
    let text_ = std::fs::read_to_string(&config)
        .expect("config")
        .replace(
            "[node]\nmetrics = \"off\"\n",
            &format!("[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\n"),
        )
        .replace("[[job]]\nid = 7\n", "[[job]]\nid = 7\nwindow = 2\n");
    assert!(text_.contains("optional") && text_.contains("window = 2"), "{text_}");
    let optional = bed.work.file("optional.toml");
    std::fs::write(&optional, text_).expect("write config");
    let mut d = bed.attach("optional", Some(&optional));
    assert!(
        d.stderr().contains("warning: user-space path (AF_XDP) not started"),
        "the attach warns: {}",
        d.stderr()
    );
    let objects = BpfObjects::of(&bed);
    let st = bed.status_json();
    assert_eq!(st["attach"]["userspace_path"], Value::Bool(false), "{st}");
    assert!(
        st["attach"]["userspace_path_error"].as_str().is_some_and(|e| e.contains("queue 0")),
        "status --json says why: {st}"
    );
    let human = bed.aggbox(0, &["status", "eth0", "--pin-root", bed.pin_root()]);
    assert!(
        String::from_utf8_lossy(&human.stdout).contains("user-space path: NOT RUNNING ("),
        "human status shows the missing path: {}",
        text(&human)
    );
    let exposition = scrape_in(&bed, METRICS_PORT);
    assert!(
        exposition.lines().any(|l| l == "aggbox_userspace_path_up{iface=\"eth0\"} 0"),
        "metrics show the missing path: {exposition}"
    );
    bed.traffic_exact(1);

    // Without the user-space path the node itself releases stale kernel
    // slots: round 2 gets rank 0's contribution only (its 3 fragments hold
    // slots), rounds 3..5 complete, so round 2 is older than newest - 2.
    let to = format!("{}:{PORT}", bed.agg_addr());
    let elements = ELEMENTS.to_string();
    let out = bed.aggbox(
        1,
        &["contribute", "--to", &to, "--job", "7", "--rank", "0", "--round", "2", "--op", "sum", "--elements", &elements],
    );
    assert!(out.status.success(), "aggbox contribute: {}", text(&out));
    let active = |bed: &Bed| -> Option<f64> {
        scrape_in(bed, METRICS_PORT)
            .lines()
            .find(|l| l.starts_with("aggbox_job_slots_active{") && l.contains("aggbox_job=\"7\""))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    assert!(
        wait_until(Duration::from_secs(5), || active(&bed) == Some(3.0)),
        "round 2's three fragments hold slots: {:?}",
        active(&bed)
    );
    for round in 3..=5 {
        bed.traffic_exact(round);
    }
    assert!(
        wait_until(Duration::from_secs(5), || active(&bed) == Some(0.0)),
        "the stale round's slots were released without the user-space path: {:?}",
        active(&bed)
    );

    d.signal(Signal::SIGINT);
    assert!(d.wait_exit().success(), "SIGINT: exit 0; stderr: {}", d.stderr());
    drop(blocker);
    bed.assert_clean(&objects);
}

/// Issue #21 item 11: `ip netns exec` gives each command its own mount
/// namespace with a fresh /sys, so an attach with the default pin root
/// mounts a bpffs only it can see. It says so, with the --pin-root fix;
/// `status` and `detach` run by another `ip netns exec` say why they find
/// nothing; with a shared --pin-root there is no such warning.
#[test]
fn attach_under_ip_netns_exec_says_its_bpffs_is_private() {
    let bed = Bed::up(1);
    let ns = bed.agg_ns();
    let config = bed.config("job.toml", &bed.sender_addrs());
    let out = bed.work.file("private.out");
    let err = bed.work.file("private.err");
    let child = bed
        .tb
        .command_in(0, &[BIN, "attach", "eth0", "--config", config.to_str().expect("utf-8")])
        .expect("command")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("starting aggbox attach");
    let mut d = Daemon { child: Some(child), out, err };
    d.wait_attached();
    assert!(
        d.stderr().contains(
            "warning: mounted a bpffs on /sys/fs/bpf in this process's own mount namespace"
        ) && d.stderr().contains("--pin-root /run/aggbox/bpf/NETNS"),
        "attach says its pins are private and how to share them: {}",
        d.stderr()
    );

    let status = bed.aggbox(0, &["status", "eth0"]);
    assert!(!status.status.success(), "{}", text(&status));
    assert!(
        String::from_utf8_lossy(&status.stderr).contains(
            "eth0 is not attached (no state under /sys/fs/bpf/aggbox/eth0); no bpffs is mounted on /sys/fs/bpf in this mount namespace"
        ),
        "status explains why it sees nothing: {}",
        text(&status)
    );
    let detach = bed.aggbox(0, &["detach", "eth0"]);
    assert!(
        String::from_utf8_lossy(&detach.stdout)
            .contains("nothing attached to eth0; no bpffs is mounted on /sys/fs/bpf"),
        "detach explains why it sees nothing: {}",
        text(&detach)
    );
    assert!(has_xdp(&ns, "eth0"), "the private attach still runs");
    d.signal(Signal::SIGINT);
    assert!(d.wait_exit().success(), "SIGINT: exit 0; stderr: {}", d.stderr());
    assert!(!has_xdp(&ns, "eth0"), "detached:\n{}", link_show(&ns, "eth0"));

    // The fix: a pin root on a bpffs shared with the host.
    let mut shared = bed.attach("shared", Some(&config));
    assert!(
        !shared.stderr().contains("own mount namespace"),
        "no warning with a shared pin root: {}",
        shared.stderr()
    );
    let objects = BpfObjects::of(&bed);
    assert_eq!(bed.status_json()["serving"], Value::Bool(true));
    shared.signal(Signal::SIGINT);
    assert!(shared.wait_exit().success(), "SIGINT: exit 0; stderr: {}", shared.stderr());
    bed.assert_clean(&objects);
}
