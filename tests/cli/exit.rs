//! The documented exit codes — 0 ok, 1 failure, 2 usage error or invalid
//! inventory, 3 partial — and the promise CI relies on: with `--output json`
//! stdout holds exactly one JSON document, whatever happens.

use std::path::Path;
use std::process::Output;

use crate::common;
use common::inventory::Inventory;
use common::run::Run;
use common::sims::{Pve, Sim};
use common::{imgbuild, text};

/// The JSON documents on stdout, however many there are.
fn documents(o: &Output) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<serde_json::Value>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(&o.stdout)))
}

/// Exactly one JSON document on stdout, which is returned.
fn one_document(o: &Output) -> serde_json::Value {
    let mut docs = documents(o);
    assert_eq!(
        docs.len(),
        1,
        "stdout: {}\nstderr: {}",
        text(&o.stdout),
        text(&o.stderr)
    );
    docs.remove(0)
}

/// The loopback example with two nodes on one address, as `dir/broken.yaml`.
fn broken_inventory(dir: &Path) -> String {
    let path = Inventory::loopback()
        .replace("address: 127.0.0.12", "address: 127.0.0.11")
        .write_to(&dir.join("broken.yaml"));
    path.to_str().unwrap().to_owned()
}

const LOOPBACK: &str = "examples/loopback/cluster.yaml";

#[test]
fn success_is_0_with_one_document() {
    let o = imgbuild(&["--config", LOOPBACK, "--output", "json", "validate"]);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(one_document(&o)["valid"], true);
    // `-o json` as kubectl and talosctl spell it, before or after the command.
    for args in [
        &["--config", LOOPBACK, "-o", "json", "validate"][..],
        &["--config", LOOPBACK, "validate", "-o", "json"],
    ] {
        let o = imgbuild(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        assert_eq!(one_document(&o)["valid"], true, "{args:?}");
    }
}

#[test]
fn an_invalid_inventory_is_2_in_every_command_that_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let bad = broken_inventory(dir.path());
    let commands: [&[&str]; 7] = [
        &["validate"],
        &["schematic", "--all"],
        &["build"],
        &["publish"],
        &["plan"],
        &["config", "cp-01"],
        &["bootstrap", "--new-secrets"],
    ];
    for args in commands {
        let o = imgbuild(&[&["--config", bad.as_str()], args].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("is already used by node cp-01"));
        let o = imgbuild(&[&["--config", bad.as_str(), "--output", "json"], args].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let v = one_document(&o);
        assert!(
            v["error"].as_str().unwrap().contains("broken.yaml"),
            "{args:?}: {v}"
        );
    }
    // A missing inventory is the same mistake: the wrong --config.
    let o = imgbuild(&["--config", "no/such/cluster.yaml", "validate"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn usage_errors_are_2_and_one_document_with_json() {
    let cases: [&[&str]; 5] = [
        &["--bogus"],
        &["validate", "--bogus"],
        &["completions", "tcsh"],
        &["plan", "--format", "xml"],
        &[],
    ];
    for args in cases {
        let o = imgbuild(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(o.stdout.is_empty(), "{args:?}: {}", text(&o.stdout));
        // kubectl's and talosctl's spellings of it too.
        for json in [
            &["--output", "json"][..],
            &["-o", "json"],
            &["-ojson"],
            &["--output=json"],
        ] {
            let o = imgbuild(&[json, args].concat());
            assert_eq!(o.status.code(), Some(2), "{json:?} {args:?}");
            let v = one_document(&o);
            assert!(!v["error"].as_str().unwrap().is_empty(), "{v}");
        }
    }
    // Several inventories are for `plan` only.
    let o = imgbuild(&[
        "--config", LOOPBACK, "--config", LOOPBACK, "--output", "json", "validate",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        one_document(&o)["error"]
            .as_str()
            .unwrap()
            .contains("only `plan`")
    );
    // An argument that is not UTF-8 is a usage error too, not a panic.
    for json in [false, true] {
        use std::os::unix::ffi::OsStrExt;
        let mut cmd = common::imgbuild_command(if json { &["-o", "json"] } else { &[] });
        let o = cmd
            .arg(std::ffi::OsStr::from_bytes(b"\xff"))
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
        assert!(!text(&o.stderr).contains("panicked"), "{}", text(&o.stderr));
        if json {
            assert!(one_document(&o)["error"].is_string());
        }
    }
    // Help is not an error.
    let o = imgbuild(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(text(&o.stdout).contains("Usage: imgbuild"));
}

/// Every command, failing for its own reason, exits 1 with one document
/// (an unknown node name is a usage error: see below).
#[test]
fn failures_are_1_and_one_document_from_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let missing = format!("{d}/missing.raw");
    let empty_out = format!("{d}/empty-out");
    std::fs::create_dir_all(&empty_out).unwrap();
    let talconfig = format!("{d}/talconfig.yaml");
    std::fs::write(&talconfig, "clusterName: [not, a, name]\n").unwrap();
    let cases: Vec<Vec<&str>> = vec![
        vec!["schematic", "id", &missing],
        vec!["inspect", &missing],
        vec!["meta", "get", &missing, "--key", "10"],
        vec![
            "patch", "--base", &missing, "--node", "cp-01", "--out", &missing,
        ],
        vec!["verify", "--out-dir", &empty_out],
        vec!["diff", &missing, &missing],
        vec![
            "fetch",
            "http://127.0.0.1:9/x.raw",
            "--retries",
            "0",
            "--cache-dir",
            d,
        ],
        vec!["publish", "--out-dir", &empty_out],
        vec!["import", "talhelper", &talconfig],
    ];
    for args in cases {
        let o = imgbuild(&[&["--config", LOOPBACK, "--output", "json"], &args[..]].concat());
        assert_eq!(
            o.status.code(),
            Some(1),
            "{args:?}: {}{}",
            text(&o.stdout),
            text(&o.stderr)
        );
        let v = one_document(&o);
        assert!(v["error"].as_str().is_some(), "{args:?}: {v}");
    }
}

/// Commands whose output is a generated file wrap it in one document.
#[test]
fn generated_files_are_one_document_with_json() {
    let o = imgbuild(&["--output", "json", "completions", "bash"]);
    assert_eq!(o.status.code(), Some(0));
    let v = one_document(&o);
    assert_eq!(v["shell"], "bash");
    assert!(v["text"].as_str().unwrap().contains("_imgbuild()"), "{v}");
    let o = imgbuild(&["--output", "json", "man"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(
        one_document(&o)["text"]
            .as_str()
            .unwrap()
            .contains(".TH imgbuild")
    );
    // A plan format that is not JSON cannot honour --output json.
    for format in ["text", "gitlab"] {
        let o = imgbuild(&[
            "--config", LOOPBACK, "--output", "json", "plan", "--format", format,
        ]);
        assert_eq!(o.status.code(), Some(2), "{format}");
        assert!(
            one_document(&o)["error"]
                .as_str()
                .unwrap()
                .contains("--format")
        );
    }
}

/// `verify` prints its per-image verdicts and then fails: still one document.
#[test]
fn a_failed_verify_is_1_with_its_results_as_the_only_document() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cp-01.raw"), b"not the image").unwrap();
    let manifest = serde_json::json!({"images": {"cp-01": {
        "node": "cp-01", "route": "patch", "schematicId": "00", "talosVersion": "v1.11.2",
        "platform": "metal", "arch": "amd64", "format": "raw", "size": 13,
        "sha256": "0".repeat(64), "path": "cp-01.raw", "sourceUrl": "http://127.0.0.1:9/"
    }}});
    std::fs::write(
        dir.path().join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    let out = dir.path().to_str().unwrap();
    let o = imgbuild(&["--output", "json", "verify", "--out-dir", out]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let v = one_document(&o);
    assert_eq!(v["images"][0]["node"], "cp-01", "{v}");
    assert_eq!(v["images"][0]["ok"], false, "{v}");
    let o = imgbuild(&["verify", "--out-dir", out]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("1 of 1 images do not match"));
}

/// Some nodes published, one refused (its vmid is another VM's): 3, and
/// the one document lists both.
#[test]
fn a_partial_publish_is_3_with_one_document() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &["-d", "vmid=300", "-d", "name=database", "-d", "memory=2048"],
    );
    assert_eq!(code, 200, "{v}");
    pve.wait(&v["data"]);
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::loopback()
        .append("publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, diskSize: 10}\n")
        .write(dir.path());
    let o = Run::with_config(
        &config,
        &["--output", "json", "publish", "--quiet", "--poll-ms", "50"],
    )
    .factory(&sim)
    .folders(dir.path())
    .proxmox(&pve)
    .output();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let v = one_document(&o);
    assert_eq!(v["nodes"].as_array().unwrap().len(), 4, "{v}");
    assert_eq!(v["failed"][0]["node"], "cp-01", "{v}");
    assert!(!text(&o.stdout).contains(&pve.token));
}

/// Runs imgbuild with stdout on `stdout`, stderr captured.
fn imgbuild_with_stdout(args: &[&str], stdout: impl Into<std::process::Stdio>) -> Output {
    common::imgbuild_command(args)
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap()
}

/// `imgbuild … | head -1`: a reader that went away ends every command that
/// prints as it ends other tools, killed by SIGPIPE without a word; a stdout
/// that cannot be written for another reason is one message and exit 1.
#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let bad = broken_inventory(dir.path());
    let cases: [&[&str]; 12] = [
        &["--config", LOOPBACK, "validate"],
        &["--config", LOOPBACK, "--output", "json", "validate"],
        &["--config", LOOPBACK, "schematic", "--all"],
        &[
            "--config",
            LOOPBACK,
            "--output",
            "json",
            "schematic",
            "--all",
        ],
        &["--config", LOOPBACK, "schematic", "cp-01"],
        &["--config", LOOPBACK, "plan"],
        &["--config", LOOPBACK, "plan", "--format", "gitlab"],
        &["--config", &bad, "--output", "json", "validate"],
        &["--output", "json", "--bogus"],
        &["man"],
        &["completions", "bash"],
        &["--output", "json", "completions", "zsh"],
    ];
    for args in cases {
        // The reading end is closed before imgbuild starts: its first
        // write meets EPIPE every time.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = imgbuild_with_stdout(args, writer);
        assert!(o.stderr.is_empty(), "{args:?}: {}", text(&o.stderr));
        assert_eq!(
            o.status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {}",
            o.status
        );
    }
    // Help goes through the same writer: quiet, and SIGPIPE like the rest.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = imgbuild_with_stdout(&["--help"], writer);
    assert!(o.stderr.is_empty(), "{}", text(&o.stderr));
    assert_eq!(o.status.signal(), Some(libc::SIGPIPE), "{}", o.status);
    // A full disk behind `>` is an error worth a line, not a panic.
    let full = std::fs::File::options()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = imgbuild_with_stdout(&["--config", LOOPBACK, "schematic", "--all"], full);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr).trim_end(),
        "error: writing to stdout: No space left on device (os error 28)"
    );
}

#[test]
fn day_two_commands_on_a_missing_state_dir_fail_and_create_nothing() {
    // A mistyped --state-dir must not mint a new cluster identity (secrets,
    // talosconfig) that a later bootstrap would then use.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("typo");
    for args in [
        &["status"][..],
        &["status", "--check"],
        &["apply", "--dry-run"],
        &["apply"],
        &["upgrade", "--dry-run"],
        &["upgrade"],
    ] {
        let mut all = vec!["--config", LOOPBACK, "--output", "json"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--state-dir", state.to_str().unwrap()]);
        let o = imgbuild(&all);
        // No secrets: the user's to give (exit 2), before the factory is asked.
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        let doc = one_document(&o);
        assert!(
            doc["error"]
                .as_str()
                .unwrap_or("")
                .contains("no cluster secrets"),
            "{args:?}: {doc}"
        );
        assert!(!state.exists(), "{args:?} created {}", state.display());
    }
}

/// A node name the inventory lacks is a usage error (exit 2) in every
/// command that takes node names, named with the nodes there are. The
/// factory given is a closed loopback port: nothing is asked of anyone.
#[test]
fn an_unknown_node_name_is_a_usage_error_everywhere() {
    let factory = ["--factory", "http://127.0.0.1:9"];
    let cases: [&[&str]; 6] = [
        &["build", "nope"],
        &["node", "nope"],
        &["schematic", "nope"],
        &["config", "nope"],
        &["upgrade", "--dry-run", "nope"],
        &["apply", "--dry-run", "nope"],
    ];
    for args in cases {
        let mut full = vec!["--config", LOOPBACK];
        full.extend_from_slice(args);
        if matches!(args[0], "upgrade" | "apply") {
            full.extend_from_slice(&factory);
        }
        let o = imgbuild(&full);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("no node named \"nope\""), "{args:?}: {err}");
    }
}

#[test]
fn validate_refuses_a_kubernetes_version_its_talos_does_not_run_with_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = Inventory::loopback()
        .replace("kubernetesVersion: v1.32.1", "kubernetesVersion: v1.36.0")
        .write_to(&dir.path().join("k8s.yaml"));
    let o = imgbuild(&["--config", path.to_str().unwrap(), "validate"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("cluster.kubernetesVersion: Kubernetes v1.36.0 is too new for Talos v1.11.2"),
        "{err}"
    );
}

#[test]
fn validate_refuses_a_secure_boot_iso_for_a_node_that_needs_meta_with_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = Inventory::loopback()
        .replace("format: raw", "format: iso\n  secureBoot: true")
        .replace("talosVersion: v1.11.2", "talosVersion: v1.9.6")
        .write_to(&dir.path().join("sb.yaml"));
    let o = imgbuild(&["--config", path.to_str().unwrap(), "validate"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("image.format: iso: node cp-01: a Secure Boot ISO boots a signed UKI"),
        "{err}"
    );
}
