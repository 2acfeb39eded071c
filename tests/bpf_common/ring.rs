//! A member of a 4-member ring under BPF_PROG_TEST_RUN (docs/RING.md
//! "XDP"): member 1, its round made ready as the runtime does, and the
//! datagrams its neighbours would send. Shared by tests/bpf_ring.rs and
//! tests/bpf_ops_agree.rs.

use std::net::Ipv4Addr;

use aggbox::config::RingConfig;
use aggbox::kernel::xdp::{Chain, RingPool, XdpPlane};
use aggbox::wire::abi::{self, Op, RingStat};
use libbpf_rs::{MapCore, MapFlags};

use super::{ipv4_checksum, require_root, Frame};

pub const XDP_REDIRECT: u32 = 4;
pub const PORT: u16 = 7400;
pub const RING_ID: u16 = 40;
pub const FRAG: u32 = 8;
pub const ME: usize = 1;
pub const NEXT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x22];
pub const OWN_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x11];

pub fn members() -> Vec<Ipv4Addr> {
    (0..4).map(|i| Ipv4Addr::new(10, 88, 0, 11 + i)).collect()
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
}

fn ring_config(id: u16, port: u16, vector_len: u32, weights: Vec<i32>, frag: u32) -> RingConfig {
    RingConfig { id, port, members: members().into_iter().map(std::net::IpAddr::V4).collect(), weights, vector_len, frag_elems: frag }
}

/// Ring `cfg`'s dense index and entry, member `ME`, at its place in `pool`.
fn placed_job(cfg: &RingConfig, pool: &RingPool) -> (u32, abi::RingJob) {
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
        self_addr: u32::from(members()[ME]).to_be(),
        next_addr: u32::from(members()[ME + 1]).to_be(),
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
        require_root();
        let cfg = ring_config(RING_ID, PORT, vector_len, weights, frag);
        let pool = RingPool::reserve(std::slice::from_ref(&cfg), frag, pool_elems).expect("ring memory");
        let dp = XdpPlane::load_chain_with(Chain::detect().expect("chain"), pool.sizing()).expect("load with a ring");
        let (dense, job) = placed_job(&cfg, &pool);
        dp.set_ring(dense, &job, &members()).expect("set_ring");
        dp.set_ring_next_hop(dense, NEXT_MAC, OWN_MAC, 1).expect("next hop"); // lo: the test run's ingress
        Ring { dp, cfg, job, dense, pool, round: std::cell::Cell::new(0) }
    }

    /// Remove this ring and put ring `id` on `port` of `vector_len`
    /// elements (same members, weights and fragments) where the pool
    /// places it, as a reload does.
    pub fn replace(&mut self, id: u16, port: u16, vector_len: u32) {
        self.dp.remove_ring(self.dense, &self.job).expect("remove_ring");
        let cfg = ring_config(id, port, vector_len, self.cfg.weights.clone(), self.cfg.frag_elems);
        self.pool = self.pool.place(std::slice::from_ref(&cfg)).expect("the new ring fits");
        let (dense, job) = placed_job(&cfg, &self.pool);
        self.dp.set_ring(dense, &job, &members()).expect("set_ring");
        self.dp.set_ring_next_hop(dense, NEXT_MAC, OWN_MAC, 1).expect("next hop");
        (self.cfg, self.job, self.dense) = (cfg, job, dense);
        self.round.set(0);
    }

    pub fn ready(&self, round: u32, op: Op, input: &[i32]) {
        self.round.set(round);
        let [data, _, ctrl] = self.dp.ring_memory_maps().unwrap();
        let frag = self.cfg.frag_elems;
        for f in 0..self.cfg.frags() {
            let mut v = vec![0u8; 4 * frag as usize];
            for (i, x) in input.iter().skip((f * frag) as usize).take(frag as usize).enumerate() {
                v[4 * i..4 * i + 4].copy_from_slice(&x.to_ne_bytes());
            }
            data.update(&self.index(f).to_ne_bytes(), &v, MapFlags::ANY).unwrap();
        }
        let c = abi::RingCtrl {
            ready_round: round,
            state: abi::RING_READY,
            finals: 0,
            finals_round: round,
            op: op as u32,
            round_frags: 0,
            pad: [0; 10],
        };
        ctrl.update(&self.dense.to_ne_bytes(), abi::as_bytes(&c), MapFlags::ANY).unwrap();
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
        let [_, _, ctrl] = self.dp.ring_memory_maps().unwrap();
        abi::from_bytes(&ctrl.lookup(&self.dense.to_ne_bytes(), MapFlags::ANY).unwrap().unwrap()).unwrap()
    }

    pub fn stat(&self, s: RingStat) -> u64 {
        self.dp.ring_stats(self.dense).unwrap().count[s as usize]
    }

    pub fn count_of(&self, f: u32) -> u32 {
        (self.cfg.vector_len - f * self.cfg.frag_elems).min(self.cfg.frag_elems)
    }

    pub fn run(&self, d: &Datagram) -> (u32, Vec<u8>) {
        self.dp.test_runner().unwrap().run(&d.frame()).unwrap()
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
    pub src: Ipv4Addr,
    pub count: Option<u16>,
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
            src: members()[sender],
            count: None,
        }
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
        f.dst = members()[ME].into();
        f.sport = self.port;
        f.dport = self.port;
        f.build()
    }
}

/// The payload of a forwarded frame, its header fields checked.
pub fn forwarded(out: &[u8], kind: u8, hops: u16) -> (u8, Vec<i32>) {
    assert_eq!(&out[0..6], &NEXT_MAC, "destination MAC of the next hop");
    assert_eq!(&out[6..12], &OWN_MAC, "source MAC of the next hop");
    let ip = &out[14..34];
    assert_eq!(ipv4_checksum(ip), 0, "IPv4 checksum of the rewritten header");
    assert_eq!(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[12..16]).unwrap()), members()[ME]);
    assert_eq!(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[16..20]).unwrap()), members()[ME + 1]);
    let udp = &out[34..42];
    assert_eq!(u16::from_be_bytes([udp[0], udp[1]]), PORT);
    assert_eq!(u16::from_be_bytes([udp[6], udp[7]]), 0, "UDP checksum cleared");
    let rh = &out[42..66];
    assert_eq!(rh[6], kind, "kind");
    assert_eq!(u16::from_be_bytes([rh[16], rh[17]]), hops, "hops");
    assert_eq!(u16::from_be_bytes([rh[20], rh[21]]), ME as u16, "sender");
    let n = u16::from_be_bytes([rh[18], rh[19]]) as usize;
    let vals = out[66..66 + 4 * n].chunks(4).map(|c| i32::from_be_bytes(c.try_into().unwrap())).collect();
    (rh[7], vals)
}

