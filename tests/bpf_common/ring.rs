//! A member of a 4-member ring under BPF_PROG_TEST_RUN (docs/RING.md
//! "XDP"): member 1, its round made ready as the runtime does, and the
//! datagrams its neighbours would send, over IPv4 or IPv6 (the ring's
//! [`Family`]: members 10.88.0.11.. or their twins fd00:77::a58:b..).
//! Shared by tests/bpf_ring.rs and tests/bpf_ops_agree.rs.

use std::net::{IpAddr, Ipv4Addr};

use aggbox::config::RingConfig;
use aggbox::kernel::xdp::{Chain, RingPool, XdpPlane};
use aggbox::wire::abi::{self, Op, RingStat};
use libbpf_rs::{MapCore, MapFlags};

use super::{frame_offsets, ipv4_checksum, require_root, udp6_checksum_ok, Family, Frame};

pub const XDP_REDIRECT: u32 = 4;
pub const PORT: u16 = 7400;
pub const RING_ID: u16 = 40;
pub const FRAG: u32 = 8;
pub const ME: usize = 1;
pub const NEXT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x22];
pub const OWN_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x11];

/// What a member's runtime does for a call on ring `dense` of `dp`: `input`
/// into round `round`'s buffer, fragment by fragment, then the round made
/// ready for `op` in `ring_ctrl`.
pub fn make_ready(dp: &XdpPlane, dense: u32, job: &abi::RingJob, round: u32, op: Op, input: &[i32]) {
    let [data, _, ctrl] = dp.ring_memory_maps().expect("ring maps");
    let frag = job.frag_elems;
    for f in 0..job.frags {
        let mut v = vec![0u8; 4 * frag as usize];
        for (i, x) in input.iter().skip((f * frag) as usize).take(frag as usize).enumerate() {
            v[4 * i..4 * i + 4].copy_from_slice(&x.to_ne_bytes());
        }
        data.update(&job.index(abi::Round(round), f).to_ne_bytes(), &v, MapFlags::ANY).expect("ring input");
    }
    let c = abi::RingCtrl { ready_round: round, state: abi::RING_READY, finals: 0, finals_round: round, op: op as u32, round_frags: 0, pad: [0; 10] };
    ctrl.update(&dense.to_ne_bytes(), abi::as_bytes(&c), MapFlags::ANY).expect("ring ctrl");
}

/// Ring `dense`'s control block in `dp`.
pub fn ring_ctrl(dp: &XdpPlane, dense: u32) -> abi::RingCtrl {
    let [_, _, ctrl] = dp.ring_memory_maps().expect("ring maps");
    abi::from_bytes(&ctrl.lookup(&dense.to_ne_bytes(), MapFlags::ANY).unwrap().unwrap()).unwrap()
}

pub fn members() -> Vec<Ipv4Addr> {
    (0..4).map(|i| Ipv4Addr::new(10, 88, 0, 11 + i)).collect()
}

/// The members' addresses of a ring of `family`.
pub fn members_of(family: Family) -> Vec<IpAddr> {
    members().into_iter().map(|a| family.addr(a)).collect()
}

pub struct Ring {
    pub dp: XdpPlane,
    pub cfg: RingConfig,
    pub job: abi::RingJob,
    /// The ring's dense index.
    pub dense: u32,
    /// The ring memory and the ring's place in it.
    pub pool: RingPool,
    /// The round made ready last: `data` and `done` read its buffer.
    pub round: std::cell::Cell<u32>,
    /// The IP version of the ring's members.
    pub family: Family,
}

fn ring_config(id: u16, port: u16, vector_len: u32, weights: Vec<i32>, frag: u32) -> RingConfig {
    RingConfig { id, port, members: members().into_iter().map(std::net::IpAddr::V4).collect(), weights, vector_len, frag_elems: frag }
}

/// Ring `cfg`'s dense index and entry, member `ME`, at its place in `pool`;
/// an IPv6 ring's `self_addr` and `next_addr` are 0 (the program reads
/// its members' entries).
fn placed_job(cfg: &RingConfig, pool: &RingPool, family: Family) -> (u32, abi::RingJob) {
    let v4 = |a: Ipv4Addr| if family == Family::V4 { u32::from(a).to_be() } else { 0 };
    let place = pool.place_of(cfg.id).expect("placed");
    let job = abi::RingJob {
        id: cfg.id,
        port: cfg.port,
        members: 4,
        me: ME as u16,
        frag_elems: cfg.frag_elems,
        frags: cfg.frags(),
        vector_len: cfg.vector_len,
        base: place.base,
        weight_sum: cfg.weight_sum(),
        weight: cfg.weights[ME],
        self_addr: v4(members()[ME]),
        next_addr: v4(members()[ME + 1]),
    };
    (place.dense, job)
}

impl Ring {
    /// A 4-member ring of `vector_len` elements with `weights`, this node
    /// member 1, round `round` ready with op `op` and input `input`.
    pub fn new(vector_len: u32, weights: Vec<i32>) -> Ring {
        Ring::with_frag(vector_len, weights, FRAG)
    }

    pub fn with_frag(vector_len: u32, weights: Vec<i32>, frag: u32) -> Ring {
        Ring::with_pool(vector_len, weights, frag, 0)
    }

    /// [`Ring::with_frag`] with `pool_elems` more elements of ring memory
    /// (`[node] ring_pool`) for rings added later ([`Ring::replace`]).
    pub fn with_pool(vector_len: u32, weights: Vec<i32>, frag: u32, pool_elems: u32) -> Ring {
        Ring::of_family(Family::V4, vector_len, weights, frag, pool_elems)
    }

    /// [`Ring::with_pool`] of members of `family`.
    pub fn of_family(family: Family, vector_len: u32, weights: Vec<i32>, frag: u32, pool_elems: u32) -> Ring {
        require_root();
        let cfg = ring_config(RING_ID, PORT, vector_len, weights, frag);
        let pool = RingPool::reserve(std::slice::from_ref(&cfg), frag, pool_elems).expect("ring memory");
        let dp = XdpPlane::load_chain_with(Chain::detect().expect("chain"), pool.sizing()).expect("load with a ring");
        let (dense, job) = placed_job(&cfg, &pool, family);
        dp.set_ring(dense, &job, &members_of(family)).expect("set_ring");
        dp.set_ring_next_hop(dense, NEXT_MAC, OWN_MAC, 1).expect("next hop"); // lo: the test run's ingress
        Ring { dp, cfg, job, dense, pool, round: std::cell::Cell::new(0), family }
    }

    /// Remove this ring and put ring `id` on `port` of `vector_len`
    /// elements (same members, weights and fragments) where the pool
    /// places it, as a reload does.
    pub fn replace(&mut self, id: u16, port: u16, vector_len: u32) {
        self.dp.remove_ring(self.dense, &self.job).expect("remove_ring");
        let cfg = ring_config(id, port, vector_len, self.cfg.weights.clone(), self.cfg.frag_elems);
        self.pool = self.pool.place(std::slice::from_ref(&cfg)).expect("the new ring fits");
        let (dense, job) = placed_job(&cfg, &self.pool, self.family);
        self.dp.set_ring(dense, &job, &members_of(self.family)).expect("set_ring");
        self.dp.set_ring_next_hop(dense, NEXT_MAC, OWN_MAC, 1).expect("next hop");
        (self.cfg, self.job, self.dense) = (cfg, job, dense);
        self.round.set(0);
    }

    pub fn ready(&self, round: u32, op: Op, input: &[i32]) {
        self.round.set(round);
        make_ready(&self.dp, self.dense, &self.job, round, op, input);
    }

    /// Fragment `f`'s entry in the ready round's buffer.
    pub fn index(&self, f: u32) -> u32 {
        self.job.index(abi::Round(self.round.get()), f)
    }

    pub fn data(&self, f: u32) -> Vec<i32> {
        let [data, _, _] = self.dp.ring_memory_maps().unwrap();
        let v = data.lookup(&self.index(f).to_ne_bytes(), MapFlags::ANY).unwrap().unwrap();
        v.chunks(4).map(|c| i32::from_ne_bytes(c.try_into().unwrap())).collect()
    }

    pub fn done(&self, f: u32) -> abi::RingDone {
        let [_, done, _] = self.dp.ring_memory_maps().unwrap();
        abi::from_bytes(&done.lookup(&self.index(f).to_ne_bytes(), MapFlags::ANY).unwrap().unwrap()).unwrap()
    }

    pub fn ctrl(&self) -> abi::RingCtrl {
        ring_ctrl(&self.dp, self.dense)
    }

    pub fn stat(&self, s: RingStat) -> u64 {
        self.dp.ring_stats(self.dense).unwrap().count[s as usize]
    }

    pub fn count_of(&self, f: u32) -> u32 {
        (self.cfg.vector_len - f * self.cfg.frag_elems).min(self.cfg.frag_elems)
    }

    /// `d` through the program. The next hop is put into the cache again
    /// first: it holds for a second, and on an emulated kernel (the
    /// matrix's TCG guests) more than that can pass between two runs, when
    /// the program would look the next hop up (no route: to the service).
    pub fn run(&self, d: &Datagram) -> (u32, Vec<u8>) {
        self.dp.set_ring_next_hop(self.dense, NEXT_MAC, OWN_MAC, 1).expect("next hop");
        self.dp.test_runner().unwrap().run(&d.frame()).unwrap()
    }

    /// `d` as this ring's neighbours send it: over the ring's IP version.
    pub fn run_own(&self, d: &Datagram) -> (u32, Vec<u8>) {
        self.run(&d.clone().over(self.family))
    }
}

#[derive(Clone)]
pub struct Datagram {
    /// Ring id and port (default [`RING_ID`], [`PORT`]).
    pub ring: u16,
    pub port: u16,
    pub kind: u8,
    pub flags: u8,
    pub round: u32,
    pub frag: u32,
    pub hops: u16,
    pub sender: u16,
    pub op: Op,
    pub values: Vec<i32>,
    /// The IP source; the destination is member `ME` of the same version.
    pub src: IpAddr,
    pub count: Option<u16>,
    /// An 802.1Q tag (its TCI).
    pub vlan: Option<u16>,
    /// IPv6 extension headers before UDP ([`super::ip6_ext`]).
    pub ip6_ext: Vec<(u8, Vec<u8>)>,
    /// The UDP checksum field (default: 0 over IPv4, the right one over IPv6).
    pub udp_csum: Option<u16>,
    /// The IPv4 flags and fragment offset field (default DF).
    pub ip_frag: Option<u16>,
}

impl Datagram {
    pub fn new(kind: u8, round: u32, frag: u32, hops: u16, op: Op, values: Vec<i32>) -> Datagram {
        // the sender of transmission `hops` is member origin + hops - 1
        let sender = ((frag as usize % 4) + hops as usize - 1) % 4;
        Datagram {
            ring: RING_ID,
            port: PORT,
            kind,
            flags: 0,
            round,
            frag,
            hops,
            sender: sender as u16,
            op,
            values,
            src: members()[sender].into(),
            count: None,
            vlan: None,
            ip6_ext: Vec::new(),
            udp_csum: None,
            ip_frag: None,
        }
    }

    /// The same datagram over `family`: its source the IPv6 twin of an
    /// IPv4 test address (or as it is).
    pub fn over(self, family: Family) -> Datagram {
        let src = match (family, self.src) {
            (Family::V6, IpAddr::V4(a)) => family.addr(a),
            (_, src) => src,
        };
        Datagram { src, ..self }
    }

    /// The same datagram of `ring`'s id and port.
    pub fn of(self, ring: &Ring) -> Datagram {
        Datagram { ring: ring.cfg.id, port: ring.cfg.port, ..self }
    }

    pub fn frame(&self) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&abi::MAGIC_RING.to_be_bytes());
        p.extend_from_slice(&self.ring.to_be_bytes());
        p.push(self.kind);
        p.push(self.flags);
        p.extend_from_slice(&self.round.to_be_bytes());
        p.extend_from_slice(&self.frag.to_be_bytes());
        p.extend_from_slice(&self.hops.to_be_bytes());
        p.extend_from_slice(&self.count.unwrap_or(self.values.len() as u16).to_be_bytes());
        p.extend_from_slice(&self.sender.to_be_bytes());
        p.push(self.op as u8);
        p.push(0);
        for v in &self.values {
            p.extend_from_slice(&v.to_be_bytes());
        }
        let mut f = Frame::udp(self.src, p);
        f.dst = if self.src.is_ipv4() { members()[ME].into() } else { Family::V6.addr(members()[ME]) };
        f.sport = self.port;
        f.dport = self.port;
        f.vlan = self.vlan;
        f.ip6_ext = self.ip6_ext.clone();
        f.udp_csum = self.udp_csum;
        if let Some(frag) = self.ip_frag {
            f.frag = frag;
        }
        f.build()
    }
}

/// The payload of a forwarded frame, its header fields checked: MACs of
/// the next hop, source member `ME` and destination member `ME + 1` of
/// the frame's IP version, TTL or hop limit as sent (64), ports, the IPv4
/// header checksum and UDP checksum 0, or over IPv6 the UDP checksum
/// (computed here over the whole datagram), the AGR1 fields.
pub fn forwarded(out: &[u8], kind: u8, hops: u16) -> (u8, Vec<i32>) {
    assert_eq!(&out[0..6], &NEXT_MAC, "destination MAC of the next hop");
    assert_eq!(&out[6..12], &OWN_MAC, "source MAC of the next hop");
    let (family, ip_off, udp_off) = frame_offsets(out).expect("an IP frame");
    match family {
        Family::V4 => {
            let ip = &out[ip_off..ip_off + 20];
            assert_eq!(ipv4_checksum(ip), 0, "IPv4 checksum of the rewritten header");
            assert_eq!(ip[8], 64, "TTL as sent");
            assert_eq!(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[12..16]).unwrap()), members()[ME]);
            assert_eq!(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[16..20]).unwrap()), members()[ME + 1]);
            assert_eq!(u16::from_be_bytes([out[udp_off + 6], out[udp_off + 7]]), 0, "UDP checksum cleared");
        }
        Family::V6 => {
            let ip = &out[ip_off..ip_off + 40];
            assert_eq!(ip[7], 64, "hop limit as sent");
            let addr = |b: &[u8]| IpAddr::from(<[u8; 16]>::try_from(b).unwrap());
            assert_eq!(addr(&ip[8..24]), members_of(Family::V6)[ME], "source: this member");
            assert_eq!(addr(&ip[24..40]), members_of(Family::V6)[ME + 1], "destination: the next member");
            assert!(udp6_checksum_ok(out), "the UDP checksum of the forwarded datagram");
        }
    }
    let udp = &out[udp_off..udp_off + 8];
    assert_eq!(u16::from_be_bytes([udp[0], udp[1]]), PORT, "source port");
    assert_eq!(u16::from_be_bytes([udp[2], udp[3]]), PORT, "destination port");
    let p = udp_off + 8;
    let rh = &out[p..p + 24];
    assert_eq!(rh[6], kind, "kind");
    assert_eq!(u16::from_be_bytes([rh[16], rh[17]]), hops, "hops");
    assert_eq!(u16::from_be_bytes([rh[20], rh[21]]), ME as u16, "sender");
    let n = u16::from_be_bytes([rh[18], rh[19]]) as usize;
    let vals = out[p + 24..p + 24 + 4 * n].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
    (rh[7], vals)
}

