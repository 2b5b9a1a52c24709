//! A CI runner holds no state (issue 38): the demo cluster is made from a
//! laptop checkout and its secrets kept in Git as `secrets.sops.yaml`; a
//! fresh clone holding only the inventory, that file, the age key and the
//! Proxmox token plans exactly what the laptop plans, carries out a Talos
//! upgrade, and leaves the laptop's view clean. Neither checkout's state
//! dir holds a secret in clear once the secrets come from SOPS.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::demo::DemoCluster as Cluster;
use common::run::Run;
use common::{json, stdout_ok, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// One checkout of the cluster's repository: its inventory, its own state
/// dir (`<dir>/state`) and folders, the simulators of `cluster`, and only
/// the age key and the Proxmox token from the CI system's secrets.
struct Checkout<'a> {
    cluster: &'a Cluster,
    dir: PathBuf,
    key: PathBuf,
}

impl Checkout<'_> {
    fn config(&self) -> PathBuf {
        self.dir.join("cluster.yaml")
    }

    fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    fn run(&self, args: &[&str]) -> Output {
        let c = self.cluster;
        let mut run = Run::with_config(&self.config(), args);
        if !args.contains(&"secrets") {
            run.timeouts(args);
        }
        run.arg("--state-dir")
            .arg(self.state())
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .env_remove("KUBECONFIG")
            .env_remove("SOPS_AGE_KEY")
            .env("SOPS_AGE_KEY_FILE", &self.key)
            .env("HOME", self.dir.join("home"))
            .proxmox(&c.pve);
        if args.contains(&"up") {
            run.factory(&c.factory)
                .args(["--poll-ms", "50", "--quiet"])
                .folders(&self.dir);
        } else {
            run.args(["--factory", &c.factory.url]);
        }
        run.output()
    }

    /// `up --dry-run` as JSON, this checkout's folder written `$CHECKOUT`
    /// (the only text two checkouts' plans may differ in).
    fn plan(&self) -> serde_json::Value {
        let out = self.run(&["--output", "json", "up", "--dry-run"]);
        let text = stdout_ok(&out).replace(self.dir.to_str().unwrap(), "$CHECKOUT");
        serde_json::from_str(&text).unwrap()
    }
}

/// The planned actions of an `up --dry-run` document, as they compare
/// across checkouts: kind, node, from → to, in order.
fn rows(v: &serde_json::Value) -> Vec<serde_json::Value> {
    v["plan"].as_array().expect("a plan array").clone()
}

/// Every string of the cluster's secrets bundle long enough to be a key,
/// a token or a certificate.
fn secret_values(secrets_yaml: &str) -> Vec<String> {
    fn walk(v: &serde_yaml_ng::Value, out: &mut Vec<String>) {
        match v {
            serde_yaml_ng::Value::String(s) if s.len() >= 16 => out.push(s.clone()),
            serde_yaml_ng::Value::Mapping(m) => m.values().for_each(|v| walk(v, out)),
            serde_yaml_ng::Value::Sequence(s) => s.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&serde_yaml_ng::from_str(secrets_yaml).unwrap(), &mut out);
    assert!(out.len() >= 8, "too few secrets found: {}", out.len());
    out
}

/// No file under `dir` holds one of `secrets`, nor is named as a clear
/// secrets file.
fn assert_no_secret_under(dir: &Path, secrets: &[String], after: &str) {
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                !["secrets.yaml", "talosconfig", "kubeconfig"].contains(&name.as_str()),
                "after {after}: {} in the state dir of a SOPS cluster",
                path.display()
            );
            let bytes = std::fs::read(&path).unwrap();
            let body = String::from_utf8_lossy(&bytes);
            for s in secrets {
                assert!(
                    !body.contains(s.as_str()),
                    "after {after}: {} holds a secret of the bundle in clear",
                    path.display()
                );
            }
        }
    }
}

/// The laptop makes the cluster and keeps its secrets in Git; a fresh
/// clone with only that file, the age key and the token plans nothing,
/// then plans a Talos bump exactly as the laptop does and carries it out;
/// the laptop's `status --check` is clean afterwards.
#[test]
fn a_fresh_clone_with_only_the_sops_file_plans_and_runs_what_the_laptop_would() {
    let c = Cluster::start(net(1));
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("age.key");
    let recipient = common::age_keygen(&key);
    let laptop = Checkout {
        cluster: &c,
        dir: c.dir.path().to_owned(),
        key: key.clone(),
    };
    std::fs::create_dir_all(laptop.dir.join("home")).unwrap();

    // The laptop: secrets made on purpose, the cluster up, the secrets
    // encrypted beside the inventory as the guide says.
    stdout_ok(&laptop.run(&["secrets", "gen"]));
    let out = laptop.run(&["--output", "json", "up"]);
    stdout_ok(&out);
    assert_eq!(json(&out)["healthy"], true, "{}", text(&out.stdout));
    stdout_ok(&laptop.run(&["secrets", "encrypt", "--age", &recipient]));
    let sops = laptop.dir.join("secrets.sops.yaml");
    assert!(sops.is_file());
    let secrets =
        secret_values(&std::fs::read_to_string(laptop.state().join("secrets.yaml")).unwrap());

    // The fresh clone: the committed files only.
    let clone_dir = tempfile::tempdir().unwrap();
    let clone = Checkout {
        cluster: &c,
        dir: clone_dir.path().to_owned(),
        key,
    };
    std::fs::create_dir_all(clone.dir.join("home")).unwrap();
    std::fs::copy(laptop.config(), clone.config()).unwrap();
    std::fs::copy(&sops, clone.dir.join("secrets.sops.yaml")).unwrap();

    // Nothing to do, and the clone sees that.
    let applies = c.nodes.stats();
    let planned = clone.plan();
    assert_eq!(rows(&planned), Vec::<serde_json::Value>::new(), "{planned}");
    assert_no_secret_under(&clone.state(), &secrets, "up --dry-run");
    assert_eq!(
        c.nodes.stats()["nodes"]["cp-01"]["applies"],
        applies["nodes"]["cp-01"]["applies"],
        "a dry run applied a config"
    );

    // A checkout without the SOPS file cannot pass for this cluster with
    // new secrets: its nodes are configured, so --new-secrets is refused
    // in the dry run as in the run, and nothing is made.
    let stranger_dir = tempfile::tempdir().unwrap();
    let stranger = Checkout {
        cluster: &c,
        dir: stranger_dir.path().to_owned(),
        key: clone.key.clone(),
    };
    std::fs::copy(laptop.config(), stranger.config()).unwrap();
    for args in [
        &["up", "--dry-run", "--new-secrets"][..],
        &["up", "--new-secrets"],
    ] {
        let o = stranger.run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stdout));
        let err = text(&o.stderr);
        assert!(
            err.contains("node cp-01") && err.contains("is already configured"),
            "{args:?}: {err}"
        );
        assert!(!stranger.state().join("secrets.yaml").exists(), "{args:?}");
    }

    // A Talos bump, committed: both checkouts plan the same actions.
    let bumped = c.inventory().talos("v1.11.5");
    bumped.write_to(&laptop.config());
    bumped.write_to(&clone.config());
    let on_laptop = laptop.plan();
    let on_clone = clone.plan();
    assert!(
        rows(&on_clone)
            .iter()
            .any(|a| a["kind"]["kind"] == "upgradeTalos" && a["node"] == "worker-02"),
        "{on_clone}"
    );
    assert_eq!(
        rows(&on_clone),
        rows(&on_laptop),
        "the fresh clone plans otherwise than the laptop"
    );
    // The whole document too, but for how long each took.
    let timeless = |v: &serde_json::Value| {
        let mut v = v.clone();
        v.as_object_mut().unwrap().remove("elapsedMs");
        v
    };
    assert_eq!(timeless(&on_clone), timeless(&on_laptop));

    // The clone carries it out; every node runs the new version.
    let out = clone.run(&["--output", "json", "up"]);
    stdout_ok(&out);
    assert_eq!(json(&out)["healthy"], true, "{}", text(&out.stdout));
    assert_no_secret_under(&clone.state(), &secrets, "up");
    let stats = c.nodes.stats();
    for (node, ..) in common::inventory::NODES {
        assert_eq!(
            stats["nodes"][node]["day2"]["upgrades"].as_u64(),
            Some(1),
            "{node}: {}",
            stats["nodes"][node]
        );
    }

    // The laptop afterwards: every node and Kubernetes component known and
    // current, and nothing left to plan.
    let out = laptop.run(&["--output", "json", "status", "--check"]);
    stdout_ok(&out);
    let status = text(&out.stdout);
    assert!(!status.contains("\"unknown\""), "{status}");
    assert_eq!(rows(&laptop.plan()), Vec::<serde_json::Value>::new());
}
