//! Backend `gloo`: torch.distributed with the Gloo backend, one
//! `scripts/gloo_allreduce.py` process per worker namespace.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use anyhow::anyhow;

use crate::{progress, Csv};
use crate::testbed::Testbed;

use super::{worker_count, Dtype, Point, GLOO_PORT};
use super::ranks::{
    checked_points, failed_points, kill_children, read_output, wait_children, RankCalls,
};

// ------------------------------------------------------------------ Gloo ----

/// The interpreter with torch: `AGGBOX_PYTHON` where torch lives elsewhere
/// (a virtual environment), else the system one, where Debian's
/// python3-torch is (a `python3` earlier on PATH, pyenv's say, lacks it).
pub(super) fn python() -> String {
    if let Some(p) = std::env::var_os("AGGBOX_PYTHON").filter(|p| !p.is_empty()) {
        return p.to_string_lossy().into_owned();
    }
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3".into()
    } else {
        "python3".into()
    }
}

/// `Ok(version)` when `import torch` works, else why not.
pub fn torch_available() -> std::result::Result<String, String> {
    match std::process::Command::new(python())
        .args(["-c", "import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available(); print(torch.__version__)"])
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).trim().to_string()),
        Ok(o) => Err(format!(
            "{} -c 'import torch' failed: {}",
            python(),
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => Err(format!("{}: {e}", python())),
    }
}

pub(super) fn gloo_script() -> PathBuf {
    crate::testbed::script_path().with_file_name("gloo_allreduce.py")
}

/// Gloo at one MTU: 4 processes (one per worker namespace) run every size.
pub(super) fn gloo_phase(
    tb: &Testbed,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    dtype: Dtype,
) -> Vec<Point> {
    let name = dtype.backend("gloo");
    let name = name.as_str();
    let fail_all = |e: String| failed_points(name, mtu, sizes, &e);
    let script = gloo_script();
    if !script.exists() {
        return fail_all(format!("{} not found", script.display()));
    }
    let master = tb.host(1).addr;
    let sizes_arg = sizes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let calls: u64 = (reps + 1) as u64;
    // Generous: start-up (torch import: seconds on this VM) + 2 µs per
    // element and call (Gloo runs at well over 1 M elements/s here).
    let limit = Duration::from_secs(120)
        + Duration::from_secs_f64(2e-6 * sizes.iter().sum::<u64>() as f64 * calls as f64);
    progress(format!(
        "large: MTU {mtu}, Gloo: {} processes ({}), sizes {sizes_arg}, warm-up + {reps} calls each, limit {:.0} s",
        worker_count(),
        script.display(),
        limit.as_secs_f64()
    ));
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    let world = worker_count().to_string();
    for r in 0..worker_count() {
        let rank = r.to_string();
        // A port per dtype: the previous rendezvous may linger in TIME_WAIT.
        let port = (GLOO_PORT + (dtype == Dtype::F32) as u16).to_string();
        let reps_s = reps.to_string();
        let timeout = format!("{:.0}", limit.as_secs_f64());
        let script_s = script.to_string_lossy().to_string();
        let master_s = master.to_string();
        let python = python();
        let args: Vec<&str> = vec![
            &python,
            &script_s,
            "--rank",
            &rank,
            "--world",
            &world,
            "--master-addr",
            &master_s,
            "--master-port",
            &port,
            "--sizes",
            &sizes_arg,
            "--reps",
            &reps_s,
            "--warmup",
            "1",
            "--timeout",
            &timeout,
            "--dtype",
            match dtype {
                Dtype::I32 => "int32",
                Dtype::F32 => "float32",
            },
        ];
        let spawned = tb
            .command_in(r + 1, &args)
            .map_err(|e| anyhow!("{e}"))
            .and_then(|mut c| {
                c.env("GLOO_SOCKET_IFNAME", "eth0")
                    .env("OMP_NUM_THREADS", "1")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| anyhow!("starting {args:?} in host {}: {e}", r + 1))
            });
        match spawned {
            Ok(mut child) => {
                readers.push(read_output(&mut child));
                children.push(child);
            }
            Err(e) => {
                kill_children(&mut children);
                return fail_all(format!("{e:#}"));
            }
        }
    }
    let timed_out = !wait_children(&mut children, limit, &format!("Gloo at MTU {mtu}"));
    kill_children(&mut children);
    let statuses: Vec<String> = children
        .iter_mut()
        .map(|c| {
            c.try_wait()
                .ok()
                .flatten()
                .map(|s| s.to_string())
                .unwrap_or_else(|| "?".into())
        })
        .collect();
    let outputs: Vec<(String, String)> = readers
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    let mut calls: RankCalls = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    for (r, (o, e)) in outputs.iter().enumerate() {
        let v = o
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok());
        match v {
            Some(v) => {
                if let Some(err) = v.get("error").and_then(|x| x.as_str()) {
                    problems.push(format!("rank {r}: {err}"));
                }
                calls.push(
                    (0..sizes.len())
                        .map(|si| {
                            v.get("points")
                                .and_then(|p| p.get(si))
                                .and_then(|p| p.get("calls"))
                                .and_then(|c| c.as_array())
                                .cloned()
                                .unwrap_or_default()
                        })
                        .collect(),
                );
            }
            None => {
                let tail: String = e.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                problems.push(format!(
                    "rank {r} ({}): no JSON result; stderr: {tail}",
                    statuses[r]
                ));
                calls.push(Vec::new());
            }
        }
    }
    if timed_out {
        problems.insert(0, format!("timed out after {:.0} s", limit.as_secs_f64()));
    }
    checked_points(
        name, "Gloo", mtu, sizes, reps, bases, csv, &calls, &problems,
    )
}
