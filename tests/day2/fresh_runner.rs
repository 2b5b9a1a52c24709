//! A CI runner holds no state (issue 38): what a run learns must come back
//! from the cluster, not only from the state dir of the machine it ran on.
//! A cluster is made from one checkout (the laptop); a second run starts
//! with a new, empty state dir holding only the cluster's secrets (a fresh
//! runner) and must do what the laptop would.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::inventory::{Inventory, NODES};
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
        let nodes = Nodes::cluster(
            &net,
            true,
            &[
                "--talos-version",
                version,
                "--reboot-delay",
                "300",
                "--upgrade-delay",
                "50",
            ],
        );
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
        self.write(version, gone, "");
    }

    /// The inventory asks for Talos `version`, with `cluster_extra` (lines
    /// of YAML) in its `cluster` section.
    fn write(&self, version: &str, gone: &[&str], cluster_extra: &str) {
        let mut inv = Inventory::five_nodes("sim", &self.net)
            .talos(version)
            .factory(&self.factory.url);
        for name in gone {
            inv = inv.without_node(name);
        }
        let text = inv
            .text()
            .replacen("cluster:\n", &format!("cluster:\n{cluster_extra}"), 1);
        std::fs::write(&self.config, text).unwrap();
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
        self.nodes.wait_for_version(node, version);
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
            "upgrade",
            "--dry-run",
            "--state-dir",
            fresh.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let planned = json(&o);
    assert!(
        planned["notes"].to_string().contains(
            "cp-01: left cordoned by a stopped run (its imgbuild/cordoned mark): uncordoned once Ready"
        ),
        "the fresh runner's plan names the cordon: {planned}"
    );
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
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        text(&o.stderr),
        text(&o.stdout)
    );
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

/// The snapshots (not their `.sha256` records) in `dir`, sorted.
fn snapshots_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".snapshot"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn etcd_snapshots_go_where_the_user_says_and_the_run_prints_the_path() {
    // Talos v1.11.2 → v1.11.5. A CI job keeps the snapshot taken before
    // the first control-plane change as an artifact: the inventory's
    // `cluster.etcdSnapshotDir` (relative to the inventory) or
    // `--etcd-snapshot-dir` (which wins) says where; the state dir then
    // holds none. A link where the folder should be is refused before any
    // node is touched.
    let c = Cluster::start(2, "v1.11.2", "v1.11.2,v1.11.5");
    c.write("v1.11.5", &[], "  etcdSnapshotDir: snapshots\n");
    let state_snapshots = c.state().join("etcd");
    let real = c.dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let link = c.dir.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let o = imgbuild(
        &c.config,
        &[
            "upgrade",
            "cp-01",
            "--etcd-snapshot-dir",
            link.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("a link"), "{}", text(&o.stderr));
    assert_eq!(c.per_node("upgrade_calls"), [0; 5], "nothing upgraded");
    assert!(snapshots_in(&real).is_empty());

    // The inventory's setting, relative to the inventory's folder; the
    // text output names the file.
    let o = imgbuild(&c.config, &["upgrade", "cp-01"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let in_inventory_dir = c.dir.path().join("snapshots");
    let taken = snapshots_in(&in_inventory_dir);
    assert_eq!(taken.len(), 1, "{taken:?}");
    let path = in_inventory_dir.join(&taken[0]);
    assert!(
        text(&o.stderr).contains(&format!("note: etcd snapshot: {}", path.display())),
        "{}",
        text(&o.stderr)
    );
    assert!(snapshots_in(&state_snapshots).is_empty());

    // `up --etcd-snapshot-dir` wins over the inventory; its dry run and
    // its JSON name the folder, then the file.
    let artifacts = c.dir.path().join("artifacts/etcd");
    let out_dir = c.dir.path().join("out");
    let args = |dry: bool| {
        let mut a = vec![
            "--output",
            "json",
            "up",
            "--out-dir",
            out_dir.to_str().unwrap(),
        ];
        a.extend(["--etcd-snapshot-dir", artifacts.to_str().unwrap()]);
        if dry {
            a.push("--dry-run");
        }
        a
    };
    let o = imgbuild(&c.config, &args(true));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let planned = json(&o).to_string();
    assert!(
        planned.contains(&format!("into {}, before", artifacts.display())),
        "{planned}"
    );
    let o = imgbuild(&c.config, &args(false));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let taken = snapshots_in(&artifacts);
    assert_eq!(taken.len(), 1, "{taken:?}");
    let done = json(&o).to_string();
    assert!(
        done.contains(&artifacts.join(&taken[0]).display().to_string()),
        "{done}"
    );
    assert_eq!(snapshots_in(&in_inventory_dir).len(), 1, "the flag won");
    assert!(snapshots_in(&state_snapshots).is_empty());
    for (name, _, _) in NODES {
        assert_eq!(c.day2(name, "version"), "v1.11.5", "{name}");
    }
}
