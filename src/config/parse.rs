//! The TOML parser of the node configuration ([`Config::parse`]): each
//! section and key with its rules, cross-checks, and errors that name the
//! file, line and key (`ConfigError`). The types it produces are in
//! `config/mod.rs`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

use super::*;
use crate::wire::abi;

/// [`Config::parse`]: the document, its sections in order, then the
/// checks across them.
pub(super) fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let src = Source { text, origin };
    let root: Value = toml::from_str(text).map_err(|e| src.toml_error(&e))?;
    let Value::Table(entries) = root else {
        // The TOML grammar makes the document a table; keep a message
        // anyway instead of a panic.
        return Err(src.error(0, None, "the document is not a TOML table".into()));
    };
    let mut top = Table::from_entries(&src, "", 0, entries, &["node", "job", "group", "ring"])?;

    let node = match top.take("node") {
        Some(v) => parse_node(&src, v)?,
        None => NodeConfig::default(),
    };
    let jobs = match top.take("job") {
        Some(v) => {
            let items = array_of_tables(&src, "job", v)?;
            let mut jobs = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let path = format!("job[{i}]");
                if i >= abi::MAX_JOBS as usize {
                    return Err(src.error(
                        item.span().start,
                        Some(path),
                        format!(
                            "more than {} jobs; the kernel's jobs map holds {}",
                            abi::MAX_JOBS,
                            abi::MAX_JOBS
                        ),
                    ));
                }
                jobs.push(parse_job(&src, path, item)?);
            }
            jobs
        }
        None => Vec::new(),
    };
    let groups = match top.take("group") {
        Some(v) => {
            let items = array_of_tables(&src, "group", v)?;
            let mut groups = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                groups.push(parse_group(&src, format!("group[{i}]"), item)?);
            }
            groups
        }
        None => Vec::new(),
    };
    check_references(&src, &jobs, &groups)?;
    let rings = match top.take("ring") {
        Some(v) => {
            let items = array_of_tables(&src, "ring", v)?;
            let mut rings: Vec<(RingConfig, String, usize, usize)> = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let path = format!("ring[{i}]");
                if i >= abi::MAX_RINGS as usize {
                    return Err(src.error(
                        item.span().start,
                        Some(path),
                        format!("more than {} rings; the kernel's ring_jobs map holds {}", abi::MAX_RINGS, abi::MAX_RINGS),
                    ));
                }
                let default_frag_elems = node.ring_frag_elems.unwrap_or(DEFAULT_RING_FRAG_ELEMS);
                rings.push(parse_ring(&src, path, item, default_frag_elems)?);
            }
            check_rings(&src, &node, &jobs, &rings)?;
            rings.into_iter().map(|r| r.0).collect()
        }
        None => Vec::new(),
    };
    Ok(Config {
        node,
        jobs: jobs.into_iter().map(|j| j.config).collect(),
        groups: groups.into_iter().map(|g| g.config).collect(),
        rings,
    })
}

// ---------------------------------------------------------------------------
// Sections
// ---------------------------------------------------------------------------

/// A parsed job plus the byte offsets of the keys that cross-checks
/// (duplicates, references) report on.
struct ParsedJob {
    config: JobConfig,
    path: String,
    id_at: usize,
    port_at: usize,
    result_port_at: usize,
    result_group_at: usize,
    /// Where `consumer` is (0 when absent).
    consumer_at: usize,
}

/// A parsed group plus the offset of its id, for duplicate reports.
struct ParsedGroup {
    config: GroupConfig,
    path: String,
    id_at: usize,
}

const NODE_KEYS: &[&str] = &[
    "metrics",
    "ack_mode",
    "ack_group",
    "userspace_path",
    "userspace_slot_bytes",
    "control",
    "keys",
    "ring_pool",
    "ring_frag_elems",
];

/// `userspace_slot_bytes` (node or job): an integer of bytes, at least
/// [`MIN_USERSPACE_SLOT_BYTES`].
fn slot_bytes(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<u64, ConfigError> {
    Ok(int_in(
        src,
        key,
        v,
        MIN_USERSPACE_SLOT_BYTES as i64,
        i64::MAX,
        "a byte bound",
        "bytes, at least 1 MiB",
    )? as u64)
}

fn parse_node(src: &Source<'_>, v: Spanned<Value>) -> Result<NodeConfig, ConfigError> {
    let mut t = Table::from_value(src, "node".into(), v, NODE_KEYS)?;
    let mut node = NodeConfig::default();
    if let Some(v) = t.take("metrics") {
        let key = t.key("metrics");
        let s = expect_str(src, &key, &v)?;
        node.metrics = if s == "off" {
            None
        } else {
            let addr = socket_addr(s).map_err(|why| {
                let why = why.unwrap_or_else(|| format!("{s:?} is neither \"off\" nor an address A.B.C.D:PORT or [IPv6]:PORT"));
                src.error(v.span().start, Some(key.clone()), why)
            })?;
            if addr.port() == 0 {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{s:?}: port 0 is not a TCP port Prometheus can scrape (use \"off\" to disable metrics)"),
                ));
            }
            Some(addr)
        };
    }
    if let Some(v) = t.take("ack_mode") {
        let key = t.key("ack_mode");
        node.ack_mode = match expect_str(src, &key, &v)? {
            "group" => AckMode::Group,
            "packet" => AckMode::Packet,
            other => {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{other:?} is not an ACK mode (\"group\" or \"packet\")"),
                ))
            }
        };
    }
    if let Some(v) = t.take("userspace_path") {
        let key = t.key("userspace_path");
        node.userspace_path = match expect_str(src, &key, &v)? {
            "required" => UserspacePathMode::Required,
            "optional" => UserspacePathMode::Optional,
            other => {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{other:?} is neither \"required\" nor \"optional\""),
                ))
            }
        };
    }
    if let Some(v) = t.take("ack_group") {
        node.ack_group = int_in(
            src,
            &t.key("ack_group"),
            &v,
            1,
            i64::from(MAX_ACK_GROUP),
            "an ACK group size",
            "one AGK1 covers at most 1024 sequence numbers",
        )? as u16;
    }
    if let Some(v) = t.take("userspace_slot_bytes") {
        node.userspace_slot_bytes = slot_bytes(src, &t.key("userspace_slot_bytes"), &v)?;
    }
    if let Some(v) = t.take("control") {
        let key = t.key("control");
        let s = expect_str(src, &key, &v)?;
        node.control = socket_addr(s).map_err(|why| {
            let why = why.unwrap_or_else(|| format!("{s:?} is not an address A.B.C.D:PORT or [IPv6]:PORT"));
            src.error(v.span().start, Some(key.clone()), why)
        })?;
    }
    if let Some(v) = t.take("keys") {
        let key = t.key("keys");
        let s = expect_str(src, &key, &v)?;
        if s.is_empty() {
            return Err(src.error(v.span().start, Some(key), "an empty path: name the key file".into()));
        }
        node.keys = Some(s.into());
    }
    if let Some(v) = t.take("ring_pool") {
        node.ring_pool = int_in(
            src,
            &t.key("ring_pool"),
            &v,
            0,
            i64::from(MAX_RING_POOL),
            "a ring pool in elements",
            "at most 2^28 elements (2 GiB of ring memory)",
        )? as u32;
    }
    if let Some(v) = t.take("ring_frag_elems") {
        node.ring_frag_elems = Some(ring_frag_elems(src, &t.key("ring_frag_elems"), &v)?);
    }
    Ok(node)
}

/// A ring fragment size (`[node] ring_frag_elems`, `[[ring]] frag_elems`):
/// even, 2..=[`abi::RING_MAX_FRAG_ELEMS`].
fn ring_frag_elems(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<u32, ConfigError> {
    let n = int_in(
        src,
        key,
        v,
        2,
        i64::from(abi::RING_MAX_FRAG_ELEMS),
        "a fragment size in elements",
        "(MTU - 52) / 4 fills a datagram",
    )? as u32;
    if !n.is_multiple_of(2) {
        return Err(src.error(
            v.span().start,
            Some(key.to_string()),
            format!("{n} is odd: the ring's memory holds fragments of whole 8-byte words"),
        ));
    }
    Ok(n)
}

const JOB_KEYS: &[&str] = &[
    "id",
    "port",
    "workers",
    "weights",
    "result_port",
    "result_group",
    "vector_len",
    "slots",
    "parent",
    "userspace_only",
    "window",
    "userspace_slots",
    "userspace_slot_bytes",
    "consumer",
    "frag_elems",
];

fn parse_job(src: &Source<'_>, path: String, v: Spanned<Value>) -> Result<ParsedJob, ConfigError> {
    let mut t = Table::from_value(src, path, v, JOB_KEYS)?;

    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a job id", "")? as u16;
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;

    let workers_v = t.require("workers")?;
    let workers = parse_workers(src, &t.key("workers"), workers_v, "a job's workers")?;

    let weights = match t.take("weights") {
        Some(v) => parse_weights(src, &t.key("weights"), v, workers.len())?,
        None => vec![1; workers.len()],
    };

    let rp_v = t.require("result_port")?;
    let result_port = udp_port(src, &t.key("result_port"), &rp_v)?;
    if result_port == port {
        return Err(src.error(
            rp_v.span().start,
            Some(t.key("result_port")),
            format!("{result_port} is this job's own contribution port; RESULT datagrams need a port of their own"),
        ));
    }

    let mut result_group_at = 0;
    let result_group = match t.take("result_group") {
        Some(v) => {
            let key = t.key("result_group");
            let g = int_in(src, &key, &v, 0, 65535, "a group id", "")? as u16;
            if g == abi::NO_GROUP {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("{g} is reserved: the jobs map uses it for \"no group\""),
                ));
            }
            result_group_at = v.span().start;
            Some(g)
        }
        None => None,
    };

    let vector_len = match t.take("vector_len") {
        Some(v) => Some(int_in(
            src,
            &t.key("vector_len"),
            &v,
            1,
            i64::from(u32::MAX),
            "a vector length",
            "leave vector_len out for no bound",
        )? as u32),
        None => None,
    };
    let slots = match t.take("slots") {
        Some(v) => int_in(
            src,
            &t.key("slots"),
            &v,
            1,
            i64::from(u32::MAX),
            "a slot count",
            "",
        )? as u32,
        None => DEFAULT_SLOTS,
    };
    let mut parent_at = 0;
    let parent = match t.take("parent") {
        Some(v) => {
            parent_at = v.span().start;
            let (parent, addr_at) = parse_parent(src, t.key("parent"), v)?;
            if let Some(w) = workers.first().filter(|w| w.is_ipv6() != parent.addr.is_ipv6()) {
                return Err(src.error(
                    addr_at,
                    Some(format!("{}.addr", t.key("parent"))),
                    format!(
                        "{} is {} where the job's workers are {} ({w}): a tree's parent and its workers are of one family",
                        parent.addr,
                        family(parent.addr),
                        family(*w)
                    ),
                ));
            }
            Some(parent)
        }
        None => None,
    };
    let userspace_only = match t.take("userspace_only") {
        Some(v) => expect_bool(src, &t.key("userspace_only"), &v)?,
        None => false,
    };
    let window = match t.take("window") {
        Some(v) => int_in(
            src,
            &t.key("window"),
            &v,
            1,
            i64::from(MAX_WINDOW),
            "a window",
            "rounds compare modulo 2^32",
        )? as u32,
        None => DEFAULT_WINDOW,
    };
    let frag_elems = match t.take("frag_elems") {
        Some(v) => Some(int_in(
            src,
            &t.key("frag_elems"),
            &v,
            1,
            i64::from(abi::MAX_ELEMS),
            "a fragment size in elements",
            "(MTU - 52) / 4 fills a datagram",
        )? as u32),
        None => None,
    };
    let userspace_slots = match t.take("userspace_slots") {
        Some(v) => int_in(
            src,
            &t.key("userspace_slots"),
            &v,
            1,
            i64::from(u32::MAX),
            "a slot count",
            "",
        )? as u32,
        None => DEFAULT_USERSPACE_SLOTS,
    };
    let userspace_slot_bytes = match t.take("userspace_slot_bytes") {
        Some(v) => slot_bytes(src, &t.key("userspace_slot_bytes"), &v)?,
        None => DEFAULT_USERSPACE_SLOT_BYTES_JOB,
    };
    let mut consumer_at = 0;
    let consumer = match t.take("consumer") {
        Some(v) => {
            let key = t.key("consumer");
            consumer_at = v.span().start;
            let c = match expect_str(src, &key, &v)? {
                "application" => ResultConsumer::Application,
                "node" => ResultConsumer::Node,
                other => {
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        format!("{other:?}: expected \"application\" or \"node\""),
                    ))
                }
            };
            if let (ResultConsumer::Node, Some(p)) = (c, &parent) {
                if p.result_port.is_none() {
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        "\"node\" with a parent needs parent.result_port: the node acknowledges the parent's RESULTs there".into(),
                    ));
                }
                if p.job == id {
                    // The parent's RESULTs come to this job's result_port
                    // with job = parent.job; the XDP program drops RESULTs
                    // of this node's own job id there as forged.
                    return Err(src.error(
                        v.span().start,
                        Some(key),
                        format!("\"node\" with a parent needs parent.job other than the job's own id {id}: the parent's RESULTs arrive at this job's result_port, where the node drops RESULTs of its own job id as forged"),
                    ));
                }
            }
            if c == ResultConsumer::Node && workers.len() > 64 {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    format!("\"node\" serves at most 64 workers (a bit each in its resend window), this job has {}", workers.len()),
                ));
            }
            if c == ResultConsumer::Node && result_group.is_none() {
                return Err(src.error(
                    v.span().start,
                    Some(key),
                    "\"node\" needs result_group: the node acknowledges the RESULT copies that group brings to the workers".into(),
                ));
            }
            c
        }
        None => ResultConsumer::Application,
    };
    if let Some(n) = parent.and_then(|p| p.tree_workers).filter(|&n| usize::from(n) < workers.len()) {
        return Err(src.error(
            parent_at,
            Some(format!("{}.tree_workers", t.key("parent"))),
            format!("{n} is fewer than this job's own {} workers: the tree's workers include them", workers.len()),
        ));
    }
    if parent.is_some_and(|p| p.result_port.is_some()) && consumer != ResultConsumer::Node {
        return Err(src.error(
            parent_at,
            Some(format!("{}.result_port", t.key("parent"))),
            "only a job with consumer = \"node\" takes its parent's RESULTs (for the node to acknowledge them); an aggregator application gets none".into(),
        ));
    }

    Ok(ParsedJob {
        config: JobConfig {
            id,
            port,
            workers,
            weights,
            result_port,
            result_group,
            vector_len,
            slots,
            parent,
            userspace_only,
            window,
            userspace_slots,
            userspace_slot_bytes,
            consumer,
            frag_elems,
        },
        path: t.path,
        consumer_at,
        id_at: id_v.span().start,
        port_at: port_v.span().start,
        result_port_at: rp_v.span().start,
        result_group_at,
    })
}

fn parse_workers(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
    whose: &str,
) -> Result<Vec<IpAddr>, ConfigError> {
    let at = v.span().start;
    let items = expect_array(src, key, v)?;
    if items.is_empty() {
        return Err(src.error(
            at,
            Some(key.into()),
            "no workers: a job needs at least one rank".into(),
        ));
    }
    if items.len() > MAX_WORKERS {
        return Err(src.error(
            at,
            Some(key.into()),
            format!(
                "{} workers, at most {MAX_WORKERS} ranks per job (larger jobs use a tree of aggregators)",
                items.len()
            ),
        ));
    }
    let mut workers: Vec<IpAddr> = Vec::with_capacity(items.len());
    let mut seen: HashMap<IpAddr, (usize, usize)> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let ikey = format!("{key}[{i}]");
        let s = expect_str(src, &ikey, item)?;
        let addr = ip_addr(src, &ikey, item, s)?;
        if let Some(why) = not_unicast(addr) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?} cannot be a worker's source address ({why})"),
            ));
        }
        if let Some(&(j, at)) = seen.get(&addr) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is also {key}[{j}] (line {}): the source address identifies the rank",
                    src.line(at)
                ),
            ));
        }
        if let Some(first) = workers.first().filter(|f| f.is_ipv6() != addr.is_ipv6()) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is {} where {key}[0] ({first}, line {}) is {}: {whose} are all of one family",
                    family(addr),
                    src.line(items[0].span().start),
                    family(*first)
                ),
            ));
        }
        seen.insert(addr, (i, item.span().start));
        workers.push(addr);
    }
    Ok(workers)
}

/// "IPv4" or "IPv6", for messages.
fn family(addr: IpAddr) -> &'static str {
    if addr.is_ipv6() {
        "IPv6"
    } else {
        "IPv4"
    }
}

/// An address alone (a worker, a ring member, a parent): IPv4 `A.B.C.D` or
/// IPv6 without brackets; an IPv4-mapped IPv6 address is refused (it is
/// IPv4 on the wire: the file must say the IPv4 address).
fn ip_addr(src: &Source<'_>, key: &str, v: &Spanned<Value>, s: &str) -> Result<IpAddr, ConfigError> {
    let fail = |m: String| src.error(v.span().start, Some(key.to_string()), m);
    if let Some(inner) = s.strip_prefix('[') {
        return Err(fail(match inner.strip_suffix(']').map(str::parse::<std::net::Ipv6Addr>) {
            Some(Ok(a)) => format!("{s:?}: brackets go around an IPv6 address only before a :PORT; write {a} here"),
            _ => format!("{s:?} is not an IP address (IPv4 A.B.C.D or IPv6, without brackets and port here)"),
        }));
    }
    let addr: IpAddr = s
        .parse()
        .map_err(|_| fail(format!("{s:?} is not an IP address (IPv4 A.B.C.D or IPv6)")))?;
    if let IpAddr::V6(a) = addr {
        if let Some(v4) = a.to_ipv4_mapped() {
            return Err(fail(format!(
                "{s:?} is an IPv4-mapped IPv6 address, which travels as IPv4: write {v4}"
            )));
        }
    }
    Ok(addr)
}

/// A socket address `A.B.C.D:PORT` or `[IPv6]:PORT`. `Err(Some(why))`
/// names what is wrong with a form that is almost one (an IPv6 address
/// without brackets, brackets without a port or around an IPv4 address,
/// an unclosed bracket, a scope id, an IPv4-mapped address); `Err(None)`:
/// not an address at all (the caller says what it expected).
fn socket_addr(s: &str) -> Result<SocketAddr, Option<String>> {
    if let Some(inner) = s.strip_prefix('[') {
        let Some((host, rest)) = inner.split_once(']') else {
            return Err(Some(format!("{s:?}: no closing ]; an IPv6 socket address is [ADDR]:PORT")));
        };
        if rest.is_empty() {
            return Err(Some(format!("{s:?} has no port: write [{host}]:PORT")));
        }
        if host.parse::<std::net::Ipv4Addr>().is_ok() {
            return Err(Some(format!("{s:?}: brackets are for IPv6 addresses; write {host}{rest}")));
        }
        if host.contains('%') {
            return Err(Some(format!("{s:?}: scope ids (%IFACE) are not accepted; use a global or unique-local address")));
        }
    } else if s.parse::<std::net::Ipv6Addr>().is_ok() || s.matches(':').count() > 1 {
        return Err(Some(format!("{s:?}: an IPv6 address with a port is written in brackets, [ADDR]:PORT")));
    }
    let addr: SocketAddr = s.parse().map_err(|_| None)?;
    if let SocketAddr::V6(a) = addr {
        if let Some(v4) = a.ip().to_ipv4_mapped() {
            return Err(Some(format!(
                "{s:?} is an IPv4-mapped IPv6 address, which travels as IPv4: write {v4}:{}",
                a.port()
            )));
        }
    }
    Ok(addr)
}

fn parse_weights(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
    n_workers: usize,
) -> Result<Vec<i32>, ConfigError> {
    let at = v.span().start;
    let items = expect_array(src, key, v)?;
    if items.len() != n_workers {
        return Err(src.error(
            at,
            Some(key.into()),
            format!(
                "{} weights for {n_workers} workers: one weight per rank",
                items.len()
            ),
        ));
    }
    let mut weights = Vec::with_capacity(items.len());
    let mut sum: u64 = 0;
    for (i, item) in items.iter().enumerate() {
        let w = int_in(
            src,
            &format!("{key}[{i}]"),
            item,
            0,
            i64::from(crate::wire::abi::MAX_WEIGHT),
            "a weight",
            "the kernel adds weight × value in a 64-bit sum that 256 ranks must not overflow",
        )?;
        sum += w as u64;
        weights.push(w as i32);
    }
    if sum == 0 {
        return Err(src.error(
            at,
            Some(key.into()),
            "the weights sum to 0; AVG divides by the sum, it must be positive".into(),
        ));
    }
    Ok(weights)
}

const RING_KEYS: &[&str] = &["id", "port", "members", "weights", "vector_len", "frag_elems"];

/// A parsed ring, its path, and the offsets of its id and port;
/// `frag_elems` defaults to `default_frag_elems` (the node's).
fn parse_ring(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
    default_frag_elems: u32,
) -> Result<(RingConfig, String, usize, usize), ConfigError> {
    let mut t = Table::from_value(src, path.clone(), v, RING_KEYS)?;
    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a ring id", "")? as u16;
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;
    let members_v = t.require("members")?;
    let members_at = members_v.span().start;
    let members = parse_workers(src, &t.key("members"), members_v, "a ring's members")?;
    if members.len() < 2 {
        return Err(src.error(
            members_at,
            Some(t.key("members")),
            "one member: a ring needs at least two (a single node has nothing to reduce with)".into(),
        ));
    }
    let weights = match t.take("weights") {
        Some(v) => parse_weights(src, &t.key("weights"), v, members.len())?,
        None => vec![1; members.len()],
    };
    let vl_v = t.require("vector_len")?;
    let vector_len = int_in(
        src,
        &t.key("vector_len"),
        &vl_v,
        1,
        i64::from(u32::MAX),
        "a vector length",
        "a ring's memory is sized from it",
    )? as u32;
    let frag_elems = match t.take("frag_elems") {
        Some(v) => ring_frag_elems(src, &t.key("frag_elems"), &v)?,
        None => default_frag_elems,
    };
    Ok((
        RingConfig { id, port, members, weights, vector_len, frag_elems },
        path,
        id_v.span().start,
        port_v.span().start,
    ))
}

/// Ring ids unique among rings, ports unique among jobs and rings, one
/// fragment size for the node (`[node] ring_frag_elems` when given).
fn check_rings(
    src: &Source<'_>,
    node: &NodeConfig,
    jobs: &[ParsedJob],
    rings: &[(RingConfig, String, usize, usize)],
) -> Result<(), ConfigError> {
    for (i, (ring, path, id_at, port_at)) in rings.iter().enumerate() {
        if let Some(node_frag) = node.ring_frag_elems.filter(|&n| n != ring.frag_elems) {
            return Err(src.error(
                *id_at,
                Some(format!("{path}.frag_elems")),
                format!(
                    "{} elements per fragment where [node] ring_frag_elems is {node_frag}: the rings of a node share one fragment size",
                    ring.frag_elems
                ),
            ));
        }
        for (other, opath, oid_at, _) in &rings[..i] {
            if other.id == ring.id {
                return Err(src.error(
                    *id_at,
                    Some(format!("{path}.id")),
                    format!("ring {} is already defined by {opath} (line {})", ring.id, src.line(*oid_at)),
                ));
            }
            if other.port == ring.port {
                return Err(src.error(
                    *port_at,
                    Some(format!("{path}.port")),
                    format!("port {} is already ring {}'s ({opath}): a port serves one ring", ring.port, other.id),
                ));
            }
            if other.frag_elems != ring.frag_elems {
                return Err(src.error(
                    *id_at,
                    Some(format!("{path}.frag_elems")),
                    format!(
                        "{} elements per fragment where {opath} has {}: the rings of a node share one fragment size",
                        ring.frag_elems, other.frag_elems
                    ),
                ));
            }
        }
        if let Some(job) = jobs.iter().find(|j| j.config.port == ring.port || j.config.result_port == ring.port) {
            return Err(src.error(
                *port_at,
                Some(format!("{path}.port")),
                format!("port {} is also job {}'s ({}): a port serves one job or ring", ring.port, job.config.id, job.path),
            ));
        }
    }
    Ok(())
}

const PARENT_KEYS: &[&str] = &["addr", "port", "job", "rank", "result_port", "tree_workers"];

/// The parent and the offset of its `addr` (for the family check against
/// the job's workers).
fn parse_parent(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
) -> Result<(ParentConfig, usize), ConfigError> {
    let mut t = Table::from_value(src, path, v, PARENT_KEYS)?;
    let addr_v = t.require("addr")?;
    let key = t.key("addr");
    let s = expect_str(src, &key, &addr_v)?;
    let addr = ip_addr(src, &key, &addr_v, s)?;
    if let Some(why) = not_unicast(addr) {
        return Err(src.error(
            addr_v.span().start,
            Some(key),
            format!("{s:?} cannot be a parent aggregator's address ({why})"),
        ));
    }
    let port_v = t.require("port")?;
    let port = udp_port(src, &t.key("port"), &port_v)?;
    let job_v = t.require("job")?;
    let job = int_in(src, &t.key("job"), &job_v, 0, 65535, "a job id", "")? as u16;
    let rank_v = t.require("rank")?;
    let rank = int_in(
        src,
        &t.key("rank"),
        &rank_v,
        0,
        i64::from(abi::RESULT_RANK) - 1,
        "a rank",
        "65535 marks RESULT datagrams",
    )? as u16;
    let result_port = match t.take("result_port") {
        Some(v) => Some(udp_port(src, &t.key("result_port"), &v)?),
        None => None,
    };
    let tree_workers = match t.take("tree_workers") {
        Some(v) => Some(int_in(
            src,
            &t.key("tree_workers"),
            &v,
            1,
            i64::from(u16::MAX),
            "a worker count",
            "",
        )? as u16),
        None => None,
    };
    Ok((
        ParentConfig {
            addr,
            port,
            job,
            rank,
            result_port,
            tree_workers,
        },
        addr_v.span().start,
    ))
}

const GROUP_KEYS: &[&str] = &["id", "members"];

fn parse_group(
    src: &Source<'_>,
    path: String,
    v: Spanned<Value>,
) -> Result<ParsedGroup, ConfigError> {
    let mut t = Table::from_value(src, path, v, GROUP_KEYS)?;
    let id_v = t.require("id")?;
    let id = int_in(src, &t.key("id"), &id_v, 0, 65535, "a group id", "")? as u16;

    let members_v = t.require("members")?;
    let key = t.key("members");
    let at = members_v.span().start;
    let items = expect_array(src, &key, members_v)?;
    if items.is_empty() {
        return Err(src.error(
            at,
            Some(key),
            "no members: a group needs at least one destination".into(),
        ));
    }
    if items.len() > MAX_GROUP_MEMBERS {
        return Err(src.error(
            at,
            Some(key),
            format!(
                "{} members, at most {MAX_GROUP_MEMBERS} per group (one AGB1 mask bit each; larger groups use a tree)",
                items.len()
            ),
        ));
    }
    let mut members: Vec<SocketAddr> = Vec::with_capacity(items.len());
    let mut seen: HashMap<SocketAddr, (usize, usize)> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let ikey = format!("{key}[{i}]");
        let s = expect_str(src, &ikey, item)?;
        let member = socket_addr(s).map_err(|why| {
            let why = why.unwrap_or_else(|| format!("{s:?} is not an IP address and UDP port (A.B.C.D:PORT or [IPv6]:PORT)"));
            src.error(item.span().start, Some(ikey.clone()), why)
        })?;
        if member.port() == 0 {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?}: 0 is not a UDP port (1..=65535)"),
            ));
        }
        if let Some(why) = not_unicast(member.ip()) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!("{s:?} cannot be a broadcast destination ({why})"),
            ));
        }
        if let Some(&(j, at)) = seen.get(&member) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is also {key}[{j}] (line {}): each destination gets one mask bit",
                    src.line(at)
                ),
            ));
        }
        if let Some(first) = members.first().filter(|f: &&SocketAddr| f.is_ipv6() != member.is_ipv6()) {
            return Err(src.error(
                item.span().start,
                Some(ikey),
                format!(
                    "{s:?} is {} where {key}[0] ({first}, line {}) is {}: a group's members are all of one family",
                    family(member.ip()),
                    src.line(items[0].span().start),
                    family(first.ip())
                ),
            ));
        }
        seen.insert(member, (i, item.span().start));
        members.push(member);
    }
    Ok(ParsedGroup {
        config: GroupConfig { id, members },
        path: t.path,
        id_at: id_v.span().start,
    })
}

/// Checks that span tables: unique ids and ports, result ports that are
/// nobody's contribution port, result groups that exist.
fn check_references(
    src: &Source<'_>,
    jobs: &[ParsedJob],
    groups: &[ParsedGroup],
) -> Result<(), ConfigError> {
    let mut job_ids: HashMap<u16, &ParsedJob> = HashMap::new();
    let mut job_ports: HashMap<u16, &ParsedJob> = HashMap::new();
    for job in jobs {
        if let Some(first) = job_ids.get(&job.config.id) {
            return Err(src.error(
                job.id_at,
                Some(format!("{}.id", job.path)),
                format!(
                    "job {} is already defined by {} (line {})",
                    job.config.id,
                    first.path,
                    src.line(first.id_at)
                ),
            ));
        }
        job_ids.insert(job.config.id, job);
        if let Some(first) = job_ports.get(&job.config.port) {
            return Err(src.error(
                job.port_at,
                Some(format!("{}.port", job.path)),
                format!(
                    "port {} already serves job {} (line {}); a port serves one job",
                    job.config.port,
                    first.config.id,
                    src.line(first.port_at)
                ),
            ));
        }
        job_ports.insert(job.config.port, job);
    }
    // After all ports are known, so a later job's port counts too.
    for job in jobs {
        if let Some(other) = job_ports.get(&job.config.result_port) {
            return Err(src.error(
                job.result_port_at,
                Some(format!("{}.result_port", job.path)),
                format!(
                    "{} is the contribution port of job {} (line {}); RESULT datagrams need a port of their own",
                    job.config.result_port,
                    other.config.id,
                    src.line(other.port_at)
                ),
            ));
        }
    }

    // A node-served job's parent sends its RESULTs (job = parent.job) to
    // the job's result_port; the XDP program drops RESULTs there of a job
    // of this node with that id and result_port as forged.
    for job in jobs {
        let Some(p) = job.config.parent.filter(|_| job.config.consumer == ResultConsumer::Node) else {
            continue;
        };
        if let Some(other) = jobs.iter().find(|o| o.config.id == p.job && o.config.result_port == job.config.result_port) {
            return Err(src.error(
                job.result_port_at,
                Some(format!("{}.result_port", job.path)),
                format!(
                    "job {} (line {}) has the parent's job id {} and this result_port: the node would drop the parent's RESULTs as forged",
                    other.config.id,
                    src.line(other.id_at),
                    p.job
                ),
            ));
        }
    }

    let mut group_ids: HashMap<u16, &ParsedGroup> = HashMap::new();
    for group in groups {
        if let Some(first) = group_ids.get(&group.config.id) {
            return Err(src.error(
                group.id_at,
                Some(format!("{}.id", group.path)),
                format!(
                    "group {} is already defined by {} (line {})",
                    group.config.id,
                    first.path,
                    src.line(first.id_at)
                ),
            ));
        }
        group_ids.insert(group.config.id, group);
    }
    for job in jobs {
        if let Some(g) = job.config.result_group {
            let Some(group) = group_ids.get(&g) else {
                return Err(src.error(
                    job.result_group_at,
                    Some(format!("{}.result_group", job.path)),
                    format!("there is no [[group]] with id {g}"),
                ));
            };
            if let (Some(w), Some(m)) = (job.config.workers.first(), group.config.members.first()) {
                if w.is_ipv6() != m.is_ipv6() {
                    return Err(src.error(
                        job.result_group_at,
                        Some(format!("{}.result_group", job.path)),
                        format!(
                            "group {g} ({}, line {}) has {} members where this job's workers are {}: the RESULTs the kernel copies to them are datagrams of the workers' family",
                            group.path,
                            src.line(group.id_at),
                            family(m.ip()),
                            family(*w)
                        ),
                    ));
                }
            }
            // The node resends a RESULT copy to the member socket of the
            // worker that missed it: every worker needs one.
            if job.config.consumer == ResultConsumer::Node {
                if let Some((r, w)) = job
                    .config
                    .workers
                    .iter()
                    .enumerate()
                    .find(|(_, w)| !group.config.members.iter().any(|m| m.ip() == **w))
                {
                    return Err(src.error(
                        job.consumer_at,
                        Some(format!("{}.consumer", job.path)),
                        format!("\"node\": worker {r} ({w}) is not a member of group {g}, so the node has no socket to resend its RESULTs to"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Why `addr` cannot be a unicast source or destination, if it cannot.
fn not_unicast(addr: IpAddr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("unspecified address")
    } else if matches!(addr, IpAddr::V4(a) if a.is_broadcast()) {
        Some("broadcast address")
    } else if addr.is_multicast() {
        Some("multicast address")
    } else {
        None
    }
}

// ---------------------------------------------------------------------------
// Typed access to the spanned tree
// ---------------------------------------------------------------------------

fn udp_port(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<u16, ConfigError> {
    Ok(int_in(src, key, v, 1, 65535, "a UDP port", "")? as u16)
}

/// An integer in `lo..=hi`; the message says what the value should be
/// (`what`) and, when given, why the range is what it is (`why`).
fn int_in(
    src: &Source<'_>,
    key: &str,
    v: &Spanned<Value>,
    lo: i64,
    hi: i64,
    what: &str,
    why: &str,
) -> Result<i64, ConfigError> {
    let Value::Integer(n) = *v.get_ref() else {
        return Err(src.type_error(key, v, "an integer"));
    };
    if n < lo || n > hi {
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(": {why}")
        };
        return Err(src.error(
            v.span().start,
            Some(key.into()),
            format!("{n} is not {what} ({lo}..={hi}{why})"),
        ));
    }
    Ok(n)
}

fn expect_str<'v>(
    src: &Source<'_>,
    key: &str,
    v: &'v Spanned<Value>,
) -> Result<&'v str, ConfigError> {
    match v.get_ref() {
        Value::String(s) => Ok(s),
        _ => Err(src.type_error(key, v, "a string")),
    }
}

fn expect_bool(src: &Source<'_>, key: &str, v: &Spanned<Value>) -> Result<bool, ConfigError> {
    match v.get_ref() {
        Value::Boolean(b) => Ok(*b),
        _ => Err(src.type_error(key, v, "a boolean (true or false)")),
    }
}

fn expect_array(
    src: &Source<'_>,
    key: &str,
    v: Spanned<Value>,
) -> Result<Vec<Spanned<Value>>, ConfigError> {
    if !matches!(v.get_ref(), Value::Array(_)) {
        return Err(src.type_error(key, &v, "an array"));
    }
    match v.into_inner() {
        Value::Array(items) => Ok(items),
        _ => Ok(Vec::new()), // checked just above
    }
}

/// `[[name]]` sections: an array whose items are all tables.
fn array_of_tables(
    src: &Source<'_>,
    name: &str,
    v: Spanned<Value>,
) -> Result<Vec<Spanned<Value>>, ConfigError> {
    let what = format!("an array of tables (write [[{name}]], one per {name})");
    if !matches!(v.get_ref(), Value::Array(_)) {
        return Err(src.type_error(name, &v, &what));
    }
    let items = expect_array(src, name, v)?;
    for (i, item) in items.iter().enumerate() {
        if !matches!(item.get_ref(), Value::Table(_)) {
            return Err(src.type_error(&format!("{name}[{i}]"), item, "a table"));
        }
    }
    Ok(items)
}

/// One table being walked: values are taken out by key, and keys nobody
/// asks for are rejected up front (what `deny_unknown_fields` does, but with
/// the key's path and line).
struct Table<'s> {
    src: &'s Source<'s>,
    path: String,
    start: usize,
    entries: Vec<(String, Spanned<Value>)>,
}

impl<'s> Table<'s> {
    fn from_value(
        src: &'s Source<'s>,
        path: String,
        v: Spanned<Value>,
        allowed: &[&str],
    ) -> Result<Self, ConfigError> {
        let start = v.span().start;
        if !matches!(v.get_ref(), Value::Table(_)) {
            return Err(src.type_error(&path, &v, "a table"));
        }
        match v.into_inner() {
            Value::Table(entries) => Table::from_entries(src, &path, start, entries, allowed),
            _ => Ok(Table {
                src,
                path,
                start,
                entries: Vec::new(),
            }), // checked just above
        }
    }

    fn from_entries(
        src: &'s Source<'s>,
        path: &str,
        start: usize,
        entries: Vec<(String, Spanned<Value>)>,
        allowed: &[&str],
    ) -> Result<Self, ConfigError> {
        let table = Table {
            src,
            path: path.to_string(),
            start,
            entries,
        };
        if let Some((k, v)) = table
            .entries
            .iter()
            .find(|(k, _)| !allowed.contains(&k.as_str()))
        {
            return Err(src.error(
                v.span().start,
                Some(table.key(k)),
                format!("unknown key; expected one of: {}", allowed.join(", ")),
            ));
        }
        Ok(table)
    }

    /// Path of `key` inside this table.
    fn key(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    fn take(&mut self, key: &str) -> Option<Spanned<Value>> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.swap_remove(i).1)
    }

    /// A key the table must have; its absence is reported on the table's
    /// header line.
    fn require(&mut self, key: &str) -> Result<Spanned<Value>, ConfigError> {
        match self.take(key) {
            Some(v) => Ok(v),
            None => Err(self.src.error(
                self.start,
                Some(self.key(key)),
                "required key is missing".into(),
            )),
        }
    }
}

/// The text being parsed, to turn byte offsets into lines.
struct Source<'a> {
    text: &'a str,
    origin: &'a str,
}

impl Source<'_> {
    /// 1-based line of byte `offset`.
    fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn error(&self, offset: usize, key: Option<String>, message: String) -> ConfigError {
        ConfigError {
            origin: self.origin.to_string(),
            line: Some(self.line(offset)),
            key,
            message,
        }
    }

    fn type_error(&self, key: &str, v: &Spanned<Value>, expected: &str) -> ConfigError {
        self.error(
            v.span().start,
            Some(key.to_string()),
            format!("expected {expected}, found {}", v.get_ref().describe()),
        )
    }

    /// A TOML syntax error: the parser knows the place, not the key, so the
    /// key is guessed from the text; the multi-line message becomes one line.
    fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let message = e
            .message()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(": ");
        match e.span() {
            Some(span) => ConfigError {
                origin: self.origin.to_string(),
                line: Some(self.line(span.start)),
                key: key_at_line(self.text, self.line(span.start)),
                message,
            },
            None => ConfigError {
                origin: self.origin.to_string(),
                line: Some(1),
                key: None,
                message,
            },
        }
    }
}

/// Best-effort key path in force at 1-based `line`: the last table header
/// (with its `[[array]]` index) and the last `key =` under it. Used only for
/// syntax errors, where no parsed tree exists.
fn key_at_line(text: &str, line: usize) -> Option<String> {
    let mut section: Option<String> = None;
    let mut key: Option<String> = None;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for raw in text.lines().take(line) {
        let l = raw.trim_start();
        if let Some(rest) = l.strip_prefix("[[") {
            let name = rest.split("]]").next().unwrap_or("").trim().to_string();
            let n = counts.entry(name.clone()).or_insert(0);
            section = Some(format!("{name}[{n}]"));
            *n += 1;
            key = None;
        } else if let Some(rest) = l.strip_prefix('[') {
            if let Some((name, _)) = rest.split_once(']') {
                section = Some(name.trim().to_string());
                key = None;
            }
        } else if let Some((k, _)) = l.split_once('=') {
            let k = k.trim();
            let bare = !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if bare {
                key = Some(k.to_string());
            }
        }
    }
    match (section, key) {
        (Some(s), Some(k)) => Some(format!("{s}.{k}")),
        (Some(s), None) => Some(s),
        (None, Some(k)) => Some(k),
        (None, None) => None,
    }
}

// ---------------------------------------------------------------------------
// Untyped TOML tree with spans
// ---------------------------------------------------------------------------

/// A TOML value whose children carry their byte spans. `toml::Value` drops
/// spans below the top, which is why this exists.
#[derive(Debug)]
enum Value {
    String(String),
    Integer(i64),
    Float(f64),
    Boolean(bool),
    Datetime(String),
    Array(Vec<Spanned<Value>>),
    /// Entries in file order, so "the first unknown key" is the first in
    /// the file.
    Table(Vec<(String, Spanned<Value>)>),
}

impl Value {
    /// How a value is named in "expected X, found Y".
    fn describe(&self) -> String {
        match self {
            Value::String(s) => format!("the string {s:?}"),
            Value::Integer(n) => format!("the integer {n}"),
            Value::Float(x) => format!("the float {x}"),
            Value::Boolean(b) => format!("the boolean {b}"),
            Value::Datetime(d) => format!("the datetime {d}"),
            Value::Array(_) => "an array".into(),
            Value::Table(_) => "a table".into(),
        }
    }
}

/// The key under which the `toml` deserializer hands out a datetime as a
/// one-entry map (`toml_datetime::__unstable::FIELD`).
const TOML_DATETIME_FIELD: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Boolean(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Integer(n))
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Value, E> {
        // TOML integers are i64; kept for completeness.
        i64::try_from(n)
            .map(Value::Integer)
            .map_err(|_| E::custom("integer out of range"))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(Value::Float(x))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_string()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Value>>()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == TOML_DATETIME_FIELD {
                let d: String = map.next_value()?;
                return Ok(Value::Datetime(d));
            }
            entries.push((key, map.next_value::<Spanned<Value>>()?));
        }
        Ok(Value::Table(entries))
    }
}
