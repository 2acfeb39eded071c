//! `aggbox-bench soak-worker`: one participant of one run of the soak
//! (docs/ROBUSTNESS.md "Production soak"), a process of its own so that the
//! driver can kill it with -9. The driver starts it inside its host's
//! network namespace (`ip netns exec`).
//!
//! Every input is a function of (run, call, rank, element) only
//! ([`input`]), so each participant checks every result it gets against
//! the project's reference reducer (`aggbox::wire::reducer`) over all
//! ranks' inputs, without talking to anyone. Each call is logged to
//! `--log` as two lines, `begin` before it and `end` after it (outcome
//! `ok`, `wrong` or `error` with its cause), written unbuffered, so a
//! call a killed or hung process never finished is still seen by the
//! driver. The first failed call ends the process (as the MPI shim
//! aborts): a run that went on past a failed call may leave contributions
//! in more than one round past the newest RESULT (docs/PROTOCOL.md "AGP1",
//! Limits).

use std::fs::File;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aggbox::config::Config;
use aggbox::runtime::{BackendKind, Collective, CommError, Communicator, CommunicatorBuilder, Participant, RingCommunicator};
use aggbox::wire::abi::{Op, Round};
use aggbox::wire::reducer;
use anyhow::{bail, Context, Result};

/// Which of the soak's jobs a participant belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum JobKind {
    /// A star job with an aggregator application (`consumer = "application"`).
    Star,
    /// A node-served star job (`consumer = "node"`).
    Served,
    /// A ring (`[[ring]]`), one member per node.
    Ring,
}

impl JobKind {
    /// Name in logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            JobKind::Star => "star",
            JobKind::Served => "served",
            JobKind::Ring => "ring",
        }
    }

    /// Every kind, in report order.
    pub const ALL: [JobKind; 3] = [JobKind::Star, JobKind::Served, JobKind::Ring];
}

/// Command line of `aggbox-bench soak-worker` (written by the driver).
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "aggbox-bench soak-worker", about = "One participant of a soak run (started by `aggbox-bench soak`)")]
pub struct WorkerArgs {
    #[arg(long, value_enum)]
    pub kind: JobKind,
    /// Worker rank (ring: member index); absent = the star job's aggregator application.
    #[arg(long)]
    pub rank: Option<u16>,
    /// Number of ranks (ring: members), for the reference.
    #[arg(long)]
    pub ranks: u16,
    #[arg(long)]
    pub run: u64,
    #[arg(long)]
    pub calls: u64,
    /// Job id (ring: ring id).
    #[arg(long)]
    pub job: u16,
    #[arg(long)]
    pub config: PathBuf,
    /// The aggregator node's address (star jobs).
    #[arg(long, default_value = "0.0.0.0")]
    pub node: Ipv4Addr,
    /// Workers' data port (star jobs).
    #[arg(long, default_value_t = 0)]
    pub data_port: u16,
    /// The node's pin directory (ring).
    #[arg(long)]
    pub pin_dir: Option<PathBuf>,
    /// First round and contribution seq (the star job with an aggregator
    /// application; a node-served worker asks its node).
    #[arg(long)]
    pub start_round: Option<u32>,
    #[arg(long, default_value_t = 0)]
    pub start_seq: u32,
    #[arg(long, default_value_t = 8000)]
    pub deadline_ms: u64,
    /// Pause between calls.
    #[arg(long, default_value_t = 50)]
    pub pace_ms: u64,
    #[arg(long)]
    pub log: PathBuf,
}

/// Element `i` of rank `rank`'s input to call `call` of run `run`: the
/// same on every machine and in the driver, within ±10,000 so no SUM of a
/// few ranks overflows.
pub fn input(run: u64, call: u64, rank: u16, len: usize) -> Vec<i32> {
    let salt = (run.wrapping_mul(7919) + call.wrapping_mul(31)) as usize;
    (0..len).map(|i| ((i * 7 + rank as usize * 1_000_003 + salt) % 20_001) as i32 - 10_000).collect()
}

/// Length and op of call `call` of run `run` of a star job: sizes from one
/// element to 56 fragments at MTU 1500.
pub fn star_call(run: u64, call: u64) -> (usize, Op) {
    const LENS: [usize; 6] = [1, 362, 1000, 4000, 20_000, 363];
    const OPS: [Op; 3] = [Op::Sum, Op::Max, Op::Min];
    let h = run.wrapping_mul(0x9E37_79B9).wrapping_add(call.wrapping_mul(2_654_435_761));
    (LENS[(h % 6) as usize], OPS[((h / 7) % 3) as usize])
}

/// Op of call `call` of a ring run (its length is the ring's `vector_len`).
pub fn ring_op(run: u64, call: u64) -> Op {
    const OPS: [Op; 4] = [Op::Sum, Op::Max, Op::Min, Op::Avg];
    OPS[((run + call) % 4) as usize]
}

/// The reference reducer's result over every rank's input (weights 1).
pub fn reference(op: Op, run: u64, call: u64, ranks: u16, len: usize) -> Result<Vec<i32>> {
    let inputs: Vec<Vec<i32>> = (0..ranks).map(|r| input(run, call, r, len)).collect();
    let c: Vec<(&[i32], i32)> = inputs.iter().map(|v| (v.as_slice(), 1)).collect();
    let out = reducer::reduce(op, &c).map_err(|e| anyhow::anyhow!("reference reducer: {e:?}"))?;
    Ok(out.ints().context("reference reducer: not ints")?.to_vec())
}

/// Milliseconds since the Unix epoch (the driver compares them with its own clock).
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The cause of a failed call, one word (the report's key) and the
/// message (commas replaced: the log is comma-separated).
pub fn cause(e: &CommError) -> (&'static str, String) {
    let word = match e {
        CommError::Timeout(_) => "timeout",
        CommError::Overflow { .. } => "overflow",
        CommError::Config(_) => "config",
        CommError::Io(_) => "io",
        CommError::Closed => "closed",
        CommError::Position(_) => "position",
        CommError::JobLost(_) => "job_lost",
    };
    (word, clean(&e.to_string()))
}

fn clean(s: &str) -> String {
    s.replace([',', '\n', '\r'], ";")
}

struct Log {
    file: File,
    prefix: String,
}

impl Log {
    fn line(&mut self, text: &str) {
        // Unbuffered and one write a line: a kill -9 leaves whole lines.
        let _ = self.file.write_all(format!("{},{text}\n", self.prefix).as_bytes());
    }
}

enum Participant_ {
    Star(Communicator),
    Ring(RingCommunicator),
}

/// Run the participant: build, make `calls` calls, log each, exit.
pub fn run(args: WorkerArgs) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log)
        .with_context(|| format!("opening {}", args.log.display()))?;
    let rank_word = args.rank.map(|r| r.to_string()).unwrap_or_else(|| "agg".into());
    let mut log = Log { file, prefix: format!("{},{},{}", args.kind.name(), args.run, rank_word) };
    let config = Config::load(&args.config).with_context(|| format!("loading {}", args.config.display()))?;
    let deadline = Duration::from_millis(args.deadline_ms);
    let t_build = unix_ms();
    let start = Instant::now();
    let built: Result<Participant_, CommError> = match args.kind {
        JobKind::Star | JobKind::Served => {
            let me = match args.rank {
                Some(r) => Participant::Worker(r),
                None => Participant::Aggregator,
            };
            let mut b = CommunicatorBuilder::from_config(&config, args.job, args.node, args.data_port, me)?
                .backend(BackendKind::Kernel)
                .deadline(deadline);
            if let Some(round) = args.start_round {
                b = b.resume(Round(round), args.start_seq);
            }
            b.build().map(Participant_::Star)
        }
        JobKind::Ring => {
            let Some(pin_dir) = &args.pin_dir else { bail!("--pin-dir is needed for a ring member") };
            RingCommunicator::open(&config, args.job, pin_dir).map(|mut c| {
                c.set_deadline(deadline);
                Participant_::Ring(c)
            })
        }
    };
    let build_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut comm = match built {
        Ok(c) => c,
        Err(e) => {
            let (word, msg) = cause(&e);
            // A failed build counts as a failed call: the application asked
            // for a communicator with a deadline and did not get one.
            log.line(&format!("end,build,{t_build},{build_ms:.3},{},error,build-{word},{msg}", args.deadline_ms));
            std::process::exit(3);
        }
    };
    let position = match &comm {
        Participant_::Star(c) => c.position().0 .0,
        Participant_::Ring(c) => c.round().0,
    };
    log.line(&format!("built,{t_build},{build_ms:.3},{position}"));
    for call in 0..args.calls {
        let (len, op) = match &comm {
            Participant_::Star(_) => star_call(args.run, call),
            Participant_::Ring(c) => (c.len(), ring_op(args.run, call)),
        };
        let want = reference(op, args.run, call, args.ranks, len)?;
        let mut v = match args.rank {
            Some(r) => input(args.run, call, r, len),
            None => vec![0; len],
        };
        let t0 = unix_ms();
        log.line(&format!("begin,{call},{t0},{len},{op:?}"));
        let started = Instant::now();
        let out: Result<(), CommError> = match &mut comm {
            Participant_::Star(c) => c.allreduce(&mut v, op).map(drop),
            Participant_::Ring(c) => c.allreduce_i32(&mut v, op).map(drop),
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match out {
            Ok(()) if v == want => log.line(&format!("end,{call},{t0},{ms:.3},{},ok,,", args.deadline_ms)),
            Ok(()) => {
                let i = v.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                log.line(&format!(
                    "end,{call},{t0},{ms:.3},{},wrong,wrong,{op:?} of {len}: element {i} is {} where the reference is {}",
                    args.deadline_ms, v[i], want[i]
                ));
            }
            Err(e) => {
                let (word, msg) = cause(&e);
                log.line(&format!("end,{call},{t0},{ms:.3},{},error,{word},{msg}", args.deadline_ms));
                std::process::exit(2);
            }
        }
        // No pause after the last call: an application exits right after
        // it, and so does this one (a pause would let a lost closing ACK be
        // repaired, which an exiting application does not allow).
        if call + 1 < args.calls {
            std::thread::sleep(Duration::from_millis(args.pace_ms));
        }
    }
    let position = match &comm {
        Participant_::Star(c) => {
            let (r, s) = c.position();
            format!("{},{s}", r.0)
        }
        Participant_::Ring(c) => format!("{},0", c.round().0),
    };
    log.line(&format!("exit,{position}"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_a_function_of_run_call_rank_and_element_and_sums_fit() {
        assert_eq!(input(3, 7, 1, 500), input(3, 7, 1, 500));
        assert_ne!(input(3, 7, 1, 500), input(3, 8, 1, 500));
        assert_ne!(input(3, 7, 1, 500), input(4, 7, 1, 500));
        assert_ne!(input(3, 7, 1, 500), input(3, 7, 2, 500));
        assert!(input(9, 9, 2, 20_000).iter().all(|x| (-10_000..=10_000).contains(x)));
        let want: Vec<i32> = (0..1000).map(|i| (0..3).map(|r| input(5, 2, r, 1000)[i]).sum()).collect();
        assert_eq!(reference(Op::Sum, 5, 2, 3, 1000).unwrap(), want);
        for call in 0..50 {
            let (len, op) = star_call(11, call);
            assert!((1..=20_000).contains(&len) && [Op::Sum, Op::Max, Op::Min].contains(&op));
        }
    }
}
