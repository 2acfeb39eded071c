//! The config file: the shipped example and the INTERFACE.md example parse,
//! defaults are applied, and every validation error names file, line and key.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use aggbox::config::{
    AckMode, Config, ConfigError, GroupConfig, NodeConfig, ParentConfig, UserspacePathMode,
};

/// The example of spec/INTERFACE.md, verbatim.
const INTERFACE_EXAMPLE: &str = r#"[node]
metrics = "127.0.0.1:9435"   # Prometheus exposition at http://ADDR/metrics; "off" disables
ack_mode = "group"           # "group" | "packet"
ack_group = 1024             # group size for group ACKs

[[job]]                      # one reduction group served by this node as aggregator
id = 7                       # u16, the AGG1 `job` field
port = 7000                  # UDP port the contributions are sent to
workers = ["10.77.0.11", "10.77.0.12", "10.77.0.13"]   # rank i sends from address i
weights = [1, 1, 2]          # optional, default all 1
result_port = 7001           # RESULT datagrams go to this node's own address, this UDP port
result_group = 3             # optional: also broadcast each RESULT to broadcast group 3 (in-kernel allreduce)
vector_len = 1048576         # optional: reject frag_off + count beyond it
slots = 4096                 # optional: bound on outstanding fragments of this job
# parent = { addr = "10.77.9.1", port = 7000, job = 7, rank = 2 }   # intermediate aggregator: send results upstream

[[group]]                    # one broadcast group for which this node sends or forwards
id = 3                       # u16, the AGB1 `group` field
members = ["10.77.0.11:7200", "10.77.0.12:7200"]   # index i = mask bit i, at most 32
"#;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn sock(s: &str) -> SocketAddr {
    s.parse().expect("test socket address")
}

fn parse(text: &str) -> Config {
    match Config::parse(text, "config.toml") {
        Ok(c) => c,
        Err(e) => panic!("config should parse, got: {e}"),
    }
}

/// Parses `text` as `config.toml`, expects an error, and checks its place and
/// key exactly and that the message mentions `needle`.
fn expect_error(text: &str, line: usize, key: &str, needle: &str) -> ConfigError {
    let e = match Config::parse(text, "config.toml") {
        Ok(c) => panic!("config should be rejected, parsed as {c:?}"),
        Err(e) => e,
    };
    let shown = e.to_string();
    assert_eq!(e.origin, "config.toml", "{shown}");
    assert_eq!(e.line, Some(line), "{shown}");
    assert_eq!(e.key.as_deref(), Some(key), "{shown}");
    assert!(
        shown.starts_with(&format!("config.toml:{line}: {key}: ")),
        "bad prefix: {shown}"
    );
    assert!(
        shown.contains(needle),
        "{shown:?} should contain {needle:?}"
    );
    assert!(!shown.contains('\n'), "one line: {shown:?}");
    e
}

/// A valid job for tests that only vary something else.
const JOB7: &str = r#"[[job]]
id = 7
port = 7000
workers = ["10.77.0.11", "10.77.0.12"]
result_port = 7001
"#;

fn check_interface_example(c: &Config) {
    assert_eq!(
        c.node,
        NodeConfig {
            metrics: Some("127.0.0.1:9435".parse::<SocketAddr>().expect("addr")),
            ack_mode: AckMode::Group,
            ack_group: 1024,
            userspace_path: UserspacePathMode::Required,
            userspace_slot_bytes: aggbox::config::DEFAULT_USERSPACE_SLOT_BYTES_NODE,
            control: aggbox::config::DEFAULT_CONTROL,
            keys: None,
            ring_pool: 0,
            ring_frag_elems: None,
        }
    );
    assert_eq!(c.jobs.len(), 1);
    let job = &c.jobs[0];
    assert_eq!(job.id, 7);
    assert_eq!(job.port, 7000);
    assert_eq!(
        job.workers,
        vec![ip("10.77.0.11"), ip("10.77.0.12"), ip("10.77.0.13")]
    );
    assert_eq!(job.weights, vec![1, 1, 2]);
    assert_eq!(job.weight_sum(), 4);
    assert_eq!(job.result_port, 7001);
    assert_eq!(job.result_group, Some(3));
    assert_eq!(job.vector_len, Some(1_048_576));
    assert_eq!(job.slots, 4096);
    assert_eq!(job.parent, None);
    assert_eq!(job.rank_of(ip("10.77.0.13")), Some(2));
    assert_eq!(job.rank_of(ip("10.77.0.14")), None);
    assert_eq!(
        c.groups,
        vec![GroupConfig {
            id: 3,
            members: vec![sock("10.77.0.11:7200"), sock("10.77.0.12:7200")]
        }]
    );
    assert_eq!(c.job(7).map(|j| j.port), Some(7000));
    assert_eq!(c.group(3).map(|g| g.members.len()), Some(2));
    assert!(c.job(8).is_none() && c.group(4).is_none());
}

#[test]
fn interface_example_parses() {
    let c = parse(INTERFACE_EXAMPLE);
    check_interface_example(&c);
    assert!(!c.jobs[0].userspace_only);
    assert_eq!(c.jobs[0].window, 4);
}

#[test]
fn interface_example_with_parent_uncommented_parses() {
    let text = INTERFACE_EXAMPLE.replace("# parent = {", "parent = {");
    let c = parse(&text);
    assert_eq!(
        c.jobs[0].parent,
        Some(ParentConfig {
            addr: ip("10.77.9.1"),
            port: 7000,
            job: 7,
            rank: 2,
            result_port: None,
            tree_workers: None
        })
    );
}

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/aggbox.example.toml")
}

#[test]
fn shipped_example_loads() {
    let c = match Config::load(&example_path()) {
        Ok(c) => c,
        Err(e) => panic!("deploy/aggbox.example.toml must be valid: {e}"),
    };
    // Same content as the INTERFACE.md example, plus the project's keys.
    check_interface_example(&c);
    assert_eq!(c.jobs[0].window, 4);
    assert!(!c.jobs[0].userspace_only);
}

#[test]
fn shipped_example_parent_line_is_valid() {
    let text = std::fs::read_to_string(example_path()).expect("read example");
    let text = text.replace("# parent = {", "parent = {");
    let c = parse(&text);
    assert_eq!(
        c.jobs[0].parent,
        Some(ParentConfig {
            addr: ip("10.77.9.1"),
            port: 7000,
            job: 7,
            rank: 2,
            result_port: None,
            tree_workers: None
        })
    );
}

#[test]
fn empty_file_is_the_default_config() {
    let c = parse("");
    assert_eq!(c, Config::default());
    assert!(c.jobs.is_empty() && c.groups.is_empty());
    assert_eq!(
        c.node.metrics,
        Some("127.0.0.1:9435".parse().expect("addr"))
    );
    assert_eq!(c.node.ack_mode, AckMode::Group);
    assert_eq!(c.node.ack_group, 1024);
}

#[test]
fn job_defaults_are_applied() {
    let c = parse(JOB7);
    let job = &c.jobs[0];
    assert_eq!(job.weights, vec![1, 1]);
    assert_eq!(job.weight_sum(), 2);
    assert_eq!(job.result_group, None);
    assert_eq!(job.vector_len, None);
    assert_eq!(job.slots, 4096);
    assert_eq!(job.parent, None);
    assert!(!job.userspace_only);
    assert_eq!(job.window, 4);
    assert_eq!(job.userspace_slots, aggbox::config::DEFAULT_USERSPACE_SLOTS);
    assert_eq!(c.node, NodeConfig::default());
}

#[test]
fn userspace_slots_is_read_and_bounded() {
    let c = parse(&format!("{JOB7}userspace_slots = 64\n"));
    assert_eq!(c.jobs[0].userspace_slots, 64);
    expect_error(&format!("{JOB7}userspace_slots = 0\n"), 6, "job[0].userspace_slots", "0 is not a slot count");
}

#[test]
fn node_and_project_keys_are_read() {
    let text = r#"[node]
metrics = "off"
ack_mode = "packet"
ack_group = 64

[[job]]
id = 65535
port = 65535
workers = ["127.0.0.1"]
weights = [0x10]
result_port = 1
userspace_only = true
window = 16
slots = 1
vector_len = 4294967295
"#;
    let c = parse(text);
    assert_eq!(c.node.metrics, None);
    assert_eq!(c.node.ack_mode, AckMode::Packet);
    assert_eq!(c.node.ack_mode.to_string(), "packet");
    assert_eq!(c.node.ack_group, 64);
    let job = &c.jobs[0];
    assert_eq!((job.id, job.port, job.result_port), (65535, 65535, 1));
    assert_eq!(job.weights, vec![16]);
    assert!(job.userspace_only);
    assert_eq!(
        (job.window, job.slots, job.vector_len),
        (16, 1, Some(u32::MAX))
    );
}

#[test]
fn metrics_accepts_ipv6() {
    let c = parse("[node]\nmetrics = \"[::1]:9500\"\n");
    assert_eq!(c.node.metrics, Some("[::1]:9500".parse().expect("addr")));
}

#[test]
fn zero_weight_is_allowed_when_the_sum_is_positive() {
    let text = JOB7.replace("result_port", "weights = [0, 3]\nresult_port");
    assert_eq!(parse(&text).jobs[0].weights, vec![0, 3]);
}

#[test]
fn several_jobs_may_share_a_result_port() {
    let text = format!(
        "{JOB7}{}",
        JOB7.replace("id = 7", "id = 8")
            .replace("port = 7000", "port = 7100")
    );
    let c = parse(&text);
    assert_eq!(c.jobs.len(), 2);
    assert_eq!(c.jobs[1].result_port, 7001);
}

#[test]
fn limits_are_accepted_at_the_edge() {
    let workers: Vec<String> = (0..256)
        .map(|i| format!("\"10.1.{}.{}\"", i / 200, i % 200 + 1))
        .collect();
    let members: Vec<String> = (0..32)
        .map(|i| format!("\"10.2.0.{}:7200\"", i + 1))
        .collect();
    let text = format!(
        "[[job]]\nid = 1\nport = 7000\nworkers = [{}]\nresult_port = 7001\n\n[[group]]\nid = 1\nmembers = [{}]\n",
        workers.join(", "),
        members.join(", ")
    );
    let c = parse(&text);
    assert_eq!(c.jobs[0].workers.len(), 256);
    assert_eq!(c.jobs[0].weight_sum(), 256);
    assert_eq!(c.groups[0].members.len(), 32);
}

// ---------------------------------------------------------------------------
// Errors: one per validation rule, exact file:line: key.
// ---------------------------------------------------------------------------

#[test]
fn bad_worker_address_is_named_exactly() {
    let text = format!(
        "{JOB7}\n[[job]]\nid = 8\nport = 7100\nworkers = [\"10.77.0.21\", \"10.77.0.22\", \"10.77.0.23\", \"10.77.0.300\"]\nresult_port = 7101\n"
    );
    let e = expect_error(&text, 10, "job[1].workers[3]", "");
    assert_eq!(
        e.to_string(),
        r#"config.toml:10: job[1].workers[3]: "10.77.0.300" is not an IP address (IPv4 A.B.C.D or IPv6)"#
    );
}

/// IPv6 wherever an address is accepted; one family per job, group, ring
/// and tree; a dual-stack node holds jobs of both families.
#[test]
fn ipv6_addresses_are_accepted() {
    let text = r#"[node]
metrics = "[::1]:9435"
control = "[::]:7471"

[[job]]
id = 7
port = 7000
workers = ["10.77.0.11", "10.77.0.12"]
result_port = 7001

[[job]]
id = 8
port = 7100
workers = ["fd00:77::21", "fd00:77::22", "::1"]
result_port = 7101
result_group = 4
parent = { addr = "fd00:77:9::1", port = 7000, job = 7, rank = 2 }

[[group]]
id = 4
members = ["[fd00:77::21]:7200", "[fd00:77::22]:7200"]

[[ring]]
id = 1
port = 7300
members = ["fd00:77::21", "fd00:77::22"]
vector_len = 1000
"#;
    let c = parse(text);
    assert_eq!(c.node.metrics, Some(sock("[::1]:9435")));
    assert_eq!(c.node.control, sock("[::]:7471"));
    assert_eq!(c.jobs[0].workers, vec![ip("10.77.0.11"), ip("10.77.0.12")]);
    assert!(!c.jobs[0].is_ipv6());
    assert_eq!(c.jobs[1].workers, vec![ip("fd00:77::21"), ip("fd00:77::22"), ip("::1")]);
    assert!(c.jobs[1].is_ipv6());
    assert_eq!(c.jobs[1].rank_of(ip("fd00:77::22")), Some(1));
    assert_eq!(c.jobs[1].parent.expect("parent").addr, ip("fd00:77:9::1"));
    assert_eq!(c.groups[0].members, vec![sock("[fd00:77::21]:7200"), sock("[fd00:77::22]:7200")]);
    assert_eq!(c.rings[0].members, vec![ip("fd00:77::21"), ip("fd00:77::22")]);
}

/// A job's workers, a group's members, a ring's members, a tree's parent
/// and its workers, and a job's workers and its result group are of one
/// family: a mix is refused at the first address of the other family.
#[test]
fn a_mix_of_families_is_refused_with_file_line_and_key() {
    let text = JOB7.replace(r#"["10.77.0.11", "10.77.0.12"]"#, r#"["10.77.0.11", "fd00::12"]"#);
    let e = expect_error(&text, 4, "job[0].workers[1]", "");
    assert_eq!(
        e.to_string(),
        r#"config.toml:4: job[0].workers[1]: "fd00::12" is IPv6 where job[0].workers[0] (10.77.0.11, line 4) is IPv4: a job's workers are all of one family"#
    );
    let text = JOB7.replace(r#"["10.77.0.11", "10.77.0.12"]"#, "[\n  \"fd00::11\",\n  \"10.77.0.12\",\n]");
    expect_error(&text, 6, "job[0].workers[1]", r#""10.77.0.12" is IPv4 where job[0].workers[0] (fd00::11, line 5) is IPv6"#);
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"[fd00::12]:7200\"");
    expect_error(&text, 3, "group[0].members[1]", "a group's members are all of one family");
    let ring = "[[ring]]\nid = 1\nport = 7300\nmembers = [\"10.0.0.1\", \"fd00::2\"]\nvector_len = 100\n";
    expect_error(ring, 4, "ring[0].members[1]", "a ring's members are all of one family");
    let text = format!("{JOB7}parent = {{ addr = \"fd00::9\", port = 7000, job = 7, rank = 2 }}\n");
    expect_error(&text, 6, "job[0].parent.addr", "fd00::9 is IPv6 where the job's workers are IPv4 (10.77.0.11): a tree's parent and its workers are of one family");
    let text = format!("{}result_group = 3\n\n[[group]]\nid = 3\nmembers = [\"[fd00::11]:7200\"]\n", JOB7);
    expect_error(&text, 6, "job[0].result_group", "group 3 (group[0], line 9) has IPv6 members where this job's workers are IPv4");
}

/// Socket addresses are `A.B.C.D:PORT` or `[IPv6]:PORT`; the near misses
/// are named.
#[test]
fn bad_bracket_forms_are_named() {
    for (member, needle) in [
        ("fd00::12:7200", "an IPv6 address with a port is written in brackets, [ADDR]:PORT"),
        ("[fd00::12]", "has no port: write [fd00::12]:PORT"),
        ("[fd00::12:7200", "no closing ]"),
        ("[10.77.0.12]:7200", "brackets are for IPv6 addresses; write 10.77.0.12:7200"),
        ("[fe80::1%eth0]:7200", "scope ids"),
        ("[::ffff:10.77.0.12]:7200", "IPv4-mapped IPv6 address, which travels as IPv4: write 10.77.0.12:7200"),
        ("[fd00::zz]:7200", "is not an IP address and UDP port (A.B.C.D:PORT or [IPv6]:PORT)"),
        ("[fd00::12]:0", "0 is not a UDP port"),
        ("[ff02::1]:7200", "multicast address"),
    ] {
        let text = GROUP3.replace("\"10.77.0.12:7200\"", &format!("{member:?}"));
        let text = text.replace("\"10.77.0.11:7200\"", "\"[fd00::11]:7200\"");
        expect_error(&text, 3, "group[0].members[1]", needle);
    }
    for (worker, needle) in [
        ("[fd00::12]", "brackets go around an IPv6 address only before a :PORT; write fd00::12 here"),
        ("[fd00::12]:7000", "without brackets and port here"),
        ("::ffff:10.77.0.12", "IPv4-mapped IPv6 address, which travels as IPv4: write 10.77.0.12"),
        ("::", "unspecified address"),
        ("ff02::1", "multicast address"),
    ] {
        let text = JOB7.replace(r#""10.77.0.12""#, &format!("{worker:?}")).replace(r#""10.77.0.11""#, r#""fd00::11""#);
        expect_error(&text, 4, "job[0].workers[1]", needle);
    }
    expect_error("[node]\ncontrol = \"::1:7471\"\n", 2, "node.control", "[ADDR]:PORT");
    expect_error("[node]\nmetrics = \"[::1]\"\n", 2, "node.metrics", "has no port: write [::1]:PORT");
    expect_error("[node]\nmetrics = \"[::1]:0\"\n", 2, "node.metrics", "port 0");
}

#[test]
fn worker_in_multiline_array_reports_its_own_line() {
    let text = r#"[[job]]
id = 7
port = 7000
workers = [
  "10.77.0.11",
  "10.77.0.x",
]
result_port = 7001
"#;
    expect_error(
        text,
        6,
        "job[0].workers[1]",
        r#""10.77.0.x" is not an IP address"#,
    );
}

#[test]
fn worker_must_be_unicast() {
    let text = JOB7.replace("\"10.77.0.12\"", "\"0.0.0.0\"");
    expect_error(&text, 4, "job[0].workers[1]", "unspecified");
    let text = JOB7.replace("\"10.77.0.12\"", "\"224.0.0.1\"");
    expect_error(&text, 4, "job[0].workers[1]", "multicast");
}

#[test]
fn duplicate_worker_address_is_rejected() {
    let text = r#"[[job]]
id = 7
port = 7000
workers = [
  "10.77.0.11",
  "10.77.0.12",
  "10.77.0.11",
]
result_port = 7001
"#;
    expect_error(
        text,
        7,
        "job[0].workers[2]",
        "is also job[0].workers[0] (line 5)",
    );
}

#[test]
fn empty_workers_are_rejected() {
    let text = JOB7.replace(r#"["10.77.0.11", "10.77.0.12"]"#, "[]");
    expect_error(&text, 4, "job[0].workers", "at least one rank");
}

#[test]
fn more_than_256_workers_are_rejected() {
    let workers: Vec<String> = (0..257)
        .map(|i| format!("\"10.1.{}.{}\"", i / 200, i % 200 + 1))
        .collect();
    let text = format!(
        "[[job]]\nid = 1\nport = 7000\nworkers = [{}]\nresult_port = 7001\n",
        workers.join(", ")
    );
    expect_error(&text, 4, "job[0].workers", "257 workers, at most 256");
}

#[test]
fn weights_must_match_workers() {
    let text = JOB7.replace("result_port", "weights = [1, 1, 1]\nresult_port");
    expect_error(&text, 5, "job[0].weights", "3 weights for 2 workers");
}

#[test]
fn negative_weight_is_rejected() {
    let text = JOB7.replace("result_port", "weights = [2, -1]\nresult_port");
    expect_error(
        &text,
        5,
        "job[0].weights[1]",
        "-1 is not a weight (0..=8388608",
    );
}

#[test]
fn weights_summing_to_zero_are_rejected() {
    let text = JOB7.replace("result_port", "weights = [0, 0]\nresult_port");
    expect_error(&text, 5, "job[0].weights", "sum to 0");
}

#[test]
fn weight_above_2_pow_23_is_rejected_with_file_line_and_key() {
    // Issue #21 item 8: a weight the data plane refuses (it adds weight ×
    // value in a 64-bit sum; `abi::MAX_WEIGHT` = 2^23) must be named
    // here, with its line and key, not fail later inside `set_job`.
    assert_eq!(aggbox::wire::abi::MAX_WEIGHT, 1 << 23);
    let text = r#"[[job]]
id = 7
port = 7000
workers = ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
weights = [
  1,
  8388608,
  8388609,
]
result_port = 7001
"#;
    expect_error(
        text,
        8,
        "job[0].weights[2]",
        "8388609 is not a weight (0..=8388608: the kernel adds weight × value in a 64-bit sum",
    );
    // i32::MAX, which the parser used to accept, is refused the same way.
    let text = JOB7.replace("result_port", "weights = [2147483647, 1]\nresult_port");
    expect_error(&text, 5, "job[0].weights[0]", "2147483647 is not a weight (0..=8388608");
}

#[test]
fn weights_at_2_pow_23_are_accepted_and_their_sum_fits_u32() {
    let workers: Vec<String> = (0..256)
        .map(|i| format!("\"10.1.{}.{}\"", i / 200, i % 200 + 1))
        .collect();
    let text = format!(
        "[[job]]\nid = 1\nport = 7000\nworkers = [{}]\nweights = [{}]\nresult_port = 7001\n",
        workers.join(", "),
        vec!["8388608"; 256].join(", ")
    );
    let c = parse(&text);
    assert_eq!(c.jobs[0].weight_sum(), 1 << 31);
}

#[test]
fn weight_must_be_an_integer() {
    let text = JOB7.replace("result_port", "weights = [1, 1.5]\nresult_port");
    expect_error(
        &text,
        5,
        "job[0].weights[1]",
        "expected an integer, found the float 1.5",
    );
}

#[test]
fn duplicate_job_ids_are_rejected() {
    let text = format!(
        "{JOB7}\n{}",
        JOB7.replace("port = 7000", "port = 7100")
            .replace("7001", "7101")
    );
    expect_error(
        &text,
        8,
        "job[1].id",
        "job 7 is already defined by job[0] (line 2)",
    );
}

#[test]
fn duplicate_job_ports_are_rejected() {
    let text = format!(
        "{JOB7}\n{}",
        JOB7.replace("id = 7", "id = 8").replace("7001", "7101")
    );
    expect_error(
        &text,
        9,
        "job[1].port",
        "port 7000 already serves job 7 (line 3)",
    );
}

#[test]
fn result_port_equal_to_job_port_is_rejected() {
    let text = JOB7.replace("result_port = 7001", "result_port = 7000");
    expect_error(
        &text,
        5,
        "job[0].result_port",
        "7000 is this job's own contribution port",
    );
}

#[test]
fn result_port_equal_to_another_jobs_port_is_rejected() {
    // The first job's results would land on the second job's port.
    let text = format!(
        "{}\n{}",
        JOB7.replace("result_port = 7001", "result_port = 7100"),
        JOB7.replace("id = 7", "id = 8")
            .replace("port = 7000", "port = 7100")
            .replace("7001", "7101")
    );
    expect_error(
        &text,
        5,
        "job[0].result_port",
        "7100 is the contribution port of job 8 (line 9)",
    );
}

#[test]
fn result_group_must_be_configured() {
    let text = JOB7.replace("result_port = 7001", "result_port = 7001\nresult_group = 4");
    let text = format!("{text}\n[[group]]\nid = 3\nmembers = [\"10.77.0.11:7200\"]\n");
    expect_error(
        &text,
        6,
        "job[0].result_group",
        "there is no [[group]] with id 4",
    );
}

#[test]
fn result_group_65535_is_reserved() {
    let text = JOB7.replace(
        "result_port = 7001",
        "result_port = 7001\nresult_group = 65535",
    );
    expect_error(&text, 6, "job[0].result_group", "reserved");
}

#[test]
fn job_port_must_be_a_udp_port() {
    let text = JOB7.replace("port = 7000", "port = 0");
    expect_error(&text, 3, "job[0].port", "0 is not a UDP port (1..=65535)");
    let text = JOB7.replace("port = 7000", "port = 70000");
    expect_error(
        &text,
        3,
        "job[0].port",
        "70000 is not a UDP port (1..=65535)",
    );
    let text = JOB7.replace("result_port = 7001", "result_port = -1");
    expect_error(&text, 5, "job[0].result_port", "-1 is not a UDP port");
}

#[test]
fn job_id_must_fit_u16() {
    let text = JOB7.replace("id = 7", "id = 65536");
    expect_error(&text, 2, "job[0].id", "65536 is not a job id (0..=65535)");
}

#[test]
fn wrong_type_is_named() {
    let text = JOB7.replace("id = 7", "id = \"7\"");
    expect_error(
        &text,
        2,
        "job[0].id",
        "expected an integer, found the string \"7\"",
    );
    let text = JOB7.replace(r#"["10.77.0.11", "10.77.0.12"]"#, "\"10.77.0.11\"");
    expect_error(&text, 4, "job[0].workers", "expected an array");
    let text = format!("{JOB7}userspace_only = \"yes\"\n");
    expect_error(&text, 6, "job[0].userspace_only", "expected a boolean");
    let text = format!("{JOB7}window = 1979-05-27\n");
    expect_error(&text, 6, "job[0].window", "found the datetime 1979-05-27");
}

#[test]
fn missing_required_key_is_reported_on_the_table_header() {
    let text = format!(
        "{JOB7}\n{}",
        JOB7.replace("id = 7", "id = 8")
            .replace("port = 7000\n", "")
    );
    expect_error(&text, 7, "job[1].port", "required key is missing");
    let text = "[[group]]\nid = 1\n";
    expect_error(text, 1, "group[0].members", "required key is missing");
}

#[test]
fn unknown_key_in_job_is_rejected() {
    let text = format!("{JOB7}slotz = 8\n");
    expect_error(
        &text,
        6,
        "job[0].slotz",
        "unknown key; expected one of: id, port, workers",
    );
}

#[test]
fn unknown_key_in_node_is_rejected() {
    expect_error(
        "[node]\nmetrics = \"off\"\nack_grop = 8\n",
        3,
        "node.ack_grop",
        "unknown key",
    );
}

#[test]
fn unknown_top_level_table_is_rejected() {
    expect_error(
        "[node]\n\n[[jobs]]\nid = 1\n",
        3,
        "jobs",
        "expected one of: node, job, group",
    );
}

#[test]
fn unknown_key_in_parent_is_rejected() {
    let text =
        format!("{JOB7}parent = {{ addr = \"10.77.9.1\", port = 7000, job = 7, rnak = 2 }}\n");
    expect_error(&text, 6, "job[0].parent.rnak", "unknown key");
}

#[test]
fn parent_fields_are_validated() {
    let text =
        format!("{JOB7}parent = {{ addr = \"10.77.9.256\", port = 7000, job = 7, rank = 2 }}\n");
    expect_error(
        &text,
        6,
        "job[0].parent.addr",
        "\"10.77.9.256\" is not an IP address",
    );
    let text =
        format!("{JOB7}parent = {{ addr = \"10.77.9.1\", port = 7000, job = 7, rank = 65535 }}\n");
    expect_error(
        &text,
        6,
        "job[0].parent.rank",
        "65535 marks RESULT datagrams",
    );
    let text = format!("{JOB7}parent = {{ addr = \"10.77.9.1\", port = 0, job = 7, rank = 1 }}\n");
    expect_error(&text, 6, "job[0].parent.port", "0 is not a UDP port");
    let text = format!("{JOB7}parent = {{ addr = \"10.77.9.1\", port = 7000, rank = 1 }}\n");
    expect_error(&text, 6, "job[0].parent.job", "required key is missing");
    let text = format!("{JOB7}parent = \"10.77.9.1\"\n");
    expect_error(&text, 6, "job[0].parent", "expected a table");
}

#[test]
fn job_as_plain_table_is_rejected() {
    expect_error("[job]\nid = 7\n", 1, "job", "write [[job]]");
}

#[test]
fn too_many_jobs_are_rejected() {
    let mut text = String::new();
    for i in 0..257u32 {
        text += &format!(
            "[[job]]\nid = {i}\nport = {}\nworkers = [\"10.0.0.1\"]\nresult_port = 1\n",
            10_000 + i
        );
    }
    // Job 256 starts on line 256 * 5 + 1.
    expect_error(&text, 1281, "job[256]", "more than 256 jobs");
}

#[test]
fn vector_len_slots_window_must_be_positive() {
    let text = format!("{JOB7}vector_len = 0\n");
    expect_error(&text, 6, "job[0].vector_len", "0 is not a vector length");
    let text = format!("{JOB7}slots = 0\n");
    expect_error(&text, 6, "job[0].slots", "0 is not a slot count");
    let text = format!("{JOB7}window = 0\n");
    expect_error(&text, 6, "job[0].window", "0 is not a window");
    let text = format!("{JOB7}slots = 4294967296\n");
    expect_error(&text, 6, "job[0].slots", "4294967296 is not a slot count");
}

#[test]
fn frag_elems_is_a_job_fragment_size_or_left_to_the_interface() {
    assert_eq!(parse(JOB7).jobs[0].frag_elems, None, "default: the attached interface's MTU decides");
    assert_eq!(parse(&format!("{JOB7}frag_elems = 362\n")).jobs[0].frag_elems, Some(362));
    assert_eq!(parse(&format!("{JOB7}frag_elems = 16370\n")).jobs[0].frag_elems, Some(16370));
    let text = format!("{JOB7}frag_elems = 0\n");
    expect_error(&text, 6, "job[0].frag_elems", "0 is not a fragment size in elements");
    let text = format!("{JOB7}frag_elems = 16385\n");
    expect_error(&text, 6, "job[0].frag_elems", "16385 is not a fragment size in elements");
}

const GROUP3: &str = r#"[[group]]
id = 3
members = ["10.77.0.11:7200", "10.77.0.12:7200"]
"#;

#[test]
fn duplicate_group_ids_are_rejected() {
    let text = format!("{GROUP3}\n{GROUP3}");
    expect_error(
        &text,
        6,
        "group[1].id",
        "group 3 is already defined by group[0] (line 2)",
    );
}

#[test]
fn more_than_32_members_are_rejected() {
    let members: Vec<String> = (0..33)
        .map(|i| format!("\"10.2.0.{}:7200\"", i + 1))
        .collect();
    let text = format!("[[group]]\nid = 3\nmembers = [{}]\n", members.join(", "));
    expect_error(&text, 3, "group[0].members", "33 members, at most 32");
}

#[test]
fn empty_members_are_rejected() {
    let text = GROUP3.replace(r#"["10.77.0.11:7200", "10.77.0.12:7200"]"#, "[]");
    expect_error(&text, 3, "group[0].members", "at least one destination");
}

#[test]
fn bad_member_is_rejected() {
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"10.77.0.12\"");
    expect_error(
        &text,
        3,
        "group[0].members[1]",
        "\"10.77.0.12\" is not an IP address and UDP port",
    );
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"10.77.0.12:0\"");
    expect_error(&text, 3, "group[0].members[1]", "0 is not a UDP port");
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"10.77.0.12:72000\"");
    expect_error(
        &text,
        3,
        "group[0].members[1]",
        "is not an IP address and UDP port",
    );
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"255.255.255.255:7200\"");
    expect_error(&text, 3, "group[0].members[1]", "broadcast address");
}

#[test]
fn duplicate_member_is_rejected() {
    let text = GROUP3.replace("\"10.77.0.12:7200\"", "\"10.77.0.11:7200\"");
    expect_error(
        &text,
        3,
        "group[0].members[1]",
        "is also group[0].members[0] (line 3)",
    );
}

#[test]
fn unknown_key_in_group_is_rejected() {
    let text = format!("{GROUP3}mask = 3\n");
    expect_error(&text, 4, "group[0].mask", "expected one of: id, members");
}

#[test]
fn ack_group_must_be_1_to_1024() {
    expect_error(
        "[node]\nack_group = 0\n",
        2,
        "node.ack_group",
        "0 is not an ACK group size (1..=1024",
    );
    expect_error(
        "[node]\nack_group = 1025\n",
        2,
        "node.ack_group",
        "at most 1024 sequence numbers",
    );
}

#[test]
fn userspace_slot_bytes_is_read_and_bounded() {
    use aggbox::config::{DEFAULT_USERSPACE_SLOT_BYTES_JOB, DEFAULT_USERSPACE_SLOT_BYTES_NODE};
    let c = parse(JOB7);
    assert_eq!(c.node.userspace_slot_bytes, DEFAULT_USERSPACE_SLOT_BYTES_NODE);
    assert_eq!(c.jobs[0].userspace_slot_bytes, DEFAULT_USERSPACE_SLOT_BYTES_JOB);
    assert_eq!((DEFAULT_USERSPACE_SLOT_BYTES_JOB, DEFAULT_USERSPACE_SLOT_BYTES_NODE), (64 << 20, 256 << 20));
    let c = parse(&format!("[node]\nuserspace_slot_bytes = 536870912\n\n{JOB7}userspace_slot_bytes = 1048576\n"));
    assert_eq!(c.node.userspace_slot_bytes, 512 << 20);
    assert_eq!(c.jobs[0].userspace_slot_bytes, 1 << 20);
    expect_error(
        &format!("{JOB7}userspace_slot_bytes = 65536\n"),
        6,
        "job[0].userspace_slot_bytes",
        "65536 is not a byte bound (1048576..=9223372036854775807: bytes, at least 1 MiB)",
    );
    expect_error("[node]\nuserspace_slot_bytes = 64\n", 2, "node.userspace_slot_bytes", "64 is not a byte bound");
    expect_error("[node]\nuserspace_slot_bytes = -1\n", 2, "node.userspace_slot_bytes", "-1 is not a byte bound");
    expect_error("[node]\nuserspace_slot_bytes = \"64MiB\"\n", 2, "node.userspace_slot_bytes", "integer");
}

#[test]
fn userspace_path_is_required_or_optional() {
    assert_eq!(parse("").node.userspace_path, UserspacePathMode::Required);
    let c = parse("[node]\nuserspace_path = \"optional\"\n");
    assert_eq!(c.node.userspace_path, UserspacePathMode::Optional);
    assert_eq!(c.node.userspace_path.as_str(), "optional");
    expect_error(
        "[node]\nuserspace_path = \"off\"\n",
        2,
        "node.userspace_path",
        "\"off\" is neither \"required\" nor \"optional\"",
    );
}

#[test]
fn ack_mode_must_be_known() {
    expect_error(
        "[node]\nack_mode = \"grop\"\n",
        2,
        "node.ack_mode",
        "\"grop\" is not an ACK mode",
    );
}

#[test]
fn metrics_must_be_an_address_or_off() {
    expect_error(
        "[node]\nmetrics = \"localhost\"\n",
        2,
        "node.metrics",
        "neither \"off\" nor an address",
    );
    expect_error(
        "[node]\nmetrics = \"127.0.0.1:0\"\n",
        2,
        "node.metrics",
        "port 0",
    );
    expect_error(
        "[node]\nmetrics = false\n",
        2,
        "node.metrics",
        "expected a string",
    );
}

#[test]
fn toml_syntax_error_gets_file_line_and_key() {
    let text =
        format!("{JOB7}[[group]]\nid = 3\nmembers = [\"10.77.0.11:7200\" \"10.77.0.12:7200\"]\n");
    let e = expect_error(&text, 8, "group[0].members", "");
    assert!(e.message.contains("array"), "{e}");
}

#[test]
fn toml_duplicate_key_gets_file_and_line() {
    let text = format!("{JOB7}port = 7002\n");
    let e = match Config::parse(&text, "config.toml") {
        Ok(c) => panic!("duplicate key accepted: {c:?}"),
        Err(e) => e,
    };
    assert_eq!(e.line, Some(6), "{e}");
    assert!(
        e.to_string().starts_with("config.toml:6: job[0].port: "),
        "{e}"
    );
    assert!(e.message.contains("duplicate key"), "{e}");
}

#[test]
fn load_names_the_file() {
    let dir = std::env::temp_dir().join(format!("aggbox-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("bad.toml");
    std::fs::write(&path, "[node]\nack_mode = \"fast\"\n").expect("write");
    let e = Config::load(&path).expect_err("bad config");
    assert_eq!(
        e.to_string(),
        format!(
            "{}:2: node.ack_mode: \"fast\" is not an ACK mode (\"group\" or \"packet\")",
            path.display()
        )
    );

    let missing = dir.join("missing.toml");
    let e = Config::load(&missing).expect_err("missing file");
    assert_eq!(e.line, None);
    assert!(
        e.to_string()
            .starts_with(&format!("{}: cannot read: ", missing.display())),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `consumer = "node"`: the node serves an in-kernel allreduce, so it needs
/// the result group (with a socket for every worker), at most 64 workers,
/// and with a parent the parent's result port and another job id; anything
/// else names the key.
#[test]
fn consumer_node_needs_a_result_group_of_the_workers() {
    let group = "\n[[group]]\nid = 3\nmembers = [\"10.77.0.11:7200\", \"10.77.0.12:7200\"]\n";
    let served = JOB7.replace("result_port = 7001", "result_port = 7001\nresult_group = 3\nconsumer = \"node\"");
    let c = Config::parse(&format!("{served}{group}"), "config.toml").expect("a node-served job");
    assert_eq!(c.jobs[0].consumer, aggbox::config::ResultConsumer::Node);
    let default = Config::parse(&format!("{JOB7}"), "config.toml").expect("default");
    assert_eq!(default.jobs[0].consumer, aggbox::config::ResultConsumer::Application);

    let bad = JOB7.replace("result_port = 7001", "result_port = 7001\nconsumer = \"daemon\"");
    expect_error(&bad, 6, "job[0].consumer", "expected \"application\" or \"node\"");
    let no_group = JOB7.replace("result_port = 7001", "result_port = 7001\nconsumer = \"node\"");
    expect_error(&no_group, 6, "job[0].consumer", "needs result_group");
    let parent = JOB7.replace(
        "result_port = 7001",
        "result_port = 7001\nresult_group = 3\nparent = { addr = \"10.77.9.1\", port = 7000, job = 7, rank = 2 }\nconsumer = \"node\"",
    );
    expect_error(&format!("{parent}{group}"), 8, "job[0].consumer", "needs parent.result_port");
    let parent = parent.replace("rank = 2 }", "rank = 2, result_port = 7001 }");
    expect_error(&format!("{parent}{group}"), 8, "job[0].consumer", "other than the job's own id 7");
    // A tree node served by the node: the kernel neither routes its RESULTs
    // upstream nor copies them to the group (the service does both).
    let tree = parent.replace("job = 7, rank", "job = 20, rank");
    let c = Config::parse(&format!("{tree}{group}"), "config.toml").expect("a node-served tree job");
    assert_eq!(c.jobs[0].parent.and_then(|p| p.result_port), Some(7001));
    assert_eq!((c.jobs[0].kernel_parent(), c.jobs[0].kernel_result_group()), (None, None));
    // Another job of the node with the parent's job id and result port.
    let clash = format!("{tree}\n[[job]]\nid = 20\nport = 7300\nworkers = [\"10.77.0.11\"]\nresult_port = 7001\n{group}");
    expect_error(&clash, 5, "job[0].result_port", "has the parent's job id 20");
    // parent.result_port without the node serving: nobody would take them.
    let app = tree.replace("\nconsumer = \"node\"", "");
    expect_error(&format!("{app}{group}"), 7, "job[0].parent.result_port", "only a job with consumer = \"node\"");
    let plain = JOB7.replace("result_port = 7001", "result_port = 7001\nresult_group = 3\nparent = { addr = \"10.77.9.1\", port = 7000, job = 7, rank = 2 }");
    let c = Config::parse(&format!("{plain}{group}"), "config.toml").expect("a kernel-routed tree job");
    assert_eq!((c.jobs[0].kernel_parent().map(|p| p.job), c.jobs[0].kernel_result_group()), (Some(7), Some(3)));
    let short_group = "\n[[group]]\nid = 3\nmembers = [\"10.77.0.11:7200\"]\n";
    expect_error(&format!("{served}{short_group}"), 7, "job[0].consumer", "worker 1 (10.77.0.12) is not a member of group 3");
    let many: Vec<String> = (0..65).map(|i| format!("\"10.78.0.{}\"", i + 1)).collect();
    let big = served.replace("workers = [\"10.77.0.11\", \"10.77.0.12\"]", &format!("workers = [{}]", many.join(", ")));
    expect_error(&format!("{big}{group}"), 7, "job[0].consumer", "at most 64 workers");
}

/// `parent.tree_workers`: the workers of the whole tree, the mean divisor
/// of the job's workers' communicators; at least the job's own workers.
#[test]
fn parent_tree_workers_is_at_least_the_jobs_own_workers() {
    let group = "\n[[group]]\nid = 3\nmembers = [\"10.77.0.11:7200\", \"10.77.0.12:7200\"]\n";
    let tree = JOB7.replace(
        "result_port = 7001",
        "result_port = 7001\nresult_group = 3\nparent = { addr = \"10.77.9.1\", port = 7000, job = 20, rank = 2, result_port = 7001, tree_workers = 6 }\nconsumer = \"node\"",
    );
    let c = Config::parse(&format!("{tree}{group}"), "config.toml").expect("a tree job with tree_workers");
    assert_eq!(c.jobs[0].parent.and_then(|p| p.tree_workers), Some(6));
    let b = aggbox::runtime::CommunicatorBuilder::from_config(&c, 7, ip("10.77.9.2"), 7200, aggbox::runtime::Participant::Worker(0))
        .expect("from_config");
    assert_eq!(b.config().tree_workers, Some(6), "the workers' mean divisor is the tree's workers");
    let none = tree.replace(", tree_workers = 6", "");
    let c = Config::parse(&format!("{none}{group}"), "config.toml").expect("without tree_workers");
    assert_eq!(c.jobs[0].parent.and_then(|p| p.tree_workers), None);
    expect_error(&format!("{}{group}", tree.replace("tree_workers = 6", "tree_workers = 1")), 7, "job[0].parent.tree_workers", "fewer than this job's own 2 workers");
    expect_error(&format!("{}{group}", tree.replace("tree_workers = 6", "tree_workers = 0")), 7, "job[0].parent.tree_workers", "");
    expect_error(&format!("{}{group}", tree.replace("tree_workers = 6", "tree_workers = \"6\"")), 7, "job[0].parent.tree_workers", "");
}

const RING: &str = "[[ring]]\nid = 40\nport = 7400\nmembers = [\"10.0.0.1\", \"10.0.0.2\", \"10.0.0.3\"]\nvector_len = 1000\n";

#[test]
fn a_ring_parses_with_its_defaults() {
    let c = parse(RING);
    let r = c.ring(40).expect("ring 40");
    assert_eq!((r.port, r.vector_len, r.frag_elems), (7400, 1000, aggbox::config::DEFAULT_RING_FRAG_ELEMS));
    assert_eq!(r.members, vec![ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3")]);
    assert_eq!(r.weights, vec![1, 1, 1]);
    assert_eq!(r.frags(), 3); // 362 + 362 + 276
    assert_eq!(r.weight_sum(), 3);
}

#[test]
fn bad_rings_name_the_line_and_key() {
    expect_error(
        "[[ring]]\nid = 40\nport = 7400\nmembers = [\"10.0.0.1\"]\nvector_len = 10\n",
        4,
        "ring[0].members",
        "at least two",
    );
    expect_error(&format!("{RING}frag_elems = 361\n"), 6, "ring[0].frag_elems", "odd");
    expect_error(&format!("{RING}frag_elems = 20000\n"), 6, "ring[0].frag_elems", "");
    expect_error("[[ring]]\nid = 40\nport = 7400\nmembers = [\"10.0.0.1\", \"10.0.0.2\"]\n", 1, "ring[0].vector_len", "missing");
    expect_error(
        &format!("{RING}\n[[ring]]\nid = 40\nport = 7401\nmembers = [\"10.0.0.1\", \"10.0.0.2\"]\nvector_len = 5\n"),
        8,
        "ring[1].id",
        "already defined",
    );
    expect_error(
        &format!("{RING}\n[[ring]]\nid = 41\nport = 7401\nmembers = [\"10.0.0.1\", \"10.0.0.2\"]\nvector_len = 5\nfrag_elems = 100\n"),
        8,
        "ring[1].frag_elems",
        "share one fragment size",
    );
    expect_error(
        &format!("[[job]]\nid = 7\nport = 7400\nworkers = [\"10.0.0.1\"]\nresult_port = 7001\n\n{RING}"),
        9,
        "ring[0].port",
        "job 7",
    );
}

#[test]
fn ring_pool_and_ring_frag_elems_are_read_and_bounded() {
    let c = parse(RING);
    assert_eq!((c.node.ring_pool, c.node.ring_frag_elems, c.ring_frag_elems()), (0, None, aggbox::config::DEFAULT_RING_FRAG_ELEMS));
    let c = parse(&format!("[node]\nring_pool = 1048576\nring_frag_elems = 2242\n\n{RING}"));
    assert_eq!(c.node.ring_pool, 1 << 20);
    assert_eq!(c.rings[0].frag_elems, 2242, "a ring's frag_elems defaults to the node's");
    assert_eq!(c.ring_frag_elems(), 2242);
    let c = parse("[node]\nring_pool = 268435456\n");
    assert_eq!((c.node.ring_pool, c.ring_frag_elems()), (aggbox::config::MAX_RING_POOL, aggbox::config::DEFAULT_RING_FRAG_ELEMS));
    expect_error("[node]\nring_pool = -1\n", 2, "node.ring_pool", "-1 is not a ring pool in elements");
    expect_error("[node]\n\nring_pool = 268435457\n", 3, "node.ring_pool", "at most 2^28 elements");
    expect_error("[node]\nring_pool = \"1M\"\n", 2, "node.ring_pool", "an integer");
    expect_error("[node]\nring_frag_elems = 361\n", 2, "node.ring_frag_elems", "odd");
    expect_error("[node]\nring_frag_elems = 0\n", 2, "node.ring_frag_elems", "not a fragment size");
    expect_error(
        &format!("[node]\nring_frag_elems = 2242\n\n{RING}frag_elems = 362\n"),
        5,
        "ring[0].frag_elems",
        "where [node] ring_frag_elems is 2242",
    );
}
