//! The node's kernel state as a value (src/node/desired.rs) written into
//! real maps: attach's writes from empty maps, a reload's difference, and
//! the undo when a plane refuses a write part way.
//!
//! Loads the XDP and TC programs without attaching them. Needs root; fails
//! (never skips) otherwise.

use std::net::Ipv4Addr;

use aggbox::config::Config;
use aggbox::kernel::tc::{ParentRoute, TcPlane};
use aggbox::kernel::xdp::XdpPlane;
use aggbox::node::desired::{self, JobRoutes, KernelState, Planes};

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "loading BPF programs needs root: `sudo -E cargo test --test node_state`");
}

const CONFIG: &str = "\
[[group]]
id = 3
members = [\"10.0.0.2:9000\", \"10.0.0.3:9000\"]

[[job]]
id = 1
port = 7000
result_port = 7001
workers = [\"10.0.0.2\", \"10.0.0.3\"]
result_group = 3

[[job]]
id = 2
port = 7100
result_port = 7101
workers = [\"10.0.0.2\", \"10.0.0.3\"]
";

fn state(text: &str) -> KernelState {
    KernelState::of(&Config::parse(text, "t.toml").expect("config"), 1500, &[]).expect("kernel state")
}

/// What the planes hold, read back through their own accessors.
fn read_back(xdp: &XdpPlane, tc: &TcPlane) -> Vec<String> {
    let mut out = Vec::new();
    for id in 0..16u16 {
        if let Some(job) = xdp.job(id).expect("job") {
            out.push(format!("job {id} port {} workers {}", job.port, job.workers));
        }
        if let Some(route) = tc.result_route(id).expect("route") {
            out.push(format!("route {id} {route:?}"));
        }
        if let Some(members) = tc.group(id, 0).expect("group") {
            out.push(format!("group {id} {members:?}"));
        }
    }
    out
}

#[test]
fn attach_and_reload_write_the_state_and_a_refused_write_is_undone() {
    require_root();
    let xdp = XdpPlane::load().expect("load XDP");
    let tc = TcPlane::load().expect("load TC");
    let mut planes = Planes { xdp: &xdp, tc: Some(&tc) };

    // attach: from empty maps
    let first = state(CONFIG);
    desired::apply(&mut planes, &KernelState::default(), &first).expect("attach's writes");
    let attached = read_back(&xdp, &tc);
    assert_eq!(
        attached.iter().map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" ")).collect::<Vec<_>>(),
        ["job 1", "route 1", "job 2", "group 3"],
        "{attached:#?}"
    );
    assert!(attached[0].contains("port 7000"), "{attached:#?}");

    // reload: job 1 moves to another port, job 2 goes, job 4 comes
    let text = CONFIG.replace("port = 7000", "port = 7002").replace("id = 2\nport = 7100", "id = 4\nport = 7100");
    let second = state(&text);
    desired::apply(&mut planes, &first, &second).expect("reload's writes");
    let reloaded = read_back(&xdp, &tc);
    assert!(reloaded.iter().any(|l| l.starts_with("job 1 port 7002")), "{reloaded:#?}");
    assert!(reloaded.iter().any(|l| l.starts_with("job 4 port 7100")), "{reloaded:#?}");
    assert!(!reloaded.iter().any(|l| l.starts_with("job 2 ")), "{reloaded:#?}");

    // a reload whose last write the TC plane refuses (a parent route with
    // the RESULT rank): everything before it is undone
    let mut bad = state(&text.replace("port = 7002", "port = 7004"));
    bad.jobs.get_mut(&4).expect("job 4").port = 7400;
    bad.routes.insert(
        4,
        JobRoutes {
            result_group: None,
            parent: Some(ParentRoute {
                addr: std::net::IpAddr::V4(Ipv4Addr::new(10, 0, 0, 9)),
                port: 7300,
                job: 5,
                rank: 0xffff,
                result_port: 7101,
            }),
        },
    );
    let changes = second.changes_to(&bad);
    assert!(changes.len() >= 3, "the refused write comes after others: {changes:?}");
    let err = desired::apply(&mut planes, &second, &bad).expect_err("the parent route is refused");
    assert!(format!("{err:#}").contains("job 4: parent 10.0.0.9:7300"), "{err:#}");
    assert_eq!(read_back(&xdp, &tc), reloaded, "the refused reload left the maps as they were");

    // and back to empty maps: nothing of either config is left
    desired::apply(&mut planes, &second, &KernelState::default()).expect("detach's writes");
    assert!(read_back(&xdp, &tc).is_empty(), "{:#?}", read_back(&xdp, &tc));
}
