//! The control endpoint's registry (jobs on demand) on arbitrary frames:
//! never panics, answers anything but a genuine join with a refusal, and
//! creates no job (the seed is one rank of a run of two).
#![no_main]
use libfuzzer_sys::fuzz_target;

use aggbox::config::Config;
use aggbox::node::control::{Keys, Limits, Registry, Tenant};
use aggbox::wire::control::Reply;

fuzz_target!(|data: &[u8]| {
    let mut keys = Keys::default();
    keys.tenants.insert("t".into(), Tenant { name: "t".into(), key: vec![7; 32], revoked: false, jobs: 4, workers: 64 });
    let mut reg = Registry::new(keys, Limits::default(), &Config::default());
    for (_, reply) in reg.handle(1_800_000_000_000, 1, data) {
        assert!(matches!(reply, Reply::Refused { .. }), "{reply:?}");
    }
    assert!(reg.live().is_empty());
});
