//! Scrapes a live `aggbox attach` in a testbed namespace: the exposition
//! passes `promtool check metrics`, and the counters move with real traffic
//! (needs root: network namespaces, BPF). The endpoint's limits (slow,
//! endless and oversized requests) are tested on loopback without root.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aggbox::wire::abi::Op;
use crate::testbed::{in_netns, Testbed, TestbedConfig};
use aggbox::node::tools;

const JOB: u16 = 21;
const PORT: u16 = 7100;
const RESULT_PORT: u16 = 7101;
const METRICS_PORT: u16 = 9435;
const ELEMENTS: u32 = 800;

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/metrics.rs needs root (network namespaces and BPF); run `sudo -E cargo test --test metrics`"
    );
}

mod live_attach;
use live_attach::LiveAttach;

fn scrape(netns: &str) -> String {
    in_netns(netns, || {
        let mut stream = TcpStream::connect(("127.0.0.1", METRICS_PORT)).expect("connect to /metrics");
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(stream, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read response");
        assert!(response.starts_with("HTTP/1.1 200"), "bad response: {response}");
        response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).expect("body")
    })
    .expect("enter namespace")
}

/// Outcome labels of `aggbox_job_contributions_total`.
const JOB_OUTCOMES: [&str; 6] = ["accepted", "result", "retransmission", "stale", "to_userspace", "dropped"];

fn job_sample(outcome: &str) -> String {
    format!("aggbox_job_contributions_total{{iface=\"eth0\",aggbox_job=\"{JOB}\",outcome=\"{outcome}\"}}")
}

/// promtool is the reference linter for the exposition format and names.
fn promtool_check(exposition: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (from the prometheus package; `make deps` installs it)");
    promtool.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn value(exposition: &str, name_and_labels: &str) -> f64 {
    exposition
        .lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name_and_labels} in:\n{exposition}"))
}

#[test]
fn metrics_are_valid_and_move_with_traffic() {
    require_root();
    let bed = Testbed::up(TestbedConfig { hosts: 3, ..Default::default() }).expect("testbed");
    let agg = bed.host(0);
    let senders = [bed.host(1), bed.host(2)];

    let config = format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\n\n[[job]]\nid = {JOB}\nport = {PORT}\nworkers = [\"{}\", \"{}\"]\nresult_port = {RESULT_PORT}\n",
        senders[0].addr, senders[1].addr
    );
    let attach = LiveAttach::start(&agg.netns, "metrics", &config, &["--bpf-stats"]);

    let before = scrape(&agg.netns);
    assert_eq!(value(&before, &format!("aggbox_job_results_total{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")), 0.0);

    for outcome in JOB_OUTCOMES {
        assert_eq!(value(&before, &job_sample(outcome)), 0.0, "{outcome}");
    }
    assert_eq!(value(&before, &format!("aggbox_job_payload_bytes_total{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")), 0.0);
    promtool_check(&before);

    // One reduction from both ranks, plus one spoofed datagram.
    let results = bed.in_host(0, || tools::bind_any(RESULT_PORT).unwrap()).unwrap();
    let to = SocketAddrV4::new(agg.addr, PORT);
    for (rank, sender) in senders.iter().enumerate() {
        let netns = sender.netns.clone();
        in_netns(&netns, move || {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
            let c = tools::Contribution { job: JOB, rank: rank as u16, round: aggbox::wire::abi::Round(1), op: Op::Sum, first_seq: 0, per_datagram: 362 };
            tools::contribute(&socket, to, &c, &tools::pattern_vector(rank as u16, ELEMENTS)).unwrap();
        })
        .unwrap();
    }
    // Rank 1's vector again from rank 0's host: wrong source address.
    in_netns(&senders[0].netns.clone(), move || {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        let c = tools::Contribution { job: JOB, rank: 1, round: aggbox::wire::abi::Round(2), op: Op::Sum, first_seq: 0, per_datagram: 362 };
        tools::contribute(&socket, to, &c, &[1, 2, 3]).unwrap();
    })
    .unwrap();
    let got = tools::collect_results(&results, JOB, ELEMENTS, Duration::from_secs(10)).unwrap();
    assert!(got.missing.is_empty(), "missing result elements {:?}", got.missing);
    let expected = tools::expected_pattern_result(Op::Sum, 2, ELEMENTS, &[]).unwrap();
    assert_eq!(got.values, expected.ints().unwrap());

    // Rank 0's vector once more: every fragment is complete, so each
    // datagram is a retransmission of the job.
    in_netns(&senders[0].netns.clone(), move || {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        let c = tools::Contribution { job: JOB, rank: 0, round: aggbox::wire::abi::Round(1), op: Op::Sum, first_seq: 100, per_datagram: 362 };
        tools::contribute(&socket, to, &c, &tools::pattern_vector(0, ELEMENTS)).unwrap();
    })
    .unwrap();
    let fragments = ELEMENTS.div_ceil(362) as f64;
    let deadline = Instant::now() + Duration::from_secs(5);
    let after = loop {
        let after = scrape(&agg.netns);
        if value(&after, &job_sample("retransmission")) >= fragments || Instant::now() > deadline {
            break after;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    promtool_check(&after);
    // Per job: both ranks' datagrams (accepted or completing), the
    // retransmissions, the spoofed one dropped; payload = 24-byte header +
    // 4 bytes per element of each datagram.
    assert_eq!(value(&after, &job_sample("accepted")), fragments);
    assert_eq!(value(&after, &job_sample("result")), fragments);
    assert_eq!(value(&after, &job_sample("retransmission")), fragments);
    assert_eq!(value(&after, &job_sample("dropped")), 1.0);
    assert_eq!(value(&after, &job_sample("stale")), 0.0);
    assert_eq!(value(&after, &job_sample("to_userspace")), 0.0);
    assert_eq!(value(&after, &format!("aggbox_job_overflow_results_total{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")), 0.0);
    let vector_bytes = 24.0 * fragments + 4.0 * ELEMENTS as f64;
    assert_eq!(
        value(&after, &format!("aggbox_job_payload_bytes_total{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")),
        3.0 * vector_bytes + (24.0 + 3.0 * 4.0)
    );
    assert_eq!(value(&after, &format!("aggbox_job_results_total{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")), fragments);
    assert_eq!(value(&after, "aggbox_datagrams_total{iface=\"eth0\",outcome=\"result\"}"), fragments);
    assert_eq!(value(&after, "aggbox_datagrams_total{iface=\"eth0\",outcome=\"accepted\"}"), fragments);
    assert_eq!(value(&after, "aggbox_dropped_total{iface=\"eth0\",reason=\"source_mismatch\"}"), 1.0);
    assert_eq!(value(&after, &format!("aggbox_job_slots_active{{iface=\"eth0\",aggbox_job=\"{JOB}\"}}")), 0.0);
    // Every fragment in its fast slot: taken once, both ranks joined.
    assert_eq!(value(&after, "aggbox_fast_slot_events_total{iface=\"eth0\",event=\"taken\"}"), fragments);
    assert_eq!(value(&after, "aggbox_fast_slot_events_total{iface=\"eth0\",event=\"joined\"}"), 2.0 * fragments);
    assert_eq!(value(&after, "aggbox_fast_slot_events_total{iface=\"eth0\",event=\"busy\"}"), 0.0);
    // --bpf-stats was given: the entry program's run count covers every datagram.
    assert!(value(&after, "aggbox_program_runs_total{iface=\"eth0\",program=\"aggbox_xdp\"}") >= 2.0 * fragments + 1.0);

    drop(attach);
    let _ = std::fs::remove_file(&config);
    drop(bed);
}

/// One scrape of `addr` that must be answered 200 within `within`.
fn scrape_within(addr: SocketAddr, within: Duration) -> String {
    let started = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, within).expect("connect to /metrics");
    stream.set_read_timeout(Some(within)).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    let read = stream.read_to_string(&mut response);
    assert!(
        read.is_ok() && started.elapsed() < within,
        "scrape not answered within {within:?} ({read:?} after {:?}): {response:?}",
        started.elapsed()
    );
    assert!(response.starts_with("HTTP/1.1 200"), "bad response: {response}");
    response
}

/// Whether the server has closed `stream` (EOF, reset, or an error status
/// line followed by EOF) within `within`.
fn closed_by_server_within(stream: &mut TcpStream, within: Duration) -> Result<String, String> {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => Ok(String::from_utf8_lossy(&got).into_owned()),
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => Ok(format!("reset: {e}")),
        Err(e) => Err(format!("still open after {within:?} ({e}); read so far {:?}", String::from_utf8_lossy(&got))),
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Issue #21 item 5: a client that connects and stalls, one that trickles an
/// endless request line, and one that sends an oversized request head do
/// not delay a scrape, and each is closed by the server within its bounds
/// (header timeout, request-size limit). The server used to serve one
/// connection at a time and read request lines without a limit, so the
/// trickling client stalled every scrape for as long as it kept sending.
#[test]
fn slow_endless_and_oversized_requests_do_not_stall_a_scrape() {
    use aggbox::node::metrics::{self, MetricsServer, HEADER_READ_TIMEOUT, MAX_REQUEST_BYTES};
    let listener = metrics::bind("127.0.0.1:0".parse().unwrap()).expect("bind loopback");
    let server = MetricsServer::start(listener, Vec::new()).expect("metrics server");
    let addr = server.local_addr();

    // Stalls after half a request line.
    let mut silent = TcpStream::connect(addr).expect("connect");
    silent.write_all(b"GET /metr").unwrap();

    // Sends one more byte of a request line that never ends every 20 ms.
    let stop = Arc::new(AtomicBool::new(false));
    // Dropped before `server` if an assertion fails: the trickler stops, so
    // a server that is stuck reading it can still be joined (the test fails
    // instead of hanging).
    let _stop_on_unwind = StopOnDrop(stop.clone());
    let trickler = {
        let stop = stop.clone();
        let mut stream = TcpStream::connect(addr).expect("connect");
        std::thread::spawn(move || {
            stream.write_all(b"GET /").unwrap();
            let started = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if stream.write_all(b"a").is_err() {
                    // Closed by the server: how long it kept us.
                    return Some(started.elapsed());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            None
        })
    };
    std::thread::sleep(Duration::from_millis(200));

    // A request head of twice the limit, sent at once.
    let mut oversized = TcpStream::connect(addr).expect("connect");
    let mut head = b"GET /metrics HTTP/1.1\r\nX-Padding: ".to_vec();
    head.resize(2 * MAX_REQUEST_BYTES, b'a');
    let _ = oversized.write_all(&head);

    // Scrapes succeed at once while all three are open.
    for _ in 0..3 {
        scrape_within(addr, Duration::from_secs(2));
    }

    // The oversized request is refused (431) and closed, not read on.
    let answer = closed_by_server_within(&mut oversized, Duration::from_secs(3)).expect("oversized request closed");
    assert!(answer.starts_with("HTTP/1.1 431") || answer.starts_with("reset"), "oversized request: {answer:?}");

    // The stalled and the endless client are cut off after the header timeout.
    let bound = HEADER_READ_TIMEOUT + Duration::from_secs(3);
    let answer = closed_by_server_within(&mut silent, bound).expect("stalled client closed");
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 408") || answer.starts_with("reset"), "stalled client: {answer:?}");
    let deadline = Instant::now() + bound;
    while !trickler.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let kept = trickler.join().expect("trickler thread");
    assert!(kept.is_some_and(|d| d <= bound), "the endless request line was not cut off within {bound:?}: {kept:?}");

    // And the endpoint still serves.
    scrape_within(addr, Duration::from_secs(2));
    drop(server);
}
