//! Shared helpers of the netns integration tests (`tests/netns_aggregate.rs`,
//! `tests/cli_lifecycle.rs`): the root check, a private bpffs for pins, config
//! text, rank sockets bound to testbed addresses, deterministic test vectors,
//! and a round driver that sends real UDP contributions (windowed, with
//! injected retransmissions and resends after loss) and checks every RESULT
//! against the reference reducer as it arrives.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use aggbox::wire::abi::{self, Op};
use aggbox::wire::proto::{self, AggHeader};
use aggbox::wire::reducer;
use crate::testbed::{in_netns, Testbed};

/// Ops the XDP program reduces in the kernel.
pub fn kernel_ops() -> Vec<Op> {
    Op::ALL.into_iter().filter(|op| op.runs_in_kernel()).collect()
}

/// Elements per datagram at MTU 1500 (the testbed's).
pub const PER_DATAGRAM: usize = 362;

/// Fail (never skip) when not root.
pub fn require_root() {
    let euid = nix::unistd::geteuid();
    assert!(
        euid.is_root(),
        "the netns tests need root (network namespaces, BPF, bpffs mounts); effective uid is {euid}: \
         run them as root, e.g. `sudo -E cargo test --test netns_aggregate --test cli_lifecycle`"
    );
}

static MOUNT_COUNTER: AtomicU32 = AtomicU32::new(0);

/// A bpffs mounted on a fresh directory under /tmp, unmounted (lazily, so pins
/// held by a crashed test go too) and removed on drop, also during a panic:
/// the one the evaluation uses too (`src/testing/bpffs.rs`).
#[path = "../../src/testing/bpffs.rs"]
mod private_bpffs;
pub use private_bpffs::PrivateBpffs as Bpffs;

/// A scratch directory under /tmp, removed on drop.
#[derive(Debug)]
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let n = MOUNT_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!("/tmp/aggbox-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// One `[[job]]` of a test config.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub id: u16,
    pub port: u16,
    pub result_port: u16,
    pub workers: Vec<Ipv4Addr>,
    /// Empty: all 1.
    pub weights: Vec<i32>,
    pub vector_len: Option<u32>,
}

impl JobSpec {
    pub fn effective_weights(&self) -> Vec<i32> {
        if self.weights.is_empty() {
            vec![1; self.workers.len()]
        } else {
            self.weights.clone()
        }
    }
}

/// TOML text of a node config with `jobs` (metrics off).
pub fn config_text(jobs: &[JobSpec]) -> String {
    let mut s = String::from("[node]\nmetrics = \"off\"\n");
    for j in jobs {
        let workers: Vec<String> = j.workers.iter().map(|a| format!("\"{a}\"")).collect();
        let _ = write!(
            s,
            "\n[[job]]\nid = {}\nport = {}\nresult_port = {}\nworkers = [{}]\n",
            j.id,
            j.port,
            j.result_port,
            workers.join(", ")
        );
        if !j.weights.is_empty() {
            let w: Vec<String> = j.weights.iter().map(|w| w.to_string()).collect();
            let _ = writeln!(s, "weights = [{}]", w.join(", "));
        }
        if let Some(len) = j.vector_len {
            let _ = writeln!(s, "vector_len = {len}");
        }
    }
    s
}

/// Where rank `r` sends from when ranks are spread round-robin over the
/// sender hosts `hosts`: host `hosts[r % H]`, its address number `r / H`
/// (0 = the main address, k = extra address k-1).
pub fn spread_ranks(tb: &Testbed, hosts: &[usize], ranks: usize) -> Vec<(usize, Ipv4Addr)> {
    (0..ranks)
        .map(|r| {
            let h = tb.host(hosts[r % hosts.len()]);
            let k = r / hosts.len();
            let addr = if k == 0 {
                h.addr
            } else {
                *h.extra_addrs.get(k - 1).unwrap_or_else(|| {
                    panic!(
                        "rank {r} needs extra address {} of host {}, which has {}",
                        k - 1,
                        h.index,
                        h.extra_addrs.len()
                    )
                })
            };
            (h.index, addr)
        })
        .collect()
}

/// A UDP socket in host `host`'s namespace bound to `addr:0`.
pub fn bind_in(tb: &Testbed, host: usize, addr: Ipv4Addr) -> UdpSocket {
    tb.in_host(host, || UdpSocket::bind(SocketAddrV4::new(addr, 0)))
        .unwrap_or_else(|e| panic!("entering host {host}: {e}"))
        .unwrap_or_else(|e| panic!("binding {addr}:0 in host {host}: {e}"))
}

/// One socket per rank, bound to the rank's address in its host.
pub fn rank_sockets(tb: &Testbed, placement: &[(usize, Ipv4Addr)]) -> Vec<UdpSocket> {
    placement
        .iter()
        .map(|&(host, addr)| bind_in(tb, host, addr))
        .collect()
}

/// A socket bound to `0.0.0.0:port` in the namespace `netns` (the
/// application's result socket), with a large receive buffer.
pub fn result_socket_in(netns: &str, port: u16) -> UdpSocket {
    let socket = in_netns(netns, || {
        UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port))
    })
    .unwrap_or_else(|e| panic!("entering {netns}: {e}"))
    .unwrap_or_else(|e| panic!("binding 0.0.0.0:{port} in {netns}: {e}"));
    let size: libc::c_int = 4 << 20;
    // SAFETY: valid socket fd and option buffer. SO_RCVBUFFORCE (root) ignores rmem_max.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    socket
}

/// Deterministic pseudo-random number for (seed, a, b).
pub fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut x =
        seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// Kinds of test vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// About a quarter zeros (COUNT matters), the rest in ±2^20, both signs.
    Mixed,
    /// Large positive values near INT32_MAX: a SUM of two or more overflows.
    Large,
}

/// Rank `rank`'s vector of `n` elements for `seed`.
pub fn vector(seed: u64, rank: usize, n: usize, kind: Values) -> Vec<i32> {
    (0..n)
        .map(|i| {
            let h = mix(seed, rank as u64, i as u64);
            match kind {
                Values::Mixed => {
                    if h % 4 == 0 {
                        0
                    } else {
                        ((h >> 8) % (1 << 21)) as i32 - (1 << 20)
                    }
                }
                Values::Large => i32::MAX - ((h >> 8) % 1000) as i32,
            }
        })
        .collect()
}

/// Every rank's vector.
pub fn vectors(seed: u64, ranks: usize, n: usize, kind: Values) -> Vec<Vec<i32>> {
    (0..ranks).map(|r| vector(seed, r, n, kind)).collect()
}

/// One reduction round to drive.
#[derive(Debug, Clone)]
pub struct Round<'a> {
    pub job: u16,
    pub round: u32,
    pub op: Op,
    /// Aggregator address and job port.
    pub to: SocketAddrV4,
    /// One vector per rank (all the same length).
    pub vectors: &'a [Vec<i32>],
    /// One weight per rank.
    pub weights: &'a [i32],
    /// Fragments in flight at once (self-clocking window).
    pub window: usize,
    /// Inject retransmissions: a rank's datagram sent twice before its slot
    /// completes, and one resent after the RESULT came back.
    pub duplicates: bool,
}

/// What a round did.
#[derive(Debug, Clone, Default)]
pub struct RoundReport {
    /// Fragments (= RESULT datagrams received, one each).
    pub fragments: usize,
    /// Distinct contributions (ranks × fragments).
    pub contributions: u64,
    /// Datagrams deliberately sent twice.
    pub injected_duplicates: u64,
    /// Datagrams resent because a fragment's RESULT was late (loss recovery).
    pub resent: u64,
}

/// Expected RESULT of one fragment: header flags and payload.
fn expected_fragment(r: &Round, off: usize, count: usize, last: bool) -> (u8, Vec<i32>) {
    let slices: Vec<(&[i32], i32)> = r
        .vectors
        .iter()
        .zip(r.weights)
        .map(|(v, &w)| (&v[off..off + count], w))
        .collect();
    let res = reducer::reduce(r.op, &slices).unwrap_or_else(|e| panic!("reference reducer: {e}"));
    let mut flags = abi::AGG_F_RESULT | res.flags();
    if last {
        flags |= abi::AGG_F_LAST_FRAGMENT;
    }
    (flags, res.ints().expect("integer result").to_vec())
}

/// Encode rank `rank`'s datagram of fragment `f`.
fn datagram(
    r: &Round,
    seq_base: &[u32],
    rank: usize,
    f: usize,
    frags: &[(usize, usize)],
) -> Vec<u8> {
    let (off, count) = frags[f];
    let hdr = AggHeader {
        job: r.job,
        rank: rank as u16,
        seq: seq_base[rank].wrapping_add(f as u32),
        round: abi::Round(r.round),
        frag_off: off as u32,
        op: r.op,
        flags: if f + 1 == frags.len() {
            abi::AGG_F_LAST_FRAGMENT
        } else {
            0
        },
        count: count as u16,
    };
    let mut buf = Vec::with_capacity(abi::AGG_HDR_LEN + 4 * count);
    proto::encode_agg_into(&hdr, &r.vectors[rank][off..off + count], &mut buf)
        .expect("encode AGG1");
    buf
}

fn send(socket: &UdpSocket, buf: &[u8], to: SocketAddrV4) {
    socket
        .send_to(buf, to)
        .unwrap_or_else(|e| panic!("sending to {to} from {:?}: {e}", socket.local_addr()));
}

/// How long a fragment may go without its RESULT before every rank's
/// contribution to it is resent (the retransmissions are deduplicated).
pub const RESEND_AFTER: Duration = Duration::from_millis(400);

/// Drive one round: send every rank's vector as AGG1 datagrams (at most
/// `window` fragments in flight, each fragment's ranks in a rotating order),
/// and check each RESULT on `rx` as it arrives against the reference reducer
/// (header fields, flags, payload). Panics on a wrong or second RESULT, a
/// RESULT of another round, or when `timeout` passes first. `seqs` holds each
/// rank's next sequence number and is advanced.
pub fn run_round(
    senders: &[UdpSocket],
    rx: &UdpSocket,
    r: &Round,
    seqs: &mut [u32],
    timeout: Duration,
) -> RoundReport {
    let ranks = r.vectors.len();
    assert_eq!(senders.len(), ranks, "one socket per rank");
    assert_eq!(r.weights.len(), ranks, "one weight per rank");
    let n = r.vectors[0].len();
    let frags: Vec<(usize, usize)> = (0..n)
        .step_by(PER_DATAGRAM)
        .map(|off| (off, PER_DATAGRAM.min(n - off)))
        .collect();
    let by_off: BTreeMap<u32, usize> = frags
        .iter()
        .enumerate()
        .map(|(f, &(off, _))| (off as u32, f))
        .collect();
    let expected: Vec<(u8, Vec<i32>)> = frags
        .iter()
        .enumerate()
        .map(|(f, &(off, count))| expected_fragment(r, off, count, f + 1 == frags.len()))
        .collect();

    let mut report = RoundReport {
        fragments: frags.len(),
        contributions: (ranks * frags.len()) as u64,
        ..Default::default()
    };
    let mut done = vec![false; frags.len()];
    let mut sent_at: Vec<Option<Instant>> = vec![None; frags.len()];
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut completed = 0usize;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 65536];
    let mut payload = Vec::new();

    while completed < frags.len() {
        while in_flight < r.window.max(1) && next < frags.len() {
            let f = next;
            for i in 0..ranks {
                let rank = (f + i) % ranks;
                let d = datagram(r, seqs, rank, f, &frags);
                send(&senders[rank], &d, r.to);
                if r.duplicates && i == 0 && f % 4 == 0 {
                    // Retransmission before the slot completes (with one
                    // rank it already has: then it is a late one).
                    send(&senders[rank], &d, r.to);
                    report.injected_duplicates += 1;
                }
            }
            sent_at[f] = Some(Instant::now());
            in_flight += 1;
            next += 1;
        }

        let now = Instant::now();
        assert!(
            now < deadline,
            "job {} round {} ({}): only {completed} of {} RESULTs after {timeout:?} (missing frag_offs {:?}); report {report:?}",
            r.job,
            r.round,
            r.op.name(),
            frags.len(),
            frags.iter().enumerate().filter(|(f, _)| !done[*f]).map(|(_, &(off, _))| off).collect::<Vec<_>>()
        );
        let oldest = sent_at
            .iter()
            .zip(&done)
            .filter(|(_, d)| !**d)
            .filter_map(|(t, _)| *t)
            .min();
        let wait = oldest.map_or(deadline - now, |t| {
            (t + RESEND_AFTER).saturating_duration_since(now)
        });
        rx.set_read_timeout(Some(wait.clamp(Duration::from_millis(1), deadline - now)))
            .expect("set_read_timeout");
        let len = match rx.recv(&mut buf) {
            Ok(len) => len,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // Loss recovery: resend every rank's contribution of the
                // fragments whose RESULT is late.
                let now = Instant::now();
                for f in 0..frags.len() {
                    if done[f] || sent_at[f].map_or(true, |t| now < t + RESEND_AFTER) {
                        continue;
                    }
                    for rank in 0..ranks {
                        send(&senders[rank], &datagram(r, seqs, rank, f, &frags), r.to);
                        report.resent += 1;
                    }
                    sent_at[f] = Some(now);
                }
                continue;
            }
            Err(e) => panic!("receiving RESULTs: {e}"),
        };
        let (hdr, be) = proto::split_agg(&buf[..len]).unwrap_or_else(|e| {
            panic!(
                "a datagram on the result port is not a valid AGG1 message ({e}): {:02x?}",
                &buf[..len.min(32)]
            )
        });
        assert!(
            hdr.is_result(),
            "a non-RESULT AGG1 datagram reached the result port: {hdr:?}"
        );
        assert_eq!(hdr.job, r.job, "RESULT of another job: {hdr:?}");
        assert_eq!(
            hdr.round, abi::Round(r.round),
            "RESULT of round {} during round {} (a second RESULT?): {hdr:?}",
            hdr.round, r.round
        );
        let f = *by_off
            .get(&hdr.frag_off)
            .unwrap_or_else(|| panic!("RESULT for an unknown frag_off: {hdr:?}"));
        assert!(
            !done[f],
            "a second RESULT for job {} round {} frag_off {}: {hdr:?}",
            r.job, r.round, hdr.frag_off
        );
        let (flags, want) = &expected[f];
        assert_eq!(hdr.rank, abi::RESULT_RANK, "RESULT rank: {hdr:?}");
        assert_eq!(hdr.op, r.op, "RESULT op: {hdr:?}");
        assert_eq!(hdr.count as usize, frags[f].1, "RESULT count: {hdr:?}");
        assert_eq!(
            hdr.flags,
            *flags,
            "RESULT flags of frag_off {} ({}): {hdr:?}",
            hdr.frag_off,
            r.op.name()
        );
        payload.resize(hdr.count as usize, 0);
        proto::read_i32_be(be, &mut payload);
        if payload != *want {
            let first = payload
                .iter()
                .zip(want)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "job {} round {} {} frag_off {}: RESULT differs from the reference reducer at element {} (got {}, want {}); {} of {} elements differ",
                r.job,
                r.round,
                r.op.name(),
                hdr.frag_off,
                hdr.frag_off as usize + first,
                payload[first],
                want[first],
                payload.iter().zip(want).filter(|(a, b)| a != b).count(),
                want.len()
            );
        }
        done[f] = true;
        completed += 1;
        in_flight -= 1;
        if r.duplicates && f % 4 == 1 {
            // A late retransmission of a completed slot.
            let rank = f % ranks;
            send(&senders[rank], &datagram(r, seqs, rank, f, &frags), r.to);
            report.injected_duplicates += 1;
        }
    }
    for s in seqs.iter_mut() {
        *s = s.wrapping_add(frags.len() as u32);
    }
    report
}

/// Sum of reports.
pub fn total(reports: &[RoundReport]) -> RoundReport {
    reports.iter().fold(RoundReport::default(), |mut t, r| {
        t.fragments += r.fragments;
        t.contributions += r.contributions;
        t.injected_duplicates += r.injected_duplicates;
        t.resent += r.resent;
        t
    })
}

/// No datagram arrives on `rx` within `quiet` (checks that no extra RESULT
/// came after the last round; call after the counters have settled).
pub fn assert_no_more_results(rx: &UdpSocket, quiet: Duration) {
    rx.set_read_timeout(Some(quiet)).expect("set_read_timeout");
    let mut buf = vec![0u8; 65536];
    match rx.recv(&mut buf) {
        Ok(len) => panic!(
            "an unexpected datagram reached the result port after the last round: {:?}",
            proto::split_agg(&buf[..len]).map(|(h, _)| h)
        ),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        Err(e) => panic!("receiving: {e}"),
    }
}

/// Poll `f` until it returns true or `timeout` passes; returns the last result.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `ip -d link show IFACE` in namespace `netns`.
pub fn link_show(netns: &str, iface: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-n", netns, "-d", "link", "show", iface])
        .output()
        .expect("run ip (iproute2 is required)");
    assert!(
        out.status.success(),
        "ip -n {netns} link show {iface}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether an XDP program is attached to `iface` in `netns` (any mode).
pub fn has_xdp(netns: &str, iface: &str) -> bool {
    let text = link_show(netns, iface);
    text.contains("prog/xdp") || text.contains(" xdp") || text.contains("xdpgeneric")
}

/// Entries the kernel's bpf_preload puts at the root of every bpffs mount.
const BPFFS_PRELOAD: [&str; 2] = ["maps.debug", "progs.debug"];

/// Files in `dir` (empty if it does not exist), without bpffs's own
/// `maps.debug` / `progs.debug`.
pub fn dir_entries(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            let mut v: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !BPFFS_PRELOAD.contains(&n.as_str()))
                .collect();
            v.sort();
            v
        }
        Err(_) => Vec::new(),
    }
}
