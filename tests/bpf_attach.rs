//! Attaching the XDP program with a BPF link, inside a network namespace the
//! test creates (and deletes, even on failure).
//!
//! Needs root: run with `sudo -E cargo test --test bpf_attach`.

mod bpf_common;

use std::fs::File;
use std::process::Command;

use aggbox::kernel::xdp::XdpMode;
use bpf_common::*;
use nix::sched::{setns, CloneFlags};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2 is required)");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn attach_native_and_generic_links() {
    let dp = load();
    let ns = Netns(format!("aggbox-attach-{}", std::process::id()));
    ip(&["netns", "add", &ns.0]);
    ip(&[
        "-n", &ns.0, "link", "add", "agg0", "type", "veth", "peer", "name", "agg1",
    ]);
    ip(&["-n", &ns.0, "link", "set", "agg0", "up"]);
    ip(&["-n", &ns.0, "link", "set", "agg1", "up"]);
    let f = File::open(format!("/run/netns/{}", ns.0)).expect("netns file");
    setns(f, CloneFlags::CLONE_NEWNET).expect("setns (this thread only)");
    let ifindex = nix::net::if_::if_nametoindex("agg0").expect("ifindex");

    let (link, warning) = dp
        .attach_xdp(ifindex, XdpMode::Native)
        .expect("attach native");
    assert_eq!(link.mode(), XdpMode::Native, "veth supports native XDP");
    assert!(warning.is_none());
    assert!(
        ip(&["link", "show", "agg0"]).contains("xdp"),
        "program attached"
    );
    drop(link);
    assert!(
        !ip(&["link", "show", "agg0"]).contains("prog/xdp"),
        "dropping the link detaches"
    );

    let (link, _) = dp
        .attach_xdp(ifindex, XdpMode::Generic)
        .expect("attach generic");
    assert_eq!(link.mode(), XdpMode::Generic);
    assert!(ip(&["link", "show", "agg0"]).contains("xdpgeneric"));
    link.detach().expect("detach");
}
