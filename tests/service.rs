//! The systemd unit (`deploy/aggbox@.service`) and the Kubernetes manifest
//! (`deploy/kubernetes/aggbox.yaml`), checked without systemd or a cluster:
//!
//! - `systemd-analyze verify` accepts the unit without a warning, and
//!   `systemd-analyze security --offline` rates its exposure OK-to-medium;
//! - a systemd-free harness runs the unit's own `ExecStart`, `ExecReload`
//!   (`kill -HUP $MAINPID`), `KillSignal` and `ExecStopPost` lines, `%i`
//!   expanded, in a testbed namespace: the node attaches, a reload adds a
//!   job, SIGTERM detaches and exits 0, and after a `kill -9` the
//!   `ExecStopPost` line removes everything, the XDP program included;
//! - the DaemonSet has what attach needs (host network, the bpffs host
//!   mount, the capabilities, the metrics port, the TOML from a ConfigMap
//!   that `aggbox` itself parses).
//!
//! The harness needs root: `sudo -E cargo test --test service`.

#[path = "../src/testing/testbed.rs"]
#[allow(dead_code)]
mod testbed;

use std::path::{Path, PathBuf};
use std::process::Command;

use testbed::{Testbed, TestbedConfig};

const UNIT: &str = "deploy/aggbox@.service";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `KEY=value` lines of the unit's `[Service]` section, `%i` = `iface`,
/// the installed paths replaced by the built binary and `config`.
fn service_lines(iface: &str, config: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo(UNIT)).expect("read the unit");
    let mut in_service = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_service = line == "[Service]";
            continue;
        }
        if !in_service || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line.split_once('=').expect("KEY=value");
        let value = value
            .replace("%i", iface)
            .replace("/usr/local/bin/aggbox", env!("CARGO_BIN_EXE_aggbox"))
            .replace("/etc/aggbox/aggbox.toml", &config.display().to_string());
        out.push((key.to_string(), value));
    }
    out
}

fn line<'a>(lines: &'a [(String, String)], key: &str) -> &'a str {
    &lines.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{UNIT} has no {key}")).1
}

fn systemd_analyze(args: &[&str], dir: &Path) -> (bool, String, String) {
    let out = Command::new("systemd-analyze")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("systemd-analyze (Debian package systemd): {e}"));
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_unit_verifies_and_is_hardened() {
    let dir = std::env::temp_dir().join(format!("aggbox-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // verify checks that ExecStart's binary exists: point it at the build.
    let text = std::fs::read_to_string(repo(UNIT)).unwrap().replace("/usr/local/bin/aggbox", env!("CARGO_BIN_EXE_aggbox"));
    std::fs::write(dir.join("aggbox@.service"), text).unwrap();
    let (ok, _, err) = systemd_analyze(&["verify", "--man=no", "./aggbox@eth0.service"], &dir);
    assert!(ok && err.trim().is_empty(), "systemd-analyze verify: {err}");
    let (_, out, err) = systemd_analyze(&["security", "--offline=true", "./aggbox@eth0.service"], &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!("{out}{err}");
    let exposure: f64 = text
        .lines()
        .find_map(|l| l.split("Overall exposure level for aggbox@eth0.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    // 10 is a service with no sandboxing; the capabilities BPF needs
    // (CAP_SYS_ADMIN, CAP_NET_ADMIN) keep it above the fully sandboxed end.
    assert!(exposure <= 5.5, "exposure {exposure}:\n{text}");
    let lines = service_lines("eth0", Path::new("/etc/aggbox/aggbox.toml"));
    for (key, want) in [("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"), ("Restart", "on-failure"), ("KillSignal", "SIGTERM")] {
        assert_eq!(line(&lines, key), want, "{key}");
    }
    let caps = line(&lines, "CapabilityBoundingSet");
    assert!(!caps.contains("CAP_SYS_MODULE") && !caps.contains("CAP_SYS_PTRACE") && caps.contains("CAP_BPF"), "{caps}");
}

#[test]
fn the_units_own_lines_attach_reload_stop_and_clean_up_after_a_crash() {
    assert!(nix::unistd::geteuid().is_root(), "tests/service.rs needs root: `sudo -E cargo test --test service`");
    let tb = Testbed::up(TestbedConfig { hosts: 2, ..Default::default() }).expect("testbed");
    let work = std::env::temp_dir().join(format!("aggbox-service-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let config = work.join("aggbox.toml");
    let job = |id: u16| {
        format!(
            "[[job]]\nid = {id}\nport = {}\nworkers = [\"{}\"]\nresult_port = {}\n\n",
            7000 + 10 * id,
            tb.host(1).addr,
            7001 + 10 * id
        )
    };
    let v1 = format!("[node]\nmetrics = \"off\"\n\n{}", job(1));
    let v2 = format!("{v1}{}", job(2));
    std::fs::write(&config, &v1).unwrap();
    std::fs::write(work.join("v2.toml"), &v2).unwrap();
    let lines = service_lines("eth0", &config);
    let (start, reload, stop_post) = (line(&lines, "ExecStart"), line(&lines, "ExecReload"), line(&lines, "ExecStopPost"));
    let kill = format!("kill -{}", line(&lines, "KillSignal").trim_start_matches("SIG"));
    let aggbox = env!("CARGO_BIN_EXE_aggbox");
    // One shell, so that every line sees the bpffs the first one mounts
    // (each `ip netns exec` has a mount namespace of its own).
    let script = format!(
        r#"
W={work}
wait_for() {{ i=0; until grep -q "$2" "$1" 2>/dev/null; do i=$((i+1)); [ $i -gt 400 ] && {{ echo "timeout waiting for $2 in $1"; return 1; }}; sleep 0.05; done; }}
# ExecStart, as systemd runs it (Type=simple: MAINPID is that process).
{start} >$W/out1 2>$W/err1 &
MAINPID=$!
wait_for $W/out1 "attached to eth0" || exit 10
{aggbox} status eth0 >$W/status1
# systemctl reload: ExecReload.
cp $W/v2.toml {config}
{reload}
wait_for $W/err1 "reloaded" || exit 11
{aggbox} status eth0 >$W/status2
# systemctl stop: KillSignal, then ExecStopPost.
{kill} $MAINPID
wait $MAINPID
echo $? >$W/rc1
{stop_post} >$W/post1 2>&1
# A crash: SIGKILL leaves the pins and the XDP link; ExecStopPost removes them.
{start} >$W/out2 2>$W/err2 &
MAINPID=$!
wait_for $W/out2 "attached to eth0" || exit 12
ip -details link show eth0 >$W/link_attached
kill -9 $MAINPID
wait $MAINPID
{stop_post} >$W/post2 2>&1
ip -details link show eth0 >$W/link_after
{aggbox} status eth0 >$W/status3 2>&1
exit 0
"#,
        work = work.display(),
        config = config.display(),
    );
    let out = Command::new("ip")
        .args(["netns", "exec", &tb.host(0).netns, "sh", "-c", &script])
        .output()
        .expect("run the harness");
    let read = |name: &str| std::fs::read_to_string(work.join(name)).unwrap_or_default();
    let all = || {
        ["out1", "err1", "status1", "status2", "rc1", "post1", "out2", "err2", "post2", "link_attached", "link_after", "status3"]
            .iter()
            .map(|n| format!("--- {n}\n{}", read(n)))
            .collect::<String>()
    };
    assert!(out.status.success(), "harness: {out:?}\n{}", all());
    assert!(read("status1").contains("job     1") && !read("status1").contains("job     2"), "{}", all());
    assert!(read("err1").contains("jobs added: 2;"), "{}", all());
    assert!(read("status2").contains("job     1") && read("status2").contains("job     2"), "{}", all());
    assert_eq!(read("rc1").trim(), "0", "SIGTERM: a clean exit\n{}", all());
    assert!(read("out1").contains("aggbox: detached from eth0"), "{}", all());
    assert!(read("post1").contains("nothing attached to eth0"), "ExecStopPost after a clean stop: {}", all());
    assert!(read("link_attached").contains("xdp"), "attached: {}", all());
    assert!(read("post2").contains("aggbox: detached from eth0"), "ExecStopPost after kill -9: {}", all());
    assert!(!read("link_after").contains("xdp"), "the XDP program is gone: {}", all());
    assert!(read("status3").contains("eth0 is not attached"), "{}", all());
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn the_daemonset_has_what_attach_needs() {
    use yaml_rust2::{Yaml, YamlLoader};
    let text = std::fs::read_to_string(repo("deploy/kubernetes/aggbox.yaml")).expect("read the manifest");
    let docs = YamlLoader::load_from_str(&text).expect("the manifest is YAML");
    let kind = |d: &Yaml| d["kind"].as_str().unwrap_or("").to_string();
    let config_map = docs.iter().find(|d| kind(d) == "ConfigMap").expect("a ConfigMap");
    let daemon_set = docs.iter().find(|d| kind(d) == "DaemonSet").expect("a DaemonSet");
    assert_eq!(daemon_set["apiVersion"].as_str(), Some("apps/v1"));
    let pod = &daemon_set["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"].as_bool(), Some(true), "XDP and TC attach to the node's interface");
    let selector = &daemon_set["spec"]["selector"]["matchLabels"];
    let labels = &daemon_set["spec"]["template"]["metadata"]["labels"];
    assert_eq!(selector, labels, "the selector matches the pods");

    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"].as_vec().expect("args").iter().filter_map(|a| a.as_str()).collect();
    assert_eq!(args.first(), Some(&"attach"));
    let config_path = args.iter().skip_while(|a| **a != "--config").nth(1).expect("--config");
    let caps: Vec<&str> = container["securityContext"]["capabilities"]["add"]
        .as_vec()
        .expect("capabilities")
        .iter()
        .filter_map(|c| c.as_str())
        .collect();
    for needed in ["BPF", "NET_ADMIN", "SYS_ADMIN", "PERFMON"] {
        assert!(caps.contains(&needed), "capability {needed}: {caps:?}");
    }
    // The same set as the systemd unit's.
    let unit = service_lines("eth0", Path::new("/etc/aggbox/aggbox.toml"));
    let unit_caps: Vec<String> = line(&unit, "CapabilityBoundingSet").split_whitespace().map(|c| c.trim_start_matches("CAP_").to_string()).collect();
    assert_eq!(caps.iter().map(|c| c.to_string()).collect::<Vec<_>>(), unit_caps);

    // Volumes: the host's bpffs at /sys/fs/bpf, the ConfigMap at the
    // directory of --config.
    let mounts = container["volumeMounts"].as_vec().expect("volumeMounts");
    let volumes = pod["volumes"].as_vec().expect("volumes");
    let volume = |mount_path: &str| {
        let m = mounts.iter().find(|m| m["mountPath"].as_str() == Some(mount_path)).unwrap_or_else(|| panic!("a mount at {mount_path}"));
        volumes.iter().find(|v| v["name"] == m["name"]).unwrap_or_else(|| panic!("the volume of {mount_path}"))
    };
    assert_eq!(volume("/sys/fs/bpf")["hostPath"]["path"].as_str(), Some("/sys/fs/bpf"));
    let config_dir = Path::new(config_path).parent().unwrap().to_str().unwrap();
    let config_volume = volume(config_dir);
    assert_eq!(config_volume["configMap"]["name"], config_map["metadata"]["name"]);

    // The TOML in the ConfigMap is one `aggbox` loads, and its metrics
    // address is the container's metrics port on every address.
    let file = Path::new(config_path).file_name().unwrap().to_str().unwrap();
    let toml = config_map["data"][file].as_str().unwrap_or_else(|| panic!("ConfigMap data {file}"));
    let config = aggbox::config::Config::parse(toml, "deploy/kubernetes/aggbox.yaml (ConfigMap)").unwrap_or_else(|e| panic!("{e}"));
    let metrics = config.node.metrics.expect("metrics on");
    assert!(metrics.ip().is_unspecified(), "scraped from outside the node: {metrics}");
    let port = container["ports"]
        .as_vec()
        .expect("ports")
        .iter()
        .find(|p| p["name"].as_str() == Some("metrics"))
        .and_then(|p| p["containerPort"].as_i64())
        .expect("a metrics port");
    assert_eq!(port, i64::from(metrics.port()));
}
