//! Proves that `src/wire/abi.rs` and `include/aggbox/abi.h` agree: every struct
//! size, every field offset and size, and every constant, compiled from the C
//! header with the host C compiler and compared with the Rust mirror.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

use aggbox::wire::abi::{self, DropReason, Outcome};

/// Bit `op` set for every op that has `property` (abi.h's AGGBOX_OP_*_MASK).
fn op_mask(property: fn(abi::Op) -> bool) -> i64 {
    abi::Op::ALL.iter().filter(|&&op| property(op)).map(|&op| 1i64 << op as u8).sum()
}

/// Constants compared by value: (C expression, Rust value).
fn constants() -> Vec<(String, i64)> {
    let mut out: Vec<(String, i64)> = vec![
        ("AGGBOX_MAGIC_AGG".into(), abi::MAGIC_AGG as i64),
        ("AGGBOX_MAGIC_BCAST".into(), abi::MAGIC_BCAST as i64),
        ("AGGBOX_MAGIC_ACK".into(), abi::MAGIC_ACK as i64),
        ("AGGBOX_MAGIC_POSITION".into(), abi::MAGIC_POSITION as i64),
        ("AGGBOX_POSITION_F_REPLY".into(), abi::POSITION_F_REPLY as i64),
        ("AGGBOX_POSITION_F_FRESH".into(), abi::POSITION_F_FRESH as i64),
        ("AGGBOX_POSITION_F_KNOWN".into(), abi::POSITION_F_KNOWN as i64),
        ("AGGBOX_POSITION_LEN".into(), abi::POSITION_LEN as i64),
        ("AGGBOX_AGG_F_LAST_FRAGMENT".into(), abi::AGG_F_LAST_FRAGMENT as i64),
        ("AGGBOX_AGG_F_RESULT".into(), abi::AGG_F_RESULT as i64),
        ("AGGBOX_AGG_F_OVERFLOW".into(), abi::AGG_F_OVERFLOW as i64),
        ("AGGBOX_AGG_F_FLOAT32".into(), abi::AGG_F_FLOAT32 as i64),
        ("AGGBOX_AGG_F_KNOWN".into(), abi::AGG_F_KNOWN as i64),
        ("AGGBOX_AGG_F_CARRIED".into(), abi::AGG_F_CARRIED as i64),
        ("AGGBOX_RESULT_RANK".into(), abi::RESULT_RANK as i64),
        ("AGGBOX_BCAST_F_FORWARD".into(), abi::BCAST_F_FORWARD as i64),
        ("AGGBOX_BCAST_F_KNOWN".into(), abi::BCAST_F_KNOWN as i64),
        ("AGGBOX_BCAST_SUBHDR_OVERFLOW".into(), abi::BCAST_SUBHDR_OVERFLOW as i64),
        ("AGGBOX_ACK_KIND_AGG".into(), abi::ACK_KIND_AGG as i64),
        ("AGGBOX_ACK_KIND_BCAST".into(), abi::ACK_KIND_BCAST as i64),
        ("AGGBOX_ACK_F_FINAL".into(), abi::ACK_F_FINAL as i64),
        ("AGGBOX_ACK_F_KNOWN".into(), abi::ACK_F_KNOWN as i64),
        ("AGGBOX_ACK_MAX_BITS".into(), abi::ACK_MAX_BITS as i64),
        ("AGGBOX_MAX_JOBS".into(), abi::MAX_JOBS as i64),
        ("AGGBOX_MAX_RANKS".into(), abi::MAX_RANKS as i64),
        ("AGGBOX_FAMILY_NONE".into(), abi::FAMILY_NONE as i64),
        ("AGGBOX_FAMILY_IPV4".into(), abi::FAMILY_IPV4 as i64),
        ("AGGBOX_FAMILY_IPV6".into(), abi::FAMILY_IPV6 as i64),
        ("AGGBOX_JOB_F_USERSPACE_ONLY".into(), abi::JOB_F_USERSPACE_ONLY as i64),
        ("AGGBOX_JOB_F_HAS_PARENT".into(), abi::JOB_F_HAS_PARENT as i64),
        ("AGGBOX_JOB_F_NO_FAST".into(), abi::JOB_F_NO_FAST as i64),
        ("AGGBOX_NO_GROUP".into(), abi::NO_GROUP as i64),
        ("AGGBOX_OUTCOME_COUNT_OK".into(), abi::OUTCOME_COUNT_OK as i64),
        ("AGGBOX_STATS_DROP_BASE".into(), abi::STATS_DROP_BASE as i64),
        ("AGGBOX_STATS_MAX".into(), abi::STATS_MAX as i64),
        ("AGGBOX_OP_LAST".into(), abi::Op::ALL[abi::Op::ALL.len() - 1] as i64),
        ("AGGBOX_OPS".into(), abi::Op::ALL.len() as i64),
        (
            "AGGBOX_OP_LAST_KERNEL".into(),
            abi::Op::ALL.into_iter().filter(|op| op.runs_in_kernel()).max_by_key(|&op| op as u8).unwrap() as i64,
        ),
        ("AGGBOX_OP_FLOATS_MASK".into(), op_mask(abi::Op::valid_on_floats)),
        ("AGGBOX_OP_KERNEL_MASK".into(), op_mask(abi::Op::runs_in_kernel)),
        ("AGGBOX_OP_RING_MASK".into(), op_mask(abi::Op::runs_in_ring)),
        ("AGGBOX_MAX_QUEUES".into(), abi::MAX_QUEUES as i64),
        ("AGGBOX_XSK_RX_HEADROOM".into(), abi::XSK_RX_HEADROOM as i64),
        ("AGGBOX_MAX_ELEMS".into(), abi::MAX_ELEMS as i64),
        ("AGGBOX_CHUNK_ELEMS".into(), abi::CHUNK_ELEMS as i64),
        ("AGGBOX_PROG_CHUNKS".into(), abi::PROG_CHUNKS as i64),
        ("AGGBOX_LINEAR_MAX_CHUNKS".into(), abi::LINEAR_MAX_CHUNKS as i64),
        ("AGGBOX_LINEAR_MAX_ELEMS".into(), abi::LINEAR_MAX_ELEMS as i64),
        ("AGGBOX_MAX_SLOTS".into(), abi::MAX_SLOTS as i64),
        ("AGGBOX_MAX_BLOCKS".into(), abi::MAX_BLOCKS as i64),
        ("AGGBOX_FAST_SLOTS".into(), abi::FAST_SLOTS as i64),
        ("AGGBOX_FAST_JOB_SLOTS".into(), abi::FAST_JOB_SLOTS as i64),
        ("AGGBOX_FAST_ELEMS".into(), abi::FAST_ELEMS as i64),
        ("AGGBOX_FAST_GRANULE".into(), abi::FAST_GRANULE as i64),
        ("AGGBOX_FAST_JOINED".into(), abi::FAST_JOINED as i64),
        ("AGGBOX_FAST_TAKEN".into(), abi::FAST_TAKEN as i64),
        ("AGGBOX_FAST_BUSY".into(), abi::FAST_BUSY as i64),
        ("AGGBOX_FAST_ABORTED".into(), abi::FAST_ABORTED as i64),
        ("AGGBOX_FAST_RELEASED".into(), abi::FAST_RELEASED as i64),
        ("AGGBOX_FAST_CHECKED".into(), abi::FAST_CHECKED as i64),
        ("AGGBOX_FAST_STAT_MAX".into(), abi::FAST_STAT_MAX as i64),
        ("AGGBOX_MAX_OWNERS".into(), abi::MAX_OWNERS as i64),
        ("AGGBOX_HANDOFF_MAX".into(), abi::HANDOFF_MAX as i64),
        ("AGGBOX_HANDOFF_OP".into(), abi::HandoffReason::Op as i64),
        ("AGGBOX_HANDOFF_FLOAT32".into(), abi::HandoffReason::Float32 as i64),
        ("AGGBOX_HANDOFF_USERSPACE_ONLY".into(), abi::HandoffReason::UserspaceOnly as i64),
        ("AGGBOX_HANDOFF_POOL_FULL".into(), abi::HandoffReason::PoolFull as i64),
        ("AGGBOX_HANDOFF_OVERLOAD".into(), abi::HandoffReason::Overload as i64),
        ("AGGBOX_HANDOFF_OWNED".into(), abi::HandoffReason::Owned as i64),
        ("AGGBOX_OWNER_KERNEL".into(), abi::OWNER_KERNEL as i64),
        ("AGGBOX_OWNER_USERSPACE".into(), abi::OWNER_USERSPACE as i64),
        ("AGGBOX_HANDOFF_F_OVERLOAD".into(), abi::HANDOFF_F_OVERLOAD as i64),
        ("AGGBOX_BCAST_MAX_DESTS".into(), abi::BCAST_MAX_DESTS as i64),
        ("AGGBOX_BCAST_MAX_GROUPS".into(), abi::BCAST_MAX_GROUPS as i64),
        ("AGGBOX_BCAST_MAX_NEIGH".into(), abi::BCAST_MAX_NEIGH as i64),
        ("AGGBOX_BCAST_MAX_HOPS".into(), abi::BCAST_MAX_HOPS as i64),
        ("AGGBOX_BCAST_DEFAULT_NEIGH_TTL_S".into(), abi::BCAST_DEFAULT_NEIGH_TTL_S as i64),
        ("AGGBOX_BCAST_MARK_COPY".into(), abi::BCAST_MARK_COPY as i64),
        ("AGGBOX_BCAST_MARK_NEIGH".into(), abi::BCAST_MARK_NEIGH as i64),
        ("AGGBOX_BCAST_MARK_DONE".into(), abi::BCAST_MARK_DONE as i64),
        ("AGGBOX_BCAST_PORT_ANY".into(), abi::BCAST_PORT_ANY as i64),
        ("AGGBOX_NEIGH_F_STALE".into(), abi::NEIGH_F_STALE as i64),
        ("AGGBOX_BCAST_STAT_MAX".into(), abi::BCAST_STAT_MAX as i64),
        ("AGGBOX_MAX_RESULT_ROUTES".into(), abi::MAX_RESULT_ROUTES as i64),
        ("AGGBOX_ROUTE_F_GROUP".into(), abi::ROUTE_F_GROUP as i64),
        ("AGGBOX_ROUTE_F_PARENT".into(), abi::ROUTE_F_PARENT as i64),
        ("AGGBOX_ROUTE_F_KNOWN".into(), abi::ROUTE_F_KNOWN as i64),
        ("AGGBOX_MAGIC_RING".into(), abi::MAGIC_RING as i64),
        ("AGGBOX_RING_PARTIAL".into(), abi::RING_PARTIAL as i64),
        ("AGGBOX_RING_FINAL".into(), abi::RING_FINAL as i64),
        ("AGGBOX_RING_NACK".into(), abi::RING_NACK as i64),
        ("AGGBOX_RING_KICK".into(), abi::RING_KICK as i64),
        ("AGGBOX_RING_KIND_LAST".into(), abi::RING_KIND_LAST as i64),
        ("AGGBOX_RING_F_SATURATED".into(), abi::RING_F_SATURATED as i64),
        ("AGGBOX_RING_F_NACK_FINAL".into(), abi::RING_F_NACK_FINAL as i64),
        ("AGGBOX_RING_F_KNOWN".into(), abi::RING_F_KNOWN as i64),
        ("AGGBOX_MAX_RINGS".into(), abi::MAX_RINGS as i64),
        ("AGGBOX_RING_MAX_FRAG_ELEMS".into(), abi::RING_MAX_FRAG_ELEMS as i64),
        ("AGGBOX_RING_READY".into(), abi::RING_READY as i64),
        ("AGGBOX_RING_STAT_MAX".into(), abi::RING_STAT_MAX as i64),
        ("AGGBOX_CALL_RING".into(), abi::CALL_RING as i64),
        ("AGGBOX_CALL_MAX".into(), abi::CALL_MAX as i64),
        ("AGGBOX_DROP_FIRST".into(), DropReason::ALL[0] as i64),
        ("AGGBOX_DROP_LAST".into(), DropReason::ALL[DropReason::ALL.len() - 1] as i64),
    ];
    for op in abi::Op::ALL {
        out.push((format!("AGGBOX_OP_{}", op.name()), op as i64));
    }
    for reason in DropReason::ALL {
        // The C enumerator names follow the Rust variant names in SCREAMING case.
        let name = format!("{reason:?}");
        let mut screaming = String::new();
        for (i, ch) in name.chars().enumerate() {
            if ch.is_uppercase() && i > 0 {
                screaming.push('_');
            }
            screaming.push(ch.to_ascii_uppercase());
        }
        let c_name = match reason {
            DropReason::IpFragment => "AGGBOX_DROP_IP_OPTIONS_OR_FRAGMENT".to_string(),
            _ => format!("AGGBOX_DROP_{screaming}"),
        };
        out.push((c_name, reason as i64));
    }
    for stat in abi::BcastStat::ALL {
        out.push((format!("AGGBOX_BCAST_{}", stat.label().to_uppercase()), stat as i64));
    }
    for stat in abi::RingStat::ALL {
        out.push((format!("AGGBOX_RING_{}", stat.label().to_uppercase()), stat as i64));
    }
    for outcome in Outcome::ALL {
        out.push((format!("AGGBOX_OUTCOME_{}", outcome.label().to_uppercase()), outcome as i64));
    }
    out
}

#[test]
fn rust_mirror_matches_c_header_field_by_field() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = tempdir();
    let src = dir.join("layout.c");
    let bin = dir.join("layout");

    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <aggbox/abi.h>\n\
         #define FIELD(s, f) printf(\"%s %s %zu %zu\\n\", #s, #f, offsetof(struct s, f), sizeof(((struct s *)0)->f))\n\
         int main(void) {\n",
    );
    let layout = abi::layout();
    for (strukt, field, _, _) in &layout {
        if *field == "sizeof" {
            c.push_str(&format!("printf(\"{strukt} sizeof 0 %zu\\n\", sizeof(struct {strukt}));\n"));
        } else {
            c.push_str(&format!("FIELD({strukt}, {field});\n"));
        }
    }
    for (name, _) in constants() {
        c.push_str(&format!("printf(\"const {name} %lld\\n\", (long long)({name}));\n"));
    }
    c.push_str("return 0;\n}\n");
    fs::write(&src, c).expect("write layout.c");

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(root.join("include"))
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (needed to check the ABI): {e}"));
    assert!(status.success(), "compiling the ABI layout probe against include/aggbox/abi.h failed");
    let out = Command::new(&bin).output().expect("run layout probe");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf8");

    let mut c_fields: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
    let mut c_consts: BTreeMap<String, i64> = BTreeMap::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts[0] == "const" {
            c_consts.insert(parts[1].to_string(), parts[2].parse().expect("const value"));
        } else {
            c_fields.insert(
                (parts[0].to_string(), parts[1].to_string()),
                (parts[2].parse().expect("offset"), parts[3].parse().expect("size")),
            );
        }
    }

    let mut mismatches = Vec::new();
    for (strukt, field, offset, size) in layout {
        let c = c_fields[&(strukt.to_string(), field.to_string())];
        if c != (offset, size) {
            mismatches.push(format!("struct {strukt}.{field}: C (offset {}, size {}) vs Rust (offset {offset}, size {size})", c.0, c.1));
        }
    }
    for (name, value) in constants() {
        let c = c_consts[&name];
        if c != value {
            mismatches.push(format!("{name}: C {c} vs Rust {value}"));
        }
    }
    assert!(mismatches.is_empty(), "ABI drift between abi.h and abi.rs:\n{}", mismatches.join("\n"));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn every_drop_reason_has_its_own_stats_slot() {
    let mut seen = std::collections::BTreeSet::new();
    for reason in DropReason::ALL {
        let index = reason.stats_index();
        assert!(index >= abi::STATS_DROP_BASE && index < abi::STATS_MAX, "{reason:?} index {index}");
        assert!(seen.insert(index), "{reason:?} shares a stats slot");
    }
    for outcome in Outcome::ALL {
        assert!((outcome as u32) < abi::STATS_DROP_BASE);
    }
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("aggbox-abi-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// The stubs' `OpName` lists the table's names (and "mean"), in order.
#[test]
fn the_python_stubs_name_the_table_ops() {
    let stubs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/python/aggbox/_aggbox.pyi")).expect("stubs");
    let line = stubs.lines().find(|l| l.starts_with("OpName = Literal[")).expect("an OpName line");
    let names: Vec<&str> = line
        .trim_start_matches("OpName = Literal[")
        .trim_end_matches(']')
        .split(',')
        .map(|n| n.trim().trim_matches('"'))
        .collect();
    let mut want: Vec<&str> = abi::Op::NAMES.to_vec();
    want.push("mean");
    assert_eq!(names, want, "python/aggbox/_aggbox.pyi OpName vs include/aggbox/ops.def");
    for (op, name) in abi::Op::ALL.into_iter().zip(abi::Op::NAMES) {
        assert_eq!(abi::Op::from_name(name), Some(op));
        assert_eq!(abi::Op::from_name(&name.to_ascii_uppercase()), Some(op));
    }
}
