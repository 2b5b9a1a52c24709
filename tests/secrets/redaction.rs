//! End to end (issue 29): secrets stay secret. A two-node cluster on the
//! node simulator (Talos v1.11.2) with the tailscale patch that
//! `${TS_AUTHKEY}` fills in; then the key, the machine token and the
//! Kubernetes CA key all change next to other lines, and `apply --dry-run`,
//! `apply`, `status`, `up`, `config`, `--output json` and the error paths
//! are grepped, raw bytes of stdout and stderr, for every old and new value.
//! `--show-secrets` shows them on a pseudo-terminal only (util-linux
//! `script`). The state dir and `out/` stay out of a Git commit, and a
//! world-readable `secrets.yaml` is named once.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::text;

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// Non-ASCII, so a spelling other than UTF-8 (a `\u` escape, percent- or
/// base64-encoding) would differ from the raw bytes; the ASCII tail is
/// grepped too, for any spelling that keeps it.
const KEY1: &str = "tskey-auth-kÖnig€🔑-FIRSTVALUE0123456789";
const KEY2: &str = "tskey-auth-ßecond€🔑-OTHERVALUE9876543210";

fn tailscale(routes: &str) -> String {
    format!(
        "machine:\n  sysctls:\n    net.ipv4.ip_forward: \"1\"\n---\napiVersion: v1alpha1\nkind: ExtensionServiceConfig\nname: tailscale\nenvironment:\n  - TS_AUTHKEY=${{TS_AUTHKEY}}\n  - TS_ROUTES={routes}\n"
    )
}

fn inventory(net: &str) -> String {
    inventory_on(net, Inventory::new("sec"))
}

fn inventory_on(net: &str, base: Inventory) -> String {
    base.endpoint(&format!("{net}.11"))
        .no_nameservers()
        .node(Node::new("cp-01", "controlplane").address(&format!("{net}.11")))
        .node(Node::new("worker-01", "worker").address(&format!("{net}.21")))
        .append("patches:\n  all: [ts.yaml]\n")
        .text()
}

fn sim(net: &str) -> Nodes {
    Nodes::start(&[
        "--node",
        &format!("cp-01={net}.11:controlplane"),
        "--node",
        &format!("worker-01={net}.21:worker"),
    ])
}

/// `imgbuild --config <dir>/cluster.yaml ARGS` with test-sized timeouts
/// where the command takes them, `TS_AUTHKEY` = `key`.
fn run(dir: &Path, args: &[&str], key: Option<&str>) -> Output {
    let mut run = Run::with_config(&dir.join("cluster.yaml"), args);
    run.env_remove("TALOSCONFIG")
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TS_AUTHKEY")
        .env_remove("IMGBUILD_FACTORY");
    if let Some(key) = key {
        run.env("TS_AUTHKEY", key);
    }
    let day2 = [
        "up",
        "bootstrap",
        "--new-secrets",
        "apply",
        "status",
        "upgrade",
    ];
    if args.iter().any(|a| day2.contains(a)) {
        run.timeouts(&[]);
    }
    if (args.contains(&"up") || args.contains(&"bootstrap")) && !args.contains(&"--new-secrets") {
        // A new cluster: its secrets are made on the first run.
        run.arg("--new-secrets");
    }
    if args.contains(&"up") {
        run.arg("--out-dir").arg(dir.join("out"));
    }
    run.output()
}

/// A field of the state dir's secrets.yaml.
fn field(dir: &Path, path: &[&str]) -> String {
    let text = std::fs::read_to_string(dir.join(".talos/sec/secrets.yaml")).unwrap();
    let mut v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    for p in path {
        v = v[*p].clone();
    }
    v.as_str().unwrap().to_owned()
}

/// What must never be shown: each value, its ASCII tail, and for a
/// base64 PEM key its first line of key material.
fn spellings(values: &[String]) -> Vec<String> {
    use base64::Engine as _;
    let mut out = Vec::new();
    for v in values {
        out.push(v.clone());
        if let Some((_, tail)) = v.rsplit_once('-') {
            out.push(tail.to_owned());
        }
        if let Ok(pem) = base64::engine::general_purpose::STANDARD.decode(v)
            && let Ok(pem) = String::from_utf8(pem)
        {
            out.extend(
                pem.lines()
                    .filter(|l| !l.starts_with("-----") && l.len() > 20)
                    .map(str::to_owned),
            );
        }
    }
    out
}

/// Fails naming the command when any secret is in its stdout or stderr.
fn shows_none(what: &str, o: &Output, secrets: &[String]) {
    for s in spellings(secrets) {
        for (stream, bytes) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
            assert!(
                !bytes.windows(s.len()).any(|w| w == s.as_bytes()),
                "{what}: {stream} shows a secret ({s}):\n{}",
                text(bytes)
            );
        }
    }
}

/// Replaces the state dir's machine token and Kubernetes CA with those of
/// another bundle (made by imgbuild in `other`): what a rotation does,
/// without touching the OS CA the API's mTLS rests on.
fn rotate(dir: &Path) {
    let other = dir.join("other");
    let o = Run::with_config(
        &dir.join("cluster.yaml"),
        &["secrets", "gen", "--state-dir"],
    )
    .arg(&other)
    .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let read = |p: &Path| -> serde_yaml_ng::Value {
        serde_yaml_ng::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let path = dir.join(".talos/sec/secrets.yaml");
    let mut ours = read(&path);
    let theirs = read(&other.join("secrets.yaml"));
    ours["trustdinfo"]["token"] = theirs["trustdinfo"]["token"].clone();
    ours["certs"]["k8s"] = theirs["certs"]["k8s"].clone();
    std::fs::write(&path, serde_yaml_ng::to_string(&ours).unwrap()).unwrap();
}

#[test]
fn no_command_shows_the_auth_key_the_machine_token_or_a_ca_key() {
    let net = net(1);
    let nodes = sim(&net);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("ts.yaml"), tailscale("10.0.0.0/8")).unwrap();
    std::fs::write(d.join("cluster.yaml"), inventory(&net)).unwrap();

    let o = run(d, &["bootstrap", "--new-secrets"], Some(KEY1));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let token1 = field(d, &["trustdinfo", "token"]);
    let ca1 = field(d, &["certs", "k8s", "key"]);
    let mut secrets = vec![KEY1.to_owned(), token1.clone(), ca1.clone()];
    shows_none("bootstrap", &o, &secrets);
    assert_eq!(nodes.stats()["totals"]["applies"], 2);

    // The rendered config holds all three; printed, it shows none.
    for args in [
        &["config", "cp-01"][..],
        &["--output", "json", "config", "cp-01"],
    ] {
        let o = run(d, args, Some(KEY1));
        assert!(o.status.success(), "{}", text(&o.stderr));
        shows_none(&args.join(" "), &o, &secrets);
        let out = text(&o.stdout);
        for mark in [
            "<redacted: TS_AUTHKEY>",
            "<redacted: ",
            "token: '<redacted: ",
        ] {
            assert!(out.contains(mark), "{mark}: {out}");
        }
        // Still YAML, as another parser reads it: the placeholders are
        // quoted strings.
        let yaml = if args[0] == "--output" {
            common::json(&o)["config"].as_str().unwrap().to_owned()
        } else {
            out.clone()
        };
        let token = python_yaml(&yaml, "docs[0]['machine']['token']");
        assert!(token.starts_with("<redacted: "), "{token}");
    }
    let shown = run(
        d,
        &["config", "cp-01", "--show-secrets", "--yes"],
        Some(KEY1),
    );
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    assert_eq!(
        python_yaml(&text(&shown.stdout), "docs[0]['machine']['token']"),
        token1
    );
    // Written where asked, 0600, it holds them.
    let file = d.join("cp-01.yaml");
    let o = run(
        d,
        &["config", "cp-01", "--out", file.to_str().unwrap()],
        Some(KEY1),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let written = std::fs::read_to_string(&file).unwrap();
    assert!(written.contains(KEY1) && written.contains(&token1) && written.contains(&ca1));
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    // A new key, a new token and a new CA, and a change on the line next
    // to the key.
    rotate(d);
    std::fs::write(d.join("ts.yaml"), tailscale("10.1.0.0/16")).unwrap();
    let token2 = field(d, &["trustdinfo", "token"]);
    let ca2 = field(d, &["certs", "k8s", "key"]);
    assert_ne!(token1, token2);
    secrets.extend([KEY2.to_owned(), token2, ca2]);

    for args in [
        &["apply", "--dry-run"][..],
        &["--output", "json", "apply", "--dry-run"],
    ] {
        let o = run(d, args, Some(KEY2));
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        shows_none(&args.join(" "), &o, &secrets);
        // The diff is there, its secret lines redacted (old ones too).
        let out = text(&o.stdout);
        assert!(out.contains("10.1.0.0/16"), "{out}");
        for mark in [
            "TS_AUTHKEY=<redacted: TS_AUTHKEY>",
            "token: <redacted: ",
            "key: <redacted: ",
        ] {
            assert!(out.contains(mark), "{args:?} {mark}: {out}");
        }
    }
    for args in [
        &["apply"][..],
        &["status"],
        &["--output", "json", "status"],
        &["up"],
        &["--output", "json", "up"],
        &["--output", "json", "apply"],
    ] {
        let o = run(d, args, Some(KEY2));
        assert!(
            matches!(o.status.code(), Some(0 | 1 | 3)),
            "{args:?}: {}",
            text(&o.stderr)
        );
        shows_none(&args.join(" "), &o, &secrets);
    }

    // Error paths: a damaged talosconfig (its key in the parse error), a
    // bad patch that quotes the key, a factory URL with the key as its
    // password, an unset variable.
    let tc = d.join(".talos/sec/talosconfig");
    let good = std::fs::read_to_string(&tc).unwrap();
    std::fs::write(&tc, good.replacen("key:", "key: [", 1)).unwrap();
    for args in [&["status"][..], &["--output", "json", "apply"]] {
        let o = run(d, args, Some(KEY2));
        assert_ne!(o.status.code(), Some(101), "{}", text(&o.stderr));
        shows_none(&format!("damaged talosconfig: {args:?}"), &o, &secrets);
    }
    std::fs::write(&tc, good).unwrap();
    std::fs::write(
        d.join("ts.yaml"),
        format!("machine:\n  kubelet:\n    image: 5\n    extraArgs: {{a: {KEY2}}}\n    imagee: \"${{TS_AUTHKEY}}\"\n"),
    )
    .unwrap();
    for args in [
        &["apply", "--dry-run"][..],
        &["--output", "json", "status"],
        &["validate"],
    ] {
        let o = run(d, args, Some(KEY2));
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "{args:?}: {}",
            text(&o.stderr)
        );
        shows_none(&format!("bad patch: {args:?}"), &o, &secrets);
    }
    std::fs::write(d.join("ts.yaml"), tailscale("10.1.0.0/16")).unwrap();
    let o = run(
        d,
        &[
            "--factory",
            &format!("http://admin:{KEY2}@127.0.0.1:9/"),
            "--output",
            "json",
            "up",
        ],
        Some(KEY2),
    );
    assert_ne!(o.status.code(), Some(101), "{}", text(&o.stderr));
    shows_none("factory password", &o, &secrets);
    let o = run(d, &["apply", "--dry-run"], None);
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "{}",
        text(&o.stderr)
    );
    shows_none("unset variable", &o, &secrets);

    // --show-secrets: off a terminal it is refused (without --yes)…
    let o = run(d, &["config", "cp-01", "--show-secrets"], Some(KEY2));
    assert!(o.status.success());
    shows_none("--show-secrets off a terminal", &o, &secrets);
    assert!(
        text(&o.stderr).contains("--show-secrets ignored"),
        "{}",
        text(&o.stderr)
    );
    // …given with --yes…
    let o = run(
        d,
        &["config", "cp-01", "--show-secrets", "--yes"],
        Some(KEY2),
    );
    assert!(text(&o.stdout).contains(KEY2), "{}", text(&o.stdout));
    // …and on a pseudo-terminal it shows them.
    let shown = on_a_terminal(d, &["config", "cp-01", "--show-secrets"], KEY2);
    assert!(shown.contains(&format!("TS_AUTHKEY={KEY2}")), "{shown}");
    let hidden = on_a_terminal(d, &["config", "cp-01"], KEY2);
    assert!(hidden.contains("<redacted: TS_AUTHKEY>"), "{hidden}");
    assert!(!hidden.contains(KEY2), "{hidden}");
}

/// imgbuild's output on a pseudo-terminal, through util-linux `script`.
fn on_a_terminal(dir: &Path, args: &[&str], key: &str) -> String {
    let mut line = format!(
        "{} --config {}",
        env!("CARGO_BIN_EXE_imgbuild"),
        dir.join("cluster.yaml").display()
    );
    for a in args {
        line.push(' ');
        line.push_str(a);
    }
    let o = Command::new("script")
        .args(["-q", "-e", "-c", &line, "/dev/null"])
        .env("TS_AUTHKEY", key)
        .env("TERM", "xterm-256color")
        .env("NO_COLOR", "1")
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output()
        .expect("util-linux script (make deps)");
    text(&o.stdout)
}

#[test]
fn a_world_readable_secrets_file_is_named_once_and_fixed_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("ts.yaml"), tailscale("10.0.0.0/8")).unwrap();
    std::fs::write(d.join("cluster.yaml"), inventory(&net(2))).unwrap();
    let o = run(d, &["secrets", "gen"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let secrets = d.join(".talos/sec/secrets.yaml");
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o644)).unwrap();

    let o = run(d, &["config", "cp-01"], Some(KEY1));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("secrets.yaml")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains(&secrets.display().to_string()) && warnings[0].contains("0644"),
        "{err}"
    );

    let o = run(d, &["--fix-permissions", "config", "cp-01"], Some(KEY1));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mode = std::fs::metadata(&secrets).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let o = run(d, &["config", "cp-01"], Some(KEY1));
    assert!(
        !text(&o.stderr).contains("secrets.yaml"),
        "{}",
        text(&o.stderr)
    );
}

fn git(dir: &Path, args: &[&str]) -> String {
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "t")
        .env("GIT_AUTHOR_EMAIL", "t@example.invalid")
        .env("GIT_COMMITTER_NAME", "t")
        .env("GIT_COMMITTER_EMAIL", "t@example.invalid")
        .output()
        .unwrap();
    assert!(o.status.success(), "git {args:?}: {}", text(&o.stderr));
    text(&o.stdout)
}

#[test]
fn after_up_in_a_git_repository_nothing_of_the_state_dir_or_out_is_staged() {
    let net = net(3);
    let _nodes = sim(&net);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let factory = Sim::start(&[]);
    let cache = tempfile::tempdir().unwrap();
    git(d, &["init", "-q"]);
    std::fs::write(d.join("ts.yaml"), tailscale("10.0.0.0/8")).unwrap();
    std::fs::write(
        d.join("cluster.yaml"),
        inventory_on(&net, Inventory::new("sec").factory(&factory.url)),
    )
    .unwrap();
    // The images, then the cluster (no publish target: bare metal).
    let out = d.join("out");
    let o = run(
        d,
        &[
            "build",
            "--out-dir",
            out.to_str().unwrap(),
            "--cache-dir",
            cache.path().to_str().unwrap(),
        ],
        Some(KEY1),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run(d, &["--output", "json", "up"], Some(KEY1));
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(d.join(".talos/sec/kubeconfig").exists());
    assert!(d.join("out").is_dir());
    git(d, &["add", "-A"]);
    let staged = git(d, &["status", "--porcelain"]);
    let mut files: Vec<&str> = staged.lines().map(|l| l[3..].trim_matches('"')).collect();
    files.sort_unstable();
    assert_eq!(files, ["cluster.yaml", "ts.yaml"], "{staged}");

    // Forced in anyway: the next run says so, once.
    git(d, &["add", "-f", ".talos/sec/secrets.yaml"]);
    let o = run(d, &["config", "cp-01"], Some(KEY1));
    let err = text(&o.stderr);
    let tracked: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("tracked by Git"))
        .collect();
    assert_eq!(tracked.len(), 1, "{err}");
    assert!(tracked[0].contains(".talos/sec/secrets.yaml"), "{err}");
}

/// `expr` (Python over `docs`, the YAML documents of `yaml`) as PyYAML
/// reads them: a YAML parser that is not the one imgbuild writes with.
fn python_yaml(yaml: &str, expr: &str) -> String {
    use std::io::Write;
    // Debian's python3-yaml (`make deps`).
    let mut child = std::process::Command::new("/usr/bin/python3")
        .args([
            "-c",
            &format!("import sys, yaml; docs = list(yaml.safe_load_all(sys.stdin)); print({expr})"),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with PyYAML");
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
    text(&o.stdout).trim_end().to_owned()
}
