//! A live `aggbox attach eth0` inside a testbed namespace, with a private
//! bpffs pin root, for the integration tests that drive the real binary
//! (tests/metrics.rs, tests/netns_allreduce.rs, tests/runtime_kernel.rs).
//! It is stopped (SIGINT, by the pid of the process the test started) and
//! cleaned up on drop.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running attachment.
pub struct LiveAttach {
    pub child: Child,
    pub pin_root: PathBuf,
    config: PathBuf,
    netns: String,
    extra_args: Vec<String>,
}

impl LiveAttach {
    /// Write `config_text`, mount a private bpffs, start `aggbox attach eth0`
    /// in `netns` with `extra_args`, and wait for its "attached" line.
    pub fn start(netns: &str, tag: &str, config_text: &str, extra_args: &[&str]) -> LiveAttach {
        let pin_root = std::env::temp_dir().join(format!("aggbox-live-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&pin_root).expect("pin root");
        nix::mount::mount(Some("bpf"), &pin_root, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
            .expect("mount bpffs");
        let config = pin_root.with_extension("toml");
        std::fs::write(&config, config_text).expect("write config");
        let extra_args: Vec<String> = extra_args.iter().map(|a| a.to_string()).collect();
        let child = spawn(netns, &extra_args, &config, &pin_root);
        let mut attach = LiveAttach { child, pin_root, config, netns: netns.to_string(), extra_args };
        attach.wait_attached(tag);
        attach
    }

    fn wait_attached(&mut self, what: &str) {
        let mut line = String::new();
        BufReader::new(self.child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read attach output");
        assert_eq!(line.trim(), "aggbox: attached to eth0", "aggbox attach in {} ({what})", self.netns);
    }

    /// Kill the attach process with SIGKILL and wait for it (its pins
    /// stay, as after a crash).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stop the attach process with SIGTERM (by its pid) and wait for it
    /// to exit, 10 s at most.
    pub fn terminate(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to aggbox attach");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("aggbox attach in {} did not exit within 10 s of SIGTERM", self.netns);
    }

    /// Start `aggbox attach` again after [`LiveAttach::kill9`] (or
    /// [`LiveAttach::terminate`]), with the
    /// same config and pin root: it replaces the dead process's state.
    pub fn restart(&mut self) {
        self.child = spawn(&self.netns, &self.extra_args, &self.config, &self.pin_root);
        self.wait_attached("restart");
    }

    /// The node's status, read from the pins.
    pub fn status(&self) -> aggbox::node::NodeStatus {
        let mut status = aggbox::node::status(Some("eth0"), &self.pin_root).expect("status from the pins");
        status.remove(0)
    }

    /// The TC counters by label.
    pub fn broadcast_counts(&self) -> BTreeMap<String, u64> {
        let status = self.status();
        assert!(status.attach.tc, "aggbox attach attached the TC programs");
        status.broadcast
    }

    /// The XDP datagram counters by outcome.
    pub fn outcomes(&self) -> BTreeMap<String, u64> {
        self.status().outcomes
    }
}

/// `aggbox attach eth0` in `netns`, its stdout piped.
fn spawn(netns: &str, extra_args: &[String], config: &PathBuf, pin_root: &PathBuf) -> Child {
    Command::new("ip")
        .args(["netns", "exec", netns, env!("CARGO_BIN_EXE_aggbox"), "attach", "eth0"])
        .args(extra_args)
        .arg("--config")
        .arg(config)
        .arg("--pin-root")
        .arg(pin_root)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn aggbox attach")
}

impl Drop for LiveAttach {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = nix::mount::umount(&self.pin_root);
        let _ = std::fs::remove_dir_all(&self.pin_root);
        let _ = std::fs::remove_file(&self.config);
    }
}

/// A node's key file of `tenants` (name, hex key), mode 0600, in a
/// directory of its own that is removed when dropped (on failure too).
pub struct KeyFile {
    pub dir: std::path::PathBuf,
}

impl KeyFile {
    pub fn new(tag: &str, tenants: &[(&str, &str)]) -> KeyFile {
        let dir = std::env::temp_dir().join(format!("aggbox-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text: String = tenants.iter().map(|(name, key)| format!("[[tenant]]\nname = \"{name}\"\nkey = \"{key}\"\n\n")).collect();
        std::fs::write(dir.join("keys.toml"), text).unwrap();
        std::fs::set_permissions(dir.join("keys.toml"), <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600)).unwrap();
        KeyFile { dir }
    }

    /// The `[node]` table of a node that serves jobs on demand with this
    /// key file, its metrics at `metrics` ("off" or an address).
    pub fn node_config(&self, metrics: &str) -> String {
        format!("[node]\nmetrics = \"{metrics}\"\nuserspace_path = \"optional\"\nkeys = \"{}\"\n", self.dir.join("keys.toml").display())
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
