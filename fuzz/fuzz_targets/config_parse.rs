//! config::Config::parse on arbitrary text: never panics (every error is a
//! ConfigError with a one-line message).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match aggbox::config::Config::parse(text, "fuzz.toml") {
            Ok(cfg) => {
                assert!(cfg.jobs.len() <= 256);
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.trim_end().contains('\n'), "a config error is one line: {msg:?}");
            }
        }
    }
});
