//! End to end: `imgbuild up` as the reconciler, on the 5-node Proxmox
//! cluster of examples/demo (cp-01..03, worker-01..02, VMs 300..304) built
//! against the factory, Proxmox VE and Talos node simulators on loopback.
//! Each scenario shares one simulated cluster across its steps (the CI
//! machine has two cores). The nodes model Talos v1.11.2, moved to v1.11.5
//! (siderolabs/talos v1.11 `MachineService.Upgrade`, as the node simulator
//! implements it per version).
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::path::Path;
use std::process::Output;

use crate::common;
use common::inventory::{Inventory, NODES};

use common::sims::Pve;
use common::{json, stdout_ok, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The demo cluster, with this file's scenario helpers.
use common::demo::DemoCluster as Cluster;

impl Cluster {
    fn start_at(k: u8) -> Cluster {
        Cluster::start(net(k))
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output()
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

/// The nodes of the node actions among `actions` (the cluster's own, as
/// the etcd snapshot, have none).
fn nodes_of(actions: &[&serde_json::Value]) -> Vec<String> {
    let mut out: Vec<String> = actions
        .iter()
        .filter_map(|a| a["node"].as_str().map(str::to_owned))
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
    let c = Cluster::start_at(1);
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
    let of_kind = |all: &[&serde_json::Value], kind: &str| -> Vec<serde_json::Value> {
        all.iter()
            .filter(|a| a["kind"]["kind"] == kind)
            .map(|a| (*a).clone())
            .collect()
    };
    let talos = of_kind(&upgrades, "upgradeTalos");
    assert_eq!(
        nodes_of(&talos.iter().collect::<Vec<_>>()),
        all_nodes(),
        "{v}"
    );
    // The step opens with the run's etcd snapshot, then the nodes.
    assert_eq!(upgrades[0]["kind"]["kind"], "snapshotEtcd", "{v}");
    assert_eq!(upgrades[0]["outcome"], "planned", "{v}");
    for a in &talos {
        let talos = &a["changes"][0];
        assert_eq!(talos["field"], "talos", "{a}");
        assert_eq!(talos["from"], "v1.11.2", "{a}");
        assert_eq!(talos["to"], "v1.11.5", "{a}");
    }
    // Each node's config names the new installer: the upgrade's last step
    // applies it, right after the node's upgrade, without a reboot.
    for pair in upgrades[1..].chunks(2) {
        assert_eq!(pair[0]["kind"]["kind"], "upgradeTalos", "{v}");
        assert_eq!(pair[1]["kind"]["kind"], "applyConfig", "{v}");
        assert_eq!(pair[1]["kind"]["reboot"], false, "{v}");
        assert_eq!(pair[0]["node"], pair[1]["node"], "{v}");
        assert!(
            pair[1]["detail"]
                .as_str()
                .unwrap()
                .contains("install.image"),
            "{v}"
        );
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
    let upgrades = actions(&v, "upgrade");
    assert_eq!(upgrades[0]["kind"]["kind"], "snapshotEtcd", "{v}");
    for a in upgrades {
        assert_eq!(a["outcome"], "done", "{a}");
    }
    for (name, ..) in NODES {
        assert_eq!(c.day2(name, "version"), "v1.11.5", "{name}");
        assert_eq!(c.day2(name, "upgrades"), 1, "{name}");
    }
    // One etcd snapshot, taken before the first control plane was upgraded.
    let snapshots = etcd_snapshots(&c);
    assert_eq!(snapshots.len(), 1, "{snapshots:?}");
    assert_eq!(snapshots[0]["upgrade_calls_before"], 0, "{snapshots:?}");
    assert!(
        std::fs::read_dir(c.dir.path().join("state/etcd"))
            .unwrap()
            .count()
            >= 1,
        "no snapshot in the state dir"
    );

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

/// Creates VM `vmid` named `name` with a disk of its own, as someone else
/// would: no imgbuild record in its description.
fn foreign_vm(pve: &Pve, vmid: u32, name: &str) {
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &[
            "-d",
            &format!("vmid={vmid}"),
            "-d",
            &format!("name={name}"),
            "-d",
            "memory=512",
            "-d",
            "scsi0=local-lvm:1",
            "--data-urlencode",
            "description=Managed by Terraform",
        ],
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
}

/// VM `vmid`'s config, or None when there is no such VM.
fn vm_config(pve: &Pve, vmid: u32) -> Option<serde_json::Value> {
    let (code, v) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
    (code == 200).then(|| v["data"].clone())
}

/// The volumes VM `vmid` owns (named for it) in the Proxmox simulator.
fn owned_volumes(config: &serde_json::Value, vmid: u32) -> Vec<String> {
    config
        .as_object()
        .unwrap()
        .values()
        .filter_map(|v| v.as_str())
        .filter_map(|v| v.split(',').next())
        .filter(|v| v.contains(&format!("vm-{vmid}-")))
        .map(str::to_owned)
        .collect()
}

fn volume_exists(pve: &Pve, volid: &str) -> bool {
    let (storage, _) = volid.split_once(':').unwrap();
    let (_, v) = pve.curl(&format!("/nodes/pve/storage/{storage}/content"), &[]);
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["volid"] == volid)
}

/// The Kubernetes nodes the cluster lists now.
fn kube_nodes(c: &Cluster) -> Vec<String> {
    let kc = std::fs::read_to_string(c.dir.path().join("state/kubeconfig")).unwrap();
    let kc = imgbuild::talos::kube::Kubeconfig::parse(&kc).unwrap();
    let mut names: Vec<String> = kc
        .node_readiness(std::time::Duration::from_secs(5))
        .unwrap()
        .into_iter()
        .map(|n| n.name)
        .collect();
    names.sort();
    names
}

/// The inventory without the nodes named.
fn without(c: &Cluster, gone: &[&str]) -> Inventory {
    let mut inv = Inventory::new("demo").vip(&format!("{}.10", c.net));
    for (name, host, role) in NODES {
        if !gone.contains(&name) {
            inv = inv.node(
                common::inventory::Node::new(name, role).address(&format!("{}.{host}", c.net)),
            );
        }
    }
    inv.metal("raw").proxmox(true)
}

/// Talos v1.11.2: worker-02 leaves the inventory. The dry run shows its
/// removal (exit 0); `up` alone deletes nothing and says so; `up
/// --allow-destroy` drains and resets it, deletes its Kubernetes Node, VM
/// 304 and its volumes, and leaves the VM of the same name imgbuild did
/// not make. Then cp-03 goes: etcd keeps 2 members, with a warning, and a
/// snapshot was taken before the first control-plane change.
#[test]
fn a_node_gone_from_the_inventory_is_removed_only_with_allow_destroy() {
    let c = Cluster::start_at(2);
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true, "{v}");
    foreign_vm(&c.pve, 900, "worker-02");
    let vm304 = vm_config(&c.pve, 304).expect("VM 304");
    let volumes = owned_volumes(&vm304, 304);
    assert!(!volumes.is_empty(), "{vm304}");

    c.write(&without(&c, &["worker-02"]));
    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    let removal = actions(&v, "remove");
    assert_eq!(removal.len(), 2, "{v}");
    for a in &removal {
        assert_eq!(a["node"], "worker-02", "{a}");
        assert_eq!(a["destructive"], true, "{a}");
        assert_eq!(a["outcome"], "planned", "{a}");
    }
    assert_eq!(removal[0]["what"], "remove from the cluster", "{v}");
    assert_eq!(removal[1]["what"], "delete VM 304 on pve", "{v}");
    let plan_text = text(&c.run(&["up", "--dry-run"]).stdout);
    assert!(
        plan_text.contains("plan (with --allow-destroy): remove worker-02: delete VM 304 on pve"),
        "{plan_text}"
    );

    // Without the flag: nothing deleted, and it says what it left.
    let out = c.run(&["up"]);
    stdout_ok(&out);
    assert!(
        text(&out.stderr)
            .contains("3 destructive action(s) left undone; rerun with --allow-destroy"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains("left: remove worker-02"),
        "{}",
        text(&out.stdout)
    );
    assert!(vm_config(&c.pve, 304).is_some(), "VM 304 was deleted");
    assert!(kube_nodes(&c).contains(&"worker-02".to_owned()));
    assert_eq!(c.nodes.stats()["removals"]["calls"], serde_json::json!([]));
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    // The removal's two, and the prune of worker-02's upload that only
    // VM 304 uses (planned now, not found only once the VM is gone).
    assert_eq!(v["left"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(v["left"][2]["step"], "prune", "{v}");

    // With it: drained, reset, its Node deleted, its VM and volumes gone.
    let (out, v) = c.up(&["--allow-destroy"]);
    stdout_ok(&out);
    for a in actions(&v, "remove") {
        assert_eq!(a["outcome"], "done", "{a}");
    }
    assert_eq!(v["left"], serde_json::json!([]), "{v}");
    let calls: Vec<(String, String)> = c.nodes.stats()["removals"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["node"].as_str().unwrap().to_owned(),
                c["call"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(
        calls.contains(&("worker-02".into(), "Reset".into())),
        "{calls:?}"
    );
    assert!(
        calls.contains(&("worker-02".into(), "DeleteNode".into())),
        "{calls:?}"
    );
    let reset = c.nodes.stats()["removals"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["call"] == "Reset")
        .unwrap()
        .clone();
    assert_eq!(reset["cordoned"], true, "drained before the reset: {reset}");
    assert!(!kube_nodes(&c).contains(&"worker-02".to_owned()));
    assert!(vm_config(&c.pve, 304).is_none(), "VM 304 survived");
    for vol in &volumes {
        assert!(!volume_exists(&c.pve, vol), "{vol} survived");
    }
    let foreign = vm_config(&c.pve, 900).expect("the VM imgbuild did not make was deleted");
    assert_eq!(foreign["name"], "worker-02");
    // Converged: nothing left to remove.
    let (out, v) = c.up(&["--allow-destroy"]);
    stdout_ok(&out);
    assert!(actions(&v, "remove").is_empty(), "{v}");

    // A control plane: etcd keeps 2 members, with a warning; the run took
    // an etcd snapshot before it touched the control plane.
    c.write(&without(&c, &["worker-02", "cp-03"]));
    let (out, v) = c.up(&["--allow-destroy"]);
    stdout_ok(&out);
    let warnings = v["warnings"].to_string();
    assert!(warnings.contains("etcd is left with 2 members"), "{v}");
    let members = imgbuild::talos::remove::survey(
        &prepared(&c),
        &[],
        &imgbuild::talos::bootstrap::Options::default(),
    )
    .unwrap()
    .members
    .unwrap();
    let mut names: Vec<String> = members.into_iter().map(|m| m.hostname).collect();
    names.sort();
    assert_eq!(names, ["cp-01", "cp-02"]);
    assert!(vm_config(&c.pve, 302).is_none(), "VM 302 survived");
    let snapshots = etcd_snapshots(&c);
    assert_eq!(snapshots.len(), 1, "{snapshots:?}");

    // `replace worker-01`: removed (its VM deleted), then made again by up.
    let creates = c.pve.stats()["vmCreates"].as_u64().unwrap();
    let out = c.run(&["--output", "json", "replace", "worker-01"]);
    stdout_ok(&out);
    let v = json(&out);
    assert_eq!(v["healthy"], true, "{v}");
    let removal = actions(&v, "remove");
    assert_eq!(nodes_of(&removal), ["worker-01", "worker-01"], "{v}");
    assert_eq!(c.pve.stats()["vmCreates"].as_u64().unwrap(), creates + 1);
    let worker = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "worker-01")
        .unwrap();
    assert_eq!(worker["stages"]["vm"], "created", "{worker}");
    assert_eq!(worker["stages"]["apply"], "applied", "{worker}");
    assert_eq!(worker["kubernetesReady"], true, "{worker}");
    assert!(kube_nodes(&c).contains(&"worker-01".to_owned()));
    let new_disk = owned_volumes(
        &vm_config(&c.pve, worker["vmid"].as_u64().unwrap() as u32).unwrap(),
        worker["vmid"].as_u64().unwrap() as u32,
    );
    assert!(!new_disk.is_empty());

    // `replace cp-02`: it leaves etcd and is reset (STATE and EPHEMERAL
    // wiped), its VM made again; the new machine boots in maintenance mode,
    // takes its config and joins etcd as a new member.
    let out = c.run(&["--output", "json", "replace", "cp-02"]);
    stdout_ok(&out);
    let v = json(&out);
    assert_eq!(v["healthy"], true, "{v}");
    let cp = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "cp-02")
        .unwrap();
    assert_eq!(cp["stages"]["apply"], "applied", "{cp}");
    let members = imgbuild::talos::remove::survey(
        &prepared(&c),
        &[],
        &imgbuild::talos::bootstrap::Options::default(),
    )
    .unwrap()
    .members
    .unwrap();
    let mut names: Vec<String> = members.into_iter().map(|m| m.hostname).collect();
    names.sort();
    assert_eq!(names, ["cp-01", "cp-02"]);
}

/// The simulator's record of the etcd snapshots it served.
fn etcd_snapshots(c: &Cluster) -> Vec<serde_json::Value> {
    let o = std::process::Command::new("curl")
        .args(["-sf", &format!("{}/_sim/etcd", c.nodes.control)])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["snapshots"].as_array().cloned().unwrap_or_default()
}

/// The cluster's state as the library prepares it (for reading etcd).
fn prepared(c: &Cluster) -> imgbuild::talos::stage::Prepared {
    let inv = imgbuild::inventory::Inventory::load(&c.config()).unwrap();
    let opts = imgbuild::talos::stage::BootstrapOptions {
        state_dir: Some(c.dir.path().join("state")),
        ..Default::default()
    };
    imgbuild::talos::stage::prepare(&inv, &opts).unwrap()
}

/// A VM whose description carries the cluster's record but a node name no
/// node can have (by hand, or a record edited) is not provably the
/// cluster's node: `up`, its dry run and `up --allow-destroy` go on and
/// never take it for a node to remove; the VM stays.
#[test]
fn a_vm_whose_record_names_no_node_stops_no_up_and_is_left() {
    let c = Cluster::start_at(3);
    let state = c.dir.path().join("state");
    let o = common::run::Run::with_config(&c.config(), &["secrets", "gen", "--state-dir"])
        .arg(&state)
        .env_remove("IMGBUILD_STATE_DIR")
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true, "{v}");
    let (code, r) = c.pve.curl(
        "/nodes/pve/qemu",
        &[
            "-d",
            "vmid=901",
            "-d",
            "name=odd",
            "-d",
            "memory=512",
            "-d",
            "scsi0=local-lvm:1",
            "--data-urlencode",
            "description=Talos node image managed by imgbuild\nimgbuild-cluster: demo\nimgbuild-node: Bad_Name!\n",
        ],
    );
    assert_eq!(code, 200, "{r}");
    assert_eq!(c.pve.wait(&r["data"])["exitstatus"], "OK");

    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    assert!(actions(&v, "remove").is_empty(), "{v}");
    let (out, v) = c.up(&["--allow-destroy"]);
    stdout_ok(&out);
    assert!(actions(&v, "remove").is_empty(), "{v}");
    assert!(vm_config(&c.pve, 901).is_some(), "VM 901 was deleted");
}
