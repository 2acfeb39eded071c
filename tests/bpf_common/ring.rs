//! A member of a 4-member ring under BPF_PROG_TEST_RUN (docs/RING.md
//! "XDP"): member 1, its round made ready as the runtime does, and the
//! datagrams its neighbours would send. Shared by tests/bpf_ring.rs and
//! tests/bpf_ops_agree.rs.

use std::net::Ipv4Addr;

use aggbox::config::RingConfig;
use aggbox::kernel::xdp::{Chain, RingSizing, XdpPlane};
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
    /// The round made ready last: `data` and `done` read its buffer.
    pub round: std::cell::Cell<u32>,
}

impl Ring {
    /// A 4-member ring of `vector_len` elements with `weights`, this node
    /// member 1, round `round` ready with op `op` and input `input`.
    pub fn new(vector_len: u32, weights: Vec<i32>) -> Ring {
        Ring::with_frag(vector_len, weights, FRAG)
    }

    pub fn with_frag(vector_len: u32, weights: Vec<i32>, frag: u32) -> Ring {
        require_root();
        let cfg = RingConfig {
            id: RING_ID,
            port: PORT,
            members: members(),
            weights,
            vector_len,
            frag_elems: frag,
        };
        let (sizing, bases) = RingSizing::of(std::slice::from_ref(&cfg));
        let dp = XdpPlane::load_chain_with(Chain::detect().expect("chain"), sizing).expect("load with a ring");
        let job = abi::RingJob {
            id: RING_ID,
            port: PORT,
            members: 4,
            me: ME as u16,
            frag_elems: frag,
            frags: cfg.frags(),
            vector_len,
            base: bases[0],
            weight_sum: cfg.weight_sum(),
            weight: cfg.weights[ME],
            self_addr: u32::from(members()[ME]).to_be(),
            next_addr: u32::from(members()[ME + 1]).to_be(),
        };
        dp.set_ring(0, &job, &cfg.members).expect("set_ring");
        dp.set_ring_next_hop(0, NEXT_MAC, OWN_MAC, 1).expect("next hop"); // lo: the test run's ingress
        Ring { dp, cfg, job, round: std::cell::Cell::new(0) }
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
        ctrl.update(&0u32.to_ne_bytes(), abi::as_bytes(&c), MapFlags::ANY).unwrap();
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
        abi::from_bytes(&ctrl.lookup(&0u32.to_ne_bytes(), MapFlags::ANY).unwrap().unwrap()).unwrap()
    }

    pub fn stat(&self, s: RingStat) -> u64 {
        self.dp.ring_stats(0).unwrap().count[s as usize]
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

    pub fn frame(&self) -> Vec<u8> {
        let mut p = Vec::new();
        p.extend_from_slice(&abi::MAGIC_RING.to_be_bytes());
        p.extend_from_slice(&RING_ID.to_be_bytes());
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
        f.dst = members()[ME];
        f.sport = PORT;
        f.dport = PORT;
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

