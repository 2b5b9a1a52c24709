//! End to end: `imgbuild up` as the reconciler, on the 5-node Proxmox
//! cluster of examples/demo (cp-01..03, worker-01..02, VMs 300..304) built
//! against the factory, Proxmox VE and Talos node simulators on loopback.
//! Each scenario shares one simulated cluster across its steps (the CI
//! machine has two cores). The nodes model Talos v1.11.2, moved to v1.11.5
//! (siderolabs/talos v1.11 `MachineService.Upgrade`, as the node simulator
//! implements it per version).
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::{Nodes, Pve, Sim};
use common::{json, stdout_ok, text};

/// The /24 for scenario `k`, offset by the process id (and apart from the
/// /24s of tests/cli_up.rs, which uses 200..250).
fn net(k: u8) -> String {
    format!("127.{}.{k}", 150 + std::process::id() % 50)
}

/// The three simulators wired as a chain, the inventory's folder, and the
/// inventory's text as the test edits it.
struct Cluster {
    factory: Sim,
    pve: Pve,
    nodes: Nodes,
    dir: tempfile::TempDir,
    net: String,
}

impl Cluster {
    fn start(k: u8) -> Cluster {
        let net = net(k);
        let nodes = Nodes::start(&[
            "--vip",
            &format!("{net}.10"),
            "--reboot-delay",
            "200",
            "--upgrade-delay",
            "50",
        ]);
        let pve = Pve::start(&["--nodes-control", nodes.control.as_str()]);
        let dir = tempfile::tempdir().unwrap();
        let cluster = Cluster {
            factory: Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]),
            pve,
            nodes,
            dir,
            net,
        };
        cluster.write(&cluster.inventory());
        cluster
    }

    /// The demo's shape on this scenario's /24.
    fn inventory(&self) -> Inventory {
        Inventory::five_nodes("demo", &self.net)
            .metal("raw")
            .proxmox(true)
    }

    fn write(&self, inv: &Inventory) {
        inv.write_to(&self.config());
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    /// `imgbuild <args>` on the inventory with the simulators, test-sized
    /// timeouts and this scenario's state dir (and for `up`, its folders).
    fn run(&self, args: &[&str]) -> Output {
        let mut run = Run::with_config(&self.config(), args);
        run.timeouts(args)
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .proxmox(&self.pve);
        if args.contains(&"up") {
            run.factory(&self.factory)
                .args(["--poll-ms", "50", "--quiet"])
                .folders(self.dir.path());
        } else {
            // The installer every config names is at this factory.
            run.args(["--factory", &self.factory.url]);
        }
        run.output()
    }

    /// `imgbuild --output json up <extra>`: its output and document.
    fn up(&self, extra: &[&str]) -> (Output, serde_json::Value) {
        let mut args = vec!["--output", "json", "up"];
        args.extend_from_slice(extra);
        let out = self.run(&args);
        let v = json(&out);
        (out, v)
    }

    fn day2(&self, node: &str, key: &str) -> serde_json::Value {
        self.nodes.stats()["nodes"][node]["day2"][key].clone()
    }

    fn applies(&self) -> Vec<u64> {
        let stats = self.nodes.stats();
        NODES
            .iter()
            .map(|(n, ..)| stats["nodes"][n]["applies"].as_u64().unwrap())
            .collect()
    }
}

/// The plan's actions of `step`, from a JSON report.
fn actions<'a>(v: &'a serde_json::Value, step: &str) -> Vec<&'a serde_json::Value> {
    v["plan"]
        .as_array()
        .unwrap_or_else(|| panic!("no plan in {v}"))
        .iter()
        .filter(|a| a["step"] == step)
        .collect()
}

fn nodes_of(actions: &[&serde_json::Value]) -> Vec<String> {
    let mut out: Vec<String> = actions
        .iter()
        .map(|a| a["node"].as_str().unwrap().to_owned())
        .collect();
    out.sort();
    out
}

fn all_nodes() -> Vec<String> {
    let mut out: Vec<String> = NODES.iter().map(|(n, ..)| n.to_string()).collect();
    out.sort();
    out
}

fn write_patch(dir: &Path) {
    std::fs::write(
        dir.join("sysctl.yaml"),
        "machine:\n  sysctls:\n    net.core.somaxconn: \"65535\"\n",
    )
    .unwrap();
}

/// Talos v1.11.2 → v1.11.5: a patch edit is applied by `up` (exit 0, no
/// drift left), and a `talosVersion` bump is upgraded by `up` as `upgrade`
/// does it, node by node; afterwards nothing is outdated.
#[test]
fn up_converges_a_patch_edit_and_a_version_bump() {
    let c = Cluster::start(1);
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true, "{v}");
    let applied = c.applies();

    // A patch edit: the dry run shows each node's config change (a
    // summary, never the diff), then `up` applies it and exits 0.
    write_patch(c.dir.path());
    c.write(&c.inventory().append("patches:\n  all: [sysctl.yaml]\n"));
    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    let configs = actions(&v, "configs");
    assert_eq!(nodes_of(&configs), all_nodes(), "{v}");
    for a in &configs {
        assert_eq!(a["outcome"], "planned", "{a}");
        assert_eq!(a["what"], "apply config", "{a}");
        assert!(
            a["detail"].as_str().unwrap().contains("machine.sysctls"),
            "{a}"
        );
    }
    assert_eq!(c.applies(), applied, "a dry run applied a config");
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    let configs = actions(&v, "configs");
    assert_eq!(nodes_of(&configs), all_nodes(), "{v}");
    for a in &configs {
        assert_eq!(a["outcome"], "done", "{a}");
    }
    assert_eq!(v["drift"], serde_json::json!([]), "{v}");
    for (now, before) in c.applies().iter().zip(&applied) {
        assert_eq!(*now, before + 1, "one apply per node");
    }
    let status = c.run(&["status", "--check"]);
    stdout_ok(&status);

    // A version bump: planned per node from → to, then upgraded.
    c.write(
        &c.inventory()
            .talos("v1.11.5")
            .append("patches:\n  all: [sysctl.yaml]\n"),
    );
    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    let upgrades = actions(&v, "upgrade");
    assert_eq!(nodes_of(&upgrades), all_nodes(), "{v}");
    for a in &upgrades {
        let talos = &a["changes"][0];
        assert_eq!(talos["field"], "talos", "{a}");
        assert_eq!(talos["from"], "v1.11.2", "{a}");
        assert_eq!(talos["to"], "v1.11.5", "{a}");
    }
    assert!(
        actions(&v, "configs").is_empty(),
        "the upgrade applies them: {v}"
    );
    let text_plan = text(&c.run(&["up", "--dry-run"]).stdout);
    assert!(
        text_plan.contains("plan: upgrade worker-02: upgrade: talos v1.11.2 → v1.11.5"),
        "{text_plan}"
    );
    let uploads = c.pve.stats()["uploads"].clone();
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["drift"], serde_json::json!([]), "{v}");
    for a in actions(&v, "upgrade") {
        assert_eq!(a["outcome"], "done", "{a}");
    }
    for (name, ..) in NODES {
        assert_eq!(c.day2(name, "version"), "v1.11.5", "{name}");
        assert_eq!(c.day2(name, "upgrades"), 1, "{name}");
    }

    // Converged: another `up` uploads nothing, upgrades nothing, and calls
    // nothing outdated.
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert!(actions(&v, "upgrade").is_empty(), "{v}");
    assert!(actions(&v, "configs").is_empty(), "{v}");
    for n in v["nodes"].as_array().unwrap() {
        assert_ne!(n["stages"]["vm"], "outdated", "{n}");
        assert_ne!(n["stages"]["upload"], "uploaded", "{n}");
    }
    assert_eq!(c.pve.stats()["uploads"], uploads, "up uploaded an image");
    for (name, ..) in NODES {
        assert_eq!(c.day2(name, "upgrades"), 1, "{name} upgraded twice");
    }
}
