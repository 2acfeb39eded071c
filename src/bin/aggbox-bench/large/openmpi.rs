//! Backend `openmpi`: plain Open MPI's `MPI_Allreduce` among the worker
//! namespaces (`mpi/bench/allreduce_points.c`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::anyhow;

use crate::{progress, Csv};
use crate::testbed::Testbed;

use super::{worker_count, Dtype, Point};
use super::ranks::{
    checked_points, failed_points, kill_children, read_output, wait_children, RankCalls,
};

// -------------------------------------------------------------- Open MPI ----

/// The `openmpi` points' program (`mpi/bench/allreduce_points.c`), compiled
/// with mpicc.openmpi for this run into a directory of its own, removed on
/// drop. The directory is also the TMPDIR of mpirun and of its daemons
/// (their session directories, scripts/mpi_netns_agent.sh's per-namespace
/// ones), so that nothing of the run stays in /tmp.
pub(super) struct OpenMpi {
    pub(super) dir: PathBuf,
    pub(super) exe: PathBuf,
    /// Open MPI's version (`mpirun.openmpi --version`).
    pub(super) version: String,
}

impl Drop for OpenMpi {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) fn openmpi_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("mpi/bench/allreduce_points.c")
}

/// Compile the `openmpi` points' program, or say why that is not possible.
pub(super) fn openmpi_build() -> std::result::Result<OpenMpi, String> {
    const INSTALL: &str =
        "install it with `apt-get install -y openmpi-bin libopenmpi-dev` (make deps)";
    let run = |tool: &str, args: &[&str]| -> std::result::Result<String, String> {
        match std::process::Command::new(tool)
            .args(args)
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
            Ok(o) => Err(format!(
                "{tool} {}: {}: {}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(format!("{tool} not found; {INSTALL}"))
            }
            Err(e) => Err(format!("{tool}: {e}")),
        }
    };
    let version = run("mpirun.openmpi", &["--version"])?;
    let version = version
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().last())
        .unwrap_or("?")
        .to_string();
    let dir = std::env::temp_dir().join(format!("aggbox-large-openmpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let ompi = OpenMpi {
        exe: dir.join("allreduce_points"),
        dir,
        version,
    };
    let src = openmpi_source();
    run(
        "mpicc.openmpi",
        &[
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            &ompi.exe.to_string_lossy(),
            &src.to_string_lossy(),
        ],
    )?;
    Ok(ompi)
}

/// Open MPI at one MTU: one `mpirun.openmpi` in worker 0's namespace starts
/// a rank in every worker namespace (a hostfile of their names, daemons
/// started by scripts/mpi_netns_agent.sh, as scripts/mpi_bench.sh runs
/// plain MPI) and runs every size.
#[allow(clippy::too_many_arguments)]
pub(super) fn openmpi_phase(
    tb: &Testbed,
    mtu: u32,
    sizes: &[u64],
    reps: usize,
    bases: &BTreeMap<u64, Vec<i32>>,
    csv: &mut Csv,
    dtype: Dtype,
    ompi: &OpenMpi,
) -> Vec<Point> {
    let name = dtype.backend("openmpi");
    let name = name.as_str();
    let fail_all = |e: String| failed_points(name, mtu, sizes, &e);
    let agent = crate::testbed::script_path().with_file_name("mpi_netns_agent.sh");
    if !agent.exists() {
        return fail_all(format!("{} not found", agent.display()));
    }
    let hostfile = ompi.dir.join("hosts");
    let hosts: String = (1..=worker_count())
        .map(|h| format!("{} slots=1\n", tb.host(h).netns))
        .collect();
    if let Err(e) = std::fs::write(&hostfile, hosts) {
        return fail_all(format!("writing {}: {e}", hostfile.display()));
    }
    let sizes_arg = sizes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let per_size = reps + 1;
    // As for Gloo: start-up (mpirun and its daemons: about a second here) +
    // 2 µs per element and call. mpirun ends the job itself at the limit;
    // this process stops mpirun only if that fails.
    let limit = Duration::from_secs(120)
        + Duration::from_secs_f64(2e-6 * sizes.iter().sum::<u64>() as f64 * per_size as f64);
    progress(format!(
        "large: MTU {mtu}, Open MPI {}: mpirun.openmpi, {} ranks ({}), sizes {sizes_arg}, warm-up + {reps} calls each, limit {:.0} s",
        ompi.version,
        worker_count(),
        ompi.exe.display(),
        limit.as_secs_f64()
    ));
    let np = worker_count().to_string();
    let timeout = format!("{:.0}", limit.as_secs_f64());
    let hostfile_s = hostfile.to_string_lossy().to_string();
    let agent_s = agent.to_string_lossy().to_string();
    let exe_s = ompi.exe.to_string_lossy().to_string();
    let reps_s = reps.to_string();
    let args: Vec<&str> = vec![
        "mpirun.openmpi",
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np,
        "--hostfile",
        &hostfile_s,
        "--mca",
        "plm_rsh_agent",
        &agent_s,
        "--mca",
        "btl",
        "tcp,self",
        // Ranks wait in the kernel rather than spin: the workers share the
        // machine's CPUs (as Gloo's processes, which block).
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "--mca",
        "oob_tcp_if_include",
        "eth0",
        // Unpinned, as Gloo's processes are: each daemon takes its
        // namespace for a node of its own, where Open MPI's default for
        // ≤ 2 ranks (bind to core) would put every rank on the same core.
        // 4.1.4 with --oversubscribe binds nothing already; this keeps it so.
        "--bind-to",
        "none",
        "--timeout",
        &timeout,
        &exe_s,
        match dtype {
            Dtype::I32 => "int",
            Dtype::F32 => "float",
        },
        &sizes_arg,
        "1",
        &reps_s,
    ];
    let spawned = tb
        .command_in(1, &args)
        .map_err(|e| anyhow!("{e}"))
        .and_then(|mut c| {
            c.env("TMPDIR", &ompi.dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| anyhow!("starting {args:?} in host 1: {e}"))
        });
    let mut mpirun = match spawned {
        Ok(c) => c,
        Err(e) => return fail_all(format!("{e:#}")),
    };
    let reader = read_output(&mut mpirun);
    let mut children = [mpirun];
    let what = format!("Open MPI at MTU {mtu}");
    let mut problems: Vec<String> = Vec::new();
    if !wait_children(&mut children, limit + Duration::from_secs(30), &what) {
        problems.push(format!(
            "timed out after {:.0} s",
            limit.as_secs_f64() + 30.0
        ));
        // SIGTERM first: mpirun then stops its daemons and ranks, which a
        // SIGKILL of mpirun alone would leave running.
        // SAFETY: kill(2) on our own child's pid, not yet reaped.
        unsafe { libc::kill(children[0].id() as libc::pid_t, libc::SIGTERM) };
        wait_children(&mut children, Duration::from_secs(10), &what);
    }
    kill_children(&mut children);
    let status = children[0].try_wait().ok().flatten();
    let (out, err) = reader.join().unwrap_or_default();
    if !status.is_some_and(|s| s.success()) {
        let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        problems.push(format!(
            "mpirun: {}; stderr: {tail}",
            status.map_or("?".into(), |s| s.to_string())
        ));
    }
    let calls = openmpi_calls(&out, sizes, reps, &mut problems);
    checked_points(
        name, "Open MPI", mtu, sizes, reps, bases, csv, &calls, &problems,
    )
}

/// Each rank's calls from the output of `allreduce_points` (rank 0's lines:
/// a header, then one per call in order, size by size, warm-up first, each
/// with every rank's (t0, t1, wrong, sum)); what does not fit goes to
/// `problems`.
pub(super) fn openmpi_calls(out: &str, sizes: &[u64], reps: usize, problems: &mut Vec<String>) -> RankCalls {
    let per_size = reps + 1;
    let mut calls: RankCalls = vec![vec![Vec::new(); sizes.len()]; worker_count()];
    let mut seen = 0usize;
    for v in out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
    {
        if v.get("mpi").is_some() {
            let world = v.get("world").and_then(|w| w.as_u64());
            if world != Some(worker_count() as u64) {
                problems.push(format!("{world:?} ranks, expected {}", worker_count()));
            }
            continue;
        }
        let (si, k) = (seen / per_size, seen % per_size);
        seen += 1;
        if v.get("elements").and_then(|n| n.as_u64()) != sizes.get(si).copied()
            || v.get("k").and_then(|n| n.as_u64()) != Some(k as u64)
        {
            problems.push(format!(
                "unexpected line (expected size {si} call {k}): {v}"
            ));
            break;
        }
        for (r, c) in v
            .get("ranks")
            .and_then(|r| r.as_array())
            .into_iter()
            .flatten()
            .enumerate()
        {
            if let Some(rc) = calls.get_mut(r) {
                rc[si].push(c.clone());
            }
        }
    }
    calls
}
