//! The cargo-fuzz targets of fuzz/ (decode_message, split_agg, ack_bitmap,
//! config_parse, control_request) as a bounded, deterministic random fuzz loop, so that CI
//! (stable toolchain, no libFuzzer) runs the same properties on every
//! change. Inputs: mutations (bit flips, truncation, extension, byte edits,
//! splices) of valid seeds. `AGGBOX_SOAK=1` runs 20× longer. No root needed.

use aggbox::wire::proto::{self, SeqBitmap};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

fn iterations() -> usize {
    if std::env::var("AGGBOX_SOAK").is_ok_and(|v| v == "1") { 4_000_000 } else { 200_000 }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut b = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        let len = b.len();
        match rng.below(7) {
            0 if len > 0 => { let i = rng.below(len); b[i] ^= 1 << rng.below(8); }
            1 => b.truncate(rng.below(len + 1)),
            2 => { let n = 1 + rng.below(16); b.extend((0..n).map(|_| rng.next() as u8)); }
            3 if len > 0 => { let i = rng.below(len); b[i] = [0u8, 0xff, 0x7f, 0x80, 1][rng.below(5)]; }
            4 if len > 0 => { let i = rng.below(len.min(24)); b[i] = rng.next() as u8; }
            5 => { let o = &seeds[rng.below(seeds.len())]; let at = rng.below(o.len() + 1); b.extend_from_slice(&o[at..]); }
            _ if len >= 24 => { let c = [0u16, 1, 2, 0xffff][rng.below(4)]; b[22..24].copy_from_slice(&c.to_be_bytes()); }
            _ => {}
        }
    }
    b
}

fn message_seeds() -> Vec<Vec<u8>> {
    let mut seeds = Vec::new();
    for (op, flags, count) in [(0u8, 0u8, 1usize), (4, 1, 3), (8, 0, 2), (0, 8, 2), (5, 0x0b, 5)] {
        let mut b = Vec::new();
        b.extend_from_slice(&aggbox::wire::abi::MAGIC_AGG.to_be_bytes());
        b.extend_from_slice(&[0, 7, 0, 1, 0, 0, 0, 9, 0, 0, 0, 2, 0, 0, 1, 0, op, flags]);
        b.extend_from_slice(&(count as u16).to_be_bytes());
        b.extend((0..count * 4).map(|i| i as u8));
        seeds.push(b);
    }
    let mut bc = aggbox::wire::abi::MAGIC_BCAST.to_be_bytes().to_vec();
    bc.extend_from_slice(&[0, 0, 0, 3, 0, 0, 0, 1, 0, 9, 1, 0, b'h', b'i']);
    seeds.push(bc);
    for nbits in [1u16, 8, 9, 1024] {
        let mut ak = aggbox::wire::abi::MAGIC_ACK.to_be_bytes().to_vec();
        ak.extend_from_slice(&[0, 7, 0, 1, 0, 0, 4, 0]);
        ak.extend_from_slice(&nbits.to_be_bytes());
        ak.extend_from_slice(&[0, 0]);
        let n = (nbits as usize).div_ceil(8);
        ak.extend((0..n).map(|i| if i + 1 == n && nbits % 8 != 0 { (1u8 << (nbits % 8)) - 1 } else { 0xff }));
        seeds.push(ak);
    }
    seeds
}

#[test]
fn decode_message_roundtrip_never_panics() {
    let seeds = message_seeds();
    let mut rng = Rng(1);
    let mut ok = 0;
    for _ in 0..iterations() {
        let data = mutate(&mut rng, &seeds);
        if let Ok(msg) = proto::decode(&data) {
            let mut out = Vec::new();
            msg.encode_into(&mut out).expect("a decoded message encodes");
            assert_eq!(out, data, "decode/encode round trip");
            assert_eq!(proto::classify(&data), Some(msg.kind()));
            ok += 1;
        }
    }
    eprintln!("decode_message: {ok} of {} mutants decoded", iterations());
    assert!(ok > 0);
}

#[test]
fn split_agg_accepts_only_exact_datagrams() {
    let seeds = message_seeds();
    let mut rng = Rng(2);
    for _ in 0..iterations() {
        let data = mutate(&mut rng, &seeds);
        if let Ok((hdr, payload)) = proto::split_agg(&data) {
            assert_eq!(payload.len(), 4 * hdr.count as usize);
            assert_eq!(data.len(), 24 + payload.len());
            assert_eq!(&proto::agg_header_bytes(&hdr)[..], &data[..24]);
        }
    }
}

#[test]
fn ack_bitmap_from_bytes_is_consistent() {
    let mut rng = Rng(3);
    for _ in 0..iterations() {
        let nbits = [0u16, 1, 7, 8, 9, 63, 64, 65, 1023, 1024, 1025, 0xffff][rng.below(12)];
        let want = (nbits as usize).div_ceil(8);
        let len = if rng.below(4) == 0 { rng.below(140) } else { want };
        let bytes: Vec<u8> = (0..len).map(|_| if rng.below(3) == 0 { 0xff } else { rng.next() as u8 }).collect();
        if let Ok(bm) = SeqBitmap::from_bytes(rng.next() as u32, nbits, &bytes) {
            let mut out = Vec::new();
            bm.write_bytes(&mut out);
            assert_eq!(out, bytes);
            let received = bm.received().count() as u32;
            let missing = bm.missing().count() as u32;
            assert_eq!(received, bm.count_received());
            assert_eq!(received + missing, u32::from(nbits));
            assert_eq!(bm.is_complete(), missing == 0);
        }
    }
}

#[test]
fn config_parse_never_panics_and_errors_are_one_line() {
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/aggbox.example.toml")).expect("example config");
    let seeds: Vec<Vec<u8>> = vec![
        example.into_bytes(),
        b"[[job]]\nid = 7\nport = 7000\nworkers = [\"10.0.0.1\"]\nresult_port = 7001\nslots = 4\nwindow = 2\n[[group]]\nid = 3\nmembers = [\"10.0.0.2:7200\"]\n".to_vec(),
    ];
    let mut rng = Rng(4);
    let mut parsed = 0;
    for _ in 0..iterations() / 10 {
        let data = mutate(&mut rng, &seeds);
        let Ok(text) = std::str::from_utf8(&data) else { continue };
        match aggbox::config::Config::parse(text, "fuzz.toml") {
            Ok(_) => parsed += 1,
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.trim_end().contains('\n'), "a config error is one line: {msg:?}");
            }
        }
    }
    eprintln!("config_parse: {parsed} mutants parsed");
}

/// fuzz/fuzz_targets/control_request.rs: the control endpoint's registry
/// on mutants of a genuine signed join (one rank of a run of two, so no
/// run completes) and of garbage: never panics, every reply a refusal,
/// no job created.
#[test]
fn control_request_never_panics_and_changes_nothing() {
    use aggbox::config::Config;
    use aggbox::node::control::{Keys, Limits, Registry, Tenant};
    use aggbox::wire::control::{Envelope, Reply, Request};
    const NOW: u64 = 1_800_000_000_000;
    let mut keys = Keys::default();
    keys.tenants.insert("t".into(), Tenant { name: "t".into(), key: vec![7; 32], revoked: false, jobs: 4, workers: 64 });
    let mut reg = Registry::new(keys, Limits::default(), &Config::default());
    let join = Request::Join { run: "r".into(), world: 2, rank: 0, data: "10.0.0.1:7700".parse().unwrap(), vector_len: Some(1000), window: Some(16), frag_elems: Some(362), parent: None, ring: None };
    let seeds: Vec<Vec<u8>> = vec![
        serde_json::to_vec(&Envelope::sign("t", &[7; 32], [1; 16], NOW, &join)).unwrap(),
        serde_json::to_vec(&Envelope::sign("t", &[7; 32], [2; 16], NOW, &Request::Renew { job: 61440, incarnation: 1 })).unwrap(),
        b"{\"kind\":\"join\"}".to_vec(),
    ];
    let mut rng = Rng(45);
    let (mut refused, mut waiting) = (0, 0);
    for _ in 0..iterations() / 10 {
        let data = mutate(&mut rng, &seeds);
        let replies = reg.handle(NOW, 1, &data);
        if replies.is_empty() {
            waiting += 1;
        }
        for (_, reply) in replies {
            assert!(matches!(reply, Reply::Refused { .. }), "{reply:?} for {:?}", String::from_utf8_lossy(&data));
            refused += 1;
        }
        assert!(reg.live().is_empty(), "a job was created from {:?}", String::from_utf8_lossy(&data));
    }
    assert!(refused > 0);
    eprintln!("control_request: {refused} refused, {waiting} joins waiting");
}
