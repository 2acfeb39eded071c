//! The soak's nodes: one `aggbox attach` process per node host, its
//! configuration, started, watched and stopped.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::testbed::Testbed;
use crate::PrivateBpffs;

use super::{
    started, Shared, METRICS_PORT, RING_HOSTS, RING_ID, RING_LEN, SERVED_DATA_PORT, SERVED_JOB,
    SPARE_JOB, SPARE_RESULT_PORT, STAR_DATA_PORT, STAR_JOB, WORKER_HOSTS,
};

/// A node's `aggbox attach` under the driver's supervision.
pub(super) struct Node {
    pub(super) name: String,
    pub(super) host: usize,
    pub(super) pins: PrivateBpffs,
    pub(super) config: PathBuf,
    pub(super) child: Option<Child>,
    pub(super) started: Instant,
    pub(super) incarnation: u32,
    /// VmRSS (KiB) and descriptors at the first sample after warm-up.
    pub(super) rss_base_kib: Option<f64>,
    pub(super) fd_base: Option<i64>,
    /// Pins seen at the first check (relative paths).
    pub(super) pins_base: Option<BTreeSet<String>>,
    /// Ephemeral UDP ports held at the first check.
    pub(super) ephemeral_base: Option<usize>,
    pub(super) log: PathBuf,
}

impl Node {
    pub(super) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub(super) fn pin_dir(&self) -> PathBuf {
        aggbox::node::pin_dir(&self.pins.path, "eth0")
    }

    /// Start `aggbox attach eth0` and wait for its "attached" line.
    pub(super) fn start(&mut self, tb: &Testbed, aggbox: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut child = tb
            .command_in(
                self.host,
                &[
                    &aggbox.to_string_lossy(),
                    "attach",
                    "eth0",
                    "--config",
                    &self.config.to_string_lossy(),
                    "--pin-root",
                    &self.pins.path.to_string_lossy(),
                ],
            )?
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.try_clone()?)
            .spawn()
            .with_context(|| format!("starting aggbox attach on {}", self.name))?;
        let stdout = child.stdout.take().context("attach stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        // The rest of its stdout goes to the log, so the pipe never fills.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
            let _ = tx.send(first);
            let mut log = log;
            for l in lines.map_while(|l| l.ok()) {
                let _ = writeln!(log, "{l}");
            }
        });
        let pid = child.id();
        started(pid);
        self.child = Some(child);
        self.started = Instant::now();
        self.incarnation += 1;
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.trim() == "aggbox: attached to eth0" => Ok(()),
            Ok(line) => {
                self.kill9();
                bail!("aggbox attach on {} (pid {pid}) said {line:?} instead of attaching (see {})", self.name, self.log.display())
            }
            Err(_) => {
                self.kill9();
                bail!("aggbox attach on {} (pid {pid}) did not attach within 60 s", self.name)
            }
        }
    }

    pub(super) fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (10 s at most); its exit status, or why not.
    pub(super) fn terminate(&mut self) -> Result<(), String> {
        let Some(mut c) = self.child.take() else { return Ok(()) };
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = c.try_wait() {
                return if s.success() { Ok(()) } else { Err(format!("{} exited {s} after SIGTERM", self.name)) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        Err(format!("{} did not exit within 10 s of SIGTERM", self.name))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate();
        }
    }
}

/// The node h0's configuration with spare state `spare` (0: no spare job,
/// 1: the spare with 64 slots, 2: with 128).
pub(super) fn node_config(tb: &Testbed, spare: u8) -> String {
    let workers: Vec<String> = WORKER_HOSTS.iter().map(|&h| format!("\"{}\"", tb.host(h).addr)).collect();
    let members = |port: u16| -> String {
        WORKER_HOSTS.iter().map(|&h| format!("\"{}:{port}\"", tb.host(h).addr)).collect::<Vec<_>>().join(", ")
    };
    let mut text = format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\n\n\
         [[job]]\nid = {STAR_JOB}\nport = 7100\nworkers = [{w}]\nresult_port = 7101\nresult_group = {STAR_JOB}\n\n\
         [[group]]\nid = {STAR_JOB}\nmembers = [{sm}]\n\n\
         [[job]]\nid = {SERVED_JOB}\nport = 7200\nworkers = [{w}]\nresult_port = 7201\nresult_group = {SERVED_JOB}\nconsumer = \"node\"\n\n\
         [[group]]\nid = {SERVED_JOB}\nmembers = [{vm}]\n",
        w = workers.join(", "),
        sm = members(STAR_DATA_PORT),
        vm = members(SERVED_DATA_PORT),
    );
    if spare > 0 {
        let slots = if spare == 1 { 64 } else { 128 };
        text += &format!(
            "\n[[job]]\nid = {SPARE_JOB}\nport = 7900\nworkers = [{w}]\nresult_port = {SPARE_RESULT_PORT}\nresult_group = {SPARE_JOB}\nconsumer = \"node\"\nslots = {slots}\n\n\
             [[group]]\nid = {SPARE_JOB}\nmembers = [{m}]\n",
            w = workers.join(", "),
            m = members(7950),
        );
    }
    text
}

pub(super) fn ring_config(tb: &Testbed) -> String {
    let members: Vec<String> = RING_HOSTS.iter().map(|&h| format!("\"{}\"", tb.host(h).addr)).collect();
    format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nuserspace_path = \"optional\"\n\n\
         [[ring]]\nid = {RING_ID}\nport = 7400\nmembers = [{}]\nvector_len = {RING_LEN}\nfrag_elems = 362\n",
        members.join(", ")
    )
}

/// Node h0 is attached and has been for 5 s.
pub(super) fn node_up_steadily(s: &Shared) -> bool {
    let n = s.nodes[0].lock().unwrap();
    n.child.is_some() && n.started.elapsed() > Duration::from_secs(5)
}
