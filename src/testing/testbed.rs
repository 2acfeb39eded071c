//! Network-namespace testbeds for the integration tests and the evaluation
//! (`aggbox-bench`). Not part of the library: both include this file with
//! `#[path = ".../src/testing/testbed.rs"] mod testbed;` (one copy, two
//! users).
//!
//! A [`Testbed`] is a star of `N` hosts built by `scripts/testbed.sh`: host `i`
//! is the network namespace `{prefix}h{i}` with one veth, `eth0`, whose peer
//! `{prefix}p{i}` is a port of the bridge `br0` in the switch namespace
//! `{prefix}sw`. Host `i` has the address `A.B.0.(first+i)/16` (by default
//! `10.77.0.11` for host 0) and optionally extra addresses `A.B.(1+k).(first+i)`.
//! IPv4 forwarding is on in every host (so `bpf_fib_lookup` works there) and
//! IPv6 is off. Nothing is created outside the testbed's own namespaces.
//!
//! The testbed is torn down when the [`Testbed`] is dropped, also while a panic
//! unwinds. Processes started with [`Testbed::spawn_in`] belong to the caller,
//! which must kill them (by pid) before the testbed goes, or their namespace
//! lives on unnamed until they exit.
//!
//! ```ignore
//! use testbed::{in_netns, Testbed, TestbedConfig};
//! use std::net::UdpSocket;
//!
//! let tb = Testbed::up(TestbedConfig { hosts: 3, ..Default::default() })?;
//! let (h0, h1) = (tb.host(0), tb.host(1));
//! // Sockets keep the namespace they were created in, whichever thread uses them.
//! let rx = in_netns(&h1.netns, || UdpSocket::bind((h1.addr, 9000)))??;
//! let tx = in_netns(&h0.netns, || UdpSocket::bind((h0.addr, 0)))??;
//! tx.send_to(b"hello", (h1.addr, 9000))?;
//! let mut buf = [0u8; 16];
//! let (n, from) = rx.recv_from(&mut buf)?;
//! assert_eq!((&buf[..n], from.ip()), (&b"hello"[..], std::net::IpAddr::V4(h0.addr)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! All operations need root (CAP_NET_ADMIN and CAP_SYS_ADMIN).

use std::fs::File;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sched::{setns, CloneFlags};

/// Name of the testbed interface inside every host namespace.
pub const HOST_IFNAME: &str = "eth0";

/// Directory where `ip netns` keeps the namespace handles that [`in_netns`] opens.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Environment variable: when set to `1`, a dropped [`Testbed`] is left up (and
/// its prefix printed) so it can be inspected; remove it with
/// `scripts/testbed.sh down --prefix P`.
pub const KEEP_ENV: &str = "AGGBOX_TESTBED_KEEP";

/// Errors of testbed operations.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    /// The process is not root; testbeds need CAP_NET_ADMIN and CAP_SYS_ADMIN.
    #[error(
        "testbeds need root (effective uid is {euid}); run the tests as root, e.g. with sudo -E"
    )]
    NotRoot {
        /// The effective uid of this process.
        euid: u32,
    },
    /// The configuration was rejected before anything was created.
    #[error("invalid testbed configuration: {0}")]
    InvalidConfig(String),
    /// `scripts/testbed.sh` exited unsuccessfully.
    #[error("scripts/testbed.sh {action} --prefix {prefix} failed ({status}): {stderr}")]
    Script {
        /// The script command (`up`, `down`, `list`).
        action: String,
        /// The testbed prefix it was run for.
        prefix: String,
        /// The exit status, as text.
        status: String,
        /// What the script wrote to stderr (trimmed).
        stderr: String,
    },
    /// A process could not be started, or a file could not be opened.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `setns` into a network namespace failed.
    #[error("setns into network namespace {netns}: {source}")]
    Setns {
        /// The namespace name.
        netns: String,
        /// The underlying error.
        #[source]
        source: nix::Error,
    },
    /// A host index was out of range.
    #[error("no host {index}: the testbed has {hosts} hosts")]
    NoSuchHost {
        /// The index asked for.
        index: usize,
        /// How many hosts the testbed has.
        hosts: usize,
    },
    /// No free default prefix was found (every candidate is in use).
    #[error("no free testbed prefix for this process")]
    NoFreePrefix,
}

/// Result of testbed operations.
pub type Result<T> = std::result::Result<T, TestbedError>;

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> TestbedError {
    let context = context.into();
    move |source| TestbedError::Io { context, source }
}

/// How to build a [`Testbed`]; start from `TestbedConfig::default()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestbedConfig {
    /// Number of hosts (1..=999, and `first + hosts - 1 <= 254`). Default 2.
    pub hosts: usize,
    /// Prefix of every namespace and interface name: `[a-z0-9]{1,8}`. `None`
    /// (the default) picks one unique to this process and testbed.
    pub prefix: Option<String>,
    /// MTU of every veth. Default 1500.
    pub mtu: u32,
    /// Extra addresses per host: host `i` gets `A.B.(1+k).(first+i)` for
    /// `k in 0..extra_addrs`. Default 0.
    pub extra_addrs: u32,
    /// Turn TX checksum offload off on every host's `eth0`, so locally generated
    /// packets carry full checksums. Default false.
    pub tx_csum_off: bool,
    /// Install permanent ARP entries for every other host's addresses. Default
    /// false (ARP resolves on demand).
    pub static_neigh: bool,
    /// GRO on the switch's end of every veth, so frames a host's XDP
    /// program sends back out (a redirect: the ring's forwarding) are taken.
    /// Default false.
    pub xdp_tx: bool,
    /// TX and RX queue count of every veth; `None` (default) keeps the kernel's
    /// (one TX queue, as many RX queues as CPUs).
    pub queues: Option<u32>,
    /// Dual stack: IPv6 on in every host, each with [`Host::addr6`] beside
    /// its IPv4 addresses. Default false (IPv6 off in every namespace).
    pub ipv6: bool,
    /// First two octets of every address. Default `[10, 77]`.
    pub subnet: [u8; 2],
    /// Last octet of host 0's address. Default 11.
    pub first: u8,
}

impl Default for TestbedConfig {
    fn default() -> Self {
        TestbedConfig {
            hosts: 2,
            prefix: None,
            mtu: 1500,
            extra_addrs: 0,
            tx_csum_off: false,
            static_neigh: false,
            xdp_tx: false,
            ipv6: false,
            queues: None,
            subnet: [10, 77],
            first: 11,
        }
    }
}

impl TestbedConfig {
    /// Arguments of `scripts/testbed.sh` that build this configuration with the
    /// given prefix (starting with `up`).
    pub fn up_args(&self, prefix: &str) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "up".into(),
            "--prefix".into(),
            prefix.into(),
            "--hosts".into(),
            self.hosts.to_string(),
            "--subnet".into(),
            format!("{}.{}", self.subnet[0], self.subnet[1]),
            "--first".into(),
            self.first.to_string(),
            "--extra-addrs".into(),
            self.extra_addrs.to_string(),
            "--mtu".into(),
            self.mtu.to_string(),
        ];
        if let Some(q) = self.queues {
            args.extend(["--queues".into(), q.to_string()]);
        }
        if self.tx_csum_off {
            args.push("--tx-csum-off".into());
        }
        if self.static_neigh {
            args.push("--static-neigh".into());
        }
        if self.xdp_tx {
            args.push("--xdp-tx".into());
        }
        if self.ipv6 {
            args.push("--ipv6".into());
        }
        args
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TestbedError::InvalidConfig(m));
        if self.hosts == 0 || self.hosts > 999 {
            return bad(format!("hosts must be 1..=999, not {}", self.hosts));
        }
        if self.first == 0 || usize::from(self.first) + self.hosts - 1 > 254 {
            return bad(format!(
                "first {} with {} hosts runs past .254",
                self.first, self.hosts
            ));
        }
        if self.extra_addrs > 254 {
            return bad(format!(
                "extra_addrs must be 0..=254, not {}",
                self.extra_addrs
            ));
        }
        if let Some(p) = &self.prefix {
            if !valid_prefix(p) {
                return bad(format!("prefix {p:?} must match [a-z0-9]{{1,8}}"));
            }
        }
        Ok(())
    }
}

/// The IPv6 address `scripts/testbed.sh` gives the host `a.b.0.last`:
/// `fd00:a:b::last`, each number's decimal digits read as hex.
pub fn addr6_of(a: u8, b: u8, last: u8) -> Ipv6Addr {
    let group = |n: u8| u16::from_str_radix(&n.to_string(), 16).expect("decimal digits are hex digits");
    Ipv6Addr::new(0xfd00, group(a), group(b), 0, 0, 0, 0, group(last))
}

/// Whether `prefix` is a valid testbed prefix (`[a-z0-9]{1,8}`).
pub fn valid_prefix(prefix: &str) -> bool {
    (1..=8).contains(&prefix.len())
        && prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// One host of a [`Testbed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Index of the host in its testbed (0-based).
    pub index: usize,
    /// Name of its network namespace (`{prefix}h{index}`), for `ip netns exec`
    /// and [`in_netns`].
    pub netns: String,
    /// Its main address, on [`Host::ifname`] (prefix length 16).
    pub addr: Ipv4Addr,
    /// Its extra addresses, on the same interface (see
    /// [`TestbedConfig::extra_addrs`]).
    pub extra_addrs: Vec<Ipv4Addr>,
    /// Its IPv6 address (prefix length 64) with [`TestbedConfig::ipv6`]:
    /// `fd00:A:B::N` for `A.B.0.N`, each number's decimal digits read as
    /// hex (`10.77.0.11` → `fd00:10:77::11`).
    pub addr6: Option<Ipv6Addr>,
    /// Its interface towards the switch: always [`HOST_IFNAME`] (`eth0`).
    pub ifname: String,
    /// MAC address of [`Host::ifname`]: `02:00:A:B:00:(first+index)`.
    pub mac: [u8; 6],
}

/// A running testbed; torn down on drop (see the module documentation).
#[derive(Debug)]
pub struct Testbed {
    prefix: String,
    config: TestbedConfig,
    hosts: Vec<Host>,
    torn_down: bool,
}

/// Path of `scripts/testbed.sh` in this source tree.
pub fn script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/testbed.sh")
}

fn run_script(action: &str, prefix: &str, args: &[String]) -> Result<Output> {
    let out = Command::new(script_path())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(format!("running {}", script_path().display())))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(TestbedError::Script {
            action: action.into(),
            prefix: prefix.into(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn require_root() -> Result<()> {
    let euid = nix::unistd::geteuid();
    if euid.is_root() {
        Ok(())
    } else {
        Err(TestbedError::NotRoot {
            euid: euid.as_raw(),
        })
    }
}

/// Names of the namespaces that carry `prefix` (as `scripts/testbed.sh list`).
pub fn list_namespaces(prefix: &str) -> Result<Vec<String>> {
    let out = run_script(
        "list",
        prefix,
        &["list".into(), "--prefix".into(), prefix.into()],
    )?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// Removes the testbed with `prefix` (as `scripts/testbed.sh down`); no error if
/// there is none. Only for cleaning up after a [`Testbed`] that was leaked.
pub fn down_prefix(prefix: &str) -> Result<()> {
    run_script(
        "down",
        prefix,
        &["down".into(), "--prefix".into(), prefix.into()],
    )
    .map(drop)
}

/// Removes every testbed this process made (namespaces named
/// `a` + its pid + a counter, see `fresh_prefix`): for a signal handler,
/// where the [`Testbed`]s' destructors will not run.
pub fn down_all_of_this_process() -> Result<()> {
    let mine = format!("a{}", to_base36(std::process::id(), 5));
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map_err(io_err("listing network namespaces".to_string()))?;
    let mut prefixes: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&mine) && n.len() > mine.len() + 2)
        .map(|n| n[..mine.len() + 2].to_string())
        .collect();
    prefixes.sort();
    prefixes.dedup();
    for prefix in prefixes {
        down_prefix(&prefix)?;
    }
    Ok(())
}

fn to_base36(mut n: u32, width: usize) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    while n > 0 {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
    }
    while out.len() < width {
        out.push(b'0');
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

static PREFIX_COUNTER: AtomicU32 = AtomicU32::new(0);

/// A prefix unique to this process and call: `a` + pid (5 base-36 digits) +
/// counter (2 base-36 digits), skipping prefixes whose namespaces exist.
fn fresh_prefix() -> Result<String> {
    let pid = to_base36(std::process::id(), 5);
    for _ in 0..36 * 36 {
        let n = PREFIX_COUNTER.fetch_add(1, Ordering::Relaxed) % (36 * 36);
        let prefix = format!("a{pid}{}", to_base36(n, 2));
        if prefix.len() <= 8 && list_namespaces(&prefix)?.is_empty() {
            return Ok(prefix);
        }
    }
    Err(TestbedError::NoFreePrefix)
}

impl Testbed {
    /// Builds a testbed (running `scripts/testbed.sh up`). With an explicit
    /// prefix that is already up with the same options, the existing testbed is
    /// adopted unchanged; with other options it is rebuilt. On failure nothing
    /// with the prefix is left behind.
    pub fn up(config: TestbedConfig) -> Result<Testbed> {
        require_root()?;
        config.validate()?;
        let prefix = match &config.prefix {
            Some(p) => p.clone(),
            None => fresh_prefix()?,
        };
        if let Err(e) = run_script("up", &prefix, &config.up_args(&prefix)) {
            // The script cleans up after itself; this only makes sure.
            let _ = down_prefix(&prefix);
            return Err(e);
        }
        let [a, b] = config.subnet;
        let hosts = (0..config.hosts)
            .map(|i| {
                let last = config.first + i as u8; // validated: <= 254
                Host {
                    index: i,
                    netns: format!("{prefix}h{i}"),
                    addr: Ipv4Addr::new(a, b, 0, last),
                    extra_addrs: (0..config.extra_addrs)
                        .map(|k| Ipv4Addr::new(a, b, (1 + k) as u8, last))
                        .collect(),
                    addr6: config.ipv6.then(|| addr6_of(a, b, last)),
                    ifname: HOST_IFNAME.to_string(),
                    mac: [0x02, 0x00, a, b, 0x00, last],
                }
            })
            .collect();
        Ok(Testbed {
            prefix,
            config,
            hosts,
            torn_down: false,
        })
    }

    /// The prefix of every namespace and interface of this testbed.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The configuration it was built with (`prefix` as given, maybe `None`).
    pub fn config(&self) -> &TestbedConfig {
        &self.config
    }

    /// All hosts, by index.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Always false: a testbed has at least one host.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Host `i` (a copy). Panics if `i >= self.len()`; see [`Testbed::try_host`].
    pub fn host(&self, i: usize) -> Host {
        match self.try_host(i) {
            Ok(h) => h.clone(),
            Err(e) => panic!("{e}"),
        }
    }

    /// Host `i`, or [`TestbedError::NoSuchHost`].
    pub fn try_host(&self, i: usize) -> Result<&Host> {
        self.hosts.get(i).ok_or(TestbedError::NoSuchHost {
            index: i,
            hosts: self.hosts.len(),
        })
    }

    /// Name of the switch namespace (holding the bridge `br0` and the ports
    /// `{prefix}p{i}`).
    pub fn switch_netns(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// Name of the switch-side veth (bridge port) of host `i`.
    pub fn switch_port(&self, i: usize) -> String {
        format!("{}p{i}", self.prefix)
    }

    /// A `Command` running `cmd` inside host `host`'s namespace (`ip netns exec`),
    /// for callers that want to set stdio or environment before starting it.
    pub fn command_in(&self, host: usize, cmd: &[&str]) -> Result<Command> {
        let h = self.try_host(host)?;
        if cmd.is_empty() {
            return Err(TestbedError::InvalidConfig("empty command".into()));
        }
        let mut c = Command::new("ip");
        c.args(["netns", "exec", h.netns.as_str()]).args(cmd);
        Ok(c)
    }

    /// Runs `cmd` inside host `host`'s namespace and waits for it, capturing
    /// stdout and stderr. A non-zero exit is not an error: check `status`.
    pub fn run_in(&self, host: usize, cmd: &[&str]) -> Result<Output> {
        self.command_in(host, cmd)?
            .stdin(Stdio::null())
            .output()
            .map_err(io_err(format!("running {cmd:?} in host {host}")))
    }

    /// Starts `cmd` inside host `host`'s namespace with inherited stdio. The
    /// caller owns the child: kill it (by its pid) and wait for it before the
    /// testbed is dropped.
    pub fn spawn_in(&self, host: usize, cmd: &[&str]) -> Result<Child> {
        self.command_in(host, cmd)?
            .spawn()
            .map_err(io_err(format!("starting {cmd:?} in host {host}")))
    }

    /// The IPv6 address [`Testbed::enable_ipv6`] gives host `host`:
    /// `fd00:77::(first + host)`.
    pub fn ipv6_addr(&self, host: usize) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, u16::from(self.config().first) + host as u16)
    }

    /// Turns IPv6 on in host `host`'s namespace (the testbed has it off)
    /// and gives its eth0 [`Testbed::ipv6_addr`]`/64`, without duplicate
    /// address detection for it and for the link-local address (a
    /// tentative link-local address cannot send the neighbour solicitations
    /// of datagrams whose source is another host's, a forwarder's copies',
    /// for the first seconds); `forwarding` also turns IPv6 forwarding on
    /// there (what `bpf_fib_lookup` with AF_INET6 wants).
    pub fn enable_ipv6(&self, host: usize, forwarding: bool) -> Result<()> {
        let addr = format!("{}/64", self.ipv6_addr(host));
        let mut cmds: Vec<Vec<&str>> = vec![
            vec!["sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"],
            vec!["sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0"],
            vec!["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0", "net.ipv6.conf.default.disable_ipv6=0"],
            vec!["sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=0", "net.ipv6.conf.lo.disable_ipv6=0"],
            vec!["ip", "-6", "addr", "replace", addr.as_str(), "dev", "eth0", "nodad"],
        ];
        if forwarding {
            cmds.push(vec!["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        }
        for cmd in cmds {
            let out = self.run_in(host, &cmd)?;
            if !out.status.success() {
                return Err(TestbedError::InvalidConfig(format!(
                    "host {host}: {cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
        }
        Ok(())
    }

    /// Runs `f` on a fresh thread inside host `host`'s namespace; see [`in_netns`].
    pub fn in_host<T: Send>(&self, host: usize, f: impl FnOnce() -> T + Send) -> Result<T> {
        in_netns(&self.try_host(host)?.netns, f)
    }

    /// Tears the testbed down now, reporting failure (dropping it does the same
    /// but can only print errors).
    pub fn down(mut self) -> Result<()> {
        self.torn_down = true;
        down_prefix(&self.prefix)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        if std::env::var(KEEP_ENV).as_deref() == Ok("1") {
            eprintln!(
                "testbed {}: left up ({KEEP_ENV}=1); remove with: {} down --prefix {}",
                self.prefix,
                script_path().display(),
                self.prefix
            );
            return;
        }
        if let Err(e) = down_prefix(&self.prefix) {
            eprintln!("testbed {}: teardown failed: {e}", self.prefix);
        }
    }
}

/// Runs `f` on a fresh thread that has joined the network namespace `netns`
/// (a name under [`NETNS_DIR`], as made by `ip netns add`), and returns its
/// result. The calling thread's namespace is untouched. Sockets created inside
/// `f` stay in `netns` for their whole life, so they can be returned and used
/// from any thread. A panic inside `f` is resumed on the calling thread.
pub fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    if netns.is_empty() || netns.contains('/') || netns == "." || netns == ".." {
        return Err(TestbedError::InvalidConfig(format!(
            "bad namespace name {netns:?}"
        )));
    }
    let path = Path::new(NETNS_DIR).join(netns);
    let handle = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name(format!("netns-{netns}"))
            .spawn_scoped(scope, move || -> Result<T> {
                setns(&handle, CloneFlags::CLONE_NEWNET).map_err(|source| TestbedError::Setns {
                    netns: netns.to_string(),
                    source,
                })?;
                drop(handle);
                Ok(f())
            })
            .map_err(io_err("spawning a namespace thread"))?;
        match thread.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert!(valid_prefix("ab1"));
        assert!(valid_prefix("a1234567"));
        assert!(!valid_prefix(""));
        assert!(!valid_prefix("a12345678"));
        assert!(!valid_prefix("Ab"));
        assert!(!valid_prefix("a-b"));
        assert_eq!(to_base36(0, 2), "00");
        assert_eq!(to_base36(35, 2), "0z");
        assert_eq!(to_base36(4_194_304, 5), "2hwcg"); // pid_max fits 5 digits
    }

    #[test]
    fn config_checks_and_args() {
        let c = TestbedConfig {
            hosts: 3,
            queues: Some(2),
            static_neigh: true,
            ..Default::default()
        };
        assert!(c.validate().is_ok());
        let args = c.up_args("ab");
        assert_eq!(&args[..5], ["up", "--prefix", "ab", "--hosts", "3"]);
        assert!(args.iter().any(|a| a == "--static-neigh"));
        assert!(!args.iter().any(|a| a == "--tx-csum-off"));
        let too_many = TestbedConfig {
            hosts: 245,
            ..Default::default()
        };
        assert!(too_many.validate().is_err());
        let bad = TestbedConfig {
            prefix: Some("x/y".into()),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
