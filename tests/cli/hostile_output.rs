//! End to end (issue 28): what nodes say reaches the terminal escaped and
//! bounded, through the one writer, and a stream that cannot be written
//! never panics. The node simulator (Talos v1.11.2 otherwise) reports a
//! version tag carrying CR/LF, ESC sequences, BEL, a C1 control and a bidi
//! override, shaped to forge a `status` row and an `up` table row.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common;
use common::hostile::no_raw_control;
use common::inventory::{Inventory, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// A version tag that would print a fake `worker-09` row, set the window
/// title, clear the screen and reverse the rest of the line; after a `-`,
/// where a pre-release suffix goes, so the node still runs v1.11.2.
const HOSTILE: &str = "v1.11.2-\r\nworker-09    yes       v6.6.6 (v1.11.2)\u{1b}]0;owned\u{7}\u{1b}[2J\u{9b}1m\u{202e}gnp.exe";

fn inventory(net: &str, factory: &str) -> String {
    Inventory::new("hostile")
        .endpoint(&format!("{net}.11"))
        .no_nameservers()
        .factory(factory)
        .node(Node::new("cp-01", "controlplane").address(&format!("{net}.11")))
        .node(Node::new("worker-01", "worker").address(&format!("{net}.21")))
        .text()
}

fn run(dir: &Path, args: &[&str]) -> Output {
    let mut run = Run::with_config(&dir.join("cluster.yaml"), args);
    run.env_remove("TALOSCONFIG")
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .timeouts(&[]);
    if (args.contains(&"up") || args.contains(&"bootstrap")) && !args.contains(&"--new-secrets") {
        // A new cluster: its secrets are made on the first run.
        run.arg("--new-secrets");
    }
    if args.contains(&"up") {
        run.arg("--out-dir").arg(dir.join("out"));
    }
    run.output()
}

/// No line (of a table or a log) starts as the forged row does.
fn no_forged_row(what: &str, bytes: &[u8]) {
    let s = text(bytes);
    assert!(
        !s.lines().any(|l| l.trim_start().starts_with("worker-09")),
        "{what}: a forged row:\n{s}"
    );
}

fn clean(what: &str, o: &Output) {
    assert_ne!(
        o.status.code(),
        Some(101),
        "{what}: panicked: {}",
        text(&o.stderr)
    );
    for (stream, bytes) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
        no_raw_control(&format!("{what} {stream}"), &text(bytes));
        no_forged_row(&format!("{what} {stream}"), bytes);
    }
}

#[test]
fn a_hostile_version_tag_is_shown_escaped_and_forges_no_row() {
    let net = net(11);
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let _nodes = Nodes::start(&[
        "--talos-version",
        HOSTILE,
        "--node",
        &format!("cp-01={net}.11:controlplane"),
        "--node",
        &format!("worker-01={net}.21:worker"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("cluster.yaml"), inventory(&net, &factory.url)).unwrap();

    // The bootstrap's log lines quote the version each node reports.
    let o = run(d, &["bootstrap", "--new-secrets"]);
    clean("bootstrap", &o);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("\\r\\nworker-09"),
        "{}",
        text(&o.stderr)
    );

    // status: one row per node, the version escaped in its cell; exit 0
    // (drift is a failure only with --check, exit 1).
    let o = run(d, &["status"]);
    clean("status", &o);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("cp-01") || l.starts_with("worker-01"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    let o = run(d, &["status", "--check"]);
    clean("status --check", &o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    // JSON keeps the tag as it came, in a valid document.
    let o = run(d, &["--output", "json", "status"]);
    clean("status json", &o);
    assert_eq!(json(&o)["nodes"][0]["version"], HOSTILE);

    // A tag no upgrade path can start from: the plan refuses the nodes
    // (exit 1), and says so escaped.
    let o = run(d, &["upgrade", "--dry-run"]);
    clean("upgrade --dry-run", &o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));

    // up converges, so it plans the upgrade `upgrade` refuses: exit 1, the
    // refusal quoting the tag escaped, in the table and in the JSON.
    let o = run(d, &["up"]);
    clean("up", &o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("cannot read version"),
        "{}",
        text(&o.stderr)
    );
    let o = run(d, &["--output", "json", "up"]);
    clean("up json", &o);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    json(&o);
}

/// etcd member hostnames and service messages that carry the same text
/// (simulator `--hostile-text`): health never passes, and the waits, the
/// log and the final error quote them escaped. Exit 1 (health timeout).
#[test]
fn hostile_etcd_hostnames_and_service_messages_are_shown_escaped() {
    let net = net(13);
    let _nodes = Nodes::start_with(
        &[
            "--apply-delay",
            "200",
            "--etcd-delay",
            "400",
            "--kubelet-delay",
            "60000",
            "--ready-delay",
            "300",
        ],
        &[
            "--hostile-text",
            HOSTILE,
            "--node",
            &format!("cp-01={net}.11:controlplane"),
            "--node",
            &format!("worker-01={net}.21:worker"),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("cluster.yaml"),
        inventory(&net, "http://127.0.0.1:9"),
    )
    .unwrap();
    for args in [
        &[
            "bootstrap",
            "--new-secrets",
            "--health-timeout",
            "3s",
            "--heartbeat",
            "1s",
        ][..],
        &[
            "--output",
            "json",
            "bootstrap",
            "--new-secrets",
            "--health-timeout",
            "3s",
        ],
        &["up", "--health-timeout", "3s"],
    ] {
        let mut run = Run::with_config(&d.join("cluster.yaml"), args);
        run.env_remove("TALOSCONFIG")
            .env_remove("IMGBUILD_STATE_DIR")
            .timeouts(&["--health-timeout"]);
        if (args.contains(&"up") || args.contains(&"bootstrap")) && !args.contains(&"--new-secrets")
        {
            // A new cluster: its secrets are made on the first run.
            run.arg("--new-secrets");
        }
        if args.contains(&"up") {
            run.arg("--out-dir").arg(d.join("out"));
        }
        let o = run.output();
        clean(&format!("{args:?}"), &o);
        assert!(
            matches!(o.status.code(), Some(1 | 3)),
            "{args:?}: {}",
            text(&o.stderr)
        );
        let all = text(&o.stdout) + &text(&o.stderr);
        assert!(
            all.contains("worker-09"),
            "{args:?}: the hostile text is shown: {all}"
        );
    }
}

/// `imgbuild ARGS` with stdout or stderr on `/dev/full` or closed.
fn with_streams(args: &[&str], stdout: &str, stderr: &str) -> Output {
    let line = format!(
        "exec \"$0\" \"$@\" {}{}",
        match stdout {
            "full" => ">/dev/full ",
            "closed" => ">&- ",
            _ => "",
        },
        match stderr {
            "full" => "2>/dev/full",
            "closed" => "2>&-",
            _ => "",
        }
    );
    Command::new("sh")
        .arg("-c")
        .arg(line)
        .arg(env!("CARGO_BIN_EXE_imgbuild"))
        .args(args)
        .env_remove("IMGBUILD_CONFIG")
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn a_full_or_closed_stderr_never_panics_and_keeps_the_exit_code() {
    let missing = ["--config", "/nonexistent/cluster.yaml", "validate"];
    for stderr in ["full", "closed"] {
        let o = with_streams(&missing, "", stderr);
        assert_eq!(o.status.code(), Some(2), "2>{stderr}: {o:?}");
        // A usage error clap reports, and a failure of a later stage.
        let o = with_streams(&["validate", "--no-such-flag"], "", stderr);
        assert_eq!(o.status.code(), Some(2), "2>{stderr}: {o:?}");
        let o = with_streams(&["inspect", "/nonexistent.raw"], "", stderr);
        assert_eq!(o.status.code(), Some(1), "2>{stderr}: {o:?}");
        // The --show-secrets notice goes to stderr too.
        let o = with_streams(&["--show-secrets", "completions", "bash"], "", stderr);
        assert_eq!(o.status.code(), Some(0), "2>{stderr}: {o:?}");
    }
    // A full stdout is one message on stderr and exit 1, also when stderr
    // is full as well.
    let o = with_streams(&["completions", "bash"], "full", "");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(text(&o.stderr).contains("writing to stdout"), "{o:?}");
    let o = with_streams(&["completions", "bash"], "full", "full");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    // Help and version too: clap's own printing would say 0.
    for flag in ["--help", "--version", "-h", "-V"] {
        let o = with_streams(&[flag], "full", "");
        assert_eq!(o.status.code(), Some(1), "{flag} >/dev/full: {o:?}");
        let o = with_streams(&[flag], "", "");
        assert_eq!(o.status.code(), Some(0), "{flag}: {o:?}");
        assert!(text(&o.stdout).contains("imgbuild"), "{flag}: {o:?}");
    }
}

#[test]
fn progress_into_a_closed_stderr_does_not_stop_a_run() {
    let net = net(12);
    let _nodes = Nodes::start(&[
        "--node",
        &format!("cp-01={net}.11:controlplane"),
        "--node",
        &format!("worker-01={net}.21:worker"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("cluster.yaml"),
        inventory(&net, "http://127.0.0.1:9"),
    )
    .unwrap();
    let config = d.join("cluster.yaml");
    for stderr in ["closed", "full"] {
        let o = with_streams(
            &[
                "--config",
                config.to_str().unwrap(),
                "bootstrap",
                "--new-secrets",
                "--poll",
                "100ms",
                "--node-timeout",
                "20s",
                "--health-timeout",
                "30s",
            ],
            "",
            stderr,
        );
        assert_eq!(o.status.code(), Some(0), "2>{stderr}: {o:?}");
        clean("bootstrap", &o);
    }
}
