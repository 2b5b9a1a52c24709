//! Identity before destruction (issue 39): every node shares the
//! cluster's CA, so an mTLS answer at a removed node's address proves only
//! "a node of this cluster". `up --allow-destroy` acts on a node to remove
//! only when the machine answering there has the node ID recorded for it
//! in the state dir's `nodes.json` (the node simulator serves each
//! machine's `Identities.cluster.talos.dev`, new for a new machine, as
//! siderolabs/talos `internal/app/machined/pkg/controllers/cluster/
//! node_identity.go` makes it), and no inventory node's; else it resets
//! nothing, deletes nothing, names the node, the address and both IDs,
//! and exits non-zero.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};
use serde_json::Value;

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

/// The five [`NODES`] on Talos v1.11.5, bootstrapped (the secrets made
/// first with `secrets gen`), the factory simulator offering v1.11.5.
struct Cluster {
    _factory: Sim,
    nodes: Nodes,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
    factory_url: String,
}

const TALOS: &str = "v1.11.5";

impl Cluster {
    fn start(block: u32) -> Cluster {
        let factory = Sim::start_with(&[], 0, &["--versions", TALOS]);
        let net = net(block);
        let mut args: Vec<String> = ["--talos-version", TALOS, "--upgrade-delay", "50"]
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
        let factory_url = factory.url.clone();
        let c = Cluster {
            _factory: factory,
            nodes,
            dir,
            config,
            net,
            factory_url,
        };
        c.keep(&[]);
        let o = Run::with_config(&c.config, &["secrets", "gen"]).output();
        assert!(o.status.success(), "secrets gen: {}", text(&o.stderr));
        let o = c.imgbuild(&["bootstrap"]);
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory without `gone`.
    fn keep(&self, gone: &[&str]) {
        let nodes: Vec<(&str, String, &str)> = NODES
            .iter()
            .filter(|(n, _, _)| !gone.contains(n))
            .map(|(n, h, r)| (*n, h.to_string(), *r))
            .collect();
        self.write_nodes(&nodes);
    }

    /// The inventory with `nodes` (name, host, role).
    fn write_nodes(&self, nodes: &[(&str, String, &str)]) {
        let mut inv = Inventory::new("sim")
            .vip(&format!("{}.10", self.net))
            .talos(TALOS)
            .factory(&self.factory_url);
        for (name, host, role) in nodes {
            inv = inv.node(Node::new(name, role).address(&self.ip(host)));
        }
        std::fs::write(&self.config, inv.text()).unwrap();
    }

    fn ip(&self, host: &str) -> String {
        format!("{}.{host}", self.net)
    }

    fn imgbuild(&self, args: &[&str]) -> Output {
        let mut r = Run::with_config(&self.config, args);
        r.timeouts(&[])
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("IMGBUILD_FACTORY")
            .env_remove("TALOSCONFIG");
        r.output()
    }

    /// `imgbuild --output json up --out-dir <dir>/out <extra>`.
    fn up(&self, extra: &[&str]) -> (Output, Value) {
        let out = self.dir.path().join("out");
        let mut args = vec!["--output", "json", "up", "--out-dir", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = self.imgbuild(&args);
        let v = json(&o);
        (o, v)
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join(".talos/sim")
    }

    fn stats(&self) -> Value {
        self.nodes.stats()
    }

    /// The node ID the simulator gave the machine named `machine`.
    fn node_id(&self, machine: &str) -> String {
        self.stats()["nodes"][machine]["node_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no node_id for {machine}: {}", self.stats()))
            .to_owned()
    }

    /// The simulator's stats of the machine on `host` now.
    fn at(&self, host: &str) -> Value {
        let ip = self.ip(host);
        let stats = self.stats();
        stats["nodes"]
            .as_object()
            .unwrap()
            .values()
            .find(|n| n["ip"] == ip.as_str())
            .unwrap_or_else(|| panic!("no machine on {ip}: {stats}"))
            .clone()
    }

    /// The removal calls the simulator saw: (node, call).
    fn calls(&self) -> Vec<(String, String)> {
        self.stats()["removals"]["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["node"].as_str().unwrap().to_owned(),
                    c["call"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    /// `POST /_sim/<what>` on the node simulator's control server.
    fn control(&self, what: &str, body: &Value) {
        let o = Command::new("curl")
            .args(["-sf", "-X", "POST", "-H", "content-type: application/json"])
            .args(["-d", &body.to_string()])
            .arg(format!("{}/_sim/{what}", self.nodes.control))
            .output()
            .unwrap();
        assert!(o.status.success(), "{what}: {}", text(&o.stderr));
    }

    /// worker-02's VM is deleted and another machine (`machine`) is
    /// created at its address, given worker-02's config as a platform
    /// hands it over: a node of this cluster, but not worker-02's machine.
    fn another_machine_at_worker_02(&self, machine: &str) {
        let now = std::fs::read_to_string(&self.config).unwrap();
        self.keep(&[]);
        self.new_machine_at("22", "worker-02", machine);
        std::fs::write(&self.config, now).unwrap();
    }

    /// The machine on `host` is deleted and another one (`machine`) made
    /// there, given the config the inventory renders for `node`.
    fn new_machine_at(&self, host: &str, node: &str, machine: &str) {
        let inv = imgbuild::inventory::Inventory::load(&self.config).unwrap();
        let configs = imgbuild::talos::stage::machine_configs(
            &inv,
            &imgbuild::talos::stage::BootstrapOptions::default(),
        )
        .unwrap();
        let (_, config) = configs.into_iter().find(|(n, _)| n == node).unwrap();
        let ip = self.ip(host);
        self.control("halt", &serde_json::json!({ "ip": ip }));
        self.control(
            "boot",
            &serde_json::json!({"name": machine, "ip": ip, "config": config, "machine": machine}),
        );
    }
}

/// The node IDs recorded in `nodes.json`, by node.
fn recorded_ids(state_dir: &Path) -> Vec<(String, Option<String>)> {
    imgbuild::talos::remove::NodesRecord::load(state_dir)
        .unwrap()
        .nodes
        .into_iter()
        .map(|n| (n.name, n.node_id))
        .collect()
}

fn short(id: &str) -> &str {
    &id[..8]
}

/// The error that stopped an `up` (its JSON document).
fn stopped(v: &Value) -> String {
    assert_eq!(v["failedStage"], "remove", "{v}");
    v["error"]
        .as_str()
        .unwrap_or_else(|| panic!("not stopped: {v}"))
        .to_owned()
}

#[test]
fn v1_11_the_record_holds_each_machines_node_id_and_a_matching_removal_goes_through() {
    let c = Cluster::start(0);
    // Each node of record with the node ID its machine answers with.
    let ids = recorded_ids(&c.state_dir());
    assert_eq!(ids.len(), NODES.len());
    for (name, id) in &ids {
        assert_eq!(id.as_deref(), Some(c.node_id(name).as_str()), "{name}");
    }
    // worker-02 leaves the inventory; its machine still answers as itself:
    // the plan names the check, and the run removes it.
    c.keep(&["worker-02"]);
    let (o, v) = c.up(&["--dry-run"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let machine = c.stats()["nodes"]["worker-02"]["machine_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let row = v["plan"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["step"] == "remove" && a["node"] == "worker-02")
        .unwrap_or_else(|| panic!("no removal planned: {v}"))
        .clone();
    assert!(
        row["detail"].as_str().unwrap().contains(&format!(
            "identity checked before each step: whatever answers at its address must be machine {}…",
            &machine[..8]
        )),
        "{row}"
    );
    let (o, v) = c.up(&["--allow-destroy"]);
    assert_eq!(o.status.code(), Some(0), "{}\n{v}", text(&o.stderr));
    let calls = c.calls();
    for call in ["Reset", "DeleteNode"] {
        assert!(
            calls.contains(&("worker-02".into(), call.into())),
            "{calls:?}"
        );
    }
    assert!(
        !recorded_ids(&c.state_dir())
            .iter()
            .any(|(n, _)| n == "worker-02")
    );
}

#[test]
fn v1_11_another_machine_at_a_removed_nodes_address_is_not_reset() {
    // worker-02 leaves the inventory; its VM is deleted and another
    // machine made at its address with a config of this cluster (so it
    // answers over mTLS). The record says which machine worker-02 was: the
    // dry run and `up --allow-destroy` refuse, naming both IDs; nothing is
    // reset or deleted; exit 1.
    let c = Cluster::start(1);
    let recorded = c.node_id("worker-02");
    c.keep(&["worker-02"]);
    c.another_machine_at_worker_02("vm-new");
    let answering = c.at("22")["node_id"].as_str().unwrap().to_owned();
    assert_ne!(answering, recorded);

    let expect = format!(
        "node worker-02: the machine answering at {}:50000 has node ID {}…, not node ID {}… (recorded)",
        c.ip("22"),
        short(&answering),
        short(&recorded)
    );
    let (o, v) = c.up(&["--dry-run"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(stopped(&v).contains(&expect), "{v}");
    let (o, v) = c.up(&["--allow-destroy"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let e = stopped(&v);
    assert!(e.contains(&expect), "{e}");
    assert!(e.contains("nothing reset or deleted"), "{e}");
    assert_eq!(c.calls(), Vec::<(String, String)>::new());
    let new = c.at("22");
    assert_eq!(new["halted"], false, "{new}");
    assert_eq!(new["booted_by"], "vm-new", "{new}");
    assert_eq!(
        new["node_id"],
        answering.as_str(),
        "the new machine was wiped"
    );
    assert!(
        recorded_ids(&c.state_dir())
            .iter()
            .any(|(n, _)| n == "worker-02")
    );
}

#[test]
fn v1_11_a_record_whose_node_id_no_longer_matches_removes_nothing() {
    // The record is stale: it holds another node ID for worker-02 than its
    // machine answers with (a restored state dir, a machine reinstalled).
    let c = Cluster::start(2);
    let real = c.node_id("worker-02");
    let stale = "Zz9Stale0Record0Node0Id0Of0Another0Machine0";
    let path = imgbuild::talos::remove::NodesRecord::path(&c.state_dir());
    let text_now = std::fs::read_to_string(&path).unwrap();
    assert!(text_now.contains(&real));
    std::fs::write(&path, text_now.replace(&real, stale)).unwrap();
    c.keep(&["worker-02"]);
    let (o, v) = c.up(&["--allow-destroy"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let e = stopped(&v);
    assert!(
        e.contains(&format!(
            "node worker-02: the machine answering at {}:50000 has node ID {}…, not node ID Zz9Stale… (recorded)",
            c.ip("22"),
            short(&real)
        )),
        "{e}"
    );
    assert_eq!(c.calls(), Vec::<(String, String)>::new());
    assert_eq!(c.stats()["nodes"]["worker-02"]["halted"], false);
}

#[test]
fn v1_11_a_machine_swapped_after_the_plan_is_caught_just_before_the_step() {
    // The plan was made while worker-02's own machine answered; then its
    // VM is replaced. The run proves the identity again right before each
    // step, so the first step stops and nothing is done.
    use imgbuild::talos::remove::{self, Event, RemoveOptions};
    let c = Cluster::start(3);
    c.keep(&["worker-02"]);
    let inv = imgbuild::inventory::Inventory::load(&c.config).unwrap();
    let opts = imgbuild::talos::stage::BootstrapOptions::default();
    let prepared = imgbuild::talos::stage::prepare(&inv, &opts).unwrap();
    let removed = remove::removed_nodes(&inv, &prepared.state_dir.path).unwrap();
    let view = remove::survey(&prepared, &removed, &opts.limits).unwrap();
    let plan = remove::plan(&inv, &removed, &view).unwrap();
    assert_eq!(plan.nodes[0].node, "worker-02");

    c.another_machine_at_worker_02("vm-swapped");
    let swapped = c.at("22")["node_id"].as_str().unwrap().to_owned();
    let quiet = |_: &str, _: &Event| {};
    let report = remove::remove(&prepared, &plan, &RemoveOptions::default(), &quiet).unwrap();
    let failed = report.failed.expect("the run stops");
    assert_eq!(failed.node, "worker-02");
    assert_eq!(failed.step, remove::Step::Drain);
    let shown = failed.to_string();
    assert!(
        shown.starts_with("node worker-02: cordon and drain: the machine answering at "),
        "{shown}"
    );
    assert!(
        failed.message.contains(&format!(
            "has node ID {}…, not node ID {}… (recorded)",
            short(&swapped),
            short(&c.node_id_recorded("worker-02"))
        )),
        "{}",
        failed.message
    );
    assert_eq!(c.calls(), Vec::<(String, String)>::new());
    assert_eq!(c.at("22")["halted"], false);
}

impl Cluster {
    fn node_id_recorded(&self, node: &str) -> String {
        recorded_ids(&self.state_dir())
            .into_iter()
            .find(|(n, _)| n == node)
            .and_then(|(_, id)| id)
            .unwrap()
    }
}

#[test]
fn v1_11_a_new_machine_at_an_old_address_is_not_taken_for_the_old_nodes_leftover_node() {
    // worker-02's VM is deleted; a new machine for inventory node
    // worker-03 is made at its address. worker-02's Node stays in the API
    // server (NotReady, its old machineID) beside worker-03's. Kubernetes
    // is at its target: the plan has no kubelet step for worker-03 (no
    // no-op step waited on until its timeout).
    use imgbuild::up::converge::{UpgradeSettings, kubernetes_plan};
    let c = Cluster::start(4);
    let nodes: Vec<(&str, String, &str)> = NODES
        .iter()
        .map(|(n, h, r)| {
            let n = if *n == "worker-02" { "worker-03" } else { *n };
            (n, h.to_string(), *r)
        })
        .collect();
    c.write_nodes(&nodes);
    let inv = imgbuild::inventory::Inventory::load(&c.config).unwrap();
    // kube-controller-manager marks a silent Node NotReady after its
    // grace period: short here.
    c.control(
        "k8s",
        &serde_json::json!({"node_monitor_grace_period": 300}),
    );
    c.new_machine_at("22", "worker-03", "vm-w3");
    let opts = imgbuild::talos::stage::BootstrapOptions::default();
    let prepared = imgbuild::talos::stage::prepare(&inv, &opts).unwrap();
    let kc = imgbuild::talos::kube::Kubeconfig::parse(
        &std::fs::read_to_string(c.state_dir().join("kubeconfig")).unwrap(),
    )
    .unwrap();
    let ready = |list: &Value, name: &str| {
        list["items"].as_array().unwrap().iter().any(|n| {
            n["metadata"]["name"] == name && n["status"]["conditions"][0]["status"] == "True"
        })
    };
    let listed = |list: &Value, name: &str| {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["metadata"]["name"] == name)
    };
    // Both Nodes listed, worker-03's Ready (the simulator's kubelet
    // registers it once its config is in).
    let mut list = Value::Null;
    for _ in 0..600 {
        list = kc
            .get_json("/api/v1/nodes", std::time::Duration::from_secs(5))
            .unwrap();
        if ready(&list, "worker-03") && listed(&list, "worker-02") && !ready(&list, "worker-02") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        ready(&list, "worker-03") && listed(&list, "worker-02"),
        "{list}"
    );
    assert!(!ready(&list, "worker-02"), "{list}");

    let (seen, k) = kubernetes_plan(
        &inv,
        &prepared.plan,
        &std::collections::BTreeMap::new(),
        &UpgradeSettings::default(),
        &opts.limits,
    );
    let w3 = seen.nodes.iter().find(|n| n.node == "worker-03").unwrap();
    let kubelet = &w3.components[&imgbuild::talos::kubernetes::plan::Component::Kubelet];
    assert!(
        kubelet.ready,
        "worker-03's kubelet taken from another Node: {kubelet:?}"
    );
    let pending: Vec<String> = k
        .steps
        .iter()
        .filter(|s| !s.done)
        .map(|s| format!("{:?}", s.step))
        .collect();
    assert!(
        !pending.iter().any(|s| s.contains("worker-03")),
        "a step planned for worker-03: {pending:?}"
    );
}
