//! Shell completion of node names from the inventory (issue 41), as kubectl
//! completes resource names: after `apply`, `config`, `upgrade`, … and for
//! `--node`, the generated scripts ask `imgbuild __complete nodes`, which
//! reads the inventory (--config, else ./cluster.yaml) quietly. Bash runs
//! its completion function on a sample command line; fish its `complete
//! -C`; zsh (no terminal to drive `compsys` here) the node action the
//! script defines, with `_describe` standing in, and the node arguments of
//! clap's specs pointing at it. fish and zsh are Debian's `fish` and `zsh`
//! (make deps).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;
use common::run::Run;
use common::text;

const INVENTORY: &str = "\
cluster: {name: comp, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: \"https://10.9.0.10:6443\"}
nodes:
  - {name: cp-01, role: controlplane, address: 10.9.0.11}
  - {name: worker-07, role: worker, address: 10.9.0.21}
";

const NAMES: [&str; 2] = ["cp-01", "worker-07"];

/// A folder with the inventory as `comp.yaml` and the scripts for `shells`.
fn setup() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("comp.yaml"), INVENTORY).unwrap();
    for shell in ["bash", "zsh", "fish"] {
        let o = Run::new(&["completions", shell]).output();
        assert!(o.status.success(), "{}", text(&o.stderr));
        std::fs::write(dir.path().join(format!("imgbuild.{shell}")), &o.stdout).unwrap();
    }
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_imgbuild"));
    (dir, bin.parent().unwrap().to_owned())
}

/// PATH with the imgbuild under test first.
fn path_with(bin_dir: &Path) -> String {
    format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// Bash's completion for `words` (the last is the word being completed).
fn bash_complete(dir: &Path, bin_dir: &Path, words: &[&str]) -> Vec<String> {
    let o = Command::new("bash")
        .arg("-c")
        .arg(
            r#"source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 ))
_imgbuild_with_nodes "${COMP_WORDS[0]}" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}""#,
        )
        .arg("_")
        .arg(dir.join("imgbuild.bash"))
        .arg("imgbuild")
        .args(words)
        .current_dir(dir)
        .env("PATH", path_with(bin_dir))
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stderr), "", "completion printed on stderr");
    text(&o.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

fn has_names(got: &[String]) -> bool {
    NAMES.iter().all(|n| got.iter().any(|g| g == n))
}

fn has_any_name(got: &[String]) -> bool {
    NAMES.iter().any(|n| got.iter().any(|g| g == n))
}

#[test]
fn bash_completes_node_names_after_the_commands_that_take_nodes() {
    let (dir, bin) = setup();
    let d = dir.path();
    for line in [
        &["--config", "comp.yaml", "apply", ""][..],
        &["--config=comp.yaml", "config", ""],
        &[
            "--config",
            "comp.yaml",
            "upgrade",
            "--skip-etcd-snapshot",
            "",
        ],
        &["--config", "comp.yaml", "node", ""],
        &["--config", "comp.yaml", "patch", "--node", ""],
    ] {
        let got = bash_complete(d, &bin, line);
        assert!(has_names(&got), "{line:?} → {got:?}");
        assert!(
            !got.iter().any(|g| g.starts_with('[') || g.starts_with('<')),
            "{line:?} → {got:?}"
        );
    }
    // The word typed so far narrows them; the next node of a list too.
    let got = bash_complete(d, &bin, &["--config", "comp.yaml", "apply", "cp-01", "w"]);
    assert_eq!(got, ["worker-07"]);
    // Not where no node goes: another command, an option's value, an option.
    for line in [
        &["--config", "comp.yaml", "status", ""][..],
        &["--config", "comp.yaml", "upgrade", "--parallel", ""],
        &["--config", "comp.yaml", "apply", "--mode", ""],
    ] {
        let got = bash_complete(d, &bin, line);
        assert!(!has_any_name(&got), "{line:?} → {got:?}");
    }
    let got = bash_complete(d, &bin, &["--config", "comp.yaml", "apply", "--"]);
    assert!(got.iter().any(|g| g == "--mode"), "{got:?}");
    assert!(!has_any_name(&got), "{got:?}");
}

#[test]
fn bash_reads_the_default_inventory_and_stays_quiet_without_one() {
    let (dir, bin) = setup();
    let d = dir.path();
    // No inventory at ./cluster.yaml: nothing, and nothing on stderr.
    assert!(!has_any_name(&bash_complete(d, &bin, &["apply", ""])));
    std::fs::copy(d.join("comp.yaml"), d.join("cluster.yaml")).unwrap();
    assert!(has_names(&bash_complete(d, &bin, &["apply", ""])));
    // A broken inventory: nothing, quietly.
    std::fs::write(d.join("cluster.yaml"), "nodes: [ {name: cp-01\n: :").unwrap();
    assert!(!has_any_name(&bash_complete(d, &bin, &["apply", ""])));
}

#[test]
fn the_hidden_command_prints_names_only_and_never_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("comp.yaml");
    std::fs::write(
        &config,
        format!("{INVENTORY}  - {{name: \"$(rm -rf x)\", role: worker, address: 10.9.0.22}}\n"),
    )
    .unwrap();
    let o = Run::with_config(&config, &["__complete", "nodes"]).output();
    assert!(o.status.success());
    // A name no shell word can hold as is is left out.
    assert_eq!(text(&o.stdout), "cp-01\nworker-07\n");
    assert_eq!(text(&o.stderr), "");
    for missing in ["absent.yaml", "/"] {
        let o = Run::with_config(Path::new(missing), &["__complete", "nodes"]).output();
        assert!(o.status.success(), "{missing}");
        assert_eq!(
            (text(&o.stdout), text(&o.stderr)),
            (String::new(), String::new())
        );
    }
    // Hidden: not in the help a user reads.
    let o = Run::new(&["--help"]).output();
    assert!(!text(&o.stdout).contains("__complete"));
}

fn installed(shell: &str) -> bool {
    let found = Command::new(shell).arg("-c").arg("exit 0").output().is_ok();
    if !found {
        eprintln!("{shell} not installed (Debian package `{shell}`): skipped");
    }
    found
}

#[test]
fn fish_completes_node_names_after_the_commands_that_take_nodes() {
    if !installed("fish") {
        return;
    }
    let (dir, bin) = setup();
    let complete = |line: &str| -> Vec<String> {
        let o = Command::new("fish")
            .arg("--no-config")
            .arg("-c")
            .arg(format!("source imgbuild.fish; complete -C '{line}'"))
            .current_dir(dir.path())
            .env("PATH", path_with(&bin))
            .output()
            .unwrap();
        assert_eq!(text(&o.stderr), "", "{line}");
        text(&o.stdout)
            .lines()
            .map(|l| l.split('\t').next().unwrap().to_owned())
            .collect()
    };
    assert!(has_names(&complete("imgbuild --config comp.yaml apply ")));
    assert!(has_names(&complete("imgbuild --config comp.yaml config ")));
    assert!(has_names(&complete(
        "imgbuild --config comp.yaml patch --node "
    )));
    assert_eq!(
        complete("imgbuild --config comp.yaml apply w"),
        ["worker-07"]
    );
    assert!(!has_any_name(&complete(
        "imgbuild --config comp.yaml status "
    )));
}

#[test]
fn zsh_node_arguments_ask_the_inventory() {
    if !installed("zsh") {
        return;
    }
    let (dir, bin) = setup();
    let script = std::fs::read_to_string(dir.path().join("imgbuild.zsh")).unwrap();
    // clap's specs of the node arguments point at the node action.
    for spec in [
        "'*::nodes -- Nodes to compare and apply \\[default\\: all\\]:_imgbuild_nodes'",
        "':node -- The node whose machine config to print:_imgbuild_nodes'",
        "'--node=[The node whose network goes into META key 10]:NODE:_imgbuild_nodes'",
    ] {
        assert!(script.contains(spec), "{spec}");
    }
    let o = Command::new("zsh")
        .arg("-f")
        .arg("-c")
        .arg(
            r#"source ./imgbuild.zsh 2>/dev/null
_describe() { print -l -- ${(P)${@[-1]}} }
BUFFER="imgbuild --config comp.yaml apply cp-01 "
_imgbuild_nodes"#,
        )
        .current_dir(dir.path())
        .env("PATH", path_with(&bin))
        .output()
        .unwrap();
    assert_eq!(text(&o.stderr), "");
    assert_eq!(text(&o.stdout), "cp-01\nworker-07\n");
}
