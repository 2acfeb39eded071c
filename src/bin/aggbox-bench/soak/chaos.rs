//! What the soak does to the running jobs: loss bursts, killed workers
//! and nodes, reloads.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::soak_worker::{unix_ms, JobKind};
use crate::testbed;

use super::{
    Shared, BURST_DUP, BURST_EVERY, BURST_LEN, BURST_LOSS, DUP, KILL_NODE_EVERY, KILL_WORKER_EVERY,
    LOSS, NODE_HOST, RELOAD_EVERY, RESTART_AFTER, SPARE_JOB,
};
use super::node::node_config;

pub(super) fn impair_all(s: &Shared, loss: f64, dup: f64) -> Result<()> {
    for h in 0..s.tb.len() {
        let port = s.tb.switch_port(h);
        let injector = &s.injector;
        testbed::in_netns(&s.tb.switch_netns(), move || injector.set(&port, loss, dup))??;
    }
    Ok(())
}

/// The schedule: loss bursts, reloads, worker kills, node kills.
pub(super) fn chaos(s: &Arc<Shared>) -> Result<()> {
    let mut next_burst = BURST_EVERY;
    let mut next_reload = RELOAD_EVERY.min(Duration::from_secs(60));
    let mut next_kill_worker = Duration::from_secs(45);
    let mut next_kill_node = KILL_NODE_EVERY.min(Duration::from_secs(120));
    let mut victim = 0usize;
    while s.running() {
        let now = s.t0.elapsed();
        if now >= next_burst {
            next_burst += BURST_EVERY;
            impair_all(s, BURST_LOSS, BURST_DUP)?;
            s.event("burst", format!("loss {BURST_LOSS} dup {BURST_DUP} for {} s", BURST_LEN.as_secs()));
            std::thread::sleep(BURST_LEN);
            impair_all(s, LOSS, DUP)?;
        }
        if now >= next_reload {
            next_reload += RELOAD_EVERY;
            let spare = (*s.spare.lock().unwrap() + 1) % 3;
            if s.nodes[0].lock().unwrap().child.is_some() {
                if let Err(e) = reload(s, spare) {
                    s.violation(format!("reload: {e:#}"));
                }
            }
        }
        if now >= next_kill_worker {
            // The next kind with a live run that has made calls.
            let live = s.live.lock().unwrap().clone();
            let kind = JobKind::ALL[victim % 3];
            if let Some((k, run, pid, who)) = live.iter().filter(|l| l.0 == kind).nth((victim / 3) % 3).or_else(|| live.iter().find(|l| l.0 == kind)).cloned() {
                next_kill_worker += KILL_WORKER_EVERY;
                victim += 1;
                s.killed_runs.lock().unwrap().insert((k.name(), run));
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
                s.event("kill_worker", format!("{} run {run} rank {who} (pid {pid})", k.name()));
            } else if live.is_empty() {
                next_kill_worker += Duration::from_secs(1);
            } else {
                victim += 1;
            }
        }
        if now >= next_kill_node {
            next_kill_node += KILL_NODE_EVERY;
            kill_and_restart_node(s)?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// kill -9 node h0's `aggbox attach`; restart it after [`RESTART_AFTER`],
/// again every second until it attaches (systemd's Restart=always).
pub(super) fn kill_and_restart_node(s: &Arc<Shared>) -> Result<()> {
    let mut n = s.nodes[0].lock().unwrap();
    let pid = n.pid().unwrap_or(0);
    let down_at = unix_ms();
    n.kill9();
    s.event("kill_node", format!("h0 aggbox attach (pid {pid}) killed with -9"));
    for attempt in 1..=5 {
        std::thread::sleep(RESTART_AFTER);
        match n.start(&s.tb, &s.aggbox) {
            Ok(()) => {
                s.node_down.lock().unwrap().push((down_at, unix_ms()));
                let pid = n.pid().unwrap_or(0);
                drop(n);
                s.event("restart_node", format!("h0 attached again on stale state (pid {pid}, attempt {attempt})"));
                return Ok(());
            }
            Err(e) => s.violation(format!("restart of h0 after kill -9, attempt {attempt}: {e:#}")),
        }
    }
    bail!("node h0 did not attach again after kill -9")
}

/// Write node h0's config with spare state `spare` and `aggbox reload`.
pub(super) fn reload(s: &Shared, spare: u8) -> Result<()> {
    let n = s.nodes[0].lock().unwrap();
    std::fs::write(&n.config, node_config(&s.tb, spare))?;
    let out = s
        .tb
        .run_in(NODE_HOST, &[&s.aggbox.to_string_lossy(), "reload", "eth0", "--pin-root", &n.pins.path.to_string_lossy()])?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)).replace('\n', " | ");
    *s.last_reload_ms.lock().unwrap() = unix_ms();
    if !out.status.success() {
        bail!("aggbox reload (spare state {spare}) exited {}: {text}", out.status);
    }
    *s.spare.lock().unwrap() = spare;
    drop(n);
    s.event("reload", format!("spare job {SPARE_JOB} {}: {text}", ["removed", "added (64 slots)", "changed to 128 slots"][spare as usize]));
    Ok(())
}
