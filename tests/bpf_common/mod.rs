//! Shared helpers of the BPF_PROG_TEST_RUN tests (`tests/bpf_*.rs`): a packet
//! builder (Ethernet / IPv4 or IPv6 / UDP / AGG1), the root check, the spec
//! vectors loader and the loaded planes the tests share (`load`).
#![allow(dead_code)]

pub mod ring;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;

use aggbox::kernel::xdp::{Chain, XdpJob, XdpPlane};
use aggbox::wire::abi::{self, DropReason, Op};

/// XDP verdicts (uapi `enum xdp_action`).
pub const XDP_DROP: u32 = 1;
/// XDP_PASS.
pub const XDP_PASS: u32 = 2;

/// Address of the aggregator in every test frame.
pub const AGG_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// Address of the aggregator in every IPv6 test frame.
pub const AGG_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0x0a4d, 0x0001);

/// The IP version a test runs its frames and jobs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// The test address of this version for the IPv4 test address `a`:
    /// `a` itself, or fd00:77::a.b.c.d (every IPv4 test address has its
    /// IPv6 twin, so tables written with IPv4 addresses run over both).
    pub fn addr(self, a: Ipv4Addr) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(a),
            Family::V6 => IpAddr::V6(v6(a)),
        }
    }

    /// Offset of the UDP payload in a frame of this version without
    /// VLAN tag, IPv4 options or IPv6 extension headers.
    pub fn payload_off(self) -> usize {
        match self {
            Family::V4 => PAYLOAD_OFF,
            Family::V6 => PAYLOAD_OFF6,
        }
    }
}

/// The IPv6 twin of an IPv4 test address: fd00:77::a.b.c.d.
pub fn v6(a: Ipv4Addr) -> Ipv6Addr {
    let [a0, a1, a2, a3] = a.octets();
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, u16::from_be_bytes([a0, a1]), u16::from_be_bytes([a2, a3]))
}

/// IPv6 extension header types (Next Header values) the tests put in front
/// of UDP.
pub const IP6_HOPOPTS: u8 = 0;
pub const IP6_ROUTING: u8 = 43;
pub const IP6_FRAGMENT: u8 = 44;
pub const IP6_DSTOPTS: u8 = 60;

/// An IPv6 extension header of `kind` with `len` bytes (a multiple of 8;
/// 8 for a Fragment header): hdrlen set, options PadN, Fragment offset /
/// M flag from `frag` (host order, as the header's frag_off field). The
/// next-header byte is filled in by [`Frame::build`].
pub fn ip6_ext(kind: u8, len: usize, frag: u16) -> (u8, Vec<u8>) {
    assert!(len >= 8 && len % 8 == 0);
    let mut h = vec![0u8; len];
    match kind {
        IP6_FRAGMENT => {
            assert_eq!(len, 8, "a Fragment header is 8 bytes");
            h[2..4].copy_from_slice(&frag.to_be_bytes());
            h[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        }
        IP6_ROUTING => {
            h[1] = (len / 8 - 1) as u8;
            h[2] = 4; // segment routing header type, segments left 0
        }
        _ => {
            h[1] = (len / 8 - 1) as u8;
            // PadN over the option area
            h[2] = 1;
            h[3] = (len - 4) as u8;
        }
    }
    (kind, h)
}

/// The UDP checksum (RFC 8200 section 8.1, RFC 768) of `udp` (header with
/// its checksum field as it is, and payload) from `src` to `dst` over IPv6:
/// 0 when the datagram's checksum is right; with a zero field, the value
/// to put there (before the 0 → 0xffff rule).
pub fn udp6_checksum(src: Ipv6Addr, dst: Ipv6Addr, udp: &[u8]) -> u16 {
    let mut sum: u64 = 0;
    let mut add = |bytes: &[u8]| {
        for chunk in bytes.chunks(2) {
            sum += u64::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&(udp.len() as u32).to_be_bytes());
    add(&[0, 0, 0, 17]);
    add(udp);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Where a test frame's headers are: (IP version, IP header offset, UDP
/// header offset), following one VLAN tag, IPv4 IHL and IPv6 extension
/// headers; `None` for anything else.
pub fn frame_offsets(f: &[u8]) -> Option<(Family, usize, usize)> {
    let mut off = 14;
    let mut proto = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    if proto == 0x8100 || proto == 0x88a8 {
        proto = u16::from_be_bytes([*f.get(16)?, *f.get(17)?]);
        off = 18;
    }
    match proto {
        0x0800 => Some((Family::V4, off, off + usize::from(*f.get(off)? & 0x0f) * 4)),
        0x86dd => {
            let mut next = *f.get(off + 6)?;
            let mut u = off + 40;
            while matches!(next, IP6_HOPOPTS | IP6_ROUTING | IP6_DSTOPTS | IP6_FRAGMENT) {
                let len = if next == IP6_FRAGMENT { 8 } else { (usize::from(*f.get(u + 1)?) + 1) * 8 };
                next = *f.get(u)?;
                u += len;
            }
            Some((Family::V6, off, u))
        }
        _ => None,
    }
}

/// Whether the UDP checksum of an IPv6 test frame is right and not 0
/// (what the receiving stack requires).
pub fn udp6_checksum_ok(f: &[u8]) -> bool {
    let (fam, ip, u) = frame_offsets(f).expect("an IP frame");
    assert_eq!(fam, Family::V6);
    let src: [u8; 16] = f[ip + 8..ip + 24].try_into().unwrap();
    let dst: [u8; 16] = f[ip + 24..ip + 40].try_into().unwrap();
    let ulen = usize::from(u16::from_be_bytes([f[u + 4], f[u + 5]]));
    f[u + 6..u + 8] != [0, 0] && udp6_checksum(src.into(), dst.into(), &f[u..u + ulen]) == 0
}
/// UDP port the test jobs listen on.
pub const JOB_PORT: u16 = 7000;
/// UDP port the test jobs deliver results to.
pub const RESULT_PORT: u16 = 7001;
/// UDP source port of every test contribution.
pub const SRC_PORT: u16 = 40000;

/// Fail (never skip) when the tests cannot use BPF.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the BPF_PROG_TEST_RUN tests need root (CAP_BPF + CAP_NET_ADMIN); run them with sudo: \
         `sudo -E cargo test --test bpf_xdp`"
    );
}

/// Loaded planes of this test binary that no test holds. A load spends
/// about 2 s in the verifier here and about a minute under the matrix's
/// emulation; a test takes an idle plane, reset to its state at load
/// (`XdpPlane::reset`), and only loads when none is idle, so a binary loads
/// about as many planes as tests run at once.
static IDLE_PLANES: Mutex<Vec<XdpPlane>> = Mutex::new(Vec::new());

/// One test's dataplane, in the state of a fresh load; it goes back to the
/// idle planes when the test is done with it, unless the test failed (a
/// failed test may leave it in any state, even attached).
pub struct TestPlane(Option<XdpPlane>);

impl std::ops::Deref for TestPlane {
    type Target = XdpPlane;
    fn deref(&self) -> &XdpPlane {
        self.0.as_ref().expect("the plane is held until drop")
    }
}

impl Drop for TestPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        if let Some(dp) = self.0.take() {
            IDLE_PLANES.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(dp);
        }
    }
}

/// A dataplane of the chain `XdpPlane::load` picks, in the state of a fresh
/// load, or fail with the verifier's message.
pub fn load() -> TestPlane {
    match Chain::detect() {
        Ok(chain) => load_chain(chain),
        Err(err) => panic!("choosing the XDP chain: {err}"),
    }
}

/// A dataplane of `chain` in the state of a fresh load: an idle one reset,
/// or a new load (failing with the verifier's message).
pub fn load_chain(chain: Chain) -> TestPlane {
    require_root();
    let idle = {
        let mut idle = IDLE_PLANES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let found = idle.iter().position(|dp| dp.chain() == chain);
        found.map(|index| idle.swap_remove(index))
    };
    if let Some(dp) = idle {
        if let Err(err) = dp.reset() {
            panic!("resetting a loaded XDP plane failed: {err:#}");
        }
        return TestPlane(Some(dp));
    }
    match XdpPlane::load_chain(chain) {
        Ok(dp) => TestPlane(Some(dp)),
        Err(err) => panic!("loading the XDP program failed: {err:#?}"),
    }
}

/// IPv4 header checksum (RFC 1071) over `hdr`.
pub fn ipv4_checksum(hdr: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in hdr.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Describes one test frame; `build()` turns it into bytes.
#[derive(Debug, Clone)]
pub struct Frame {
    pub ethertype: u16,
    pub vlan: Option<u16>,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    /// IPv4 option bytes (multiple of 4).
    pub ip_options: Vec<u8>,
    /// IPv4 flags + fragment offset field (host order).
    pub frag: u16,
    /// IPv6 extension headers before UDP, in order: (type, bytes), as
    /// [`ip6_ext`] makes them (their next-header bytes are filled in).
    pub ip6_ext: Vec<(u8, Vec<u8>)>,
    /// The UDP checksum field. `None`: 0 over IPv4 (no checksum), the right
    /// one over IPv6 (where 0 is not allowed).
    pub udp_csum: Option<u16>,
    pub sport: u16,
    pub dport: u16,
    pub payload: Vec<u8>,
    /// Override of the UDP length field (default 8 + payload).
    pub udp_len: Option<u16>,
    /// Bytes appended after the datagram (Ethernet padding).
    pub trailer: usize,
}

impl Frame {
    /// A UDP datagram from `src` to the aggregator's job port.
    /// An IPv6 source makes an IPv6 frame to [`AGG_ADDR6`].
    pub fn udp(src: impl Into<IpAddr>, payload: Vec<u8>) -> Frame {
        let src = src.into();
        Frame {
            ethertype: if src.is_ipv4() { 0x0800 } else { 0x86dd },
            vlan: None,
            src,
            dst: if src.is_ipv4() { AGG_ADDR.into() } else { AGG_ADDR6.into() },
            protocol: 17,
            ip_options: Vec::new(),
            frag: 0x4000, // DF
            ip6_ext: Vec::new(),
            udp_csum: None,
            sport: SRC_PORT,
            dport: JOB_PORT,
            payload,
            udp_len: None,
            trailer: 0,
        }
    }

    /// The frame's bytes (valid IPv4 header checksum, UDP checksum 0; over
    /// IPv6 a valid UDP checksum).
    pub fn build(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(64 + self.payload.len());
        f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // dst MAC
        f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // src MAC
        if let Some(tci) = self.vlan {
            f.extend_from_slice(&0x8100u16.to_be_bytes());
            f.extend_from_slice(&tci.to_be_bytes());
        }
        f.extend_from_slice(&self.ethertype.to_be_bytes());
        if self.ethertype == 0x86dd && self.src.is_ipv6() {
            self.build_ipv6(&mut f);
            return f;
        }
        if self.ethertype != 0x0800 {
            // ARP-ish body
            f.extend_from_slice(&[0u8; 28]);
            return f;
        }
        let ihl = 5 + self.ip_options.len() / 4;
        let l4_len = if self.protocol == 17 {
            8 + self.payload.len()
        } else {
            self.payload.len()
        };
        let tot_len = (ihl * 4 + l4_len) as u16;
        let ip_start = f.len();
        f.push(0x40 | ihl as u8);
        f.push(0);
        f.extend_from_slice(&tot_len.to_be_bytes());
        f.extend_from_slice(&0x1234u16.to_be_bytes());
        f.extend_from_slice(&self.frag.to_be_bytes());
        f.push(64);
        f.push(self.protocol);
        f.extend_from_slice(&[0, 0]);
        // An IPv4 frame of IPv6 addresses (a test that changed the
        // EtherType): their last four bytes.
        let v4 = |a: IpAddr| match a {
            IpAddr::V4(a) => a,
            IpAddr::V6(a) => {
                let o = a.octets();
                Ipv4Addr::new(o[12], o[13], o[14], o[15])
            }
        };
        f.extend_from_slice(&v4(self.src).octets());
        f.extend_from_slice(&v4(self.dst).octets());
        f.extend_from_slice(&self.ip_options);
        let csum = ipv4_checksum(&f[ip_start..]);
        f[ip_start + 10..ip_start + 12].copy_from_slice(&csum.to_be_bytes());
        if self.protocol == 17 {
            let udp_len = self.udp_len.unwrap_or((8 + self.payload.len()) as u16);
            f.extend_from_slice(&self.sport.to_be_bytes());
            f.extend_from_slice(&self.dport.to_be_bytes());
            f.extend_from_slice(&udp_len.to_be_bytes());
            f.extend_from_slice(&self.udp_csum.unwrap_or(0).to_be_bytes());
        }
        f.extend_from_slice(&self.payload);
        f.extend(std::iter::repeat(0u8).take(self.trailer));
        f
    }

    /// The IPv6 header, extension headers, UDP (or `protocol`) datagram.
    fn build_ipv6(&self, f: &mut Vec<u8>) {
        let v6 = |a: IpAddr| match a {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        let (src, dst) = (v6(self.src), v6(self.dst));
        let l4_len = if self.protocol == 17 { 8 + self.payload.len() } else { self.payload.len() };
        let ext_len: usize = self.ip6_ext.iter().map(|(_, h)| h.len()).sum();
        f.extend_from_slice(&0x6000_0000u32.to_be_bytes()); // version 6, class 0, flow 0
        f.extend_from_slice(&((ext_len + l4_len) as u16).to_be_bytes());
        f.push(self.ip6_ext.first().map_or(self.protocol, |(kind, _)| *kind));
        f.push(64);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        for (i, (_, h)) in self.ip6_ext.iter().enumerate() {
            let mut h = h.clone();
            h[0] = self.ip6_ext.get(i + 1).map_or(self.protocol, |(kind, _)| *kind);
            f.extend_from_slice(&h);
        }
        let udp = f.len();
        if self.protocol == 17 {
            let udp_len = self.udp_len.unwrap_or((8 + self.payload.len()) as u16);
            f.extend_from_slice(&self.sport.to_be_bytes());
            f.extend_from_slice(&self.dport.to_be_bytes());
            f.extend_from_slice(&udp_len.to_be_bytes());
            f.extend_from_slice(&[0, 0]);
        }
        f.extend_from_slice(&self.payload);
        if self.protocol == 17 {
            let csum = self.udp_csum.unwrap_or_else(|| match udp6_checksum(src, dst, &f[udp..]) {
                0 => 0xffff,
                c => c,
            });
            f[udp + 6..udp + 8].copy_from_slice(&csum.to_be_bytes());
        }
        f.extend(std::iter::repeat(0u8).take(self.trailer));
    }
}

/// Offset of the UDP payload in a frame built without VLAN and IP options.
pub const PAYLOAD_OFF: usize = 14 + 20 + 8;
/// The same over IPv6 (no extension headers).
pub const PAYLOAD_OFF6: usize = 14 + 40 + 8;

/// An AGG1 datagram.
#[derive(Debug, Clone)]
pub struct Agg {
    pub job: u16,
    pub rank: u16,
    pub seq: u32,
    pub round: u32,
    pub frag_off: u32,
    pub op: u8,
    pub flags: u8,
    pub count: u16,
    pub values: Vec<i32>,
}

impl Agg {
    /// A contribution of `values` (count = values.len()).
    pub fn new(job: u16, rank: u16, op: u8, values: Vec<i32>) -> Agg {
        Agg {
            job,
            rank,
            seq: 1,
            round: 1,
            frag_off: 0,
            op,
            flags: 0,
            count: values.len() as u16,
            values,
        }
    }

    /// The datagram's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(24 + 4 * self.values.len());
        p.extend_from_slice(&abi::MAGIC_AGG.to_be_bytes());
        p.extend_from_slice(&self.job.to_be_bytes());
        p.extend_from_slice(&self.rank.to_be_bytes());
        p.extend_from_slice(&self.seq.to_be_bytes());
        p.extend_from_slice(&self.round.to_be_bytes());
        p.extend_from_slice(&self.frag_off.to_be_bytes());
        p.push(self.op);
        p.push(self.flags);
        p.extend_from_slice(&self.count.to_be_bytes());
        for v in &self.values {
            p.extend_from_slice(&v.to_be_bytes());
        }
        p
    }
}

/// Decode hex (no separators).
pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// Map a spec vector `why` string to the drop reason the kernel counts.
pub fn why_to_reason(why: &str) -> DropReason {
    match why {
        "truncated header" => DropReason::TruncatedHeader,
        "invalid op" => DropReason::InvalidOp,
        "reserved flag bit set" => DropReason::ReservedFlag,
        "zero count" => DropReason::ZeroCount,
        "count larger than datagram" => DropReason::CountTooLarge,
        "count smaller than datagram" => DropReason::CountTooSmall,
        "unknown job" => DropReason::UnknownJob,
        "rank out of range" => DropReason::RankOutOfRange,
        "source address does not match rank" => DropReason::SourceMismatch,
        "beyond vector length" | "frag_off + count beyond vector_len" => DropReason::BeyondVector,
        "retransmission" => DropReason::Retransmission,
        "stale round" => DropReason::StaleRound,
        other => {
            panic!("spec vector `why` string {other:?} has no drop reason mapping; add it here")
        }
    }
}

/// Load `shared/spec/vectors/<name>`; a missing file fails the test.
pub fn spec_vectors(name: &str) -> serde_json::Value {
    let path = format!(
        "{}/../shared/spec/vectors/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("spec vectors {path} missing or unreadable ({e}); they are required")
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("spec vectors {path}: invalid JSON: {e}"))
}

/// XdpJob of a spec vector case's `job` object.
pub fn job_from_vector(job: &serde_json::Value) -> XdpJob {
    job_from_vector_in(Family::V4, job)
}

/// [`job_from_vector`] with ranks of IP version `fam`: the vectors' IPv4
/// rank addresses, or their IPv6 twins ([`Family::addr`]).
pub fn job_from_vector_in(fam: Family, job: &serde_json::Value) -> XdpJob {
    let id = job["id"].as_u64().expect("job.id") as u16;
    let ranks = job["rank_ips"]
        .as_array()
        .expect("job.rank_ips")
        .iter()
        .map(|v| {
            fam.addr(v.as_str()
                .expect("rank ip")
                .parse::<Ipv4Addr>()
                .expect("rank ip parses"))
        })
        .collect::<Vec<_>>();
    let weights = job
        .get("weights")
        .and_then(|w| w.as_array())
        .map(|w| {
            w.iter()
                .map(|v| v.as_i64().expect("weight") as i32)
                .collect()
        })
        .unwrap_or_default();
    let workers = job["workers"].as_u64().expect("job.workers") as usize;
    assert_eq!(workers, ranks.len(), "vector job: workers vs rank_ips");
    XdpJob {
        id,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks,
        weights,
        vector_len: job.get("vector_len").and_then(|v| v.as_u64()).unwrap_or(0) as u32,
        slots: 0,
        flags: 0,
        result_group: None,
        window: 0,
        frag_elems: 0,
    }
}

/// The counter deltas between two stats snapshots, as (label, packets, bytes),
/// only those that changed.
/// Run one frame through the entry program; returns the single counter
/// label that moved (exactly one must) and the frame as the program left it.
pub fn run_one(dp: &XdpPlane, frame: &[u8]) -> (&'static str, Vec<u8>) {
    let before = dp.stats().expect("stats");
    let (_, out) = dp.test_run(frame).expect("test_run");
    let d = deltas(&before, &dp.stats().expect("stats"));
    assert_eq!(d.len(), 1, "{d:?}");
    (d[0].0, out)
}

pub fn deltas(
    before: &aggbox::kernel::xdp::Stats,
    after: &aggbox::kernel::xdp::Stats,
) -> Vec<(&'static str, u64, u64)> {
    let mut out = Vec::new();
    for (label, a) in after.outcomes.iter().chain(after.drops.iter()) {
        let b = before
            .outcomes
            .get(label)
            .or_else(|| before.drops.get(label))
            .copied()
            .unwrap_or_default();
        if a.packets != b.packets || a.bytes != b.bytes {
            out.push((*label, a.packets - b.packets, a.bytes - b.bytes));
        }
    }
    out
}

// ---- Reducing one fragment through the chain, checked against the reducer
// (bpf_jumbo, bpf_linear). ----

/// Job of [`reduce_one`].
pub const REDUCE_JOB: u16 = 31;

/// Address of rank `rank` of [`reduce_job`].
pub fn reduce_addr(rank: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 2, rank as u8 + 1)
}

/// Job [`REDUCE_JOB`] of `workers` ranks with `weights` (empty: all 1).
pub fn reduce_job(workers: u16, weights: Vec<i32>) -> XdpJob {
    reduce_job_in(Family::V4, workers, weights)
}

/// [`reduce_job`] of ranks of IP version `fam` (`fam.addr(reduce_addr(r))`).
pub fn reduce_job_in(fam: Family, workers: u16, weights: Vec<i32>) -> XdpJob {
    XdpJob {
        id: REDUCE_JOB,
        port: JOB_PORT,
        result_port: RESULT_PORT,
        ranks: (0..workers).map(|r| fam.addr(reduce_addr(r))).collect(),
        weights,
        vector_len: 0,
        slots: 0,
        flags: 0,
        result_group: None,
        window: 0,
        frag_elems: 0,
    }
}

/// Counter delta of one label between two snapshots.
pub fn stat_delta(before: &aggbox::kernel::xdp::Stats, after: &aggbox::kernel::xdp::Stats, label: &str) -> u64 {
    let get = |s: &aggbox::kernel::xdp::Stats| {
        s.outcomes.get(label).or_else(|| s.drops.get(label)).map(|c| c.packets).unwrap_or(0)
    };
    get(after) - get(before)
}

/// A RESULT frame's headers against the contribution it was made from:
/// Ethernet and IP headers (options, extension headers) untouched, UDP
/// source port and length kept, destination [`RESULT_PORT`], checksum 0
/// over IPv4 and right (never 0) over IPv6. Returns the offset of the AGG1
/// header.
pub fn check_result_headers(input: &[u8], out: &[u8]) -> usize {
    let (fam, _, u) = frame_offsets(input).expect("an IP frame");
    assert_eq!(out.len(), input.len(), "RESULT rewritten in place");
    assert_eq!(out[..u], input[..u], "Ethernet and IP headers untouched");
    assert_eq!(out[u..u + 2], input[u..u + 2], "UDP source port kept");
    assert_eq!(u16::from_be_bytes([out[u + 2], out[u + 3]]), RESULT_PORT, "UDP destination = job.result_port");
    assert_eq!(out[u + 4..u + 6], input[u + 4..u + 6], "UDP length kept");
    match fam {
        Family::V4 => assert_eq!(out[u + 6..u + 8], [0, 0], "UDP checksum 0 (IPv4)"),
        Family::V6 => assert!(udp6_checksum_ok(out), "a right, nonzero UDP checksum (IPv6)"),
    }
    u + 8
}

/// Send one fragment of `vectors` (one per rank) and check the RESULT
/// against the reference reducer, byte for byte.
pub fn reduce_one(dp: &XdpPlane, op: Op, weights: &[i32], vectors: &[Vec<i32>], round: u32, frag_off: u32) {
    reduce_one_in(dp, Family::V4, op, weights, vectors, round, frag_off)
}

/// [`reduce_one`] over IP version `fam` ([`reduce_job_in`]'s ranks).
pub fn reduce_one_in(dp: &XdpPlane, fam: Family, op: Op, weights: &[i32], vectors: &[Vec<i32>], round: u32, frag_off: u32) {
    let workers = vectors.len() as u16;
    let count = vectors[0].len();
    let before = dp.stats().unwrap();
    let mut last = None;
    for (rank, values) in vectors.iter().enumerate() {
        let mut a = Agg::new(REDUCE_JOB, rank as u16, op as u8, values.clone());
        a.round = round;
        a.frag_off = frag_off;
        a.seq = round * 1000 + rank as u32;
        if rank == 1 {
            a.flags = abi::AGG_F_LAST_FRAGMENT;
        }
        let frame = Frame::udp(fam.addr(reduce_addr(rank as u16)), a.bytes()).build();
        let (verdict, out) = dp.test_run(&frame).unwrap();
        if rank + 1 < vectors.len() {
            assert_eq!(verdict, XDP_DROP, "{op:?} count {count} rank {rank}: absorbed");
        } else {
            assert_eq!(verdict, XDP_PASS, "{op:?} count {count}: RESULT passes");
            last = Some((frame, out));
        }
    }
    let after = dp.stats().unwrap();
    assert_eq!(stat_delta(&before, &after, "accepted"), workers as u64 - 1, "{op:?} count {count}");
    assert_eq!(stat_delta(&before, &after, "result"), 1, "{op:?} count {count}");
    assert_eq!(after.dropped_packets(), before.dropped_packets(), "{op:?} count {count}: no drops");

    let (input, out) = last.unwrap();
    let a = &out[check_result_headers(&input, &out)..];
    assert_eq!(u16::from_be_bytes([a[6], a[7]]), abi::RESULT_RANK);
    assert_eq!(u32::from_be_bytes(a[12..16].try_into().unwrap()), round);
    assert_eq!(u32::from_be_bytes(a[16..20].try_into().unwrap()), frag_off);
    assert_eq!(a[20], op as u8);
    assert_eq!(u16::from_be_bytes([a[22], a[23]]) as usize, count);

    let contributions: Vec<(&[i32], i32)> =
        vectors.iter().enumerate().map(|(r, v)| (v.as_slice(), weights.get(r).copied().unwrap_or(1))).collect();
    let expected = aggbox::wire::reducer::reduce(op, &contributions).unwrap();
    let mut want = Vec::new();
    expected.write_be(&mut want);
    assert_eq!(a[21], expected.flags() | abi::AGG_F_RESULT | abi::AGG_F_LAST_FRAGMENT, "{op:?} count {count}: flags");
    if a[24..] != want[..] {
        let first = a[24..].chunks(4).zip(want.chunks(4)).position(|(g, w)| g != w).unwrap();
        panic!(
            "{op:?} count {count}: element {first} is {:?}, reducer says {:?}",
            &a[24 + 4 * first..24 + 4 * first + 4],
            &want[4 * first..4 * first + 4]
        );
    }
    assert_eq!(dp.slots_in_use(), 0, "slot released");
    assert_eq!(dp.blocks_in_use().unwrap(), 0, "blocks released");
}

/// The ops the kernel aggregates.
pub fn kernel_ops() -> Vec<Op> {
    Op::ALL.into_iter().filter(|op| op.runs_in_kernel()).collect()
}
