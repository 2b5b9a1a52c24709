//! `--output yaml` (`-o yaml`): the document `--output json` prints, as
//! YAML, for every command. Read back by PyYAML (YAML 1.1, not the parser
//! imgbuild's own code uses) and by serde_yaml_ng (YAML 1.2), it must be
//! the JSON document, value for value.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use crate::common;
use common::{root, text};

/// The JSON documents on stdout, in order.
fn json_documents(o: &Output) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", text(&o.stdout)))
}

/// The YAML documents in `yaml` as PyYAML reads them (`safe_load_all`),
/// through Python's JSON writer: a date or any other non-JSON value that
/// PyYAML would make of a string fails here.
fn python_yaml(yaml: &str) -> Vec<serde_json::Value> {
    // Debian's python3-yaml (`make deps`).
    let mut child = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps(list(yaml.safe_load_all(sys.stdin))))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 with PyYAML (python3-yaml)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "PyYAML refused it: {}\n{yaml}",
        text(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The same YAML documents as serde_yaml_ng (YAML 1.2) reads them.
fn yaml_12(yaml: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| {
            serde_json::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("serde_yaml_ng refused it ({e}):\n{yaml}"))
        })
        .collect()
}

/// A state dir holding the atlas cluster's secrets (`config` renders
/// with them and never makes them).
fn seeded() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().to_str().unwrap();
    let o = run(
        "text",
        &["--config", ATLAS, "secrets", "gen", "--state-dir", state],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    dir
}

/// `imgbuild -o FORMAT ARGS` from the repository root.
fn run(format: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["-o", format])
        .args(args)
        .current_dir(root())
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap()
}

/// Runs `args` with `-o json` and `-o yaml` and checks that both say the
/// same, with the same exit code; returns the documents.
fn same_as_json(args: &[&str]) -> Vec<serde_json::Value> {
    let json = run("json", args);
    let yaml = run("yaml", args);
    assert_eq!(
        json.status.code(),
        yaml.status.code(),
        "{args:?}\n{}",
        text(&yaml.stderr)
    );
    let expected = json_documents(&json);
    assert!(!expected.is_empty(), "{args:?}: no JSON document");
    let shown = text(&yaml.stdout);
    assert!(
        !shown.trim_start().starts_with(['{', '[']),
        "{args:?}: block-style YAML expected, got:\n{shown}"
    );
    assert_eq!(python_yaml(&shown), expected, "{args:?} (PyYAML):\n{shown}");
    assert_eq!(yaml_12(&shown), expected, "{args:?} (YAML 1.2):\n{shown}");
    expected
}

const ATLAS: &str = "examples/atlas/cluster.yaml";

#[test]
fn every_offline_command_prints_its_json_document_as_yaml() {
    let dir = seeded();
    let state = dir.path().display().to_string();
    for args in [
        &["--config", ATLAS, "validate"][..],
        &["--config", ATLAS, "schematic", "--all"],
        &["--config", ATLAS, "plan"],
        &["--config", "examples/ci/clusters/lab.yaml", "plan"],
        &[
            "--config",
            ATLAS,
            "config",
            "cp-01",
            "--state-dir",
            state.as_str(),
        ],
        &["completions", "fish"],
        &["man"],
    ] {
        same_as_json(args);
    }
}

/// The multi-line text a document carries (a machine config, a script)
/// reads as a literal block a person can follow, not one escaped line.
#[test]
fn a_machine_config_in_yaml_is_a_literal_block_that_reads_back_as_the_config() {
    let dir = seeded();
    let args = ["--config", ATLAS, "config", "cp-01", "--state-dir"];
    let args = [&args[..], &[dir.path().to_str().unwrap()]].concat();
    let docs = same_as_json(&args);
    let config = docs[0]["config"].as_str().unwrap();
    assert!(config.lines().count() > 20, "{config}");
    let yaml = text(&run("yaml", &args).stdout);
    assert!(yaml.contains("config: |\n  version: v1alpha1\n"), "{yaml}");
}

/// Failures are documents too: a usage error and an inventory that does
/// not exist, whose path is made of what YAML and terminals trip on.
#[test]
fn errors_are_yaml_documents_with_the_json_exit_code() {
    let docs = same_as_json(&["no-such-command"]);
    assert!(
        docs[0]["error"]
            .as_str()
            .unwrap()
            .contains("no-such-command")
    );
    assert_eq!(run("yaml", &["no-such-command"]).status.code(), Some(2));

    let dir = tempfile::tempdir().unwrap();
    let hostile = dir
        .path()
        .join("yes: no #\u{202e}- [x]\n--- 1e3 \"q\" \\ 'ü'\t~");
    let hostile = hostile.to_str().unwrap();
    let docs = same_as_json(&["--config", hostile, "validate"]);
    let error = docs[0]["error"].as_str().unwrap();
    assert!(error.contains("yes: no #"), "{error}");
    let yaml = run("yaml", &["--config", hostile, "validate"]);
    let shown = text(&yaml.stdout);
    assert!(
        !shown.contains('\u{202e}'),
        "a character that hides text reached the terminal raw:\n{shown}"
    );
}

/// `-o yaml` as kubectl users type it, and every other spelling clap takes.
#[test]
fn the_short_and_long_spellings_agree() {
    for spelling in [
        &["--output", "yaml"][..],
        &["--output=yaml"],
        &["-oyaml"],
        &["-o=yaml"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(spelling)
            .args(["--config", ATLAS, "validate"])
            .current_dir(root())
            .output()
            .unwrap();
        assert!(o.status.success(), "{spelling:?}: {}", text(&o.stderr));
        let docs = python_yaml(&text(&o.stdout));
        assert_eq!(docs[0]["cluster"], "atlas", "{spelling:?}");
    }
}
