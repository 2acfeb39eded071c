//! `aggbox`: the AggBox node command line (INTERFACE.md). Thin: every command
//! calls the library.

use std::net::{SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use aggbox::wire::abi::Op;
use aggbox::wire::proto;
use aggbox::config::Config;
use aggbox::kernel::xdp::XdpMode;
use aggbox::node::{self, metrics, tools};

/// In-kernel aggregation and broadcast for distributed communication.
///
/// A node runs `aggbox attach IFACE --config FILE` (as root, in the
/// foreground or as a service): the XDP program on IFACE then aggregates the
/// contributions of the configured jobs and the application on this host
/// receives one RESULT datagram per fragment. `aggbox status` shows what is
/// attached and the per-reason counters; `aggbox detach IFACE` cleans up
/// after a crash. `contribute` and `listen` send and receive test traffic.
#[derive(Parser, Debug)]
#[command(name = "aggbox", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Load the BPF programs, attach them to IFACE, write the config's jobs
    /// into the maps, pin everything under PIN_ROOT/IFACE and serve until
    /// SIGINT/SIGTERM, which detaches everything and exits 0. SIGHUP
    /// reloads the config file's jobs and groups (see `aggbox reload`).
    Attach {
        /// Interface to attach to, e.g. eth0.
        iface: String,
        /// TOML configuration (see deploy/aggbox.example.toml); without it
        /// no jobs are configured and every datagram passes.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Where pins live; must be on a bpffs.
        #[arg(long, default_value = node::DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
        /// XDP attach mode: native falls back to generic with a warning.
        #[arg(long, value_enum, default_value_t = ModeArg::Native)]
        xdp_mode: ModeArg,
        /// Turn on kernel BPF run-time statistics while attached (a few ns
        /// per program run), exported as aggbox_program_run_seconds_total.
        #[arg(long)]
        bpf_stats: bool,
    },
    /// Have the running `aggbox attach IFACE` reload its config file: jobs
    /// and groups added, changed or removed while the others' calls go on
    /// undisturbed ([node] changes need a restart). Prints what changed, or
    /// why nothing did (then exits 1).
    Reload {
        /// Interface.
        iface: String,
        /// Where pins live.
        #[arg(long, default_value = node::DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
    },
    /// Remove everything AggBox attached or pinned for IFACE (also after kill -9).
    Detach {
        /// Interface.
        iface: String,
        /// Where pins live.
        #[arg(long, default_value = node::DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
    },
    /// What is attached, jobs and counters (every attached interface if IFACE is omitted).
    Status {
        /// Interface.
        iface: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Print rates per second every SECONDS (until interrupted) instead
        /// of totals once.
        #[arg(long, value_name = "SECONDS")]
        watch: Option<f64>,
        /// Where pins live.
        #[arg(long, default_value = node::DEFAULT_PIN_ROOT)]
        pin_root: PathBuf,
    },
    /// Send one contribution vector to an aggregator (test traffic; no retransmission).
    Contribute {
        /// Aggregator address and job port, e.g. 10.77.0.11:7000.
        #[arg(long)]
        to: SocketAddrV4,
        /// Job id.
        #[arg(long)]
        job: u16,
        /// This sender's rank.
        #[arg(long)]
        rank: u16,
        /// Reduction round.
        #[arg(long, default_value_t = 1)]
        round: u32,
        /// Operation: a name of the op table (include/aggbox/ops.def): sum,
        /// count, max, min, avg, prod, band, bor, bxor, land, lor.
        #[arg(long, default_value = "sum")]
        op: String,
        /// Vector length (values from the deterministic test pattern of this rank).
        #[arg(long, conflicts_with = "values")]
        elements: Option<u32>,
        /// Explicit values, comma-separated.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
        values: Vec<i32>,
        /// Interface MTU the datagrams must fit.
        #[arg(long, default_value_t = 1500)]
        mtu: usize,
        /// First sequence number.
        #[arg(long, default_value_t = 0)]
        seq: u32,
    },
    /// Receive a job's RESULT datagrams on a UDP port and print the reduced
    /// vector; with --workers, compare it with the reference reducer's result
    /// for the test pattern that `contribute --elements` sends.
    Listen {
        /// UDP port (the job's result_port).
        #[arg(long)]
        port: u16,
        /// Job id.
        #[arg(long)]
        job: u16,
        /// Elements to wait for.
        #[arg(long)]
        elements: u32,
        /// Seconds to wait.
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// Compare with the test pattern of this many ranks.
        #[arg(long)]
        workers: Option<u16>,
        /// Operation of the comparison.
        #[arg(long, default_value = "sum")]
        op: String,
    },
    /// Send one AGB1 broadcast datagram (test traffic). Sent to one member
    /// of the group (by convention the first); on a node running `aggbox
    /// attach` with that [[group]], the TC program delivers a copy to every
    /// member whose mask bit is set.
    SendBroadcast {
        /// A member of the group, e.g. 10.77.0.12:7200.
        #[arg(long)]
        to: SocketAddrV4,
        /// Broadcast group id.
        #[arg(long)]
        group: u16,
        /// Destination mask (bit i = member i; 0x... for hex); default all 32.
        #[arg(long, default_value_t = u32::MAX, value_parser = parse_mask)]
        mask: u32,
        /// Sequence number.
        #[arg(long, default_value_t = 0)]
        seq: u32,
        /// Payload text.
        #[arg(long)]
        text: String,
    },
    /// Receive AGB1 broadcast datagrams on a UDP port and print them.
    ListenBroadcast {
        /// UDP port (this member's port in the group).
        #[arg(long)]
        port: u16,
        /// Datagrams to wait for.
        #[arg(long, default_value_t = 1)]
        count: usize,
        /// Seconds to wait.
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
    },
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum ModeArg {
    Native,
    Generic,
}

fn parse_mask(text: &str) -> Result<u32, String> {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|e| format!("bad mask {text:?}: {e}"))
}

fn parse_op(name: &str) -> Result<Op> {
    Op::from_name(name).ok_or_else(|| {
        anyhow!("unknown op {name:?} ({})", Op::names_list())
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let text = format!("{err:#}");
            if text.starts_with("aggbox:") {
                eprintln!("{text}");
            } else {
                eprintln!("aggbox: {text}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Attach {
            iface,
            config,
            pin_root,
            xdp_mode,
            bpf_stats,
        } => attach(&iface, config.as_deref(), &pin_root, xdp_mode, bpf_stats),
        Command::Reload { iface, pin_root } => {
            let outcome = node::request_reload(&iface, &pin_root, Duration::from_secs(10))?;
            if !outcome.ok {
                bail!("aggbox: reload of {iface} refused: {}", outcome.message);
            }
            println!("aggbox: reloaded {iface}: {}", outcome.message);
            Ok(())
        }
        Command::Detach { iface, pin_root } => {
            if node::detach(&iface, &pin_root)? {
                println!("aggbox: detached from {iface}");
            } else {
                match node::hidden_pins_hint(&pin_root) {
                    Some(hint) => println!("aggbox: nothing attached to {iface}; {hint}"),
                    None => println!("aggbox: nothing attached to {iface}"),
                }
            }
            Ok(())
        }
        Command::Status {
            iface,
            json,
            watch,
            pin_root,
        } => {
            if let Some(interval) = watch {
                if json {
                    bail!("--watch prints rates for people; for machines, scrape the metrics endpoint");
                }
                return watch_rates(iface.as_deref(), &pin_root, interval);
            }
            let statuses = node::status(iface.as_deref(), &pin_root)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&statuses)?);
            } else if statuses.is_empty() {
                match node::hidden_pins_hint(&pin_root) {
                    Some(hint) => println!(
                        "aggbox: nothing attached (no state under {}); {hint}",
                        pin_root.display()
                    ),
                    None => println!(
                        "aggbox: nothing attached (no state under {})",
                        pin_root.display()
                    ),
                }
            } else {
                for s in &statuses {
                    print!("{}", node::format_status(s));
                }
            }
            Ok(())
        }
        Command::Contribute {
            to,
            job,
            rank,
            round,
            op,
            elements,
            values,
            mtu,
            seq,
        } => {
            let op = parse_op(&op)?;
            let values = match elements {
                Some(n) => tools::pattern_vector(rank, n),
                None if values.is_empty() => bail!("give --elements N or --values v1,v2,..."),
                None => values,
            };
            let socket = UdpSocket::bind("0.0.0.0:0").context("opening a UDP socket")?;
            let c = tools::Contribution {
                job,
                rank,
                round: aggbox::wire::abi::Round(round),
                op,
                first_seq: seq,
                per_datagram: proto::elements_per_datagram(mtu),
            };
            let sent = tools::contribute(&socket, to, &c, &values)?;
            println!("rank {rank}: sent {} elements in {sent} datagrams to {to} (job {job}, round {round}, {})", values.len(), op.name());
            Ok(())
        }
        Command::Listen {
            port,
            job,
            elements,
            timeout,
            workers,
            op,
        } => listen(port, job, elements, timeout, workers, &op),
        Command::SendBroadcast {
            to,
            group,
            mask,
            seq,
            text,
        } => {
            let socket = UdpSocket::bind("0.0.0.0:0").context("opening a UDP socket")?;
            let len = tools::send_broadcast(&socket, to, group, mask, seq, text.as_bytes())?;
            println!("sent ONE AGB1 datagram of {len} bytes (group {group}, seq {seq}, mask {mask:#010x}) to {to}");
            Ok(())
        }
        Command::ListenBroadcast {
            port,
            count,
            timeout,
        } => {
            let socket = tools::bind_any(port)?;
            let got = tools::collect_broadcasts(&socket, count, Duration::from_secs_f64(timeout))?;
            for b in &got {
                println!(
                    "port {port}: AGB1 from {} group {} seq {} mask {:#010x} hops {}: {:?}",
                    b.from,
                    b.header.group,
                    b.header.seq,
                    b.header.mask,
                    b.header.hops,
                    String::from_utf8_lossy(&b.payload)
                );
            }
            if got.len() < count {
                bail!(
                    "port {port}: received {} of {count} broadcast datagram(s) in {timeout} s",
                    got.len()
                );
            }
            Ok(())
        }
    }
}

fn attach(
    iface: &str,
    config_path: Option<&Path>,
    pin_root: &Path,
    mode: ModeArg,
    bpf_stats: bool,
) -> Result<()> {
    let config = match config_path {
        Some(path) => Config::load(path).map_err(|e| anyhow!("aggbox: {e}"))?,
        None => Config::default(),
    };
    let mode = match mode {
        ModeArg::Native => XdpMode::Native,
        ModeArg::Generic => XdpMode::Generic,
    };
    // Install the signal handlers before attaching so a signal that arrives
    // while attaching still leads to a clean detach (a SIGHUP then waits
    // for the attach to finish).
    let (events_tx, events) = mpsc::channel::<Event>();
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP]).context("installing the SIGINT/SIGTERM/SIGHUP handlers")?;
    let signal_tx = events_tx.clone();
    std::thread::Builder::new()
        .name("aggbox-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal_tx.send(Event::Signal(signal)).is_err() {
                    break;
                }
            }
        })
        .context("starting the signal thread")?;

    // The control endpoint's key file and port, before the interface is
    // touched: a bad key file or a port in use fails the attach here.
    let control = match &config.node.keys {
        Some(path) => {
            let keys = node::control::Keys::load(path).map_err(|e| anyhow!("aggbox: [node] keys: {e}"))?;
            let listener = std::net::TcpListener::bind(config.node.control)
                .with_context(|| format!("aggbox: [node] control: binding {}", config.node.control))?;
            Some((keys, listener))
        }
        None => None,
    };

    // Bind the metrics port first: a port in use must fail the attach while
    // the interface is still untouched.
    let metrics_listener = config.node.metrics.map(metrics::bind).transpose()?;
    let _bpf_stats = if bpf_stats {
        Some(metrics::enable_bpf_stats()?)
    } else {
        None
    };

    let mut attachment = node::attach(iface, &config, config_path, pin_root, mode)?;
    // Jobs on demand: the registry beside the file's jobs (served below).
    let registry = control.as_ref().map(|(keys, _)| {
        Arc::new(Mutex::new(node::control::Registry::new(keys.clone(), node::control::Limits::default(), &config).first_id(random_u16())))
    });
    for warning in &attachment.warnings {
        eprintln!("aggbox: warning: {warning}");
    }
    let _metrics_server = match metrics_listener {
        Some(listener) => {
            let programs = attachment
                .xdp
                .programs()
                .map_err(|e| anyhow!("aggbox: {e}"))?
                .into_iter()
                .map(|p| metrics::ProgramRef {
                    name: p.name.to_string(),
                    id: p.id,
                })
                .collect();
            let userspace = attachment.userspace.as_ref().map(|u| u.stats_fn());
            let mut source = metrics::source_for(iface, attachment.pin_dir(), programs, userspace);
            source.results = attachment.results.as_ref().map(|r| r.stats_fn());
            source.rings = attachment.rings.as_ref().map(|r| r.stats_fn());
            source.control = registry.clone().map(|r| -> metrics::ControlStatsFn {
                Arc::new(move || {
                    let r = r.lock().unwrap_or_else(|p| p.into_inner());
                    (r.counts().clone(), r.live().len(), r.rings().len())
                })
            });
            let server = metrics::MetricsServer::start(listener, vec![source])?;
            eprintln!("aggbox: metrics at http://{}/metrics", server.local_addr());
            Some(server)
        }
        None => None,
    };
    eprintln!(
        "aggbox: XDP in {} mode ({} chain) on {iface}{}, {} job(s), {} group(s){}{}, pinned under {}",
        attachment.record.xdp_mode,
        attachment.record.xdp_chain,
        if attachment.record.lo_xdp {
            " (and generic on lo)"
        } else {
            ""
        },
        config.jobs.len(),
        config.groups.len(),
        if attachment.record.tc {
            ", TC broadcast attached"
        } else {
            ""
        },
        if attachment.record.userspace_path {
            ", user-space path running"
        } else if attachment.record.userspace_path_error.is_some() {
            ", user-space path NOT running"
        } else {
            ""
        },
        attachment.pin_dir().display()
    );
    println!("aggbox: attached to {iface}");
    // stdout may be a pipe read by a supervisor: make the line visible now.
    use std::io::Write;
    std::io::stdout().flush().ok();

    // Jobs on demand: the registry beside the file's jobs; its changes
    // come back here to be applied (docs/INTERFACE.md, "Jobs on demand").
    let mut file_config = config.clone();
    let control = match (control, registry) {
        (Some((_, listener)), Some(registry)) => {
            let (changes_tx, changes) = mpsc::channel();
            let capacity = registry.lock().unwrap_or_else(|p| p.into_inner()).limits().jobs;
            // The jobs and the rings served for runs on demand.
            let mut published = node::control::PublishedJobs::create(attachment.pin_dir(), capacity + aggbox::wire::abi::MAX_RINGS)?;
            let mut failing = false;
            let publish: Box<dyn FnMut(&node::control::Registry) + Send> = Box::new(move |r| match published.publish(r) {
                // Said once per failing spell, not at every tick.
                Err(e) if !failing => {
                    eprintln!("aggbox: control: `aggbox status` may show stale jobs on demand: {e:#}");
                    failing = true;
                }
                Err(_) => {}
                Ok(()) => failing = false,
            });
            let server = node::control::server::ControlServer::start(listener, registry.clone(), changes_tx, Some(publish))
                .context("aggbox: starting the control endpoint")?;
            let forward = events_tx.clone();
            std::thread::Builder::new()
                .name("aggbox-control-events".into())
                .spawn(move || {
                    for change in changes {
                        if forward.send(Event::Control(change)).is_err() {
                            break;
                        }
                    }
                })
                .context("starting the control event thread")?;
            node::metrics::control_apply_seconds(); // exported from the start, at 0
            eprintln!("aggbox: control endpoint (jobs on demand) at {}", server.local_addr());
            Some((server, registry))
        }
        _ => None,
    };
    drop(events_tx);
    while let Ok(event) = events.recv() {
        match event {
            Event::Signal(SIGHUP) => {
                if let Some(new) = reload(&mut attachment, iface, config_path, control.as_ref().map(|c| &c.1)) {
                    file_config = new;
                }
            }
            Event::Signal(_) => break,
            Event::Control(change) => {
                if let Some((server, registry)) = &control {
                    apply_control(&mut attachment, &file_config, server, registry, change);
                }
            }
        }
    }
    drop(control);
    attachment.detach()?;
    // The supervisor may have stopped reading stdout by now: a closed pipe
    // must not turn a clean detach into a panic.
    let _ = writeln!(std::io::stdout(), "aggbox: detached from {iface}");
    Ok(())
}

/// `aggbox status --watch SECONDS`: rates per second of every attached
/// interface, one block per interval.
fn watch_rates(iface: Option<&str>, pin_root: &Path, interval: f64) -> Result<()> {
    if !(0.1..=3600.0).contains(&interval) {
        bail!("--watch {interval}: give an interval between 0.1 and 3600 seconds");
    }
    let mut before = node::status(iface, pin_root)?;
    if before.is_empty() {
        bail!("nothing attached (no state under {})", pin_root.display());
    }
    let mut at = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs_f64(interval));
        let now = node::status(iface, pin_root)?;
        let seconds = at.elapsed().as_secs_f64();
        at = std::time::Instant::now();
        for status in &now {
            if let Some(old) = before.iter().find(|b| b.attach.iface == status.attach.iface) {
                print!("{}", node::format_rates(old, status, seconds));
            }
        }
        println!();
        before = now;
    }
}

/// A random u16 (the kernel's entropy; the time when it cannot be read).
fn random_u16() -> u16 {
    use std::io::Read;
    let mut b = [0u8; 2];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        Ok(()) => u16::from_ne_bytes(b),
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() as u16),
    }
}

/// What the attach loop waits for.
enum Event {
    Signal(i32),
    /// The control endpoint's live jobs changed.
    Control(node::control::server::Change),
}

/// SIGHUP: read the config file again and apply its jobs and groups (with
/// the live jobs on demand); the outcome goes to stderr and to the attach
/// record (`aggbox reload`). Returns the file's new configuration once
/// applied.
fn reload(
    attachment: &mut node::Attachment,
    iface: &str,
    config_path: Option<&Path>,
    registry: Option<&Arc<Mutex<node::control::Registry>>>,
) -> Option<Config> {
    let Some(path) = config_path else {
        eprintln!("aggbox: SIGHUP: {iface} was attached without --config, nothing to reload");
        let _ = attachment.refuse_reload(&anyhow!("attached without --config: there is no file to reload"));
        return None;
    };
    let loaded = Config::load(path).map_err(|e| anyhow!("{e}")).and_then(|new| {
        let Some(registry) = registry else { return Ok((new.clone(), new)) };
        let registry = registry.lock().unwrap_or_else(|p| p.into_inner());
        let effective = node::control::with_dynamic_jobs(&new, &registry).map_err(|e| anyhow!("{e}"))?;
        Ok((new, effective))
    });
    match loaded {
        Ok((new, effective)) => match attachment.reload(&effective, Some(path)) {
            Ok(summary) => {
                eprintln!("aggbox: reloaded {}: {summary}", path.display());
                if let Some(registry) = registry {
                    let mut registry = registry.lock().unwrap_or_else(|p| p.into_inner());
                    registry.set_file(&new);
                    // The key file too: a revoked tenant is refused from now on.
                    match new.node.keys.as_deref().map(node::control::Keys::load) {
                        Some(Ok(keys)) => registry.set_keys(keys),
                        Some(Err(e)) => eprintln!("aggbox: reload: [node] keys: {e}; the tenants stay as they were"),
                        None => {}
                    }
                }
                Some(new)
            }
            Err(e) => {
                eprintln!("aggbox: reload of {} refused: {e:#}", path.display());
                None
            }
        },
        Err(e) => {
            let e = anyhow!("{e}; nothing was changed");
            eprintln!("aggbox: reload of {} refused: {e:#}", path.display());
            if let Err(record) = attachment.refuse_reload(&e) {
                eprintln!("aggbox: {record:#}");
            }
            None
        }
    }
}

/// The live jobs on demand changed: the node's kernel state becomes the
/// file's and theirs, then the waiting ranks get their replies. A job the
/// node could not apply is removed again and its ranks are refused.
fn apply_control(
    attachment: &mut node::Attachment,
    file: &Config,
    server: &node::control::server::ControlServer,
    registry: &Arc<Mutex<node::control::Registry>>,
    change: node::control::server::Change,
) {
    use aggbox::wire::control::{Refusal, Reply};
    let mut replies = change.replies;
    let effective = {
        let registry = registry.lock().unwrap_or_else(|p| p.into_inner());
        node::control::with_dynamic_jobs(file, &registry)
    };
    let started = std::time::Instant::now();
    let applied = effective
        .map_err(|e| anyhow!("{e}"))
        .and_then(|c| attachment.apply_jobs(&c));
    node::metrics::control_apply_seconds().observe(started.elapsed().as_secs_f64());
    if let Err(e) = applied {
        eprintln!("aggbox: control: the node could not apply the jobs on demand: {e:#}");
        let mut registry = registry.lock().unwrap_or_else(|p| p.into_inner());
        for (_, reply) in &mut replies {
            if let Reply::Joined(grant) = reply {
                registry.remove(grant.job);
                *reply = Reply::Refused {
                    reason: Refusal::Unavailable,
                    message: format!("the node could not serve the job: {e:#}"),
                };
            } else if let Reply::RingInstalled { ring, .. } = reply {
                registry.remove_ring(*ring);
                *reply = Reply::Refused {
                    reason: Refusal::Unavailable,
                    message: format!("the node could not serve the ring: {e:#}"),
                };
            }
        }
        // The node is back where the registry now is (the writes of a
        // failed apply are undone): nothing else to do.
    }
    server.deliver(replies);
}

fn listen(
    port: u16,
    job: u16,
    elements: u32,
    timeout: f64,
    workers: Option<u16>,
    op: &str,
) -> Result<()> {
    let op = parse_op(op)?;
    let socket = tools::bind_any(port)?;
    let got = tools::collect_results(&socket, job, elements, Duration::from_secs_f64(timeout))?;
    println!(
        "received {} RESULT datagram(s) for job {job}: {} of {elements} elements{}{}",
        got.datagrams,
        elements as usize
            - got
                .missing
                .iter()
                .map(|(a, b)| (b - a) as usize)
                .sum::<usize>(),
        if got.overflow { ", OVERFLOW" } else { "" },
        if got.last_fragment_seen {
            ", last fragment seen"
        } else {
            ""
        },
    );
    let head = |v: &[i32]| {
        v.iter()
            .take(8)
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("  result    [{} ...]", head(&got.values));
    if !got.missing.is_empty() {
        bail!("missing elements {:?} after {timeout} s", got.missing);
    }
    if let Some(workers) = workers {
        let expected = tools::expected_pattern_result(op, workers, elements, &[])?;
        let want = expected
            .ints()
            .ok_or_else(|| anyhow!("reference reducer returned floats"))?;
        println!(
            "  reference [{} ...]  ({} of {workers} ranks' test vectors)",
            head(want),
            op.name()
        );
        let wrong = got.values.iter().zip(want).filter(|(a, b)| a != b).count();
        if wrong > 0 || got.overflow != expected.overflow {
            bail!("{wrong} element(s) differ from the reference reducer");
        }
        println!("  all {elements} elements equal the reference reducer's result");
    }
    Ok(())
}
