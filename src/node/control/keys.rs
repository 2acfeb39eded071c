//! The control endpoint's key file: the credentials the operator issued,
//! one `[[tenant]]` each, with its quotas (docs/INTERFACE.md, "Jobs on
//! demand").
//!
//! ```toml
//! [[tenant]]
//! name = "training"          # what requests name in `tenant`
//! key = "64 hex digits"      # 32 random bytes: `aggbox keygen`
//! jobs = 4                   # live jobs at once (default 4)
//! workers = 64               # workers over its live jobs (default 64)
//! revoked = false            # true: every request is refused
//! ```
//!
//! The file must be readable by its owner only (mode 0600 or stricter):
//! anyone who can read a key can act as its tenant.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::Deserialize;

/// Bytes of a key, at least (the HMAC's own output size).
pub const MIN_KEY_BYTES: usize = 32;
/// A tenant's live jobs when its entry does not say.
pub const DEFAULT_TENANT_JOBS: u32 = 4;
/// A tenant's workers over its live jobs when its entry does not say.
pub const DEFAULT_TENANT_WORKERS: u32 = 64;

/// One credential and its quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    pub key: Vec<u8>,
    pub revoked: bool,
    /// Live jobs at once, at most.
    pub jobs: u32,
    /// Workers over its live jobs, at most.
    pub workers: u32,
}

/// Every tenant of the key file, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keys {
    pub tenants: BTreeMap<String, Tenant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tenant: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    key: String,
    #[serde(default)]
    revoked: bool,
    #[serde(default = "default_jobs")]
    jobs: u32,
    #[serde(default = "default_workers")]
    workers: u32,
}

fn default_jobs() -> u32 {
    DEFAULT_TENANT_JOBS
}

fn default_workers() -> u32 {
    DEFAULT_TENANT_WORKERS
}

impl Keys {
    /// The key file at `path`, which must be readable by its owner only.
    /// Errors name the file, and the line and key where there is one.
    pub fn load(path: &Path) -> Result<Keys, String> {
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
        if meta.mode() & 0o077 != 0 {
            return Err(format!(
                "{shown}: mode {:o}: a key file must be readable by its owner only (chmod 600 {shown})",
                meta.mode() & 0o777
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
        Keys::parse(&text, &shown.to_string())
    }

    /// The key file's `text` (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Keys, String> {
        let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        let file: File = toml::from_str(text).map_err(|e| match e.span() {
            Some(span) => format!("{origin}:{}: {}", line_of(span.start), e.message()),
            None => format!("{origin}: {}", e.message()),
        })?;
        let mut keys = Keys::default();
        for (i, t) in file.tenant.into_iter().enumerate() {
            // The line of the entry's value for `what` (the first
            // occurrence after the entry's name).
            let entry = text.match_indices(&format!("\"{}\"", t.name)).map(|(o, _)| o).next().unwrap_or(0);
            let at = |what: &str| {
                let needle = match what {
                    "key" => format!("\"{}\"", t.key),
                    "name" => format!("\"{}\"", t.name),
                    other => other.to_string(),
                };
                let line = text[entry..].find(&needle).map(|o| line_of(entry + o + 1));
                format!("{origin}:{}: tenant[{i}].{what}", line.map_or("?".into(), |l| l.to_string()))
            };
            if t.name.is_empty() || !t.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(format!("{}: a name of letters, digits, '-', '_' and '.'", at("name")));
            }
            let key = hex::decode(&t.key).map_err(|e| format!("{}: not hex: {e}", at("key")))?;
            if key.len() < MIN_KEY_BYTES {
                return Err(format!("{}: {} bytes; at least {MIN_KEY_BYTES}", at("key"), key.len()));
            }
            if t.jobs == 0 || t.workers == 0 {
                return Err(format!("{}: quotas are at least 1", at("jobs")));
            }
            let tenant = Tenant { name: t.name.clone(), key, revoked: t.revoked, jobs: t.jobs, workers: t.workers };
            if keys.tenants.insert(t.name.clone(), tenant).is_some() {
                return Err(format!("{}: tenant {} is named twice", at("name"), t.name));
            }
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn tenants_parse_with_defaults_and_bad_entries_name_their_line_and_key() {
        let k = Keys::parse(&format!("[[tenant]]\nname = \"a\"\nkey = \"{KEY}\"\n\n[[tenant]]\nname = \"b\"\nkey = \"{KEY}\"\nrevoked = true\njobs = 1\n"), "keys.toml").unwrap();
        assert_eq!(k.tenants["a"].jobs, DEFAULT_TENANT_JOBS);
        assert!(k.tenants["b"].revoked && k.tenants["b"].jobs == 1);
        let short = Keys::parse("[[tenant]]\nname = \"a\"\nkey = \"0011\"\n", "keys.toml").unwrap_err();
        assert!(short.starts_with("keys.toml:3: tenant[0].key: 2 bytes"), "{short}");
        let unknown = Keys::parse("[[tenant]]\nname = \"a\"\nkey = \"00\"\ncolour = 1\n", "keys.toml").unwrap_err();
        assert!(unknown.starts_with("keys.toml:4:") && unknown.contains("colour"), "{unknown}");
        let twice = Keys::parse(&format!("[[tenant]]\nname = \"a\"\nkey = \"{KEY}\"\n[[tenant]]\nname = \"a\"\nkey = \"{KEY}\"\n"), "k").unwrap_err();
        assert!(twice.contains("named twice"), "{twice}");
    }

    #[test]
    fn a_key_file_others_can_read_is_refused() {
        let dir = std::env::temp_dir().join(format!("aggbox-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys.toml");
        std::fs::write(&path, format!("[[tenant]]\nname = \"a\"\nkey = \"{KEY}\"\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Keys::load(&path).unwrap_err();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Keys::load(&path).unwrap().tenants.contains_key("a"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
