//! End to end: the real binary on the example inventory and the public vectors.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common;
use common::{atlas_copy, imgbuild, root, text};

fn stdout(o: &Output) -> String {
    text(&o.stdout)
}

fn stderr(o: &Output) -> String {
    text(&o.stderr)
}

const ATLAS: &str = "examples/atlas/cluster.yaml";

#[test]
fn schematic_id_reproduces_every_public_vector() {
    let dir = root().join("tests/vectors/schematics");
    let ids = std::fs::read_to_string(dir.join("ids.txt")).unwrap();
    let mut n = 0;
    for line in ids.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (file, want) = line.split_once(' ').unwrap();
        let o = imgbuild(&["schematic", "id", dir.join(file).to_str().unwrap()]);
        assert!(o.status.success(), "{file}: {}", stderr(&o));
        assert_eq!(stdout(&o).trim(), want, "{file}");
        n += 1;
    }
    assert_eq!(n, 15);
}

/// The ID the factory gives `canonical` once its `meta` block is dropped:
/// the canonical YAML keeps one key per line, so the block is the lines under
/// `meta:` that are indented deeper than it. Hashed here, not by imgbuild.
fn id_without_meta(canonical: &str) -> String {
    use sha2::Digest;
    let mut kept = String::new();
    let mut meta_indent = None;
    for line in canonical.lines() {
        let indent = line.len() - line.trim_start().len();
        if line.trim_start() == "meta:" {
            meta_indent = Some(indent);
            continue;
        }
        if meta_indent.is_some_and(|m| indent > m) {
            continue;
        }
        meta_indent = None;
        kept.push_str(line);
        kept.push('\n');
    }
    assert_ne!(kept, canonical, "no meta block in {canonical}");
    hex::encode(sha2::Sha256::digest(kept.as_bytes()))
}

/// Every node's installer is the factory's for its META-less schematic:
/// the factory never bakes META into installers, so nodes with the same
/// extensions share one, and below Talos v1.10 it is `installer/<id>`.
#[test]
fn installers_name_the_schematic_without_meta() {
    let o = imgbuild(&["--config", ATLAS, "schematic", "--all", "--output", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let list: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    let mut installers = std::collections::BTreeSet::new();
    for v in &list {
        let canonical = v["schematic"].as_str().unwrap();
        let want = if canonical.contains("meta:") {
            id_without_meta(canonical)
        } else {
            v["id"].as_str().unwrap().to_owned()
        };
        assert_eq!(
            v["installer"],
            format!("factory.talos.dev/metal-installer/{want}:v1.11.2"),
            "{}",
            v["node"]
        );
        installers.insert(v["installer"].as_str().unwrap().to_owned());
    }
    assert!(
        installers.len() < list.len(),
        "nodes with the same extensions share an installer: {installers:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let old = atlas_copy(dir.path(), "talosVersion: v1.11.2", "talosVersion: v1.9.5");
    let o = imgbuild(&[
        "--config",
        old.to_str().unwrap(),
        "schematic",
        "cp-01",
        "--output",
        "json",
        "--factory",
        "http://127.0.0.1:8123/",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let canonical = v["schematic"].as_str().unwrap();
    assert_eq!(
        v["installer"],
        format!(
            "127.0.0.1:8123/installer/{}:v1.9.5",
            id_without_meta(canonical)
        )
    );
}

/// The machine config names the same installer as `schematic`, on the
/// factory the command was pointed at (flag or environment).
#[test]
fn the_config_installs_from_the_factory_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // `config` renders with the cluster's secrets, made first.
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["--config", ATLAS, "secrets", "gen", "--state-dir"])
        .arg(&state)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["--config", ATLAS, "config", "cp-01", "--state-dir"])
        .arg(&state)
        .env("IMGBUILD_FACTORY", "http://127.0.0.5:9000")
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let config = stdout(&o);
    let o = imgbuild(&[
        "--config",
        ATLAS,
        "schematic",
        "cp-01",
        "--output",
        "json",
        "--factory",
        "http://127.0.0.5:9000",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let installer = v["installer"].as_str().unwrap();
    assert!(
        installer.starts_with("127.0.0.5:9000/metal-installer/"),
        "{installer}"
    );
    assert!(
        config.contains(&format!("image: {installer}")),
        "{installer} not in\n{config}"
    );
}

#[test]
fn schematic_id_reads_standard_input() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["schematic", "id", "-", "--output", "json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"customization: {}\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["id"],
        "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"
    );
}

#[test]
fn schematic_id_of_a_bad_file_names_it_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("typo.yaml");
    std::fs::write(&bad, "customization:\n  systemExtension: {}\n").unwrap();
    let o = imgbuild(&["schematic", "id", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("typo.yaml") && err.contains("systemExtension"),
        "{err}"
    );
}

/// The cp-01 schematic carries key 10 with its address, route, name and DNS.
#[test]
fn cp01_key10_carries_its_network() {
    let o = imgbuild(&["--config", ATLAS, "schematic", "cp-01", "--output", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let canonical = v["schematic"].as_str().unwrap();
    assert_eq!(
        v["installer"],
        format!(
            "factory.talos.dev/metal-installer/{}:v1.11.2",
            id_without_meta(canonical)
        )
    );
    let schematic: serde_yaml_ng::Value = serde_yaml_ng::from_str(canonical).unwrap();
    let meta = &schematic["customization"]["meta"][0];
    assert_eq!(meta["key"].as_u64(), Some(10));
    let net: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(meta["value"].as_str().unwrap()).unwrap();
    assert_eq!(
        net["addresses"][0]["address"].as_str(),
        Some("10.0.0.11/16")
    );
    assert_eq!(net["routes"][0]["gateway"].as_str(), Some("10.0.0.1"));
    assert_eq!(net["hostnames"][0]["hostname"].as_str(), Some("cp-01"));
    let dns: Vec<&str> = net["resolvers"][0]["dnsServers"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(dns, ["1.1.1.1", "8.8.8.8"]);
    // The ID printed is the hash of the canonical bytes printed.
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["schematic", "id", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(canonical.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(stdout(&o).trim(), v["id"].as_str().unwrap());
}

#[test]
fn every_node_gets_a_distinct_id_and_the_base_has_no_meta() {
    let o = imgbuild(&["--config", ATLAS, "schematic", "--all", "--output", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 6);
    let mut ids: Vec<&str> = list.iter().map(|e| e["id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 6);
    let base = list.iter().find(|e| e["node"] == "base").unwrap();
    assert!(!base["schematic"].as_str().unwrap().contains("meta:"));
}

#[test]
fn written_files_are_idempotent_and_match_the_committed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let write = || {
        imgbuild(&[
            "--config",
            ATLAS,
            "schematic",
            "--all",
            "--write",
            "--dir",
            d,
        ])
    };
    let first = write();
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(stdout(&first).matches("(written)").count(), 6);
    let second = write();
    assert_eq!(stdout(&second).matches("(unchanged)").count(), 6);
    for name in ["base", "cp-01", "cp-02", "cp-03", "worker-01", "worker-02"] {
        let fresh = std::fs::read_to_string(Path::new(d).join(format!("{name}.yaml"))).unwrap();
        let committed =
            std::fs::read_to_string(root().join(format!("examples/schematics/{name}.yaml")))
                .unwrap();
        assert_eq!(
            fresh, committed,
            "examples/schematics/{name}.yaml is stale: run make schematics"
        );
        // The leading comment names the ID `schematic id` computes for the file.
        let id_line = fresh
            .lines()
            .nth(1)
            .unwrap()
            .trim_start_matches("# id: ")
            .to_owned();
        let o = imgbuild(&[
            "schematic",
            "id",
            Path::new(d).join(format!("{name}.yaml")).to_str().unwrap(),
        ]);
        assert_eq!(stdout(&o).trim(), id_line);
    }
}

#[test]
fn validate_reports_the_culprit_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let path = atlas_copy(dir.path(), "address: 10.0.0.22", "address: 10.0.0.21");
    let o = imgbuild(&["--config", path.to_str().unwrap(), "validate"]);
    // 2: an invalid inventory, as documented.
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("cluster.yaml"), "{err}");
    assert!(
        err.contains(
            "nodes[4].address: node worker-02: address 10.0.0.21 is already used by node worker-01"
        ),
        "{err}"
    );

    let o = imgbuild(&[
        "--config",
        path.to_str().unwrap(),
        "--output",
        "json",
        "validate",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("worker-02"));
}

#[test]
fn config_comes_from_the_environment_when_not_given() {
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["validate", "--output", "json"])
        .env("IMGBUILD_CONFIG", root().join(ATLAS))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["valid"], true);
    assert_eq!(v["nodes"], 5);
}

#[test]
fn missing_config_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("validate")
        .current_dir(dir.path())
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap();
    // 2: the wrong --config is a usage error.
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cluster.yaml"), "{}", stderr(&o));
}

#[test]
fn unknown_node_lists_the_known_ones() {
    let o = imgbuild(&["--config", ATLAS, "schematic", "cp-9"]);
    // 2: a node name the inventory lacks is a usage error.
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no node named \"cp-9\""),
        "{}",
        stderr(&o)
    );
}
