//! The operator's view, checked against real servers: the shipped rules
//! (`deploy/prometheus/aggbox.rules.yml`) pass `promtool check rules` and
//! their unit tests (`promtool test rules`); a real Prometheus server
//! (Debian's `prometheus`, installed by `make deps`) scrapes a live `aggbox
//! attach` in a testbed namespace with those rules loaded, and its HTTP API
//! returns the per-job counters, a `rate()` over them and the drops by
//! reason that the traffic sent must produce; every rule evaluates without
//! error; every expression of the Grafana dashboard
//! (`deploy/grafana/aggbox.json`) is accepted by the server and names only
//! metrics the live node exposes; `aggbox status` lists the group with its
//! members' next hops.
//!
//! The live test needs root (network namespaces, BPF):
//! `sudo -E cargo test --test prometheus`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;
mod live_attach;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aggbox::node::tools;
use aggbox::wire::abi::{Op, Round};
use live_attach::LiveAttach;
use testbed::{in_netns, Testbed, TestbedConfig};

const JOB: u16 = 31;
const PORT: u16 = 7300;
const RESULT_PORT: u16 = 7301;
const GROUP: u16 = 6;
const METRICS_PORT: u16 = 9491;
const PROMETHEUS_PORT: u16 = 9492;
const ELEMENTS: u32 = 800;

/// Rules (alerting and recording) in deploy/prometheus/aggbox.rules.yml.
const SHIPPED_RULES: usize = 16;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(path)
}

fn promtool(args: &[&str], cwd: &Path) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| panic!("promtool (Debian package prometheus, installed by `make deps`): {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn shipped_rules_pass_promtool_and_their_unit_tests() {
    let dir = deploy("prometheus");
    let checked = promtool(&["check", "rules", "aggbox.rules.yml"], &dir);
    assert!(checked.contains(&format!("SUCCESS: {SHIPPED_RULES} rules found")), "{checked}");
    let tested = promtool(&["test", "rules", "aggbox.rules.test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
    promtool(&["check", "config", "prometheus.yml"], &dir);
}

/// Debian's `prometheus` server inside a namespace, stopped (by its pid)
/// and its storage removed on drop.
struct PrometheusServer {
    child: Child,
    dir: PathBuf,
}

impl PrometheusServer {
    fn start(netns: &str) -> PrometheusServer {
        let dir = std::env::temp_dir().join(format!("aggbox-prometheus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: aggbox\n    static_configs:\n      - targets: [\"127.0.0.1:{METRICS_PORT}\"]\n",
                deploy("prometheus/aggbox.rules.yml").display()
            ),
        )
        .expect("write prometheus.yml");
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "prometheus"])
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("log")).expect("log file"))
            .spawn()
            .expect("start prometheus (Debian package prometheus, installed by `make deps`)");
        let mut server = PrometheusServer { child, dir };
        // Ready when its API answers (TSDB opened, rules loaded).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(server.dir.join("log")).unwrap_or_default();
                panic!("prometheus exited ({status}):\n{log}");
            }
            if http_get(netns, PROMETHEUS_PORT, "/-/ready").0.contains("200") {
                return server;
            }
            assert!(Instant::now() < deadline, "prometheus not ready within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` from 127.0.0.1:`port` inside `netns`: (status line, body).
fn http_get(netns: &str, port: u16, path: &str) -> (String, String) {
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    in_netns(netns, || {
        let mut stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(request.as_bytes())?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        Ok::<_, std::io::Error>((head.lines().next().unwrap_or("").to_string(), body.to_string()))
    })
    .expect("netns")
    .unwrap_or_else(|e| (format!("connection failed: {e}"), String::new()))
}

/// Percent-encoding of a query parameter (RFC 3986 unreserved kept).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query: the server's whole JSON answer (`status` checked by
/// the caller).
fn query(netns: &str, expr: &str) -> serde_json::Value {
    let (status, body) = http_get(netns, PROMETHEUS_PORT, &format!("/api/v1/query?query={}", encode(expr)));
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("query {expr}: {status}: {e}: {body}"))
}

/// The single value of `expr` (None: no series).
fn value(netns: &str, expr: &str) -> Option<f64> {
    let answer = query(netns, expr);
    assert_eq!(answer["status"], "success", "{expr}: {answer}");
    let result = answer["data"]["result"].as_array().expect("vector");
    assert!(result.len() <= 1, "{expr}: one series expected: {answer}");
    result.first().map(|s| s["value"][1].as_str().expect("value").parse().expect("number"))
}

/// Waits (20 s at most) until `expr` is at least `min`; its value then.
fn wait_for(netns: &str, expr: &str, min: f64) -> Option<f64> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = value(netns, expr);
        if v.is_some_and(|v| v >= min) || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Metric names a live exposition defines (histograms with their series).
fn exposed_names(exposition: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else { continue };
            names.insert(name.to_string());
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    names
}

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(deploy("grafana/aggbox.json")).expect("read the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 7, "the panels an operator opens first");
    panels
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets").iter())
        .map(|t| t["expr"].as_str().expect("expr").to_string())
        .collect()
}

#[test]
fn a_prometheus_server_scrapes_a_live_node_with_the_shipped_rules_and_dashboard() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "tests/prometheus.rs needs root (network namespaces, BPF): `sudo -E cargo test --test prometheus`"
    );
    let bed = Testbed::up(TestbedConfig { hosts: 3, ..Default::default() }).expect("testbed");
    let agg = bed.host(0);
    let senders = [bed.host(1), bed.host(2)];
    // A node-served job with a result group: the result service's and the
    // broadcast's families exist too; a key file, so the jobs-on-demand
    // families do.
    let keys = std::env::temp_dir().join(format!("aggbox-prometheus-keys-{}.toml", std::process::id()));
    std::fs::write(&keys, "[[tenant]]\nname = \"t\"\nkey = \"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\"\n").expect("key file");
    std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("key file mode");
    let _remove_keys = RemoveOnDrop(keys.clone());
    let config = format!(
        "[node]\nmetrics = \"127.0.0.1:{METRICS_PORT}\"\nkeys = \"{keys}\"\n\n[[job]]\nid = {JOB}\nport = {PORT}\nworkers = [\"{a}\", \"{b}\"]\nresult_port = {RESULT_PORT}\nresult_group = {GROUP}\nconsumer = \"node\"\n\n[[group]]\nid = {GROUP}\nmembers = [\"{a}:7700\", \"{b}:7700\"]\n",
        a = senders[0].addr,
        b = senders[1].addr,
        keys = keys.display()
    );
    let attach = LiveAttach::start(&agg.netns, "prometheus", &config, &["--bpf-stats"]);
    let _server = PrometheusServer::start(&agg.netns);
    let ns = agg.netns.as_str();
    let up = wait_for(ns, "up{job=\"aggbox\"}", 1.0);
    assert_eq!(up, Some(1.0), "the server scrapes the node");

    // One reduction from both ranks, then one datagram with a forged source.
    let to = SocketAddrV4::new(agg.addr, PORT);
    for (rank, sender) in senders.iter().enumerate() {
        // From the member socket of the result group: the RESULT carries the
        // completing contribution's source, which the service checks.
        in_netns(&sender.netns, move || {
            let socket = UdpSocket::bind("0.0.0.0:7700").unwrap();
            let c = tools::Contribution { job: JOB, rank: rank as u16, round: Round(1), op: Op::Sum, first_seq: 0, per_datagram: 362 };
            tools::contribute(&socket, to, &c, &tools::pattern_vector(rank as u16, ELEMENTS)).unwrap();
        })
        .unwrap();
    }
    in_netns(&senders[0].netns, move || {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        let c = tools::Contribution { job: JOB, rank: 1, round: Round(2), op: Op::Sum, first_seq: 0, per_datagram: 362 };
        tools::contribute(&socket, to, &c, &[1, 2, 3]).unwrap();
    })
    .unwrap();

    let fragments = f64::from(ELEMENTS.div_ceil(362));
    let job = format!("aggbox_job=\"{JOB}\"");
    assert_eq!(wait_for(ns, &format!("aggbox_job_results_total{{{job}}}"), fragments), Some(fragments));
    assert_eq!(value(ns, &format!("aggbox_job_contributions_total{{{job},outcome=\"accepted\"}}")), Some(fragments));
    assert_eq!(value(ns, &format!("aggbox_job_contributions_total{{{job},outcome=\"result\"}}")), Some(fragments));
    assert_eq!(value(ns, "aggbox_dropped_total{reason=\"source_mismatch\"}"), Some(1.0));
    assert_eq!(value(ns, "sum(aggbox_dropped_total{reason!=\"source_mismatch\"})"), Some(0.0));
    let rate = value(ns, &format!("sum(rate(aggbox_job_contributions_total{{{job},outcome=~\"accepted|result\"}}[1m]))"));
    assert!(rate.is_some_and(|r| r > 0.0), "a rate over the counters: {rate:?}");
    // The result service took every RESULT.
    assert_eq!(wait_for(ns, &format!("aggbox_result_service_results_total{{{job}}}"), fragments), Some(fragments));
    // The recording rules evaluate over the scraped series.
    let recorded = wait_for(ns, &format!("aggbox:job_contributions:rate1m{{{job}}}"), f64::MIN_POSITIVE);
    assert!(recorded.is_some_and(|r| r > 0.0), "recording rule: {recorded:?}");

    // `aggbox status` lists the group: both members, their next hops
    // resolved by the RESULT copies the TC program sent them.
    let status = attach.status();
    let group = status.groups.iter().find(|g| g.id == GROUP && g.port == 0).expect("the group's root table in status");
    let members: Vec<std::net::SocketAddr> = group.members.iter().map(|m| m.addr).collect();
    assert_eq!(members, vec![SocketAddrV4::new(senders[0].addr, 7700).into(), SocketAddrV4::new(senders[1].addr, 7700).into()]);
    for m in &group.members {
        let hop = m.next_hop.as_ref().unwrap_or_else(|| panic!("{}: next hop resolved", m.addr));
        assert!(hop.mac.len() == 17 && hop.mac != "00:00:00:00:00:00", "{}: {hop:?}", m.addr);
    }
    let copies = group.counters.expect("group counters").copies;
    assert!(copies >= 2 * fragments as u64, "a RESULT copy per member and fragment: {copies}");
    let text = aggbox::node::format_status(&status);
    assert!(text.contains(&format!("group {GROUP:5}  root table, 2 member(s)")), "{text}");
    assert!(text.contains("next hop ") && text.contains(&format!("{}:7700", senders[0].addr)), "{text}");

    // `aggbox status --watch`: rates per second while a second reduction
    // (round 2 of both ranks) goes through.
    let mut watch = Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_aggbox"), "status", "eth0", "--watch", "0.5", "--pin-root"])
        .arg(&attach.pin_root)
        .stdout(Stdio::piped())
        .spawn()
        .expect("aggbox status --watch");
    std::thread::sleep(Duration::from_millis(700));
    for (rank, sender) in senders.iter().enumerate() {
        in_netns(&sender.netns, move || {
            let socket = UdpSocket::bind("0.0.0.0:7700").unwrap();
            let c = tools::Contribution { job: JOB, rank: rank as u16, round: Round(2), op: Op::Sum, first_seq: 100, per_datagram: 362 };
            tools::contribute(&socket, to, &c, &tools::pattern_vector(rank as u16, ELEMENTS)).unwrap();
        })
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(1500));
    // SIGTERM, not SIGINT: the watch keeps the default dispositions, and a
    // test run started in the background of a non-interactive shell
    // inherits SIGINT ignored. A watch that outlives its signal fails the
    // test instead of hanging it.
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(watch.id() as i32), nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    while watch.try_wait().expect("watch status").is_none() {
        if Instant::now() > deadline {
            let _ = watch.kill();
            panic!("aggbox status --watch did not exit within 10 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let watched = watch.wait_with_output().expect("watch output");
    let watched = String::from_utf8_lossy(&watched.stdout);
    let moved: f64 = watched
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("job {JOB:5}")))
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "contributions").nth(1)?.parse::<f64>().ok())
        .sum();
    assert!(watched.contains("rates per second") && moved > 0.0, "the watch showed the round's contributions:\n{watched}");

    // Every rule of the shipped file is loaded and evaluates without error.
    let (status, body) = http_get(ns, PROMETHEUS_PORT, "/api/v1/rules");
    let rules: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{status}: {e}: {body}"));
    let all: Vec<&serde_json::Value> = rules["data"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .collect();
    assert_eq!(all.len(), SHIPPED_RULES, "{rules}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = http_get(ns, PROMETHEUS_PORT, "/api/v1/rules");
        let rules: serde_json::Value = serde_json::from_str(&body).expect("rules JSON");
        let unhealthy: Vec<String> = rules["data"]["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .flat_map(|g| g["rules"].as_array().expect("rules").iter())
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{} {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        if unhealthy.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "rules not evaluated cleanly: {unhealthy:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
    // The node is healthy: no alert fires.
    assert_eq!(value(ns, "count(ALERTS{alertstate=\"firing\"})"), None, "no alert on a healthy node");

    // The dashboard: every expression runs on the server and uses only
    // metric names the live node exposes.
    let (status, exposition) = http_get(ns, METRICS_PORT, "/metrics");
    assert!(status.contains("200"), "{status}");
    let names = exposed_names(&exposition);
    for expr in dashboard_exprs() {
        let concrete = expr.replace("$__rate_interval", "1m").replace("$instance", ".*");
        let answer = query(ns, &concrete);
        assert_eq!(answer["status"], "success", "dashboard expression {expr}: {answer}");
        for name in metric_names(&expr).into_iter().filter(|n| n != "aggbox_job") {
            assert!(names.contains(&name), "dashboard expression {expr} uses {name}, which /metrics does not expose");
        }
    }
}

/// The `aggbox_*` names in a PromQL expression (metric names, and the
/// label `aggbox_job`, which the caller skips).
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("aggbox_") {
        let start = i + at;
        let preceded = start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_' || bytes[start - 1] == b':');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if !preceded {
            out.push(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Removes a file when dropped (on failure too).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
