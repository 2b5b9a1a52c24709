//! Node removal on the Talos side (issue 30), driving the library
//! (`imgbuild::talos::remove`) against the node simulator: a cluster is
//! bootstrapped through `imgbuild bootstrap` (which records its nodes in
//! the state dir), a node leaves the inventory, and survey → plan → remove
//! take it out as `sim/src/node/remove.rs` models Talos (each test names
//! the version it runs) and etcd's member-removal rule.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::Nodes;
use common::text;
use imgbuild::inventory::Role;
use imgbuild::talos::bootstrap::Options;
use imgbuild::talos::remove::{
    self, Event, Outcome, RemovalPlan, RemoveError, RemoveOptions, RemovedNode, Step,
};
use imgbuild::talos::stage::{self, BootstrapOptions, Prepared};
use serde_json::Value;

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

fn limits() -> Options {
    Options {
        call_timeout: Duration::from_secs(3),
        poll: Duration::from_millis(100),
        ..Options::default()
    }
}

fn run_options() -> RemoveOptions {
    RemoveOptions {
        limits: limits(),
        drain_timeout: Duration::from_secs(15),
        reset_timeout: Duration::from_secs(15),
    }
}

/// A cluster of `nodes` (of [`NODES`]) on Talos `talos`, bootstrapped.
struct Cluster {
    sim: Nodes,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
}

impl Cluster {
    fn start(block: u32, talos: &str, nodes: &[&str]) -> Cluster {
        Self::start_patched(block, talos, nodes, None)
    }

    /// [`Cluster::start`] with `patch` (YAML documents) for every node.
    fn start_patched(block: u32, talos: &str, nodes: &[&str], patch: Option<&str>) -> Cluster {
        let net = net(block);
        let mut args: Vec<String> = ["--talos-version", talos, "--upgrade-delay", "50"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for (name, host, role) in NODES.iter().filter(|n| nodes.contains(&n.0)) {
            args.extend(["--node".to_owned(), format!("{name}={net}.{host}:{role}")]);
        }
        args.extend(["--vip".to_owned(), format!("{net}.10")]);
        let sim = Nodes::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        if let Some(p) = patch {
            std::fs::write(dir.path().join(PATCH), p).unwrap();
        }
        let c = Cluster {
            sim,
            dir,
            config,
            net,
        };
        c.keep(talos, nodes);
        let mut r = Run::with_config(&c.config, &["bootstrap", "--new-secrets"]);
        r.timeouts(&[])
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG");
        let o = r.output();
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory now holds only `nodes`.
    fn keep(&self, talos: &str, nodes: &[&str]) {
        let mut inv = Inventory::new("rm")
            .vip(&format!("{}.10", self.net))
            .talos(talos);
        for (name, host, role) in NODES.iter().filter(|n| nodes.contains(&n.0)) {
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", self.net)));
        }
        if self.dir.path().join(PATCH).exists() {
            inv = inv.append(&format!("patches:\n  all: [{PATCH}]\n"));
        }
        std::fs::write(&self.config, inv.text()).unwrap();
    }

    fn inventory(&self) -> imgbuild::inventory::Inventory {
        imgbuild::inventory::Inventory::load(&self.config).unwrap()
    }

    fn prepared(&self) -> Prepared {
        let opts = BootstrapOptions {
            limits: limits(),
            ..BootstrapOptions::default()
        };
        stage::prepare(&self.inventory(), &opts).unwrap()
    }

    /// The default state dir: `.talos/<cluster>/` beside the inventory.
    fn state_dir(&self) -> PathBuf {
        self.dir.path().join(".talos/rm")
    }

    /// Survey and plan for the nodes of record gone from the inventory.
    fn plan(&self, prepared: &Prepared) -> Result<RemovalPlan, RemoveError> {
        let inv = self.inventory();
        let removed = remove::removed_nodes(&inv, &prepared.state_dir.path)?;
        let view = remove::survey(prepared, &removed, &limits())?;
        remove::plan(&inv, &removed, &view)
    }

    fn removals(&self) -> Value {
        self.sim.stats()["removals"].clone()
    }

    /// The removal calls the simulator saw: (node, call) in order.
    fn calls(&self) -> Vec<(String, String)> {
        self.removals()["calls"]
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

    fn call(&self, node: &str, call: &str) -> Value {
        self.removals()["calls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["node"] == node && c["call"] == call)
            .unwrap_or_else(|| panic!("no {call} for {node}: {}", self.removals()))
            .clone()
    }

    fn halt(&self, host: u8) {
        let o = Command::new("curl")
            .args(["-sf", "-X", "POST", "-H", "content-type: application/json"])
            .args(["-d", &format!("{{\"ip\":\"{}.{host}\"}}", self.net)])
            .arg(format!("{}/_sim/halt", self.sim.control))
            .output()
            .unwrap();
        assert!(o.status.success());
    }

    /// The Kubernetes nodes as the API lists them now.
    fn kube_nodes(&self) -> Vec<String> {
        let view = remove::survey(&self.prepared(), &[], &limits()).unwrap();
        view.kube_nodes
            .expect("the Kubernetes API answers")
            .into_iter()
            .map(|k| k.name)
            .collect()
    }
}

/// The file of [`Cluster::start_patched`]'s patch, beside the inventory.
const PATCH: &str = "volumes.yaml";

const ALL: [&str; 5] = ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"];

fn without(gone: &[&str]) -> Vec<&'static str> {
    ALL.into_iter().filter(|n| !gone.contains(n)).collect()
}

fn quiet(_: &str, _: &Event) {}

fn steps_of(report: &remove::RemovalReport, node: &str) -> Vec<(Step, Outcome)> {
    report
        .nodes
        .iter()
        .find(|n| n.node == node)
        .unwrap()
        .steps
        .clone()
}

fn recorded(state_dir: &Path) -> Vec<String> {
    remove::NodesRecord::load(state_dir)
        .unwrap()
        .nodes
        .into_iter()
        .map(|n| n.name)
        .collect()
}

#[test]
fn v1_11_worker_removal_drains_then_resets_then_deletes_the_node() {
    let c = Cluster::start(0, "v1.11.5", &ALL);
    assert_eq!(recorded(&c.state_dir()), ALL);
    c.keep("v1.11.5", &without(&["worker-02"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    assert_eq!(plan.nodes.len(), 1);
    assert_eq!(plan.nodes[0].role, Role::Worker);
    assert_eq!(
        plan.nodes[0].steps,
        [Step::Drain, Step::Reset, Step::DeleteNode]
    );
    assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);

    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    let calls = c.calls();
    assert_eq!(
        calls,
        [
            ("worker-02".to_owned(), "Reset".to_owned()),
            ("worker-02".to_owned(), "ResetSequence".to_owned()),
            ("worker-02".to_owned(), "DeleteNode".to_owned()),
        ],
    );
    // Drained before the Reset came, and the Node deleted only once the
    // node was down (a running kubelet would register it again).
    let reset = c.call("worker-02", "Reset");
    assert_eq!(
        (reset["cordoned"].clone(), reset["pods_left"].clone()),
        (Value::Bool(true), Value::from(0)),
        "{reset}"
    );
    assert_eq!(c.call("worker-02", "DeleteNode")["kubelet_running"], false);
    assert!(!c.kube_nodes().contains(&"worker-02".to_owned()));
    assert_eq!(c.sim.stats()["nodes"]["worker-02"]["halted"], true);
    assert_eq!(recorded(&c.state_dir()), without(&["worker-02"]));
    assert!(matches!(
        steps_of(&report, "worker-02")[0].1,
        Outcome::Done(_)
    ));
}

#[test]
fn v1_12_control_plane_removal_leaves_two_etcd_members_and_warns() {
    let c = Cluster::start(1, "v1.12.4", &ALL);
    c.keep("v1.12.4", &without(&["cp-02"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    assert_eq!(
        plan.nodes[0].steps,
        [Step::Drain, Step::LeaveEtcd, Step::Reset, Step::DeleteNode]
    );
    assert_eq!(plan.members_after, Some(2));
    assert_eq!(plan.warnings, [remove::plan::TWO_MEMBERS]);

    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    assert_eq!(report.warnings, [remove::plan::TWO_MEMBERS]);
    let order: Vec<String> = c.calls().into_iter().map(|(_, call)| call).collect();
    assert_eq!(
        order,
        [
            "EtcdForfeitLeadership",
            "EtcdLeaveCluster",
            "Reset",
            "ResetSequence",
            "DeleteNode"
        ]
    );
    // cp-02 did not lead: nothing was handed off.
    assert_eq!(c.call("cp-02", "EtcdForfeitLeadership")["to"], "");
    // It left on its own; the reset found it no member any more.
    assert_eq!(c.call("cp-02", "EtcdLeaveCluster")["via"], "cp-02");
    let reset = c.call("cp-02", "Reset");
    assert_eq!(reset["member"], false, "{reset}");
    // A CoreDNS pod ran there: the drain evicted it before the Reset.
    assert!(reset["evictions"].as_u64().unwrap() >= 1, "{reset}");
    assert_eq!(
        (reset["cordoned"].clone(), reset["pods_left"].clone()),
        (Value::Bool(true), Value::from(0)),
        "{reset}"
    );
    assert_eq!(c.removals()["left_etcd"], serde_json::json!(["cp-02"]));
    // etcd as the remaining control planes list it: two members.
    let again = remove::survey(&c.prepared(), &[], &limits()).unwrap();
    let names: Vec<String> = again
        .members
        .unwrap()
        .into_iter()
        .map(|m| m.hostname)
        .collect();
    assert_eq!(names, ["cp-01", "cp-03"]);
}

/// talosctl reset's order: the leader hands etcd leadership to another
/// member before it leaves, so the cluster never loses its leader with it.
#[test]
fn v1_11_the_etcd_leader_hands_leadership_off_before_it_leaves() {
    let c = Cluster::start(7, "v1.11.5", &ALL);
    c.keep("v1.11.5", &without(&["cp-01"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    let order: Vec<String> = c
        .calls()
        .into_iter()
        .filter(|(node, _)| node == "cp-01")
        .map(|(_, call)| call)
        .collect();
    assert_eq!(order[..2], ["EtcdForfeitLeadership", "EtcdLeaveCluster"]);
    assert_eq!(c.call("cp-01", "EtcdForfeitLeadership")["to"], "cp-02");
    let leave = &steps_of(&report, "cp-01")[1];
    assert!(
        format!("{leave:?}").contains("leadership handed to cp-02"),
        "{leave:?}"
    );
}

#[test]
fn v1_10_the_last_control_plane_is_refused_and_talos_refuses_it_too() {
    let c = Cluster::start(2, "v1.10.6", &["cp-01", "worker-01"]);
    // The inventory must name a control plane: cp-02, never brought up.
    c.keep("v1.10.6", &["cp-02", "worker-01"]);
    let prepared = c.prepared();
    let e = c.plan(&prepared).unwrap_err();
    assert!(
        matches!(e, RemoveError::LastControlPlane { ref node } if node == "cp-01"),
        "{e}"
    );
    assert!(e.to_string().contains("last control plane"), "{e}");
    assert_eq!(c.calls(), []);
    // The simulated node refuses as etcd would, had the plan let it through.
    let removed = remove::removed_nodes(&c.inventory(), &c.state_dir()).unwrap();
    let forced = RemovalPlan {
        nodes: vec![remove::NodeRemoval {
            node: "cp-01".into(),
            role: Role::Controlplane,
            address: removed[0].address,
            endpoint: removed[0].endpoint,
            member: Some(0x1000),
            answering: true,
            expected: remove::Expected::NodeId(removed[0].node_id.clone().expect("recorded")),
            steps: vec![Step::Reset],
        }],
        ..RemovalPlan::default()
    };
    let short = RemoveOptions {
        reset_timeout: Duration::from_secs(3),
        ..run_options()
    };
    let report = remove::remove(&prepared, &forced, &short, &quiet).unwrap();
    let failed = report.failed.expect("the reset of the only member fails");
    assert_eq!(failed.step, Step::Reset);
    let seq = c.call("cp-01", "ResetSequence");
    assert_eq!(seq["ok"], false);
    assert!(
        seq["error"]
            .as_str()
            .unwrap()
            .contains("not enough started members"),
        "{seq}"
    );
}

#[test]
fn v1_13_a_removal_that_breaks_quorum_is_refused() {
    let c = Cluster::start(3, "v1.13.4", &ALL);
    c.halt(12); // cp-02 is down
    c.keep("v1.13.4", &without(&["cp-03"]));
    let prepared = c.prepared();
    let e = c.plan(&prepared).unwrap_err();
    assert!(
        matches!(
            e,
            RemoveError::Quorum { ref node, others: 2, healthy: 1, needed: 2 } if node == "cp-03"
        ),
        "{e}"
    );
    assert_eq!(c.calls(), []);
}

#[test]
fn v1_11_a_rerun_after_a_run_stopped_midway_completes_it() {
    let c = Cluster::start(4, "v1.11.5", &ALL);
    c.keep("v1.11.5", &without(&["cp-03"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    // The run dies right after the Reset (as a SIGKILL would leave it).
    let stop = |_: &str, e: &Event| {
        if matches!(e, Event::Finished(Step::Reset, _)) {
            panic!("killed");
        }
    };
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        remove::remove(&prepared, &plan, &run_options(), &stop)
    }));
    assert!(died.is_err());
    assert!(recorded(&c.state_dir()).contains(&"cp-03".to_owned()));
    assert!(c.kube_nodes().contains(&"cp-03".to_owned()));

    // The same plan again: every step finds what was done.
    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    let steps = steps_of(&report, "cp-03");
    assert!(
        matches!(steps[0], (Step::Drain, Outcome::Skipped(_))),
        "{steps:?}"
    );
    assert!(
        matches!(steps[1], (Step::LeaveEtcd, Outcome::AlreadyDone(_))),
        "{steps:?}"
    );
    assert!(
        matches!(steps[2], (Step::Reset, Outcome::Skipped(_))),
        "{steps:?}"
    );
    assert!(
        matches!(steps[3], (Step::DeleteNode, Outcome::Done(_))),
        "{steps:?}"
    );
    let count = |call: &str| c.calls().iter().filter(|(_, k)| k == call).count();
    assert_eq!(
        (
            count("EtcdLeaveCluster"),
            count("Reset"),
            count("DeleteNode")
        ),
        (1, 1, 1)
    );
    assert!(!recorded(&c.state_dir()).contains(&"cp-03".to_owned()));
    // A third run has nothing left to do.
    assert!(c.plan(&prepared).unwrap().is_empty());
}

#[test]
fn v1_9_an_unreachable_control_plane_is_removed_by_member_id_from_another() {
    let c = Cluster::start(5, "v1.9.5", &ALL);
    c.halt(13); // cp-03's machine is gone
    c.keep("v1.9.5", &without(&["cp-03"]));
    // Found on the platform only: no record, no address.
    std::fs::remove_file(remove::NodesRecord::path(&c.state_dir())).unwrap();
    let prepared = c.prepared();
    let inv = c.inventory();
    let mut removed = remove::removed_nodes(&inv, &c.state_dir()).unwrap();
    assert_eq!(removed, []);
    remove::add_found(&mut removed, RemovedNode::on_platform("cp-03", None));
    let view = remove::survey(&prepared, &removed, &limits()).unwrap();
    let plan = remove::plan(&inv, &removed, &view).unwrap();
    let n = &plan.nodes[0];
    assert_eq!(n.role, Role::Controlplane);
    assert_eq!(n.address, Some(format!("{}.13", c.net).parse().unwrap()));
    assert!(!n.answering);

    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    let leave = &steps_of(&report, "cp-03")[1];
    assert!(
        matches!(leave, (Step::LeaveEtcd, Outcome::Done(how)) if how.contains("EtcdRemoveMemberByID")),
        "{leave:?}"
    );
    let calls = c.calls();
    assert_eq!(
        calls,
        [
            ("cp-03".to_owned(), "EtcdRemoveMemberByID".to_owned()),
            ("cp-03".to_owned(), "DeleteNode".to_owned()),
        ]
    );
    assert_eq!(c.call("cp-03", "EtcdRemoveMemberByID")["via"], "cp-01");
    assert_eq!(c.call("cp-03", "EtcdRemoveMemberByID")["member_id"], 0x1002);
    assert_eq!(c.removals()["left_etcd"], serde_json::json!(["cp-03"]));
}

#[test]
fn v1_11_two_control_planes_leave_one_after_the_other() {
    // 3 → 1: the plan allows it (with the one-member warning), so the run
    // must not count the second leaver's healthy member as unhealthy.
    let c = Cluster::start(6, "v1.11.5", &ALL);
    c.keep("v1.11.5", &without(&["cp-02", "cp-03"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    assert_eq!(plan.members_after, Some(1));
    assert_eq!(plan.warnings, [remove::plan::ONE_MEMBER]);

    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    assert_eq!(
        c.removals()["left_etcd"],
        serde_json::json!(["cp-02", "cp-03"])
    );
    assert_eq!(
        recorded(&c.state_dir()),
        ["cp-01", "worker-01", "worker-02"]
    );
}

/// Talos v1.14 lets etcd's data (and CRI, KUBELET, LOG) sit on a partition
/// of its own, which wiping EPHEMERAL leaves: the removed control plane's
/// Reset names those volumes too, and v1.14 accepts them (also when they
/// are directories under EPHEMERAL, wiped in the same request).
#[test]
fn v1_14_control_plane_removal_also_wipes_the_etcd_volume() {
    // etcd's data on a partition of its own (a VolumeConfig that asks for
    // provisioning): wiping EPHEMERAL alone would leave it.
    let etcd_partition = "apiVersion: v1alpha1\nkind: VolumeConfig\nname: ETCD\nprovisioning:\n  minSize: 2GiB\n  maxSize: 4GiB\n";
    let c = Cluster::start_patched(8, "v1.14.0", &ALL, Some(etcd_partition));
    c.keep("v1.14.0", &without(&["cp-03"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    let reset = c.call("cp-03", "ResetSequence");
    assert_eq!(reset["etcd_data_wiped"], true, "{reset}");
    assert!(
        reset["wiped"]
            .as_array()
            .unwrap()
            .contains(&Value::from("ETCD")),
        "{reset}"
    );
    let outcome = steps_of(&report, "cp-03")
        .into_iter()
        .find(|(s, _)| *s == Step::Reset)
        .unwrap()
        .1;
    assert_eq!(
        outcome,
        Outcome::Done(
            "Reset (graceful, STATE, EPHEMERAL, ETCD, CRI, KUBELET, LOG wiped); it powered off"
                .into()
        )
    );
    assert_eq!(c.removals()["left_etcd"], serde_json::json!(["cp-03"]));
}

/// Before v1.14 the Reset names STATE and EPHEMERAL only: v1.13 refuses a
/// label of a volume that is a directory (`volume "ETCD" is not located`).
#[test]
fn v1_13_control_plane_removal_wipes_state_and_ephemeral_only() {
    let c = Cluster::start(9, "v1.13.5", &ALL);
    c.keep("v1.13.5", &without(&["cp-03"]));
    let prepared = c.prepared();
    let plan = c.plan(&prepared).unwrap();
    let report = remove::remove(&prepared, &plan, &run_options(), &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    assert!(steps_of(&report, "cp-03").contains(&(
        Step::Reset,
        Outcome::Done("Reset (graceful, STATE, EPHEMERAL wiped); it powered off".into())
    )));
}

#[test]
fn v1_11_a_removed_nodes_address_now_another_nodes_is_not_reset() {
    // worker-02 leaves the inventory and its address is handed to a new
    // node, worker-03. The record still places worker-02 there; a Reset
    // sent to that address would wipe worker-03 (every node shares the
    // cluster's CA). The removal is refused naming both; nothing is called.
    let c = Cluster::start(10, "v1.11.5", &ALL);
    let (_, host, _) = NODES.iter().find(|n| n.0 == "worker-02").unwrap();
    let mut inv = Inventory::new("rm")
        .vip(&format!("{}.10", c.net))
        .talos("v1.11.5");
    for (name, h, role) in NODES.iter().filter(|n| n.0 != "worker-02") {
        inv = inv.node(Node::new(name, role).address(&format!("{}.{h}", c.net)));
    }
    inv = inv.node(Node::new("worker-03", "worker").address(&format!("{}.{host}", c.net)));
    std::fs::write(&c.config, inv.text()).unwrap();
    let e = c.plan(&c.prepared()).unwrap_err().to_string();
    assert!(
        e.contains("node worker-02 was recorded at")
            && e.contains("inventory node worker-03 is reached")
            && e.contains("would wipe worker-03"),
        "{e}"
    );
    assert_eq!(c.calls(), Vec::<(String, String)>::new());
    assert!(recorded(&c.state_dir()).contains(&"worker-02".to_owned()));
}
