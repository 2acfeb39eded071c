//! Jobs on demand (docs/INTERFACE.md, "Jobs on demand"): a node whose file
//! has no `[[job]]` serves the runs that bring their own job through its
//! control endpoint. Four workers in namespaces join a run with a
//! credential of the node's key file, get the job, run int32 and float32
//! allreduces exactly, and end it; the same run key then gets a new
//! incarnation (another job id). A wrong key and an unknown tenant are
//! refused with their reasons and create nothing.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;

use std::net::{SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use aggbox::runtime::control::{Credential, RunJob};
use aggbox::runtime::Collective;
use aggbox::wire::abi::Op;
use live_attach::LiveAttach;
use testbed::{Testbed, TestbedConfig};

const WORKERS: usize = 4;
const CONTROL_PORT: u16 = 7471;
const DATA_PORT: u16 = 7700;
const KEY: &str = "5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0c0ffee5ee0";

fn credential(key: &str) -> Credential {
    Credential { tenant: "training".into(), key: hex::decode(key).unwrap() }
}

/// Rank `r`'s int32 input of `n` elements.
fn ints(r: usize, n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7 + r * 1_000_003) % 20_001) as i32 - 10_000).collect()
}

#[test]
fn a_node_without_jobs_serves_a_run_that_brings_its_own() {
    assert!(nix::unistd::geteuid().is_root(), "tests/node_on_demand.rs needs root (network namespaces, XDP)");
    let tb = Testbed::up(TestbedConfig { hosts: WORKERS + 1, ..Default::default() }).expect("testbed");
    let dir = std::env::temp_dir().join(format!("aggbox-on-demand-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys.toml");
    std::fs::write(&keys, format!("[[tenant]]\nname = \"training\"\nkey = \"{KEY}\"\n")).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = format!(
        "[node]\nmetrics = \"off\"\nuserspace_path = \"optional\"\ncontrol = \"0.0.0.0:{CONTROL_PORT}\"\nkeys = \"{}\"\n",
        keys.display()
    );
    let _node = LiveAttach::start(&tb.host(0).netns, "on-demand", &config, &[]);
    let control = SocketAddr::from(SocketAddrV4::new(tb.host(0).addr, CONTROL_PORT));

    // Refusals first: they create nothing.
    let data = |h: usize| SocketAddrV4::new(tb.host(h).addr, DATA_PORT);
    let bad = tb
        .in_host(1, || RunJob::join(control, credential(&KEY.replace("5", "6")), "run", 4, 0, data(1), None, Duration::from_secs(5)))
        .unwrap()
        .expect_err("a wrong key");
    assert!(bad.to_string().contains("bad_mac"), "{bad}");
    let stranger = Credential { tenant: "nobody".into(), key: vec![1; 32] };
    let unknown = tb
        .in_host(1, || RunJob::join(control, stranger, "run", 4, 0, data(1), None, Duration::from_secs(5)))
        .unwrap()
        .expect_err("an unknown tenant");
    assert!(unknown.to_string().contains("unknown_tenant"), "{unknown}");

    let mut jobs = Vec::new();
    for incarnation in 1..=2u64 {
        let results: Vec<(u16, u64)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..WORKERS)
                .map(|r| {
                    let tb = &tb;
                    s.spawn(move || {
                        let (run, comm) = tb
                            .in_host(r + 1, || {
                                let run = RunJob::join(control, credential(KEY), "run", WORKERS as u16, r as u16, data(r + 1), None, Duration::from_secs(20))
                                    .unwrap_or_else(|e| panic!("rank {r}: join: {e}"));
                                let comm = run.builder().deadline(Duration::from_secs(10)).build().unwrap_or_else(|e| panic!("rank {r}: build: {e}"));
                                (run, comm)
                            })
                            .unwrap();
                        for n in [1usize, 362, 10_007] {
                            let want: Vec<i32> = (0..n).map(|i| (0..WORKERS).map(|q| ints(q, n)[i]).sum()).collect();
                            let mut v = ints(r, n);
                            comm.allreduce(&mut v, Op::Sum).unwrap_or_else(|e| panic!("rank {r}: int32 SUM of {n}: {e}"));
                            assert_eq!(v, want, "rank {r}: int32 SUM of {n}");
                            let mut x = vec![r as f32 + 1.0; n];
                            comm.allreduce(&mut x, Op::Avg).unwrap_or_else(|e| panic!("rank {r}: float32 AVG of {n}: {e}"));
                            assert!(x.iter().all(|y| (y - 2.5).abs() < 1e-5), "rank {r}: float32 AVG of {n}: {:?}", &x[..1]);
                        }
                        let g = (run.grant().job, run.grant().incarnation);
                        drop(comm);
                        run.end().unwrap_or_else(|e| panic!("rank {r}: end: {e}"));
                        g
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert!(results.iter().all(|g| *g == results[0]), "every rank got the same job: {results:?}");
        assert_eq!(results[0].1, incarnation);
        jobs.push(results[0].0);
    }
    assert_ne!(jobs[0], jobs[1], "a new incarnation is a new job");
    let _ = std::fs::remove_dir_all(&dir);
}
