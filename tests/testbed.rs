//! Integration tests of `scripts/testbed.sh` and `crate::testbed` (need root).
//!
//! Every test builds its own testbed with a prefix unique to the process, so the
//! tests run in parallel. Traffic goes only to addresses inside namespaces the
//! test created.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::Duration;

use crate::testbed::{
    in_netns, list_namespaces, script_path, Host, Testbed, TestbedConfig, TestbedError,
};

/// Fails (not skips) when not root: these tests are the point of running as root.
fn require_root() {
    let euid = nix::unistd::geteuid();
    assert!(
        euid.is_root(),
        "tests/testbed.rs needs root (network namespaces, veth, bridge); effective uid is {euid}. \
         Run e.g. `sudo -E cargo test --test testbed`."
    );
}

fn script(args: &[&str]) -> Output {
    Command::new(script_path())
        .args(args)
        .output()
        .expect("run scripts/testbed.sh")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Namespaces from `ip netns list` that carry `prefix` (as the script names them).
fn netns_with_prefix(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    assert!(out.status.success(), "ip netns list: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| {
            n.strip_prefix(prefix).is_some_and(|rest| {
                rest == "sw"
                    || rest
                        .strip_prefix('h')
                        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            })
        })
        .map(String::from)
        .collect()
}

/// Links in this (the test's own) namespace whose name starts with `prefix`.
fn root_links_with_prefix(prefix: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    assert!(out.status.success(), "ip link: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

fn assert_gone(prefix: &str) {
    assert_eq!(
        netns_with_prefix(prefix),
        Vec::<String>::new(),
        "namespaces left for {prefix}"
    );
    assert_eq!(list_namespaces(prefix).expect("list"), Vec::<String>::new());
    assert_eq!(
        root_links_with_prefix(prefix),
        Vec::<String>::new(),
        "links left for {prefix}"
    );
    assert!(
        !std::path::Path::new(&format!("/run/aggbox-testbed/{prefix}.state")).exists(),
        "state file left for {prefix}"
    );
}

/// Sends one UDP datagram from `from` to `to_addr` (an address of host `to`)
/// using sockets opened inside the hosts' namespaces, and checks it arrives
/// with the right payload and source.
fn udp_check(from: &Host, to: &Host, to_addr: impl Into<IpAddr>, port: u16) {
    let to_addr: IpAddr = to_addr.into();
    let from_addr = match to_addr {
        IpAddr::V4(_) => IpAddr::V4(from.addr),
        IpAddr::V6(_) => IpAddr::V6(from.addr6.expect("the sender has an IPv6 address")),
    };
    let rx = in_netns(&to.netns, || UdpSocket::bind((to_addr, port)))
        .expect("enter receiver netns")
        .unwrap_or_else(|e| panic!("bind {to_addr}:{port} in {}: {e}", to.netns));
    rx.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let tx = in_netns(&from.netns, || UdpSocket::bind((from_addr, 0)))
        .expect("enter sender netns")
        .unwrap_or_else(|e| panic!("bind {from_addr} in {}: {e}", from.netns));
    let msg = format!("{} -> {}", from.netns, to_addr);
    let mut buf = [0u8; 256];
    // The first datagram may wait on ARP (or neighbour discovery); resend a
    // few times before failing.
    for attempt in 0..10 {
        tx.send_to(msg.as_bytes(), (to_addr, port))
            .expect("send_to");
        match rx.recv_from(&mut buf) {
            Ok((n, src)) => {
                assert_eq!(&buf[..n], msg.as_bytes());
                assert_eq!(src.ip(), from_addr);
                return;
            }
            Err(e) if attempt < 9 => eprintln!("{msg}: attempt {attempt}: {e}"),
            Err(e) => panic!("{msg}: no datagram after 10 tries: {e}"),
        }
    }
}

#[test]
fn three_hosts_reach_each_other_over_udp() {
    require_root();
    let tb = Testbed::up(TestbedConfig {
        hosts: 3,
        ..Default::default()
    })
    .expect("testbed up");
    assert_eq!(tb.len(), 3);
    let expect = [
        Ipv4Addr::new(10, 77, 0, 11),
        Ipv4Addr::new(10, 77, 0, 12),
        Ipv4Addr::new(10, 77, 0, 13),
    ];
    for (i, addr) in expect.iter().enumerate() {
        let h = tb.host(i);
        assert_eq!(h.addr, *addr);
        assert_eq!(h.ifname, "eth0");
        assert_eq!(h.netns, format!("{}h{i}", tb.prefix()));
    }
    let mut port = 40000;
    for i in 0..3 {
        for j in 0..3 {
            if i != j {
                udp_check(&tb.host(i), &tb.host(j), tb.host(j).addr, port);
                port += 1;
            }
        }
    }
    // Each namespace really is separate: the host's own address is not in ours.
    assert!(
        UdpSocket::bind((expect[0], 0)).is_err(),
        "10.77.0.11 must not exist outside h0"
    );
    let prefix = tb.prefix().to_string();
    drop(tb);
    assert_gone(&prefix);
}

/// `ipv6`: every host also has its `fd00:A:B::N` address, usable at once,
/// and reaches every other over IPv6 as over IPv4, with and without static
/// neighbour entries (which then cover the IPv6 addresses too); without the
/// option a host has no IPv6 address and IPv6 is off.
#[test]
fn ipv6_gives_every_host_a_second_family() {
    require_root();
    for static_neigh in [false, true] {
        let tb = Testbed::up(TestbedConfig { hosts: 3, ipv6: true, static_neigh, ..Default::default() })
            .expect("testbed up");
        let want: Vec<Ipv6Addr> = ["fd00:10:77::11", "fd00:10:77::12", "fd00:10:77::13"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(tb.hosts().iter().map(|h| h.addr6.unwrap()).collect::<Vec<_>>(), want);
        let mut port = 41000;
        for i in 0..3 {
            for j in 0..3 {
                if i != j {
                    udp_check(&tb.host(i), &tb.host(j), tb.host(j).addr6.unwrap(), port);
                    udp_check(&tb.host(i), &tb.host(j), tb.host(j).addr, port + 1);
                    port += 2;
                }
            }
        }
        let h0 = tb.host(0);
        let neigh = in_netns(&h0.netns, || Command::new("ip").args(["-6", "neigh", "show", "nud", "permanent"]).output())
            .expect("enter h0")
            .expect("ip -6 neigh");
        let permanent = String::from_utf8_lossy(&neigh.stdout).into_owned();
        assert_eq!(
            permanent.contains("fd00:10:77::12") && permanent.contains("fd00:10:77::13"),
            static_neigh,
            "h0's permanent IPv6 neighbours with static_neigh={static_neigh}: {permanent}"
        );
    }
    let tb = Testbed::up(TestbedConfig { hosts: 2, ..Default::default() }).expect("testbed up");
    assert_eq!(tb.host(0).addr6, None);
    let off = in_netns(&tb.host(0).netns, || std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6"))
        .expect("enter h0")
        .expect("read disable_ipv6");
    assert_eq!(off.trim(), "1", "IPv6 is off without the option");
}

#[test]
fn run_in_spawn_in_and_namespace_settings() {
    require_root();
    let tb = Testbed::up(TestbedConfig {
        hosts: 2,
        ..Default::default()
    })
    .expect("testbed up");
    let out = tb
        .run_in(1, &["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        .expect("run_in");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("10.77.0.12/16"));

    let sysctl = |key: &str| {
        let o = tb.run_in(0, &["sysctl", "-n", key]).expect("sysctl");
        assert!(o.status.success(), "sysctl {key}: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(sysctl("net.ipv4.ip_forward"), "1");
    assert_eq!(sysctl("net.ipv6.conf.all.disable_ipv6"), "1");
    let lo = tb
        .run_in(0, &["ip", "-o", "link", "show", "dev", "lo"])
        .expect("lo");
    assert!(
        String::from_utf8_lossy(&lo.stdout).contains("UP"),
        "lo must be up"
    );

    // Loopback inside a host namespace works for in_netns sockets too.
    let got = tb
        .in_host(0, || -> std::io::Result<Vec<u8>> {
            let a = UdpSocket::bind("127.0.0.1:0")?;
            let b = UdpSocket::bind("127.0.0.1:0")?;
            b.set_read_timeout(Some(Duration::from_secs(1)))?;
            a.send_to(b"lo", b.local_addr()?)?;
            let mut buf = [0u8; 8];
            let n = b.recv(&mut buf)?;
            Ok(buf[..n].to_vec())
        })
        .expect("in_host")
        .expect("loopback");
    assert_eq!(got, b"lo");

    let mut child = tb.spawn_in(1, &["sleep", "30"]).expect("spawn_in");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kill child by pid");
    let status = child.wait().expect("wait");
    assert!(!status.success());

    assert!(matches!(
        tb.try_host(2),
        Err(TestbedError::NoSuchHost { index: 2, hosts: 2 })
    ));
    let prefix = tb.prefix().to_string();
    tb.down().expect("down");
    assert_gone(&prefix);
}

#[test]
fn options_extra_addrs_static_neigh_tx_csum_off_queues_mtu() {
    require_root();
    let cfg = TestbedConfig {
        hosts: 2,
        mtu: 9000,
        extra_addrs: 2,
        tx_csum_off: true,
        static_neigh: true,
        queues: Some(2),
        ..Default::default()
    };
    let tb = Testbed::up(cfg).expect("testbed up");
    let h0 = tb.host(0);
    let h1 = tb.host(1);
    assert_eq!(
        h1.extra_addrs,
        vec![Ipv4Addr::new(10, 77, 1, 12), Ipv4Addr::new(10, 77, 2, 12)]
    );

    let link = tb
        .run_in(0, &["ip", "-d", "-o", "link", "show", "dev", "eth0"])
        .expect("link");
    let link = String::from_utf8_lossy(&link.stdout).into_owned();
    assert!(link.contains("mtu 9000"), "{link}");
    assert!(link.contains("numtxqueues 2 numrxqueues 2"), "{link}");
    assert!(link.contains("02:00:0a:4d:00:0b"), "{link}");

    // With --queues every TX queue is one CPU's (XPS): queue q, CPU q mod N.
    let cpus = tb.run_in(0, &["nproc", "--all"]).expect("nproc");
    let cpus: usize = String::from_utf8_lossy(&cpus.stdout).trim().parse().expect("nproc");
    for q in 0..2 {
        let path = format!("/sys/class/net/eth0/queues/tx-{q}/xps_cpus");
        let out = tb.run_in(0, &["cat", &path]).expect("xps_cpus");
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // Comma-separated 32-bit words, most significant first.
        let cpus_set: Vec<usize> = text
            .split(',')
            .rev()
            .enumerate()
            .flat_map(|(w, word)| {
                let bits = u32::from_str_radix(word, 16).expect("hex word");
                (0..32).filter(move |b| bits & (1 << b) != 0).map(move |b| 32 * w + b)
            })
            .collect();
        assert_eq!(cpus_set, vec![q % cpus], "{path}: {text}");
    }

    let neigh = tb
        .run_in(0, &["ip", "neigh", "show", "dev", "eth0"])
        .expect("neigh");
    let neigh = String::from_utf8_lossy(&neigh.stdout).into_owned();
    for a in std::iter::once(h1.addr).chain(h1.extra_addrs.iter().copied()) {
        assert!(
            neigh.lines().any(|l| l.starts_with(&format!("{a} "))
                && l.contains("02:00:0a:4d:00:0c")
                && l.contains("PERMANENT")),
            "no permanent entry for {a}: {neigh}"
        );
    }

    let k = tb.run_in(0, &["ethtool", "-k", "eth0"]).expect("ethtool");
    assert!(k.status.success(), "ethtool: {}", stderr(&k));
    assert!(String::from_utf8_lossy(&k.stdout).contains("tx-checksumming: off"));

    udp_check(&h0, &h1, h1.extra_addrs[1], 41000);
    udp_check(&h1, &h0, h0.extra_addrs[0], 41001);
}

#[test]
fn up_is_idempotent_and_rebuilds_on_new_host_count() {
    require_root();
    let cfg = TestbedConfig {
        hosts: 3,
        ..Default::default()
    };
    let tb = Testbed::up(cfg.clone()).expect("testbed up");
    let prefix = tb.prefix().to_string();
    let ifindex = |h: usize| {
        let o = tb
            .run_in(h, &["cat", "/sys/class/net/eth0/ifindex"])
            .expect("ifindex");
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let before = ifindex(2);

    let args = cfg.up_args(&prefix);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let again = script(&args);
    assert!(again.status.success(), "second up: {}", stderr(&again));
    let line = String::from_utf8_lossy(&again.stdout).into_owned();
    assert!(
        line.contains("unchanged"),
        "second up should keep the testbed: {line}"
    );
    assert_eq!(line.lines().count(), 1, "one-line summary: {line}");
    assert_eq!(ifindex(2), before, "same links after the second up");
    udp_check(&tb.host(0), &tb.host(2), tb.host(2).addr, 42000);

    // Same prefix, 4 hosts: rebuilt.
    let mut args4 = args.clone();
    let hosts_at = args4.iter().position(|a| *a == "--hosts").expect("--hosts") + 1;
    args4[hosts_at] = "4";
    let rebuilt = script(&args4);
    assert!(
        rebuilt.status.success(),
        "up with 4 hosts: {}",
        stderr(&rebuilt)
    );
    assert!(!String::from_utf8_lossy(&rebuilt.stdout).contains("unchanged"));
    let mut names = list_namespaces(&prefix).expect("list");
    names.sort();
    let mut want: Vec<String> = (0..4).map(|i| format!("{prefix}h{i}")).collect();
    want.push(format!("{prefix}sw"));
    want.sort();
    assert_eq!(names, want);

    // Back to 3: host 3 must disappear.
    let back = script(&args);
    assert!(back.status.success(), "up with 3 hosts: {}", stderr(&back));
    assert!(!netns_with_prefix(&prefix).contains(&format!("{prefix}h3")));
    let status = script(&["status", "--prefix", &prefix]);
    assert!(
        status.status.success(),
        "status: {}",
        String::from_utf8_lossy(&status.stdout)
    );

    drop(tb);
    assert_gone(&prefix);
}

#[test]
fn down_removes_everything_and_is_idempotent() {
    require_root();
    let tb = Testbed::up(TestbedConfig {
        hosts: 3,
        ..Default::default()
    })
    .expect("testbed up");
    let prefix = tb.prefix().to_string();
    assert_eq!(netns_with_prefix(&prefix).len(), 4);
    let down = script(&["down", "--prefix", &prefix]);
    assert!(down.status.success(), "down: {}", stderr(&down));
    assert_gone(&prefix);
    let status = script(&["status", "--prefix", &prefix]);
    assert_eq!(status.status.code(), Some(1), "status of an absent testbed");
    // Down again (by the script and by Drop): no error.
    let again = script(&["down", "--prefix", &prefix]);
    assert!(again.status.success(), "second down: {}", stderr(&again));
    tb.down().expect("down after down");
    assert_gone(&prefix);
}

#[test]
fn failed_up_leaves_nothing_behind() {
    require_root();
    // Invalid prefixes are rejected before anything is made.
    for bad in ["Bad", "has-dash", "toolong123", ""] {
        let r = Testbed::up(TestbedConfig {
            prefix: Some(bad.into()),
            ..Default::default()
        });
        assert!(
            matches!(r, Err(TestbedError::InvalidConfig(_))),
            "prefix {bad:?}: {r:?}"
        );
        let o = script(&["up", "--prefix", bad, "--hosts", "2"]);
        assert!(!o.status.success(), "script accepted prefix {bad:?}");
    }
    assert!(matches!(
        Testbed::up(TestbedConfig {
            hosts: 0,
            ..Default::default()
        }),
        Err(TestbedError::InvalidConfig(_))
    ));

    // A failure half-way (after hosts 0 and 1 exist) removes what was made.
    let prefix = format!("f{}", std::process::id() % 10_000_000);
    let out = Command::new(script_path())
        .args(["up", "--prefix", &prefix, "--hosts", "3"])
        .env("AGGBOX_TESTBED_FAIL_AFTER_HOST", "1")
        .output()
        .expect("run script");
    assert!(!out.status.success(), "up should have failed");
    assert!(stderr(&out).contains("up failed"), "{}", stderr(&out));
    assert_gone(&prefix);

    // Bad options are rejected before anything is made.
    let out = script(&[
        "up", "--prefix", &prefix, "--hosts", "2", "--subnet", "300.1",
    ]);
    assert!(!out.status.success());
    assert_gone(&prefix);
}

#[test]
fn drop_cleans_up_after_panic() {
    require_root();
    let seen: Mutex<Option<String>> = Mutex::new(None);
    let r = catch_unwind(AssertUnwindSafe(|| {
        let tb = Testbed::up(TestbedConfig {
            hosts: 2,
            ..Default::default()
        })
        .expect("up");
        *seen.lock().unwrap() = Some(tb.prefix().to_string());
        assert_eq!(netns_with_prefix(tb.prefix()).len(), 3);
        // A panic inside a namespace closure comes back to this thread...
        let h = tb.host(0);
        let _ = in_netns(&h.netns, || -> () { panic!("boom inside {}", h.netns) });
        unreachable!("in_netns must resume the panic");
    }));
    assert!(r.is_err(), "the closure must panic");
    let prefix = seen.lock().unwrap().clone().expect("testbed was up");
    // ...and the testbed was torn down while unwinding.
    assert_gone(&prefix);
}

#[test]
fn in_netns_rejects_missing_namespace() {
    require_root();
    let r = in_netns("aggbox-no-such-ns", || ());
    assert!(matches!(r, Err(TestbedError::Io { .. })), "{r:?}");
    assert!(in_netns("../etc", || ()).is_err());
    // The calling thread stays in its own namespace.
    let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
    assert!(UdpSocket::bind(lo).is_ok());
}
