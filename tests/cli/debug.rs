//! `--debug`: every HTTP request and gRPC call on stderr with its method,
//! URL or path, status and time, as hcloud's `--debug` and `TF_LOG` show
//! them, and never a credential: the Proxmox token, the Hetzner token and
//! the cluster's secrets stay out of the log.

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Nodes, Pve, Sim};
use common::text;

/// The `debug:` lines of `stderr`.
fn debug_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("debug: "))
        .collect()
}

/// Every way the Proxmox token could leak: whole, its secret, the header scheme.
fn assert_no_token(all: &str, pve: &Pve) {
    let (_, secret) = pve.token.rsplit_once('=').unwrap();
    for leak in [pve.token.as_str(), secret] {
        assert!(!all.contains(leak), "{leak:?} reached the output:\n{all}");
    }
    let lower = all.to_ascii_lowercase();
    for header in ["pveapitoken", "authorization", "cookie"] {
        assert!(
            !lower.contains(header),
            "{header:?} reached the output:\n{all}"
        );
    }
}

#[test]
fn a_failing_proxmox_upload_shows_each_call_with_its_status_and_never_the_token() {
    let sim = Sim::start(&[]);
    // Every upload cut after 1 MB: the publish fails at the upload.
    let pve = Pve::start(&["--drop-upload-after", "1000000", "--drop-uploads", "100"]);
    let work = Work::new(&Inventory::loopback().proxmox(false));
    let publish = |debug: bool| {
        let mut run = Run::with_config(&work.config, &["publish", "cp-01"]);
        if debug {
            run.arg("--debug");
        }
        run.factory(&sim)
            .args(["--poll-ms", "50", "--quiet"])
            .folders(work.dir.path())
            .proxmox(&pve)
            .output()
    };

    let o = publish(true);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    let lines = debug_lines(&err);
    let api = format!("{}api2/json/", pve.url);
    let upload: Vec<&&str> = lines
        .iter()
        .filter(|l| {
            l.starts_with(&format!(
                "debug: HTTP POST {api}nodes/pve/storage/local/upload "
            ))
        })
        .collect();
    // Three attempts, each cut off: each is one line saying so and how long it took.
    assert_eq!(upload.len(), 3, "{err}");
    for line in &upload {
        assert!(
            line.contains(" → failed after ") && line.contains(" ms: "),
            "{line}"
        );
    }
    // The API calls before it, with their status, and the factory's downloads.
    assert!(
        lines.iter().any(
            |l| l.starts_with(&format!("debug: HTTP GET {api}")) && l.contains(" → 200 OK in ")
        ),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&format!("debug: HTTP GET {}", sim.url))),
        "{err}"
    );
    assert_no_token(&format!("{}{err}", text(&o.stdout)), &pve);

    // Without --debug: the same failure, no request log.
    let o = publish(false);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(debug_lines(&err).is_empty(), "{err}");
}

/// A refused token is the case where a log most wants to show what was
/// sent: the call and its 401, nothing of the token.
#[test]
fn a_refused_proxmox_token_is_logged_as_its_401_without_the_token() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = Work::new(&Inventory::loopback().proxmox(false));
    let wrong = format!("{}-wrong", pve.token);
    let o = Run::with_config(&work.config, &["--debug", "publish", "cp-01", "--quiet"])
        .factory(&sim)
        .folders(work.dir.path())
        .proxmox(&pve)
        .env("PROXMOX_VE_API_TOKEN", &wrong)
        .output();
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        debug_lines(&err)
            .iter()
            .any(|l| l.contains(&pve.url) && l.contains(" → 401 ")),
        "{err}"
    );
    let all = format!("{}{err}", text(&o.stdout));
    assert_no_token(&all, &pve);
    assert!(!all.contains("-wrong"), "{all}");
}

/// This file's loopback /24 (tests/common/net.rs).
fn net() -> String {
    common::net::block(module_path!())
}

#[test]
fn a_bootstrap_logs_each_talos_call_by_node_and_method_and_no_secret() {
    let net = net();
    let _nodes = Nodes::cluster(&net, true, &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("sim", &net).write(dir.path());
    let o = Run::with_config(&config, &["--debug", "bootstrap", "--new-secrets"])
        .timeouts(&[])
        .current_dir(dir.path())
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    let lines = debug_lines(&err);
    for (node, path) in [
        ("11", "/machine.MachineService/ApplyConfiguration"),
        ("21", "/machine.MachineService/ApplyConfiguration"),
        ("11", "/machine.MachineService/Version"),
    ] {
        let call = format!("debug: gRPC {net}.{node}:50000 {path} → HTTP 200 OK");
        assert!(lines.iter().any(|l| l.starts_with(&call)), "{call}\n{err}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("/machine.MachineService/Bootstrap → HTTP 200 OK")),
        "{err}"
    );
    // The cluster's secrets: none of their values in the log.
    let secrets = std::fs::read_to_string(dir.path().join(".talos/sim/secrets.yaml"))
        .expect("the secrets bundle in the state dir (.talos/CLUSTER/)");
    let bundle: serde_yaml_ng::Value = serde_yaml_ng::from_str(&secrets).unwrap();
    let mut values = Vec::new();
    collect_strings(&bundle, &mut values);
    assert!(values.len() > 5, "{secrets}");
    for v in values.iter().filter(|v| v.len() >= 16) {
        assert!(!err.contains(v.as_str()), "a secret reached the log: {v}");
    }
}

fn collect_strings(v: &serde_yaml_ng::Value, out: &mut Vec<String>) {
    match v {
        serde_yaml_ng::Value::String(s) => out.push(s.clone()),
        serde_yaml_ng::Value::Mapping(m) => m.values().for_each(|v| collect_strings(v, out)),
        serde_yaml_ng::Value::Sequence(s) => s.iter().for_each(|v| collect_strings(v, out)),
        _ => {}
    }
}
