//! The bootstrap-manifest sync per Talos version (issue 37), through
//! `imgbuild upgrade` against the node simulator's API server: talosctl
//! replaces objects whole before Talos v1.13 and deletes nothing; from
//! v1.13 it applies them server-side with Talos's inventory
//! (`config.k8s.io/owning-inventory`, the ConfigMap
//! `kube-system/talos-bootstrap-manifests-inventory`) and prunes what Talos
//! no longer renders (siderolabs/talos `pkg/cluster/kubernetes/
//! talos_managed.go`, go-kubernetes `kubernetes/manifests`, `kubernetes/
//! ssa`). What Talos stops rendering here: kube-proxy, once the inventory
//! sets `cluster.proxy.disabled` (as for a CNI that replaces kube-proxy).

use std::time::Duration;

use super::kubernetes_upgrade::{Cluster, imgbuild, left};
use crate::common;
use common::{json, text};
use imgbuild::talos::kube::Kubeconfig;
use imgbuild::talos::kubernetes::api::Kube;
use imgbuild::talos::kubernetes::manifests::{INVENTORY_NAME, OWNING_INVENTORY, inventory_path};
use serde_json::Value;

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

const NO_PROXY: &str = "cluster:\n  proxy:\n    disabled: true\n";
const KUBE_PROXY_DS: &str = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy";
const KUBE_PROXY_SA: &str = "/api/v1/namespaces/kube-system/serviceaccounts/kube-proxy";
const KUBE_PROXY_CRB: &str = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/kube-proxy";

/// The objects of Talos's `10-kube-proxy` manifest, as the plan names them.
const PROXY_OBJECTS: [&str; 3] = [
    "apps/v1 DaemonSet kube-system/kube-proxy",
    "rbac.authorization.k8s.io/v1 ClusterRoleBinding kube-proxy",
    "v1 ServiceAccount kube-system/kube-proxy",
];

/// The cluster's API server as the bootstrap's kubeconfig reaches it.
fn kube(c: &Cluster) -> Kube {
    let path = c.config.with_file_name(".talos/sim/kubeconfig");
    let text = std::fs::read_to_string(&path).unwrap();
    Kube {
        kc: Kubeconfig::parse(&text).unwrap(),
        timeout: Duration::from_secs(5),
    }
}

/// The inventory moves to `cluster.proxy.disabled: true` on every node and
/// `imgbuild apply` pushes it: the control planes stop rendering kube-proxy.
fn disable_kube_proxy(c: &Cluster, talos: &str) {
    std::fs::write(c.config.with_file_name("noproxy.yaml"), NO_PROXY).unwrap();
    c.want_with(talos, "v1.32.1", "patches:\n  all: [noproxy.yaml]\n");
    let o = imgbuild(&c.config, &["apply"]);
    assert!(
        o.status.success(),
        "apply: {}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

/// The dry run's `syncManifests` step.
fn sync_step(plan: &Value) -> Value {
    plan["kubernetes"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["kind"] == "syncManifests")
        .unwrap_or_else(|| panic!("no sync step: {plan}"))
        .clone()
}

fn sorted(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// Talos `talos` (v1.13+): what Talos created and no longer renders is
/// pruned; an object its inventory lists without its mark is kept.
fn prunes_what_talos_no_longer_renders(block: u32, talos: &str) {
    let c = Cluster::start_in(&net(block), talos, "v1.32.1", talos);
    let k = kube(&c);
    // Talos v1.13+ created the objects marked and listed them.
    let ds = k.get_some(KUBE_PROXY_DS).unwrap();
    assert_eq!(
        ds["metadata"]["annotations"][OWNING_INVENTORY], INVENTORY_NAME,
        "{ds}"
    );
    let inventory = k.get_some(&inventory_path()).unwrap();
    assert!(
        inventory["data"]
            .as_object()
            .unwrap()
            .contains_key("kube-system_kube-proxy_apps_DaemonSet"),
        "{inventory}"
    );
    // Someone took Talos's mark off the ServiceAccount: Talos did not
    // create it, as far as anyone can tell now.
    let mut sa = k.get_some(KUBE_PROXY_SA).unwrap();
    sa["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(OWNING_INVENTORY);
    sa["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("managedFields");
    k.replace(KUBE_PROXY_SA, &sa, false).unwrap();

    disable_kube_proxy(&c, talos);
    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    assert_eq!(left(&plan), ["syncManifests"], "{plan}");
    let step = sync_step(&plan);
    assert_eq!(step["mode"], "apply", "{step}");
    assert_eq!(
        sorted(&step["prune"]),
        [PROXY_OBJECTS[0], PROXY_OBJECTS[1]],
        "{step}"
    );
    let notes = plan["kubernetes"]["notes"].to_string();
    assert!(
        notes.contains("not pruned although") && notes.contains(PROXY_OBJECTS[2]),
        "{notes}"
    );
    assert!(
        k.get(KUBE_PROXY_DS).unwrap().is_some(),
        "a dry run deletes nothing"
    );

    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let report = json(&o);
    assert!(report["kubernetes"]["failed"].is_null(), "{report}");
    assert_eq!(
        sorted(&report["kubernetes"]["pruned"]),
        [PROXY_OBJECTS[0], PROXY_OBJECTS[1]],
        "{report}"
    );
    assert!(k.get(KUBE_PROXY_DS).unwrap().is_none(), "pruned");
    assert!(k.get(KUBE_PROXY_CRB).unwrap().is_none(), "pruned");
    assert!(
        k.get(KUBE_PROXY_SA).unwrap().is_some(),
        "an object without Talos's mark is never pruned"
    );
    let inventory = k.get_some(&inventory_path()).unwrap();
    let keys: Vec<&String> = inventory["data"].as_object().unwrap().keys().collect();
    assert!(
        !keys
            .iter()
            .any(|k| k.starts_with("kube-system_kube-proxy_apps")),
        "a pruned object leaves the inventory: {keys:?}"
    );
    // Every object Talos renders now carries its mark.
    let coredns = k
        .get_some("/apis/apps/v1/namespaces/kube-system/deployments/coredns")
        .unwrap();
    assert_eq!(
        coredns["metadata"]["annotations"][OWNING_INVENTORY],
        INVENTORY_NAME
    );

    // A rerun has nothing left to do.
    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    let plan = json(&o);
    assert!(left(&plan).is_empty(), "{plan}");
}

#[test]
fn talos_1_13_prunes_what_talos_no_longer_renders_and_keeps_what_it_did_not_mark() {
    // Talos v1.13.5.
    prunes_what_talos_no_longer_renders(0, "v1.13.5");
}

#[test]
fn talos_1_14_prunes_what_talos_no_longer_renders_and_keeps_what_it_did_not_mark() {
    // Talos v1.14.0.
    prunes_what_talos_no_longer_renders(1, "v1.14.0");
}

#[test]
fn talos_1_11_replaces_objects_and_deletes_nothing() {
    // Talos v1.11.5: go-kubernetes manifests.Sync (POST or PUT).
    let c = Cluster::start_in(&net(2), "v1.11.5", "v1.32.1", "v1.11.5");
    let k = kube(&c);
    assert!(
        k.get(&inventory_path()).unwrap().is_none(),
        "no inventory before v1.13"
    );
    // A field someone added to CoreDNS: a whole-object replace takes it out.
    let path = "/apis/apps/v1/namespaces/kube-system/deployments/coredns";
    let mut coredns = k.get_some(path).unwrap();
    coredns["metadata"]["labels"]["added-by"] = "someone".into();
    coredns["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("managedFields");
    k.replace(path, &coredns, false).unwrap();

    disable_kube_proxy(&c, "v1.11.5");
    // Move Kubernetes so the sync runs.
    c.want_with("v1.11.5", "v1.33.5", "patches:\n  all: [noproxy.yaml]\n");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    let plan = json(&o);
    let step = sync_step(&plan);
    assert_eq!(step["mode"], "replace", "{step}");
    assert!(step["prune"].is_null(), "{step}");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let report = json(&o);
    assert!(report["kubernetes"]["failed"].is_null(), "{report}");
    assert!(report["kubernetes"]["pruned"].is_null(), "{report}");
    assert!(
        k.get(KUBE_PROXY_DS).unwrap().is_some(),
        "before v1.13 nothing is deleted"
    );
    let coredns = k.get_some(path).unwrap();
    assert!(
        coredns["metadata"]["labels"]["added-by"].is_null(),
        "replaced whole: {coredns}"
    );
    assert!(
        coredns["metadata"]["annotations"][OWNING_INVENTORY].is_null(),
        "no mark before v1.13"
    );
    assert!(k.get(&inventory_path()).unwrap().is_none());
}
