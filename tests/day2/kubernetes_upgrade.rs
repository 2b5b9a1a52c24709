//! Kubernetes upgrades through `imgbuild upgrade` against the node
//! simulator's Kubernetes side (issue 31): a 3+2 cluster whose Talos runs
//! the version each test names (v1.11.5 unless said otherwise), its static
//! pods, kubelets, bootstrap manifests and deprecated-API metric as
//! `sim/src/node/k8s/*.rs` model them after siderolabs/talos and
//! kubernetes/kubernetes. Delays are scaled down.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

pub(super) fn imgbuild(config: &Path, args: &[&str]) -> Output {
    run(config, args).output()
}

fn post(url: &str, body: &str) {
    let o = Command::new("curl")
        .args(["-sf", "-X", "POST", "-H", "content-type: application/json"])
        .args(["-d", body, url])
        .output()
        .unwrap();
    assert!(o.status.success(), "{url} {body}: {}", text(&o.stderr));
}

/// A bootstrapped 3+2 cluster on Talos `talos` running Kubernetes `k8s`.
pub(super) struct Cluster {
    factory: Sim,
    pub(super) nodes: Nodes,
    _dir: tempfile::TempDir,
    pub(super) config: PathBuf,
    net: String,
}

impl Cluster {
    pub(super) fn start(block: u32, talos: &str, k8s: &str, offered: &str) -> Cluster {
        Self::start_in(&net(block), talos, k8s, offered)
    }

    /// [`Cluster::start`] on the loopback /24 `net`.
    pub(super) fn start_in(net: &str, talos: &str, k8s: &str, offered: &str) -> Cluster {
        let factory = Sim::start_with(&[], 0, &["--versions", offered]);
        let net = net.to_owned();
        let nodes = Nodes::cluster(
            &net,
            true,
            &[
                "--talos-version",
                talos,
                "--reboot-delay",
                "300",
                "--upgrade-delay",
                "50",
                "--static-pod-delay",
                "300",
                "--kubelet-restart-delay",
                "300",
                "--rollout-delay",
                "200",
            ],
        );
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        let c = Cluster {
            factory,
            nodes,
            _dir: dir,
            config,
            net,
        };
        c.want(talos, k8s);
        let o = imgbuild(
            &c.config,
            &["--output", "json", "bootstrap", "--new-secrets"],
        );
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory moves to Talos `talos` and Kubernetes `k8s`.
    pub(super) fn want(&self, talos: &str, k8s: &str) {
        self.want_with(talos, k8s, "");
    }

    /// [`Cluster::want`] with `extra` YAML after the inventory (patches).
    pub(super) fn want_with(&self, talos: &str, k8s: &str, extra: &str) {
        let mut inv = Inventory::five_nodes("sim", &self.net)
            .talos(talos)
            .factory(&self.factory.url);
        if !extra.is_empty() {
            inv = inv.append(extra);
        }
        let text = inv.text();
        assert!(text.contains("kubernetesVersion: v1.32.1"));
        let text = text.replace(
            "kubernetesVersion: v1.32.1",
            &format!("kubernetesVersion: {k8s}"),
        );
        std::fs::write(&self.config, text).unwrap();
    }

    pub(super) fn k8s(&self) -> serde_json::Value {
        self.nodes.stats()["k8s"].clone()
    }

    fn applies(&self) -> u64 {
        self.nodes.stats()["totals"]["applies"].as_u64().unwrap()
    }

    /// Each component restart the simulator saw into `image_tag`.
    fn restarts_to(&self, tag: &str) -> Vec<serde_json::Value> {
        self.k8s()["restarts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["image"].as_str().unwrap().ends_with(tag))
            .cloned()
            .collect()
    }
}

/// The Kubernetes part of a dry run's document: the steps not done.
pub(super) fn left(plan: &serde_json::Value) -> Vec<String> {
    plan["kubernetes"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["done"] == false)
        .map(|s| match s["kind"].as_str().unwrap() {
            "component" => format!(
                "{} {}",
                s["node"].as_str().unwrap(),
                s["component"].as_str().unwrap()
            ),
            k => k.to_owned(),
        })
        .collect()
}

const CPS: [&str; 3] = ["cp-01", "cp-02", "cp-03"];

/// The pre-pulls first, one per node (talosctl pre-pulls on every Talos
/// version from v1.5: `talos_managed.go` `prePullImages`), then `rest`.
fn pulls_then(rest: &[String]) -> Vec<String> {
    let mut out = vec!["prePull".to_owned(); NODES.len()];
    out.extend_from_slice(rest);
    out
}

/// The order talosctl's `upgrade-k8s` goes in, for the 3+2 [`NODES`],
/// after the pre-pulls.
fn full_order() -> Vec<String> {
    let mut out = Vec::new();
    for c in [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kube-proxy",
    ] {
        out.extend(CPS.iter().map(|n| format!("{n} {c}")));
    }
    out.extend(NODES.iter().map(|(n, _, _)| format!("{n} kubelet")));
    out.push("syncManifests".into());
    out
}

#[test]
fn a_3_plus_2_cluster_moves_from_1_32_1_to_1_33_5_in_order_and_a_rerun_does_nothing() {
    // Talos v1.11.5 (Kubernetes 1.29–1.34).
    let c = Cluster::start(0, "v1.11.5", "v1.32.1", "v1.11.5");
    c.want("v1.11.5", "v1.33.5");
    let applies = c.applies();

    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    assert_eq!(plan["kubernetes"]["from"], "v1.32.1");
    assert_eq!(plan["kubernetes"]["to"], "v1.33.5");
    assert_eq!(left(&plan), pulls_then(&full_order()));
    let via: Vec<&str> = plan["kubernetes"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == "prePull")
        .map(|s| s["via"].as_str().unwrap())
        .collect();
    assert_eq!(via, ["ImagePull"; 5], "Talos v1.11 has no ImageService");
    let o = imgbuild(&c.config, &["upgrade", "--dry-run"]);
    let shown = text(&o.stdout);
    assert!(shown.contains("kubernetes: v1.32.1 → v1.33.5"), "{shown}");
    assert!(
        shown.contains("cp-02: kube-scheduler v1.32.1 → v1.33.5"),
        "{shown}"
    );
    assert_eq!(c.applies(), applies, "a dry run applies nothing");
    assert!(c.restarts_to("v1.33.5").is_empty());

    // Kubernetes moves only through upgrade: apply keeps each node's
    // versions, and status names the components, not the configs.
    let o = imgbuild(&c.config, &["apply"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        c.restarts_to("v1.33.5").is_empty(),
        "apply moved Kubernetes"
    );
    let o = imgbuild(&c.config, &["--output", "json", "status", "--check"]);
    assert_eq!(o.status.code(), Some(1));
    let doc = json(&o);
    let what: std::collections::BTreeSet<&str> = doc["drift"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["what"].as_str().unwrap())
        .collect();
    assert_eq!(
        what.into_iter().collect::<Vec<_>>(),
        [
            "kube-apiserver",
            "kube-controller-manager",
            "kube-proxy",
            "kube-scheduler",
            "kubelet"
        ],
        "{doc}"
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
    assert_pre_pulled(&c, &report, "v1.33.5", "MachineService.ImagePull");
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    for secret in [
        "PRIVATE KEY",
        "client-key-data",
        "certificate-authority-data",
    ] {
        assert!(!all.contains(secret), "{secret} in the output");
    }

    // In order, by the simulator's own clock.
    let restarts = c.restarts_to("v1.33.5");
    let order: Vec<String> = restarts
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r["node"].as_str().unwrap(),
                r["component"].as_str().unwrap()
            )
        })
        .collect();
    let mut want = full_order();
    want.retain(|s| !s.ends_with("kube-proxy") && s != "syncManifests");
    assert_eq!(order, want, "{restarts:#?}");
    let apiservers: Vec<&serde_json::Value> = restarts
        .iter()
        .filter(|r| r["component"] == "kube-apiserver")
        .collect();
    for w in apiservers.windows(2) {
        assert!(
            w[0]["ready_ms"].as_u64().unwrap() <= w[1]["start_ms"].as_u64().unwrap(),
            "two API servers restarting at once: {w:?}"
        );
    }
    let control_plane_ready = restarts
        .iter()
        .filter(|r| r["component"] != "kubelet")
        .map(|r| r["ready_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    for k in restarts.iter().filter(|r| r["component"] == "kubelet") {
        assert!(
            k["start_ms"].as_u64().unwrap() >= control_plane_ready,
            "a kubelet before the control plane was done: {k}"
        );
    }
    let workloads = &c.k8s()["workloads"];
    assert_eq!(
        workloads["kube-proxy"], "registry.k8s.io/kube-proxy:v1.33.5",
        "{workloads}"
    );
    let status = imgbuild(&c.config, &["--output", "json", "status"]);
    let doc = json(&status);
    let coredns = doc["kubernetes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["component"] == "coredns")
        .unwrap();
    assert_eq!(coredns["running"], workloads["coredns"], "{coredns}");
    assert_eq!(coredns["in_sync"], true, "{coredns}");

    // A rerun finds everything done.
    let applies = c.applies();
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let again = json(&o);
    assert_eq!(
        again["kubernetes"]["done"],
        serde_json::json!([]),
        "{again}"
    );
    assert_eq!(c.applies(), applies, "a rerun applies nothing");
    assert_eq!(c.restarts_to("v1.33.5").len(), restarts.len());
}

#[test]
fn a_stop_after_the_second_control_plane_resumes_without_repeating_work() {
    // Talos v1.11.5.
    let c = Cluster::start(1, "v1.11.5", "v1.32.1", "v1.11.5");
    c.want("v1.11.5", "v1.33.5");
    run(&c.config, &["upgrade"]).kill_at("kubernetes: done: cp-02: kube-apiserver");
    let before = c.restarts_to("v1.33.5").len();
    assert_eq!(before, 2, "{:#?}", c.restarts_to("v1.33.5"));

    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    let plan = json(&o);
    assert_eq!(left(&plan), pulls_then(&full_order()[2..]));
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);
    let done: Vec<&str> = report["kubernetes"]["done"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert!(
        !done
            .iter()
            .any(|s| s.starts_with("cp-01: kube-apiserver")
                || s.starts_with("cp-02: kube-apiserver")),
        "{done:?}"
    );
    let restarts = c.restarts_to("v1.33.5");
    for cp in CPS {
        let n = restarts
            .iter()
            .filter(|r| r["node"] == cp && r["component"] == "kube-apiserver")
            .count();
        assert_eq!(n, 1, "{cp}: {restarts:#?}");
    }
}

#[test]
fn a_cluster_still_requesting_a_removed_api_is_refused_before_any_change() {
    // Talos v1.11.5, Kubernetes 1.31.4 → 1.32.2: 1.32 stops serving
    // flowcontrol.apiserver.k8s.io/v1beta3.
    let c = Cluster::start(2, "v1.11.5", "v1.31.4", "v1.11.5");
    post(
        &format!("{}/_sim/k8s-apis", c.nodes.control),
        r#"{"requested": [{"group": "flowcontrol.apiserver.k8s.io", "version": "v1beta3", "resource": "flowschemas", "removed_release": "1.32"}]}"#,
    );
    c.want("v1.11.5", "v1.32.2");
    let applies = c.applies();
    let o = imgbuild(&c.config, &["upgrade"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stdout));
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(
        all.contains("flowschemas.v1beta3.flowcontrol.apiserver.k8s.io"),
        "{all}"
    );
    assert!(all.contains("--skip-api-check"), "{all}");
    assert_eq!(c.applies(), applies, "refused before any change");
    assert!(c.restarts_to("v1.32.2").is_empty());

    // Overridden, and said so.
    let o = imgbuild(&c.config, &["upgrade", "--dry-run", "--skip-api-check"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shown = text(&o.stdout);
    assert!(
        shown.contains("note: --skip-api-check: upgrading although the cluster still uses APIs Kubernetes v1.32.2 removes: flowschemas.v1beta3"),
        "{shown}"
    );
}

#[test]
fn a_kubelet_flag_the_target_removes_is_refused_before_any_change_naming_flag_and_node() {
    // Talos v1.11.5, Kubernetes 1.33.5 → 1.34.1: 1.34 removes the kubelet's
    // --cloud-config (go-kubernetes kubernetes/upgrade/checks.go, "1.33->1.34").
    let c = Cluster::start(8, "v1.11.5", "v1.33.5", "v1.11.5");
    std::fs::write(
        c.config.with_file_name("cloud.yaml"),
        "machine:\n  kubelet:\n    extraArgs:\n      cloud-config: /etc/kubernetes/cloud.conf\n",
    )
    .unwrap();
    c.want_with("v1.11.5", "v1.34.1", "patches:\n  worker: [cloud.yaml]\n");
    let applies = c.applies();
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    for w in ["worker-01", "worker-02"] {
        assert!(
            all.contains(&format!("{w} kubelet: flag --cloud-config")),
            "{all}"
        );
    }
    assert!(!all.contains("cp-01 kubelet"), "{all}");
    assert_eq!(c.applies(), applies, "refused before any change");
    assert!(c.restarts_to("v1.34.1").is_empty());
    assert!(c.k8s()["pulled"].as_object().is_none_or(|p| p.is_empty()));
}

#[test]
fn kubernetes_1_35_on_talos_1_11_is_refused_naming_both_versions() {
    // Talos v1.11.5 runs Kubernetes 1.29–1.34.
    let c = Cluster::start(3, "v1.11.5", "v1.34.1", "v1.11.5");
    c.want("v1.11.5", "v1.35.0");
    let applies = c.applies();
    let o = imgbuild(&c.config, &["upgrade"]);
    assert_eq!(o.status.code(), Some(1));
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(
        all.contains(
            "Kubernetes v1.35.0 is too new for Talos v1.11.5, which runs Kubernetes 1.29–1.34"
        ),
        "{all}"
    );
    // JSON readers get one document carrying the refusal.
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert_eq!(o.status.code(), Some(1));
    let doc: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {:?}", text(&o.stdout)));
    assert!(
        doc["kubernetes"]["refusal"]
            .as_str()
            .is_some_and(|r| r.contains("too new for Talos v1.11.5")),
        "{doc}"
    );
    assert_eq!(c.applies(), applies);
}

#[test]
fn talos_and_kubernetes_bumped_together_move_talos_first() {
    // Talos v1.10.7 → v1.11.5, Kubernetes v1.32.1 → v1.33.5.
    let c = Cluster::start(4, "v1.10.7", "v1.32.1", "v1.10.7,v1.11.5");
    let coredns_before = c.k8s()["workloads"]["coredns"].clone();
    c.want("v1.11.5", "v1.33.5");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let stats = c.nodes.stats();
    let last_talos_up = stats["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["up_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    let first_k8s = c
        .restarts_to("v1.33.5")
        .iter()
        .map(|r| r["start_ms"].as_u64().unwrap())
        .min()
        .unwrap();
    assert!(
        last_talos_up <= first_k8s,
        "Kubernetes moved before Talos was done"
    );
    for (name, _, _) in NODES {
        assert_eq!(stats["nodes"][name]["day2"]["version"], "v1.11.5");
    }
    let coredns = &c.k8s()["workloads"]["coredns"];
    assert_ne!(
        coredns, &coredns_before,
        "CoreDNS follows Talos v1.11's manifests"
    );
}

#[test]
fn status_check_exits_1_while_coredns_is_on_the_old_image() {
    // Talos v1.10.7 renders an older CoreDNS than v1.11.5; a node whose
    // Talos moves renders the new one, and Talos never updates it.
    let c = Cluster::start(5, "v1.10.7", "v1.32.1", "v1.10.7,v1.11.5");
    let o = imgbuild(&c.config, &["status", "--check"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    for (name, _, _) in NODES {
        post(
            &format!("{}/_sim/node", c.nodes.control),
            &format!(r#"{{"node": "{name}", "version": "v1.11.5"}}"#),
        );
    }
    c.want("v1.11.5", "v1.32.1");
    // The installer named in the configs follows the inventory's Talos.
    let o = imgbuild(&c.config, &["apply"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let o = imgbuild(&c.config, &["status", "--check"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stdout));
    let shown = text(&o.stdout);
    let drift: Vec<&str> = shown.lines().filter(|l| l.starts_with("drift: ")).collect();
    assert_eq!(
        drift,
        ["drift: cluster: coredns differs from the inventory (fix: imgbuild upgrade)"],
        "{shown}"
    );
    let o = imgbuild(&c.config, &["upgrade"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let o = imgbuild(&c.config, &["status", "--check"]);
    assert!(o.status.success(), "{}", text(&o.stdout));
}

/// talosctl `prePullImages` (`talos_managed.go`): kube-apiserver,
/// kube-controller-manager and kube-scheduler on each control plane, the
/// kubelet on every node, each node either pulled exactly those (in the
/// CRI containerd) or answered Unimplemented and was noted as skipped.
fn assert_pre_pulled(c: &Cluster, report: &serde_json::Value, to: &str, api: &str) {
    let pulled = &c.k8s()["pulled"];
    let notes = report["kubernetes"]["notes"].to_string();
    for (node, _, role) in NODES {
        let mut want = Vec::new();
        if role == "controlplane" {
            for c in [
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
            ] {
                want.push(format!("registry.k8s.io/{c}:{to}"));
            }
        }
        want.push(format!("ghcr.io/siderolabs/kubelet:{to}"));
        let skipped = format!("{node}: Talos does not offer {api}: not pre-pulled");
        match pulled[node].as_array() {
            Some(images) => {
                let images: Vec<&str> = images.iter().map(|i| i.as_str().unwrap()).collect();
                assert_eq!(images, want, "{node}: {pulled}");
                assert!(!notes.contains(&skipped), "{node}: {notes}");
            }
            None => assert!(notes.contains(&skipped), "{node} pulled nothing: {notes}"),
        }
    }
}

/// Kubernetes 1.32.1 → 1.33.5 on Talos `talos` (v1.13+): the pre-pulls go
/// through ImageService.Pull with the CRI driver (talos ctrhelper.go;
/// ctrhelper.go refuses the containerd driver with NS_CRI), then the rest.
fn moves_with_image_service(block: u32, talos: &str) {
    let c = Cluster::start(block, talos, "v1.32.1", talos);
    c.want(talos, "v1.33.5");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--dry-run"]);
    let plan = json(&o);
    assert_eq!(left(&plan), pulls_then(&full_order()));
    for step in plan["kubernetes"]["steps"].as_array().unwrap() {
        if step["kind"] == "prePull" {
            assert_eq!(step["via"], "ImageService", "{step}");
        }
    }
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let report = json(&o);
    assert!(report["kubernetes"]["failed"].is_null(), "{report}");
    assert!(
        !report["kubernetes"]["notes"]
            .to_string()
            .contains("not pre-pulled"),
        "{report}"
    );
    assert_pre_pulled(&c, &report, "v1.33.5", "ImageService.Pull");
    assert_eq!(c.restarts_to("v1.33.5").len(), 14);
}

#[test]
fn talos_1_13_pre_pulls_through_image_service_into_the_cri_containerd() {
    // Talos v1.13.5.
    moves_with_image_service(6, "v1.13.5");
}

#[test]
fn talos_1_14_pre_pulls_through_image_service_into_the_cri_containerd() {
    // Talos v1.14.0 (Kubernetes 1.32–1.37).
    moves_with_image_service(7, "v1.14.0");
}
