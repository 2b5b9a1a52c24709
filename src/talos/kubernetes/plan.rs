//! What a Kubernetes upgrade will do, decided from what the live cluster
//! runs before anything changes: the checks that refuse it (Talos ↔
//! Kubernetes compatibility per node, the minor rule, removed APIs), then
//! the steps in talosctl `upgrade-k8s` order (siderolabs/talos
//! `pkg/cluster/kubernetes/talos_managed.go`, `Upgrade`): the checks first,
//! then the images pre-pulled into the CRI containerd (`prePullImages`:
//! `MachineService.ImagePull` from v1.5, `ImageService.Pull` with the CRI
//! driver from v1.13, where ImagePull is deprecated); kube-apiserver on each control
//! plane one at a time, then kube-controller-manager on each, then
//! kube-scheduler on each (no controller-manager or scheduler is ever newer
//! than an API server, as the version skew policy asks); kube-proxy in each
//! control plane's config unless disabled; the kubelets one node at a time,
//! control planes first; then the bootstrap manifests synced the way the
//! cluster's oldest Talos version has talosctl sync them ([`SyncMode`]:
//! replaced before v1.13; server-side applied with Talos's inventory, and
//! what it no longer renders pruned, from v1.13). Each step is
//! done or not by what the cluster shows, so a rerun after a stop skips
//! what is done. Pure: `--dry-run` prints it, the run executes it.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::compat::{self, Version};
use super::flags::{self, RemovedSetting};
pub use super::manifests::SyncMode;
use super::removed::{self, Finding, RemovedApi, Requested};
use crate::inventory::parse_version;
use crate::talos::client::PullApi;

/// A Kubernetes component Talos runs and its machine config pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Component {
    KubeApiserver,
    KubeControllerManager,
    KubeScheduler,
    KubeProxy,
    Kubelet,
}

impl Component {
    /// The static pods, in the order they are upgraded.
    pub const STATIC_PODS: [Component; 3] = [
        Component::KubeApiserver,
        Component::KubeControllerManager,
        Component::KubeScheduler,
    ];

    pub const ALL: [Component; 5] = [
        Component::KubeApiserver,
        Component::KubeControllerManager,
        Component::KubeScheduler,
        Component::KubeProxy,
        Component::Kubelet,
    ];

    /// Its name, and the `k8s-app` label of its pods.
    pub fn name(self) -> &'static str {
        match self {
            Component::KubeApiserver => "kube-apiserver",
            Component::KubeControllerManager => "kube-controller-manager",
            Component::KubeScheduler => "kube-scheduler",
            Component::KubeProxy => "kube-proxy",
            Component::Kubelet => "kubelet",
        }
    }

    /// Where a v1alpha1 machine config holds its image.
    fn config_path(self) -> [&'static str; 2] {
        match self {
            Component::KubeApiserver => ["cluster", "apiServer"],
            Component::KubeControllerManager => ["cluster", "controllerManager"],
            Component::KubeScheduler => ["cluster", "scheduler"],
            Component::KubeProxy => ["cluster", "proxy"],
            Component::Kubelet => ["machine", "kubelet"],
        }
    }

    /// Which node runs it: control planes only, or every node.
    pub fn on_control_planes_only(self) -> bool {
        self != Component::Kubelet
    }
}

/// One component on one node as the cluster shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Seen {
    /// `v1.32.1`; None when it could not be read.
    pub version: Option<String>,
    /// Its pod (static pods) or Node (kubelet) is Ready; true for kube-proxy,
    /// which is a line in the config.
    pub ready: bool,
}

/// One node as read before the upgrade.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSeen {
    pub node: String,
    pub control_plane: bool,
    /// The Talos version the node runs when Kubernetes moves (after a Talos
    /// upgrade of the same run: its target).
    pub talos: Option<String>,
    pub components: BTreeMap<Component, Seen>,
    /// The images of the target, from the node's rendered config.
    pub wanted_images: BTreeMap<Component, String>,
    /// Each component's command-line arguments from the rendered config
    /// (`extraArgs`), for the removed-settings check.
    pub args: BTreeMap<Component, Vec<String>>,
    /// Why something could not be read.
    pub error: Option<String>,
}

/// Whether a bootstrap manifest object matches what Talos renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ObjectState {
    Missing,
    Differs,
    InSync,
    /// It carries another inventory's `config.k8s.io/owning-inventory`
    /// mark: the server-side apply of Talos v1.13+ refuses it.
    Foreign,
}

/// The whole cluster as read before the upgrade.
#[derive(Debug, Clone, Default)]
pub struct ClusterSeen {
    /// Control planes first, then workers, each in inventory order.
    pub nodes: Vec<NodeSeen>,
    /// `cluster.proxy.disabled` in the control planes' configs.
    pub proxy_disabled: bool,
    /// Each bootstrap manifest object (`apps/v1 DaemonSet kube-system/kube-proxy`).
    pub manifests: Vec<(String, ObjectState)>,
    /// Why the manifests could not be read.
    pub manifests_error: Option<String>,
    /// Talos v1.13+: objects Talos's inventory lists, marked as its own,
    /// that it no longer renders (to be pruned).
    pub prune: Vec<String>,
    /// Objects Talos's inventory lists that it no longer renders but that
    /// carry no Talos mark: never pruned.
    pub unmarked: Vec<String>,
    /// `apiserver_requested_deprecated_apis` series, by API server.
    pub requested: Vec<(String, Requested)>,
    /// Objects kept under an API version without successor.
    pub stored: Vec<(RemovedApi, u64)>,
    /// Why the removed-API check could not read what it needs.
    pub api_check_error: Option<String>,
}

/// One step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Step {
    /// The target's images pulled into the node's CRI containerd through
    /// `via` (the kubelet's into namespace `system`, the rest `k8s.io`).
    #[serde(rename_all = "camelCase")]
    PrePull {
        node: String,
        images: Vec<String>,
        via: PullApi,
    },
    /// The component's image moved in the node's config
    /// (ApplyConfiguration NO_REBOOT), then waited for.
    #[serde(rename_all = "camelCase")]
    Component {
        node: String,
        component: Component,
        from: Option<String>,
        to: String,
    },
    /// The manifests Talos renders synced as talosctl syncs them on the
    /// cluster's oldest Talos version (`mode`): `objects` differ now;
    /// `prune` (Talos v1.13+) are deleted as no longer rendered.
    #[serde(rename_all = "camelCase")]
    SyncManifests {
        objects: Vec<String>,
        mode: SyncMode,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        prune: Vec<String>,
    },
}

impl Step {
    /// One line for progress and the report.
    pub fn describe(&self) -> String {
        match self {
            Step::PrePull { node, images, .. } => {
                format!("{node}: pre-pull {}", images.join(", "))
            }
            Step::Component {
                node,
                component,
                from,
                to,
            } => format!(
                "{node}: {} {} → {to}",
                component.name(),
                from.as_deref().unwrap_or("?")
            ),
            Step::SyncManifests { objects, prune, .. } => {
                let mut out = "bootstrap manifests: sync".to_owned();
                if !objects.is_empty() {
                    out.push(' ');
                    out.push_str(&objects.join(", "));
                }
                if !prune.is_empty() {
                    out.push_str("; prune ");
                    out.push_str(&prune.join(", "));
                }
                out
            }
        }
    }
}

/// A step and whether the cluster shows it done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedStep {
    #[serde(flatten)]
    pub step: Step,
    pub done: bool,
}

/// The whole Kubernetes upgrade, decided up front.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubePlan {
    /// The version the API servers run (the oldest, when they differ).
    pub from: Option<String>,
    pub to: String,
    pub steps: Vec<PlannedStep>,
    /// What still uses an API the target removes.
    pub removed_apis: Vec<Finding>,
    /// Component flags, feature gates and admission plugins the target
    /// removes that a node still starts a component with.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub removed_settings: Vec<RemovedSetting>,
    /// `--skip-api-check` was given and there were findings.
    pub api_check_skipped: bool,
    pub notes: Vec<String>,
    /// Why nothing may run.
    pub refusal: Option<String>,
}

impl KubePlan {
    /// Whether a step is left to run.
    pub fn has_work(&self) -> bool {
        self.refusal.is_none() && self.steps.iter().any(|s| !s.done)
    }
}

/// `v1.33.5` for `1.33.5` or `v1.33.5`.
pub fn version_tag(v: &str) -> String {
    format!("v{}", v.trim_start_matches('v'))
}

fn parsed(v: &str) -> Option<Version> {
    parse_version(v, false)
}

/// The API a node on `talos` pre-pulls through; None when it has none
/// (below v1.5) or its version is unknown.
fn pull_api(talos: Option<&str>) -> Option<PullApi> {
    let (major, minor, _) = talos.and_then(parsed)?;
    PullApi::for_talos(major.into(), minor.into())
}

/// The cluster's Kubernetes version: what its API servers run (the oldest
/// when they differ).
pub fn cluster_version(seen: &ClusterSeen) -> Option<String> {
    seen.nodes
        .iter()
        .filter_map(|n| n.components.get(&Component::KubeApiserver))
        .filter_map(|s| s.version.as_deref().and_then(parsed))
        .min()
        .map(compat::tag)
}

/// Decides the plan: refuses on any check, else lists every step with what
/// the cluster shows done. `skip_api_check` turns removed-API findings into
/// a note.
pub fn decide(seen: &ClusterSeen, target: &str, skip_api_check: bool) -> KubePlan {
    let to = version_tag(target);
    let mut plan = KubePlan {
        to: to.clone(),
        ..KubePlan::default()
    };
    let Some(t) = parsed(&to) else {
        plan.refusal = Some(format!("cannot read Kubernetes version {target:?}"));
        return plan;
    };
    let mut refusals: Vec<String> = Vec::new();
    for n in &seen.nodes {
        match &n.talos {
            Some(talos) => {
                if let Err(e) = compat::supported(talos, &to) {
                    refusals.push(format!("node {}: {e}", n.node));
                }
            }
            None => refusals.push(format!(
                "node {}: its Talos version could not be read ({})",
                n.node,
                n.error.as_deref().unwrap_or("no answer")
            )),
        }
        for (c, s) in &n.components {
            if let Some(from) = s.version.as_deref().and_then(parsed)
                && let Err(e) = compat::step_allowed(c.name(), &n.node, from, t)
            {
                refusals.push(e.to_string());
            }
        }
    }
    plan.from = cluster_version(seen);
    let from = plan.from.as_deref().and_then(parsed);
    if from.is_none() {
        refusals.push("no control plane reports its kube-apiserver version".to_owned());
    }
    if let Some(f) = from
        && f.1 < t.1
    {
        // go-kubernetes checks.go: static pods on control planes, the
        // kubelet everywhere; no flag skips it (the component would not start).
        for n in &seen.nodes {
            for (c, args) in &n.args {
                if *c == Component::KubeProxy || (!n.control_plane && c.on_control_planes_only()) {
                    continue;
                }
                plan.removed_settings
                    .extend(flags::removed_in(f.1, t.1, &n.node, c.name(), args));
            }
        }
        if !plan.removed_settings.is_empty() {
            let list: Vec<String> = plan
                .removed_settings
                .iter()
                .map(RemovedSetting::describe)
                .collect();
            refusals.push(format!(
                "Kubernetes {to} removes settings the cluster still starts components with: {} (remove them from the inventory's patches first)",
                list.join("; ")
            ));
        }
        if let Some(e) = &seen.api_check_error {
            if skip_api_check {
                plan.notes.push(format!(
                    "--skip-api-check: the removed-API check was not made ({e})"
                ));
            } else {
                refusals.push(format!(
                    "the removed-API check could not read the cluster ({e}); --skip-api-check upgrades without it"
                ));
            }
        }
        plan.removed_apis = removed::findings(f.1, t.1, &seen.requested, &seen.stored);
        if !plan.removed_apis.is_empty() {
            let list: Vec<String> = plan
                .removed_apis
                .iter()
                .map(|f| format!("{} ({}, removed in {})", f.resource, f.detail, f.removed_in))
                .collect();
            if skip_api_check {
                plan.api_check_skipped = true;
                plan.notes.push(format!(
                    "--skip-api-check: upgrading although the cluster still uses APIs Kubernetes {to} removes: {}",
                    list.join("; ")
                ));
            } else {
                refusals.push(format!(
                    "the cluster still uses APIs Kubernetes {to} removes: {} (migrate them, or --skip-api-check)",
                    list.join("; ")
                ));
            }
        }
    }
    let foreign: Vec<&str> = seen
        .manifests
        .iter()
        .filter(|(_, s)| *s == ObjectState::Foreign)
        .map(|(o, _)| o.as_str())
        .collect();
    if !foreign.is_empty() && sync_mode(seen) == SyncMode::Apply {
        // go-kubernetes ssa, policy AdoptIfNoInventory: "inventory policy
        // prevented actuation (status: NoMatch)".
        refusals.push(format!(
            "bootstrap manifest objects belong to another inventory (their {} annotation is not {}): {}; Talos's server-side apply refuses to take them over",
            super::manifests::OWNING_INVENTORY,
            super::manifests::INVENTORY_NAME,
            foreign.join(", ")
        ));
    }
    if !refusals.is_empty() {
        plan.refusal = Some(refusals.join("; "));
        return plan;
    }
    if !seen.unmarked.is_empty() {
        plan.notes.push(format!(
            "not pruned although Talos no longer renders them: {} (listed in Talos's inventory, but without its {} mark: not created by Talos)",
            seen.unmarked.join(", "),
            super::manifests::OWNING_INVENTORY
        ));
    }
    plan.steps = steps(seen, &to);
    plan
}

fn done_in(n: &NodeSeen, c: Component, to: &str) -> bool {
    n.components
        .get(&c)
        .is_some_and(|s| s.version.as_deref() == Some(to) && s.ready)
}

fn component_step(n: &NodeSeen, c: Component, to: &str) -> PlannedStep {
    PlannedStep {
        step: Step::Component {
            node: n.node.clone(),
            component: c,
            from: n.components.get(&c).and_then(|s| s.version.clone()),
            to: to.to_owned(),
        },
        done: done_in(n, c, to),
    }
}

/// The steps in order, each marked done or not.
fn steps(seen: &ClusterSeen, to: &str) -> Vec<PlannedStep> {
    let cps: Vec<&NodeSeen> = seen.nodes.iter().filter(|n| n.control_plane).collect();
    let mut main: Vec<PlannedStep> = Vec::new();
    for c in Component::STATIC_PODS {
        main.extend(cps.iter().map(|n| component_step(n, c, to)));
    }
    if !seen.proxy_disabled {
        main.extend(
            cps.iter()
                .map(|n| component_step(n, Component::KubeProxy, to)),
        );
    }
    main.extend(
        seen.nodes
            .iter()
            .map(|n| component_step(n, Component::Kubelet, to)),
    );
    let mut out: Vec<PlannedStep> = Vec::new();
    for n in &seen.nodes {
        let Some(via) = pull_api(n.talos.as_deref()) else {
            continue;
        };
        let images: Vec<String> = [
            Component::KubeApiserver,
            Component::KubeControllerManager,
            Component::KubeScheduler,
            Component::Kubelet,
        ]
        .into_iter()
        .filter(|c| n.control_plane || !c.on_control_planes_only())
        // Running the target already (Ready or not): its image is there.
        .filter(|c| n.components.get(c).and_then(|s| s.version.as_deref()) != Some(to))
        .filter_map(|c| n.wanted_images.get(&c).cloned())
        .collect();
        if !images.is_empty() {
            out.push(PlannedStep {
                step: Step::PrePull {
                    node: n.node.clone(),
                    images,
                    via,
                },
                done: false,
            });
        }
    }
    let components_done = main.iter().all(|s| s.done);
    out.extend(main);
    let differing: Vec<String> = seen
        .manifests
        .iter()
        .filter(|(_, s)| *s != ObjectState::InSync)
        .map(|(o, _)| o.clone())
        .collect();
    let mode = sync_mode(seen);
    // Before v1.13 talosctl deletes nothing.
    let prune = match mode {
        SyncMode::Apply => seen.prune.clone(),
        SyncMode::Replace => Vec::new(),
    };
    out.push(PlannedStep {
        done: components_done
            && differing.is_empty()
            && prune.is_empty()
            && seen.manifests_error.is_none(),
        step: Step::SyncManifests {
            objects: differing,
            mode,
            prune,
        },
    });
    out
}

/// How talosctl syncs the manifests on this cluster: by its oldest node's
/// Talos version (the one it runs when Kubernetes moves).
pub fn sync_mode(seen: &ClusterSeen) -> SyncMode {
    SyncMode::of(seen.nodes.iter().filter_map(|n| n.talos.as_deref()))
}

/// The versions a node's config pins before the run: what each component
/// runs, else the API servers' version, else the target.
pub fn pins(n: &NodeSeen, from: Option<&str>, to: &str) -> BTreeMap<Component, String> {
    Component::ALL
        .into_iter()
        .map(|c| {
            let v = n
                .components
                .get(&c)
                .and_then(|s| s.version.clone())
                .or_else(|| from.map(str::to_owned))
                .unwrap_or_else(|| to.to_owned());
            (c, v)
        })
        .collect()
}

/// `image` with its tag set to `version` (a digest reference stays as is).
pub fn retag(image: &str, version: &str) -> String {
    if image.contains('@') {
        return image.to_owned();
    }
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    let repo = match image[name_start..].find(':') {
        Some(i) => &image[..name_start + i],
        None => image,
    };
    format!("{repo}:{version}")
}

/// The tag of an image reference (`v1.33.5`), if it has one.
pub fn tag_of(image: &str) -> Option<&str> {
    let name_start = image.rfind('/').map_or(0, |i| i + 1);
    let name = image[name_start..].split('@').next()?;
    name.split_once(':').map(|(_, t)| t)
}

/// Why a rendered config could not be read or re-pinned.
#[derive(Debug, thiserror::Error)]
pub enum RenderedError {
    #[error("the config is not UTF-8")]
    NotUtf8,
    #[error("the config is not YAML: {0}")]
    NotYaml(#[source] serde_yaml_ng::Error),
    /// Writing the pinned document back out.
    #[error("{0}")]
    Serialise(#[source] serde_yaml_ng::Error),
}

/// Splits a rendered config into its v1alpha1 document (parsed) and the
/// documents after it (as text).
fn split(config: &[u8]) -> Result<(Value, &str), RenderedError> {
    let text = std::str::from_utf8(config).map_err(|_| RenderedError::NotUtf8)?;
    let (first, rest) = match text.split_once("\n---\n") {
        Some((a, b)) => (a, b),
        None => (text, ""),
    };
    let doc: Value = serde_yaml_ng::from_str(first).map_err(RenderedError::NotYaml)?;
    Ok((doc, rest))
}

/// The images a rendered config gives each component it names.
pub fn images_of(config: &[u8]) -> BTreeMap<Component, String> {
    let Ok((doc, _)) = split(config) else {
        return BTreeMap::new();
    };
    Component::ALL
        .into_iter()
        .filter_map(|c| {
            let [a, b] = c.config_path();
            doc[a][b]["image"].as_str().map(|i| (c, i.to_owned()))
        })
        .collect()
}

/// Each component's `extraArgs` in a rendered config, as command-line
/// arguments.
pub fn args_of(config: &[u8]) -> BTreeMap<Component, Vec<String>> {
    let Ok((doc, _)) = split(config) else {
        return BTreeMap::new();
    };
    Component::ALL
        .into_iter()
        .filter_map(|c| {
            let [a, b] = c.config_path();
            let args = doc[a][b]["extraArgs"].as_object()?;
            let list = args
                .iter()
                .map(|(k, v)| format!("--{k}={}", flags::arg_value(v)))
                .collect();
            Some((c, list))
        })
        .collect()
}

/// Whether a rendered config disables kube-proxy (`cluster.proxy.disabled`).
pub fn proxy_disabled(config: &[u8]) -> bool {
    split(config).is_ok_and(|(doc, _)| doc["cluster"]["proxy"]["disabled"] == true)
}

/// The rendered config with each component's image at the version `pins`
/// gives it (the image's repository kept); other documents untouched.
pub fn with_versions(
    config: &[u8],
    pins: &BTreeMap<Component, String>,
) -> Result<Vec<u8>, RenderedError> {
    let (mut doc, rest) = split(config)?;
    for (c, v) in pins {
        let [a, b] = c.config_path();
        if let Some(image) = doc[a][b]["image"].as_str() {
            let image = retag(image, v);
            doc[a][b]["image"] = Value::String(image);
        }
    }
    let mut text = serde_yaml_ng::to_string(&doc).map_err(RenderedError::Serialise)?;
    if !rest.is_empty() {
        text.push_str("---\n");
        text.push_str(rest);
    }
    Ok(text.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CP_CONFIG: &str = "version: v1alpha1\nmachine:\n  type: controlplane\n  kubelet:\n    image: ghcr.io/siderolabs/kubelet:v1.33.5\ncluster:\n  apiServer:\n    image: registry.k8s.io/kube-apiserver:v1.33.5\n  controllerManager:\n    image: registry.k8s.io/kube-controller-manager:v1.33.5\n  proxy:\n    image: mirror.local:5000/kube-proxy:v1.33.5\n  scheduler:\n    image: registry.k8s.io/kube-scheduler:v1.33.5\n---\napiVersion: v1alpha1\nkind: HostnameConfig\nhostname: cp-01\n";

    fn node(name: &str, cp: bool, talos: &str, v: &str) -> NodeSeen {
        let comps: &[Component] = if cp {
            &Component::ALL
        } else {
            &[Component::Kubelet]
        };
        NodeSeen {
            node: name.into(),
            control_plane: cp,
            talos: Some(talos.into()),
            components: comps
                .iter()
                .map(|c| {
                    (
                        *c,
                        Seen {
                            version: Some(v.into()),
                            ready: true,
                        },
                    )
                })
                .collect(),
            wanted_images: images_of(CP_CONFIG.as_bytes())
                .into_iter()
                .filter(|(c, _)| cp || *c == Component::Kubelet)
                .collect(),
            args: BTreeMap::new(),
            error: None,
        }
    }

    /// A 3+2 cluster on Talos `talos`, every component at `v`.
    fn cluster(talos: &str, v: &str) -> ClusterSeen {
        ClusterSeen {
            nodes: vec![
                node("cp-01", true, talos, v),
                node("cp-02", true, talos, v),
                node("cp-03", true, talos, v),
                node("w-01", false, talos, v),
                node("w-02", false, talos, v),
            ],
            manifests: vec![
                (
                    "apps/v1 DaemonSet kube-system/kube-proxy".into(),
                    ObjectState::Differs,
                ),
                (
                    "apps/v1 Deployment kube-system/coredns".into(),
                    ObjectState::InSync,
                ),
            ],
            ..ClusterSeen::default()
        }
    }

    fn described(p: &KubePlan) -> Vec<String> {
        p.steps
            .iter()
            .filter(|s| !s.done)
            .map(|s| s.step.describe())
            .collect()
    }

    #[test]
    fn steps_follow_talosctl_order_component_by_component() {
        let p = decide(&cluster("v1.11.5", "v1.32.1"), "1.33.5", false);
        assert_eq!(p.refusal, None);
        assert_eq!(p.from.as_deref(), Some("v1.32.1"));
        let want: Vec<String> = [
            "cp-01: kube-apiserver",
            "cp-02: kube-apiserver",
            "cp-03: kube-apiserver",
            "cp-01: kube-controller-manager",
            "cp-02: kube-controller-manager",
            "cp-03: kube-controller-manager",
            "cp-01: kube-scheduler",
            "cp-02: kube-scheduler",
            "cp-03: kube-scheduler",
            "cp-01: kube-proxy",
            "cp-02: kube-proxy",
            "cp-03: kube-proxy",
            "cp-01: kubelet",
            "cp-02: kubelet",
            "cp-03: kubelet",
            "w-01: kubelet",
            "w-02: kubelet",
        ]
        .iter()
        .map(|s| format!("{s} v1.32.1 → v1.33.5"))
        .chain(["bootstrap manifests: sync apps/v1 DaemonSet kube-system/kube-proxy".to_owned()])
        .collect();
        // Talos v1.11 pre-pulls through ImagePull first, one step a node.
        let all = described(&p);
        for (step, node) in all.iter().zip(["cp-01", "cp-02", "cp-03", "w-01", "w-02"]) {
            assert!(step.starts_with(&format!("{node}: pre-pull ")), "{step}");
        }
        assert_eq!(all[5..], want);
        assert!(p.has_work());
    }

    #[test]
    fn extra_args_become_the_command_line() {
        let config = b"machine:\n  kubelet:\n    extraArgs:\n      pod-infra-container-image: pause:3.10\ncluster:\n  apiServer:\n    extraArgs:\n      feature-gates: [A=true, B=false]\n";
        let args = args_of(config);
        assert_eq!(
            args[&Component::Kubelet],
            ["--pod-infra-container-image=pause:3.10"]
        );
        assert_eq!(
            args[&Component::KubeApiserver],
            ["--feature-gates=A=true,B=false"]
        );
    }

    #[test]
    fn a_setting_the_target_removes_refuses_naming_node_and_flag() {
        // go-kubernetes checks.go "1.34->1.35": the kubelet's
        // --pod-infra-container-image; Talos v1.12.4 runs 1.35.
        let mut seen = cluster("v1.12.4", "v1.34.1");
        seen.nodes[4].args.insert(
            Component::Kubelet,
            vec!["--pod-infra-container-image=registry.k8s.io/pause:3.10".into()],
        );
        seen.nodes[1].args.insert(
            Component::KubeApiserver,
            vec!["--feature-gates=SizeMemoryBackedVolumes=true".into()],
        );
        let p = decide(&seen, "v1.35.0", true);
        let r = p.refusal.expect("refused");
        assert!(
            r.contains("w-02 kubelet: flag --pod-infra-container-image"),
            "{r}"
        );
        assert!(
            r.contains("cp-02 kube-apiserver: feature gate SizeMemoryBackedVolumes"),
            "{r}"
        );
        assert!(p.steps.is_empty(), "nothing planned");
        assert_eq!(p.removed_settings.len(), 2);
        // A patch release removes nothing.
        let mut seen = cluster("v1.12.4", "v1.35.0");
        seen.nodes[4].args = [(
            Component::Kubelet,
            vec!["--pod-infra-container-image=x".to_owned()],
        )]
        .into();
        assert_eq!(decide(&seen, "v1.35.1", false).refusal, None);
    }

    #[test]
    fn talos_1_13_nodes_pre_pull_first_and_only_what_is_left() {
        let mut seen = cluster("v1.13.2", "v1.32.1");
        seen.nodes[0]
            .components
            .get_mut(&Component::KubeApiserver)
            .unwrap()
            .version = Some("v1.33.5".into());
        seen.nodes[4].talos = Some("v1.12.4".into());
        let p = decide(&seen, "v1.33.5", false);
        let pulls: Vec<&Step> = p
            .steps
            .iter()
            .take_while(|s| matches!(s.step, Step::PrePull { .. }))
            .map(|s| &s.step)
            .collect();
        assert_eq!(pulls.len(), 5, "every node pre-pulls, as talosctl does");
        assert_eq!(
            *pulls[0],
            Step::PrePull {
                node: "cp-01".into(),
                images: vec![
                    "registry.k8s.io/kube-controller-manager:v1.33.5".into(),
                    "registry.k8s.io/kube-scheduler:v1.33.5".into(),
                    "ghcr.io/siderolabs/kubelet:v1.33.5".into(),
                ],
                via: PullApi::ImageService,
            }
        );
        assert_eq!(
            *pulls[3],
            Step::PrePull {
                node: "w-01".into(),
                images: vec!["ghcr.io/siderolabs/kubelet:v1.33.5".into()],
                via: PullApi::ImageService,
            }
        );
        assert_eq!(
            *pulls[4],
            Step::PrePull {
                node: "w-02".into(),
                images: vec!["ghcr.io/siderolabs/kubelet:v1.33.5".into()],
                via: PullApi::ImagePull,
            },
            "Talos v1.12 has ImagePull, not ImageService"
        );
        assert!(!described(&p).contains(&"cp-01: kube-apiserver v1.33.5 → v1.33.5".to_owned()));
    }

    #[test]
    fn a_finished_cluster_has_nothing_left() {
        let mut seen = cluster("v1.11.5", "v1.33.5");
        seen.manifests[0].1 = ObjectState::InSync;
        let p = decide(&seen, "v1.33.5", false);
        assert!(!p.has_work(), "{:?}", described(&p));
        // A pod on the target that is not Ready yet is waited for again.
        seen.nodes[1]
            .components
            .get_mut(&Component::KubeScheduler)
            .unwrap()
            .ready = false;
        assert_eq!(
            described(&decide(&seen, "v1.33.5", false)),
            [
                "cp-02: kube-scheduler v1.33.5 → v1.33.5",
                "bootstrap manifests: sync"
            ]
        );
    }

    #[test]
    fn a_stopped_run_resumes_after_what_the_cluster_shows_done() {
        let mut seen = cluster("v1.11.5", "v1.32.1");
        for n in &mut seen.nodes[..2] {
            n.components
                .get_mut(&Component::KubeApiserver)
                .unwrap()
                .version = Some("v1.33.5".into());
        }
        let p = decide(&seen, "v1.33.5", false);
        assert_eq!(p.from.as_deref(), Some("v1.32.1"), "the oldest API server");
        let left = described(&p);
        // Pre-pulls first (talosctl repeats them too), of what is left.
        assert_eq!(
            left[0],
            "cp-01: pre-pull registry.k8s.io/kube-controller-manager:v1.33.5, registry.k8s.io/kube-scheduler:v1.33.5, ghcr.io/siderolabs/kubelet:v1.33.5"
        );
        assert_eq!(left[5], "cp-03: kube-apiserver v1.32.1 → v1.33.5");
        assert_eq!(left.len(), 21);
    }

    const FLANNEL: &str = "apps/v1 DaemonSet kube-system/kube-flannel";

    fn sync_step(p: &KubePlan) -> &PlannedStep {
        p.steps.last().expect("a sync step")
    }

    #[test]
    fn talos_1_11_replaces_the_manifests_and_prunes_nothing() {
        // talos_managed.go before v1.13: manifests.SyncWithLog (create or PUT).
        let mut seen = cluster("v1.11.5", "v1.33.5");
        seen.prune = vec![FLANNEL.into()];
        let p = decide(&seen, "v1.33.5", false);
        assert_eq!(
            sync_step(&p).step,
            Step::SyncManifests {
                objects: vec!["apps/v1 DaemonSet kube-system/kube-proxy".into()],
                mode: SyncMode::Replace,
                prune: vec![],
            }
        );
    }

    #[test]
    fn talos_1_13_prunes_what_its_inventory_lists_and_it_no_longer_renders() {
        // talos_managed.go v1.13: syncManifestsSSA, NoPrune false by default.
        let mut seen = cluster("v1.13.5", "v1.33.5");
        seen.manifests[0].1 = ObjectState::InSync;
        seen.prune = vec![FLANNEL.into()];
        let p = decide(&seen, "v1.33.5", false);
        assert!(p.has_work(), "a prune left is work left");
        assert_eq!(
            described(&p),
            [format!("bootstrap manifests: sync; prune {FLANNEL}")]
        );
        assert!(matches!(
            &sync_step(&p).step,
            Step::SyncManifests { mode: SyncMode::Apply, prune, .. } if prune == &[FLANNEL.to_owned()]
        ));
        let json = serde_json::to_value(&p.steps).unwrap();
        assert_eq!(json.as_array().unwrap().last().unwrap()["mode"], "apply");
        // One node still on v1.12: talosctl takes the oldest, replaces,
        // and deletes nothing.
        seen.nodes[4].talos = Some("v1.12.9".into());
        let p = decide(&seen, "v1.33.5", false);
        assert!(matches!(
            &sync_step(&p).step,
            Step::SyncManifests { mode: SyncMode::Replace, prune, .. } if prune.is_empty()
        ));
        assert!(!p.has_work());
    }

    #[test]
    fn talos_1_14_refuses_an_object_of_another_inventory_and_names_unmarked_leftovers() {
        let mut seen = cluster("v1.14.0", "v1.33.5");
        seen.manifests[1].1 = ObjectState::Foreign;
        let r = decide(&seen, "v1.33.5", false).refusal.expect("refused");
        assert!(
            r.contains("belong to another inventory")
                && r.contains("apps/v1 Deployment kube-system/coredns"),
            "{r}"
        );
        seen.manifests[1].1 = ObjectState::InSync;
        seen.unmarked = vec![FLANNEL.into()];
        let p = decide(&seen, "v1.33.5", false);
        assert_eq!(p.refusal, None);
        assert!(
            p.notes
                .iter()
                .any(|n| n.starts_with("not pruned although") && n.contains(FLANNEL)),
            "{:?}",
            p.notes
        );
    }

    #[test]
    fn kube_proxy_steps_are_left_out_when_disabled() {
        let mut seen = cluster("v1.11.5", "v1.32.1");
        seen.proxy_disabled = true;
        assert!(
            !described(&decide(&seen, "v1.33.5", false))
                .iter()
                .any(|s| s.contains("kube-proxy v1"))
        );
    }

    #[test]
    fn an_unsupported_version_is_refused_naming_node_and_both_versions() {
        let p = decide(&cluster("v1.11.5", "v1.34.1"), "1.35.0", false);
        let r = p.refusal.unwrap();
        assert!(
            r.contains("node cp-01: Kubernetes v1.35.0 is too new for Talos v1.11.5"),
            "{r}"
        );
        assert!(p.steps.is_empty());
        let mut seen = cluster("v1.11.5", "v1.32.1");
        seen.nodes[3].talos = None;
        seen.nodes[3].error = Some("connection refused".into());
        let r = decide(&seen, "1.33.5", false).refusal.unwrap();
        assert!(
            r.contains("node w-01: its Talos version could not be read (connection refused)"),
            "{r}"
        );
    }

    #[test]
    fn skipping_a_minor_is_refused() {
        let r = decide(&cluster("v1.11.5", "v1.32.1"), "1.34.0", false)
            .refusal
            .unwrap();
        assert!(
            r.contains("set kubernetesVersion to a v1.33.x first"),
            "{r}"
        );
        let mut seen = cluster("v1.11.5", "v1.33.1");
        seen.nodes[4]
            .components
            .get_mut(&Component::Kubelet)
            .unwrap()
            .version = Some("v1.31.9".into());
        let r = decide(&seen, "1.33.5", false).refusal.unwrap();
        assert!(r.contains("kubelet on w-02 runs v1.31.9"), "{r}");
    }

    fn flowschemas() -> Requested {
        removed::parse_metric(
            "apiserver_requested_deprecated_apis{group=\"flowcontrol.apiserver.k8s.io\",removed_release=\"1.32\",resource=\"flowschemas\",subresource=\"\",version=\"v1beta3\"} 1",
        )
        .remove(0)
    }

    #[test]
    fn a_requested_removed_api_refuses_unless_skipped_and_says_so() {
        let mut seen = cluster("v1.11.5", "v1.31.4");
        seen.requested = vec![("cp-02".into(), flowschemas())];
        let p = decide(&seen, "1.32.9", false);
        let r = p.refusal.unwrap();
        assert!(
            r.contains("flowschemas.v1beta3.flowcontrol.apiserver.k8s.io (requested from cp-02, removed in 1.32)"),
            "{r}"
        );
        let p = decide(&seen, "1.32.9", true);
        assert_eq!(p.refusal, None);
        assert!(p.api_check_skipped);
        assert!(
            p.notes[0].starts_with("--skip-api-check: upgrading although"),
            "{:?}",
            p.notes
        );
        // Within a minor nothing is removed.
        let mut seen = cluster("v1.11.5", "v1.32.1");
        seen.requested = vec![("cp-02".into(), flowschemas())];
        assert_eq!(decide(&seen, "1.32.9", false).refusal, None);
    }

    #[test]
    fn an_unreadable_api_check_refuses_a_minor_move() {
        let mut seen = cluster("v1.11.5", "v1.32.1");
        seen.api_check_error = Some("GET /metrics: HTTP 403".into());
        let r = decide(&seen, "1.33.5", false).refusal.unwrap();
        assert!(r.contains("removed-API check could not read"), "{r}");
        assert_eq!(decide(&seen, "1.33.5", true).refusal, None);
        assert_eq!(decide(&seen, "1.32.4", false).refusal, None, "same minor");
    }

    #[test]
    fn configs_pin_each_component_and_keep_the_repository() {
        let mut pins = BTreeMap::new();
        for c in Component::ALL {
            pins.insert(c, "v1.32.1".to_owned());
        }
        pins.insert(Component::KubeApiserver, "v1.33.5".to_owned());
        let out = with_versions(CP_CONFIG.as_bytes(), &pins).unwrap();
        let imgs = images_of(&out);
        assert_eq!(
            imgs[&Component::KubeApiserver],
            "registry.k8s.io/kube-apiserver:v1.33.5"
        );
        assert_eq!(
            imgs[&Component::KubeScheduler],
            "registry.k8s.io/kube-scheduler:v1.32.1"
        );
        assert_eq!(
            imgs[&Component::KubeProxy],
            "mirror.local:5000/kube-proxy:v1.32.1"
        );
        assert_eq!(
            imgs[&Component::Kubelet],
            "ghcr.io/siderolabs/kubelet:v1.32.1"
        );
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.ends_with("---\napiVersion: v1alpha1\nkind: HostnameConfig\nhostname: cp-01\n"),
            "{text}"
        );
        assert!(!proxy_disabled(text.as_bytes()));
        assert!(proxy_disabled(b"cluster:\n  proxy:\n    disabled: true\n"));
    }

    #[test]
    fn images_are_retagged_and_read() {
        assert_eq!(
            retag("registry.k8s.io/kube-proxy:v1.32.1", "v1.33.5"),
            "registry.k8s.io/kube-proxy:v1.33.5"
        );
        assert_eq!(
            retag("host:5000/kube-proxy", "v1.33.5"),
            "host:5000/kube-proxy:v1.33.5"
        );
        assert_eq!(retag("k@sha256:ab", "v1"), "k@sha256:ab");
        assert_eq!(tag_of("host:5000/kube-proxy:v1.33.5"), Some("v1.33.5"));
        assert_eq!(tag_of("host:5000/kube-proxy"), None);
    }

    #[test]
    fn pins_fall_back_to_the_api_servers_version() {
        let mut n = node("w-01", false, "v1.11.5", "v1.32.1");
        n.components.get_mut(&Component::Kubelet).unwrap().version = None;
        let p = pins(&n, Some("v1.32.1"), "v1.33.5");
        assert_eq!(p[&Component::Kubelet], "v1.32.1");
        assert_eq!(pins(&n, None, "v1.33.5")[&Component::Kubelet], "v1.33.5");
    }
}
