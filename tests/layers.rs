//! The library's layers (src/lib.rs): every import in src/ points down.
//!
//! `wire` ← `config` ← `kernel` ← `node`, and `wire` ← `config` ←
//! `runtime`; `netif` (interface facts) imports nothing of the crate and
//! any layer above `config` may read it. Within the runtime, its public
//! API (`RUNTIME_API`: the communicators, their builder, the calls and the
//! I/O driver) sits on the runtime core: the engine and every module it is
//! built from, which must not import the API.
//!
//! Each library file is mapped to its layer by its path; every `use` (with
//! its `{}` groups, over several lines) and every `crate::` / `super::`
//! path in code is resolved to the module file it names, and that file's
//! layer must be one the importing layer may use. Unit tests
//! (`#[cfg(test)]` items and the files they declare) are consumers, as
//! tests/ is, and may use any layer; comments and strings are not code.
//! `src/bin/` and `src/testing/` (the benchmark and its testbed) and
//! `src/main.rs` use the public API from outside.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Runtime files above the core (paths under src/runtime/).
const RUNTIME_API: &[&str] = &[
    "mod.rs",
    "comm.rs",
    "control.rs",
    "calls.rs",
    "driver.rs",
    "striped.rs",
    "collective.rs",
    "api.rs",
    "ring.rs",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Layer {
    Wire,
    Netif,
    Config,
    Kernel,
    Node,
    RuntimeCore,
    RuntimeApi,
}

impl Layer {
    /// The layers a file of this one may import.
    fn may_use(self) -> &'static [Layer] {
        use Layer::*;
        match self {
            Wire => &[Wire],
            Netif => &[Netif],
            Config => &[Wire, Config],
            Kernel => &[Wire, Netif, Config, Kernel],
            Node => &[Wire, Netif, Config, Kernel, Node],
            RuntimeCore => &[Wire, Netif, Config, RuntimeCore],
            RuntimeApi => &[Wire, Netif, Config, RuntimeCore, RuntimeApi],
        }
    }
}

/// The layer of a library file (`rel`: its path under src/), `None` for
/// the crate root.
fn layer_of(rel: &str) -> Option<Layer> {
    let (top, rest) = rel.split_once('/').unwrap_or((rel, ""));
    Some(match top {
        "lib.rs" => return None,
        "wire" => Layer::Wire,
        "netif.rs" => Layer::Netif,
        "config.rs" | "config" => Layer::Config,
        "kernel" => Layer::Kernel,
        "node" => Layer::Node,
        "runtime" if RUNTIME_API.contains(&rest) => Layer::RuntimeApi,
        "runtime" => Layer::RuntimeCore,
        _ => panic!("src/{rel}: a library file of no layer (add it to tests/layers.rs)"),
    })
}

/// The module tree: module path (`["runtime", "engine"]`) → file under src/.
type Modules = BTreeMap<Vec<String>, String>;

fn module_of(rel: &str) -> Vec<String> {
    let stem = rel.strip_suffix(".rs").expect("a .rs file");
    let mut m: Vec<String> = stem.split('/').map(String::from).collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib")) {
        m.pop();
    }
    m
}

/// The library's files under `src`, by path relative to it.
fn library_files(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, src: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).expect("read src/") {
            let path = entry.expect("dir entry").path();
            let rel = path
                .strip_prefix(src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if path.is_dir() {
                if rel != "bin" && rel != "testing" && rel != "bpf" {
                    walk(&path, src, out);
                }
            } else if rel.ends_with(".rs") && rel != "main.rs" {
                out.insert(rel, std::fs::read_to_string(&path).expect("read source"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

// ---- a lexer that keeps what can name a module ----

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// Identifiers, `::` and punctuation of `src`, without comments, strings,
/// chars, lifetimes and numbers.
fn tokens(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(&c, i + 1);
        } else if (ch == 'r' || ch == 'b') && raw_string_start(&c, i).is_some() {
            let (hashes, body) = raw_string_start(&c, i).unwrap();
            i = body;
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            while i < c.len() && !c[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
        } else if ch == 'b' && c.get(i + 1) == Some(&'"') {
            i = skip_string(&c, i + 2);
        } else if ch == '\'' || (ch == 'b' && c.get(i + 1) == Some(&'\'')) {
            let q = if ch == 'b' { i + 1 } else { i };
            if c.get(q + 1) == Some(&'\\') {
                // An escaped char: up to the closing quote.
                i = q + 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(q + 2) == Some(&'\'') {
                i = q + 3;
            } else {
                // A lifetime or label: the quote, then its name as an ident
                // that names no module.
                i = q + 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            out.push(Tok::Ident(
                word.strip_prefix("r#").unwrap_or(&word).to_string(),
            ));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() && c[i] != '"' {
        i += if c[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// At `r"`, `r#"`, `br"`, `br#"`: the number of `#` and where the body starts.
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if c[j] == 'b' {
        j += 1;
    }
    if c.get(j) != Some(&'r') || (i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')) {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&h| h == '#').count();
    (c.get(j + hashes) == Some(&'"')).then_some((hashes, j + hashes + 1))
}

// ---- the paths a file names ----

/// A module path a file's code names, resolved from the crate root, with
/// the line-free text it was written as.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    path: Vec<String>,
    written: String,
}

/// Every crate path the code of a file at module `module` names, outside
/// `#[cfg(test)]` items; `children`: `#[cfg(test)] mod x;` files it declares
/// are added to it.
fn named_paths(
    module: &[String],
    src: &str,
    modules: &Modules,
    test_children: &mut BTreeSet<Vec<String>>,
) -> Vec<Named> {
    let t = tokens(src);
    let mut out = Vec::new();
    // Inline modules open at a brace depth: (name, depth).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut cfg_test = false;
    let mut i = 0;
    let here = |inline: &[(String, usize)]| -> Vec<String> {
        module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(n, _)| n.clone()))
            .collect()
    };
    while i < t.len() {
        match &t[i] {
            Tok::Punct('#')
                if t.get(i + 1) == Some(&Tok::Punct('['))
                    || t.get(i + 2) == Some(&Tok::Punct('[')) =>
            {
                let open = if t[i + 1] == Tok::Punct('[') {
                    i + 1
                } else {
                    i + 2
                };
                let close = matching(&t, open);
                let attr = &t[open + 1..close];
                if attr
                    == [
                        Tok::Ident("cfg".into()),
                        Tok::Punct('('),
                        Tok::Ident("test".into()),
                        Tok::Punct(')'),
                    ]
                {
                    cfg_test = true;
                }
                i = close + 1;
                continue;
            }
            _ if cfg_test => {
                // Skip the test-only item; note a test module's file.
                let mut j = i;
                while matches!(t.get(j), Some(Tok::Ident(w)) if w == "pub")
                    || t.get(j) == Some(&Tok::Punct('('))
                {
                    j = if t[j] == Tok::Punct('(') {
                        matching(&t, j) + 1
                    } else {
                        j + 1
                    };
                }
                if let (Some(Tok::Ident(m)), Some(Tok::Ident(name)), Some(Tok::Punct(';'))) =
                    (t.get(j), t.get(j + 1), t.get(j + 2))
                {
                    if m == "mod" {
                        let mut child = here(&inline);
                        child.push(name.clone());
                        test_children.insert(child);
                    }
                }
                i = end_of_item(&t, i);
                cfg_test = false;
                continue;
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) =
                    (t.get(i + 1), t.get(i + 2))
                {
                    depth += 1;
                    inline.push((name.clone(), depth));
                    i += 3;
                    continue;
                }
            }
            Tok::Ident(w) if w == "use" => {
                let end = (i..t.len())
                    .find(|&j| t[j] == Tok::Punct(';'))
                    .unwrap_or(t.len());
                let mut trees = Vec::new();
                use_tree(&t[i + 1..end], &mut Vec::new(), &mut trees);
                let at = here(&inline);
                for segs in trees {
                    if let Some(path) = resolve(&at, &segs, modules, true) {
                        out.push(Named {
                            path,
                            written: segs.join("::"),
                        });
                    }
                }
                i = end + 1;
                continue;
            }
            Tok::Ident(w)
                if (w == "crate" || w == "super") && t.get(i + 1) == Some(&Tok::PathSep) =>
            {
                let preceded_by_sep = i > 0 && t[i - 1] == Tok::PathSep;
                let mut segs = Vec::new();
                let mut j = i;
                while let Some(Tok::Ident(s)) = t.get(j) {
                    segs.push(s.clone());
                    if t.get(j + 1) != Some(&Tok::PathSep) {
                        break;
                    }
                    j += 2;
                }
                if !preceded_by_sep {
                    if let Some(path) = resolve(&here(&inline), &segs, modules, false) {
                        out.push(Named {
                            path,
                            written: segs.join("::"),
                        });
                    }
                }
                i = j + 1;
                continue;
            }
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The index of the bracket closing the one at `open`.
fn matching(t: &[Tok], open: usize) -> usize {
    let mut depth = 0i32;
    for (j, tok) in t.iter().enumerate().skip(open) {
        match tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    t.len() - 1
}

/// Past the item starting at `i`: its `;`, or its first top-level block
/// (and a `;` right after it).
fn end_of_item(t: &[Tok], mut i: usize) -> usize {
    while i < t.len() {
        match t[i] {
            Tok::Punct(';') => return i + 1,
            Tok::Punct('{') => {
                let close = matching(t, i);
                return if t.get(close + 1) == Some(&Tok::Punct(';')) {
                    close + 2
                } else {
                    close + 1
                };
            }
            Tok::Punct('(' | '[') => i = matching(t, i) + 1,
            _ => i += 1,
        }
    }
    i
}

/// Expands a use tree (`a::{b::c, d as e, self}`) into its paths.
fn use_tree(t: &[Tok], prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut i = 0;
    let base = prefix.len();
    while i < t.len() {
        match &t[i] {
            Tok::Ident(w) if w == "as" => i += 2,
            Tok::Ident(w) if w == "self" && i == 0 && base > 0 => {
                out.push(prefix.clone());
                i += 1;
            }
            Tok::Ident(w) => {
                prefix.push(w.clone());
                if t.get(i + 1) != Some(&Tok::PathSep) {
                    out.push(prefix.clone());
                }
                i += 1;
            }
            Tok::PathSep => i += 1,
            Tok::Punct('*') => {
                out.push(prefix.clone());
                i += 1;
            }
            Tok::Punct('{') => {
                let close = matching(t, i);
                // Each comma-separated subtree at this level.
                let inner = &t[i + 1..close];
                let mut start = 0;
                let mut depth = 0;
                for (j, tok) in inner.iter().enumerate() {
                    match tok {
                        Tok::Punct('{') => depth += 1,
                        Tok::Punct('}') => depth -= 1,
                        Tok::Punct(',') if depth == 0 => {
                            use_tree(&inner[start..j], prefix, out);
                            start = j + 1;
                        }
                        _ => {}
                    }
                }
                use_tree(&inner[start..], prefix, out);
                i = close + 1;
            }
            Tok::Punct(',') => {
                prefix.truncate(base);
                i += 1;
            }
            _ => i += 1,
        }
    }
    prefix.truncate(base);
}

/// The crate-rooted path that `segs`, written in module `at`, names; `None`
/// for another crate's. `in_use`: a `use` path whose first segment may be a
/// child module of `at`.
fn resolve(at: &[String], segs: &[String], modules: &Modules, in_use: bool) -> Option<Vec<String>> {
    let mut path: Vec<String> = at.to_vec();
    let mut rest = segs;
    match segs.first().map(String::as_str) {
        Some("crate") => {
            path.clear();
            rest = &segs[1..];
        }
        Some("self") => rest = &segs[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                path.pop().expect("super:: above the crate root");
                rest = &rest[1..];
            }
        }
        Some(first) if in_use => {
            let mut child = at.to_vec();
            child.push(first.to_string());
            if !modules.contains_key(&child) {
                return None;
            }
        }
        _ => return None,
    }
    path.extend(rest.iter().cloned());
    Some(path)
}

/// The file the longest module prefix of `path` is.
fn file_of<'a>(path: &[String], modules: &'a Modules) -> Option<&'a str> {
    (0..=path.len())
        .rev()
        .find_map(|n| modules.get(&path[..n]).map(String::as_str))
}

/// What is wrong with the imports of file `rel` (under src/) holding `src`.
fn violations(
    rel: &str,
    src: &str,
    modules: &Modules,
    test_children: &mut BTreeSet<Vec<String>>,
) -> Vec<String> {
    let module = module_of(rel);
    let Some(from) = layer_of(rel) else {
        return Vec::new();
    };
    let mut bad = Vec::new();
    for named in named_paths(&module, src, modules, test_children) {
        let Some(target) = file_of(&named.path, modules) else {
            continue;
        };
        let Some(to) = layer_of(target) else {
            continue;
        };
        if !from.may_use().contains(&to) {
            bad.push(format!(
                "src/{rel} ({from:?}) imports {} = src/{target} ({to:?})",
                named.written
            ));
        }
    }
    bad
}

fn library() -> (BTreeMap<String, String>, Modules) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = library_files(&src);
    let modules = files
        .keys()
        .map(|rel| (module_of(rel), rel.clone()))
        .collect();
    (files, modules)
}

#[test]
fn every_import_in_the_library_points_down() {
    let (files, modules) = library();
    assert!(
        files.len() > 50,
        "src/ holds the library ({} files found)",
        files.len()
    );
    // Parents first, so a `#[cfg(test)] mod tests;` is known before its file.
    let mut order: Vec<&String> = files.keys().collect();
    order.sort_by_key(|rel| module_of(rel).len());
    let mut test_children = BTreeSet::new();
    let mut bad = Vec::new();
    let mut checked = 0;
    for rel in order {
        let module = module_of(rel);
        if (1..=module.len()).any(|n| test_children.contains(&module[..n])) {
            continue;
        }
        checked += 1;
        bad.extend(violations(rel, &files[rel], &modules, &mut test_children));
    }
    let engine_tests: Vec<String> = ["runtime", "engine", "tests"].map(String::from).to_vec();
    assert!(
        test_children.contains(&engine_tests),
        "the unit-test files were recognised: {test_children:?}"
    );
    assert!(checked > 50, "{checked} files checked");
    assert!(
        bad.is_empty(),
        "imports that point up or across:\n{}",
        bad.join("\n")
    );
}

// ---- the checker itself ----

fn check(rel: &str, src: &str) -> Vec<String> {
    let (_, modules) = library();
    violations(rel, src, &modules, &mut BTreeSet::new())
}

#[test]
fn upward_imports_are_found_in_every_form() {
    // A group, over several lines, with a nested group and a rename.
    let bad = check(
        "runtime/fragment.rs",
        "use crate::{\n    wire::abi::{self, Op},\n    kernel::{maps as m, xdp},\n};\n",
    );
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        bad[0].contains("kernel::maps = src/kernel/maps.rs (Kernel)"),
        "{bad:?}"
    );
    // A path in an expression.
    let bad = check(
        "kernel/tc.rs",
        "fn f() { let x = crate::node::ring::STATS_MAP; }",
    );
    assert_eq!(bad.len(), 1, "{bad:?}");
    // The engine and the API above it: super::super, a re-exported item of
    // runtime/mod.rs, a child module named as `use`'s first segment.
    assert_eq!(
        check(
            "runtime/engine/round.rs",
            "use super::super::comm::CommunicatorBuilder;"
        )
        .len(),
        1
    );
    assert_eq!(
        check(
            "runtime/engine/round.rs",
            "fn f() -> crate::runtime::CommError { todo!() }"
        )
        .len(),
        1
    );
    assert_eq!(
        check("runtime/mod.rs", "pub use comm::Communicator;").len(),
        0
    );
    assert_eq!(
        check("runtime/backend.rs", "use crate::runtime::calls::Request;").len(),
        1
    );
    // wire imports no other layer; config only wire.
    assert_eq!(check("wire/abi.rs", "use crate::config::Config;").len(), 1);
    assert_eq!(
        check("config.rs", "use crate::netif; use crate::wire::abi;").len(),
        1
    );
    // node and runtime never import each other.
    assert_eq!(
        check("node/mod.rs", "use crate::runtime::fragment::Coverage;").len(),
        1
    );
    assert_eq!(
        check("runtime/ring.rs", "use crate::node::ring::RingServer;").len(),
        1
    );
}

#[test]
fn downward_imports_tests_comments_and_strings_pass() {
    let ok = "//! See [`crate::node::ring`].\n\
              use crate::wire::abi;\n\
              use std::sync::Arc;\n\
              pub(crate) fn f(_: Arc<u8>) -> &'static str { let _c = '{'; \"crate::node::x\" }\n\
              /* crate::kernel::xdp */\n\
              #[cfg(test)]\n\
              mod tests {\n    use super::*;\n    use crate::node::ring::RingServer;\n}\n\
              fn g() { crate::runtime::fragment::fragments(1, 1); }\n";
    assert_eq!(check("runtime/fragment.rs", ok), Vec::<String>::new());
    // After a test module closes, code is checked again.
    let after = "#[cfg(test)]\nmod tests { fn x() { let _ = '}'; } }\nuse crate::kernel::maps;\n";
    assert_eq!(check("runtime/fragment.rs", after).len(), 1);
    // A non-test inline module: super:: is resolved from inside it (from
    // engine/mod.rs's `inner`, super::super is runtime; from round.rs's, it
    // is the engine, which has no `comm`).
    let inline = "mod inner {\n    use super::super::comm::Communicator;\n}\n";
    assert_eq!(check("runtime/engine/mod.rs", inline).len(), 1);
    assert_eq!(check("runtime/engine/round.rs", inline).len(), 0);
}
