//! A CI runner holds no state (issue 38): what a run learns must come back
//! from the cluster, not only from the state dir of the machine it ran on.
//! A cluster is made from one checkout (the laptop); a second run starts
//! with a new, empty state dir holding only the cluster's secrets (a fresh
//! runner) and must do what the laptop would.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

fn run(config: &Path, args: &[&str]) -> Run {
    let mut r = Run::with_config(config, args);
    r.timeouts(&[]);
    r.env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    r
}

fn imgbuild(config: &Path, args: &[&str]) -> Output {
    run(config, args).output()
}

/// The five [`NODES`] (3 control planes, 2 workers) on the node simulator,
/// bootstrapped from the laptop's checkout (its state dir beside the
/// inventory), the secrets made first with `secrets gen`.
struct Cluster {
    factory: Sim,
    nodes: Nodes,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
}

impl Cluster {
    fn start(block: u32, version: &str, offered: &str) -> Cluster {
        let factory = Sim::start_with(&[], 0, &["--versions", offered]);
        let net = net(block);
        let mut args: Vec<String> = [
            "--talos-version",
            version,
            "--reboot-delay",
            "300",
            "--upgrade-delay",
            "50",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (name, host, role) in NODES {
            args.extend(["--node".to_owned(), format!("{name}={net}.{host}:{role}")]);
        }
        args.extend(["--vip".to_owned(), format!("{net}.10")]);
        let nodes = Nodes::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        let c = Cluster {
            factory,
            nodes,
            dir,
            config,
            net,
        };
        c.want(version);
        let o = Run::with_config(&c.config, &["secrets", "gen"]).output();
        assert!(o.status.success(), "secrets gen: {}", text(&o.stderr));
        let o = imgbuild(&c.config, &["--output", "json", "bootstrap"]);
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory asks for Talos `version`.
    fn want(&self, version: &str) {
        self.keep(version, &[]);
    }

    /// The inventory asks for Talos `version` and no longer has `gone`.
    fn keep(&self, version: &str, gone: &[&str]) {
        let mut inv = Inventory::new("sim")
            .vip(&format!("{}.10", self.net))
            .talos(version)
            .factory(&self.factory.url);
        for (name, host, role) in NODES.iter().filter(|(n, _, _)| !gone.contains(n)) {
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", self.net)));
        }
        std::fs::write(&self.config, inv.text()).unwrap();
    }

    /// The laptop's state dir.
    fn state(&self) -> PathBuf {
        self.dir.path().join(".talos/sim")
    }

    /// A fresh runner's state dir: new, holding only the secrets.
    fn fresh_state(&self) -> PathBuf {
        let fresh = self.dir.path().join("runner-state");
        std::fs::create_dir(&fresh).unwrap();
        std::fs::copy(
            self.state().join("secrets.yaml"),
            fresh.join("secrets.yaml"),
        )
        .unwrap();
        std::fs::copy(self.state().join("kubeconfig"), fresh.join("kubeconfig")).unwrap(); // until kube38
        fresh
    }

    fn stats(&self) -> serde_json::Value {
        self.nodes.stats()
    }

    fn day2(&self, node: &str, field: &str) -> serde_json::Value {
        self.stats()["nodes"][node]["day2"][field].clone()
    }

    fn per_node(&self, field: &str) -> Vec<u64> {
        let stats = self.stats();
        NODES
            .iter()
            .map(|(n, _, _)| stats["nodes"][n]["day2"][field].as_u64().unwrap_or(0))
            .collect()
    }

    /// Waits until `node` runs `version` and is configured again.
    fn wait_for_version(&self, node: &str, version: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            let stats = self.stats();
            if stats["nodes"][node]["day2"]["version"] == version
                && stats["nodes"][node]["phase"] == "configured"
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("{node} never came up on {version}");
    }
}

#[test]
fn an_upgrade_killed_on_one_runner_is_finished_by_up_on_a_fresh_runner() {
    // Talos v1.13.3 → v1.13.5 through LifecycleService, which the client
    // cordons and drains for (v1.13 on). The laptop's `up` is SIGKILLed
    // while cp-01 reboots into v1.13.5: cp-01 is left cordoned, and the
    // laptop's upgrades.json, which names that cordon, stays on the laptop.
    // A fresh runner's `up` (a new state dir with only the secrets) finds
    // the cordon by imgbuild's mark on the Kubernetes node and cp-01's
    // version from cp-01: it uncordons cp-01 without upgrading it again and
    // upgrades the other four.
    let c = Cluster::start(0, "v1.13.3", "v1.13.3,v1.13.5");
    c.want("v1.13.5");
    let out_dir = c.dir.path().join("out");
    let out = out_dir.to_str().unwrap();
    run(&c.config, &["up", "--out-dir", out]).kill_at("cp-01: waiting for the node to reboot");
    assert_eq!(
        c.day2("cp-01", "cordoned"),
        true,
        "the kill left it cordoned"
    );
    c.wait_for_version("cp-01", "v1.13.5");
    assert_eq!(c.per_node("lifecycle_upgrades"), [1, 0, 0, 0, 0]);

    let fresh = c.fresh_state();
    let o = imgbuild(
        &c.config,
        &[
            "--output",
            "json",
            "up",
            "--quiet",
            "--out-dir",
            out,
            "--state-dir",
            fresh.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let report = json(&o);
    for (name, _, _) in NODES {
        assert_eq!(c.day2(name, "version"), "v1.13.5", "{name}: {report}");
        assert_eq!(c.day2(name, "cordoned"), false, "{name} left cordoned");
    }
    assert_eq!(
        c.per_node("lifecycle_upgrades"),
        [1; 5],
        "each node upgraded exactly once: {report}"
    );
    let cp01: Vec<&serde_json::Value> = report["plan"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["node"] == "cp-01" && a["step"] == "upgrade")
        .collect();
    assert_eq!(
        cp01[0]["kind"]["version"]["from"], "v1.13.5",
        "cp-01 is read on the target, not upgraded again: {report}"
    );
}

/// The removal rows of an `up --dry-run --output json` document.
fn removals(plan: &serde_json::Value) -> Vec<serde_json::Value> {
    plan["plan"]
        .as_array()
        .unwrap_or_else(|| panic!("no plan in {plan}"))
        .iter()
        .filter(|a| a["step"] == "remove")
        .cloned()
        .collect()
}

#[test]
fn a_fresh_runner_plans_the_removal_the_laptop_plans() {
    // Talos v1.11.5. worker-02 leaves the inventory. The laptop knows it
    // from its state dir's nodes.json; a fresh runner has no nodes.json and
    // finds worker-02 as the cluster shows it (its Kubernetes Node and
    // InternalIP): both plan the same removal, row for row.
    let c = Cluster::start(1, "v1.11.5", "v1.11.5");
    c.keep("v1.11.5", &["worker-02"]);
    let out_dir = c.dir.path().join("out");
    let out = out_dir.to_str().unwrap();
    let o = imgbuild(
        &c.config,
        &["--output", "json", "up", "--dry-run", "--out-dir", out],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let laptop = removals(&json(&o));
    assert!(!laptop.is_empty(), "the laptop plans no removal");
    assert!(
        laptop.iter().all(|a| a["node"] == "worker-02"),
        "{laptop:#?}"
    );

    let fresh = c.fresh_state();
    assert!(!fresh.join("nodes.json").exists());
    let o = imgbuild(
        &c.config,
        &[
            "--output",
            "json",
            "up",
            "--dry-run",
            "--out-dir",
            out,
            "--state-dir",
            fresh.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(removals(&json(&o)), laptop, "the fresh runner's removal");
    assert_eq!(
        c.stats()["removals"]["calls"],
        serde_json::json!([]),
        "a dry run removes nothing"
    );
}
